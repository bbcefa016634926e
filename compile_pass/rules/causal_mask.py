"""The causal rule: SDPA whose mask SDPA can do without -> SDPA with ``is_causal=True``, or
with no mask at all.

Full-attention layers of sliding-window models get an explicit (batch, 1, S, S) causal
mask; decoding steps get a mask that, once the cache holds at most a window, shows every
key. When the proof shows the mask is exactly ``kv <= q`` with Sq == Sk, SDPA's own causal
mode computes the same attention without reading (or keeping) an S*S mask; when it shows
every key is visible to every query, the mask is dropped.

Match: SDPA with a mask.
Check: ``is_causal=False``, the mask proven to be the band (unbounded, 0) with Sq == Sk
       proven, or a band that leaves every key visible (unbounded both sides, or unbounded
       left with one query row, which FA2's alignment puts at the last key); no key padding
       or packed sequences. A left side that reaches key 0 from every row at the graph's
       static sizes counts as unbounded (``attention.plain_attention``).
Replace: the same SDPA call with ``attn_mask=None`` and ``is_causal=True`` (causal) or
         ``False`` (all visible); dropout, scale and GQA arguments are untouched. The mask's
         construction is erased if nothing else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from ..graphs import example_value
from ..proof import Unproven
from .attention import SDPA_TARGETS, has_mask, mask_band, plain_attention, sdpa_mask_problem
from .base import Context, Kept, Site

NAME = "causal_mask"
TARGETS = SDPA_TARGETS


@dataclass(frozen=True)
class Plan:
    site: Site
    is_causal: bool  # True: causal; False: every key visible

    @property
    def reason(self) -> str:
        return "plain causal mask -> is_causal=True" if self.is_causal else "mask shows every key -> no mask"


def matches(site: Site, context: Context) -> bool:
    return has_mask(site.call)


def check(site: Site, context: Context) -> Plan | Kept:
    args = site.call
    problem = sdpa_mask_problem(args)
    if problem is not None:
        return Kept(problem)
    query, key = example_value(args["query"]), example_value(args["key"])
    band = mask_band(args, context.evaluator)
    if isinstance(band, Unproven):
        return Kept(f"mask {band.reason}")
    is_causal = plain_attention(band, query, key)
    if is_causal is not None:
        return Plan(site, is_causal)
    return Kept(f"mask is {band.describe()}, not plain causal")


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    node, args = plan.site.node, plan.site.call
    node.args = (args["query"], args["key"], args["value"])
    node.kwargs = {
        **{name: value for name, value in args.arguments.items() if name not in ("query", "key", "value")},
        "attn_mask": None,
        "is_causal": plan.is_causal,
    }
    return {args["attn_mask"]}
