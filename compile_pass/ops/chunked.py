"""Chunked band attention: O(S * (w + chunk)) compute and memory on any device.

Query rows are cut into chunks of ``rows_per_chunk(left, right)``. A chunk's key span covers
every key any of its rows can see, so each row's softmax is complete inside
its chunk: the forward writes final outputs and row logsumexps, and the
backward sums each chunk's key/value gradients into the overlapping spans.

Each chunk runs through a *chunk backend*: exact attention with a small additive
mask that returns (out, logsumexp), and its backward from that logsumexp.
On the CPU that is aten's fused flash kernel; elsewhere a matmul/softmax
version that works on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .layout import accumulation_dtype, empty_like_heads_last, new_logsumexp
from .window import UNBOUNDED, band_mask, key_span, rows_with_keys

# Rows per chunk. Each row scores span + rows - 1 keys instead of span, so narrow windows
# want few rows; aten's CPU kernel blocks queries by 32 below 192 rows and by 64 from 192
# up, which makes 192 the cheapest per row once the window is wide. Measured with
# benchmarks/bench_op.py --chunks (S=8192, runs in benchmarks/RESULTS.md): 64 rows beat 192
# by 1.25-1.5x at w=256 and by 1.3x at w=128; from w=512 up the two are within noise, and
# 192 was best in the first sweep at w=1024.
NARROW_CHUNK, WIDE_CHUNK, WIDE_SPAN = 64, 192, 512
# Overrides the choice when set (tests shrink it to cross many chunk edges).
QUERY_CHUNK: int | None = None


def rows_per_chunk(left: int, right: int) -> int:
    if QUERY_CHUNK is not None:
        return QUERY_CHUNK
    if UNBOUNDED in (left, right) or left + right + 1 >= WIDE_SPAN:
        return WIDE_CHUNK
    return NARROW_CHUNK


@dataclass(frozen=True)
class Chunk:
    rows: slice
    keys: slice
    # Additive mask (0 / -inf) of shape (rows, keys); None when every row sees every key.
    mask: torch.Tensor | None


def plan_chunks(
    seq_q: int,
    seq_k: int,
    left: int,
    right: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    chunk_rows: int,
) -> list[Chunk]:
    """Chunks covering exactly the query rows that see at least one key."""
    key_offset = seq_k - seq_q
    first_row, stop_row = rows_with_keys(seq_q, seq_k, right)
    chunks = []
    for start in range(first_row, stop_row, chunk_rows):
        last = min(stop_row, start + chunk_rows) - 1
        key_start, key_stop = key_span(start, last, seq_k, left, right, key_offset)
        # Spans grow monotonically with the row, so the first row bounds the
        # right edge and the last row the left edge.
        every_row_sees_every_key = (
            key_span(last, last, seq_k, left, right, key_offset)[0] == key_start
            and key_span(start, start, seq_k, left, right, key_offset)[1] == key_stop
        )
        mask = None
        if not every_row_sees_every_key:
            visible = band_mask(
                torch.arange(start, last + 1, device=device),
                torch.arange(key_start, key_stop, device=device),
                left,
                right,
                key_offset,
            )
            mask = torch.zeros(visible.shape, dtype=dtype, device=device)
            mask.masked_fill_(~visible, float("-inf"))
        chunks.append(Chunk(slice(start, last + 1), slice(key_start, key_stop), mask))
    return chunks


class ChunkBackend(NamedTuple):
    # (q, k, v, mask, scale) -> (out, logsumexp)
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (grad_out, q, k, v, out, logsumexp, mask, scale) -> (dq, dk, dv)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _fused_cpu_forward(q, k, v, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale
    )


def _fused_cpu_backward(grad_out, q, k, v, out, logsumexp, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, logsumexp, 0.0, False, attn_mask=mask, scale=scale
    )


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, ...) -> (B, Hkv, Hq // Hkv, S, ...): query heads sharing one KV head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _math_probabilities(q, k, mask, scale, logsumexp=None):
    """Scores in the accumulation dtype, grouped per KV head; returns (probs, logsumexp, q, k)."""
    acc = accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg = _grouped(q, kv_heads).to(acc)
    kg = k.unsqueeze(2).to(acc)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if mask is not None:
        # A per-batch (B, 1, rows, keys) mask lines up with the grouped (B, Hkv, g, rows, keys).
        scores = scores + (mask.unsqueeze(1) if mask.dim() == 4 else mask).to(acc)
    if logsumexp is None:
        logsumexp = torch.logsumexp(scores, dim=-1)
    else:
        logsumexp = _grouped(logsumexp, kv_heads)
    return torch.exp(scores - logsumexp.unsqueeze(-1)), logsumexp, qg, kg


def _math_forward(q, k, v, mask, scale):
    probs, logsumexp, _, _ = _math_probabilities(q, k, mask, scale)
    out = torch.matmul(probs, v.unsqueeze(2).to(probs.dtype))
    return out.flatten(1, 2).to(q.dtype), logsumexp.flatten(1, 2)


def _math_backward(grad_out, q, k, v, out, logsumexp, mask, scale):
    probs, _, qg, kg = _math_probabilities(q, k, mask, scale, logsumexp)
    kv_heads = k.shape[1]
    acc = probs.dtype
    grad_out_g = _grouped(grad_out, kv_heads).to(acc)
    out_g = _grouped(out, kv_heads).to(acc)
    vg = v.unsqueeze(2).to(acc)
    grad_probs = torch.matmul(grad_out_g, vg.transpose(-1, -2))
    # softmax backward: dS = P * (dP - rowsum(dO * O))
    grad_scores = probs * (grad_probs - (grad_out_g * out_g).sum(-1, keepdim=True)) * scale
    grad_q = torch.matmul(grad_scores, kg).flatten(1, 2)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg).sum(2)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out_g).sum(2)
    return grad_q.to(q.dtype), grad_k, grad_v


FUSED_CPU = ChunkBackend(_fused_cpu_forward, _fused_cpu_backward)
MATH = ChunkBackend(_math_forward, _math_backward)


def backend_for(device: torch.device) -> ChunkBackend:
    return FUSED_CPU if device.type == "cpu" else MATH


def _plan_for(query: torch.Tensor, key: torch.Tensor, left: int, right: int) -> list[Chunk]:
    return plan_chunks(
        query.shape[2],
        key.shape[2],
        left,
        right,
        dtype=query.dtype,
        device=query.device,
        chunk_rows=rows_per_chunk(left, right),
    )


def _query_is_token(key_padding: torch.Tensor, rows: slice, key_offset: int) -> torch.Tensor:
    """(B, rows): whether each query's own token, at its aligned key position
    ``row + key_offset``, is a real token. Rows aligned before key 0 have none to be padding."""
    aligned = torch.arange(rows.start, rows.stop, device=key_padding.device) + key_offset
    return torch.where(aligned >= 0, key_padding[:, aligned.clamp(min=0)], True)


def _with_batch_masks(chunk: Chunk, key_padding, segment_ids, dtype: torch.dtype, key_offset: int):
    """The chunk's band mask combined with per-batch conditions: key_padding[b, kv], the
    query's own token not padding, and segment_ids[b, q] == segment_ids[b, kv]. Returns the
    (B, 1, rows, keys) additive mask and the (B, rows) rows left with no visible key, or the
    band mask alone and None."""
    if key_padding is None and segment_ids is None:
        return chunk.mask, None
    some = key_padding if key_padding is not None else segment_ids
    batch, rows, keys = some.shape[0], chunk.rows.stop - chunk.rows.start, chunk.keys.stop - chunk.keys.start
    visible = torch.ones(batch, rows, keys, dtype=torch.bool, device=some.device)
    if key_padding is not None:
        visible &= key_padding[:, None, chunk.keys]
        # A padded query sees nothing, as in FA2's varlen op: zeros, lse +inf, no gradient.
        visible &= _query_is_token(key_padding, chunk.rows, key_offset)[:, :, None]
    if segment_ids is not None:
        visible &= segment_ids[:, chunk.rows, None] == segment_ids[:, None, chunk.keys]
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
    if chunk.mask is not None:
        mask += chunk.mask
    without_keys = ~torch.isfinite(mask).any(dim=-1)
    return mask[:, None], without_keys


def chunked_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    left: int,
    right: int,
    scale: float,
    backend: ChunkBackend | None = None,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    backend = backend or backend_for(query.device)
    out = empty_like_heads_last(query).zero_()
    # +inf for rows that see no key, as FA2 does: exp(score - lse) is then 0.
    logsumexp = new_logsumexp(query).fill_(float("inf"))
    key_offset = key.shape[2] - query.shape[2]
    for chunk in _plan_for(query, key, left, right):
        mask, without_keys = _with_batch_masks(chunk, key_padding, segment_ids, query.dtype, key_offset)
        chunk_out, chunk_lse = backend.forward(
            query[:, :, chunk.rows], key[:, :, chunk.keys], value[:, :, chunk.keys], mask, scale
        )
        if without_keys is not None:
            chunk_out = chunk_out.masked_fill(without_keys[:, None, :, None], 0)
            chunk_lse = chunk_lse.masked_fill(without_keys[:, None, :], float("inf"))
        out[:, :, chunk.rows] = chunk_out
        logsumexp[:, :, chunk.rows] = chunk_lse
    return out, logsumexp


def chunked_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    left: int,
    right: int,
    scale: float,
    backend: ChunkBackend | None = None,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = backend or backend_for(query.device)
    acc = accumulation_dtype(query.dtype)
    grad_q = empty_like_heads_last(query).zero_()
    # Key spans of neighbouring chunks overlap: sum their contributions at
    # accumulation precision, round once at the end.
    grad_k = empty_like_heads_last(key, acc).zero_()
    grad_v = empty_like_heads_last(value, acc).zero_()
    key_offset = key.shape[2] - query.shape[2]
    for chunk in _plan_for(query, key, left, right):
        rows, keys = chunk.rows, chunk.keys
        # Rows without keys carry lse = +inf: their probabilities, hence gradients, are 0.
        mask, _ = _with_batch_masks(chunk, key_padding, segment_ids, query.dtype, key_offset)
        chunk_dq, chunk_dk, chunk_dv = backend.backward(
            grad_out[:, :, rows],
            query[:, :, rows],
            key[:, :, keys],
            value[:, :, keys],
            out[:, :, rows],
            logsumexp[:, :, rows],
            mask,
            scale,
        )
        grad_q[:, :, rows] = chunk_dq
        grad_k[:, :, keys] += chunk_dk
        grad_v[:, :, keys] += chunk_dv
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)
