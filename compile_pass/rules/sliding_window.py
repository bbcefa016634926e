"""The sliding rule: SDPA whose mask is a proven sliding band -> the sliding-window op.

Match: every SDPA call (one without a mask is kept, and counted).
Check: the call is one the op computes (``attention.attention_problem``: no dropout, no
       broadcast batch or heads, GQA as the op groups heads, one head_dim for query and key
       and a value no wider (a narrower one zero-padded: ``OpSwap``), a supported dtype,
       a static scale), the mask is proven to be a band with a bounded left side under FA2's
       alignment (or with none, a full-attention layer, where the policy has a kernel faster
       than what SDPA runs for it: ``_full_layer_choice``; packed documents and padded rows on
       the CPU), possibly AND a key padding (batch, keys), read from the cache's first token on
       in a prefill chunk after a cache (``padding_read_of``), or segment ids (packed sequences,
       chunks, any ids a tensor of the graph holds; the op gets a private copy), or OR
       (batch, seq) image block ids, and the kernel policy knows the op's kernel there to be
       at least as fast as SDPA.
Replace: ``sliding_window_attention_forward(q, k, v, left, right, scale[, padding, ids, blocks])[0]``,
       on K/V before transformers' GQA repeat when that repeat is recognised and nothing
       writes its source; the mask's construction is erased when nothing else reads it.
       Where the op will try FA2's varlen calls, the calls that read the same padding or
       ids (one private copy, shared) share one ``varlen_layout`` per graph call.
Packed sequences whose window is over position values (transformers' masks for
``position_ids`` without an attention mask) are proven for positions in POSITION_RANGE:
``position_facts`` checks that at run time and the mask_input op runs the band with the
segment ids, or SDPA with the mask itself where the check fails.
Every other SDPA call is left exactly as it was, with the reason in the report.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graphs import example_value, fake_result, pass_into_body
from ..kernels import fa2, policy
from ..kernels.layout import accumulation_dtype
from ..proof import AdditiveMasks, Band, Unproven, hidden_alike_below
from ..sizes import same_size
from ..window import POSITION_RANGE, UNBOUNDED
from .attention import (
    SDPA_TARGETS,
    OpSwap,
    attention_problem,
    call_facts,
    has_mask,
    mask_band,
    no_mask_reason,
    op_key_value,
    op_scale,
    own_copy,
    plain_attention,
    recomputed_read,
    repeat_chain,
    within_checked_positions,
)
from .base import Context, Kept, Site
from .batch_terms import (
    PRIVATE_COPY,
    SEGMENT_PAIRS,
    batch_operands,
    batch_tensor_problem,
    called_from,
    defined_before,
    given,
    joined_ids,
    layout_of,
    padding_read_of,
    read_in_graph,
    read_through,
    segment_sources,
    shared_copy,
)

NAME = "sliding_window"
TARGETS = SDPA_TARGETS
OP = torch.ops.compile_pass.sliding_window_attention_forward.default
CHECKED_OP = torch.ops.compile_pass.mask_input_attention_forward.default
POSITION_FACTS = torch.ops.compile_pass.position_facts.default


@dataclass(frozen=True)
class Plan:
    site: Site
    band: Band
    scale: float
    key: torch.fx.Node  # K/V as the op reads them: before transformers' repeat when safe
    value: torch.fx.Node
    key_padding: torch.fx.Node | None  # a (batch, Sk) tensor; visible where != 0
    # Each set of segment ids: (tensor holding them, the calls that read it as (batch, S), each
    # (function, arguments after the tensor); none where the tensor is that already). Two
    # sets (a packed batch's chunks) reach the op as one (``segment_pairs``).
    segments: tuple[tuple[torch.fx.Node, tuple], ...]
    swap: OpSwap
    positions: torch.fx.Node | None = None  # checked at run time (``Band.assumes``)
    block_ids: torch.fx.Node | None = None  # (batch, S) image block ids
    padding_read: tuple = ()  # the calls that read the key padding as (batch, Sk), likewise
    keep_mask: bool = False  # the checked op in a checkpoint body (``mask_input_attention_forward``)
    kernel: str = ""  # what the op will run, in words (the policy's answer), for the report
    # (dtype, head_dim) of the queries where the op will try FA2's varlen calls first: the graph
    # computes their layout once for every call that reads the same padding or ids (``LAYOUT``)
    shared_layout: tuple | None = None
    sinks: torch.fx.Node | None = None  # (heads,) or (batch, heads, rows) logits, one more per row of the softmax
    softcap: float = 0.0  # scores soft-capped (FA2's softcap; 0: none)
    # The op's keyless_mean: rows that see no key get the mean of the values, as the mask's
    # finite fill gives them (0: zeros; ``ops/keyless_rows.py``).
    keyless_mean: float = 0.0
    # The checked op's (softcap, fill) where the call is a chain of ops: its fallback computes
    # that chain (``ops/chain.py``), not SDPA. None: SDPA with the mask.
    chain_fallback: tuple[float, float] | None = None

    @property
    def reason(self) -> str:
        text = self.band.describe()
        return text + (", rows without a visible key the mean of the values" if self.keyless_mean else "")


def matches(site: Site, context: Context) -> bool:
    return True  # every SDPA call gets a decision: the report counts them all


def _full_layer_choice(band: Band, node, args, query, key, context: Context) -> policy.KernelChoice:
    """The policy's answer for a band with no left bound (a full-attention layer: causal, or
    bidirectional, possibly with key padding, segment ids or image blocks): the op takes it
    where a kernel is exact and faster than what SDPA runs for it, SDPA's own ``is_causal``
    where the mask is plain attention (``plain_attention``: the kernels that would run what SDPA
    runs say so in ``never_faster``, and are not measured), else SDPA with the mask: on the
    CPU the document kernel for packed documents and padded rows above its crossover; on a
    GPU a kernel measured faster there (or by a crossover measured there)."""
    facts = call_facts(
        node,
        args,
        same_size(query.shape[-2], key.shape[-2]),
        band.key_padding is not None,
        bool(band.segments),
        band.blocks is not None,
        key.shape[-2],
        band.left,
        band.right,
        sdpa_unmasked=plain_attention(band, query, key) is not None,
        key=_op_operands(band, args, context)[0],
    )
    return policy.POLICY.choose(facts)


def _op_operands(band: Band, args, context: Context) -> tuple:
    """The K/V nodes the op reads: before transformers' repeat where it takes them so (the
    run-time checked op, ``band.assumes``, reads SDPA's)."""
    return (args["key"], args["value"]) if band.assumes else op_key_value(args, context)


