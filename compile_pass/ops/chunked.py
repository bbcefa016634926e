"""Chunked band attention: O(S * (w + chunk)) compute and memory on any device.

Query rows are cut into chunks. A chunk's key span covers every key any of its rows can see,
so each row's softmax is complete inside its chunk: the forward writes final outputs and row
logsumexps, and the backward sums the key/value gradients of overlapping spans.

Chunks are grouped into *runs* (``plan_runs``), each computed by one call of the chunk
backend per batch row (a few, when its per-chunk results would not fit ``CALL_BUDGET``).
Away from the ends of the sequence every chunk of ``r`` rows sees the same band relative to
its first row, and chunk ``c + 1``'s keys start ``r`` keys after chunk ``c``'s: those chunks
form one run, with the chunk index as the batch dimension, K/V read through overlapping
views (``Tensor.unfold``, no copy) and one ``(r, span + r - 1)`` mask for every chunk. With
a causal window the rows before it (whose window starts at key 0) are one more call, with
the kernel's own causal masking; other windows and decoding shapes take a few runs of one
chunk each at the ends.

Query heads that share a key/value head (GQA) are stacked as rows of one kernel entry:
row ``s * g + m`` is query head ``h * g + m`` at position ``s``. The kernel then sees ``g``
times more rows per entry for the same span, which aten's CPU kernel computes in larger,
cheaper query blocks; the backward gets one key/value gradient per KV head.

A *chunk backend* computes exact attention of a batch of chunks with an additive mask,
returning (out, logsumexp), and its backward from that logsumexp. On the CPU that is aten's
fused flash kernel; elsewhere a matmul/softmax version that works on every device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .kernel import band_skips_little, measured_or_set, short_call
from .layout import accumulation_dtype, block_extents, empty_like_heads_last, heads_last, new_logsumexp
from ..window import UNBOUNDED, band_mask, key_span, rows_with_keys, window_mask

# aten's CPU flash kernel cuts each (batch, head) entry's query rows into blocks of 32 rows
# when the call has fewer than 192 rows, of 64 below 768, and of 256 from 768 up, and its
# backward costs about the same per block whatever the block's height (it re-reads the
# block's keys and gradients for each one): per score, 32-row blocks cost about 1.4 times
# and 64-row blocks 1.05 times what 256-row blocks cost (fwd+bwd, fp32, head_dim 64, one
# thread; benchmarks/RESULTS.md). Each row of a chunk also scores chunk - 1 keys outside its
# window. ``rows_per_chunk`` weighs both.
KERNEL_QUERY_BLOCKS = ((768, 1.0), (192, 1.05), (0, 1.4))  # (rows per entry from, cost per score)
# Rows whose window is cut by the ends of the sequence are computed in at most this many
# runs of one chunk each (more rows per chunk there: fewer calls, a few more masked scores).
EDGE_RUNS = 2
# Elements a call may allocate (masks, per-chunk gradients): as many as the op's inputs of
# one batch row hold, and at least MIN_CALL_BUDGET.
MIN_CALL_BUDGET = 1 << 23


@dataclass(frozen=True)
class ChunkTuning:
    """Overrides of the kernel's own choices, passed to every call (the kernel policy holds the
    one the op uses): ``query_chunk`` rows per chunk, ``call_budget`` elements per call,
    ``short_keys`` (for every dtype, in place of ``SHORT_KEYS``). Tests shrink them to cross
    many chunk edges and split runs into several calls."""

    query_chunk: int | None = None
    call_budget: int | None = None
    short_keys: int | None = None


# Calls with at most this many keys keep SDPA on the CPU (``kernel.short_call``), by the dtype
# the call computes in. Measured with ``bench_op.py --sweep`` (compiled, the length dynamic,
# head_dim 64 and 256, batch 1 and 4, plain, padded and packed, w = 128, 512, 1024;
# benchmarks/RESULTS.md). fp32: up to 512 keys some cells came out at 0.73-1.0x of SDPA, from
# 768 keys every cell at 1.06x or more (two runs). bf16: at 768 keys head_dim 64 still lost (0.83-0.93x
# with w = 512 and 1024), at 1024 keys it tied (0.99-1.06x), from 1536 keys every cell measured
# won (1.13x or more). fp16 is taken to be bf16's (not measured); other dtypes fp32's.
SHORT_KEYS = {torch.float32: 512, torch.bfloat16: 1024, torch.float16: 1024}


def short_keys(dtype: torch.dtype, tuning: ChunkTuning) -> int:
    """The most keys a call keeps SDPA with, in this dtype."""
    if tuning.short_keys is not None:
        return tuning.short_keys
    return measured_or_set(SHORT_KEYS.get(dtype, SHORT_KEYS[torch.float32]))


@functools.lru_cache(maxsize=256)
def rows_per_chunk(left: int, right: int, group: int = 1, tuning: ChunkTuning = ChunkTuning()) -> int:
    """Query rows per chunk for a window, with ``group`` query heads per KV head."""
    if tuning.query_chunk is not None:
        return tuning.query_chunk
    if UNBOUNDED in (left, right):
        return math.ceil(768 / group)
    span = left + right + 1

    def cost(rows: int) -> float:
        per_score = next(cost for start, cost in KERNEL_QUERY_BLOCKS if rows * group >= start)
        return per_score * (span + rows - 1)

    # The smallest chunk that reaches each block height; 64 rows per entry at least, below
    # which the kernel's fixed cost per entry dominates.
    candidates = [math.ceil(start / group) for start, _ in KERNEL_QUERY_BLOCKS if start] + [math.ceil(64 / group)]
    return min(candidates, key=lambda rows: (cost(rows), rows))


@dataclass(frozen=True)
class Run:
    """``count`` chunks of ``rows`` query rows each. Chunk ``c`` holds query rows
    ``[first_row + c * rows, first_row + (c + 1) * rows)`` and sees keys
    ``[first_key + c * rows, first_key + c * rows + keys)``: every chunk of a run sees the
    same band relative to its first row and first key. ``causal``: a single chunk whose
    row ``t`` is aligned with its key ``t``, computed with the kernel's own causal masking,
    which skips the key blocks past the diagonal."""

    first_row: int
    rows: int
    count: int
    first_key: int
    keys: int
    causal: bool = False

    def chunk(self, index: int) -> tuple[slice, slice]:
        """(query rows, keys) of chunk ``index``."""
        row, key = self.first_row + index * self.rows, self.first_key + index * self.rows
        return slice(row, row + self.rows), slice(key, key + self.keys)


def plan_runs(
    seq_q: int,
    seq_k: int,
    left: int,
    right: int,
    *,
    chunk_rows: int,
    group: int = 1,
    mask_budget: int = MIN_CALL_BUDGET,
) -> list[Run]:
    """Runs covering exactly the query rows that see at least one key, each row once.

    Rows whose window lies inside ``[0, seq_k)`` form one run of ``chunk_rows``-row chunks.
    With a causal window (``right == 0``) whose first row is aligned with key 0 (Sq >= Sk),
    that run ends at the last row, and every row before it (window cut by key 0, plus fewer
    than ``chunk_rows`` more) is one ``causal`` run. Otherwise the rows before the inner run
    (window cut by key 0) and after it (cut by the last key, or too few for a chunk) are split
    into at most ``EDGE_RUNS`` runs of one chunk each on each side. Masks stay within
    ``mask_budget`` elements ((rows * group, keys) a chunk) where the window allows."""
    key_offset = seq_k - seq_q
    first_row, stop_row = rows_with_keys(seq_q, seq_k, right)
    runs: list[Run] = []
    if first_row >= stop_row:
        return runs

    def edge(start: int, stop: int) -> None:
        remaining = stop - start
        if remaining <= 0:
            return
        rows = max(chunk_rows, math.ceil(remaining / EDGE_RUNS))
        while rows > chunk_rows and rows * group * _span_bound(rows, seq_k, left, right) > mask_budget:
            rows = max(chunk_rows, rows // 2)
        for row in range(start, stop, rows):
            last = min(stop, row + rows) - 1
            key_start, key_stop = key_span(row, last, seq_k, left, right, key_offset)
            runs.append(Run(row, last + 1 - row, 1, key_start, key_stop - key_start))

    def inner(start: int, count: int) -> None:
        runs.append(Run(start, chunk_rows, count, start + key_offset - left, chunk_rows + left + right))

    # Rows whose window is not cut by either end: [left - key_offset, seq_q - right).
    inner_start = min(stop_row, max(first_row, left - key_offset))
    bounded = UNBOUNDED not in (left, right)
    count = max(0, (stop_row - right - inner_start) // chunk_rows) if bounded else 0
    if right == 0 and first_row + key_offset == 0:
        head_stop = stop_row - count * chunk_rows
        head = head_stop - first_row
        # The head's mask bounds the left side of rows past the window; none below it.
        if head <= left + 1 or left == UNBOUNDED or head * head <= mask_budget:
            if head:
                runs.append(Run(first_row, head, 1, 0, head, causal=True))
            if count:
                inner(head_stop, count)
            return runs
    if count == 0:
        edge(first_row, stop_row)
        return runs
    edge(first_row, inner_start)
    inner(inner_start, count)
    edge(inner_start + count * chunk_rows, stop_row)
    return runs


def _span_bound(rows: int, seq_k: int, left: int, right: int) -> int:
    if UNBOUNDED in (left, right):
        return seq_k
    return min(seq_k, rows + left + right)


def run_band(run: Run, left: int, right: int, key_offset: int, device: torch.device) -> torch.Tensor | None:
    """Boolean (rows, keys) band of the run's chunks, relative to each chunk's first row and
    key; None when every row sees every key of its span (for a causal run: every key up to
    its diagonal, which the kernel masks itself)."""
    last_row = run.first_row + run.rows - 1
    stop = run.first_key + run.keys
    # Spans grow monotonically with the row: the last row bounds the left edge, the first
    # row the right edge.
    left_edge_open = key_span(last_row, last_row, stop, left, right, key_offset)[0] <= run.first_key
    right_edge_open = run.causal or key_span(run.first_row, run.first_row, stop, left, right, key_offset)[1] >= stop
    if left_edge_open and right_edge_open:
        return None
    return band_mask(
        torch.arange(run.first_row, run.first_row + run.rows, device=device),
        torch.arange(run.first_key, run.first_key + run.keys, device=device),
        left,
        right,
        key_offset,
    )


class ChunkBackend(NamedTuple):
    # (q, k, v, mask, scale, causal=False) -> (out, logsumexp); causal: row t sees keys <= t
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (grad_out, q, k, v, out, logsumexp, mask, scale, causal=False) -> (dq, dk, dv)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # Whether a call holds all scores of its chunks in memory at once (matmul/softmax).
    holds_scores: bool


def _fused_cpu_forward(q, k, v, mask, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _fused_cpu_backward(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, logsumexp, 0.0, causal, attn_mask=mask, scale=scale
    )


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, ...) -> (B, Hkv, Hq // Hkv, S, ...): query heads sharing one KV head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _math_probabilities(q, k, mask, scale, logsumexp=None, causal=False):
    """Scores in the accumulation dtype, grouped per KV head; returns (probs, logsumexp, q, k)."""
    acc = accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg = _grouped(q, kv_heads).to(acc)
    kg = k.unsqueeze(2).to(acc)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if mask is not None:
        # A per-batch (B, 1, rows, keys) mask lines up with the grouped (B, Hkv, g, rows, keys).
        scores = scores + (mask.unsqueeze(1) if mask.dim() == 4 else mask).to(acc)
    if causal:
        after_diagonal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(after_diagonal, float("-inf"))
    if logsumexp is None:
        logsumexp = torch.logsumexp(scores, dim=-1)
    else:
        logsumexp = _grouped(logsumexp, kv_heads)
    return torch.exp(scores - logsumexp.unsqueeze(-1)), logsumexp, qg, kg


def _math_forward(q, k, v, mask, scale, causal=False):
    probs, logsumexp, _, _ = _math_probabilities(q, k, mask, scale, causal=causal)
    out = torch.matmul(probs, v.unsqueeze(2).to(probs.dtype))
    return out.flatten(1, 2).to(q.dtype), logsumexp.flatten(1, 2)


def _math_backward(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False):
    probs, _, qg, kg = _math_probabilities(q, k, mask, scale, logsumexp, causal)
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


FUSED_CPU = ChunkBackend(_fused_cpu_forward, _fused_cpu_backward, holds_scores=False)
MATH = ChunkBackend(_math_forward, _math_backward, holds_scores=True)


def backend_for(device: torch.device) -> ChunkBackend:
    return FUSED_CPU if device.type == "cpu" else MATH


# -- layouts -------------------------------------------------------------------------------


def _rows_per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, ...) -> (B, Hkv, S * g, ...), row ``s * g + m`` holding query head
    ``h * g + m`` at position ``s``; x itself when g = 1. A copy, stored (B, S * g, Hkv, ...)
    like the op's heads-last tensors: a run's consecutive chunks are then contiguous in the
    (chunks, rows, heads, ...) order aten's CPU kernel works in, which saves its backward a
    copy of the gradient."""
    batch, heads, seq = x.shape[:3]
    group = heads // kv_heads
    if group == 1:
        return x
    per_position = x.unflatten(1, (kv_heads, group)).movedim(3, 1)  # (B, S, Hkv, g, ...)
    stacked = per_position.transpose(2, 3).reshape(batch, seq * group, kv_heads, *x.shape[3:])
    return stacked.transpose(1, 2)


