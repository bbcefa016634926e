"""What torch's ops compute, for the proof engine: one handler per op, each registered under
every spelling Dynamo records (``torch.f``, ``Tensor.f``, the Python operator), each exact or
rejecting with a reason (see ``engine.py`` for the invariant)."""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch._functorch import predispatch
from torch.utils._sympy.functions import FloorDiv

from ..calls import Call
from ..graphs import describe
from .engine import (
    EVALUATED_DTYPES,
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
    moved,
    negative,
    nonnegative,
    provably,
    right_aligned,
    shape_env_of,
    shape_of,
    tensor_meta,
)


@TABLE.handles(*functions(torch.arange))
def _arange(ev: MaskEvaluator, node: torch.fx.Node, call: Call) -> Formula:
    bounds = {name: as_sympy(call.arguments.get(name, default)) for name, default in (("start", 0), ("step", 1))}
    if any(bound is None for bound in bounds.values()) or as_sympy(call["end"]) is None:
        raise Reject("arange with non-integer bounds")
    return ev.formula(node, bounds["start"] + bounds["step"] * POS[0])


# Each op in its operator, torch function and Tensor method spellings.
_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_COMPARISONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"and": sympy.And, "or": sympy.Or, "xor": sympy.Xor}


def _spellings(names, *, prefix: str):
    """Every target of each op in ``names``: ``operator.<name>``, ``.__<name>__()``,
    ``torch.<prefix><name>`` and ``.<prefix><name>()``."""
    targets = []
    for name in names:
        targets += functions(getattr(operator, f"{name}_" if name in ("and", "or") else name), getattr(torch, prefix + name))
        targets += methods(f"__{name}__", prefix + name)
    return targets


def _op_name(node: torch.fx.Node) -> str:
    """The op's name without its spelling: ``torch.logical_and``, ``.__and__()`` and ``&`` are
    all "and"."""
    name = node.target if node.op == "call_method" else node.target.__name__
    return name.strip("_").removeprefix("logical_").removeprefix("bitwise_")


def _aligned_operands(ev: MaskEvaluator, node: torch.fx.Node, call: Call, *, want_bool: bool):
    """Both operands right-aligned to the result's dimensions, as (expression, formula or None
    for a Python scalar), each checked to be what torch computes with (``_computed_in``)."""
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
        _computed_in(ev, node, operands, computation)
    return operands


def _computed_in(ev: MaskEvaluator, node: torch.fx.Node, operands, computation: torch.dtype) -> None:
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
    (a, fa), (b, fb) = _aligned_operands(ev, node, call, want_bool=False)
    wraps = next((f.wraps for f in (fa, fb) if f is not None and f.wraps), None)
    return ev.formula(node, _ARITHMETIC[_op_name(node)](a, b), wraps)


def _compare(ev, node, call):
    (a, fa), (b, fb) = _aligned_operands(ev, node, call, want_bool=False)
    for formula in (fa, fb):
        if formula is not None:
            exact(formula)
    return ev.formula(node, _without_extrema(_truth(_COMPARISONS[_op_name(node)](a, b))))


_ORDERS = {sympy.Lt: False, sympy.Le: False, sympy.Gt: True, sympy.Ge: True}  # True: "greater than"


def _without_extrema(relation: sympy.Basic) -> sympy.Basic:
    """An order relation over a Max or Min (a clamp) as logic over its arguments, which
    band.py reads: ``e < c`` is moved to ``e - c < 0``, a sum with one extremum is the extremum
    of the sums (``Max(a, b) + r = Max(a + r, b + r)``, ``-Max(a, b) = Min(-a, -b)``), then
    ``Max(a, b) < 0`` is ``a < 0 & b < 0`` and ``Max(a, b) > 0`` is ``a > 0 | b > 0`` (Min
    the other way round). Anything else is returned as it was."""
    if type(relation) not in _ORDERS or not relation.has(sympy.Max, sympy.Min):
        return relation
    difference = sympy.expand(relation.lhs - relation.rhs)
    extrema = [term for term in sympy.Add.make_args(difference) if term.has(sympy.Max, sympy.Min)]
    if len(extrema) != 1:
        return relation
    (term,) = extrema
    sign, extremum = (1, term) if isinstance(term, (sympy.Max, sympy.Min)) else (-1, -term)
    if not isinstance(extremum, (sympy.Max, sympy.Min)):
        return relation
    rest = difference - term
    greatest = isinstance(extremum, sympy.Max) == (sign == 1)  # sign * extremum is a Max
    parts = [sympy.expand(sign * arg + rest) for arg in extremum.args]
    greater = _ORDERS[type(relation)]
    joined = sympy.Or if greatest == greater else sympy.And
    return joined(*(_without_extrema(type(relation)(part, 0)) for part in parts))


