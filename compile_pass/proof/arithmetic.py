"""Integer arithmetic for the proof engine (see ``engine.py`` for the invariant): positions
(``arange``), constant tensors, ``+ - *``, floor division, clamps and extrema exactly, sums by
their range, differences and running sums. Each handler is registered under every spelling
Dynamo records (``torch.f``, ``Tensor.f``, the Python operator), and reads every operand in the
dtype torch computes in (``computed_in``)."""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx
from torch.utils._sympy.functions import FloorDiv

from ..calls import Call
from ..graphs import describe
from .engine import (
    INTEGER_DTYPES,
    POS,
    TABLE,
    Formula,
    MaskEvaluator,
    Reject,
    Unknown,
    as_sympy,
    exact,
    fits,
    functions,
    methods,
    right_aligned,
    shape_of,
    tensor_meta,
)


@TABLE.handles(*functions(torch.arange))
def _arange(ev: MaskEvaluator, node: torch.fx.Node, call: Call) -> Formula:
    bounds = {name: as_sympy(call.arguments.get(name, default)) for name, default in (("start", 0), ("step", 1))}
    if any(bound is None for bound in bounds.values()) or as_sympy(call["end"]) is None:
        raise Reject("arange with non-integer bounds")
    return ev.formula(node, bounds["start"] + bounds["step"] * POS[0])


# Each op in its operator, torch function and Tensor method spellings (``spellings``).
_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}


def spellings(names, *, prefix: str):
    """Every target of each op in ``names``: ``operator.<name>``, ``.__<name>__()``,
    ``torch.<prefix><name>`` and ``.<prefix><name>()``."""
    targets = []
    for name in names:
        targets += functions(
            getattr(operator, f"{name}_" if name in ("and", "or") else name), getattr(torch, prefix + name)
        )
        targets += methods(f"__{name}__", prefix + name)
    return targets


def op_name(node: torch.fx.Node) -> str:
    """The op's name without its spelling: ``torch.logical_and``, ``.__and__()`` and ``&`` are
    all "and"."""
    name = node.target if node.op == "call_method" else node.target.__name__
    return name.strip("_").removeprefix("logical_").removeprefix("bitwise_")


def aligned_operands(ev: MaskEvaluator, node: torch.fx.Node, call: Call, *, want_bool: bool):
    """Both operands right-aligned to the result's dimensions, as (expression, formula or None
    for a Python scalar), each checked to be what torch computes with (``computed_in``)."""
    ndim = len(shape_of(node))
    operands, examples = [], []
    for value in call.first(2):
        operand = ev.operand(value)
        if isinstance(operand, Formula):
            if operand.is_bool != want_bool:
                raise Reject("mixes bool and integer operands")
            operands.append((right_aligned(operand, ndim), operand))
            examples.append(tensor_meta(value))
        elif want_bool:
            raise Reject("logic with a Python scalar")
        else:
            operands.append((operand, None))
            examples.append(0)  # an integer scalar: only its category takes part in promotion
    if not want_bool:
        try:
            computation = torch.result_type(*examples)
        except (RuntimeError, TypeError) as error:  # a wrapper type promotion does not read
            raise Reject(f"{describe(node)}: operand dtypes not understood ({error})") from error
        computed_in(ev, node, operands, computation)
    return operands


def computed_in(ev: MaskEvaluator, node: torch.fx.Node, operands, computation: torch.dtype) -> None:
    """torch converts each operand to ``computation`` (its type promotion: a 0-dim tensor or a
    scalar takes the other operand's dtype, an integer meets a float in the float): each must
    be held there exactly. A scalar that does not fit wraps (int32) or is refused (int64); an
    integer that a float does not hold rounds; a value known only modulo 2**bits stays so only
    in its own dtype."""
    name = str(computation).removeprefix("torch.")
    for expr, formula in operands:
        if formula is None:
            if not fits(ev._scalar_range(expr, node), computation):
                raise Reject(f"constant {expr} may not fit {name}")
        elif formula.wraps is not None:
            if formula.dtype != computation:
                exact(formula)  # raises with the place it may have wrapped
        elif not fits(ev.value_range(formula, node), computation):
            raise Reject(f"{describe(node)} computes in {name}, which may not hold its operand exactly")


def _arithmetic(ev, node, call):
    if call.arguments.get("alpha", 1) != 1:
        raise Reject(f"{describe(node)} with alpha")
    (a, fa), (b, fb) = aligned_operands(ev, node, call, want_bool=False)
    wraps = next((f.wraps for f in (fa, fb) if f is not None and f.wraps), None)
    return ev.formula(node, _ARITHMETIC[op_name(node)](a, b), wraps)


TABLE.handles(*spellings(_ARITHMETIC, prefix=""))(_arithmetic)


