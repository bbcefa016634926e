"""The ``compile_pass::sliding_window_attention_*`` ops and their Python entry.

Three thin layers, as in flash-attn's interface (registered by ``registration.define_op``):
1. two opaque ops, forward -> (out, logsumexp) and backward -> (dq, dk, dv), each
   running the kernel the policy routes it to (``policy.POLICY.route``): torch's FA2 (dense
   or varlen), flash-attn's where asked for, or the chunked kernel;
2. fake implementations, so the ops trace with symbolic sizes;
3. the autograd registration tying the backward op to the forward op.

Soft-capped scores (FA2's ``softcap``: ``cap * tanh(s / cap)`` before the mask) reach the
kernels as ``AttentionCall.softcap``; a kernel that cannot cap says so in ``cannot``.

Optional sinks (one logit per query head or per row, ``sinks.py``) are applied around whichever
kernel runs: the forward op scales the kernel's output by c = sigmoid(lse - sink) and returns the
plain logsumexp (over the keys, without the sink: what the kernels' backward reads; the
sink's own is ``logaddexp(lse, sink)``); the autograd formula rescales the output's gradient
before the backward op, which is the kernels' own and takes no sinks, and computes the
sinks' gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..kernels import fa2, policy
from ..kernels.contract import AttentionCall, CallFacts
from ..kernels.fa2 import varlen as fa2_varlen
from ..kernels.layout import (
    check_attention_inputs,
    check_sinks,
    check_softcap,
    empty_like_heads_last,
    last_dim_contiguous,
    new_logsumexp,
)
from ..registration import define_op
from ..sizes import same_size
from ..window import normalize_window
from .keyless_rows import add_gradients, fill_mean, zero_rows
from .sinks import apply_sinks, sink_gradients


def _sliding_window_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_left: int,
    window_right: int,
    scale: float,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    layout: torch.Tensor | None = None,
    layout_sizes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    keyless_mean: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_forward_inputs(query, key, value, scale, key_padding, segment_ids, block_ids, sinks, softcap, keyless_mean)
    query, key, value = (last_dim_contiguous(x) for x in (query, key, value))
    call = AttentionCall(
        query,
        key,
        value,
        window_left,
        window_right,
        scale,
        key_padding,
        segment_ids,
        block_ids,
        _given(layout, layout_sizes),
        softcap,
    )
    route = policy.POLICY.route(call)
    if route.kernel is None:
        out, logsumexp = empty_like_heads_last(query).zero_(), new_logsumexp(query).fill_(float("inf"))
    else:
        out, logsumexp = route.kernel.forward(call, route.plan)
    if keyless_mean:
        return fill_mean(out, logsumexp, query, key, value, scale, softcap, keyless_mean), logsumexp
    return apply_sinks(out, logsumexp, sinks), logsumexp


def _check_forward_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    key_padding: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    block_ids: torch.Tensor | None,
    sinks: torch.Tensor | None,
    softcap: float,
    keyless_mean: float,
) -> None:
    """The forward op's checks, which its fake makes too (the backward op takes what the
    forward took)."""
    check_attention_inputs(query, key, value, key_padding, segment_ids, scale, block_ids)
    check_sinks(query, sinks)
    check_softcap(softcap)
    torch._check_value(
        keyless_mean >= 0 and not (keyless_mean > 0 and sinks is not None),
        lambda: f"keyless_mean must be >= 0 (0: rows that see no key get zeros) and without sinks: {keyless_mean!r}",
    )


def _given(layout: torch.Tensor | None, layout_sizes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The op's two layout tensors as ``AttentionCall.layout``: both or neither."""
    if layout is None and layout_sizes is None:
        return None
    if layout is None or layout_sizes is None:
        raise ValueError("layout and layout_sizes come together (fa2_varlen.encode_layout makes both)")
    return layout, layout_sizes


