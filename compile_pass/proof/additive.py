"""Additive float masks that are a boolean mask in disguise: 0 where a key is visible, and
one fill value (-inf, or the dtype's most negative finite value for float32, bfloat16 and
float64) where it is not.

SDPA adds a float mask to the scores. Where every query row keeps at least one visible key,
a score plus the fill underflows to exactly 0 after the softmax, and a score plus 0 (or -0.0)
is the score: the attention equals the boolean mask's. Rows with no visible key differ (the
finite fill gives them a uniform average), which the rules exclude by requiring a band with
no padding and Sq <= Sk.

The forms recognised, each read by its signature, with ``c`` a proven boolean tensor:
- ``torch.where(c, 0, fill)`` and ``torch.where(c, fill, 0)``;
- ``zeros.masked_fill(c, fill)`` for a tensor of zeros (``zeros``, ``zeros_like``, ``new_zeros``,
  ``full(..., 0)``);
- ``c.to(dtype) * fill`` or ``fill * c.to(dtype)`` (also ``.float()``, ...), finite fills only
  (0 * -inf is NaN);
- ``full(fill).triu(d)`` and ``full(fill).tril(d)``;
- any of these cast to another float dtype (``.to(q.dtype)``, ``.float()``, ...) where the
  cast keeps the fill a fill, or copied (``contiguous``, ``clone``, ``detach``, a cast to its
  own dtype: ``views.copied``), which keeps every value.

A mask that adds a bias (values from the model's parameters: a relative-position bias, a
per-key gate) is no boolean mask whatever op the reader stops at: where the reader fails, the
reason names the bias instead (``AdditiveMasks.bias``). That changes a reason only.
"""

from __future__ import annotations

import math
import operator

import sympy
import torch
import torch.fx

from ..calls import CallReader
from ..graphs import describe, example_value
from .engine import POS, Formula, MaskEvaluator, Unproven, input_name, located, right_aligned, shape_of
from .views import CASTS, copied

_ZERO_FACTORIES = {"zeros", "zeros_like", "new_zeros"}


