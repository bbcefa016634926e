"""Calls of the chunked kernel run whole: one fused call over all keys.

A call whose keys all lie in every row's window (S <= w with the causal band), or whose band
skips too few keys for chunks to pay (Sk <= span + rows per chunk), runs as one fused call
over all its keys for the whole batch, as SDPA itself runs it: with the kernel's own causal
masking where the band is exactly causal, else with the band and batch masks as one additive
mask. No chunk bookkeeping, no per-row loop, no cross-chunk sums. ``ChunkedKernel.plan``
(``chunked.py``) asks ``whole_call`` first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ...window import UNBOUNDED, rows_with_keys, window_mask
from ..layout import heads_last, new_logsumexp
from . import backends as chunk_backends
from .backends import FUSED_CPU
from .plan import BatchMasks, ChunkTuning, additive_mask, call_budget, rows_per_chunk

Tensor = torch.Tensor


class WholeCall(NamedTuple):
    # The kernel's own top-left causal masking (a causal band, Sq == Sk): it skips the key
    # blocks past the diagonal, with or without a mask.
    causal: bool
    mask: torch.Tensor | None  # additive: (Sq, Sk), (B, 1, 1, Sk) or (B, 1, Sq, Sk)
    # (B, Sq) rows that see no key, where a mask may leave some: asked by the forward only.
    rows_without_keys: Callable[[], torch.Tensor] | None


def whole_call(call, tuning: ChunkTuning = ChunkTuning()) -> WholeCall | None:
    """The call as one fused CPU call, or None where chunks cost less (or it would pass the
    call budget's memory for its mask). Built from as few tensor ops as it can: a short call's
    fixed cost is what it is measured by."""
    query, key = call.query, call.key
    if chunk_backends.backend_for(query.device) is not FUSED_CPU:
        return None
    batch, seq_q, seq_k = query.shape[0], query.shape[2], key.shape[2]
    masks = BatchMasks(call.key_padding, call.segment_ids, call.block_ids)
    sees_every_earlier_key = call.left == UNBOUNDED or call.left >= seq_k - 1
    sees_every_later_key = call.right == UNBOUNDED or call.right >= seq_q - 1
    causal = call.right == 0 and seq_q == seq_k and masks.block_ids is None
    band_needed = not (sees_every_earlier_key and (sees_every_later_key or causal))
    if not band_needed and not masks.any() and masks.block_ids is None:
        return WholeCall(causal and not sees_every_later_key, None, None)
    group = query.shape[1] // key.shape[1]
    if UNBOUNDED not in (call.left, call.right) and seq_k > most_whole_keys(
        call.left, call.right, group, causal, tuning
    ):
        return None
    per_batch = masks.any() or masks.block_ids is not None
    if (batch if per_batch else 1) * seq_q * seq_k > call_budget(query, key, call.value, tuning):
        return None
    if masks.block_ids is None and (masks.key_padding is None or masks.segment_ids is None):
        band = _band_additive(seq_q, seq_k, call.left, call.right, query.dtype, query.device) if band_needed else None
        if masks.segment_ids is not None:  # Sq == Sk: every row sees its own key
            ids = masks.segment_ids
            outside = band if band is not None else torch.zeros((), dtype=query.dtype, device=query.device)
            return WholeCall(
                causal, torch.where((ids[:, :, None] != ids[:, None, :])[:, None], float("-inf"), outside), None
            )
        if masks.key_padding is None:
            first_row = rows_with_keys(seq_q, seq_k, call.right)[0]
            keyless = functools.partial(_first_rows, batch, seq_q, first_row, query.device) if first_row else None
            return WholeCall(causal, band, keyless)
        keys = torch.full(masks.key_padding.shape, float("-inf"), dtype=query.dtype, device=query.device)
        keys = keys.masked_fill_(masks.key_padding, 0)[:, None, None, :]
        keyless = functools.partial(_rows_without_unpadded_keys, masks.key_padding, seq_q, call.left, call.right)
        return WholeCall(causal, keys if band is None else band + keys, keyless)
    visible = window_mask(seq_q, seq_k, call.left, call.right, query.device)
    if masks.block_ids is not None:  # the same image is seen past the right side (Sq == Sk)
        ids = masks.block_ids
        same_block = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
        visible = window_mask(seq_q, seq_k, call.left, UNBOUNDED, query.device) & (visible | same_block)
    if masks.key_padding is not None:
        visible = visible & masks.key_padding[:, None, :]
    if masks.segment_ids is not None:
        visible = visible & (masks.segment_ids[:, :, None] == masks.segment_ids[:, None, :])
    mask = additive_mask(visible.expand(batch, seq_q, seq_k)[:, None], query.dtype)
    # A row sees its own key (its segment's, its image's) unless padding hides it or it lies
    # before the first key its window reaches.
    if masks.key_padding is None and rows_with_keys(seq_q, seq_k, call.right)[0] == 0:
        return WholeCall(causal, mask, None)
    rows_without_keys = (~visible.any(dim=-1)).expand(batch, seq_q)
    return WholeCall(causal, mask, lambda: rows_without_keys)


# Bands of at most this many scores are kept for the next call of the same lengths and window
# (every layer of a step, forward and backward): 4 MiB each in fp32.
CACHED_BAND_SCORES = 1 << 20


def _band_additive(
    seq_q: int, seq_k: int, left: int, right: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The window's (Sq, Sk) additive mask. Read-only: the calls that share it only read it."""
    if seq_q * seq_k > CACHED_BAND_SCORES:
        return additive_mask(window_mask(seq_q, seq_k, left, right, device), dtype)
    return _cached_band_additive(seq_q, seq_k, left, right, dtype, device)


@functools.lru_cache(maxsize=4)
def _cached_band_additive(seq_q, seq_k, left, right, dtype, device) -> torch.Tensor:
    return additive_mask(window_mask(seq_q, seq_k, left, right, device), dtype)


def _first_rows(batch: int, seq_q: int, count: int, device: torch.device) -> torch.Tensor:
    """(B, Sq): True for the first ``count`` rows (those before the first key their window reaches)."""
    return (torch.arange(seq_q, device=device) < count).expand(batch, seq_q)


def _rows_without_unpadded_keys(key_padding: torch.Tensor, seq_q: int, left: int, right: int) -> torch.Tensor:
    """(B, Sq): rows whose window holds no unpadded key, from the running count of unpadded
    keys: row i's window is keys [start, stop), and it holds count[stop] - count[start] of them."""
    seq_k = key_padding.shape[1]
    count = key_padding.cumsum(dim=1)  # unpadded keys in [0, j]
    if (left == UNBOUNDED or left >= seq_k - 1) and right == 0 and seq_q == seq_k:
        return count == 0  # row i's window is [0, i]
    start, stop = _window_ranges(seq_q, seq_k, left, right, key_padding.device)
    count = torch.nn.functional.pad(count, (1, 0))  # (B, Sk + 1): unpadded keys before each
    return count[:, stop] == count[:, start]


@functools.lru_cache(maxsize=8)
def _window_ranges(
    seq_q: int, seq_k: int, left: int, right: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's keys as a half-open range [start, stop) of 0..Sk, stop >= start (empty
    where the window reaches no key)."""
    aligned = torch.arange(seq_q, device=device) + (seq_k - seq_q)  # the key row i is aligned with
    start = aligned.new_zeros(seq_q) if left == UNBOUNDED else (aligned - left).clamp(0, seq_k)
    stop = aligned.new_full((seq_q,), seq_k) if right == UNBOUNDED else (aligned + right + 1).clamp(0, seq_k)
    return start, torch.maximum(start, stop)


def most_whole_keys(left: int, right: int, group: int, causal: bool, tuning: ChunkTuning = ChunkTuning()) -> int:
    """The most keys a call of a bounded window runs whole with. A chunk's row scores about
    span + rows keys; a whole call's row all Sk keys, or about half of them with the kernel's
    own causal masking, which skips the key blocks past the diagonal (``benchmarks/bench_op.py
    --sweep``: chunks at S = 2w lost to SDPA's causal call, 0.83x at w = 128)."""
    chunk_keys = left + right + rows_per_chunk(left, right, group, tuning)
    return 2 * chunk_keys if causal else chunk_keys


def whole_forward(query: Tensor, key: Tensor, value: Tensor, scale: float, whole: WholeCall) -> tuple[Tensor, Tensor]:
    out, lse = FUSED_CPU.forward(query, key, value, whole.mask, scale, whole.causal)
    logsumexp = new_logsumexp(query).copy_(lse)
    # Rows without keys: the kernel returns zeros for them (``tests/kernels/test_whole_calls.py`` holds
    # it to that), and lse +inf is set here as FA2 returns it, so they pass no gradient.
    if whole.rows_without_keys is not None:
        logsumexp.masked_fill_(whole.rows_without_keys()[:, None, :], float("inf"))
    return heads_last(out), logsumexp


def whole_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    scale: float,
    whole: WholeCall,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_q, grad_k, grad_v = FUSED_CPU.backward(
        grad_out, query, key, value, out, logsumexp, whole.mask, scale, whole.causal
    )
    return heads_last(grad_q), heads_last(grad_k), heads_last(grad_v)