def _padding_or_segments(key_padding: torch.Tensor | None, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """The (batch, seq) tensor a varlen layout is read from: the padding, else the segment ids."""
    if key_padding is not None:
        return key_padding
    if segment_ids is None:
        raise ValueError("a varlen layout needs key_padding or segment_ids")
    return segment_ids


def _forward_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_left: int,
    window_right: int,
    scale: float,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    layout: torch.Tensor | None = None,
    layout_sizes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    keyless_mean: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_forward_inputs(query, key, value, scale, key_padding, segment_ids, block_ids, sinks, softcap, keyless_mean)
    # Every kernel returns these layouts, for any input strides (see fa2.py).
    return empty_like_heads_last(query), new_logsumexp(query)


def _sliding_window_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    window_left: int,
    window_right: int,
    scale: float,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    layout: torch.Tensor | None = None,
    layout_sizes: torch.Tensor | None = None,
    softcap: float = 0.0,
    keyless_mean: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, query, key, value, out = (last_dim_contiguous(x) for x in (grad_out, query, key, value, out))
    given_grad_out = grad_out
    if keyless_mean:
        grad_out = zero_rows(grad_out, logsumexp)
    call = AttentionCall(
        query,
        key,
        value,
        window_left,
        window_right,
        scale,
        key_padding,
        segment_ids,
        block_ids,
        _given(layout, layout_sizes),
        softcap,
    )
    route = policy.POLICY.route(call)
    if route.kernel is None:
        grads = (
            empty_like_heads_last(query).zero_(),
            empty_like_heads_last(key).zero_(),
            empty_like_heads_last(value).zero_(),
        )
    else:
        grads = route.kernel.backward(call, route.plan, grad_out, out, logsumexp)
    if keyless_mean:
        return add_gradients(grads, given_grad_out, query, key, value, logsumexp, scale, softcap)
    return grads


def backward_fake(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) as every attention backward op returns them, uninitialised: heads-last, like
    the inputs. The fake of each such op whose first inputs are (grad_out, query, key, value)."""
    return empty_like_heads_last(query), empty_like_heads_last(key), empty_like_heads_last(value)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    (
        query,
        key,
        value,
        window_left,
        window_right,
        scale,
        key_padding,
        segment_ids,
        block_ids,
        layout,
        layout_sizes,
        sinks,
        softcap,
        keyless_mean,
    ) = inputs
    out, logsumexp = output
    ctx.save_for_backward(
        query, key, value, out, logsumexp, key_padding, segment_ids, block_ids, layout, layout_sizes, sinks
    )
    ctx.window = (window_left, window_right)
    ctx.scale = scale
    ctx.softcap = softcap
    ctx.keyless_mean = keyless_mean
    ctx.mark_non_differentiable(logsumexp)


def _input_gradients(
    ctx: Any, grad_out: torch.Tensor, _grad_logsumexp: torch.Tensor
) -> tuple[torch.Tensor | None, ...]:
    query, key, value, out, logsumexp, key_padding, segment_ids, block_ids, layout, layout_sizes, sinks = (
        ctx.saved_tensors
    )
    grad_out, grad_sinks = sink_gradients(grad_out, out, logsumexp, sinks)
    grad_q, grad_k, grad_v = sliding_window_attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        *ctx.window,
        ctx.scale,
        key_padding,
        segment_ids,
        block_ids,
        layout,
        layout_sizes,
        ctx.softcap,
        ctx.keyless_mean,
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, None, grad_sinks, None, None


_OPTIONAL_MASKS = (
    "Tensor? key_padding=None, Tensor? segment_ids=None, Tensor? block_ids=None, Tensor? layout=None, "
    "Tensor? layout_sizes=None"
)
sliding_window_attention_backward = define_op(
    "sliding_window_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    f"Tensor logsumexp, SymInt window_left, SymInt window_right, float scale, {_OPTIONAL_MASKS}, float softcap=0.0, "
    "float keyless_mean=0.0) "
    "-> (Tensor, Tensor, Tensor)",
    _sliding_window_attention_backward,
    backward_fake,
)
sliding_window_attention_forward = define_op(
    "sliding_window_attention_forward(Tensor query, Tensor key, Tensor value, SymInt window_left, "
    f"SymInt window_right, float scale, {_OPTIONAL_MASKS}, Tensor? sinks=None, float softcap=0.0, "
    "float keyless_mean=0.0) -> (Tensor, Tensor)",
    _sliding_window_attention_forward,
    _forward_fake,
    setup_context=_setup_context,
    backward=_input_gradients,
)


def _varlen_layout(
    key_padding: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    window_left: int,
    window_right: int,
    dtype: torch.dtype,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FA2 varlen layout of self-attention (Sq == Sk) over this padding or these segment
    ids under the window, encoded (``fa2_varlen.encode_layout``) for every layer that reads
    them with queries of ``dtype`` and ``head_dim``: computed (one host sync) where such a
    call would try an FA2 kernel first, and left out (SKIPPED) where it would not. The
    layers' ops take it in place of computing their own, forward and backward."""
    some = _padding_or_segments(key_padding, segment_ids)
    batch, seq = some.shape
    window = (window_left, window_right)
    if not _tries_fa2_first(key_padding, segment_ids, window_left, window_right, dtype, head_dim):
        return fa2_varlen.encode_layout(None, fa2_varlen.SKIPPED, some.device, batch, seq, *window)
    layout = fa2_varlen.varlen_layout(key_padding, segment_ids, *window)
    status = fa2_varlen.NOT_EXPRESSIBLE if layout is None else fa2_varlen.COMPUTED
    return fa2_varlen.encode_layout(layout, status, some.device, batch, seq, *window)


def _tries_fa2_first(
    key_padding: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    window_left: int,
    window_right: int,
    dtype: torch.dtype,
    head_dim: int,
    softcap: bool = False,
) -> bool:
    """Whether self-attention over this padding or these segment ids (with soft-capped scores
    where ``softcap``) tries an FA2 kernel first."""
    some = _padding_or_segments(key_padding, segment_ids)
    facts = CallFacts(
        some.device,
        dtype,
        head_dim,
        True,
        key_padding is not None,
        segment_ids is not None,
        False,
        some.shape[1],
        window_left,
        window_right,
        softcap=softcap,
    )
    # The static tables answer (the call's heads are not known here, and Dynamo traces this for
    # the op's Python entry): whether the layout is made ahead is a matter of speed only, as an
    # FA2 kernel routed otherwise makes its own.
    return isinstance(policy.POLICY.first(facts, measured=False), fa2.FA2Kernel)


def _varlen_layout_fake(
    key_padding: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    window_left: int,
    window_right: int,
    dtype: torch.dtype,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    some = _padding_or_segments(key_padding, segment_ids)
    pieces, sizes = fa2_varlen.layout_shapes(*some.shape)
    return some.new_empty(pieces, dtype=torch.int64), torch.empty(sizes, dtype=torch.int64, device="cpu")


varlen_layout = define_op(
    "varlen_layout(Tensor? key_padding, Tensor? segment_ids, SymInt window_left, SymInt window_right, "
    "ScalarType dtype, SymInt head_dim) -> (Tensor, Tensor)",
    _varlen_layout,
    _varlen_layout_fake,
)


def _private_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that the op saves for its backward. An opaque op, so that AOTAutograd's
    partitioner saves its result instead of recomputing a clone from ``x`` in the backward,
    where a write to ``x`` in between (even one torch's version counter misses) would show."""
    return x.clone()


def _private_copy_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


private_copy = define_op("private_copy(Tensor x) -> Tensor", _private_copy, _private_copy_fake)


def _segment_pairs(ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """One set of (batch, seq) segment ids equal exactly where both ``ids`` and ``other_ids``
    are: each position's index among the distinct (id, other id) pairs, int64 (a packed
    sequence's chunks). Exact for any integer values: no arithmetic that could wrap. A new
    tensor, which the op saves for its backward as it would a ``private_copy``."""
    pairs = torch.stack(torch.broadcast_tensors(ids.long(), other_ids.long()), dim=-1)
    index: torch.Tensor
    _, index = torch.unique(pairs.reshape(-1, 2), dim=0, return_inverse=True)
    return index.reshape(pairs.shape[:-1])


def _segment_pairs_fake(ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty(torch.broadcast_shapes(ids.shape, other_ids.shape), dtype=torch.int64, device=ids.device)


segment_pairs = define_op("segment_pairs(Tensor ids, Tensor other_ids) -> Tensor", _segment_pairs, _segment_pairs_fake)


def sliding_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window: tuple[int, int] = (-1, -1),
    causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    keyless_mean: float = 0.0,
) -> torch.Tensor:
    """Attention restricted to a FlashAttention-2 window, O(S * w) time and memory.

    Args:
        query: (batch, heads, seq_q, head_dim), SDPA layout. Transposed views of
            (batch, seq, heads, head_dim) storage are used without copies; any other
            strides work too (a strided last dimension is copied once).
        key: (batch, kv_heads, seq_k, head_dim); ``heads`` must be a multiple of
            ``kv_heads`` (GQA/MQA; K/V are never repeated in memory).
        value: (batch, kv_heads, seq_k, head_dim), as ``key``.
        window: ``(left, right)`` as in FA2: query ``i`` sees keys
            ``[i + seq_k - seq_q - left, i + seq_k - seq_q + right]``; -1 leaves
            that side unbounded. A causal sliding window of ``w`` keys is ``(w - 1, 0)``.
        causal: forces ``right = 0`` (bottom-right aligned when seq_q != seq_k).
        scale: softmax scale, a positive finite number (anything else raises ValueError);
            ``1 / sqrt(head_dim)`` when None.
        dropout_p: must be 0. Dropout is not supported: a non-zero value raises
            ``ValueError``, and the graph rewrite keeps SDPA for nodes with dropout.
        key_padding: optional (batch, seq_k) bool; False marks padding: no query sees a
            padded key. Every query row, padded or not, is computed as SDPA computes it with
            the same mask: over the keys its window sees (a right-padded row sees the last
            valid keys of its window), zeros where it sees none.
        segment_ids: optional (batch, seq) integer ids of packed sequences (Sq == Sk): a
            query sees only keys of its own segment.
        block_ids: optional (batch, seq) integer ids of bidirectional blocks, such as an
            image's tokens (Sq == Sk): a query whose id is >= 0 also sees every key of the
            same id that its window's left side allows, after it as well
            (``kv >= q - left and (kv <= q + right or ids[kv] == ids[q])``).
        sinks: optional floating tensor, one logit per query head (heads,) (GPT-OSS's
            attention sinks) or per row (batch, heads, seq_q), with a gradient: each row's
            softmax has one more column of its logit, dropped after the softmax
            (``softmax(cat([scores, sink]))[..., :-1] @ v``). Computed in fp32 (fp64 for fp64
            inputs) on every kernel; a row that sees no key still returns zeros.
        softcap: FA2's soft-capping of the scores, a finite number >= 0 (0: none): each score
            ``s = scale * q . k`` becomes ``softcap * tanh(s / softcap)`` before the window
            and masks (Gemma-2's ``attn_logit_softcapping``). Exact forward and backward on the
            chunked kernel (matmul/softmax per chunk: aten's fused CPU kernel has no softcap),
            flash-attn's and the wide-head Triton kernel's; torch's FA2 has none and passes such
            calls on.
        keyless_mean: 0 (rows that see no key get zeros), or a bound below which an additive
            mask's finite fill hides every score alike: such rows then get the mean of all
            ``seq_k`` values and its gradient, as the softmax over filled scores gives them
            (``ops/keyless_rows.py``; checked at run time: a larger score raises). Not with sinks.

    With key_padding or segment_ids, FA2 runs as varlen calls when each row's valid tokens (or
    each segment) are one contiguous run; everything else runs the chunked kernel.
    Rows that see no key return zeros (the mean of the values with ``keyless_mean``), never NaN.
    fp16, bf16, fp32 and fp64.
    On a CUDA GPU of sm80 or newer (not ROCm), fp16/bf16 and head_dim <= 256 (multiple of
    8) run torch's own FA2 kernels (flash-attn's with ``COMPILE_PASS_FLASH_ATTN=1``);
    everything else, and every case FA2 would not compute exactly, runs the chunked kernel
    (``kernels/chunked/__init__.py``). ``compile_pass.kernels.policy.POLICY.choose`` tells which, and whether
    it is as fast as SDPA there.

    Returns:
        (batch, heads, seq_q, head_dim), stored as (batch, seq_q, heads, head_dim).
    """
    if dropout_p != 0.0:
        raise ValueError(
            f"sliding_window_attention does not support dropout (got dropout_p={dropout_p}); "
            "use scaled_dot_product_attention for attention with dropout"
        )
    left, right = normalize_window(window, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    layout: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if (
        (key_padding is not None or segment_ids is not None)
        and same_size(query.shape[2], key.shape[2])
        and _tries_fa2_first(key_padding, segment_ids, left, right, query.dtype, query.shape[-1], softcap != 0)
    ):
        # As a rewritten graph does: the forward and the backward read one layout (one host
        # sync, not two) of one private copy of the masks.
        check_attention_inputs(query, key, value, key_padding, segment_ids, float(scale), block_ids)
        key_padding, segment_ids = (None if x is None else private_copy(x) for x in (key_padding, segment_ids))
        layout = varlen_layout(key_padding, segment_ids, left, right, query.dtype, query.shape[-1])
    out: torch.Tensor
    out, _ = sliding_window_attention_forward(
        query,
        key,
        value,
        left,
        right,
        float(scale),
        key_padding,
        segment_ids,
        block_ids,
        *layout,
        sinks,
        float(softcap),
        float(keyless_mean),
    )
    return out