def check(site: Site, context: Context) -> Plan | Kept:
    """The rewrite to make, or why this SDPA call stays as it is. The setting ``slow_kernels``
    rewrites even where the op's kernel is not known to be as fast as SDPA (never by default)."""
    node, args, evaluator = site.node, site.call, context.evaluator
    if not has_mask(args):
        return Kept(no_mask_reason(node, args, evaluator))
    problem = attention_problem(node, args, context)
    if problem is not None:
        return Kept(problem)
    query, key = example_value(args["query"]), example_value(args["key"])
    band = mask_band(args, evaluator)
    if isinstance(band, Unproven):
        band = within_checked_positions(lambda e: mask_band(args, e), evaluator) or band
    if isinstance(band, Unproven):
        return Kept(f"mask {band.reason}")
    if band.left == UNBOUNDED:
        choice = _full_layer_choice(band, node, args, query, key, context)
        if not choice.fast:
            # What the policy weighed, for the forms it has a kernel for somewhere: padded or
            # packed self-attention (not a decoding step's padded cache).
            weighed = ""
            if (band.key_padding or band.segments) and same_size(query.shape[-2], key.shape[-2]):
                weighed = f", and no kernel is faster than SDPA for it here: {choice.reason}"
            return Kept(f"mask is {band.describe()}: no sliding window{weighed}")
        return band_plan(site, band, context, full_layer=True)
    if plain_attention(band, query, key) is not None:  # the causal rule's: SDPA's own kernel, no mask
        return Kept(
            f"mask is {band.describe()}, but its {key.shape[-2]} keys all lie inside the window: no band to skip"
        )
    return band_plan(site, band, context)


