"""The score steps of attention spelled out in ops (``spelled_attention``), each read exactly by
its op or raising ``Unread`` with the step named, and the helpers every step reads with:

- ``matmul(q, k^T)`` with k^T a transpose of k's last two dimensions (``transpose``, ``mT``,
  ``permute(0, 1, 3, 2)``), times or divided by a constant positive finite number;
- optionally soft-capped, FA2's ``softcap``: ``(s / cap).tanh() * cap`` (``torch.tanh`` or the
  method, the cap on either side of the product, ``s * (1 / cap)`` inside), the divisor and the
  multiplier one constant positive finite number of the graph;
- an additive mask added to it (``scores + mask``, either order), or a boolean mask filled in
  (``where(visible, scores, fill)``, ``scores.masked_fill(~visible, fill)``) with a fill that
  hides a key (-inf or the dtype's minimum).
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F

from ..graphs import describe, example_value
from ..proof.additive import is_fill
from .attention import call_number
from .base import Context

MATMULS = {
    ("call_function", torch.matmul),
    ("call_function", operator.matmul),
    ("call_method", "matmul"),
}
_CASTS = {"to", "float", "double", "half", "bfloat16", "type_as"}
_CAST_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}
_PRODUCTS = (operator.mul, torch.mul)
_QUOTIENTS = (operator.truediv, torch.div)
_TANHS = {("call_function", torch.tanh), ("call_function", F.tanh), ("call_method", "tanh")}
_SUMS = {("call_function", operator.add), ("call_function", torch.add)}


class Unread(Exception):
    """A step of the chain that is not read exactly: the reason names it."""


def key(node) -> tuple:
    return (node.op, node.target) if isinstance(node, torch.fx.Node) else ()


def bound(node: torch.fx.Node, context: Context) -> dict | None:
    """``node``'s arguments by name (``calls.read``)."""
    call = context.calls.read(node)
    return None if call is None else dict(call.arguments)


def first_input(node: torch.fx.Node, context: Context):
    arguments = bound(node, context)
    return None if arguments is None else next(iter(arguments.values()))