def _truth(relation: sympy.Basic) -> sympy.Basic:
    """A relation between values defined by cases (``tril`` of ones, a cast bool) as logic over
    the cases' conditions: band.py reads conjunctions of bounds, not cases."""
    if not relation.has(sympy.Piecewise):
        return relation
    folded = sympy.piecewise_fold(relation)
    if not isinstance(folded, sympy.Piecewise):
        return folded
    earlier, cases = sympy.false, []
    for value, condition in folded.args:
        cases.append(sympy.And(condition, sympy.Not(earlier), _truth(value)))
        earlier = sympy.Or(earlier, condition)
    return sympy.Or(*cases)


def _logic(ev, node, call):
    """Logic on bool tensors only: on integers ``&`` is bitwise and ``logical_and`` tests != 0."""
    (a, _), (b, _) = _aligned_operands(ev, node, call, want_bool=True)
    return ev.formula(node, _LOGIC[_op_name(node)](a, b))


def _invert(ev, node, call):
    (value,) = call.first(1)
    formula = ev.tensor(value)
    if not formula.is_bool:
        raise Reject("~ on a non-bool tensor (bitwise not)")
    return ev.formula(node, sympy.Not(formula.expr))


TABLE.handles(*_spellings(_ARITHMETIC, prefix=""))(_arithmetic)
TABLE.handles(*_spellings(_COMPARISONS, prefix=""))(_compare)
TABLE.handles(*_spellings(_LOGIC, prefix="logical_"))(_logic)
TABLE.handles(
    *functions(operator.invert, torch.logical_not, torch.bitwise_not), *methods("logical_not", "bitwise_not", "__invert__")
)(_invert)


@TABLE.handles(*functions(operator.floordiv, torch.floor_divide, torch.div), *methods("__floordiv__", "floor_divide", "div"))
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
    (a, fa), (b, fb) = _aligned_operands(ev, node, call, want_bool=False)
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


@TABLE.handles(*methods("to", "bool", "int", "long", "float", "double", "half", "bfloat16"))
def _to(ev, node, call):
    """Device moves and same-dtype casts keep values; casts between integer and float dtypes
    keep them where the target holds them exactly (``formula`` checks); a number -> bool is
    ``value != 0``, a bool -> number 1 or 0."""
    formula = ev.tensor(call["input"])
    source, target = formula.dtype, tensor_meta(node).dtype
    if source == target:
        return formula
    if target not in EVALUATED_DTYPES:
        raise Reject(f".to() casts {source} to {target}")
    if target == torch.bool:
        return ev.formula(node, _truth(sympy.Ne(exact(formula).expr, 0)))
    if source == torch.bool:
        return ev.formula(node, sympy.Piecewise((1, formula.expr), (0, True)))
    return ev.formula(node, exact(formula).expr)  # formula checks the target holds every value


@TABLE.handles(*methods("clone", "contiguous"))
@TABLE.handles(*functions(torch.clone))
def _copy(ev, node, call):
    """Copies keep every value (a copy is its own memory: writes to either are checked on its own)."""
    return ev.tensor(call["input"])


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


@TABLE.handles(*methods("view", "reshape"))
@TABLE.handles(*functions(torch.reshape))
def _reshape(ev, node, call):
    """Reshapes that only add or drop size-1 dimensions: every element keeps its position
    along the other dimensions. Anything else would reorder elements: rejected."""
    if "dtype" in call.arguments:
        raise Reject(f"{describe(node)} reinterprets the dtype")
    formula = ev.tensor(call["input"])
    out_shape = shape_of(node)
    kept_in = [k for k, size in enumerate(formula.shape) if size != 1]
    kept_out = [k for k, size in enumerate(out_shape) if size != 1]
    if len(kept_in) != len(kept_out) or any(
        sympy.simplify(formula.shape[a] - out_shape[b]) != 0 for a, b in zip(kept_in, kept_out)
    ):
        raise Reject(f"{describe(node)} reshapes {formula.shape} to {out_shape}: more than adding or dropping size-1 dimensions")
    expr = formula.expr.xreplace({POS[a]: POS[b] for a, b in zip(kept_in, kept_out)})
    return ev.formula(node, expr, formula.wraps)


