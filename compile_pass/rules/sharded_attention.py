"""The sharded-attention rule: with the setting ``context_parallel``, the graph runs on one
shard of the sequence per rank of a process group (the default group, or the one the setting
names: a ProcessGroup or a DeviceMesh dimension), contiguous or head-tail as the setting
``context_parallel_layout`` says (the user shards input_ids, position_ids, attention_mask and
labels so: ``ops.context_parallel.shard_sequence``), and every SDPA call must attend over the
whole sequence.

Match: every SDPA call, when the setting is on.
Check: the call is one the op computes (``attention.attention_problem``), Sq == Sk on the shard,
       and its mask is proven a causal window (left, 0) over token indices, possibly AND a
       (batch, keys) key padding, AND packed sequences whose ids transformers computes from a
       position-ids input (proven for positions in POSITION_RANGE, which the op checks on every
       rank). Such a mask depends on token indices only through kv - q and on positions only
       through whether a sequence starts between the two, so the whole sequence's mask is the
       same formula over global indices and the whole sequence's positions (the padding and
       the positions the shards' side by side). Image blocks, windows with a right side and
       additive masks are not read here.
       A mask that is a graph input (built in another graph: FSDP2 around each block with the
       root compiled, a graph break) is taken only as certified: the graph that built it proved
       it so and filed it (``rules/mask_certificate.py``); the op checks at run time, on every
       rank together, that it is that very tensor, unchanged, and raises otherwise.
Replace: ``context_parallel_attention_forward(q, k, v, left, scale, group, rank, world, layout, padding,
       positions)[0]``: the halo of the chunks before each of the rank's (point to point) or,
       for full attention, an all-gather (``parallel/halo_exchange.py``), on K/V before
       transformers' GQA repeat when it is recognised, so the repeat is not sent. A certified
       mask: ``certified_attention_forward(q, k, v, mask, scale, group, rank, world, layout)[0]``.
A call this rule keeps would attend within the shard only: the backend refuses to compile
such a graph rather than run it (``backend.rewrite``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx

from ..graphs import example_value, fake_result
from ..kernels import policy
from ..parallel.shard_layout import CONTIGUOUS, group_place, halo_hops, process_group
from ..proof import AtomKind, Band, Unproven, input_name
from ..sizes import branches_on, same_size, traced_value
from ..window import UNBOUNDED
from .attention import (
    SDPA_TARGETS,
    OpSwap,
    attention_problem,
    call_facts,
    has_mask,
    mask_band,
    op_key_value,
    op_scale,
    own_copy,
    repeat_chain,
    within_checked_positions,
)
from .base import Context, Kept, Site

NAME = "sharded_attention"
TARGETS = SDPA_TARGETS
OP = torch.ops.compile_pass.context_parallel_attention_forward.default
CERTIFIED_OP = torch.ops.compile_pass.certified_attention_forward.default
SETTING = "context_parallel"
LAYOUT_SETTING = "context_parallel_layout"


@dataclass(frozen=True)
class Plan:
    site: Site
    band: Band
    scale: float
    key: torch.fx.Node
    value: torch.fx.Node
    key_padding: torch.fx.Node | None
    positions: torch.fx.Node | None  # packed sequences' position ids
    group: str  # the process group's name
    place: tuple[int, int]  # (rank, world size) in that group, as traced
    layout: str  # which positions each rank holds (parallel/shard_layout.py)
    shard: int | None  # the shard's length as traced
    swap: OpSwap
    kernel: str  # what the op will run on each shard, in words, for the report

    @property
    def reason(self) -> str:
        left, world = self.band.left, self.place[1]
        if left == UNBOUNDED:
            how = "keys and values all-gathered"
        elif self.layout != CONTIGUOUS:
            how = f"each of the rank's chunks takes a halo of {left} keys from the chunks before it, point to point"
        elif self.shard is None or left <= self.shard:
            how = f"a halo of {left} keys from the previous rank, point to point"
        elif math.ceil(left / self.shard) < world:
            how = f"a halo of {left} keys over {len(halo_hops(self.shard, left, world))} ranks, point to point"
        else:  # what moves is every earlier shard, not the window
            earlier = f"{world - 1} earlier shard{'s' if world > 2 else ''}"
            how = (
                f"the window ({left} keys) covers the {earlier} of {self.shard} traced positions: each rank sends its "
                "whole shard to every rank after it, point to point"
            )
        layout = "" if self.layout == CONTIGUOUS else f" in the {self.layout} layout"
        return f"context parallel over {world} ranks{layout}: {self.band.describe()}, {how}"


def matches(site: Site, context: Context) -> bool:
    return context.settings.get(SETTING, False) is not False


def check(site: Site, context: Context) -> Plan | Kept:
    node, args = site.node, site.call
    if not (dist.is_available() and dist.is_initialized()):
        return Kept("context parallel needs torch.distributed initialised before the model compiles")
    if not has_mask(args):
        return Kept(f"context parallel: no mask (is_causal={args['is_causal']}) is not a proven causal window")
    problem = attention_problem(node, args, context)
    if problem is not None:
        return Kept(f"context parallel: {problem}")
    query, key = example_value(args["query"]), example_value(args["key"])
    if not same_size(query.shape[-2], key.shape[-2]):
        return Kept("context parallel: Sq != Sk on the shard (decoding is not sharded)")
    # The shard's program must be the whole sequence's: a window, or a branch, that depends
    # on the length would be the shard's. With the length a symbol, a window computed from it
    # keeps the symbol (and the band is not proven), and a branch on it leaves a guard.
    assumed = branches_on(query.shape[-2])
    if assumed is None:
        return Kept(
            "context parallel: the sequence length is static in this graph, so a window computed from it would "
            "look constant; mark the sequence dimension of the inputs dynamic (torch._dynamo.mark_dynamic(tensor, 1))"
        )
    if assumed:
        return Kept(f"context parallel: the traced program assumes of the sequence length: {', '.join(assumed)}")
    source = context.evaluator.source_of(args["attn_mask"])
    if source.op == "placeholder":
        return _check_certified(site, context, source)
    band = mask_band(args, context.evaluator)
    if isinstance(band, Unproven):  # transformers' packed masks hold for positions in POSITION_RANGE
        band = within_checked_positions(lambda e: mask_band(args, e), context.evaluator) or band
    found = shardable(band, node.graph, query.shape[0], key.shape[-2])
    if isinstance(found, str):
        return Kept(f"context parallel: {found}")
    padding, positions = found
    # Halo keys make Sq != Sk on every shard but the first; with padding or segment ids the op
    # queries the halo's positions too (Sq == Sk).
    batch_masks = padding is not None or positions is not None
    facts = call_facts(node, args, batch_masks, padding is not None, positions is not None)
    kernel = policy.POLICY.choose(facts)
    if not kernel.fast:
        return Kept(f"context parallel: no kernel is exact and as fast as SDPA here: {kernel.reason}")
    scale = op_scale(args)
    key_node, value_node = op_key_value(args, context)
    fake_padding = fake_result(lambda p: p != 0, padding) if padding is not None else None
    fake_positions = fake_result(torch.clone, positions) if positions is not None else None
    group = process_group(context.settings[SETTING])
    place = group_place(group)
    operands = (
        args["query"],
        key_node,
        value_node,
        band.left,
        scale,
        group.group_name,
        *place,
        context.settings[LAYOUT_SETTING],
        fake_padding,
        fake_positions,
    )
    swap = OpSwap(node, OP, args, operands)
    shard = traced_value(key.shape[-2])
    return Plan(
        site,
        band,
        scale,
        key_node,
        value_node,
        padding,
        positions,
        group.group_name,
        place,
        context.settings[LAYOUT_SETTING],
        shard,
        swap,
        kernel.name,
    )


@dataclass(frozen=True)
class CertifiedPlan:
    """A call whose mask is an input: the op takes the window, padding and positions from the
    mask's certificate at run time (``parallel/context_parallel.py``)."""

    site: Site
    source: torch.fx.Node  # the graph input the mask comes from
    scale: float
    key: torch.fx.Node
    value: torch.fx.Node
    group: str
    place: tuple[int, int]
    layout: str
    swap: OpSwap
    kernel: str

    @property
    def reason(self) -> str:
        layout = "" if self.layout == CONTIGUOUS else f" in the {self.layout} layout"
        return (
            f"context parallel over {self.place[1]} ranks{layout}: mask from input {input_name(self.source)}, as the "
            "graph that built it proved it (checked at run time: that very tensor, unchanged); the halo its window "
            "needs, point to point, exchanged again in the backward"
        )


