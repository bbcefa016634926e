"""What the attention rules share: which nodes are SDPA, when SDPA's result is the op's over
the same operands, the mask's band, and the one way an SDPA node is swapped for an op."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from ..calls import Call
from ..graphs import checkpoint_calls, example_value, fake_result, pass_into_body
from ..kernels.contract import CallFacts
from ..kernels.layout import SUPPORTED_DTYPES
from ..proof import AtomKind, Band, MaskEvaluator, Unproven, as_sympy, input_name, prove_band
from ..report import ATTENTION
from ..sizes import known_number, model_constant, same_size
from ..subclasses import user_value
from ..window import POSITION_RANGE, UNBOUNDED
from .base import Context

SDPA_TARGETS = {
    ("call_function", torch._C._nn.scaled_dot_product_attention): ATTENTION,
    ("call_function", torch.nn.functional.scaled_dot_product_attention): ATTENTION,
}


def has_mask(call: Call) -> bool:
    return call.arguments.get("attn_mask") is not None


# The argument by which transformers' models take the positions of packed documents.
POSITION_IDS = "position_ids"


def no_mask_reason(node: torch.fx.Node, args: Call, evaluator: MaskEvaluator) -> str:
    """Why a call without a mask keeps SDPA. A causal one already runs SDPA's own causal kernel,
    which is no miss. Where the graph also takes ``position_ids`` as an input, no mask built from
    them reaches the call: transformers (5.24) masks packed documents from position_ids only when
    no cache is passed, and a training forward left at ``use_cache=True`` gets one. The graph does
    not show whether the rows pack documents, so that part is a hint, not a finding."""
    if args["is_causal"] is not True:
        return f"no mask (is_causal={args['is_causal']})"
    reason = "no mask: SDPA runs its causal kernel (is_causal=True), no band to skip"
    inputs = (evaluator.source_of(placeholder) for placeholder in node.graph.find_nodes(op="placeholder"))
    if any(source.op == "placeholder" and input_name(source) == POSITION_IDS for source in inputs):
        reason += (
            f"; input {POSITION_IDS} builds no mask here: if its rows pack several documents, pass use_cache=False "
            "(transformers masks packed documents only without a cache; with one, each row attends across its "
            "documents)"
        )
    return reason


def sdpa_requires_equal(a, b) -> bool:
    """Two sizes SDPA itself requires equal (key and value lengths, query and key head_dim):
    equal for this graph, with a guard where the symbols do not say so already. A call where
    they differ fails in SDPA, so the guard only rules out calls that could not run."""
    return guard_or_false(a == b)


def sdpa_mask_problem(args: Call, chained: bool = False) -> str | None:
    """Why no rule may compute SDPA's mask another way, or None: the mask must be a tensor on
    the query's device that broadcasts to (batch, query heads, Sq, Sk) without widening any of
    them (a wider mask would widen SDPA's result), and the scale a positive finite number
    known when the graph is traced (SDPA's ``is_causal`` path and the band kernels compute
    other scales differently from SDPA with the mask: NaN where it gives numbers, or numbers
    where it gives NaN). ``chained``: the mask is added to the scores by an op of a chain
    (``spelled_attention``), in the dtype type promotion gives, which that rule checks."""
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    if args["scale"] is not None:
        scale = call_number(args["scale"])
        if scale is None:
            return "scale computed at run time"
        if not (math.isfinite(scale) and scale > 0):
            return f"scale {scale!r} is not a positive finite number"
    query, key, mask = (example_value(args[name]) for name in ("query", "key", "attn_mask"))
    if not (isinstance(mask, torch.Tensor) and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)):
        return "mask, query or key is not a tensor"
    if mask.dim() > 4 or query.dim() != 4 or key.dim() != 4 or mask.device != query.device:
        return "mask is not a tensor of at most 4 dimensions on the query's device"
    if mask.is_floating_point() and mask.dtype != query.dtype and not chained:
        # SDPA accepts a float32 mask with queries of any dtype; with float64 queries its CPU
        # kernel does not add it as it adds a float64 mask (tests/proof/test_soundness.py).
        return (
            f"additive mask in {mask.dtype} with {query.dtype} queries: "
            "only a mask of the queries' dtype is read as SDPA adds it"
        )
    attention_shape = (*query.shape[:3], key.shape[2])
    # Right-aligned, as broadcasting reads them: a mask of fewer dims has the missing leading ones.
    if not all(
        same_size(size, 1) or same_size(size, full)
        for size, full in zip(reversed(mask.shape), reversed(attention_shape), strict=False)
    ):
        return f"mask shape {tuple(mask.shape)} does not broadcast to {tuple(attention_shape)} without widening it"
    return None


def plain_attention(band: Band, query: torch.Tensor, key: torch.Tensor) -> bool | None:
    """What SDPA computes without the mask where a window-only band is no band at these
    sizes: True for ``is_causal`` (a causal band whose left side reaches key 0 from every row,
    Sq == Sk), False for every key visible (no right side, or one query row, which FA2's
    alignment puts at the last key); None where neither holds for every size the graph takes.
    With static sizes (a graph compiled for one length) a sliding window longer than the
    sequence is plain causal attention."""
    if not band.window_only:
        return None
    seq_q, seq_k = query.shape[-2], key.shape[-2]
    if band.left != UNBOUNDED and not statically_known_true(seq_k - 1 <= band.left):
        return None
    if band.right == UNBOUNDED or same_size(seq_q, 1):
        return False
    # SDPA's is_causal aligns the first query with the first key: the band must do so too.
    if band.right == 0 and same_size(seq_q, seq_k):
        return True
    return None


def mask_band(args: Call, evaluator: MaskEvaluator) -> Band | Unproven:
    """The band SDPA's mask is proven to be under FA2's alignment (query i with key
    i + Sk - Sq, so decoding with a cache qualifies when its offsets say so)."""
    query, key = example_value(args["query"]), example_value(args["key"])
    key_offset = evaluator.decide_extrema(as_sympy(key.shape[-2]) - as_sympy(query.shape[-2]), args["query"])
    return prove_band(evaluator, args["attn_mask"], key_offset, single_query=same_size(query.shape[-2], 1))


def within_checked_positions(
    prove: Callable[[MaskEvaluator], Band | Unproven], evaluator: MaskEvaluator
) -> Band | Unproven | None:
    """The band ``prove`` finds (``mask_band`` of a call, say) for a packed mask whose window is
    over position values, proven for positions in POSITION_RANGE (the ids' lemma then makes
    positions consecutive inside a segment); the rewrite must check the positions at run time
    (``Band.assumes``). Where packed positions are read but the mask is not proven even so, why
    not, with what the user can change: that reason, not the unchecked positions' overflow,
    is the obstacle. None where the mask reads no packed positions."""
    candidates = {atom.source.node: None for atom in evaluator.atoms.of_kind(AtomKind.SEGMENTS)}
    unproven = None
    for positions in candidates:  # one assumption at a time: the band then checks exactly it
        band = prove(evaluator.assuming({positions: POSITION_RANGE}))
        if isinstance(band, Band) and any(
            ids.atom is not None and ids.atom.kind is AtomKind.SEGMENTS and ids.atom.source.node is positions
            for ids in band.segments
        ):
            return band
        if isinstance(band, Unproven) and unproven is None:
            unproven = Unproven(
                f"{band.reason}, even with input {input_name(positions)} checked as packed positions at run time "
                "(a padded batch, one sequence a row with its attention_mask, is read without them)"
            )
    return unproven


def attention_problem(node: torch.fx.Node, args: Call, context: Context, chained: bool = False) -> str | None:
    """Why SDPA's result at ``node`` is not the op's over the same query, key and value (for
    any mask that broadcasts to (batch, heads, Sq, Sk)), or None. Everything the op's own
    checks require is verified here, so building the op's node cannot fail. ``chained``: a
    chain of ops read as SDPA, whose mask autocast does not cast (``sdpa_mask_problem``)."""
    # Query, key and value need only be plain tensors when the op meets them; the mask (every
    # other tensor the op takes is computed into it) must not be computed from a subclass at
    # all, since its proof reads the ops that built it (compile_pass/subclasses.py).
    for name in ("query", "key", "value"):
        source = context.subclassed.get(args[name])
        if source is not None:
            kind = type(user_value(source)).__name__
            return f"{name} may be a {kind} at run time (from input {input_name(source)}): the op takes plain tensors"
    source = context.computed_from_subclass.get(args["attn_mask"])
    if source is not None:
        kind = type(user_value(source)).__name__
        return f"attn_mask is computed from input {input_name(source)}, a {kind}: the op takes plain tensors"
    for name in ("dropout_p", "scale"):
        if args[name] is not None and call_number(args[name]) is None:
            return (
                f"{name}={args[name]} is a float the graph takes at run time (torch.compile(dynamic=True) makes a "
                "module's float attributes inputs): mark the sequence dimension dynamic instead "
                "(torch._dynamo.mark_dynamic(tensor, 1)) or set torch._dynamo.config.specialize_float = True"
            )
    dropout = call_number(args["dropout_p"])
    if dropout != 0:
        return f"dropout_p={dropout} (the op has no dropout)"
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
        if isinstance(mask, torch.Tensor) and mask.is_floating_point() and not chained:
            return f"autocast casts query, key, value and the additive mask to {dtype}"
    if not query.device == key.device == value.device:
        return "query, key and value on different devices"
    (batch, heads, _, head_dim), (kv_batch, kv_heads, _, key_dim) = query.shape, key.shape
    if model_constant(head_dim) is None:
        return "head_dim is symbolic without a traced value"
    heads, kv_heads = model_constant(heads), model_constant(kv_heads)
    if not (sdpa_requires_equal(key_dim, head_dim) and sdpa_requires_equal(value.shape[2], key.shape[2])):
        return f"key shape {tuple(key.shape)} does not fit query {tuple(query.shape)} or value {tuple(value.shape)}"
    if not all(same_size(a, b) for a, b in zip(value.shape[:2], key.shape[:2], strict=True)):
        return f"value shape {tuple(value.shape)} differs from key's {tuple(key.shape)} in batch or heads"
    value_dim = model_constant(value.shape[3])
    if value_dim is None:
        return "the value's head_dim is symbolic without a traced value"
    if value_dim > model_constant(head_dim):
        return (
            f"value head_dim {value_dim} is wider than query and key's {model_constant(head_dim)} "
            "(the op zero-pads a narrower value only)"
        )
    if not same_size(kv_batch, batch):
        return "key/value batch differs from query's (broadcast)"
    if kv_heads is None or heads is None or heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    if args["enable_gqa"] is not True and kv_heads not in (1, heads):
        return f"{heads} query heads with {kv_heads} key/value heads without enable_gqa"
    problem = sdpa_mask_problem(args, chained)
    if problem is not None:
        return problem
    result = example_value(node)
    expected_shape = (*query.shape[:3], value.shape[3])
    if not (
        isinstance(result, torch.Tensor)
        and result.dim() == len(expected_shape)
        and all(same_size(a, b) for a, b in zip(result.shape, expected_shape, strict=True))
    ):
        return "SDPA's result is not shaped like the query with the value's head_dim"
    if sdpa_layout(result) is None:
        return f"SDPA's result has strides {tuple(result.stride())}, a layout the op does not return"
    return None


def computed_dtype(node: torch.fx.Node, args: Call) -> torch.dtype | None:
    """The dtype SDPA computed in, or None when it cannot be told: the dtype of query, key and
    value when they share one; else, under autocast, the dtype its result came out in. SDPA
    takes one dtype, so a result of another dtype means autocast cast every input to it
    (its lower-precision policy casts each floating input but fp64 to the region's dtype,
    whether the region was entered in the graph or around the compiled call); the rewrite
    casts them the same way (``OpSwap``)."""
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


def call_number(value) -> int | float | None:
    """A call's number argument as a Python number: a constant, or a node whose traced value
    the graph pins (``sizes.known_number``); None otherwise."""
    return known_number(example_value(value) if isinstance(value, torch.fx.Node) else value)


def op_scale(args: Call) -> float:
    """SDPA's softmax scale as the ops take it: the given constant, or 1 / sqrt(head_dim)."""
    if args["scale"] is not None:
        return float(call_number(args["scale"]))
    return 1.0 / math.sqrt(model_constant(example_value(args["query"]).shape[-1]))


def _strides_agree(x: torch.Tensor, strides: tuple) -> bool:
    """Whether ``x`` has ``strides`` in every dim of more than one element (a size-1 dim's
    stride is never used); adds no guard."""
    return all(same_size(size, 1) or same_size(a, b) for size, a, b in zip(x.shape, x.stride(), strides, strict=True))


def sdpa_layout(result: torch.Tensor) -> str | None:
    """How SDPA stored its (batch, heads, seq, dim) result: "heads_last" ((batch, seq, heads,
    dim)-contiguous, as the ops return it), "contiguous", or None for anything else."""
    _, heads, seq, dim = result.shape
    if _strides_agree(result, (seq * heads * dim, dim, heads * dim, 1)):
        return "heads_last"
    if _strides_agree(result, (heads * seq * dim, seq * dim, dim, 1)):
        return "contiguous"
    return None


class OpSwap:
    """SDPA's node replaced by ``op(query, key, value, *rest)[0]``, in two steps so that a
    failure leaves the graph as it was: the constructor computes the op's fake result (from
    the operands' fakes; operands a rule has yet to insert are given as their fakes), and
    ``insert`` changes the graph. Where autocast computed SDPA in a lower precision, query,
    key and value are cast as autocast cast them (autograd takes gradients back through the
    casts); the result is stored as SDPA stored its own, so a view eager allows on SDPA's
    result works on the replacement too."""

    def __init__(self, node: torch.fx.Node, op, args: Call, operands: Sequence[Any]):
        self.node, self.op = node, op
        self.dtype = computed_dtype(node, args)
        dtype = self.dtype
        # A narrower value (``narrower_value``) is zero-padded to the query's head_dim: its extra
        # output columns are 0 and sliced off, and the slice's backward drops dV's extra columns.
        self.value_dim = narrower_value(args)
        padding = (
            (0, model_constant(example_value(args["query"]).shape[-1]) - self.value_dim) if self.value_dim else None
        )
        self.value_padding = padding
        self.fake = fake_result(
            lambda q, k, v, *rest: op(q.to(dtype), k.to(dtype), _padded(v.to(dtype), padding), *rest), *operands
        )
        if self.fake is None:
            raise RuntimeError(f"no fake tensors on {args['query']}")
        # The calls that store the op's output as SDPA stored its result, each with its fake.
        self.storing = []
        stored = self.fake[0]
        for step in _storing_steps(self.value_dim, sdpa_layout(example_value(node))):
            stored = fake_result(partial(_run_step, step), stored)
            self.storing.append((step, stored))
        self.fake_padded = fake_result(lambda v: _padded(v.to(dtype), padding), operands[2]) if padding else None

    def insert(self, operands: Sequence[Any]) -> None:
        node, graph = self.node, self.node.graph
        query, key, value = (self._cast(t) for t in operands[:3])
        with graph.inserting_before(node):
            if self.value_padding is not None:
                value = graph.call_function(torch.nn.functional.pad, (value, self.value_padding))
                value.meta["example_value"] = self.fake_padded
            attention = graph.call_function(self.op, (query, key, value, *operands[3:]))
            attention.meta["example_value"] = self.fake
            stored = graph.call_function(operator.getitem, (attention, 0))
            stored.meta["example_value"] = self.fake[0]
            for (kind, target, rest), fake in self.storing:
                stored = graph.create_node(kind, target, (stored, *rest))
                stored.meta["example_value"] = fake
        node.replace_all_uses_with(stored)  # the driver erases SDPA's node, now dead

    def _cast(self, value: torch.fx.Node) -> torch.fx.Node:
        if example_value(value).dtype == self.dtype:
            return value
        fake = fake_result(lambda t: t.to(self.dtype), value)
        with self.node.graph.inserting_before(self.node):
            cast = self.node.graph.call_method("to", (value, self.dtype))
        cast.meta["example_value"] = fake
        return cast


def narrower_value(args: Call) -> int | None:
    """The value's head_dim where it is smaller than the query's (``attention_problem`` has
    checked both are numbers and the value no wider), else None."""
    value_dim = model_constant(example_value(args["value"]).shape[-1])
    return value_dim if value_dim < model_constant(example_value(args["query"]).shape[-1]) else None


def call_facts(node: torch.fx.Node, args: Call, *sizes, key: torch.fx.Node | None = None, **masks) -> CallFacts:
    """The facts the kernel policy decides an SDPA call's kernel by: its device, the dtype it
    computes in, head_dim, a narrower value's head_dim, its shape (``key``: the key the op
    reads, where not SDPA's: before transformers' repeat), and the rule's ``sizes`` and
    ``masks`` (``CallFacts``' further fields). The same facts the op's call gives at run time
    (``AttentionCall.facts``), so a measurement made for one answers the other."""
    query = example_value(args["query"])
    batch, heads, queries = query.shape[0], model_constant(query.shape[1]), query.shape[2]
    kv_heads = model_constant(example_value(key if key is not None else args["key"]).shape[1])
    shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, queries=queries)
    result = example_value(node)
    # Dynamo traces a no_grad step as a graph of its own, whose results need no gradient.
    grad = not isinstance(result, torch.Tensor) or result.requires_grad
    return CallFacts(
        query.device,
        computed_dtype(node, args),
        model_constant(query.shape[-1]),
        *sizes,
        value_head_dim=narrower_value(args),
        **{"grad": grad, **shape, **masks},
    )


