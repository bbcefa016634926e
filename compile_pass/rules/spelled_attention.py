"""The spelled-out attention rule: attention computed as ops (transformers' eager attention,
GPT-OSS's with its sinks) -> the sliding-window op, as the sliding rule builds it.

Match: ``matmul(P, v)`` where P reads back, through casts, dropout and a slice, to a softmax.
Check, each step read exactly or the chain is kept with a reason naming the step:
- ``matmul(q, k^T)`` with k^T a transpose of k's last two dimensions (``transpose``, ``mT``,
  ``permute(0, 1, 3, 2)``), times or divided by a constant positive finite number;
- an additive mask added to it (``scores + mask``, either order), a mask SDPA would take
  (``attention.sdpa_mask_problem``), proven a band by the SDPA rules' own proof
  (``attention.mask_band``): sliding, causal, padded, packed alike; or a boolean mask filled
  in (``where(visible, scores, fill)``, ``scores.masked_fill(~visible, fill)``) with a fill
  that hides a key (-inf or the dtype's minimum), read as an additive mask;
- optionally a sink: ``cat([scores, s], -1)`` with s a (heads,) tensor viewed as (1, H, 1, 1)
  and expanded over batch and rows, the softmax's last column sliced off (``[..., :-1]``);
- optionally minus the row max of the same tensor (amax or max over the last dimension,
  keepdim): softmax is shift-invariant, so it changes nothing, and its gradient is 0;
- softmax over the last dimension, in the scores' dtype or upcast to float32 (``dtype=``,
  or a cast before it), cast back to the value's dtype;
- dropout with p == 0 or outside training (not in place);
- one dtype for q, k, v and both matmuls, or autocast's: both matmuls in bf16 or fp16 from
  q, k, v in it or in float32 (the op then runs on them cast so), with the mask and the sinks
  added in float32 where type promotion puts them;
- ``matmul(P, v)``; every intermediate has no other user (the probabilities are not returned:
  ``output_attentions``), and nothing writes q, k, v, the mask or the sinks.
Then the chain is SDPA(q, k, v, mask, scale) plus the sink, and the sliding rule's
``band_plan`` decides (kernel policy, padding, segments) and builds the op, with K/V taken
before transformers' repeat_kv. Any band is rewritten, unbounded sides too: with a sink the
op is the only exact kernel, and without one the op is as fast as SDPA with the mask wherever
the policy says so, which is at least as fast as the chain (below).

Never slower: the policy's answer is the op's against SDPA with the mask, and SDPA with the mask
is at least as fast as the chain of ops computing the same scores, compiled by inductor (the
chain writes every score and probability to memory; SDPA's fused kernels do not): measured on
the CPU (``benchmarks/bench_spelled.py``) and timed on a GPU by ``benchmarks/gpu_check.py
--sections measure``. So the rule rewrites on the CPU where the policy finds the op as fast as
SDPA, and on another device only where a kernel was measured so on that device
(``KernelChoice.measured``: ``ops/measure.py``, or a table this project measured there); it
keeps the chain elsewhere (short calls, a static table's answer off the CPU).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from dataclasses import replace as with_fields

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..calls import Call
from ..graphs import describe, example_value
from ..ops.layout import SUPPORTED_DTYPES
from ..proof import Unproven, input_name
from ..proof.additive import is_fill
from ..report import ATTENTION
from ..sizes import same_size
from . import sliding_window
from .attention import (
    attention_problem,
    call_number,
    insert_before,
    mask_band,
    sdpa_mask_problem,
    within_checked_positions,
)
from .base import Context, Kept, Site

NAME = "spelled_attention"
TARGETS = {
    ("call_function", torch.matmul): ATTENTION,
    ("call_function", operator.matmul): ATTENTION,
    ("call_method", "matmul"): ATTENTION,
}
_MATMULS = set(TARGETS)
_SOFTMAXES = {("call_function", F.softmax), ("call_function", torch.softmax), ("call_method", "softmax")}
_DROPOUTS = {("call_function", F.dropout), ("call_function", torch.dropout), ("call_method", "dropout")}
_CASTS = {"to", "float", "double", "half", "bfloat16", "type_as"}
_CAST_DTYPES = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Chain:
    """Attention read off a chain of ops, as SDPA's arguments plus a sink."""

    query: torch.fx.Node
    key: torch.fx.Node  # as the matmul reads them (after repeat_kv)
    value: torch.fx.Node
    mask: torch.fx.Node | None
    filled: bool  # a boolean mask read as additive (where / masked_fill)
    scale: float
    sinks: torch.fx.Node | None  # (heads,)
    nodes: frozenset  # the chain's own nodes, dead once the op replaces it

    def sdpa_call(self) -> Call:
        arguments = dict(
            query=self.query,
            key=self.key,
            value=self.value,
            attn_mask=self.mask,
            dropout_p=0.0,
            is_causal=False,
            scale=self.scale,
            enable_gqa=False,
        )
        return Call(arguments, frozenset())


