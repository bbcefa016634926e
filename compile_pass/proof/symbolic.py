"""Symbolic evaluation of index-arithmetic subgraphs: FX nodes in, exact formulas out.

Each tensor in a mask's construction is evaluated to a ``Formula``: its shape (sympy
expressions, symbolic where the graph's sizes are) and one sympy expression giving the
element at position (p0, p1, ...) in terms of *position symbols* ``POS[k]``, one per
dimension. ``arange(n) + 3`` is ``POS[0] + 3`` with shape ``(n,)``; ``x[None, :]`` moves
``POS[0]`` to ``POS[1]``; ``a <= b`` is a sympy relational; ``&`` is ``sympy.And``.

The invariant, kept by every handler: substituting an in-bounds position into the
formula gives exactly the tensor's element. Handlers therefore accept only what they
can evaluate exactly: integer and boolean dtypes (no float rounding), indices proven
in range (no negative wrap-around), and a small set of ops. Everything else evaluates
to ``Unproven`` with a reason. Sizes come from the FakeTensors Dynamo records in
``node.meta["example_value"]``; nothing here reads tensor data, guards on a size or
trusts a size hint.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx

MAX_DIMS = 8
POS = tuple(sympy.Symbol(f"_p{k}", integer=True, nonnegative=True) for k in range(MAX_DIMS))
# Position arithmetic is exact in these (values are sequence positions and offsets, far
# inside the int32 range); narrower integer dtypes could wrap and are not proven.
INTEGER_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Formula:
    shape: tuple[sympy.Expr, ...]
    expr: sympy.Basic  # integer expression, or boolean for bool tensors
    is_bool: bool

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Unproven:
    reason: str


class _Reject(Exception):
    """Raised inside handlers; becomes Unproven(reason)."""


def as_sympy(value: Any) -> sympy.Expr | None:
    """A Python int or SymInt (or an FX node producing one) as a sympy expression."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("example_value")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def _meta(node: torch.fx.Node) -> torch.Tensor:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        raise _Reject(f"{node.name} has no tensor metadata")
    return value


def _shape_of(node: torch.fx.Node) -> tuple[sympy.Expr, ...]:
    return tuple(as_sympy(size) for size in _meta(node).shape)


def _pin_unit_dims(shape, expr):
    """Size-1 dimensions have one position, 0: make the formula say so (broadcasting relies on it)."""
    unit = {POS[k]: sympy.Integer(0) for k, size in enumerate(shape) if size == 1}
    return expr.xreplace(unit) if unit else expr


def _make(shape, expr, is_bool) -> Formula:
    if len(shape) > MAX_DIMS:
        raise _Reject(f"more than {MAX_DIMS} dimensions")
    return Formula(tuple(shape), _pin_unit_dims(shape, sympy.sympify(expr)), is_bool)


def _moved(formula: Formula, new_positions: list[int]) -> sympy.Basic:
    """The formula with dimension k read from position symbol new_positions[k]."""
    return formula.expr.xreplace({POS[k]: POS[new] for k, new in enumerate(new_positions)})


def _right_aligned(formula: Formula, ndim: int) -> sympy.Basic:
    shift = ndim - formula.ndim
    return _moved(formula, [k + shift for k in range(formula.ndim)])


def provably(condition) -> bool:
    """True only when sympy proves the condition for every value of the size symbols."""
    return bool(condition is sympy.true or condition is True)


def _nonnegative(expr: sympy.Expr) -> bool:
    return sympy.simplify(expr).is_nonnegative is True