@TABLE.handles(*methods("transpose", "swapaxes", "permute", "t"))
@TABLE.handles(*functions(torch.transpose, torch.swapaxes, torch.permute, torch.t, getattr))
def _permute(ev, node, call):
    """Dimension permutations: output dimension k reads input dimension ``order[k]``."""
    formula = ev.tensor(call.first(1)[0])
    ndim = formula.ndim
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.target is getattr:
        name = call["name"]
    order = list(range(ndim))
    if name in ("transpose", "swapaxes"):
        first, second = (call[key] for key in (("dim0", "dim1") if "dim0" in call.arguments else ("axis0", "axis1")))
        first, second = (d + ndim if isinstance(d, int) and d < 0 else d for d in (first, second))
        if not (isinstance(first, int) and isinstance(second, int)):
            raise Reject(f"{describe(node)} of symbolic dimensions")
        order[first], order[second] = order[second], order[first]
    elif name == "permute":
        order = [d + ndim if d < 0 else d for d in call["dims"]]
    elif name in ("t", "T"):
        order = order[::-1]
    elif name == "mT" and ndim >= 2:
        order[-2], order[-1] = order[-1], order[-2]
    else:
        raise Reject(f"{describe(node)} not understood")
    if sorted(order) != list(range(ndim)):
        raise Reject(f"{describe(node)} is not a permutation")
    return ev.formula(node, formula.expr.xreplace({POS[order[k]]: POS[k] for k in range(ndim)}), formula.wraps)


@TABLE.handles(*functions(torch.where))
def _where(ev, node, call):
    """``where(c, a, b)``: a where c holds, else b; operands broadcast right-aligned."""
    if "condition" not in call.arguments or "input" not in call.arguments:
        raise Reject("where with one argument (nonzero)")
    ndim = len(shape_of(node))
    condition = ev.tensor(call["condition"])
    if not condition.is_bool:
        raise Reject("where with a non-bool condition")
    want_bool = tensor_meta(node).dtype == torch.bool
    branches = []
    for value in (call["input"], call["other"]):
        if isinstance(value, bool) and want_bool:
            branches.append(sympy.true if value else sympy.false)
            continue
        operand = ev.operand(value)
        if isinstance(operand, Formula):
            if operand.is_bool != want_bool:
                raise Reject("where mixes bool and integer values")
            branches.append(right_aligned(exact(operand), ndim))
        elif want_bool:
            raise Reject("where with an integer value for a bool result")
        else:
            branches.append(operand)
    chosen, other = branches
    when = right_aligned(condition, ndim)
    if want_bool:
        return ev.formula(node, sympy.Or(sympy.And(when, chosen), sympy.And(sympy.Not(when), other)))
    return ev.formula(node, sympy.Piecewise((chosen, when), (other, True)))


@TABLE.handles(*functions(predispatch._add_batch_dim))
def _add_batch_dim(ev, node, call):
    """vmap hides dimension ``batch_dim`` behind a level: the formula reads that dimension from
    the level's symbol, and the dimensions after it move down one."""
    formula = ev.tensor(call.first(1)[0])
    batch_dim, level = call["batch_dim"], call["level"]
    if not (isinstance(batch_dim, int) and isinstance(level, int)):
        raise Reject("vmap with a symbolic batch dimension or level")
    batch_dim = batch_dim + formula.ndim if batch_dim < 0 else batch_dim
    symbol = ev.level_symbol(level, formula.shape[batch_dim])
    moves = {POS[batch_dim]: symbol, **{POS[k]: POS[k - 1] for k in range(batch_dim + 1, formula.ndim)}}
    return ev.formula(node, formula.expr.xreplace(moves), formula.wraps)