@dataclass(frozen=True)
class Plan:
    chain: Chain
    sliding: sliding_window.Plan
    # Rows may see no key (padding, segments, Sq > Sk): the chain gives them 0 only where the
    # sink is above the mask's fill, which the graph then checks at run time (``_check_sinks``).
    keyless_rows: bool = False

    @property
    def reason(self) -> str:
        sink = ", attention sinks" if self.chain.sinks is not None else ""
        return f"attention spelled out in ops: {self.sliding.reason}{sink}"

    @property
    def kernel(self) -> str:
        if example_value(self.chain.query).device.type == "meta":  # an offline report
            return f"{self.sliding.kernel}; on a GPU where a kernel is measured faster on the device"
        return self.sliding.kernel


class _Unread(Exception):
    """A step of the chain that is not read exactly: the reason names it."""


def _key(node) -> tuple:
    return (node.op, node.target) if isinstance(node, torch.fx.Node) else ()


def _bound(node: torch.fx.Node, context: Context) -> dict | None:
    """``node``'s arguments by name (``calls.read``)."""
    call = context.calls.read(node)
    return None if call is None else dict(call.arguments)


def _input(node: torch.fx.Node, context: Context):
    arguments = _bound(node, context)
    return None if arguments is None else next(iter(arguments.values()))


def _cast_dtype(node, context: Context) -> torch.dtype | None:
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


def _one_user(node: torch.fx.Node, user: torch.fx.Node, step: str) -> None:
    others = [u for u in node.users if u is not user]
    if others:
        raise _Unread(f"{step} {node.name} is also used by {', '.join(describe(u) for u in others)}")


def _last_dim(dim, tensor: torch.Tensor) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool) and dim in (-1, tensor.dim() - 1)


def _strip_casts(node, context: Context, nodes: list) -> torch.fx.Node:
    """``node`` before its dtype casts, each cast added to ``nodes`` (it must have one user)."""
    while isinstance(node, torch.fx.Node) and _cast_dtype(node, context) is not None:
        nodes.append(node)
        source = node.args[0]
        if isinstance(source, torch.fx.Node):
            _one_user(source, node, "the cast value")
        node = source
    return node


def softmax_of(node: torch.fx.Node, context: Context) -> torch.fx.Node | None:
    """The softmax ``matmul(P, v)``'s P reads back to through casts, dropout and a slice; None
    where it reads back to none (not attention: no decision)."""
    probabilities = _input(node, context)
    for _ in range(8):
        if not isinstance(probabilities, torch.fx.Node):
            return None
        if _key(probabilities) in _SOFTMAXES:
            return probabilities
        if not (
            _cast_dtype(probabilities, context) is not None
            or _key(probabilities) in _DROPOUTS
            or probabilities.target is operator.getitem
        ):
            return None
        probabilities = _input(probabilities, context)
    return None


def matches(site: Site, context: Context) -> bool:
    return softmax_of(site.node, context) is not None


