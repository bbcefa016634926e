"""The mask-certificate rule: under ``context_parallel``, a graph that returns a mask it built
(a graph break between the masks and the decoder blocks: FSDP2 around each block with the
root compiled) files what it proved of it, for the graphs that attend with it.

A block's graph receives such a mask as an input, and a shard's mask cannot show the whole
sequence's (a window at least as long as the shard looks like full causal attention): only
the graph that builds it can prove what it is over the whole sequence.

Match: the top-level graph's output, when the setting is on and some value it returns is a
       (batch, 1, Sq, Sk) bool tensor (Sq and Sk may be two symbols: the graph need not relate them).
Check: each such mask is proven as the sharded rule proves an SDPA call's mask
       (``sharded_attention.shardable``: a causal window, possibly AND key padding AND packed
       sequences from position ids), over a symbolic length the traced program assumes
       nothing of, with query i aligned on key i (``certify_mask`` files it only where Sq == Sk).
Replace: each proven mask returned as ``certify_mask(mask, left, padding != 0, positions)``,
       a copy the op files with what the proof found (``ops/context_parallel.py``); the
       sharded rule's op takes a mask input only where it is that very tensor, unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graphs import example_value
from ..proof import Unproven, prove_band
from ..report import MASK_CERTIFICATE, call_site
from ..sizes import branches_on, same_size
from .attention import insert_before, within_checked_positions
from .base import Context, Kept, Site
from .sharded_attention import SETTING, shardable

NAME = "mask_certificate"
TARGETS = {("output", "output"): MASK_CERTIFICATE}
CERTIFY = torch.ops.compile_pass.certify_mask.default


@dataclass(frozen=True)
class Proven:
    mask: torch.fx.Node
    name: str  # where the report says it was built
    left: int
    key_padding: torch.fx.Node | None
    positions: torch.fx.Node | None
    described: str


@dataclass(frozen=True)
class Plan:
    site: Site
    masks: tuple[Proven, ...]
    kept: tuple[str, ...]  # why the other masks it returns are not certified

    @property
    def reason(self) -> str:
        certified = "; ".join(f"{proven.name}: {proven.described}" for proven in self.masks)
        kept = f" (not certified: {'; '.join(self.kept)})" if self.kept else ""
        return f"masks certified for the graphs that attend with them under context parallel: {certified}{kept}"


def matches(site: Site, context: Context) -> bool:
    return (
        context.settings.get(SETTING, False) is not False and site.node.graph not in context.bodies
        and bool(_returned_masks(site))
    )


def check(site: Site, context: Context) -> Plan | Kept:
    proven, kept = [], []
    for mask in _returned_masks(site):
        found = _prove(mask, context)
        if isinstance(found, str):
            kept.append(f"{_name(mask)}: {found}")
        else:
            proven.append(found)
    if not proven:
        return Kept(f"context parallel: no mask this graph returns is certified: {'; '.join(kept)}")
    return Plan(site, tuple(proven), tuple(kept))


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    output = plan.site.node
    for proven in plan.masks:
        padding = None if proven.key_padding is None else insert_before(output, operator.ne, proven.key_padding, 0)
        certified = insert_before(output, CERTIFY, proven.mask, proven.left, padding, proven.positions)
        output.replace_input_with(proven.mask, certified)
    return set()


def _returned_masks(site: Site) -> list[torch.fx.Node]:
    """The (batch, 1, Sq, Sk) bool tensors the graph returns, each once."""
    found: dict[torch.fx.Node, None] = {}
    torch.fx.node.map_arg(site.call["result"], lambda node: found.setdefault(node))
    return [node for node in found if _is_mask(example_value(node))]


def _is_mask(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4 and same_size(value.shape[1], 1)


def _prove(mask: torch.fx.Node, context: Context) -> Proven | str:
    """What ``mask`` is over the whole sequence, or why that is not proven."""
    source = context.subclassed.get(mask)
    if source is not None:
        return "computed from a tensor subclass input"
    shape = example_value(mask).shape
    lengths = [branches_on(size) for size in shape[-2:]]
    assumed = None if None in lengths else [guard for guards in lengths for guard in dict.fromkeys(guards)]
    if assumed is None:
        return (
            "the sequence length is static in this graph, so a window computed from it would look constant; mark the "
            "sequence dimension of the inputs dynamic (torch._dynamo.mark_dynamic(tensor, 1))"
        )
    if assumed:
        return f"the traced program assumes of the sequence length: {', '.join(assumed)}"

    def prove(evaluator):  # queries and keys aligned: certify_mask files only a mask with Sq == Sk
        return prove_band(evaluator, mask, key_offset=0)

    # The mask is still computed, so an index past the end raises there, unless inductor is
    # told not to check them.
    from torch._inductor import config

    evaluator = context.evaluator.with_index_bounds_checked() if config.assert_indirect_indexing else context.evaluator
    band = prove(evaluator)
    if isinstance(band, Unproven):  # transformers' packed masks hold for positions in POSITION_RANGE
        band = within_checked_positions(prove, evaluator) or band
    # Past a graph break Dynamo may give the mask's batch and the padding's two symbols:
    # certify_mask files the mask only where they are equal.
    found = shardable(band, mask.graph, None, shape[-1])
    if isinstance(found, str):
        return found
    return Proven(mask, _name(mask), band.left, *found, band.describe())


def _name(mask: torch.fx.Node) -> str:
    """The mask as the report names it: the source line that built it, where Dynamo kept one."""
    return f"the mask of {call_site(mask).source or mask.name}"