class MaskEvaluator:
    """Evaluates nodes to Formula or Unproven, memoised per node.

    ``resolve_placeholder(node)`` maps a placeholder of a subgraph (an
    activation-checkpoint body) to the operand node of the parent graph, or None
    for a true graph input.
    """

    def __init__(self, resolve_placeholder: Callable[[torch.fx.Node], torch.fx.Node | None] = lambda n: None):
        self._resolve = resolve_placeholder
        self._memo: dict[torch.fx.Node, Formula | Unproven] = {}
        # Graph inputs met so far, by the name of the sympy function standing for their data,
        # and packed-sequence ids (cumsum nodes) by the name of theirs.
        self.inputs: dict[str, torch.fx.Node] = {}
        self.segments: dict[str, torch.fx.Node] = {}

    def evaluate(self, node: torch.fx.Node) -> Formula | Unproven:
        if node not in self._memo:
            try:
                self._memo[node] = self._evaluate(node)
            except _Reject as reject:
                self._memo[node] = Unproven(str(reject))
        return self._memo[node]

    def visited(self) -> list[torch.fx.Node]:
        """Every node evaluated so far (the mask's construction, for dead-code removal)."""
        return list(self._memo)

    # -- dispatch ----------------------------------------------------------------

    def _input(self, node: torch.fx.Node) -> Formula:
        """A graph input's data is unknown: an uninterpreted function of its positions, so
        sympy can only apply identities that hold whatever the data (x(p) == x(p), ...)."""
        meta = _meta(node)
        if meta.dtype not in INTEGER_DTYPES + (torch.bool,):
            raise _Reject(f"depends on input {_input_name(node)} ({meta.dtype})")
        name = input_function_name(node)
        self.inputs[name] = node
        data = sympy.Function(name)(*POS[: meta.dim()])
        is_bool = meta.dtype == torch.bool
        return _make(_shape_of(node), sympy.Ne(data, 0) if is_bool else data, is_bool=is_bool)

    def _arg(self, value: Any) -> Formula | sympy.Expr:
        """A tensor operand as a Formula, or a scalar operand as a sympy number."""
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("example_value"), torch.Tensor):
            result = self.evaluate(value)
            if isinstance(result, Unproven):
                raise _Reject(result.reason)
            return result
        scalar = as_sympy(value)
        if scalar is None:
            raise _Reject(f"operand {value!r} is not an integer")
        return scalar

    def _evaluate(self, node: torch.fx.Node) -> Formula:
        if node.op == "placeholder":
            parent = self._resolve(node)
            if parent is None:
                return self._input(node)
            return self._arg(parent)
        if node.op == "get_attr":
            raise _Reject(f"depends on stored tensor {node.target}")
        if mutated_in_place(node):
            raise _Reject(f"{node.name} is modified in place")
        meta = _meta(node)
        if meta.dtype not in INTEGER_DTYPES + (torch.bool,):
            raise _Reject(f"{_op_name(node)} produces {meta.dtype}; only int64, int32 and bool index arithmetic is proven")
        handler = _HANDLERS.get((node.op, node.target))
        if handler is None:
            raise _Reject(f"op {_op_name(node)} not understood")
        return handler(self, node)


# Users that may return the same storage: a mutation through them mutates the node.
_ALIASING_METHODS = {
    "view", "view_as", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "transpose",
    "permute", "t", "flatten", "unflatten", "narrow", "select", "as_strided", "to", "contiguous",
    "detach", "type_as", "unbind", "split", "chunk",
}
_IN_PLACE_OPERATORS = {
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.ifloordiv, operator.imod,
}


def _mutates(user: torch.fx.Node, tensor: torch.fx.Node) -> bool:
    """Whether ``user`` may write into ``tensor``'s storage."""
    if user.op == "call_method":
        return user.args[0] is tensor and user.target.endswith("_") and not user.target.startswith("_")
    if user.op != "call_function":
        return False
    if user.target in _IN_PLACE_OPERATORS:
        return user.args[0] is tensor
    schema = getattr(user.target, "_schema", None)
    return "out" in user.kwargs or (schema is not None and schema.is_mutable)


def _may_alias(user: torch.fx.Node) -> bool:
    if user.op == "call_function":
        return user.target is operator.getitem
    return user.op == "call_method" and user.target in _ALIASING_METHODS


def mutated_in_place(node: torch.fx.Node) -> bool:
    """A formula describes a tensor as defined; reject tensors written afterwards, directly
    or through a view (``mask[:, 0] = True``, ``positions.add_(1)``)."""
    pending, seen = [node], {node}
    while pending:
        tensor = pending.pop()
        for user in tensor.users:
            if _mutates(user, tensor):
                return True
            if _may_alias(user) and user not in seen:
                seen.add(user)
                pending.append(user)
    return False


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def input_function_name(node: torch.fx.Node) -> str:
    return f"input:{_input_name(node)}"