def band_plan(
    site: Site,
    band: Band,
    context: Context,
    sinks: torch.fx.Node | None = None,
    spelled: bool = False,
    full_layer: bool = False,
    measured_only: bool = False,
    softcap: float = 0.0,
    fill: float | None = None,
    fill_replaces_scores: bool = False,
) -> Plan | Kept:
    """The op's plan for a call whose mask is proven ``band`` (an SDPA call, or a chain of ops
    read as one: ``spelled_attention``), or why not; ``sinks`` a (heads,) or (batch, heads,
    rows) tensor the op adds to each row's softmax as one more logit; ``softcap`` FA2's, the
    scores soft-capped before the mask (a chain's: no SDPA call has one). A row that sees no
    key is 0 with a sink: its sink's probability is 1, where the sink is above the mask's fill.
    ``spelled``: a chain of ops computes the call now (not SDPA), for the policy and the
    reasons. ``full_layer``: an SDPA call with no left bound, taken where a kernel is faster
    than SDPA for it (``_full_layer_choice``), never for a slower one. ``measured_only``: only
    where the kernel was measured as fast on this device (``KernelChoice.measured``), not by a
    static table alone. ``fill``: what an additive mask adds to hide a key (None: read from
    the call's mask); ``fill_replaces_scores``: the chain puts it in place of the scores
    (``where``, ``masked_fill``), so rows that see no key have no gradient into their scores."""
    node, args, evaluator = site.node, site.call, context.evaluator
    query, key = example_value(args["query"]), example_value(args["key"])
    computed_by = "the chain" if spelled else "SDPA"
    keyless_mean = 0.0
    if band.additive and sinks is None and _rows_may_see_no_key(band, query, key):
        if not spelled:  # measured: tests/integrations/test_recall.py
            return Kept(
                f"mask is {band.describe()}, but SDPA gives rows without a visible key an average, whose gradient "
                "differs between its backends (its CPU kernel's from its math's): no one result to compute"
            )
        if fill is None:
            fill = AdditiveMasks(evaluator).fill(args["attn_mask"])
        mask = example_value(args["attn_mask"])
        computed = example_value(node).dtype  # the sum may be in it, or upcast as softmax statistics are
        dtypes = {mask.dtype if mask.is_floating_point() else query.dtype, computed, accumulation_dtype(computed)}
        keyless = _keyless_mean(fill, dtypes, fill_replaces_scores)
        if isinstance(keyless, str):
            return Kept(f"mask is {band.describe()}, but {computed_by} gives rows without a visible key {keyless}")
        keyless_mean = keyless
    segments = segment_sources(band, evaluator, node, query, key)
    if isinstance(segments, str):
        return Kept(f"mask is {band.describe()}, but {segments}")
    padding_read = padding_read_of(band, key) if band.key_padding is not None else ()
    if isinstance(padding_read, str):
        return Kept(f"mask is {band.describe()}, but {padding_read}")
    per_batch = []
    for tensor, row0, read in (
        (band.key_padding.node if band.key_padding else None, band.key_padding_row0, padding_read),
        (band.blocks.node if band.blocks else None, band.blocks_row0, ()),
    ):
        problem = batch_tensor_problem(tensor, row0, read, node, query, key) if tensor is not None else None
        if problem is not None:
            return Kept(f"mask is {band.describe()}, but {problem}")
        per_batch.append(tensor)
    padding, blocks = per_batch
    # Ids computed from positions alone hold the same values whenever they are read.
    data_ids = [
        tensor
        for (tensor, _), ids in zip(segments, band.segments, strict=True)
        if ids.atom or evaluator.atoms.in_expr(ids.expr)
    ]
    # The checked op reads the graph's own tensors: ids computed before the body would meet
    # positions the recomputation reads again, as written, just as the op's copies would.
    recomputed = recomputed_read([padding, blocks, *data_ids], node, args["attn_mask"])
    if recomputed:
        return Kept(f"mask is {band.describe()}, but {recomputed}")
    key_node, value_node = _op_operands(band, args, context)
    facts = call_facts(
        node,
        args,
        same_size(query.shape[-2], key.shape[-2]),
        padding is not None,
        bool(segments),
        blocks is not None,
        key.shape[-2],
        band.left,
        band.right,
        key=key_node,
        softcap=softcap != 0,
        spelled=spelled,
        sdpa_unmasked=not spelled and sinks is None and plain_attention(band, query, key) is not None,
    )
    # A full layer is taken only where a kernel is fast for it (slow_kernels does not widen that).
    kernel = policy.POLICY.choose(facts, slower_allowed=context.settings.get("slow_kernels", False) and not full_layer)
    if not kernel.fast:
        return Kept(
            f"mask is {band.describe()}, but no kernel is exact and as fast as SDPA here: {kernel.reason}; "
            "slow_kernels=True rewrites anyway"
        )
    if measured_only and not kernel.measured and not context.settings.get("slow_kernels", False):
        return Kept(
            f"mask is {band.describe()}, but {computed_by} on {facts.device.type} is replaced only where a kernel is "
            f"measured on the device ({kernel.name} is chosen by a static table); measure='measure' measures it"
        )
    scale = op_scale(args)
    if band.assumes:  # the mask_input op, which reads SDPA's own key and value
        if sinks is not None:
            return Kept(
                f"mask is {band.describe()}, but attention sinks: the run-time checked op falls back to SDPA, which "
                "has none"
            )
        if keyless_mean:
            return Kept(
                f"mask is {band.describe()}, but rows without a visible key get the mean of the values: the run-time "
                "checked op falls back to SDPA without it"
            )
        if blocks is not None or padding_read:
            return Kept(f"mask is {band.describe()}: the run-time checked op has no image blocks or shifted padding")
        chain = (softcap, fill if fill is not None else -math.inf) if spelled else None
        return _checked_plan(site, band, scale, padding, segments, node.graph in context.bodies, kernel.name, chain)
    # The op saves its padding and block ids for the backward: hand it tensors of its own
    # (``!= 0``, also a bool's copy; ``private_copy``, which the partitioner cannot recompute
    # from the caller's tensor), which the caller cannot write between forward and backward.
    fake_padding = fake_result(lambda p: read_through(p, padding_read) != 0, padding) if padding is not None else None
    fake_blocks = fake_result(PRIVATE_COPY, blocks) if blocks is not None else None
    fake_segments = None
    if segments:
        reads = [read for _, read in segments]
        fake_segments = fake_result(lambda *ids: joined_ids(*ids, reads=reads, private=True), *(t for t, _ in segments))
    window = (band.left, band.right, scale)
    trailing = batch_operands(
        fake_padding, fake_segments, fake_blocks, sinks=example_value(sinks), softcap=softcap, keyless_mean=keyless_mean
    )
    operands = (args["query"], key_node, value_node, *window, *trailing)
    swap = OpSwap(node, OP, args, operands)
    varlen = isinstance(kernel.kernel, fa2.FA2Kernel) and facts.batch_masks and facts.same_lengths
    return Plan(
        site,
        band,
        scale,
        key_node,
        value_node,
        padding,
        segments,
        swap,
        block_ids=blocks,
        padding_read=padding_read,
        kernel=kernel.name,
        shared_layout=(facts.dtype, facts.head_dim) if varlen else None,
        sinks=sinks,
        softcap=softcap,
        keyless_mean=keyless_mean,
    )


