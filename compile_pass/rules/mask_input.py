"""Masks that cross graph boundaries: where one graph builds a mask and another attends with it.

Under FSDP2, regional compilation, graph breaks and ``generate()`` with a static cache, the
graph that builds a mask is not the graph that calls SDPA with it. Two halves:

Where a graph *returns* a mask (``attested_outputs``): its band is proven as for any mask, over
the mask's own sizes, and the backend attests the returned tensor when the compiled graph
runs (``ops.mask_input.attest``): identity and version of that tensor, window, key padding.

Where a graph *receives* a mask and calls SDPA with it (``apply``):
Match: SDPA whose mask is a graph input (through checkpoint bodies).
Check: the call is one the op computes (as for the sliding rule), the mask a (batch, 1, Sq, Sk)
       bool, and the op has a fast kernel here.
Replace: ``mask_input_attention_forward(q, k, v, mask, scale, enable_gqa)[0]``, which reads the
       mask's facts at run time (its attestation, or one exact check of a mask nobody attested)
       and runs the band kernel, SDPA's causal or unmasked mode, or SDPA with the mask.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graphs import example_value, fake_result, graph_outputs, is_sdpa, model_constant, same_size, sdpa_arguments
from ..ops.kernels import kernel_choice
from ..proof import Band, MaskEvaluator, prove_band
from ..proof.symbolic import as_sympy, input_name
from .sliding_window import attention_problem, in_sdpa_layout, op_scale

NAME = "mask_input"
OP = torch.ops.compile_pass.mask_input_attention_forward.default


@dataclass(frozen=True)
class Attestation:
    """Output ``output`` of a graph is a mask with ``band``; its key padding is graph input
    ``padding_input`` (by placeholder position) != 0."""

    output: int
    band: Band
    padding_input: int | None


def attested_outputs(graph: torch.fx.Graph, evaluator: MaskEvaluator) -> list[Attestation]:
    """The (batch, 1, Sq, Sk) bool outputs of a graph proven to be FA2 bands over their own
    sizes (query i aligned with key i + Sk - Sq), possibly AND a key padding input."""
    placeholders = graph.find_nodes(op="placeholder")
    found = []
    for position, value in enumerate(graph_outputs(graph)):
        mask = example_value(value)
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and same_size(mask.shape[1], 1)):
            continue
        seq_q, seq_k = (as_sympy(size) for size in mask.shape[2:])
        band = prove_band(evaluator, value, seq_k - seq_q, single_query=same_size(mask.shape[2], 1))
        if not isinstance(band, Band) or band.segments is not None:
            continue
        padding_input = None
        if band.key_padding is not None:
            source = evaluator.inputs[band.key_padding]
            if source not in placeholders:
                continue
            padding_input = placeholders.index(source)
        found.append(Attestation(position, band, padding_input))
    return found


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
    problem = attention_problem(node, args)
    if problem is not None:
        return problem
    query = example_value(args["query"])
    kernel = kernel_choice(query.device, query.dtype, model_constant(query.shape[-1]), batch_masks=True)
    if not kernel.fast:
        return f"mask is an input, and {kernel.reason}"
    return args


def replace(node: torch.fx.Node, args) -> set[torch.fx.Node]:
    graph = node.graph
    query = args["query"]
    call = (query, args["key"], args["value"], args["attn_mask"], op_scale(args), bool(args["enable_gqa"]))
    fake = fake_result(lambda q, k, v, m: OP(q, k, v, m, *call[4:]), *call[:4])
    if fake is None:
        raise RuntimeError(f"no fake tensors on {query.name}")
    with graph.inserting_before(node):
        attention = graph.call_function(OP, call)
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
    reason = f"mask from input {input_name(source)}: its band is read at run time (attested where built, or checked once)"
    return True, reason, replace(node, args)