def read_chain(node: torch.fx.Node, context: Context) -> Chain:
    """The chain ending at ``matmul(P, v)`` read back step by step; raises ``_Unread``."""
    nodes: list[torch.fx.Node] = []
    arguments = _bound(node, context)
    probabilities, value = list(arguments.values())[:2]
    _one_user(probabilities, node, "the probabilities")
    # P: casts, dropout and one slice (the sink's), in any order, back to the softmax.
    current, sliced = probabilities, None
    while (
        _key(current) in _DROPOUTS
        or _cast_dtype(current, context) is not None
        or (_key(current) == ("call_function", operator.getitem) and sliced is None)
    ):
        if _key(current) in _DROPOUTS:
            _check_dropout(current, context)
        if current.target is operator.getitem:
            sliced = current
        nodes.append(current)
        source = _input(current, context)
        _one_user(source, current, "the probabilities")
        current = source
    softmax = current
    if _key(softmax) not in _SOFTMAXES:
        raise _Unread(f"{describe(softmax)} between the softmax and the matmul with v")
    nodes.append(softmax)
    softmax_call = _bound(softmax, context)
    logits = softmax_call["input"]
    logits_value = example_value(logits)
    if not _last_dim(softmax_call["dim"], logits_value):
        raise _Unread(f"softmax {softmax.name} over dim {softmax_call['dim']}, not the key axis")
    # dtypes: q, k, v and the scores share one; the softmax computes in it or in float32.
    if softmax_call.get("dtype") not in (None, torch.float32, logits_value.dtype):
        raise _Unread(f"softmax {softmax.name} in {softmax_call['dtype']}")
    logits = _strip_casts(logits, context, nodes)
    _one_user(logits, nodes[-1], "the softmax's input")
    # Minus the row max of the same tensor.
    if logits.target is operator.sub or _key(logits) == ("call_function", torch.sub):
        logits = _strip_casts(_row_max_shift(logits, context, nodes), context, nodes)
    # The sink column.
    sinks = None
    if _key(logits) == ("call_function", torch.cat):
        if sliced is None:
            raise _Unread(f"logits concatenated ({logits.name}) with nothing sliced off after the softmax")
        cat = context.calls.read(logits)
        parts = cat["tensors"]
        if not (_last_dim(cat["dim"], example_value(logits)) and len(parts) == 2):
            raise _Unread(
                f"{logits.name} concatenates {len(parts)} tensors on dim {cat['dim']}, not a column on the key axis"
            )
        scores_part, column = parts
        if not (isinstance(column, torch.fx.Node) and same_size(example_value(column).shape[-1], 1)):
            raise _Unread(f"{logits.name}'s last part is not one column: the sink must be at the end of the key axis")
        if sliced.args[1] not in _ALL_BUT_LAST:
            raise _Unread(f"{sliced.name} slices {sliced.args[1]} off the softmax, not its last column")
        sinks = _sink_source(column, example_value(scores_part), context)
        nodes += [logits, column, column.args[0]]  # the cat, the expand, the (1, H, 1, 1) view
        _one_user(scores_part, logits, "the scores")
        _one_user(column, logits, "the sink column")
        logits = scores_part
    elif sliced is not None:
        raise _Unread(f"{sliced.name} slices the softmax's output without a column concatenated before it")
    scores, mask, filled = _masked(logits, context, nodes)
    query, key, scale = _scaled_product(scores, context, nodes)
    for name, tensor in (("query", query), ("key", key), ("value", value), ("mask", mask), ("sinks", sinks)):
        written = context.evaluator.writes.writer(tensor) if tensor is not None else None
        if written is not None:
            raise _Unread(f"the {name}: {written}")
    dtype = _computed_dtype(query, key, value, scores, node)
    if sinks is not None and example_value(sinks).dtype not in (dtype, torch.float32):
        raise _Unread(f"the sinks are {example_value(sinks).dtype}, the scores {dtype}")
    for step in nodes:
        if not isinstance(example_value(step), torch.Tensor):  # max's (values, indices)
            continue
        got = example_value(step).dtype
        if got not in (dtype, torch.float32) or (got == torch.float32 and dtype == torch.float64):
            raise _Unread(f"{describe(step)} computes in {got}, neither {dtype} nor an upcast to float32")
    return Chain(query, key, value, mask, filled, scale, sinks, frozenset(nodes))


def _check_dropout(node: torch.fx.Node, context: Context) -> None:
    """A dropout that drops nothing: p == 0, or outside training; not in place."""
    dropout = _bound(node, context)
    p, training = call_number(dropout["p"]), dropout["training" if "training" in dropout else "train"]
    if node.op == "call_method" or dropout.get("inplace", False) is not False:
        raise _Unread(f"dropout {node.name} in place or as a method")
    if p != 0 and training is not False:
        raise _Unread(f"dropout {node.name} with p={dropout['p']} in training")


