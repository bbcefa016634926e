"""Attention sinks spelled out in ops (``spelled_attention``), in the two spellings models use,
each read exactly or raising ``Unread`` with the step named. Both are the algebra of the op's
sinks (``ops/sinks.py``): with L a row's logsumexp over its keys and O plain attention, the
output is ``sigmoid(L - sink) * O``.

- A column concatenated last (GPT-OSS; per row: Inkling2's): ``cat([scores, column], -1)``,
  softmax, the last column sliced off (``[..., :-1]``). The column is a (heads,) tensor viewed
  as (1, H, 1, 1) (``reshape``/``view``, or ``s[None, :, None, None]``) and expanded over batch
  and rows, or a (batch, heads, rows) tensor unsqueezed on the key axis (``s.unsqueeze(-1)``,
  ``s[..., None]``): one logit per (batch, head, row).
- The logsumexp scaling (Granite-SWA's): ``lse = logsumexp(w, -1)``,
  ``c = sigmoid(lse - s)`` (cast to float32 or not, ``torch.sigmoid`` or the method), with s
  a (heads,) tensor viewed as (1, H, 1) (``view``/``reshape``, ``s[None, :, None]``) or a
  (batch, heads, rows) tensor, then ``(softmax(w) @ v) * c.unsqueeze(-1)`` (``c[..., None]``,
  cast or not, either order of the product). w must be the very tensor the softmax reads:
  the masked scores.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx
import torch.nn.functional as F

from ..graphs import describe, example_value
from ..sizes import same_size
from .base import Context
from .spelled_steps import Unread, cast_dtype, key, last_dim, one_user, single

# probs[..., :-1] and its spellings with the leading dimensions written out.
ALL_BUT_LAST = (
    (Ellipsis, slice(None, -1, None)),
    (slice(None), slice(None), slice(None), slice(None, -1, None)),
)
# s[None, :, None, None]: a (heads,) tensor as (1, heads, 1, 1); s[None, :, None]: as (1, heads, 1).
_HEADS_AT_1 = ((None, slice(None), None, None),)
_HEADS_AT_1_OF_3 = ((None, slice(None), None),)
# s[..., None] and s[:, :, :, None]: one more dimension last.
_LAST_AXIS_ADDED = ((Ellipsis, None), (slice(None), slice(None), slice(None), None))
_SIGMOIDS = {("call_function", torch.sigmoid), ("call_function", F.sigmoid), ("call_method", "sigmoid")}
_LOGSUMEXPS = {("call_function", torch.logsumexp), ("call_method", "logsumexp")}


def _is_call(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _shapes_agree(shape, expected) -> bool:
    return len(shape) == len(expected) and all(same_size(a, b) for a, b in zip(shape, expected, strict=True))


def sink_column(column: torch.fx.Node, scores: torch.Tensor, context: Context) -> tuple[torch.fx.Node, list]:
    """(the op's sinks, the column's own nodes): a (heads,) tensor whose element h is the sink
    of every row of head h, expanded; or a (batch, heads, rows) tensor, one more dimension
    added last."""
    batch, heads, rows = scores.shape[:3]
    if _is_call(column, "unsqueeze") or (column.target is operator.getitem and column.args[1] in _LAST_AXIS_ADDED):
        source = column.args[0]
        added = column.args[1] if _is_call(column, "unsqueeze") else -1
        value = example_value(source) if isinstance(source, torch.fx.Node) else None
        if not (
            isinstance(value, torch.Tensor)
            and added in (-1, 3)
            and _shapes_agree(value.shape, (batch, heads, rows))
            and _shapes_agree(example_value(column).shape, (batch, heads, rows, 1))
        ):
            raise Unread(
                f"the sink column {column.name} adds a dimension to {_shown_shape(source)}: not one logit per "
                "(batch, head, row) on the key axis"
            )
        return source, [column]
    if not _is_call(column, "expand"):
        raise Unread(
            f"the sink column {column.name} is neither a per-head tensor expanded over batch and rows nor a "
            "(batch, heads, rows) tensor unsqueezed"
        )
    viewed = context.calls.read(column)["input"]
    reshaped = _is_call(viewed, "reshape") or _is_call(viewed, "view")
    indexed = isinstance(viewed, torch.fx.Node) and viewed.target is operator.getitem and viewed.args[1] in _HEADS_AT_1
    if not (reshaped or indexed):
        raise Unread(
            f"the sink column {column.name} expands {describe(viewed)}, "
            "not a (heads,) tensor viewed as (1, heads, 1, 1)"
        )
    source = viewed.args[0] if indexed else context.calls.read(viewed)["input"]
    per_head, view, expanded = (example_value(x).shape for x in (source, viewed, column))
    if not (
        _shapes_agree(per_head, (heads,))
        and _shapes_agree(view, (1, heads, 1, 1))
        and _shapes_agree(expanded, (batch, heads, rows, 1))
    ):
        raise Unread(
            f"the sink column {column.name} is {tuple(expanded)} from {tuple(per_head)}: not one logit per query head"
        )
    one_user(viewed, column, "the sink view")
    return source, [column, viewed]


def _shown_shape(node) -> str:
    value = example_value(node) if isinstance(node, torch.fx.Node) else None
    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    text = describe(node) if isinstance(node, torch.fx.Node) else repr(node)
    return f"{text} {shape}"


class LseScaling(NamedTuple):
    """The logsumexp scaling of ``matmul(P, v)``'s result: the product that ends the chain, the
    scores the logsumexp reads, the logsumexp node itself, the sinks as the op takes them, and
    the nodes of the scaling."""

    product: torch.fx.Node
    scores: torch.fx.Node
    logsumexp: torch.fx.Node
    sinks: torch.fx.Node
    nodes: tuple


def lse_scaling(matmul: torch.fx.Node, context: Context) -> LseScaling | None:
    """The scaling of ``matmul``'s result by sigmoid(logsumexp(w) - sink); None where its one
    user multiplies it by nothing computed from a logsumexp (no sinks of this spelling)."""
    users = list(matmul.users)
    if len(users) != 1 or users[0].target not in (operator.mul, torch.mul):
        return None
    product = users[0]
    a, b = context.calls.read(product).first(2)
    factor = b if a is matmul else a
    if not (isinstance(factor, torch.fx.Node) and _reads_a_logsumexp(factor)):
        return None
    if a is b:
        raise Unread(f"{product.name} squares the attention")
    scaled, attention = example_value(product), example_value(matmul)
    if scaled.dtype != attention.dtype or not _shapes_agree(scaled.shape, attention.shape):
        raise Unread(
            f"{product.name} is {scaled.dtype} {tuple(scaled.shape)}, the attention it scales "
            f"{attention.dtype} {tuple(attention.shape)}: the scale is no (batch, heads, rows) factor in its dtype"
        )
    nodes = [product]
    out_dtype = example_value(product).dtype
    current = _through_casts(factor, context, nodes, "the sink scaling", (torch.float32, out_dtype))
    if not (_is_call(current, "unsqueeze") and current.args[1:] in ((-1,), (3,))) and not (
        current.target is operator.getitem and current.args[1] in _LAST_AXIS_ADDED
    ):
        raise Unread(
            f"{product.name} multiplies the attention by {describe(current)}, "
            "not a (batch, heads, rows) scale unsqueezed"
        )
    one_user(current, nodes[-1], "the sink scaling")
    nodes.append(current)
    sigmoid = _through_casts(current.args[0], context, nodes, "the sink scaling", (torch.float32,))
    if key(sigmoid) not in _SIGMOIDS:
        raise Unread(f"the attention is scaled by {describe(sigmoid)}, not a sigmoid of the logsumexp minus a sink")
    one_user(sigmoid, nodes[-1], "the sink scaling")
    nodes.append(sigmoid)
    difference = _through_casts(
        context.calls.read(sigmoid).first(1)[0], context, nodes, "the sigmoid's input", (torch.float32,)
    )
    if (
        difference.target not in (operator.sub, torch.sub)
        or context.calls.read(difference).arguments.get("alpha", 1) != 1
    ):
        raise Unread(f"the sigmoid {sigmoid.name} is of {describe(difference)}, not of the logsumexp minus a sink")
    one_user(difference, nodes[-1], "the sigmoid's input")
    nodes.append(difference)
    lse, sink = context.calls.read(difference).first(2)
    if key(sink) in _LOGSUMEXPS:
        raise Unread(
            f"{difference.name} subtracts the logsumexp from {_shown_shape(lse)}: the sink is not subtracted from it"
        )
    if key(lse) not in _LOGSUMEXPS:
        raise Unread(
            f"{difference.name} subtracts from {describe(lse) if isinstance(lse, torch.fx.Node) else lse!r}, "
            "not from the logsumexp: the sink is not subtracted from it"
        )
    lse_call = context.calls.read(lse)
    scores = lse_call["input"]
    if not (last_dim(single(lse_call["dim"]), example_value(scores)) and lse_call.arguments.get("keepdim") is False):
        raise Unread(f"logsumexp {lse.name} is over dim {lse_call['dim']}, not the key axis (without keepdim)")
    one_user(lse, difference, "the logsumexp")
    nodes.append(lse)
    sinks, sink_nodes = _sink_rows(sink, example_value(scores), context)
    for node in sink_nodes:
        one_user(node, difference, "the sink view")
    return LseScaling(product, scores, lse, sinks, tuple(nodes + sink_nodes))


def _reads_a_logsumexp(node: torch.fx.Node) -> bool:
    """Whether a logsumexp is among the few ops ``node`` is computed from."""
    stack, seen = [node], set()
    while stack and len(seen) < 32:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if key(current) in _LOGSUMEXPS:
            return True
        if current.op in ("call_function", "call_method"):
            stack.extend(current.all_input_nodes)
    return False


def _through_casts(node, context: Context, nodes: list, step: str, dtypes: tuple) -> torch.fx.Node:
    """``node`` before its casts to ``dtypes`` or to their source's own dtype (each with one
    user), added to ``nodes``."""
    while isinstance(node, torch.fx.Node) and cast_dtype(node, context) is not None:
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            break
        if cast_dtype(node, context) not in (*dtypes, example_value(source).dtype):
            raise Unread(f"{step} {node.name} casts to {cast_dtype(node, context)}")
        one_user(source, node, step)
        nodes.append(node)
        node = source
    if not isinstance(node, torch.fx.Node):
        raise Unread(f"{step} is {node!r}, not a tensor")
    return node


def _sink_rows(sink, scores: torch.Tensor, context: Context) -> tuple[torch.fx.Node, list]:
    """(the op's sinks, their view's nodes) of what the logsumexp is reduced by: a (heads,)
    tensor viewed as (1, H, 1), or a (batch, heads, rows) tensor."""
    batch, heads, rows = scores.shape[:3]
    value = example_value(sink) if isinstance(sink, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        raise Unread(f"the logsumexp is reduced by {sink!r}, not a sink tensor")
    if _shapes_agree(value.shape, (batch, heads, rows)):
        return sink, []
    viewed = (_is_call(sink, "view") or _is_call(sink, "reshape")) and _shapes_agree(value.shape, (1, heads, 1))
    indexed = sink.target is operator.getitem and sink.args[1] in _HEADS_AT_1_OF_3
    source = sink.args[0] if indexed else context.calls.read(sink)["input"] if viewed else None
    if source is None or not _shapes_agree(example_value(source).shape, (heads,)):
        raise Unread(
            f"the logsumexp is reduced by {_shown_shape(sink)}: not one logit per query head viewed as (1, heads, 1) "
            "nor one per (batch, head, row)"
        )
    return source, [sink]
