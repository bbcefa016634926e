"""The spelled-out attention rule: attention computed as ops (transformers' eager attention;
GPT-OSS's, Granite-SWA's and Inkling2's with their sinks; Gemma-2's soft-capped scores) -> the
sliding-window op, as the sliding rule builds it.

Match: ``matmul(P, v)`` where P reads back, through casts, dropout and a slice, to a softmax.
Check, each step read exactly or the chain is kept with a reason naming the step:
- the scores (``spelled_steps.py``): ``matmul(q, k^T)`` times or divided by a constant positive
  finite number; optionally soft-capped, ``tanh(s / cap) * cap`` with one constant cap (FA2's
  ``softcap``); then an additive mask added to it (either order), a mask SDPA would take
  (``attention.sdpa_mask_problem``), proven a band by the SDPA rules' own proof
  (``attention.mask_band``): sliding, causal, padded, packed alike; or a boolean mask filled
  in (``where(visible, scores, fill)``, ``scores.masked_fill(~visible, fill)``) with a fill
  that hides a key (-inf or the dtype's minimum), read as an additive mask;
- optionally a sink (``spelled_sinks.py``): a column concatenated last, per head or per row,
  the softmax's last column sliced off; or the logsumexp scaling of the result,
  ``(softmax(w) @ v) * sigmoid(logsumexp(w) - sink)[..., None]``, which then ends the chain;
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
Then the chain is SDPA(q, k, v, mask, scale) plus the soft-cap and the sink, and the sliding
rule's ``band_plan`` decides (kernel policy, padding, segments) and builds the op, with K/V
taken before transformers' repeat_kv. Any band is rewritten, unbounded sides too: with a sink
the op is the only exact kernel, and without one the op is as fast as SDPA with the mask
wherever the policy says so, which is at least as fast as the chain (below).

Never slower: the policy's answer is the op's against SDPA with the mask, and SDPA with the mask
is at least as fast as the chain of ops computing the same scores, compiled by inductor (the
chain writes every score and probability to memory; SDPA's fused kernels do not): measured on
the CPU (``benchmarks/bench_spelled.py``) and timed on a GPU by ``benchmarks/gpu_check.py
--sections measure``. With a soft-cap no SDPA takes the call: on the CPU the policy's answer
is then the op's against the chain itself (``bench_spelled.py --softcap``,
``chunked.SOFTCAP_SHORT_KEYS``). So the rule rewrites on the CPU where the policy finds the op
as fast, and on another device only where a kernel was measured so on that device
(``KernelChoice.measured``: ``measure/__init__.py``, or a table this project measured there); it
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
from ..kernels.layout import SUPPORTED_DTYPES
from ..proof import AdditiveMasks, Unproven, input_name
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
from .spelled_sinks import ALL_BUT_LAST, LseScaling, lse_scaling, sink_column
from .spelled_steps import (
    Unread,
    bound,
    cast_dtype,
    first_input,
    key,
    last_dim,
    masked,
    one_user,
    scaled_product,
    single,
    softcapped,
    strip_casts,
)

NAME = "spelled_attention"
TARGETS = {
    ("call_function", torch.matmul): ATTENTION,
    ("call_function", operator.matmul): ATTENTION,
    ("call_method", "matmul"): ATTENTION,
}
_SOFTMAXES = {("call_function", F.softmax), ("call_function", torch.softmax), ("call_method", "softmax")}
_DROPOUTS = {("call_function", F.dropout), ("call_function", torch.dropout), ("call_method", "dropout")}


@dataclass(frozen=True)
class Chain:
    """Attention read off a chain of ops, as SDPA's arguments plus a sink."""

    query: torch.fx.Node
    key: torch.fx.Node  # as the matmul reads them (after repeat_kv)
    value: torch.fx.Node
    mask: torch.fx.Node | None
    filled: bool  # a boolean mask read as additive (where / masked_fill)
    scale: float
    sinks: torch.fx.Node | None  # (heads,) or (batch, heads, rows)
    nodes: frozenset  # the chain's own nodes, dead once the op replaces it
    softcap: float = 0.0  # FA2's: scores soft-capped (0: none)
    fill: float | None = None  # a boolean mask's fill where it was filled in
    # The logsumexp scaling that ends the chain (its sinks are ``sinks``), or None.
    scaling: LseScaling | None = None

    @property
    def end(self) -> torch.fx.Node | None:
        """The node the op replaces where it is not ``matmul(P, v)`` (the scaling's product)."""
        return None if self.scaling is None else self.scaling.product

    def describe(self) -> str:
        text = f", soft-capped scores (cap {self.softcap:g})" if self.softcap else ""
        if self.sinks is not None:
            text += ", attention sinks" + (" per row" if example_value(self.sinks).dim() == 3 else "")
            text += " (logsumexp scaling)" if self.scaling is not None else ""
        return text

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
        return f"attention spelled out in ops: {self.sliding.reason}{self.chain.describe()}"

    @property
    def kernel(self) -> str:
        if example_value(self.chain.query).device.type == "meta":  # an offline report
            return f"{self.sliding.kernel}; on a GPU where a kernel is measured faster on the device"
        return self.sliding.kernel