def _keyless_mean(fill: float | None, dtypes: set, replaces_scores: bool) -> float | str:
    """The op's ``keyless_mean`` for rows that see no key where the mask hides keys with
    ``fill``, computed in ``dtypes``: the bound below which the fill hides every score alike
    (each row's softmax is then uniform: the mean of the values), or what such a row gets."""
    if fill is not None and math.isinf(fill):
        return "the softmax of an -inf fill (NaN) where the op gives 0"
    bound = hidden_alike_below(fill, sorted(dtypes, key=str)) if fill is not None else None
    if bound is None:
        shown = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        return f"a softmax over a fill ({fill}) that is not finite in each of {shown}, where the op gives 0"
    if replaces_scores:
        return "the mean of the values with no gradient into their scores (the fill replaces them), which the op lacks"
    return bound


def _rows_may_see_no_key(band: Band, query, key) -> bool:
    """Whether a row of the call may see no key, where an additive mask's softmax averages
    what the op zeroes. Not without batch terms where Sq <= Sk (each row sees the keys up to
    its own, bottom-right aligned), nor where every row sees its own key: Sq == Sk, both window
    sides hold the diagonal, and no key padding, which alone can hide a row's own key (the op's
    segment ids are integers, equal to themselves; an image block only shows more keys)."""
    if not statically_known_true(query.shape[-2] <= key.shape[-2]):
        return True
    if not (band.key_padding or band.segments or band.blocks):
        return False
    holds_diagonal = all(side == UNBOUNDED or side >= 0 for side in (band.left, band.right))
    same_lengths = statically_known_true(query.shape[-2] == key.shape[-2])
    return band.key_padding is not None or not (holds_diagonal and same_lengths)