def _input_name(node: torch.fx.Node) -> str:
    """Dynamo names inputs like L_kwargs_attention_mask_; report the user's name."""
    name = str(node.target)
    for prefix in ("L_kwargs_", "L_", "l_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.rstrip("_") or str(node.target)


# -- handlers --------------------------------------------------------------------

_HANDLERS: dict[tuple[str, Any], Callable[[MaskEvaluator, torch.fx.Node], Formula]] = {}


def _handles(op: str, *targets):
    def register(fn):
        for target in targets:
            _HANDLERS[(op, target)] = fn
        return fn

    return register


@_handles("call_function", torch.arange)
def _arange(ev: MaskEvaluator, node: torch.fx.Node) -> Formula:
    if "dtype" in node.kwargs and node.kwargs["dtype"] not in INTEGER_DTYPES:
        raise _Reject("arange with a non-integer dtype")
    bounds = [as_sympy(a) for a in node.args]
    if any(b is None for b in bounds) or not 1 <= len(bounds) <= 3:
        raise _Reject("arange with non-integer bounds")
    start, step = (bounds[0], bounds[2] if len(bounds) == 3 else sympy.Integer(1)) if len(bounds) > 1 else (0, 1)
    return _make(_shape_of(node), start + step * POS[0], is_bool=False)


_ARITHMETIC = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul}
_COMPARISONS = {
    operator.lt: sympy.Lt,
    operator.le: sympy.Le,
    operator.gt: sympy.Gt,
    operator.ge: sympy.Ge,
    operator.eq: sympy.Eq,
    operator.ne: sympy.Ne,
}
_LOGIC = {operator.and_: sympy.And, operator.or_: sympy.Or}


def _broadcast(ev: MaskEvaluator, node: torch.fx.Node):
    """Both operands right-aligned to the result's dimensions."""
    ndim = len(_shape_of(node))
    operands = []
    for arg in node.args[:2]:
        value = ev._arg(arg)
        operands.append(value if not isinstance(value, Formula) else (value, _right_aligned(value, ndim)))
    return operands


def _operand_exprs(operands, *, want_bool: bool):
    exprs = []
    for operand in operands:
        if isinstance(operand, tuple):
            formula, expr = operand
            if formula.is_bool != want_bool:
                raise _Reject("mixes bool and integer operands")
            exprs.append(expr)
        else:
            if want_bool:
                raise _Reject("logic with a Python scalar")
            exprs.append(operand)
    return exprs


@_handles("call_function", *_ARITHMETIC)
def _arithmetic(ev, node):
    a, b = _operand_exprs(_broadcast(ev, node), want_bool=False)
    return _make(_shape_of(node), _ARITHMETIC[node.target](a, b), is_bool=False)


@_handles("call_function", *_COMPARISONS)
def _compare(ev, node):
    a, b = _operand_exprs(_broadcast(ev, node), want_bool=False)
    return _make(_shape_of(node), _COMPARISONS[node.target](a, b), is_bool=True)


@_handles("call_function", *_LOGIC)
def _logic(ev, node):
    a, b = _operand_exprs(_broadcast(ev, node), want_bool=True)
    return _make(_shape_of(node), _LOGIC[node.target](a, b), is_bool=True)


@_handles("call_function", operator.invert)
@_handles("call_method", "logical_not")
def _invert(ev, node):
    (value,) = [ev._arg(node.args[0])]
    if not isinstance(value, Formula) or not value.is_bool:
        raise _Reject("~ on a non-bool tensor (bitwise not)")
    return _make(_shape_of(node), sympy.Not(value.expr), is_bool=True)


@_handles("call_function", abs, operator.abs, torch.abs)
@_handles("call_method", "abs")
def _abs(ev, node):
    value = ev._arg(node.args[0])
    if not isinstance(value, Formula) or value.is_bool:
        raise _Reject("abs of a non-integer tensor")
    return _make(_shape_of(node), sympy.Abs(value.expr), is_bool=False)


@_handles("call_method", "to")
def _to(ev, node):
    """Device moves and same-dtype casts keep values, and so does int32 -> int64;
    integer -> bool is ``value != 0``."""
    value = ev._arg(node.args[0])
    source, target = _meta(node.args[0]).dtype, _meta(node).dtype
    if source != torch.bool and target == torch.bool:
        return _make(_shape_of(node), sympy.Ne(value.expr, 0), is_bool=True)
    if source != target and (source, target) != (torch.int32, torch.int64):
        raise _Reject(f".to() casts {source} to {target}")
    return value