def softmax_of(node: torch.fx.Node, context: Context) -> torch.fx.Node | None:
    """The softmax ``matmul(P, v)``'s P reads back to through casts, dropout and a slice; None
    where it reads back to none (not attention: no decision)."""
    probabilities = first_input(node, context)
    for _ in range(8):
        if not isinstance(probabilities, torch.fx.Node):
            return None
        if key(probabilities) in _SOFTMAXES:
            return probabilities
        if not (
            cast_dtype(probabilities, context) is not None
            or key(probabilities) in _DROPOUTS
            or probabilities.target is operator.getitem
        ):
            return None
        probabilities = first_input(probabilities, context)
    return None


def matches(site: Site, context: Context) -> bool:
    return softmax_of(site.node, context) is not None


def read_chain(node: torch.fx.Node, context: Context) -> Chain:
    """The chain ending at ``matmul(P, v)`` (or at the logsumexp scaling of its result) read
    back step by step; raises ``Unread``."""
    nodes: list[torch.fx.Node] = []
    scaling = lse_scaling(node, context)
    lse = () if scaling is None else (scaling.logsumexp,)  # the one other reader of the scores
    arguments = bound(node, context)
    probabilities, value = list(arguments.values())[:2]
    one_user(probabilities, node, "the probabilities")
    # P: casts, dropout and one slice (the sink's), in any order, back to the softmax.
    current, sliced = probabilities, None
    while (
        key(current) in _DROPOUTS
        or cast_dtype(current, context) is not None
        or (key(current) == ("call_function", operator.getitem) and sliced is None)
    ):
        if key(current) in _DROPOUTS:
            _check_dropout(current, context)
        if current.target is operator.getitem:
            sliced = current
        nodes.append(current)
        source = first_input(current, context)
        one_user(source, current, "the probabilities")
        current = source
    softmax = current
    if key(softmax) not in _SOFTMAXES:
        raise Unread(f"{describe(softmax)} between the softmax and the matmul with v")
    nodes.append(softmax)
    softmax_call = bound(softmax, context)
    logits = softmax_call["input"]
    logits_value = example_value(logits)
    if not last_dim(softmax_call["dim"], logits_value):
        raise Unread(f"softmax {softmax.name} over dim {softmax_call['dim']}, not the key axis")
    # dtypes: q, k, v and the scores share one; the softmax computes in it or in float32.
    if softmax_call.get("dtype") not in (None, torch.float32, logits_value.dtype):
        raise Unread(f"softmax {softmax.name} in {softmax_call['dtype']}")
    logits = strip_casts(logits, context, nodes)
    one_user(logits, nodes[-1], "the softmax's input", also=lse)
    # Minus the row max of the same tensor.
    if logits.target is operator.sub or key(logits) == ("call_function", torch.sub):
        logits = strip_casts(_row_max_shift(logits, context, nodes, lse), context, nodes)
    # The sink column.
    sinks = None
    if key(logits) == ("call_function", torch.cat):
        if sliced is None:
            raise Unread(f"logits concatenated ({logits.name}) with nothing sliced off after the softmax")
        if scaling is not None:
            raise Unread(f"a sink column ({logits.name}) and a logsumexp scaling ({scaling.product.name}) together")
        cat = context.calls.read(logits)
        parts = cat["tensors"]
        if not (last_dim(cat["dim"], example_value(logits)) and len(parts) == 2):
            raise Unread(
                f"{logits.name} concatenates {len(parts)} tensors on dim {cat['dim']}, not a column on the key axis"
            )
        scores_part, column = parts
        if not (isinstance(column, torch.fx.Node) and same_size(example_value(column).shape[-1], 1)):
            raise Unread(f"{logits.name}'s last part is not one column: the sink must be at the end of the key axis")
        if sliced.args[1] not in ALL_BUT_LAST:
            raise Unread(f"{sliced.name} slices {sliced.args[1]} off the softmax, not its last column")
        sinks, column_nodes = sink_column(column, example_value(scores_part), context)
        nodes += [logits, *column_nodes]  # the cat, the column's own nodes
        one_user(scores_part, logits, "the scores")
        one_user(column, logits, "the sink column")
        logits = scores_part
    elif sliced is not None:
        raise Unread(f"{sliced.name} slices the softmax's output without a column concatenated before it")
    if scaling is not None:
        if scaling.scores is not logits:
            raise Unread(
                f"logsumexp {scaling.logsumexp.name} is of {describe(scaling.scores)}, not of the scores the "
                f"softmax reads ({logits.name})"
            )
        sinks = scaling.sinks
        nodes += scaling.nodes
    mask = masked(logits, context, nodes)
    scores, softcap = softcapped(mask.scores, context, nodes)
    query, key_node, scale = scaled_product(scores, context, nodes)
    for name, tensor in (("query", query), ("key", key_node), ("value", value), ("mask", mask.mask), ("sinks", sinks)):
        written = context.evaluator.writes.writer(tensor) if tensor is not None else None
        if written is not None:
            raise Unread(f"the {name}: {written}")
    dtype = _computed_dtype(query, key_node, value, scores, node)
    if sinks is not None and example_value(sinks).dtype not in (dtype, torch.float32):
        raise Unread(f"the sinks are {example_value(sinks).dtype}, the scores {dtype}")
    for step in nodes:
        if not isinstance(example_value(step), torch.Tensor):  # max's (values, indices)
            continue
        got = example_value(step).dtype
        if got not in (dtype, torch.float32) or (got == torch.float32 and dtype == torch.float64):
            raise Unread(f"{describe(step)} computes in {got}, neither {dtype} nor an upcast to float32")
    return Chain(
        query, key_node, value, mask.mask, mask.filled, scale, sinks, frozenset(nodes), softcap, mask.fill, scaling
    )


