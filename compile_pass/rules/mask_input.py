"""Masks that cross graph boundaries: where a graph receives a mask as an input and calls SDPA
with it.

Under FSDP2, regional compilation, graph breaks and ``generate()`` with a static cache, the
graph that builds a mask is not the graph that calls SDPA with it, and no proof can see how
the mask was built. Its band is read at run time, from the mask as it is at each graph call:
nothing known about an input's contents outlives the call that read it (torch's version
counter misses writes through ``.data``, storage, dlpack, numpy views and other threads).

Match: SDPA whose mask is a graph input (through checkpoint bodies).
Check: the call is one the op computes (as for the sliding rule), the mask a (batch, 1, Sq, Sk)
       bool tensor of the plain tensor type, the graph writes no alias of it, and the op has a
       fast kernel here.
Replace: ``mask_facts(mask)`` once per mask input, at the top of the graph that calls SDPA
       (one exact check and one host sync per graph call; a checkpoint body checks on each
       run, its recomputation included), and each call by
       ``mask_input_attention_forward(q, k, v, mask, facts, key_padding, scale, enable_gqa)[0]``,
       which runs the band kernel, SDPA's causal or unmasked mode, or SDPA with the mask.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from ..graphs import example_value, fake_result, is_sdpa, model_constant, same_size, sdpa_arguments
from ..ops.kernels import kernel_choice
from ..proof import MaskEvaluator
from ..proof.symbolic import input_name
from .sliding_window import attention_problem, cast_for_autocast, computed_dtype, in_sdpa_layout, op_scale

NAME = "mask_input"
OP = torch.ops.compile_pass.mask_input_attention_forward.default
FACTS = torch.ops.compile_pass.mask_facts.default


def check(node: torch.fx.Node, evaluator: MaskEvaluator):
    """SDPA's arguments when the call takes a graph-input mask the op can stand in for; a
    reason when it cannot; None when the mask is not a graph input (not this rule's case)."""
    args = sdpa_arguments(node)
    if args is None or args["attn_mask"] is None:
        return None
    source = evaluator.source_of(args["attn_mask"])
    if source.op != "placeholder":
        return None
    mask = example_value(source)
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and same_size(mask.shape[1], 1)):
        return "mask input is not a (batch, 1, Sq, Sk) bool tensor"
    if type(mask) is not FakeTensor:  # a subclass dispatches the op its own way, or not at all
        return f"mask input is a {type(mask).__name__}, not a plain tensor"
    writer = evaluator.writes.writer(source)
    if writer is not None:
        return f"mask input {input_name(source)}: {writer}"  # as the proof says it
    problem = attention_problem(node, args)
    if problem is not None:
        return problem
    query = example_value(args["query"])
    kernel = kernel_choice(query.device, computed_dtype(node, args), model_constant(query.shape[-1]), batch_masks=True)
    if not kernel.fast:
        return f"mask is an input, and {kernel.reason}"
    return args


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


def replace(node: torch.fx.Node, args) -> set[torch.fx.Node]:
    graph = node.graph
    query = args["query"]
    settings = (op_scale(args), bool(args["enable_gqa"]))
    dtype = computed_dtype(node, args)
    fake_facts = fake_result(lambda m: FACTS(m), args["attn_mask"])
    fake = fake_result(
        lambda q, k, v, m, f, p: OP(q.to(dtype), k.to(dtype), v.to(dtype), m, f, p, *settings),
        query, args["key"], args["value"], args["attn_mask"], *fake_facts,
    )
    if fake is None:
        raise RuntimeError(f"no fake tensors on {query.name}")
    facts, padding = _facts_of(args["attn_mask"])
    query, key, value = (cast_for_autocast(args[name], dtype, node) for name in ("query", "key", "value"))
    with graph.inserting_before(node):
        attention = graph.call_function(OP, (query, key, value, args["attn_mask"], facts, padding, *settings))
        out = graph.call_function(operator.getitem, (attention, 0))
    attention.meta["example_value"] = fake
    out.meta["example_value"] = fake[0]
    node.replace_all_uses_with(in_sdpa_layout(out, node))
    graph.erase_node(node)
    return set()


def apply(node: torch.fx.Node, evaluator: MaskEvaluator):
    if not is_sdpa(node):
        return None
    args = check(node, evaluator)
    if args is None:
        return None
    if isinstance(args, str):
        return False, args, set()
    source = evaluator.source_of(args["attn_mask"])
    reason = f"mask from input {input_name(source)}: its band is read at run time, once per graph call"
    return True, reason, replace(node, args)
