"""The sliding rule: SDPA whose mask is a proven sliding band -> the sliding-window op.

Match: every SDPA call with an explicit mask.
Check: no dropout, a supported dtype and head_dim, a static scale, and the mask proven to
       be a band with a bounded left side under FA2's alignment (query i with key
       i + Sk - Sq, so decoding with a cache qualifies when its offsets say so), possibly
       AND a (batch, keys) key padding.
Replace: ``sliding_window_attention_forward(q, k, v, left, right, scale)[0]``, on K/V
       before transformers' GQA repeat when that repeat is recognised; the mask's
       construction is erased when nothing else reads it.
Every other SDPA call is left exactly as it was, with the reason in the report.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graphs import CHECKPOINT, example_value, is_sdpa, pass_into_body, sdpa_arguments, set_fake_result
from ..ops.layout import SUPPORTED_DTYPES
from ..ops.window import UNBOUNDED
from ..proof import Band, MaskEvaluator, Unproven, prove_band
from ..proof.symbolic import as_sympy

NAME = "sliding_window"
OP = torch.ops.compile_pass.sliding_window_attention_forward.default
# FA2's head_dim limit: beyond it, on CUDA, the op would run its unfused fallback.
DEFAULT_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Plan:
    band: Band
    scale: float
    key_padding: torch.fx.Node | None = None  # a (batch, Sk) graph input; visible where != 0
    segment_ids: torch.fx.Node | None = None  # (batch, S) packed-sequence ids


def check(node: torch.fx.Node, evaluator: MaskEvaluator, max_head_dim: int) -> Plan | str:
    """The rewrite to make, or why this SDPA call stays as it is."""
    args = sdpa_arguments(node)
    if args["attn_mask"] is None:
        return f"no mask (is_causal={args['is_causal']})"
    if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
        return f"dropout_p={args['dropout_p']} (the op has no dropout)"
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    query, key = example_value(args["query"]), example_value(args["key"])
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or key.dim() != 4:
        return "query/key are not 4-D tensors"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype}"
    head_dim = query.shape[-1]
    if not isinstance(head_dim, int):
        return "head_dim is symbolic"
    if head_dim > max_head_dim:
        return f"head_dim {head_dim} > {max_head_dim}"
    scale = args["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(scale, (int, float)):
        return "scale computed at run time"
    # FA2 aligns the last query with the last key; the proof must show the mask does too.
    key_offset = as_sympy(key.shape[-2]) - as_sympy(query.shape[-2])
    band = prove_band(evaluator, args["attn_mask"], key_offset)
    if isinstance(band, Unproven):
        return f"mask {band.reason}"
    if band.left == UNBOUNDED:
        return f"mask is {band.describe()}: no sliding window"
    per_batch = []
    for name, known in ((band.key_padding, evaluator.inputs), (band.segments, evaluator.segments)):
        tensor = known[name] if name is not None else None
        if tensor is not None:
            if tensor.graph is not node.graph and not _called_from(node.graph, tensor.graph):
                return f"mask is {band.describe()}, but {tensor.name} is in a graph two levels up"
            shape = example_value(tensor).shape
            if name == band.key_padding and band.key_padding_row0 and not statically_known_true(shape[0] == 1):
                return f"mask is {band.describe()}, but reads row 0 of {tensor.name} for every batch row"
            if not (statically_known_true(shape[0] == query.shape[0]) and statically_known_true(shape[1] == key.shape[-2])):
                return f"mask is {band.describe()}, but {tensor.name} is not (batch, keys)"
        per_batch.append(tensor)
    return Plan(band, float(scale), *per_batch)


def _called_from(body: torch.fx.Graph, graph: torch.fx.Graph) -> bool:
    parent = graph.owning_module
    return any(
        getattr(parent, call.args[0].target).graph is body
        for call in graph.find_nodes(op="call_function", target=CHECKPOINT)
    )


def _unrepeated(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """K/V before transformers' repeat_kv (x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)).

    Returns (source, group) when every step matches exactly, so that repeated head h is
    source head h // group: the op's GQA convention.
    """
    if node.op != "call_method" or node.target not in ("reshape", "view"):
        return None
    expand = node.args[0]
    if not isinstance(expand, torch.fx.Node) or expand.op != "call_method" or expand.target != "expand":
        return None
    inserted = expand.args[0]
    if not (
        isinstance(inserted, torch.fx.Node)
        and inserted.op == "call_function"
        and inserted.target is operator.getitem
        and inserted.args[1] == (slice(None), slice(None), None, slice(None), slice(None))
    ):
        return None
    source = inserted.args[0]
    shapes = [example_value(n) for n in (source, expand, node)]
    if not all(isinstance(t, torch.Tensor) for t in shapes):
        return None
    src, expanded, merged = (t.shape for t in shapes)
    if len(src) != 4 or len(expanded) != 5 or len(merged) != 4:
        return None
    group = expanded[2]
    same = [
        (expanded[0], src[0]), (expanded[1], src[1]), (expanded[3], src[2]), (expanded[4], src[3]),
        (merged[0], src[0]), (merged[1], src[1] * group), (merged[2], src[2]), (merged[3], src[3]),
    ]
    if not isinstance(group, int) or not all(statically_known_true(a == b) for a, b in same):
        return None
    return source, group


def replace(node: torch.fx.Node, plan: Plan) -> set[torch.fx.Node]:
    """Swap the SDPA call for the op; returns nodes that may now be dead."""
    graph = node.graph
    args = sdpa_arguments(node)
    query, key, value = args["query"], args["key"], args["value"]
    maybe_dead = {args["attn_mask"], key, value}
    key_source, value_source = _unrepeated(key), _unrepeated(value)
    if key_source and value_source and key_source[1] == value_source[1]:
        key, value = key_source[0], value_source[0]
        maybe_dead |= {n for n in graph.nodes if n in _repeat_chain(args["key"]) | _repeat_chain(args["value"])}
    window = (plan.band.left, plan.band.right, plan.scale)
    padding, segments = (
        pass_into_body(t, graph) if t is not None and t.graph is not graph else t  # SDPA in a checkpoint body
        for t in (plan.key_padding, plan.segment_ids)
    )
    with graph.inserting_before(node):
        if padding is not None and example_value(padding).dtype != torch.bool:
            source = padding
            padding = graph.call_function(operator.ne, (source, 0))
            set_fake_result(padding, lambda p: p != 0, source)
        extra = (padding, segments) if segments is not None else (padding,) if padding is not None else ()
        attention = graph.call_function(OP, (query, key, value, *window, *extra))
        out = graph.call_function(operator.getitem, (attention, 0))
    set_fake_result(attention, lambda q, k, v, *p: OP(q, k, v, *window, *p), query, key, value, *extra)
    set_fake_result(out, lambda result: result[0], attention)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return maybe_dead


def _repeat_chain(node: torch.fx.Node) -> set[torch.fx.Node]:
    expand = node.args[0]
    return {node, expand, expand.args[0]}


def apply(node: torch.fx.Node, evaluator: MaskEvaluator, *, max_head_dim: int = DEFAULT_MAX_HEAD_DIM):
    """(rewritten, reason, maybe-dead nodes) for one graph node; non-SDPA nodes give None."""
    if not is_sdpa(node):
        return None
    plan = check(node, evaluator, max_head_dim)
    if isinstance(plan, str):
        return False, plan, set()
    return True, plan.band.describe(), replace(node, plan)
