"""Masks that cross graph boundaries: where a graph receives a mask as an input and calls SDPA
with it.

Under FSDP2, regional compilation, graph breaks and ``generate()`` with a static cache, the
graph that builds a mask is not the graph that calls SDPA with it, and no proof can see how
the mask was built. Its band is read at run time, from the mask as it is at each graph call:
nothing known about an input's contents outlives the call that read it (torch's version
counter misses writes through ``.data``, storage, dlpack, numpy views and other threads).

Match: SDPA whose mask is a graph input (through checkpoint bodies).
Check: the call is one the op computes (as for the sliding rule: plain tensors, no subclass),
       the mask a (batch, 1, Sq, Sk) bool tensor, the graph writes no alias of it, and the kernel
       policy has a fast kernel here.
Replace: ``mask_facts(mask)`` once per mask input, at the top of the graph that calls SDPA
       (one exact check and one host sync per graph call; a checkpoint body checks on each
       run, its recomputation included), and each call by
       ``mask_input_attention_forward(q, k, v, mask, facts, key_padding, scale, enable_gqa)[0]``,
       which runs the band kernel, SDPA's causal or unmasked mode, or SDPA with the mask
       (``ops/runtime_mask.py``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graphs import example_value, fake_result
from ..kernels import policy
from ..proof import input_name
from ..sizes import same_size
from .attention import SDPA_TARGETS, OpSwap, attention_problem, call_facts, has_mask, op_scale
from .base import Context, Kept, Site

NAME = "mask_input"
TARGETS = SDPA_TARGETS
OP = torch.ops.compile_pass.mask_input_attention_forward.default
FACTS = torch.ops.compile_pass.mask_facts.default


@dataclass(frozen=True)
class Plan:
    site: Site
    source: torch.fx.Node  # the graph input the mask comes from
    settings: tuple  # (scale, enable_gqa)
    swap: OpSwap
    kernel: str  # what the op will run, in words, for the report

    @property
    def reason(self) -> str:
        return f"mask from input {input_name(self.source)}: its band is read at run time, once per graph call"


def matches(site: Site, context: Context) -> bool:
    return has_mask(site.call) and context.evaluator.source_of(site.call["attn_mask"]).op == "placeholder"


def check(site: Site, context: Context) -> Plan | Kept:
    node, args = site.node, site.call
    source = context.evaluator.source_of(args["attn_mask"])
    mask = example_value(source)
    if not (
        isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and same_size(mask.shape[1], 1)
    ):
        return Kept("mask input is not a (batch, 1, Sq, Sk) bool tensor")
    writer = context.evaluator.writes.writer(source)
    if writer is not None:
        return Kept(f"mask input {input_name(source)}: {writer}")  # as the proof says it
    problem = attention_problem(node, args, context)
    if problem is not None:
        return Kept(problem)
    query = example_value(args["query"])
    # The band the check finds may carry key padding; its window is known only at run time.
    # The keys are given for the short-call crossover (a guard where the length is symbolic).
    key = example_value(args["key"])
    facts = call_facts(node, args, same_size(query.shape[-2], key.shape[-2]), key_padding=True, keys=key.shape[-2])
    kernel = policy.POLICY.choose(facts)
    if not kernel.fast:
        return Kept(f"mask is an input, and no kernel is exact and as fast as SDPA here: {kernel.reason}")
    # segment ids (none), and whether the mask is kept for a checkpoint body's recomputation
    settings = (op_scale(args), bool(args["enable_gqa"]), None, node.graph in context.bodies)
    fake_facts = fake_result(lambda m: FACTS(m), args["attn_mask"])
    swap = OpSwap(
        node, OP, args, (args["query"], args["key"], args["value"], args["attn_mask"], *fake_facts, *settings)
    )
    return Plan(site, source, settings, swap, f"{kernel.name} where the mask is a band, else SDPA")


def replace(plan: Plan, context: Context) -> set[torch.fx.Node]:
    args = plan.site.call
    facts, padding = _facts_of(args["attn_mask"])
    plan.swap.insert((args["query"], args["key"], args["value"], args["attn_mask"], facts, padding, *plan.settings))
    return set()


def _facts_of(mask: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The (facts, key padding) nodes of ``mask``, a placeholder of the graph that calls SDPA:
    one ``mask_facts`` call after that graph's placeholders, made by the first rewritten call
    and shared by the others. In the graph that calls SDPA, not where the input enters: an
    activation-checkpoint body runs again in the backward and must read its mask again, as
    eager's recomputation does."""
    graph = mask.graph
    existing = [user for user in mask.users if user.target is FACTS]
    if existing:
        (facts,) = existing
        return tuple(next(u for u in facts.users if u.args[1] == index) for index in (0, 1))
    fake = fake_result(lambda m: FACTS(m), mask)
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        facts = graph.call_function(FACTS, (mask,))
    facts.meta["example_value"] = fake
    parts = []
    for index in (0, 1):
        with graph.inserting_after(facts if not parts else parts[-1]):
            part = graph.call_function(operator.getitem, (facts, index))
        part.meta["example_value"] = fake[index]
        parts.append(part)
    return tuple(parts)