def _padded(value: torch.Tensor, padding: tuple[int, int] | None) -> torch.Tensor:
    return value if padding is None else torch.nn.functional.pad(value, padding)


def _storing_steps(value_dim: int | None, layout: str | None) -> list[tuple[str, Any, tuple]]:
    """The calls, as (node op, target, arguments after the tensor), that turn the op's output
    (heads-last storage) into SDPA's result as SDPA stored it: sliced to a narrower value's
    head_dim, then laid out as SDPA's was."""
    steps = []
    if value_dim is not None:
        steps.append(("call_function", operator.getitem, ((Ellipsis, slice(None, value_dim)),)))
        if layout != "contiguous":  # heads-last, as SDPA stores it
            return [
                *steps,
                ("call_method", "transpose", (1, 2)),
                ("call_method", "contiguous", ()),
                ("call_method", "transpose", (1, 2)),
            ]
    if layout == "contiguous":
        steps.append(("call_method", "contiguous", ()))
    return steps


def _run_step(step: tuple[str, Any, tuple], tensor: torch.Tensor) -> torch.Tensor:
    kind, target, rest = step
    return getattr(tensor, target)(*rest) if kind == "call_method" else target(tensor, *rest)


# -- what the rules that swap SDPA for an op share -------------------------------------------


# x[:, :, None], with the trailing dimensions of the 4-D K/V spelled out or not.
_GROUP_AXIS_AT_2 = tuple((slice(None), slice(None), None) + (slice(None),) * n for n in range(3))