def _windows(x_b: torch.Tensor, first: int, count: int, length: int, step: int) -> torch.Tensor:
    """(H, S, ...) -> (count, H, length, ...): window ``c`` is positions
    ``[first + c * step, first + c * step + length)``. A view; windows overlap when
    ``step < length``."""
    region = x_b.narrow(1, first, (count - 1) * step + length)
    return region.unfold(1, length, step).movedim(-1, 2).transpose(0, 1)


# -- masks ---------------------------------------------------------------------------------


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class BatchMasks(NamedTuple):
    """Per-batch conditions on top of the band: key_padding (B, Sk) bool, segment_ids (B, S),
    and block_ids (B, S): a row whose id is >= 0 also sees the later keys of its id (image
    blocks, ``_BlockCall``)."""

    key_padding: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None

    def any(self) -> bool:
        return self.key_padding is not None or self.segment_ids is not None


# -- calls ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChunkBatch:
    """Chunks ``first, first + stride, ..., first + (count - 1) * stride`` of ``run``, in one
    backend call: chunk ``c`` of the call is the batch entry ``c``."""

    run: Run
    first: int
    count: int
    stride: int

    @property
    def first_row(self) -> int:
        return self.run.first_row + self.first * self.run.rows

    @property
    def first_key(self) -> int:
        return self.run.first_key + self.first * self.run.rows

    @property
    def step(self) -> int:
        """Rows (and keys) from one of the call's chunks to the next."""
        return self.stride * self.run.rows

    def rows_of(self, x_b: torch.Tensor, group: int) -> torch.Tensor:
        """(count, Hkv, rows * g, ...) view of a (Hkv, S * g, ...) tensor of stacked rows."""
        return _windows(x_b, self.first_row * group, self.count, self.run.rows * group, self.step * group)

    def keys_of(self, x_b: torch.Tensor) -> torch.Tensor:
        """(count, H, keys, ...) view of a (H, Sk, ...) tensor; spans overlap when stride is 1."""
        return _windows(x_b, self.first_key, self.count, self.run.keys, self.step)

    def write_rows(self, x_b: torch.Tensor, result: torch.Tensor, kv_heads: int) -> None:
        """Writes a (count, Hkv, rows * g, ...) result into its rows of a (Hq, S, ...) tensor."""
        rows = self.run.rows
        target = _windows(x_b, self.first_row, self.count, rows, self.step)  # (count, Hq, rows, ...)
        target = target.unflatten(1, (kv_heads, x_b.shape[0] // kv_heads))  # (count, Hkv, g, rows, ...)
        target.copy_(result.unflatten(2, (rows, target.shape[2])).transpose(2, 3))

    def add_keys(self, acc_b: torch.Tensor, result: torch.Tensor) -> None:
        """Adds a (count, Hkv, keys, ...) result into its keys of a (Hkv, Sk, ...) tensor. The
        chunks' spans overlap when step < keys: add in slices of ``step`` keys, each slice of
        every chunk a disjoint span."""
        keys = self.run.keys
        step = self.step if self.count > 1 else keys
        for offset in range(0, keys, step):
            width = min(step, keys - offset)
            target = _windows(acc_b, self.first_key + offset, self.count, width, self.step)
            target += result[:, :, offset : offset + width]


def _chunk_batches(run: Run, per_chunk: int, budget: int, *, interleave: bool) -> list[_ChunkBatch]:
    """The run's chunks in as few calls as keep each within ``budget`` elements (``per_chunk``
    a chunk). With ``interleave``, a run too large for one call is split by interleaving:
    call ``p`` of ``s`` takes chunks ``p, p + s, p + 2s, ...``. Its chunks' key spans then
    overlap ``s`` times less, and adding its key/value gradients takes
    ``ceil(keys / (s * rows))`` ops, one once the spans are disjoint."""
    per_call = max(1, budget // max(1, per_chunk))
    stride = 1
    if interleave:  # no fewer ops past disjoint spans
        stride = min(math.ceil(run.count / per_call), math.ceil(run.keys / run.rows))
    calls = []
    for phase in range(min(stride, run.count)):
        chunks = len(range(phase, run.count, stride))
        for start in range(0, chunks, per_call):
            calls.append(_ChunkBatch(run, phase + start * stride, min(per_call, chunks - start), stride))
    return calls


@dataclass(frozen=True)
class _ChunkPlan:
    runs: tuple[Run, ...]
    bands: tuple[torch.Tensor | None, ...]  # (rows, keys) bool, per run
    masks: tuple[torch.Tensor | None, ...]  # the band as an additive mask, rows stacked per KV head
    group: int
    kv_heads: int
    budget: int

    @property
    def first_row(self) -> int:
        """Rows before it see no key."""
        return self.runs[0].first_row if self.runs else 0

    def stacking(self, run: Run) -> int:
        """Query heads stacked as rows per KV head in the run's calls: g, or 1 for the causal
        run, whose kernel rows must be positions."""
        return 1 if run.causal else self.group

    def batches(self, query, backend: ChunkBackend, batch_masks: BatchMasks, *, backward: bool):
        """Every backend call of the plan, in order: (run, stacking, batch row, chunk batch,
        (mask, rows without keys)). The backward interleaves a run's chunks over its calls."""
        for index, run in enumerate(self.runs):
            per_chunk = self._elements_per_chunk(run, query, backend, batch_masks, backward=backward)
            for b in range(query.shape[0]):
                for call in _chunk_batches(run, per_chunk, self.budget, interleave=backward):
                    yield run, self.stacking(run), b, call, self.mask(index, call, batch_masks, b, query.dtype)

    def _elements_per_chunk(self, run: Run, query, backend: ChunkBackend, batch_masks: BatchMasks, *, backward: bool) -> int:
        """Elements one chunk of ``run`` allocates in a call: its outputs (out; or dq, dk and
        dv), its batch mask, and the scores where the backend holds them."""
        stacking = self.stacking(run)
        heads, rows, head_dim = query.shape[1] // stacking, run.rows * stacking, query.shape[3]
        elements = heads * rows * head_dim + (self.kv_heads * 2 * run.keys * head_dim if backward else 0)
        if batch_masks.any():
            elements += rows * run.keys
        if backend.holds_scores:
            elements += (4 if backward else 3) * heads * rows * run.keys
        return elements

    def mask(self, index: int, call: _ChunkBatch, batch_masks: BatchMasks, b: int, dtype: torch.dtype):
        """(additive mask, (count, rows) rows left without a key or None) of a call of run
        ``index``: the run's band shared by its chunks, or with batch masks a
        (count, 1, rows * g, keys) mask: band, key_padding[b, key] and
        segment_ids[b, row] == segment_ids[b, key]."""
        if not batch_masks.any():
            return self.masks[index], None
        run = call.run
        conditions = [] if self.bands[index] is None else [self.bands[index]]
        if batch_masks.key_padding is not None:
            conditions.append(call.keys_of(batch_masks.key_padding[b, None])[:, 0, None, :])
        if batch_masks.segment_ids is not None:
            segments = batch_masks.segment_ids[b, None]
            key_segments = call.keys_of(segments)[:, 0]
            row_segments = call.rows_of(segments, 1)[:, 0]
            conditions.append(row_segments[:, :, None] == key_segments[:, None, :])
        visible = functools.reduce(torch.logical_and, conditions).expand(call.count, run.rows, run.keys)
        if run.causal:  # a key past the diagonal is no key for the row
            visible = visible & torch.ones(run.rows, run.keys, dtype=torch.bool, device=visible.device).tril()
        stacked = visible.repeat_interleave(self.stacking(run), 1)[:, None]
        return _additive(stacked, dtype), ~visible.any(dim=-1)


# -- image blocks ----------------------------------------------------------------------------
#
# With block ids, a row whose id is >= 0 sees, besides its window, every later key of its id
# that its window's left side allows:
#     kv - q >= -left  AND  (kv - q <= right  OR  ids[b, kv] == ids[b, q])  AND  key_padding[b, kv]
# (transformers' sliding mask with bidirectional image blocks). Such rows are computed apart:
# one call per (batch row, id) over the rows from the id's first to its last position and the
# keys they can see. The band pass's results for them are replaced in the forward and given
# no weight in the backward (lse +inf). Ids need not be contiguous: a row of another id
# between two positions of an id is computed in that id's call and dropped.


class _BlockCall(NamedTuple):
    batch: int
    chunk: _ChunkBatch  # rows of the id's range, and the keys they see
    anchor: int  # the id's first position


def _block_calls(block_ids: torch.Tensor, left: int, right: int, seq_k: int, group: int, budget: int) -> list[_BlockCall]:
    """Calls covering, per (batch row, id >= 0), the rows from the id's first to its last
    position; a range whose (rows * group, keys) mask would pass ``budget`` elements is cut
    into several calls of fewer rows. One host sync."""
    row, first, last, _ = block_extents(block_ids)
    calls = []
    for batch, first, last in torch.stack([row, first, last], dim=1).tolist():
        key_stop = key_span(first, last, seq_k, left, right, 0)[1]  # every row may see the id's last key
        rows = max(1, budget // max(1, group * (key_stop - key_span(first, first, seq_k, left, right, 0)[0])))
        for start in range(first, last + 1, rows):
            key_start = key_span(start, start, seq_k, left, right, 0)[0]
            run = Run(start, min(rows, last + 1 - start), 1, key_start, key_stop - key_start)
            calls.append(_BlockCall(batch, _ChunkBatch(run, 0, 1, 1), first))
    return calls


def _block_mask(call: _BlockCall, batch_masks: BatchMasks, left: int, right: int):
    """((rows, keys) visible, (rows,) rows of the call's id) of a block call."""
    run = call.chunk.run
    ids = batch_masks.block_ids[call.batch]
    rows = torch.arange(run.first_row, run.first_row + run.rows, device=ids.device)
    keys = torch.arange(run.first_key, run.first_key + run.keys, device=ids.device)
    block = ids[call.anchor]
    beyond_right = band_mask(rows, keys, UNBOUNDED, right, 0) | (ids[keys] == block)[None, :]
    visible = band_mask(rows, keys, left, UNBOUNDED, 0) & beyond_right
    if batch_masks.key_padding is not None:
        visible &= batch_masks.key_padding[call.batch, keys][None, :]
    return visible, ids[rows] == block


def _keep_rows(x_b: torch.Tensor, run: Run, keep: torch.Tensor, write) -> None:
    """``write()`` writes the run's rows of the (H, S, ...) tensor ``x_b``; rows where ``keep``
    is True get their old values back."""
    rows = x_b[:, run.first_row : run.first_row + run.rows]
    kept = rows.clone()
    write()
    shape = (1, run.rows) + (1,) * (rows.dim() - 2)
    rows.copy_(torch.where(keep.view(shape), kept, rows))


def _forward_blocks(query, key, value, out, logsumexp, left, right, scale, batch_masks, backend, plan, stacked):
    """Replaces the rows of image blocks in ``out`` and ``logsumexp`` (see above)."""
    for call in _block_calls(batch_masks.block_ids, left, right, key.shape[2], plan.group, plan.budget):
        b, chunk, run = call.batch, call.chunk, call.chunk.run
        visible, member = _block_mask(call, batch_masks, left, right)
        mask = _additive(visible.repeat_interleave(plan.group, 0), query.dtype)[None, None]
        chunk_out, chunk_lse = backend.forward(
            chunk.rows_of(stacked[b], plan.group), chunk.keys_of(key[b]), chunk.keys_of(value[b]), mask, scale
        )
        without_keys = ~visible.any(dim=-1)
        chunk_out = chunk_out.masked_fill(without_keys.repeat_interleave(plan.group)[:, None], 0)
        chunk_lse = chunk_lse.masked_fill(without_keys.repeat_interleave(plan.group), float("inf"))
        _keep_rows(out[b], run, ~member, lambda: chunk.write_rows(out[b], chunk_out, plan.kv_heads))
        _keep_rows(logsumexp[b], run, ~member, lambda: chunk.write_rows(logsumexp[b], chunk_lse, plan.kv_heads))


def _backward_blocks(inputs, key, value, grad_q, grad_k, grad_v, left, right, scale, batch_masks, backend, plan):
    """Adds the gradients of the rows of image blocks (the band pass gave them none)."""
    for call in _block_calls(batch_masks.block_ids, left, right, key.shape[2], plan.group, plan.budget):
        b, chunk, run = call.batch, call.chunk, call.chunk.run
        visible, member = _block_mask(call, batch_masks, left, right)
        mask = _additive(visible.repeat_interleave(plan.group, 0), grad_q.dtype)[None, None]
        grad_out_b, query_b, out_b, lse_b = (chunk.rows_of(x[b], plan.group) for x in inputs)
        # Rows of other ids in the call's range: lse +inf, so they add nothing.
        lse_b = lse_b[..., 0].masked_fill(~member.repeat_interleave(plan.group), float("inf"))
        chunk_dq, chunk_dk, chunk_dv = backend.backward(
            grad_out_b, query_b, chunk.keys_of(key[b]), chunk.keys_of(value[b]), out_b, lse_b, mask, scale
        )
        _keep_rows(grad_q[b], run, ~member, lambda: chunk.write_rows(grad_q[b], chunk_dq, plan.kv_heads))
        chunk.add_keys(grad_k[b], chunk_dk)
        chunk.add_keys(grad_v[b], chunk_dv)


@functools.lru_cache(maxsize=64)
def _cached_runs(seq_q, seq_k, left, right, group, chunk_rows, budget) -> tuple[Run, ...]:
    """Every layer of a model and both directions ask for the same runs: plain numbers, cached."""
    return tuple(plan_runs(seq_q, seq_k, left, right, chunk_rows=chunk_rows, group=group, mask_budget=budget))


def _plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, left: int, right: int, tuning: ChunkTuning) -> _ChunkPlan:
    """Runs, masks and the call budget (the size of the inputs of one batch row). The masks
    are made for each call (a few (rows, keys) bands), so no tensor outlives it."""
    kv_heads = key.shape[1]
    group = query.shape[1] // kv_heads
    budget = _budget(query, key, value, tuning)
    chunk_rows = rows_per_chunk(left, right, group, tuning)
    seq_q, seq_k = query.shape[2], key.shape[2]
    runs = _cached_runs(seq_q, seq_k, left, right, group, chunk_rows, budget)
    bands = tuple(run_band(run, left, right, seq_k - seq_q, query.device) for run in runs)
    masks = tuple(
        None if band is None else _additive(band.repeat_interleave(1 if run.causal else group, 0), query.dtype)
        for run, band in zip(runs, bands)
    )
    return _ChunkPlan(runs, bands, masks, group, kv_heads, budget)



# -- one call over all keys -------------------------------------------------------------------
#
# A call whose keys all lie in every row's window (S <= w with the causal band), or whose band
# skips too few keys for chunks to pay (Sk <= span + rows per chunk), runs as one fused call
# over all its keys for the whole batch, as SDPA itself runs it: with the kernel's own causal
# masking where the band is exactly causal, else with the band and batch masks as one additive
# mask. No chunk bookkeeping, no per-row loop, no cross-chunk sums.


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
    if backend_for(query.device) is not FUSED_CPU:
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
    if UNBOUNDED not in (call.left, call.right) and seq_k > most_whole_keys(call.left, call.right, group, causal, tuning):
        return None
    per_batch = masks.any() or masks.block_ids is not None
    if (batch if per_batch else 1) * seq_q * seq_k > _budget(query, key, call.value, tuning):
        return None
    if masks.block_ids is None and (masks.key_padding is None or masks.segment_ids is None):
        band = _band_additive(seq_q, seq_k, call.left, call.right, query.dtype, query.device) if band_needed else None
        if masks.segment_ids is not None:  # Sq == Sk: every row sees its own key
            ids = masks.segment_ids
            outside = band if band is not None else torch.zeros((), dtype=query.dtype, device=query.device)
            return WholeCall(causal, torch.where((ids[:, :, None] != ids[:, None, :])[:, None], float("-inf"), outside), None)
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
    mask = _additive(visible.expand(batch, seq_q, seq_k)[:, None], query.dtype)
    # A row sees its own key (its segment's, its image's) unless padding hides it or it lies
    # before the first key its window reaches.
    if masks.key_padding is None and rows_with_keys(seq_q, seq_k, call.right)[0] == 0:
        return WholeCall(causal, mask, None)
    keyless = (~visible.any(dim=-1)).expand(batch, seq_q)
    return WholeCall(causal, mask, lambda: keyless)


# Bands of at most this many scores are kept for the next call of the same lengths and window
# (every layer of a step, forward and backward): 4 MiB each in fp32.
CACHED_BAND_SCORES = 1 << 20


def _band_additive(seq_q: int, seq_k: int, left: int, right: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The window's (Sq, Sk) additive mask. Read-only: the calls that share it only read it."""
    if seq_q * seq_k > CACHED_BAND_SCORES:
        return _additive(window_mask(seq_q, seq_k, left, right, device), dtype)
    return _cached_band_additive(seq_q, seq_k, left, right, dtype, device)


@functools.lru_cache(maxsize=4)
def _cached_band_additive(seq_q, seq_k, left, right, dtype, device) -> torch.Tensor:
    return _additive(window_mask(seq_q, seq_k, left, right, device), dtype)


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
def _window_ranges(seq_q: int, seq_k: int, left: int, right: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


def _budget(query, key, value, tuning: ChunkTuning) -> int:
    """Elements a call may allocate: those of one batch row's inputs, at least MIN_CALL_BUDGET."""
    return tuning.call_budget or max(MIN_CALL_BUDGET, (query.numel() + key.numel() + value.numel()) // max(1, query.shape[0]))


def whole_forward(query: Tensor, key: Tensor, value: Tensor, scale: float, whole: WholeCall) -> tuple[Tensor, Tensor]:
    out, lse = _fused_cpu_forward(query, key, value, whole.mask, scale, whole.causal)
    logsumexp = new_logsumexp(query).copy_(lse)
    # Rows without keys: the kernel returns zeros for them (``tests/test_whole_calls.py`` holds
    # it to that), and lse +inf is set here as FA2 returns it, so they pass no gradient.
    if whole.rows_without_keys is not None:
        logsumexp.masked_fill_(whole.rows_without_keys()[:, None, :], float("inf"))
    return heads_last(out), logsumexp


def whole_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, scale: float, whole: WholeCall
) -> tuple[Tensor, Tensor, Tensor]:
    grads = _fused_cpu_backward(grad_out, query, key, value, out, logsumexp, whole.mask, scale, whole.causal)
    return tuple(heads_last(grad) for grad in grads)


# -- the kernel ----------------------------------------------------------------------------


Tensor = torch.Tensor


def chunked_forward(
    query: Tensor, key: Tensor, value: Tensor, left: int, right: int, scale: float,
    batch_masks: BatchMasks = BatchMasks(), *, backend: ChunkBackend | None = None, tuning: ChunkTuning = ChunkTuning(),
) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) of the window (left, right) and the batch masks, heads-last."""
    backend = backend or backend_for(query.device)
    plan = _plan(query, key, value, left, right, tuning)
    out = empty_like_heads_last(query)
    logsumexp = new_logsumexp(query)
    # Rows that see no key: zeros, and +inf as FA2 returns, so exp(score - lse) is 0.
    out[:, :, : plan.first_row] = 0
    logsumexp[:, :, : plan.first_row] = float("inf")
    without_keys = query.new_zeros(query.shape[0], query.shape[2], dtype=torch.bool) if batch_masks.any() else None
    # Queries stacked per KV head, and as they are (the causal run): (B, heads, rows, D).
    queries = {1: query}
    if plan.group > 1 and any(not run.causal for run in plan.runs):  # a copy: only when a run reads it
        queries[plan.group] = _rows_per_kv_head(query, plan.kv_heads)
    for run, stacking, b, call, (mask, rows_without_keys) in plan.batches(query, backend, batch_masks, backward=False):
        heads = query.shape[1] // stacking
        chunk_out, chunk_lse = backend.forward(
            call.rows_of(queries[stacking][b], stacking),
            call.keys_of(key[b]),
            call.keys_of(value[b]),
            mask,
            scale,
            run.causal,
        )
        call.write_rows(out[b], chunk_out, heads)
        call.write_rows(logsumexp[b], chunk_lse, heads)
        if rows_without_keys is not None:
            call.rows_of(without_keys[b, None], 1)[:, 0] = rows_without_keys
    if without_keys is not None:
        # A row that sees no key (all its keys padded, or in other segments) returns zeros as
        # SDPA does, with lse +inf so that it passes no gradient. A padded query row that sees
        # keys is computed over them, as SDPA computes it.
        out.masked_fill_(without_keys[:, None, :, None], 0)
        logsumexp.masked_fill_(without_keys[:, None, :], float("inf"))
    if batch_masks.block_ids is not None:
        stacked = queries.get(plan.group)
        stacked = _rows_per_kv_head(query, plan.kv_heads) if stacked is None else stacked
        _forward_blocks(query, key, value, out, logsumexp, left, right, scale, batch_masks, backend, plan, stacked)
    return out, logsumexp


def chunked_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor, left: int, right: int,
    scale: float, batch_masks: BatchMasks = BatchMasks(), *, backend: ChunkBackend | None = None,
    tuning: ChunkTuning = ChunkTuning(),
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's out and logsumexp, heads-last."""
    backend = backend or backend_for(query.device)
    plan = _plan(query, key, value, left, right, tuning)
    acc = accumulation_dtype(query.dtype)
    grad_q = empty_like_heads_last(query)
    grad_q[:, :, : plan.first_row] = 0
    # Key spans of neighbouring chunks overlap: sum their contributions at accumulation
    # precision, round once at the end.
    grad_k = empty_like_heads_last(key, acc).zero_()
    grad_v = empty_like_heads_last(value, acc).zero_()
    # Rows without keys carry lse = +inf: their probabilities, hence
    # gradients, are 0. (grad_out, query, out, logsumexp), stacked per KV head and as they are.
    # So do rows of image blocks in the band pass: their gradients come from their own calls.
    band_lse = logsumexp
    if batch_masks.block_ids is not None:
        band_lse = logsumexp.masked_fill((batch_masks.block_ids >= 0)[:, None, :], float("inf"))
    inputs = {1: (grad_out, query, out, band_lse.unsqueeze(-1))}
    if plan.group > 1 and any(not run.causal for run in plan.runs):
        inputs[plan.group] = tuple(_rows_per_kv_head(x, plan.kv_heads) for x in inputs[1])
    for run, stacking, b, call, (mask, _) in plan.batches(query, backend, batch_masks, backward=True):
        heads = query.shape[1] // stacking
        grad_out_b, query_b, out_b, lse_b = (call.rows_of(x[b], stacking) for x in inputs[stacking])
        chunk_dq, chunk_dk, chunk_dv = backend.backward(
            grad_out_b,
            query_b,
            call.keys_of(key[b]),
            call.keys_of(value[b]),
            out_b,
            lse_b[..., 0],
            mask,
            scale,
            run.causal,
        )
        call.write_rows(grad_q[b], chunk_dq, heads)
        call.add_keys(grad_k[b], chunk_dk)
        call.add_keys(grad_v[b], chunk_dv)
    if batch_masks.block_ids is not None:
        # The band pass's stacked grad_out, query and out where it made them; the true logsumexp.
        stacked = inputs.get(plan.group) or tuple(_rows_per_kv_head(x, plan.kv_heads) for x in inputs[1][:3])
        block_inputs = (*stacked[:3], _rows_per_kv_head(logsumexp.unsqueeze(-1), plan.kv_heads))
        _backward_blocks(block_inputs, key, value, grad_q, grad_k, grad_v, left, right, scale, batch_masks, backend, plan)
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)


@dataclass(frozen=True)
class ChunkedKernel:
    """The chunked kernel as the policy lists it: exact for every window, device, dtype and
    batch mask, so it takes every call no kernel before it takes. As fast as SDPA where its
    chunks run aten's fused CPU kernel (per score the kernel SDPA runs, on S * (w + chunk)
    scores instead of S * S); elsewhere an unfused matmul/softmax that is slower."""

    tuning: ChunkTuning = ChunkTuning()  # passed to every chunked call
    name = "chunked"

    def describe(self, facts) -> str:
        if backend_for(facts.device) is FUSED_CPU:  # the crossover is ``whole_call``'s
            return "chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys"
        return "chunked, matmul/softmax per chunk"

    def cannot(self, facts) -> str | None:
        return None

    def slower(self, facts) -> str | None:
        if backend_for(facts.device) is FUSED_CPU:
            return band_skips_little(facts) or short_call(facts, short_keys(facts.dtype, self.tuning))
        return f"on {facts.device.type} the chunked kernel runs an unfused matmul/softmax, slower than SDPA"

    def plan(self, call):
        return whole_call(call, self.tuning) or ()

    def forward(self, call, plan):
        if isinstance(plan, WholeCall):
            return whole_forward(call.query, call.key, call.value, call.scale, plan)
        masks = BatchMasks(call.key_padding, call.segment_ids, call.block_ids)
        return chunked_forward(call.query, call.key, call.value, call.left, call.right, call.scale, masks, tuning=self.tuning)

    def backward(self, call, plan, grad_out, out, logsumexp):
        if isinstance(plan, WholeCall):
            return whole_backward(grad_out, call.query, call.key, call.value, out, logsumexp, call.scale, plan)
        masks = BatchMasks(call.key_padding, call.segment_ids, call.block_ids)
        return chunked_backward(
            grad_out, call.query, call.key, call.value, out, logsumexp, call.left, call.right, call.scale, masks,
            tuning=self.tuning,
        )