def _check_dropout(node: torch.fx.Node, context: Context) -> None:
    """A dropout that drops nothing: p == 0, or outside training; not in place."""
    dropout = bound(node, context)
    p, training = call_number(dropout["p"]), dropout["training" if "training" in dropout else "train"]
    if node.op == "call_method" or dropout.get("inplace", False) is not False:
        raise Unread(f"dropout {node.name} in place or as a method")
    if p != 0 and training is not False:
        raise Unread(f"dropout {node.name} with p={dropout['p']} in training")


def _row_max_shift(difference: torch.fx.Node, context: Context, nodes: list, also=()) -> torch.fx.Node:
    """x for ``x - max(x)`` over the key axis (``amax(x, -1, keepdim=True)``, ``x.max(-1,
    keepdim=True)[0]`` or ``.values``, either detached), its nodes added to ``nodes``; x may
    also be read by the nodes in ``also``."""
    call = context.calls.read(difference)
    shifted, row_max = call.first(2)
    if call.arguments.get("alpha", 1) != 1 or not isinstance(row_max, torch.fx.Node):
        raise Unread(f"{difference.name} is not x minus its row max")
    steps, maximum = [difference, row_max], row_max
    if maximum.op == "call_method" and maximum.target == "detach":
        maximum = maximum.args[0]
        steps.append(maximum)
    reductions = {("call_method", "amax"), ("call_function", torch.amax)}
    if maximum.target is operator.getitem and maximum.args[1] == 0:  # max(dim=...).values
        maximum = maximum.args[0]
        steps.append(maximum)
        reductions = {("call_method", "max"), ("call_function", torch.max)}
    reduction = context.calls.read(maximum) if key(maximum) in reductions else None
    if reduction is None or "dim" not in reduction.arguments or reduction["input"] is not shifted:
        raise Unread(f"{difference.name} subtracts {describe(row_max)}, not the row max of {describe(shifted)}")
    if not (last_dim(single(reduction["dim"]), example_value(shifted)) and reduction["keepdim"] is True):
        raise Unread(f"{describe(maximum)} is not over the key axis with keepdim")
    for user in shifted.users:
        if user not in (difference, maximum, *also):
            raise Unread(f"the logits {shifted.name} are also used by {describe(user)}")
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
        raise Unread(
            f"q, k, v in {shown} and the matmuls in {example_value(scores).dtype} and {dtype}: not one dtype, nor "
            "autocast's"
        )
    return dtype