def cast_dtype(node, context: Context) -> torch.dtype | None:
    """The dtype a cast node casts to, where it is a plain dtype cast (no device, no copy)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_method" or node.target not in _CASTS:
        return None
    if node.target in _CAST_DTYPES:
        return _CAST_DTYPES[node.target] if not node.kwargs and len(node.args) == 1 else None
    value = example_value(node)
    source = example_value(node.args[0])
    if not (isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor)) or value.device != source.device:
        return None
    return value.dtype


def one_user(node: torch.fx.Node, user: torch.fx.Node, step: str, also=()) -> None:
    """``node`` is used by ``user`` alone (and the nodes in ``also``, which read it too)."""
    others = [u for u in node.users if u is not user and u not in also]
    if others:
        raise Unread(f"{step} {node.name} is also used by {', '.join(describe(u) for u in others)}")


def last_dim(dim, tensor: torch.Tensor) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, tensor.dim() - 1)


def single(dim):
    return dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim


def strip_casts(node, context: Context, nodes: list) -> torch.fx.Node:
    """``node`` before its dtype casts, each cast added to ``nodes`` (it must have one user)."""
    while isinstance(node, torch.fx.Node) and cast_dtype(node, context) is not None:
        nodes.append(node)
        source = node.args[0]
        if isinstance(source, torch.fx.Node):
            one_user(source, node, "the cast value")
        node = source
    return node


def positive_number(value) -> float | None:
    """``value`` as a Python float where it is a constant of the graph (a number, or a node
    whose value the graph pins: ``call_number``) that is positive and finite; else None."""
    if isinstance(value, bool):
        return None
    number = call_number(value)
    if number is None or isinstance(number, bool) or not (math.isfinite(number) and number > 0):
        return None
    return float(number)


def _shown(value) -> str:
    return describe(value) if isinstance(value, torch.fx.Node) else repr(value)


# -- the mask -----------------------------------------------------------------------------


class Masked(NamedTuple):
    scores: torch.fx.Node  # before the mask
    mask: torch.fx.Node | None  # the additive mask, or the boolean one filled in; None: no mask
    filled: bool  # a boolean mask filled in (where / masked_fill)
    fill: float | None = None  # the fill of a boolean mask filled in


def masked(logits: torch.fx.Node, context: Context, nodes: list) -> Masked:
    """The scores before the mask, and the mask."""
    if key(logits) in _SUMS:
        call = context.calls.read(logits)
        a, b = list(call.arguments.values())[:2]
        if call.arguments.get("alpha", 1) != 1:
            raise Unread(f"{logits.name} adds the mask times {call['alpha']}")
        scores, mask = (b, a) if is_scores(b) and not is_scores(a) else (a, b)
        if not (isinstance(mask, torch.fx.Node) and isinstance(example_value(mask), torch.Tensor)):
            raise Unread(f"{logits.name} adds {mask!r}, not a mask tensor")
        if not isinstance(scores, torch.fx.Node):
            raise Unread(f"{logits.name} adds the mask to {scores!r}, not to the scores")
        nodes.append(logits)
        one_user(scores, logits, "the scores")
        return Masked(scores, mask, False)
    filled = _filled_mask(logits, context)
    if filled is not None:
        scores, visible, fill = filled
        nodes.append(logits)
        one_user(scores, logits, "the scores")
        return Masked(scores, visible, True, fill)
    return Masked(logits, None, False)


def _filled_mask(node: torch.fx.Node, context: Context) -> tuple | None:
    """(scores, visible, fill) for ``where(visible, scores, fill)`` or ``scores.masked_fill(~visible,
    fill)`` with a fill that hides a key in the scores' dtype; None for anything else."""
    call = context.calls.read(node)
    if call is None:
        return None
    dtype = example_value(node).dtype
    if key(node) == ("call_function", torch.where) and len(call.arguments) >= 3:
        visible, scores, fill = call.first(3)
    elif node.op == "call_method" and node.target == "masked_fill":
        scores, hidden, fill = call["input"], call["mask"], call["value"]
        negations = {
            ("call_function", operator.invert),
            ("call_function", torch.logical_not),
            ("call_method", "logical_not"),
        }
        if key(hidden) not in negations:
            raise Unread(f"{node.name} fills where {describe(hidden)} holds: read only as masked_fill(~visible, fill)")
        visible = hidden.args[0]
    else:
        return None
    if not (isinstance(visible, torch.fx.Node) and example_value(visible).dtype == torch.bool):
        return None
    if not is_fill(fill, dtype):
        raise Unread(f"{node.name} fills hidden keys with {fill!r}, not -inf or the {dtype} minimum")
    return scores, visible, torch.full((), fill, dtype=dtype).item()