def _check_certified(site: Site, context: Context, source: torch.fx.Node) -> CertifiedPlan | Kept:
    """A mask built in another graph (FSDP2 around each block, a graph break): a shard's mask
    cannot show the whole sequence's, so the op takes only a mask that the graph that built it
    proved and filed (``mask_certificate``), and raises on every rank otherwise."""
    node, args = site.node, site.call
    query, key, mask = (example_value(args[name]) for name in ("query", "key", "attn_mask"))
    if not (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and same_size(mask.shape[1], 1)
        and same_size(mask.shape[-2], query.shape[-2])
        and same_size(mask.shape[-1], key.shape[-2])
        and (same_size(mask.shape[0], 1) or same_size(mask.shape[0], query.shape[0]))
    ):
        return Kept(f"context parallel: mask from input {input_name(source)} is not a (batch, 1, Sq, Sk) bool tensor")
    writer = context.evaluator.writes.writer(source)
    if writer is not None:
        return Kept(f"context parallel: mask input {input_name(source)}: {writer}")
    # The certificate's padding and positions are known at run time only: each form the op may
    # run must have a fast kernel (padding and packed documents together, which FA2's varlen op
    # does not take, run on the op's exact fallback there).
    forms = (
        call_facts(node, args, False),
        call_facts(node, args, True, key_padding=True),
        call_facts(node, args, True, segment_ids=True),
    )
    kernels = [policy.POLICY.choose(form) for form in forms]
    slow = next((kernel for kernel in kernels if not kernel.fast), None)
    if slow is not None:
        return Kept(f"context parallel: no kernel is exact and as fast as SDPA here: {slow.reason}")
    scale = op_scale(args)
    key_node, value_node = op_key_value(args, context)
    group = process_group(context.settings[SETTING])
    place = group_place(group)
    layout = context.settings[LAYOUT_SETTING]
    operands = (args["query"], key_node, value_node, args["attn_mask"], scale, group.group_name, *place, layout)
    swap = OpSwap(node, CERTIFIED_OP, args, operands)
    kernel = "; ".join(dict.fromkeys(kernel.name for kernel in kernels))
    return CertifiedPlan(site, source, scale, key_node, value_node, group.group_name, place, layout, swap, kernel)


