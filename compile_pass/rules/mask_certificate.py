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
       sequences from position ids), over symbolic lengths, where the traced program
       assumes nothing of any size, with query i aligned on key i (``certify_mask`` files it only where Sq == Sk).
       Two symbols for one size (Dynamo's, past a graph break) are related only at run time:
       an index end the proof cannot show below the end is proven with the sizes that
       ``certify_mask`` checks equal before it files the mask (``proof.unproven_end``).
Replace: each proven mask returned as ``certify_mask(mask, left, padding != 0, positions)``,
       a copy the op files with what the proof found (``ops/mask_certificate.py``); the
       sharded rule's op takes a mask input only where it is that very tensor, unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graphs import example_value
from ..proof import Unproven, prove_band, unproven_end
from ..report import MASK_CERTIFICATE, call_site
from ..sizes import branches_on, branches_on_any_size, same_size
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
        context.settings.get(SETTING, False) is not False
        and site.node.graph not in context.bodies
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
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.bool
        and value.dim() == 4
        and same_size(value.shape[1], 1)
    )


def _prove(mask: torch.fx.Node, context: Context) -> Proven | str:
    """What ``mask`` is over the whole sequence, or why that is not proven."""
    source = context.computed_from_subclass.get(mask)
    if source is not None:
        return "computed from a tensor subclass input"
    shape = example_value(mask).shape
    if any(branches_on(size) is None for size in shape[-2:]):
        return (
            "the sequence length is static in this graph, so a window computed from it would look constant; mark the "
            "sequence dimension of the inputs dynamic (torch._dynamo.mark_dynamic(tensor, 1))"
        )
    # A window chosen by a branch on any size would be the shard's: with the lengths two
    # symbols or more, every size the traced program has is asked.
    assumed = dict.fromkeys(branches_on_any_size(shape[-1]) or ())
    if assumed:
        return f"the traced program assumes of the sizes: {', '.join(assumed)}"

    def prove(evaluator):  # queries and keys aligned: certify_mask files only a mask with Sq == Sk
        return prove_band(evaluator, mask, key_offset=0)

    # Past a graph break Dynamo may give one size two symbols (the mask's batch and the
    # padding's rows): indexing by one within the other is proven under the equalities that
    # certify_mask checks before it files the mask.
    evaluator = context.evaluator.deferring_index_ends()
    band = prove(evaluator)
    if isinstance(band, Unproven):  # transformers' packed masks hold for positions in POSITION_RANGE
        band = within_checked_positions(prove, evaluator) or band
    found = shardable(band, mask.graph, None, shape[-1])
    if isinstance(found, str):
        return found
    padding, positions = found
    checked = [(shape[-2], shape[-1])]  # certify_mask's checks: Sq == Sk, padding (batch, Sk), positions (.., Sk)
    if padding is not None:
        # certify_mask files nothing for a padding of another rank (it compares the whole shape)
        checked += zip(example_value(padding).shape, (shape[0], shape[-1]), strict=False)
    if positions is not None:
        checked.append((example_value(positions).shape[1], shape[-1]))
    end = unproven_end(evaluator, checked, mask)
    if end is not None:
        return f"index not provably in range ({end} >= 0, with the sizes certify_mask checks equal)"
    return Proven(mask, _name(mask), band.left, padding, positions, band.describe())


def _name(mask: torch.fx.Node) -> str:
    """The mask as the report names it: the source line that built it, where Dynamo kept one."""
    return f"the mask of {call_site(mask).source or mask.name}"