@TABLE.handles(*functions(predispatch._remove_batch_dim))
def _remove_batch_dim(ev, node, call):
    """vmap's result: the level becomes dimension ``out_dim`` again, the dimensions from there
    on move up one. A formula that does not read the level is the same for every entry."""
    formula = ev.tensor(call.first(1)[0])
    level, size, out_dim = call["level"], as_sympy(call["batch_size"]), call["out_dim"]
    if not (isinstance(level, int) and isinstance(out_dim, int)) or size is None:
        raise Reject("vmap with a symbolic level or output dimension")
    out_dim = out_dim + formula.ndim + 1 if out_dim < 0 else out_dim
    symbol = ev.level_symbol(level, size)
    moves = {symbol: POS[out_dim], **{POS[k]: POS[k + 1] for k in range(out_dim, formula.ndim)}}
    expr = formula.expr.xreplace(moves)
    if expr.free_symbols & ev.level_symbols(level):
        raise Reject("vmap level of an unexpected size")
    return ev.formula(node, expr, formula.wraps)


@TABLE.handles(*methods("tril", "triu"))
@TABLE.handles(*functions(torch.tril, torch.triu))
def _triangle(ev, node, call):
    """``tril(d)`` keeps elements with column - row <= d, ``triu(d)`` those with column - row >= d;
    the others are 0 (False)."""
    formula = ev.tensor(call["input"])
    diagonal = call["diagonal"]
    if formula.ndim < 2 or not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise Reject(f"{describe(node)} of a vector or with a symbolic diagonal")
    row, column = POS[formula.ndim - 2], POS[formula.ndim - 1]
    name = node.target if node.op == "call_method" else node.target.__name__
    keep = sympy.Le(column - row, diagonal) if name == "tril" else sympy.Ge(column - row, diagonal)
    if formula.is_bool:
        return ev.formula(node, sympy.And(formula.expr, keep))
    return ev.formula(node, sympy.Piecewise((formula.expr, keep), (0, True)), formula.wraps)


@TABLE.handles(*methods("unsqueeze"))
def _unsqueeze(ev, node, call):
    formula = ev.tensor(call["input"])
    dim = call["dim"]
    if not isinstance(dim, int):
        raise Reject("unsqueeze at a symbolic dimension")
    dim = dim + formula.ndim + 1 if dim < 0 else dim
    positions = [k if k < dim else k + 1 for k in range(formula.ndim)]
    return ev.formula(node, moved(formula, positions), formula.wraps)


@TABLE.handles(*methods("expand"))
def _expand(ev, node, call):
    """Expanded dimensions had size 1, so the formula never read them; new ones lead."""
    formula = ev.tensor(call["input"])
    return ev.formula(node, right_aligned(formula, len(shape_of(node))), formula.wraps)


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
    _computed_in(ev, node, [(formula.expr, formula), (first.expr, first)], tensor_meta(node).dtype)
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
        expr = sympy.Integer(int(expr is sympy.true)) if expr in (sympy.true, sympy.false) else sympy.Piecewise((1, expr), (0, True))
    if at in expr.free_symbols:
        raise Reject("cumsum of values that vary along the summed dimension")
    return ev.formula(node, sympy.simplify((at + 1) * expr))


@TABLE.handles(*functions(torch.ops.aten.index, torch.ops.aten.index.Tensor))
def _aten_index(ev, node, call):
    """``aten.index(x, [i, j, ...])``: what ``x[i, j, ...]`` runs (transformers' vmap path
    turns indexing into it); None entries keep a dimension whole."""
    base = ev.tensor(call["input"])
    indices = tuple(slice(None) if entry is None else entry for entry in call["indices"])
    return _index(ev, node, base, indices)


@TABLE.handles(*functions(operator.getitem))
def _getitem(ev, node, call):
    base_node, index = call.first(2)
    base = ev.tensor(base_node)
    return _index(ev, node, base, index if isinstance(index, tuple) else (index,))