def _row_max_shift(difference: torch.fx.Node, context: Context, nodes: list) -> torch.fx.Node:
    """x for ``x - max(x)`` over the key axis (``amax(x, -1, keepdim=True)``, ``x.max(-1,
    keepdim=True)[0]`` or ``.values``, either detached), its nodes added to ``nodes``."""
    call = context.calls.read(difference)
    shifted, row_max = call.first(2)
    if call.arguments.get("alpha", 1) != 1 or not isinstance(row_max, torch.fx.Node):
        raise _Unread(f"{difference.name} is not x minus its row max")
    steps, maximum = [difference, row_max], row_max
    if maximum.op == "call_method" and maximum.target == "detach":
        maximum = maximum.args[0]
        steps.append(maximum)
    reductions = {("call_method", "amax"), ("call_function", torch.amax)}
    if maximum.target is operator.getitem and maximum.args[1] == 0:  # max(dim=...).values
        maximum = maximum.args[0]
        steps.append(maximum)
        reductions = {("call_method", "max"), ("call_function", torch.max)}
    reduction = context.calls.read(maximum) if _key(maximum) in reductions else None
    if reduction is None or "dim" not in reduction.arguments or reduction["input"] is not shifted:
        raise _Unread(f"{difference.name} subtracts {describe(row_max)}, not the row max of {describe(shifted)}")
    if not (_last_dim(_single(reduction["dim"]), example_value(shifted)) and reduction["keepdim"] is True):
        raise _Unread(f"{describe(maximum)} is not over the key axis with keepdim")
    for user in shifted.users:
        if user not in (difference, maximum):
            raise _Unread(f"the logits {shifted.name} are also used by {describe(user)}")
    nodes += steps
    return shifted


def _computed_dtype(query, key, value, scores, node) -> torch.dtype:
    """The dtype both matmuls compute in: q, k and v's; or, under autocast, the lower precision
    both matmuls came out in, with q, k and v in it or in float32 (autocast casts them; a
    matmul of two dtypes fails outside it). The op is then run on q, k, v cast so (``OpSwap``)."""
    dtype = example_value(node).dtype
    given = {example_value(t).dtype for t in (query, key, value)}
    low_precision = dtype in (torch.float16, torch.bfloat16)
    if (
        example_value(scores).dtype != dtype
        or dtype not in SUPPORTED_DTYPES
        or not (given == {dtype} or (low_precision and given <= {dtype, torch.float32}))
    ):
        shown = ", ".join(sorted(map(str, given)))
        raise _Unread(
            f"q, k, v in {shown} and the matmuls in {example_value(scores).dtype} and {dtype}: not one dtype, nor "
            "autocast's"
        )
    return dtype


# probs[..., :-1] and its spellings with the leading dimensions written out.
_ALL_BUT_LAST = (
    (Ellipsis, slice(None, -1, None)),
    (slice(None), slice(None), slice(None), slice(None, -1, None)),
)


# s[None, :, None, None]: a (heads,) tensor as (1, heads, 1, 1).
_HEADS_AT_1 = ((None, slice(None), None, None),)


def _single(dim):
    return dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim


def _sink_source(column: torch.fx.Node, scores: torch.Tensor, context: Context) -> torch.fx.Node:
    """The (heads,) tensor whose element h is the sink of every row of head h: ``s.reshape(1,
    -1, 1, 1)`` (or view) expanded to (batch, heads, rows, 1)."""
    if not (column.op == "call_method" and column.target == "expand"):
        raise _Unread(f"the sink column {column.name} is not a per-head tensor expanded over batch and rows")
    viewed = context.calls.read(column)["input"]
    reshaped = isinstance(viewed, torch.fx.Node) and viewed.op == "call_method" and viewed.target in ("reshape", "view")
    indexed = isinstance(viewed, torch.fx.Node) and viewed.target is operator.getitem and viewed.args[1] in _HEADS_AT_1
    if not (reshaped or indexed):
        raise _Unread(
            f"the sink column {column.name} expands {describe(viewed)}, "
            "not a (heads,) tensor viewed as (1, heads, 1, 1)"
        )
    source = viewed.args[0] if indexed else context.calls.read(viewed)["input"]
    heads = scores.shape[1]
    shapes = (example_value(source).shape, example_value(viewed).shape, example_value(column).shape)
    per_head, view, expanded = shapes
    if not (
        len(per_head) == 1
        and same_size(per_head[0], heads)
        and len(view) == 4
        and all(same_size(a, b) for a, b in zip(view, (1, heads, 1, 1), strict=True))
        and len(expanded) == 4
        and all(same_size(a, b) for a, b in zip(expanded, (scores.shape[0], heads, scores.shape[2], 1), strict=True))
    ):
        raise _Unread(
            f"the sink column {column.name} is {tuple(expanded)} from {tuple(per_head)}: not one logit per query head"
        )
    _one_user(viewed, column, "the sink view")
    return source