def unrepeated(node: torch.fx.Node, context: Context) -> tuple[torch.fx.Node, int] | None:
    """K/V before transformers' repeat_kv (x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)).

    Returns (source, group) when every step matches exactly, so that repeated head h is
    source head h // group: the op's GQA convention.
    """
    read = context.calls.read
    merge = read(node) if node.op == "call_method" and node.target in ("reshape", "view") else None
    expand = merge["input"] if merge is not None else None
    if not (isinstance(expand, torch.fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    expand_call = read(expand)
    inserted = expand_call["input"] if expand_call is not None else None
    if not (
        isinstance(inserted, torch.fx.Node) and inserted.op == "call_function" and inserted.target is operator.getitem
    ):
        return None
    source, index = read(inserted).first(2)
    if index not in _GROUP_AXIS_AT_2:
        return None
    shapes = [example_value(n) for n in (source, expand, node)]
    if not all(isinstance(t, torch.Tensor) for t in shapes):
        return None
    src, expanded, merged = (t.shape for t in shapes)
    if len(src) != 4 or len(expanded) != 5 or len(merged) != 4:
        return None
    group = expanded[2]
    same = [
        (expanded[0], src[0]),
        (expanded[1], src[1]),
        (expanded[3], src[2]),
        (expanded[4], src[3]),
        (merged[0], src[0]),
        (merged[1], src[1] * group),
        (merged[2], src[2]),
        (merged[3], src[3]),
    ]
    if not isinstance(group, int) or not all(same_size(a, b) for a, b in same):
        return None
    return source, group


def op_key_value(args, context: Context) -> tuple[torch.fx.Node, torch.fx.Node]:
    """K/V for the op: the sources of a recognised repeat_kv, where neither the source nor the
    repeated copy may be written before SDPA reads it (the op reads the source at the call),
    else SDPA's own key and value."""
    key, value = args["key"], args["value"]
    key_source, value_source = unrepeated(key, context), unrepeated(value, context)
    if not (key_source and value_source and key_source[1] == value_source[1]):
        return key, value
    writes = context.evaluator.writes
    untouched = all(writes.writer(node) is None for node in (key, value, key_source[0], value_source[0]))
    return (key_source[0], value_source[0]) if untouched else (key, value)


def repeat_chain(node: torch.fx.Node, context: Context) -> set[torch.fx.Node]:
    """The repeat_kv nodes between a source and SDPA's key or value (see ``unrepeated``)."""
    expand = context.calls.read(node)["input"]
    return {node, expand, context.calls.read(expand)["input"]}


def recomputed_read(tensors, node: torch.fx.Node, mask: torch.fx.Node) -> str | None:
    """Why the op at ``node`` cannot take its copies of ``tensors`` before its activation-
    checkpoint body (``own_copy``), or None: the body builds the mask itself (the mask is no
    body input) from a tensor of the calling graph, so eager's recomputation in the backward
    reads that tensor again, as a write between forward and backward left it, where the op
    would read the copy taken before."""
    if mask.op == "placeholder":  # built before the body: the recomputation reads it as given
        return None
    outer = sorted({input_name(tensor) for tensor in tensors if tensor is not None and tensor.graph is not node.graph})
    if outer:
        return f"its checkpointed body builds the mask from {', '.join(outer)} again in the backward"
    return None


def own_copy(tensor: torch.fx.Node, node: torch.fx.Node, function, *args) -> torch.fx.Node:
    """``function(tensor, *args)``, a tensor of the op's own, where the op at ``node`` can read
    it: just before it; or, for an op in an activation-checkpoint body, in the graph that
    calls the body, passed in. The body runs again in the backward and then reads that copy,
    which the caller cannot write, as eager's recomputation reads the mask it was given."""
    if tensor.graph is node.graph:
        return insert_before(node, function, tensor, *args)
    first = checkpoint_calls(tensor.graph, node.graph)[0]
    return pass_into_body(insert_before(first, function, tensor, *args), node.graph)


def insert_before(node: torch.fx.Node, function, *args) -> torch.fx.Node:
    """``function(*args)`` as a new node before ``node``, with its fake value."""
    fake = fake_result(function, *args)
    with node.graph.inserting_before(node):
        inserted = node.graph.call_function(function, args)
    inserted.meta["example_value"] = fake
    return inserted