@_handles("call_method", "new_ones", "new_zeros")
@_handles("call_function", torch.ones_like, torch.zeros_like)
def _filled(ev, node):
    """Constant tensors; only their shape comes from the argument, never its values."""
    is_bool = _meta(node).dtype == torch.bool
    one = node.target in ("new_ones", torch.ones_like)
    expr = (sympy.true if one else sympy.false) if is_bool else sympy.Integer(int(one))
    return _make(_shape_of(node), expr, is_bool=is_bool)


@_handles("call_method", "unsqueeze")
def _unsqueeze(ev, node):
    value = ev._arg(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    dim = dim + value.ndim + 1 if dim < 0 else dim
    positions = [k if k < dim else k + 1 for k in range(value.ndim)]
    return _make(_shape_of(node), _moved(value, positions), value.is_bool)


@_handles("call_method", "expand")
def _expand(ev, node):
    """Expanded dimensions had size 1, so the formula never read them; new ones lead."""
    value = ev._arg(node.args[0])
    shape = _shape_of(node)
    return _make(shape, _right_aligned(value, len(shape)), value.is_bool)


@_handles("call_function", torch.diff)
def _diff(ev, node):
    """d[k] = c[k + 1] - c[k] along ``dim`` where c = cat(prepend, x); only prepend of size 1."""
    if node.kwargs.get("append") is not None or node.kwargs.get("n", 1) != 1 or len(node.args) > 1:
        raise _Reject("diff with n != 1, append or positional options")
    value = ev._arg(node.args[0])
    prepend = node.kwargs.get("prepend")
    if prepend is None or value.is_bool:
        raise _Reject("diff without prepend")
    first = ev._arg(prepend)
    dim = node.kwargs.get("dim", -1)
    dim = dim + value.ndim if dim < 0 else dim
    if first.ndim != value.ndim or first.shape[dim] != 1:
        raise _Reject("diff with a prepend wider than one element")
    at = POS[dim]
    previous = value.expr.xreplace({at: at - 1})
    expr = sympy.Piecewise((value.expr - first.expr, sympy.Eq(at, 0)), (value.expr - previous, True))
    return _make(_shape_of(node), sympy.piecewise_fold(sympy.simplify(expr)), is_bool=False)


SEGMENTS_PREFIX = "segments:"


def _segment_source(ev: MaskEvaluator, node: torch.fx.Node, dim: int) -> str | None:
    """The input P when ``node`` is ``cumsum(diff(P, prepend=P[..., :1] - 1) != 1)`` along
    ``dim`` = P's last dimension: packed-sequence ids, which start a new segment wherever a
    position does not follow its predecessor (transformers' find_packed_sequence_indices)."""
    starts = node.args[0]
    if not (starts.op == "call_function" and starts.target is operator.ne and starts.args[1] == 1):
        return None
    difference = starts.args[0]
    if not (isinstance(difference, torch.fx.Node) and difference.target is torch.diff):
        return None
    positions, first = difference.args[0], difference.kwargs.get("prepend")
    if difference.kwargs.get("dim", -1) not in (-1, dim) or first is None:
        return None
    values, before = ev._arg(positions), ev._arg(first)
    if not isinstance(values, Formula) or not isinstance(values.expr, sympy.core.function.AppliedUndef):
        return None
    if values.ndim != dim + 1 or values.expr.args != POS[: values.ndim]:
        return None
    # prepend must be P at position 0 of dim, minus 1: the first token never starts a new segment.
    if sympy.simplify(before.expr - (values.expr.xreplace({POS[dim]: sympy.Integer(0)}) - 1)) != 0:
        return None
    return values.expr.func.__name__


@_handles("call_method", "cumsum")
def _cumsum(ev, node):
    """Packed-sequence ids become a function ``segments:P`` of their positions (band.py knows
    what they imply); any other cumsum is proven only for summands constant along ``dim``,
    where element k is (k + 1) * summand."""
    value = ev._arg(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    dim = dim + value.ndim if dim < 0 else dim
    source = _segment_source(ev, node, dim)
    if source is not None and source.startswith("input:"):
        name = SEGMENTS_PREFIX + source
        ev.segments[name] = node
        return _make(_shape_of(node), sympy.Function(name)(*POS[: value.ndim]), is_bool=False)
    at = POS[dim]
    summand = value.expr
    if value.is_bool:
        summand = sympy.Piecewise((1, summand), (0, True)) if summand not in (sympy.true, sympy.false) else int(
            summand is sympy.true
        )
        summand = sympy.sympify(summand)
    if at in summand.free_symbols:
        raise _Reject("cumsum of values that vary along the summed dimension")
    return _make(_shape_of(node), sympy.simplify((at + 1) * summand), is_bool=False)


@_handles("call_function", operator.getitem)
def _getitem(ev, node):
    base = ev._arg(node.args[0])
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return _index(ev, node, base, index)


def _index(ev: MaskEvaluator, node, base: Formula, index: tuple) -> Formula:
    """Basic indexing (slices, None, Ellipsis, ints), or slices and None around one run
    of adjacent tensor indices (gathers)."""
    consuming = sum(1 for entry in index if entry is not None and entry is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (base.ndim - consuming) + index[at + 1 :]
    index = index + (slice(None),) * (base.ndim - sum(1 for entry in index if entry is not None))
    tensor_at = [k for k, entry in enumerate(index) if isinstance(entry, torch.fx.Node)]
    if tensor_at and tensor_at != list(range(tensor_at[0], tensor_at[-1] + 1)):
        raise _Reject("indexing with non-adjacent tensor indices")
    if tensor_at and any(as_sympy(entry) is not None for entry in index):
        raise _Reject("indexing with both ints and tensors")
    out_shape = _shape_of(node)
    # Result dimensions made by the gather: all but those from slices and None.
    gathered_ndim = len(out_shape) - sum(1 for e in index if e is None or isinstance(e, slice))
    replacements: dict[sympy.Symbol, sympy.Basic] = {}
    base_dim = out_dim = 0
    for k, entry in enumerate(index):
        if entry is None:
            out_dim += 1
            continue
        if isinstance(entry, slice):
            start, step = _slice_start_step(entry, base.shape[base_dim])
            replacements[POS[base_dim]] = start + step * POS[out_dim]
            out_dim += 1
        elif isinstance(entry, torch.fx.Node):
            if k == tensor_at[0]:
                gather_start = out_dim
                out_dim += gathered_ndim
            positions = ev._arg(entry)
            if not isinstance(positions, Formula) or positions.is_bool:
                raise _Reject("indexing with a bool mask or non-integer tensor")
            # Index tensors broadcast right-aligned inside the gathered block.
            offset = gather_start + gathered_ndim - positions.ndim
            expr = _moved(positions, [offset + d for d in range(positions.ndim)])
            _require_in_range(expr, out_shape, base.shape[base_dim])
            replacements[POS[base_dim]] = expr
        else:
            position = as_sympy(entry)
            if position is None:
                raise _Reject(f"index {entry!r} not understood")
            replacements[POS[base_dim]] = position if _nonnegative(position) else position + base.shape[base_dim]
        base_dim += 1
    return _make(out_shape, base.expr.xreplace(replacements), base.is_bool)


def _slice_start_step(entry: slice, size: sympy.Expr):
    step = as_sympy(entry.step) if entry.step is not None else sympy.Integer(1)
    start = as_sympy(entry.start) if entry.start is not None else sympy.Integer(0)
    if step is None or start is None or not provably(step > 0):
        raise _Reject("slice with a non-integer or negative step")
    if not _nonnegative(start):
        start = start + size
        if not _nonnegative(start):
            raise _Reject("slice start may be clamped")
    return start, step


def _require_in_range(expr: sympy.Expr, out_shape, size: sympy.Expr) -> None:
    """Tensor indices must be provably in [0, size): negative ones would wrap around."""
    low = high = expr
    for k, extent in enumerate(out_shape):
        if POS[k] in expr.free_symbols:
            coefficient = sympy.diff(expr, POS[k])
            if coefficient.free_symbols & set(POS):
                raise _Reject("index arithmetic is not affine")
            if _nonnegative(coefficient):
                smallest, largest = sympy.Integer(0), extent - 1
            elif _nonnegative(-coefficient):
                smallest, largest = extent - 1, sympy.Integer(0)
            else:
                raise _Reject("index slope of unknown sign")
            low = low.xreplace({POS[k]: smallest})
            high = high.xreplace({POS[k]: largest})
    if low.free_symbols & set(POS) or high.free_symbols & set(POS):
        raise _Reject("index arithmetic is not affine")
    if not (_nonnegative(low) and _nonnegative(size - 1 - high)):
        raise _Reject("index not provably in range")