def is_scores(node) -> bool:
    """Whether ``node`` is a matmul, a matmul times or divided by something, or a soft-capped
    product (``tanh(...) * cap``): the scores, not the mask, of a sum."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target in (*_PRODUCTS, *_QUOTIENTS):
        return any(key(operand) in MATMULS or key(operand) in _TANHS for operand in node.args[:2])
    return key(node) in MATMULS


# -- soft-capping -------------------------------------------------------------------------


def softcapped(scores: torch.fx.Node, context: Context, nodes: list) -> tuple[torch.fx.Node, float]:
    """(the scores before the cap, the cap) of ``tanh(s / cap) * cap`` (either order of the
    product; ``s * (1 / cap)`` inside); (scores, 0.0) where ``scores`` is no product with a
    tanh. The cap must be one constant: a tanh whose divisor and multiplier differ, or a cap
    computed from data, is no FA2 softcap."""
    if scores.target not in _PRODUCTS:
        return scores, 0.0
    a, b = context.calls.read(scores).first(2)
    tanh, multiplier = (a, b) if key(a) in _TANHS else (b, a)
    if key(tanh) not in _TANHS:
        return scores, 0.0
    cap = positive_number(multiplier)
    if cap is None:
        raise Unread(
            f"{scores.name} multiplies tanh by {_shown(multiplier)}, not a constant positive finite number "
            "(a soft-cap computed from data?)"
        )
    inner = first_input(tanh, context)
    if not isinstance(inner, torch.fx.Node) or inner.target not in (*_PRODUCTS, *_QUOTIENTS):
        raise Unread(f"{tanh.name} is the tanh of {_shown(inner)}, not of the scores divided by the cap")
    call = context.calls.read(inner)
    capped, by = call.first(2)
    if inner.target in _QUOTIENTS and call.arguments.get("rounding_mode") is not None:
        raise Unread(f"{inner.name} divides with rounding")
    number = positive_number(by)
    divisor = None if number is None else (number if inner.target in _QUOTIENTS else 1.0 / number)
    if not isinstance(capped, torch.fx.Node) or divisor is None:
        raise Unread(
            f"{inner.name} scales {_shown(capped)} by {_shown(by)} inside the tanh: not the scores by a "
            "constant positive finite number"
        )
    if divisor != cap:
        raise Unread(f"soft-cap {scores.name}: tanh(s / {divisor}) * {cap}, a divisor and a multiplier that differ")
    one_user(tanh, scores, "the tanh")
    one_user(inner, tanh, "the scores divided by the cap")
    one_user(capped, inner, "the scores")
    nodes += [scores, tanh, inner]
    return capped, cap


# -- the scaled product -------------------------------------------------------------------


def scaled_product(scores: torch.fx.Node, context: Context, nodes: list) -> tuple:
    """(q, k, scale) of ``matmul(q, k^T) * c`` (or ``c *``, ``/ c``, or no scale)."""
    scale = 1.0
    if scores.target in (*_PRODUCTS, *_QUOTIENTS):
        a, b = context.calls.read(scores).first(2)
        product, constant = (a, b) if isinstance(a, torch.fx.Node) and key(a) in MATMULS else (b, a)
        if key(product) not in MATMULS:
            raise Unread(
                f"{scores.name} scales {_shown(a)} by {_shown(b)}, not matmul(q, k^T) by a number (biased scores?)"
            )
        if scores.target in _QUOTIENTS and product is not a:
            raise Unread(f"{scores.name} divides a number by the scores")
        number = positive_number(constant)
        if number is None:
            raise Unread(f"{scores.name} scales by {constant!r}, not a constant positive finite number")
        if scores.target in _QUOTIENTS and context.calls.read(scores).arguments.get("rounding_mode") is not None:
            raise Unread(f"{scores.name} divides with rounding")
        scale = 1.0 / number if scores.target in _QUOTIENTS else number
        nodes.append(scores)
        one_user(product, scores, "the scores")
        scores = product
    call = context.calls.read(scores) if key(scores) in _SUMS else None
    terms = call.first(2) if call is not None else ()
    if len(terms) == 2 and any(is_scores(term) for term in terms):
        bias = terms[1] if is_scores(terms[0]) else terms[0]
        raise Unread(f"{scores.name} adds {_shown(bias)} to the scores before the mask: a bias no FA2 window carries")
    if key(scores) not in MATMULS:
        raise Unread(f"{describe(scores)} where matmul(q, k^T) should be")
    query, transposed = list(bound(scores, context).values())[:2]
    nodes.append(scores)
    key_node = _untransposed(transposed, context)
    if key_node is None:
        raise Unread(f"{describe(transposed)} is not k with its last two dimensions swapped")
    one_user(transposed, scores, "k^T")
    nodes.append(transposed)
    return query, key_node, scale


_MT_OPS = (torch.ops.aten.mT, torch.ops.aten.mT.default)


def _untransposed(node, context: Context) -> torch.fx.Node | None:
    """k where ``node`` is k (4-D) with its last two dimensions swapped."""
    if not isinstance(node, torch.fx.Node):
        return None
    # ``k.mT``: a getattr, or aten's op where Dynamo traces it so (a checkpoint body on torch 2.14)
    attribute = node.op == "call_function" and node.target is getattr and node.args[1] == "mT"
    if attribute or (node.op == "call_function" and node.target in _MT_OPS and len(node.args) == 1 and not node.kwargs):
        source = node.args[0]
        value = example_value(source)
        return source if isinstance(value, torch.Tensor) and value.dim() == 4 else None
    if node.op != "call_method":
        return None
    call = context.calls.read(node)
    if (
        call is None
        or not isinstance(example_value(call["input"]), torch.Tensor)
        or example_value(call["input"]).dim() != 4
    ):
        return None
    if node.target in ("transpose", "swapaxes", "swapdims"):
        dims = {d % 4 for d in call.first(3)[1:] if isinstance(d, int)}
        return call["input"] if dims == {2, 3} else None
    if node.target == "permute" and [d % 4 for d in call["dims"]] == [0, 1, 3, 2]:
        return call["input"]
    return None