def _index(ev: MaskEvaluator, node, base: Formula, index: tuple) -> Formula:
    """Basic indexing (slices, None, Ellipsis, ints), or slices and None around one run
    of adjacent tensor indices (gathers)."""
    consuming = sum(1 for entry in index if entry is not None and entry is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (base.ndim - consuming) + index[at + 1 :]
    index = index + (slice(None),) * (base.ndim - sum(1 for entry in index if entry is not None))
    tensor_at = [k for k, entry in enumerate(index) if isinstance(entry, torch.fx.Node) and as_sympy(entry) is None]
    if tensor_at and tensor_at != list(range(tensor_at[0], tensor_at[-1] + 1)):
        raise Reject("indexing with non-adjacent tensor indices")
    if tensor_at and any(as_sympy(entry) is not None for entry in index):
        raise Reject("indexing with both ints and tensors")
    out_shape = shape_of(node)
    shape_env = shape_env_of(node)
    # Result dimensions made by the gather: all but those from slices and None.
    gathered_ndim = len(out_shape) - sum(1 for e in index if e is None or isinstance(e, slice))
    replacements: dict[sympy.Symbol, sympy.Basic] = {}
    base_dim = out_dim = 0
    for k, entry in enumerate(index):
        size = base.shape[base_dim] if base_dim < base.ndim else None
        if entry is None:
            out_dim += 1
            continue
        if isinstance(entry, slice):
            start, step = _slice_start_step(entry, size, shape_env)
            replacements[POS[base_dim]] = start + step * POS[out_dim]
            out_dim += 1
        elif k in tensor_at:
            if k == tensor_at[0]:
                gather_start = out_dim
                out_dim += gathered_ndim
            positions = exact(ev.tensor(entry))
            if positions.is_bool:
                raise Reject("indexing with a bool mask")
            # Index tensors broadcast right-aligned inside the gathered block.
            offset = gather_start + gathered_ndim - positions.ndim
            expr = moved(positions, [offset + d for d in range(positions.ndim)])
            extents = {**ev.level_extents(), **dict(zip(POS, out_shape))}
            _require_in_range(expr, extents, size, shape_env, ev.deferred_ends)
            replacements[POS[base_dim]] = expr
        else:
            replacements[POS[base_dim]] = _int_index(entry, size, shape_env)
        base_dim += 1
    return ev.formula(node, base.expr.xreplace(replacements), base.wraps)


def _int_index(entry: Any, size: sympy.Expr, shape_env=None) -> sympy.Expr:
    """An int index as the position it reads: -1 is the last; a sign that cannot be told is
    rejected (the position it reads would depend on it)."""
    position = as_sympy(entry)
    if position is None:
        raise Reject(f"index {entry!r} not understood")
    if nonnegative(position, shape_env):
        return position
    if negative(position, shape_env):
        return position + size
    raise Reject(f"index {position} may be negative or not")


def _slice_start_step(entry: slice, size: sympy.Expr, shape_env=None):
    """A slice's first position and step. A negative start counts from the end and must stay
    inside the tensor (torch clamps it to 0 otherwise); one of unknown sign is rejected."""
    step = as_sympy(entry.step) if entry.step is not None else sympy.Integer(1)
    start = as_sympy(entry.start) if entry.start is not None else sympy.Integer(0)
    if step is None or start is None or not provably(step > 0):
        raise Reject("slice with a non-integer or negative step")
    if nonnegative(start, shape_env):
        return start, step
    if negative(start, shape_env) and nonnegative(start + size, shape_env):
        return start + size, step
    raise Reject(f"slice start {start} may be clamped or counted from the end")


def _require_in_range(
    expr: sympy.Expr, extents: dict[sympy.Symbol, sympy.Expr], size: sympy.Expr, shape_env=None,
    deferred_ends: list | None = None,
) -> None:
    """Tensor indices must be provably in [0, size): negative ones would wrap around, and ones
    past the end raise (where the rewrite stops computing the mask, the error would be lost).
    With ``deferred_ends`` an end not proven here is recorded there, as ``size - 1 - largest``,
    for the caller to prove (``MaskEvaluator.deferring_index_ends``).
    ``extents`` bounds each position symbol (the result's dimensions, vmap's levels)."""
    low = high = expr
    for symbol, extent in extents.items():
        if symbol in expr.free_symbols:
            coefficient = sympy.diff(expr, symbol)
            if coefficient.free_symbols & set(extents):
                raise Reject("index arithmetic is not affine")
            if nonnegative(coefficient):
                smallest, largest = sympy.Integer(0), extent - 1
            elif nonnegative(-coefficient):
                smallest, largest = extent - 1, sympy.Integer(0)
            else:
                raise Reject("index slope of unknown sign")
            low = low.xreplace({symbol: smallest})
            high = high.xreplace({symbol: largest})
    if (low.free_symbols | high.free_symbols) & set(extents):
        raise Reject("index arithmetic is not affine")
    if not nonnegative(low, shape_env):
        raise Reject("index not provably in range")
    if not nonnegative(size - 1 - high, shape_env):
        if deferred_ends is None:
            raise Reject("index not provably in range")
        deferred_ends.append(size - 1 - high)