def _checked_plan(
    site: Site,
    band: Band,
    scale: float,
    padding,
    segments: tuple,
    in_body: bool,
    kernel: str,
    chain: tuple[float, float] | None = None,
) -> Plan | Kept:
    """The plan for a band that holds where positions lie in POSITION_RANGE: the mask_input op,
    with facts from ``position_facts`` and the segment ids (the graph's own; two sets, a packed
    batch's chunks, as one), SDPA with the mask as its exact fallback. The op takes the mask as
    SDPA does: (batch, 1, S, S) bool. ``chain``: (softcap, fill) of attention spelled out in ops,
    whose fallback is that chain (a float mask added to the scores, or a bool one whose hidden
    scores its fill replaces), not SDPA."""
    args = site.call
    mask = example_value(args["attn_mask"])
    query = example_value(args["query"])
    if not (
        (mask.dtype == torch.bool or (chain is not None and mask.is_floating_point()))
        and mask.dim() == 4
        and same_size(mask.shape[1], 1)
        and same_size(mask.shape[0], query.shape[0])
    ):
        return Kept(
            f"mask is {band.describe()}, but not a (batch, 1, S, S) bool tensor the run-time check can fall back to"
        )
    (positions,) = {atom.node for atom in band.assumes}
    if positions.graph is not site.node.graph and not called_from(site.node.graph, positions.graph):
        return Kept(f"mask is {band.describe()}, but {positions.name} is in a graph two levels up")
    settings = (scale, bool(args["enable_gqa"]))
    window = (*POSITION_RANGE, band.left, band.right)
    # The graph's own ids for one set: the op runs SDPA on the same call where the check fails.
    reads = [read for _, read in segments]
    ids = fake_result(lambda *t: joined_ids(*t, reads=reads, private=False), *(t for t, _ in segments))
    fake_facts = fake_result(lambda p, *pad: POSITION_FACTS(p, ids, *window, *pad), positions, *given(padding))
    operands = (
        args["query"],
        args["key"],
        args["value"],
        args["attn_mask"],
        *fake_facts,
        *settings,
        ids,
        in_body,
        *_chain_operands(chain),
    )
    swap = OpSwap(site.node, CHECKED_OP, args, operands)
    fallback = "the chain of ops" if chain is not None else "SDPA with the mask"
    checked = f"{kernel}, or {fallback} where the positions fail their check"
    return Plan(
        site,
        band,
        scale,
        args["key"],
        args["value"],
        padding,
        segments,
        swap,
        positions,
        keep_mask=in_body,
        kernel=checked,
        chain_fallback=chain,
    )


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    return swap_in(plan, context)