@TABLE.handles(
    *functions(operator.floordiv, torch.floor_divide, torch.div), *methods("__floordiv__", "floor_divide", "div")
)
def _floor_divide(ev, node, call):
    """Integer division rounding toward -inf (torch's ``//`` on integer tensors) by a positive
    integer constant: ``FloorDiv``, Python's ``//`` on every integer, negative ones included.
    ``div`` only with ``rounding_mode="floor"``; any other divisor or dtype is not proven."""
    if node.target in (torch.div, "div") and call.arguments.get("rounding_mode") != "floor":
        raise Reject(f"{describe(node)} without rounding_mode='floor'")
    dividend, divisor = call.first(2)
    formula = exact(ev.tensor(dividend))
    constant = as_sympy(divisor)
    if formula.is_bool or formula.dtype not in INTEGER_DTYPES:
        raise Reject(f"{describe(node)} of {formula.dtype}")
    if not (isinstance(constant, sympy.Integer) and constant > 0):
        shown = "a tensor" if isinstance(divisor, torch.fx.Node) and constant is None else repr(divisor)
        raise Reject(f"{describe(node)} by {shown}: only a positive integer constant is proven")
    if tensor_meta(node).dtype != formula.dtype:
        raise Reject(f"{describe(node)} changes the dtype")
    return ev.formula(node, FloorDiv(right_aligned(formula, len(shape_of(node))), constant))


@TABLE.handles(*functions(torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max))
@TABLE.handles(*methods("clamp", "clip", "clamp_min", "clamp_max"))
def _clamp(ev, node, call):
    """``clamp(x, lo, hi)`` is ``Min(Max(x, lo), hi)`` (torch gives hi where lo > hi); bounds
    must be integer constants or sizes, a missing one leaves that side open."""
    name = node.target if node.op == "call_method" else node.target.__name__
    formula = exact(ev.tensor(call["input"]))
    if formula.is_bool:
        raise Reject(f"{describe(node)} of a bool tensor")
    names = {"clamp_min": ("min",), "clamp_max": ("max",)}.get(name, ("min", "max"))
    bounds = {}
    for bound_name in names:
        value = call.arguments.get(bound_name)
        if value is None:
            continue
        bound = as_sympy(value)
        if bound is None:
            raise Reject(f"{describe(node)} with a bound that is not an integer constant")
        bounds[bound_name] = bound
    expr = right_aligned(formula, len(shape_of(node)))
    if "min" in bounds:
        expr = sympy.Max(expr, bounds["min"])
    if "max" in bounds:
        expr = sympy.Min(expr, bounds["max"])
    return ev.formula(node, expr)


@TABLE.handles(*functions(torch.maximum, torch.minimum, torch.max, torch.min), *methods("maximum", "minimum"))
def _extremum(ev, node, call):
    """Elementwise ``maximum(a, b)`` / ``minimum(a, b)`` of two integer tensors (``torch.max``
    and ``torch.min`` only in that two-tensor form; their reductions are not proven)."""
    name = node.target if node.op == "call_method" else node.target.__name__
    if name in ("max", "min") and not isinstance(call.arguments.get("other"), torch.fx.Node):
        raise Reject(f"{describe(node)} as a reduction")
    (a, fa), (b, fb) = aligned_operands(ev, node, call, want_bool=False)
    if fa is None or fb is None:
        raise Reject(f"{describe(node)} with a scalar")
    for formula in (fa, fb):
        exact(formula)
    return ev.formula(node, (sympy.Max if name in ("maximum", "max") else sympy.Min)(a, b))


@TABLE.handles(*functions(torch.sum), *methods("sum"))
def _sum(ev, node, call):
    """A sum is not computed as a formula, but the values it may take are: n terms, each in
    [low, high] (a bool counts 0 or 1), lie in [n * low, n * high]; the tensor is then opaque
    data with that range (a count of padding tokens, say)."""
    summand_node = call["input"]
    summand = exact(ev.tensor(summand_node))
    if tensor_meta(node).dtype not in INTEGER_DTYPES:
        raise Reject(f"{describe(node)} produces {tensor_meta(node).dtype}")
    each = (0, 1) if summand.is_bool else ev.value_range(summand, summand_node)
    dims = call.arguments.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    dims = dims or range(summand.ndim)  # no dim, or dim=[]: torch sums every element
    count = sympy.Mul(*(summand.shape[d] for d in dims)) if dims else sympy.Integer(1)
    terms = ev.value_range(Formula((), count, torch.int64), node)
    if each is None or terms is None:
        raise Reject(f"{describe(node)} of values without a known range")
    corners = [t * e for t in terms for e in each]
    total = (min(corners), max(corners))
    if not fits(total, tensor_meta(node).dtype):  # a sum that may wrap has no range to tell
        raise Reject(f"{describe(node)} may overflow {tensor_meta(node).dtype}")
    raise Unknown(f"{describe(node)} is a sum (only its range is known)", value_range=total)


