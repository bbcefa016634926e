"""The sliding rule: SDPA whose mask is a proven sliding band -> the sliding-window op.

Match: every SDPA call with an explicit mask.
Check: the call is one the op computes (no dropout, no broadcast batch or heads, GQA as the
       op groups heads, one head_dim for query, key and value, a supported dtype, a static
       scale), the op's kernel on that device, dtype and head_dim is known to be at least as
       fast as SDPA (``ops.kernel_choice``), and the mask is proven to be a band with a bounded left side under FA2's
       alignment (query i with key i + Sk - Sq, so decoding with a cache qualifies when its
       offsets say so), possibly AND a (batch, keys) key padding or packed-sequence ids.
Replace: ``sliding_window_attention_forward(q, k, v, left, right, scale)[0]``, on K/V
       before transformers' GQA repeat when that repeat is recognised and nothing writes
       its source; the mask's construction is erased when nothing else reads it.
Every other SDPA call is left exactly as it was, with the reason in the report.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graphs import (
    CHECKPOINT,
    Call,
    checkpoint_body,
    example_value,
    fake_result,
    is_sdpa,
    model_constant,
    pass_into_body,
    read_call,
    same_size,
    sdpa_arguments,
    sdpa_mask_problem,
    sdpa_requires_equal,
)
from ..ops.kernels import kernel_choice
from ..ops.layout import SUPPORTED_DTYPES
from ..ops.window import UNBOUNDED
from ..proof import Band, MaskEvaluator, Unproven, prove_band
from ..proof.symbolic import as_sympy

NAME = "sliding_window"
SETTINGS = ("slow_kernels",)  # keywords of apply(), given by the ways in
OP = torch.ops.compile_pass.sliding_window_attention_forward.default


@dataclass(frozen=True)
class Plan:
    band: Band
    scale: float
    key: torch.fx.Node  # K/V as the op reads them: before transformers' repeat when safe
    value: torch.fx.Node
    key_padding: torch.fx.Node | None = None  # a (batch, Sk) graph input; visible where != 0
    segment_ids: torch.fx.Node | None = None  # (batch, S) packed-sequence ids


def attention_problem(node: torch.fx.Node, args: Call) -> str | None:
    """Why SDPA's result at ``node`` is not the op's over the same query, key and value (for
    any mask that broadcasts to (batch, heads, Sq, Sk)), or None. Everything the op's own
    checks require is verified here, so building the op's node cannot fail."""
    if not isinstance(args["dropout_p"], (int, float)) or args["dropout_p"] != 0:
        return f"dropout_p={args['dropout_p']} (the op has no dropout)"
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    query, key, value = (example_value(args[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return "query, key and value are not all 4-D tensors"
    dtype = computed_dtype(node, args)
    if dtype is None or dtype not in SUPPORTED_DTYPES:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    if dtype != query.dtype or dtype != key.dtype or dtype != value.dtype:
        mask = example_value(args["attn_mask"])
        if isinstance(mask, torch.Tensor) and mask.is_floating_point():
            return f"autocast casts query, key, value and the additive mask to {dtype}"
    if not query.device == key.device == value.device:
        return "query, key and value on different devices"
    (batch, heads, _, head_dim), (kv_batch, kv_heads, _, key_dim) = query.shape, key.shape
    if model_constant(head_dim) is None:
        return "head_dim is symbolic without a traced value"
    heads, kv_heads = model_constant(heads), model_constant(kv_heads)
    if not (sdpa_requires_equal(key_dim, head_dim) and sdpa_requires_equal(value.shape[2], key.shape[2])):
        return f"key shape {tuple(key.shape)} does not fit query {tuple(query.shape)} or value {tuple(value.shape)}"
    if not all(same_size(a, b) for a, b in (*zip(value.shape[:2], key.shape[:2]), (value.shape[3], head_dim))):
        return f"value shape {tuple(value.shape)} differs from key's {tuple(key.shape)} (the op needs one head_dim)"
    if not same_size(kv_batch, batch):
        return "key/value batch differs from query's (broadcast)"
    if kv_heads is None or heads is None or heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    if args["enable_gqa"] is not True and kv_heads not in (1, heads):
        return f"{heads} query heads with {kv_heads} key/value heads without enable_gqa"
    problem = sdpa_mask_problem(args)
    if problem is not None:
        return problem
    result = example_value(node)
    if not (isinstance(result, torch.Tensor) and all(same_size(a, b) for a, b in zip(result.shape, query.shape))):
        return "SDPA's result is not shaped like the query"
    if sdpa_layout(result) is None:
        return f"SDPA's result has strides {tuple(result.stride())}, a layout the op does not return"
    return None


def computed_dtype(node: torch.fx.Node, args: Call) -> torch.dtype | None:
    """The dtype SDPA computed in, or None when it cannot be told: the dtype of query, key and
    value when they share one; else, under autocast, the dtype its result came out in. SDPA
    takes one dtype, so a result of another dtype means autocast cast every input to it
    (its lower-precision policy casts each floating input but fp64 to the region's dtype,
    whether the region was entered in the graph or around the compiled call); the rewrite
    casts them the same way (``cast_for_autocast``)."""
    tensors = [example_value(args[name]) for name in ("query", "key", "value")]
    result = example_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (*tensors, result)):
        return None
    dtypes = {t.dtype for t in tensors}
    if dtypes == {result.dtype}:
        return result.dtype
    low_precision, castable = (torch.float16, torch.bfloat16), (torch.float16, torch.bfloat16, torch.float32)
    if result.dtype in low_precision and dtypes <= set(castable):
        return result.dtype
    return None


def cast_for_autocast(value: torch.fx.Node, dtype: torch.dtype, before: torch.fx.Node) -> torch.fx.Node:
    """``value`` as the op must read it where autocast computed SDPA in ``dtype``: cast, inserted
    before ``before``, when its dtype differs (autograd takes gradients back through it)."""
    if example_value(value).dtype == dtype:
        return value
    fake = fake_result(lambda t: t.to(dtype), value)
    with before.graph.inserting_before(before):
        cast = before.graph.call_method("to", (value, dtype))
    cast.meta["example_value"] = fake
    return cast


def _strides_agree(x: torch.Tensor, strides: tuple) -> bool:
    """Whether ``x`` has ``strides`` in every dim of more than one element (a size-1 dim's
    stride is never used); adds no guard."""
    return all(same_size(size, 1) or same_size(a, b) for size, a, b in zip(x.shape, x.stride(), strides))


def sdpa_layout(result: torch.Tensor) -> str | None:
    """How SDPA stored its (batch, heads, seq, dim) result: "heads_last" ((batch, seq, heads,
    dim)-contiguous, as the op returns it), "contiguous", or None for anything else."""
    _, heads, seq, dim = result.shape
    if _strides_agree(result, (seq * heads * dim, dim, heads * dim, 1)):
        return "heads_last"
    if _strides_agree(result, (heads * seq * dim, seq * dim, dim, 1)):
        return "contiguous"
    return None


def in_sdpa_layout(out: torch.fx.Node, sdpa: torch.fx.Node) -> torch.fx.Node:
    """The op's heads-last result ``out``, stored as SDPA stored its result: a view that eager
    allows on SDPA's result must work on the replacement too. A contiguous copy where SDPA's
    was contiguous (O(S * heads * dim), against the op's O(S * w)); ``out`` itself otherwise."""
    if sdpa_layout(example_value(sdpa)) != "contiguous":
        return out
    with out.graph.inserting_after(out):
        stored = out.graph.call_method("contiguous", (out,))
    stored.meta["example_value"] = fake_result(lambda t: t.contiguous(), example_value(out))
    return stored


def op_scale(args: Call) -> float:
    """SDPA's softmax scale as the op takes it: the given constant, or 1 / sqrt(head_dim)."""
    if args["scale"] is not None:
        return float(args["scale"])
    return 1.0 / math.sqrt(model_constant(example_value(args["query"]).shape[-1]))


def check(node: torch.fx.Node, evaluator: MaskEvaluator, slow_kernels: bool = False) -> Plan | str:
    """The rewrite to make, or why this SDPA call stays as it is. ``slow_kernels`` rewrites
    even where the op's kernel is not known to be as fast as SDPA (never by default)."""
    args = sdpa_arguments(node)
    if args is None:
        return "SDPA arguments not understood"
    if args["attn_mask"] is None:
        return f"no mask (is_causal={args['is_causal']})"
    problem = attention_problem(node, args)
    if problem is not None:
        return problem
    query, key = example_value(args["query"]), example_value(args["key"])
    head_dim = model_constant(query.shape[-1])
    # FA2 aligns the last query with the last key; the proof must show the mask does too.
    key_offset = evaluator.decide_extrema(as_sympy(key.shape[-2]) - as_sympy(query.shape[-2]), args["query"])
    band = prove_band(evaluator, args["attn_mask"], key_offset, single_query=same_size(query.shape[-2], 1))
    if isinstance(band, Unproven):
        return f"mask {band.reason}"
    if band.left == UNBOUNDED:
        return f"mask is {band.describe()}: no sliding window"
    if band.additive and (band.key_padding or band.segments or not statically_known_true(query.shape[-2] <= key.shape[-2])):
        return f"mask is {band.describe()}, but SDPA gives rows without a visible key an average where the op gives 0"
    per_batch = []
    for name, known in ((band.key_padding, evaluator.inputs), (band.segments, evaluator.segments)):
        tensor = known.get(name) if name is not None else None
        if tensor is not None:
            if tensor.graph is not node.graph and not _called_from(node.graph, tensor.graph):
                return f"mask is {band.describe()}, but {tensor.name} is in a graph two levels up"
            example = example_value(tensor)
            shape = example.shape
            if name == band.key_padding and band.key_padding_row0 and not same_size(shape[0], 1):
                return f"mask is {band.describe()}, but reads row 0 of {tensor.name} for every batch row"
            if not (example.dim() == 2 and same_size(shape[0], query.shape[0]) and same_size(shape[1], key.shape[-2])):
                return f"mask is {band.describe()}, but {tensor.name} is not (batch, keys)"
            if example.device != query.device:
                return f"mask is {band.describe()}, but {tensor.name} is on {example.device}"
        elif name is not None:
            return f"mask is {band.describe()}, but its source tensor was not found"
        per_batch.append(tensor)
    dtype = computed_dtype(node, args)
    kernel = kernel_choice(query.device, dtype, head_dim, batch_masks=any(t is not None for t in per_batch))
    if not kernel.fast and not slow_kernels:
        return f"mask is {band.describe()}, but {kernel.reason}; slow_kernels=True rewrites anyway"
    key_node, value_node = _op_key_value(args, evaluator)
    return Plan(band, op_scale(args), key_node, value_node, *per_batch)


def _called_from(body: torch.fx.Graph, graph: torch.fx.Graph) -> bool:
    return any(
        checkpoint_body(call).graph is body for call in graph.find_nodes(op="call_function", target=CHECKPOINT)
    )


def _unrepeated(node: torch.fx.Node) -> tuple[torch.fx.Node, int] | None:
    """K/V before transformers' repeat_kv (x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)).

    Returns (source, group) when every step matches exactly, so that repeated head h is
    source head h // group: the op's GQA convention.
    """
    merge = read_call(node) if node.op == "call_method" and node.target in ("reshape", "view") else None
    expand = merge["input"] if merge is not None else None
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    expand_call = read_call(expand)
    inserted = expand_call["input"] if expand_call is not None else None
    if not (isinstance(inserted, torch.fx.Node) and inserted.op == "call_function" and inserted.target is operator.getitem):
        return None
    source, index = read_call(inserted).arguments.values()
    if index != (slice(None), slice(None), None, slice(None), slice(None)):
        return None
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
    if not isinstance(group, int) or not all(same_size(a, b) for a, b in same):
        return None
    return source, group


def _op_key_value(args: Call, evaluator: MaskEvaluator) -> tuple[torch.fx.Node, torch.fx.Node]:
    """K/V for the op: the sources of a recognised repeat_kv, where neither the source nor the
    repeated copy may be written before SDPA reads it (the op reads the source at the call),
    else SDPA's own key and value."""
    key, value = args["key"], args["value"]
    key_source, value_source = _unrepeated(key), _unrepeated(value)
    if not (key_source and value_source and key_source[1] == value_source[1]):
        return key, value
    untouched = all(
        evaluator.writes.writer(node) is None for node in (key, value, key_source[0], value_source[0])
    )
    return (key_source[0], value_source[0]) if untouched else (key, value)


def _repeat_chain(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The repeat_kv nodes between a source and SDPA's key or value (see ``_unrepeated``)."""
    expand = read_call(node)["input"]
    return {node, expand, read_call(expand)["input"]}


def replace(node: torch.fx.Node, plan: Plan) -> set[torch.fx.Node]:
    """Swap the SDPA call for the op; returns nodes that may now be dead. Every fake value is
    computed before the graph changes, so a failure leaves it as it was."""
    graph = node.graph
    args = sdpa_arguments(node)
    query = args["query"]
    window = (plan.band.left, plan.band.right, plan.scale)
    # The op saves its padding for the backward: hand it a tensor of its own (``!= 0``, also a
    # bool's copy), which the caller cannot write between forward and backward.
    fake_padding = fake_result(lambda p: p != 0, plan.key_padding) if plan.key_padding is not None else None
    fake_extra = [t for t in (fake_padding, example_value(plan.segment_ids)) if t is not None]
    if plan.segment_ids is not None and fake_padding is None:
        fake_extra = [None, *fake_extra]
    dtype = computed_dtype(node, args)
    cast = lambda t: t.to(dtype)  # noqa: E731 - what autocast did to SDPA's inputs
    fake_attention = fake_result(
        lambda q, k, v, *p: OP(cast(q), cast(k), cast(v), *window, *p), query, plan.key, plan.value, *fake_extra
    )
    if fake_attention is None:
        raise RuntimeError(f"no fake tensors on {query.name}")

    maybe_dead = {args["attn_mask"], args["key"], args["value"]}
    if plan.key is not args["key"]:
        maybe_dead |= _repeat_chain(args["key"]) | _repeat_chain(args["value"])
    padding, segments = (
        pass_into_body(t, graph) if t is not None and t.graph is not graph else t  # SDPA in a checkpoint body
        for t in (plan.key_padding, plan.segment_ids)
    )
    query, key, value = (cast_for_autocast(t, dtype, node) for t in (query, plan.key, plan.value))
    with graph.inserting_before(node):
        if padding is not None:
            padding = graph.call_function(operator.ne, (padding, 0))
            padding.meta["example_value"] = fake_padding
        extra = (padding, segments) if segments is not None else (padding,) if padding is not None else ()
        attention = graph.call_function(OP, (query, key, value, *window, *extra))
        out = graph.call_function(operator.getitem, (attention, 0))
    attention.meta["example_value"] = fake_attention
    out.meta["example_value"] = fake_attention[0]
    node.replace_all_uses_with(in_sdpa_layout(out, node))
    graph.erase_node(node)
    return maybe_dead


def apply(node: torch.fx.Node, evaluator: MaskEvaluator, *, slow_kernels: bool = False):
    """(rewritten, reason, maybe-dead nodes) for one graph node; non-SDPA nodes give None."""
    if not is_sdpa(node):
        return None
    plan = check(node, evaluator, slow_kernels)
    if isinstance(plan, str):
        return False, plan, set()
    return True, plan.band.describe(), replace(node, plan)