def swap_in(plan: Plan, context: Context) -> set[torch.fx.Node]:
    """The op in place of the plan's call (SDPA, or the spelled-out chain's last matmul)."""
    if plan.positions is not None:
        return _replace_checked(plan)
    node = plan.site.node
    args = plan.site.call
    maybe_dead = {args["attn_mask"], args["key"], args["value"]}
    if plan.key is not args["key"]:
        maybe_dead |= repeat_chain(args["key"], context) | repeat_chain(args["value"], context)
    segments = None
    if plan.segments:
        first, *other = (read_in_graph(tensor, read, node) for tensor, read in plan.segments)
        segments = shared_copy(first, node, SEGMENT_PAIRS, *other) if other else shared_copy(first, node, PRIVATE_COPY)
    padding = None
    if plan.key_padding is not None:
        padding = shared_copy(read_in_graph(plan.key_padding, plan.padding_read, node), node, operator.ne, 0)
    blocks = own_copy(plan.block_ids, node, PRIVATE_COPY) if plan.block_ids is not None else None
    window = (plan.band.left, plan.band.right, plan.scale)
    layout = (None, None)
    if plan.shared_layout is not None:
        layout = layout_of(padding, segments, plan.band.left, plan.band.right, *plan.shared_layout, node)
    trailing = batch_operands(padding, segments, blocks, layout, plan.sinks, plan.softcap, plan.keyless_mean)
    plan.swap.insert((args["query"], plan.key, plan.value, *window, *trailing))
    return maybe_dead


def _replace_checked(plan: Plan) -> set[torch.fx.Node]:
    """``position_facts`` once per (positions, ids, window) in the graph that calls SDPA, then
    the mask_input op in SDPA's place. The mask stays: it is the fallback's."""
    node, args = plan.site.node, plan.site.call
    graph = node.graph
    first, *other = (read_in_graph(tensor, read, node) for tensor, read in plan.segments)
    ids = first
    if other:  # one pair op per graph for the same two tensors, as position_facts below
        ids = next(
            (
                user
                for user in first.users
                if user.target is SEGMENT_PAIRS and user.args == (first, *other) and defined_before(user, node)
            ),
            None,
        )
        ids = ids or own_copy(first, node, SEGMENT_PAIRS, *other)
    positions, segments, *padding = (
        pass_into_body(t, graph) if t.graph is not graph else t for t in given(plan.positions, ids, plan.key_padding)
    )
    facts_args = (positions, segments, *POSITION_RANGE, plan.band.left, plan.band.right, *padding)
    facts = next(
        (user for user in positions.users if user.target is POSITION_FACTS and user.args == facts_args and user < node),
        None,
    )
    if facts is None:
        fake = fake_result(
            lambda p, s, *pad: POSITION_FACTS(p, s, *facts_args[2:6], *pad), positions, segments, *padding
        )
        with graph.inserting_before(node):
            facts = graph.call_function(POSITION_FACTS, facts_args)
            parts = [graph.call_function(operator.getitem, (facts, index)) for index in (0, 1)]
        facts.meta["example_value"] = fake
        for index, part in enumerate(parts):
            part.meta["example_value"] = fake[index]
    else:
        parts = sorted((user for user in facts.users if user.target is operator.getitem), key=lambda user: user.args[1])
    settings = (plan.scale, bool(args["enable_gqa"]), segments, plan.keep_mask)
    operands = (args["query"], args["key"], args["value"], args["attn_mask"], *parts, *settings)
    plan.swap.insert((*operands, *_chain_operands(plan.chain_fallback)))
    return set()


def _chain_operands(chain: tuple[float, float] | None) -> tuple:
    """The checked op's trailing operands for a chain's (softcap, fill): no sinks, the cap,
    chain=True, the fill; none for SDPA's fallback."""
    return (None, chain[0], True, chain[1]) if chain is not None else ()