@TABLE.handles(*functions(abs, operator.abs, torch.abs))
@TABLE.handles(*methods("abs"))
def _abs(ev, node, call):
    (value,) = call.first(1)
    formula = exact(ev.tensor(value))
    if formula.is_bool:
        raise Reject("abs of a non-integer tensor")
    return ev.formula(node, sympy.Abs(formula.expr))


@TABLE.handles(*functions(operator.neg, torch.neg, torch.negative), *methods("__neg__", "neg", "negative"))
def _negative(ev, node, call):
    """``-x`` of an integer tensor; the one value whose negation does not fit its dtype (the
    least) makes the result wrap, which ``ev.formula`` finds from the operand's range."""
    (value,) = call.first(1)
    formula = exact(ev.tensor(value))
    if formula.is_bool:
        raise Reject("negation of a bool tensor")
    return ev.formula(node, -formula.expr)


@TABLE.handles(*methods("new_ones", "new_zeros", "new_full"))
@TABLE.handles(*functions(torch.ones_like, torch.zeros_like, torch.full_like, torch.ones, torch.zeros, torch.full))
def _filled(ev, node, call):
    """Constant tensors; only their shape comes from the arguments, never a tensor's values."""
    name = node.target if node.op == "call_method" else node.target.__name__
    if "full" in name:
        value = call["fill_value"]
        if isinstance(value, torch.fx.Node) or not isinstance(value, (bool, int)):
            raise Reject(f"{describe(node)} with a fill value that is not a Python int")
    else:
        value = int("ones" in name)
    if tensor_meta(node).dtype == torch.bool:
        return ev.formula(node, sympy.true if value else sympy.false)
    return ev.formula(node, sympy.Integer(int(value)))


@TABLE.handles(*functions(torch.tensor))
def _literal(ev, node, call):
    """``torch.tensor(v)`` of one Python bool or int written in the program: a 0-dim constant
    (a mask function that returns ``torch.tensor(True)``, as a bidirectional model's OR does).
    Its data is read from the graph's arguments, never from a tensor."""
    data = node.args[0] if node.args else node.kwargs.get("data")
    if isinstance(data, torch.fx.Node) or type(data) not in (bool, int) or tensor_meta(node).ndim != 0:
        raise Reject(f"{describe(node)} of data that is not one Python int or bool")
    if tensor_meta(node).dtype == torch.bool:
        return ev.formula(node, sympy.true if data else sympy.false)
    if tensor_meta(node).dtype.is_floating_point:
        raise Reject(f"{describe(node)} of a floating dtype")
    return ev.formula(node, sympy.Integer(int(data)))


@TABLE.handles(*functions(torch.diff))
def _diff(ev, node, call):
    """d[k] = c[k + 1] - c[k] along ``dim`` where c = cat(prepend, x); only prepend of size 1."""
    if call["append"] is not None or call["n"] != 1:
        raise Reject("diff with n != 1 or append")
    formula = ev.tensor(call["input"])
    if call["prepend"] is None or formula.is_bool:
        raise Reject("diff without prepend")
    first = ev.tensor(call["prepend"])
    dim = call["dim"]
    dim = dim + formula.ndim if dim < 0 else dim
    if first.ndim != formula.ndim or first.shape[dim] != 1:
        raise Reject("diff with a prepend wider than one element")
    computed_in(ev, node, [(formula.expr, formula), (first.expr, first)], tensor_meta(node).dtype)
    at = POS[dim]
    previous = formula.expr.xreplace({at: at - 1})
    expr = sympy.Piecewise((formula.expr - first.expr, sympy.Eq(at, 0)), (formula.expr - previous, True))
    wraps = formula.wraps or first.wraps
    return ev.formula(node, sympy.piecewise_fold(sympy.simplify(expr)), wraps)


@TABLE.handles(*methods("cumsum"), *functions(torch.cumsum))
def _cumsum(ev, node, call):
    """Proven only for summands constant along ``dim``, where element k is (k + 1) * summand
    (packed-sequence ids are a lemma: ``lemmas.py``)."""
    summand_node, dim = call["input"], call["dim"]
    ndim = len(shape_of(node))
    at = POS[dim + ndim if dim < 0 else dim]
    summand = exact(ev.tensor(summand_node))
    expr = summand.expr
    if summand.is_bool:
        expr = (
            sympy.Integer(int(expr is sympy.true))
            if expr in (sympy.true, sympy.false)
            else sympy.Piecewise((1, expr), (0, True))
        )
    if at in expr.free_symbols:
        raise Reject("cumsum of values that vary along the summed dimension")
    return ev.formula(node, sympy.simplify((at + 1) * expr))