def _stored(value, dtype: torch.dtype) -> float | None:
    """A Python number as a ``dtype`` tensor stores it; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return torch.full((), value, dtype=dtype).item()
    except (RuntimeError, OverflowError):
        return None


# A finite fill hides a key only while scores stay far from it: softmax sees score + fill.
# The minimum of float32, bfloat16 and float64 (about -3.4e38 or below) is beyond any score
# short of overflow; float16's, -65504, is within reach of real scores (SDPA scores in fp32),
# so a float16 mask must fill with -inf.
_FINITE_FILL_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def is_fill(value, dtype: torch.dtype, *, finite: bool = False) -> bool:
    stored = _stored(value, dtype)
    if stored is None:
        return False
    if stored == float("-inf"):
        return not finite
    return dtype in _FINITE_FILL_DTYPES and stored == torch.finfo(dtype).min


def hidden_alike_below(fill: float, dtypes) -> float | None:
    """How large a score may be for ``score + fill`` to round to the fill itself in each of
    ``dtypes`` (those the sum and the softmax may compute in): a quarter of the fill's spacing
    there, the least over them. A row whose keys are all filled then has equal logits, so its
    softmax is uniform (``ops/keyless_rows.py``). None where the fill is not finite in one of
    them (float32's minimum is -inf in bfloat16): such a row's logits are all -inf, its softmax NaN."""
    bounds = []
    for dtype in dtypes:
        stored = _stored(fill, dtype)
        if stored is None or not math.isfinite(stored):
            return None
        value = torch.tensor(stored, dtype=dtype)
        spacing = (value - torch.nextafter(value, torch.zeros((), dtype=dtype))).abs().item()
        bounds.append(spacing / 4)
    return min(bounds) if bounds else None


def _is_float(value) -> bool:
    return (
        isinstance(value, torch.fx.Node)
        and isinstance(example_value(value), torch.Tensor)
        and example_value(value).is_floating_point()
    )


def _is_parameter(node: torch.fx.Node) -> bool:
    """A module's parameter, as Dynamo passes it to the graph (its fake value is one)."""
    return isinstance(example_value(node), torch.nn.Parameter)


def _filled(visible: Formula | Unproven, fill: float) -> tuple[Formula, float] | Unproven:
    return visible if isinstance(visible, Unproven) else (visible, fill)


def _name(node: torch.fx.Node) -> str:
    return node.target if node.op == "call_method" else getattr(node.target, "__name__", "")


def _is_zeros(node, dtype: torch.dtype, calls: CallReader) -> bool:
    """A tensor of zeros made by a factory (its values come from no other tensor)."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    name, call = _name(node), calls.read(node)
    if call is None:
        return False
    if name in _ZERO_FACTORIES:
        return True
    return name in ("full", "full_like", "new_full") and _stored(call["fill_value"], dtype) == 0


# Ops whose result holds their operands' values, moved, copied, selected, joined or added to
# another's: a bias behind one reaches the mask. The first kind holds the first operand's
# values only (the others give a shape, a dtype, indices or a condition).
_HOLD_FIRST = {
    "contiguous",
    "clone",
    "detach",
    "alias",
    "to",
    "to_copy",
    "type_as",
    "float",
    "double",
    "half",
    "bfloat16",
    "view",
    "reshape",
    "expand",
    "expand_as",
    "getitem",
    "getattr",
    "unsqueeze",
    "squeeze",
    "transpose",
    "swapaxes",
    "permute",
    "t",
    "flatten",
    "unflatten",
    "narrow",
    "select",
    "repeat",
    "repeat_interleave",
    "tile",
    "movedim",
    "index",
    "tril",
    "triu",
    "neg",
}
_HOLD_ALL = {"where", "masked_fill", "add", "sub", "cat", "concat", "concatenate", "stack"}
_SCALED = {"mul", "div", "truediv"}  # scaled by a Python number, the values stay the tensor's
# Factories: a tensor operand gives them a shape, dtype or device, never values (a fill made
# with a parameter's dtype is no bias).
_FACTORIES = {
    "full",
    "full_like",
    "new_full",
    "zeros",
    "zeros_like",
    "new_zeros",
    "ones",
    "ones_like",
    "new_ones",
    "empty",
    "empty_like",
    "new_empty",
    "rand_like",
    "randn_like",
}


def _value_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose values ``node``'s may be computed from: none for a factory."""
    if node.op in ("call_function", "call_method") and _name(node).split(".")[0].strip("_") in _FACTORIES:
        return []
    return node.all_input_nodes


def _held(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The operands whose values ``node``'s result holds, or None for an op that computes new
    ones (a spelling-blind name: ``torch.add``, ``.__add__()`` and ``aten.add.Tensor`` alike);
    none for a graph's input."""
    if node.op not in ("call_function", "call_method"):
        return []
    name = _name(node).split(".")[0].strip("_")
    if name in _HOLD_FIRST:
        first = node.args[0] if node.args else node.kwargs.get("input")
        return [first] if isinstance(first, torch.fx.Node) else []
    if name in _HOLD_ALL:
        return node.all_input_nodes
    operands = node.args[:2]
    if name in _SCALED and any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in operands):
        return [a for a in operands if isinstance(a, torch.fx.Node)]
    return None


class AdditiveMasks:
    """Reads float masks as the boolean masks of their visible keys, through a MaskEvaluator."""

    def __init__(self, evaluator: MaskEvaluator):
        self.evaluator = evaluator

    def visible(self, node: torch.fx.Node) -> Formula | Unproven:
        """The bool formula of the keys ``node`` leaves visible (adds 0 to), or why it is not
        a 0 / fill mask: the bias it adds, where it adds one."""
        read = self._read(node)
        if not isinstance(read, Unproven):
            return read[0]
        bias = self.bias(node)
        if bias is None:
            return read
        values = (
            f"the parameter {input_name(bias)}"
            if _is_parameter(bias)
            else (f"computed from the model's parameters by {describe(bias)}{located(bias)}")
        )
        return Unproven(f"adds a bias (values other than 0 and the fill: {values}): no FA2 window carries it")

    def fill(self, node: torch.fx.Node) -> float | None:
        """The fill of a 0 / fill mask as stored (-inf, or the dtype's minimum); None where
        ``node`` is not read as one."""
        read = self._read(node)
        return None if isinstance(read, Unproven) else read[1]

    def _read(self, node: torch.fx.Node) -> tuple[Formula, float] | Unproven:
        """(the visible-key formula, the fill as stored) of a 0 / fill mask, or why not."""
        mask = example_value(node)
        if not (isinstance(mask, torch.Tensor) and mask.is_floating_point()):
            return Unproven("is not a float mask")
        source = self.evaluator.source_of(node)
        if source is not node:  # an activation-checkpoint body's input: the mask its caller passed
            writer = self.evaluator.writes.writer(node)
            return Unproven(writer) if writer is not None else self._read(source)
        call = self.evaluator.calls.read(node) if node.op in ("call_function", "call_method") else None
        if call is None:
            return Unproven(
                f"float mask from {describe(node) if node.op != 'placeholder' else 'a graph input'} not understood"
            )
        writer = self.evaluator.writes.writer(node)
        if writer is not None:
            return Unproven(writer)
        self.evaluator.note_visited(node)
        name, dtype = _name(node), mask.dtype
        same = copied(node, call)
        if same is not None:
            return self._read(same)
        if name == "where" and "other" in call.arguments:
            chosen, other = call["input"], call["other"]
            if self._is_zero(chosen, dtype) and is_fill(other, dtype):
                return _filled(self._condition(node, call["condition"], negate=False), _stored(other, dtype))
            if is_fill(chosen, dtype) and self._is_zero(other, dtype):
                return _filled(self._condition(node, call["condition"], negate=True), _stored(chosen, dtype))
            return Unproven("where with values other than 0 and the fill")
        if name == "masked_fill":
            if not is_fill(call["value"], dtype):
                return Unproven(f"masked_fill with {call['value']!r}, not -inf or the {dtype} minimum")
            if not self._is_zero(call["input"], dtype):
                return Unproven("masked_fill of a tensor not proven all zeros")
            return _filled(self._condition(node, call["mask"], negate=True), _stored(call["value"], dtype))
        if node.op == "call_function" and node.target is operator.mul:
            first, second = list(call.arguments.values())[:2]
            cast, fill = (first, second) if isinstance(first, torch.fx.Node) else (second, first)
            if not is_fill(fill, dtype, finite=True):
                return Unproven("product with a factor other than a finite fill")
            source = self._cast_source(cast)
            if source is None:
                return Unproven("product of a float tensor that is not a cast bool")
            return _filled(self._condition(node, source, negate=True), _stored(fill, dtype))
        if (node.op, node.target) in CASTS and _is_float(call["input"]):
            # A cast keeps 0; the fill must stay a fill (float32's minimum is -inf in float16,
            # which hides a key as well; bfloat16's is a finite float32 that is no fill).
            read = self._read(call["input"])
            if isinstance(read, Unproven):
                return read
            visible, fill = read
            cast = torch.full((), fill, dtype=example_value(call["input"]).dtype).to(dtype).item()
            if not is_fill(cast, dtype):
                return Unproven(f"cast {describe(node)} to {dtype} turns the fill {fill} into {cast}, no fill")
            return visible, cast
        if name in ("triu", "tril") and isinstance(call["diagonal"], int):
            filled = call["input"]
            filled_call = self._factory(filled)
            if filled_call is None or _name(filled) != "full" or not is_fill(filled_call["fill_value"], dtype):
                return Unproven(f"{name} of a tensor not proven filled with -inf or the minimum")
            shape = shape_of(node)
            row, column = POS[len(shape) - 2], POS[len(shape) - 1]
            offset = column - row
            # triu(d) keeps the fill where column - row >= d: visible below that.
            diagonal = call["diagonal"]
            visible = sympy.Lt(offset, diagonal) if name == "triu" else sympy.Gt(offset, diagonal)
            return Formula(shape, visible, torch.bool), _stored(filled_call["fill_value"], dtype)
        return Unproven(f"float mask op {describe(node)} not understood")

    def bias(self, node: torch.fx.Node) -> torch.fx.Node | None:
        """A learned bias whose values reach ``node``'s through ops that hold their operands'
        values (``_held``): a parameter, or the first op found that computes values from
        parameters. None where there is none: the values come from constants, bool or integer
        tensors, or the caller (a graph input may be a 0 / fill mask: no bias is known)."""

        def learned(current: torch.fx.Node) -> bool:
            if _is_parameter(current):
                return True
            computed = _held(current) is None
            return computed and self._search(_value_operands(current), _is_parameter, _value_operands) is not None

        return self._search([node], learned, lambda current: _held(current) or [])

    def _search(self, starts, found, follow) -> torch.fx.Node | None:
        """The first float tensor found (``found(node)``) from ``starts`` back through
        ``follow(node)``, depth first (an index or a condition is no value computed with); a
        checkpoint body's input is its caller's operand. None where there is none."""
        seen, stack = set(), list(reversed(starts))
        while stack:
            current = self.evaluator.source_of(stack.pop())
            if current in seen or not _is_float(current):
                continue
            seen.add(current)
            if found(current):
                return current
            stack.extend(reversed(follow(current)))
        return None

    def _factory(self, node):
        """The call that made ``node``, read by its signature, when ``node`` is a call whose
        result nothing writes afterwards (the one way this module reads an operand's values
        from its call); None otherwise."""
        if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
            return None
        call = self.evaluator.calls.read(node)
        if call is None or self.evaluator.writes.writer(node) is not None:
            return None
        self.evaluator.note_visited(node)
        return call

    def _is_zero(self, value, dtype: torch.dtype) -> bool:
        """A Python 0, or a tensor of zeros from a factory that nothing writes."""
        if not isinstance(value, torch.fx.Node):
            return _stored(value, dtype) == 0
        return _is_zeros(value, dtype, self.evaluator.calls) and self._factory(value) is not None

    def _cast_source(self, node) -> torch.fx.Node | None:
        """The bool tensor ``node`` casts to a float dtype, if it is such a cast."""
        if not (isinstance(node, torch.fx.Node) and (node.op, node.target) in CASTS):
            return None
        call = self._factory(node)
        source = call["input"] if call is not None else None
        if not (isinstance(example_value(source), torch.Tensor) and example_value(source).dtype == torch.bool):
            return None
        return source

    def _condition(self, node: torch.fx.Node, condition, *, negate: bool) -> Formula | Unproven:
        """The visible-key formula at ``node``'s shape from the bool ``condition`` (negated when
        the condition marks the filled keys)."""
        if not isinstance(condition, torch.fx.Node):
            return Unproven("mask condition is not a tensor")
        formula = self.evaluator.evaluate(condition)
        if isinstance(formula, Unproven):
            return formula
        if not formula.is_bool:
            return Unproven("mask condition is not boolean")
        shape = shape_of(node)
        expr = right_aligned(formula, len(shape))
        return Formula(shape, sympy.Not(expr) if negate else expr, torch.bool)
