"""Layouts and indexing for the proof engine (see ``engine.py`` for the invariant): copies,
reshapes that add or drop size-1 dimensions, permutations, ``unsqueeze``/``expand``, vmap's
batch dimensions, and indexing (basic, and gathers by tensor indices proven in range): each
moves position symbols, never values."""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch._functorch import predispatch

from ..graphs import describe, example_value
from .engine import (
    POS,
    TABLE,
    Formula,
    MaskEvaluator,
    Reject,
    as_sympy,
    exact,
    functions,
    methods,
    moved,
    negative,
    nonnegative,
    provably,
    right_aligned,
    shape_env_of,
    shape_of,
)


def _aten(name: str) -> list:
    """An aten op under each spelling a graph may call it by: the packet and its overloads,
    less those that write into an ``out`` argument."""
    packet = getattr(torch.ops.aten, name)
    return [packet, *(getattr(packet, overload) for overload in packet.overloads() if "out" not in overload)]


# Ops that return their operand's values in its dtype, as a copy (its own memory) or as the
# operand itself (an alias of it); either way a write to one is found by the aliasing analysis,
# which the proof asks of every node it reads.
COPIES = [
    *methods("clone", "contiguous", "detach"),
    *functions(
        torch.clone, torch.detach, *(op for name in ("clone", "contiguous", "detach", "alias") for op in _aten(name))
    ),
]
# Casts: values kept where the target dtype holds them; to the operand's own dtype, a copy.
CASTS = [
    *methods("to", "type_as", "bool", "int", "long", "float", "double", "half", "bfloat16"),
    *functions(*_aten("to"), *_aten("_to_copy")),
]


def copied(node: torch.fx.Node, call) -> torch.fx.Node | None:
    """The tensor whose values ``node`` returns unchanged and in the same dtype (the operand of
    a copy, or of a cast to its own dtype); None for any other node."""
    target = (node.op, node.target)
    if call is None or (target not in COPIES and target not in CASTS):
        return None
    operand = call.arguments.get("input")
    value, result = example_value(operand), example_value(node)
    if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)) or value.dtype != result.dtype:
        return None
    return operand


@TABLE.handles(*COPIES)
def _copy(ev, node, call):
    """Copies keep every value (a copy is its own memory: writes to either are checked on its own)."""
    return ev.tensor(call["input"])


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
        sympy.simplify(formula.shape[a] - out_shape[b]) != 0 for a, b in zip(kept_in, kept_out, strict=True)
    ):
        raise Reject(
            f"{describe(node)} reshapes {formula.shape} to {out_shape}: more than adding or dropping size-1 dimensions"
        )
    expr = formula.expr.xreplace({POS[a]: POS[b] for a, b in zip(kept_in, kept_out, strict=True)})
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
            # POS names MAX_DIMS positions; the result's dims take the first len(out_shape).
            extents = {**ev.level_extents(), **dict(zip(POS, out_shape, strict=False))}
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
    expr: sympy.Expr,
    extents: dict[sympy.Symbol, sympy.Expr],
    size: sympy.Expr,
    shape_env=None,
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