def _masked(logits: torch.fx.Node, context: Context, nodes: list) -> tuple:
    """(scores before the mask, the mask or None, whether it was a boolean mask filled in)."""
    if logits.target is operator.add or _key(logits) == ("call_function", torch.add):
        call = context.calls.read(logits)
        a, b = list(call.arguments.values())[:2]
        if call.arguments.get("alpha", 1) != 1:
            raise _Unread(f"{logits.name} adds the mask times {call['alpha']}")
        scores, mask = (b, a) if _is_product(b) and not _is_product(a) else (a, b)
        if not (isinstance(mask, torch.fx.Node) and isinstance(example_value(mask), torch.Tensor)):
            raise _Unread(f"{logits.name} adds {mask!r}, not a mask tensor")
        nodes.append(logits)
        _one_user(scores, logits, "the scores")
        return scores, mask, False
    filled = _filled_mask(logits, context)
    if filled is not None:
        scores, visible = filled
        nodes.append(logits)
        _one_user(scores, logits, "the scores")
        return scores, visible, True
    return logits, None, False


def _filled_mask(node: torch.fx.Node, context: Context) -> tuple | None:
    """(scores, visible) for ``where(visible, scores, fill)`` or ``scores.masked_fill(~visible,
    fill)`` with a fill that hides a key in the scores' dtype; None for anything else."""
    call = context.calls.read(node)
    if call is None:
        return None
    dtype = example_value(node).dtype
    if _key(node) == ("call_function", torch.where) and len(call.arguments) >= 3:
        visible, scores, fill = call.first(3)
    elif node.op == "call_method" and node.target == "masked_fill":
        scores, hidden, fill = call["input"], call["mask"], call["value"]
        negations = {
            ("call_function", operator.invert),
            ("call_function", torch.logical_not),
            ("call_method", "logical_not"),
        }
        if _key(hidden) not in negations:
            raise _Unread(f"{node.name} fills where {describe(hidden)} holds: read only as masked_fill(~visible, fill)")
        visible = hidden.args[0]
    else:
        return None
    if not (isinstance(visible, torch.fx.Node) and example_value(visible).dtype == torch.bool):
        return None
    if not is_fill(fill, dtype):
        raise _Unread(f"{node.name} fills hidden keys with {fill!r}, not -inf or the {dtype} minimum")
    return scores, visible


def _is_product(node) -> bool:
    """Whether ``node`` is a matmul, or a matmul times or divided by something."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target in (operator.mul, operator.truediv, torch.mul, torch.div):
        return any(_key(operand) in _MATMULS for operand in node.args[:2])
    return _key(node) in _MATMULS


def _scaled_product(scores: torch.fx.Node, context: Context, nodes: list) -> tuple:
    """(q, k, scale) of ``matmul(q, k^T) * c`` (or ``c *``, ``/ c``, or no scale)."""
    scale = 1.0
    if scores.target in (operator.mul, operator.truediv, torch.mul, torch.div):
        a, b = context.calls.read(scores).first(2)
        product, constant = (a, b) if isinstance(a, torch.fx.Node) and _key(a) in _MATMULS else (b, a)
        if _key(product) not in _MATMULS:
            raise _Unread(
                f"{scores.name} scales {describe(a)} by {describe(b) if isinstance(b, torch.fx.Node) else b}, not "
                "matmul(q, k^T) by a number (soft-capped or biased scores?)"
            )
        number = call_number(constant)
        if scores.target in (operator.truediv, torch.div) and product is not a:
            raise _Unread(f"{scores.name} divides a number by the scores")
        if number is None or not (math.isfinite(number) and number > 0) or isinstance(constant, bool):
            raise _Unread(f"{scores.name} scales by {constant!r}, not a constant positive finite number")
        if (
            scores.target in (operator.truediv, torch.div)
            and context.calls.read(scores).arguments.get("rounding_mode") is not None
        ):
            raise _Unread(f"{scores.name} divides with rounding")
        scale = 1.0 / number if scores.target in (operator.truediv, torch.div) else float(number)
        nodes.append(scores)
        _one_user(product, scores, "the scores")
        scores = product
    if _key(scores) not in _MATMULS:
        raise _Unread(f"{describe(scores)} where matmul(q, k^T) should be")
    query, transposed = list(_bound(scores, context).values())[:2]
    nodes.append(scores)
    key = _untransposed(transposed, context)
    if key is None:
        raise _Unread(f"{describe(transposed)} is not k with its last two dimensions swapped")
    _one_user(transposed, scores, "k^T")
    nodes.append(transposed)
    return query, key, scale


def _untransposed(node, context: Context) -> torch.fx.Node | None:
    """k where ``node`` is k (4-D) with its last two dimensions swapped."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] == "mT":
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