def shardable(
    band: Band | Unproven, graph: torch.fx.Graph, batch, keys
) -> tuple[torch.fx.Node | None, torch.fx.Node | None] | str:
    """(the key padding, the packed sequences' position ids), each a node of ``graph`` or None,
    of a mask proven ``band`` over ``keys`` keys in a batch of ``batch``, which the op computes
    over the whole sequence; or why it does not. ``batch`` None: the batch sizes are checked
    at run time (``certify_mask``)."""

    def whole_batch(size) -> bool:
        return batch is None or same_size(size, batch)

    if isinstance(band, Unproven):
        return f"mask {band.reason}"
    positions = _packed_positions(band)
    if (
        band.right != 0
        or band.additive
        or positions is None
        or Band(band.left, 0, band.key_padding, band.key_padding_row0, segments=band.segments, assumes=band.assumes)
        != band
    ):
        return (
            f"mask is {band.describe()}; only a causal window AND key padding read at the keys' own positions AND "
            "packed sequences from position ids is sharded"
        )
    if positions is not False:
        shape = example_value(positions).shape
        if positions.graph is not graph or not (
            len(shape) == 2
            and (same_size(shape[0], 1) or whole_batch(shape[0]) and not band.segments[0].atom.source_row0)
            and same_size(shape[1], keys)
        ):
            return f"mask is {band.describe()}, but {positions.name} is not (batch or 1, keys) here"
    padding = band.key_padding.node if band.key_padding is not None else None
    if padding is not None:
        shape = example_value(padding).shape
        if padding.graph is not graph or band.key_padding_row0 and not same_size(shape[0], 1):
            return f"mask is {band.describe()}, but the padding is not read as (batch, keys) here"
        if not (len(shape) == 2 and whole_batch(shape[0]) and same_size(shape[1], keys)):
            return f"mask is {band.describe()}, but {padding.name} is not (batch, keys)"
    return padding, positions if positions is not False else None


def _packed_positions(band: Band) -> torch.fx.Node | None | bool:
    """The position ids whose packed sequences the band stays inside (transformers' ids from
    them: ``proof/lemmas.py``), False where it has no segments, None where its segments or
    assumptions are anything else."""
    if not band.segments:
        return False if not band.assumes else None
    (ids,) = band.segments if len(band.segments) == 1 else (None,)
    if ids is None or ids.atom is None or ids.atom.kind is not AtomKind.SEGMENTS:
        return None
    positions = ids.atom.source.node
    if any(atom.node is not positions for atom in band.assumes):
        return None
    return positions


def replace(plan: Plan | CertifiedPlan, context: Context) -> set[torch.fx.Node]:
    node, args = plan.site.node, plan.site.call
    maybe_dead = {args["key"], args["value"]}
    if plan.key is not args["key"]:
        maybe_dead |= repeat_chain(args["key"], context) | repeat_chain(args["value"], context)
    if isinstance(plan, CertifiedPlan):
        plan.swap.insert(
            (args["query"], plan.key, plan.value, args["attn_mask"], plan.scale, plan.group, *plan.place, plan.layout)
        )
        return maybe_dead
    maybe_dead.add(args["attn_mask"])
    padding = None if plan.key_padding is None else own_copy(plan.key_padding, node, operator.ne, 0)
    positions = None if plan.positions is None else own_copy(plan.positions, node, torch.clone)
    plan.swap.insert(
        (
            args["query"],
            plan.key,
            plan.value,
            plan.band.left,
            plan.scale,
            plan.group,
            *plan.place,
            plan.layout,
            padding,
            positions,
        )
    )
    return maybe_dead