def check(site: Site, context: Context) -> Plan | Kept:
    try:
        chain = read_chain(site.node, context)
    except Unread as unread:
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
    query, key_value = example_value(chain.query), example_value(chain.key)
    keyless_rows = bool(band.key_padding or band.segments or band.blocks) or not statically_known_true(
        query.shape[-2] <= key_value.shape[-2]
    )
    if chain.scaling is not None and keyless_rows:
        # softmax(w) of a row that sees no key is an average (a finite fill) or NaN (-inf), which
        # the scaling's c = 0 turns into 0 only where it is finite.
        fill = chain.fill if chain.filled else AdditiveMasks(context.evaluator).fill(chain.mask)
        if fill is None or not math.isfinite(fill):
            return Kept(
                f"attention spelled out in ops: mask is {band.describe()}, but rows may see no key, which the chain's "
                f"logsumexp scaling gives NaN (the mask's fill {fill} is not finite) where the op gives 0"
            )
    # Off the CPU (measured: benchmarks/bench_spelled.py), the op replaces the chain only where a
    # kernel is measured against SDPA with the mask on the device itself: SDPA with the mask is
    # at least as fast as the chain it computes (gpu_check.py's measure section times both).
    measured_only = device.type not in ("cpu", "meta")
    plan = sliding_window.band_plan(
        Site(chain.end or site.node, args),
        band,
        context,
        chain.sinks,
        spelled=True,
        measured_only=measured_only,
        softcap=chain.softcap,
        fill=chain.fill if chain.filled else None,
        fill_replaces_scores=chain.filled,
    )
    if isinstance(plan, Kept):
        return Kept(f"attention spelled out in ops: {plan.reason}")
    return Plan(chain, plan, keyless_rows=keyless_rows)


SINK_CHECK = (
    "compile_pass: an attention sink is +inf or NaN, or, where rows may see no key, not above the attention mask's "
    "fill (-inf or the dtype's minimum): the result would differ from eager; compile with spelled_attention=False"
)


def _check_sinks(sinks: torch.fx.Node, node: torch.fx.Node, lowest: float | None, *, below_inf: bool) -> None:
    """Where ``below_inf``, every sink below +inf (the column's softmax is NaN at a sink of +inf,
    the op's 0; the logsumexp scaling's is 0 there too) and, with ``lowest``, above it: the
    minimum of the sinks' dtype and of the fill's (the fills that hide a key), so that a row
    that sees no key puts all its weight on the sink and returns 0, as the op does. Checked
    where the op runs, raising otherwise (a comparison per sink per call; a NaN sink fails it
    too)."""
    checks = []
    if below_inf:
        checks.append(insert_before(node, torch.lt, sinks, float("inf")))
    if lowest is not None:
        checks.append(insert_before(node, torch.gt, sinks, lowest))
    if not checks:
        return
    holds = checks[0] if len(checks) == 1 else insert_before(node, torch.logical_and, *checks)
    every = insert_before(node, torch.all, holds)
    insert_before(node, torch._assert_async, every, SINK_CHECK)


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    if plan.chain.sinks is not None:
        lowest = None
        if plan.keyless_rows:
            mask = example_value(plan.chain.mask)
            fill_dtype = mask.dtype if mask.is_floating_point() else example_value(plan.sliding.site.node).dtype
            lowest = max(torch.finfo(example_value(plan.chain.sinks).dtype).min, torch.finfo(fill_dtype).min)
        _check_sinks(plan.chain.sinks, plan.sliding.site.node, lowest, below_inf=plan.chain.scaling is None)
    return sliding_window.swap_in(plan.sliding, context) | set(plan.chain.nodes)