def check(site: Site, context: Context) -> Plan | Kept:
    try:
        chain = read_chain(site.node, context)
    except _Unread as unread:
        return Kept(f"attention spelled out in ops, but {unread}")
    if chain.sinks is not None and context.subclassed.get(chain.sinks) is not None:
        source = context.subclassed[chain.sinks]
        return Kept(
            f"attention sinks may be a tensor subclass at run time (from input {input_name(source)}): "
            "the op takes plain tensors"
        )
    args = chain.sdpa_call()
    device = example_value(chain.query).device
    if chain.mask is None:
        return Kept("attention spelled out in ops without a mask: no band to skip")
    problem = sdpa_mask_problem(args, chained=True)
    if problem is not None:
        return Kept(f"attention spelled out in ops, but its {problem}")
    band = mask_band(args, context.evaluator)
    if isinstance(band, Unproven):
        band = within_checked_positions(lambda e: mask_band(args, e), context.evaluator) or band
    if isinstance(band, Unproven):
        return Kept(f"attention spelled out in ops, but its mask {band.reason}")
    if chain.filled:
        band = with_fields(band, additive=True)  # hidden keys are filled: rows without keys differ
    problem = attention_problem(site.node, args, context, chained=True)
    if problem is not None:
        return Kept(f"attention spelled out in ops, but {problem}")
    # Off the CPU (measured: benchmarks/bench_spelled.py), the op replaces the chain only where a
    # kernel is measured against SDPA with the mask on the device itself: SDPA with the mask is
    # at least as fast as the chain it computes (gpu_check.py's measure section times both).
    measured_only = device.type not in ("cpu", "meta")
    plan = sliding_window.band_plan(
        Site(site.node, args), band, context, chain.sinks, computed_by="the chain", measured_only=measured_only
    )
    if isinstance(plan, Kept):
        return Kept(f"attention spelled out in ops: {plan.reason}")
    query, key = example_value(chain.query), example_value(chain.key)
    keyless_rows = bool(band.key_padding or band.segments or band.blocks) or not statically_known_true(
        query.shape[-2] <= key.shape[-2]
    )
    return Plan(chain, plan, keyless_rows=keyless_rows)


SINK_CHECK = (
    "compile_pass: an attention sink is +inf or NaN, or, where rows may see no key, not above the attention mask's "
    "fill (-inf or the dtype's minimum): the result would differ from eager; compile with spelled_attention=False"
)


def _check_sinks(sinks: torch.fx.Node, node: torch.fx.Node, lowest: float | None) -> None:
    """Every sink below +inf (the chain's softmax is NaN at a sink of +inf, the op's 0) and,
    with ``lowest``, above it: the minimum of the sinks' dtype and of the fill's (the fills
    that hide a key), so that a row that sees no key puts all its weight on the sink and
    returns 0, as the op does. Checked where the op runs, raising otherwise (a (heads,)
    comparison per call; a NaN sink fails it too)."""
    holds = insert_before(node, torch.lt, sinks, float("inf"))
    if lowest is not None:
        holds = insert_before(node, torch.logical_and, holds, insert_before(node, torch.gt, sinks, lowest))
    every = insert_before(node, torch.all, holds)
    insert_before(node, torch._assert_async, every, SINK_CHECK)


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    if plan.chain.sinks is not None:
        lowest = None
        if plan.keyless_rows:
            mask = example_value(plan.chain.mask)
            fill_dtype = mask.dtype if mask.is_floating_point() else example_value(plan.sliding.site.node).dtype
            lowest = max(torch.finfo(example_value(plan.chain.sinks).dtype).min, torch.finfo(fill_dtype).min)
        _check_sinks(plan.chain.sinks, plan.sliding.site.node, lowest)
    return sliding_window.swap_in(plan.sliding, context) | set(plan.chain.nodes)
