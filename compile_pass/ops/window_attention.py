"""The ``compile_pass::sliding_window_attention_*`` custom ops and their Python entry.

Three thin layers, as in flash-attn's interface:
1. two opaque ops, forward -> (out, logsumexp) and backward -> (dq, dk, dv), each
   running the kernel the policy routes it to (``policy.POLICY.route``): FA2, FA2's varlen
   op, or the chunked kernel;
2. fake implementations, so the ops trace with symbolic sizes;
3. the autograd registration tying the backward op to the forward op.
"""

from __future__ import annotations

import math
import torch

from . import chunked, flash, policy
from .layout import check_attention_inputs, empty_like_heads_last, last_dim_contiguous, new_logsumexp
from ..window import normalize_window


@torch.library.custom_op("compile_pass::sliding_window_attention_forward", mutates_args=())
def sliding_window_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_left: int,
    window_right: int,
    scale: float,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_attention_inputs(query, key, value, key_padding, segment_ids, scale, block_ids)
    query, key, value = (last_dim_contiguous(x) for x in (query, key, value))
    kernels = policy.POLICY
    route = kernels.route(query, key, window_left, window_right, key_padding, segment_ids, block_ids)
    if route.kernel == "empty":
        return empty_like_heads_last(query).zero_(), new_logsumexp(query).fill_(float("inf"))
    if route.kernel in ("flash", "flash_varlen"):
        if route.kernel == "flash":
            band = flash.flash_forward(query, key, value, window_left, window_right, scale)
        else:
            band = flash.flash_varlen_forward(query, key, value, scale, route.layout)
        if route.images is None:
            return band
        images = flash.flash_varlen_forward(query, key, value, scale, flash.VarlenLayout((route.images,)))
        return flash.with_image_rows(band, images, block_ids, empty_like_heads_last(query))
    masks = chunked.BatchMasks(key_padding, segment_ids, block_ids)
    return chunked.chunked_forward(query, key, value, window_left, window_right, scale, masks, tuning=kernels.chunking)


@sliding_window_attention_forward.register_fake
def _forward_fake(query, key, value, window_left, window_right, scale, key_padding=None, segment_ids=None, block_ids=None):
    check_attention_inputs(query, key, value, key_padding, segment_ids, scale, block_ids)
    # Every kernel returns these layouts, for any input strides (see flash.py).
    return empty_like_heads_last(query), new_logsumexp(query)


@torch.library.custom_op("compile_pass::sliding_window_attention_backward", mutates_args=())
def sliding_window_attention_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, query, key, value, out = (last_dim_contiguous(x) for x in (grad_out, query, key, value, out))
    kernels = policy.POLICY
    route = kernels.route(query, key, window_left, window_right, key_padding, segment_ids, block_ids)
    if route.kernel == "empty":
        return tuple(empty_like_heads_last(x).zero_() for x in (query, key, value))
    if route.kernel in ("flash", "flash_varlen"):
        # Image rows get their gradients from the image pass alone: none from the band's.
        band_lse = logsumexp if route.images is None else flash.without_image_rows(logsumexp, block_ids)
        if route.kernel == "flash":
            grads = flash.flash_backward(grad_out, query, key, value, out, band_lse, window_left, window_right, scale)
        else:
            grads = flash.flash_varlen_backward(grad_out, query, key, value, out, band_lse, scale, route.layout)
        if route.images is None:
            return grads
        layout = flash.VarlenLayout((route.images,))
        image_grads = flash.flash_varlen_backward(grad_out, query, key, value, out, logsumexp, scale, layout)
        return tuple(flash.summed_heads_last(a, b) for a, b in zip(grads, image_grads))
    args = (grad_out, query, key, value, out, logsumexp, window_left, window_right, scale)
    masks = chunked.BatchMasks(key_padding, segment_ids, block_ids)
    return chunked.chunked_backward(*args, masks, tuning=kernels.chunking)


@sliding_window_attention_backward.register_fake
def _backward_fake(
    grad_out, query, key, value, out, logsumexp, window_left, window_right, scale, key_padding=None, segment_ids=None,
    block_ids=None,
):
    return empty_like_heads_last(query), empty_like_heads_last(key), empty_like_heads_last(value)


def _setup_context(ctx, inputs, output):
    query, key, value, window_left, window_right, scale, key_padding, segment_ids, block_ids = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, key_padding, segment_ids, block_ids)
    ctx.window = (window_left, window_right)
    ctx.scale = scale
    ctx.mark_non_differentiable(logsumexp)


def _backward(ctx, grad_out, _grad_logsumexp):
    query, key, value, out, logsumexp, key_padding, segment_ids, block_ids = ctx.saved_tensors
    grad_q, grad_k, grad_v = sliding_window_attention_backward(
        grad_out, query, key, value, out, logsumexp, *ctx.window, ctx.scale, key_padding, segment_ids, block_ids
    )
    return grad_q, grad_k, grad_v, None, None, None, None, None, None


sliding_window_attention_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("compile_pass::private_copy", mutates_args=())
def private_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that the op saves for its backward. An opaque op, so that AOTAutograd's
    partitioner saves its result instead of recomputing a clone from ``x`` in the backward,
    where a write to ``x`` in between (even one torch's version counter misses) would show."""
    return x.clone()


@private_copy.register_fake
def _private_copy_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("compile_pass::segment_pairs", mutates_args=())
def segment_pairs(ids: torch.Tensor, other_ids: torch.Tensor) -> torch.Tensor:
    """One set of (batch, seq) segment ids equal exactly where both ``ids`` and ``other_ids``
    are: each position's index among the distinct (id, other id) pairs, int64 (a packed
    sequence's chunks). Exact for any integer values: no arithmetic that could wrap. A new
    tensor, which the op saves for its backward as it would a ``private_copy``."""
    pairs = torch.stack(torch.broadcast_tensors(ids.long(), other_ids.long()), dim=-1)
    _, index = torch.unique(pairs.reshape(-1, 2), dim=0, return_inverse=True)
    return index.reshape(pairs.shape[:-1])


@segment_pairs.register_fake
def _segment_pairs_fake(ids, other_ids):
    return torch.empty(torch.broadcast_shapes(ids.shape, other_ids.shape), dtype=torch.int64, device=ids.device)


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
) -> torch.Tensor:
    """Attention restricted to a FlashAttention-2 window, O(S * w) time and memory.

    Args:
        query: (batch, heads, seq_q, head_dim), SDPA layout. Transposed views of
            (batch, seq, heads, head_dim) storage are used without copies; any other
            strides work too (a strided last dimension is copied once).
        key, value: (batch, kv_heads, seq_k, head_dim); ``heads`` must be a
            multiple of ``kv_heads`` (GQA/MQA; K/V are never repeated in memory).
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
        With key_padding or segment_ids, CUDA + flash-attn uses FA2's varlen op when each row's valid tokens (or
        each segment) are one contiguous run; everything else runs the chunked kernel.

    Rows that see no key return zeros, never NaN. fp16, bf16, fp32 and fp64.
    On a CUDA GPU of sm80 or newer (not ROCm) with flash-attn >= 2.7, fp16/bf16 and
    head_dim <= 256 (multiple of 8) run FA2's kernels; everything else, and every case FA2
    would not compute exactly, runs the chunked kernel (``ops/chunked.py``).
    ``compile_pass.ops.policy.POLICY.choose`` tells which, and whether it beats SDPA there.

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
    out, _ = sliding_window_attention_forward(
        query, key, value, left, right, float(scale), key_padding, segment_ids, block_ids
    )
    return out
