"""The chunked kernel's plan (``chunked.py``): which query rows go in which chunk, which keys
each chunk sees, and how the chunks are batched into calls of a chunk backend.

Query rows are cut into chunks. A chunk's key span covers every key any of its rows can see,
so each row's softmax is complete inside its chunk.

Chunks are grouped into *runs* (``plan_runs``), each computed by one call of the chunk
backend per batch row (a few, when its per-chunk results would not fit ``call_budget``).
Away from the ends of the sequence every chunk of ``r`` rows sees the same band relative to
its first row, and chunk ``c + 1``'s keys start ``r`` keys after chunk ``c``'s: those chunks
form one run, with the chunk index as the batch dimension, K/V read through overlapping
views (``Tensor.unfold``, no copy) and one ``(r, span + r - 1)`` mask for every chunk. With
a causal window the rows before it (whose window starts at key 0) are one more call, with
the kernel's own causal masking; other windows and decoding shapes take a few runs of one
chunk each at the ends.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ...window import UNBOUNDED, band_mask, key_span, rows_with_keys

if TYPE_CHECKING:
    from .backends import ChunkBackend

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


def call_budget(query, key, value, tuning: ChunkTuning) -> int:
    """Elements a call may allocate: those of one batch row's inputs, at least MIN_CALL_BUDGET."""
    return tuning.call_budget or max(
        MIN_CALL_BUDGET, (query.numel() + key.numel() + value.numel()) // max(1, query.shape[0])
    )


# -- masks ---------------------------------------------------------------------------------


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the chunk backends take it: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class BatchMasks(NamedTuple):
    """Per-batch conditions on top of the band: key_padding (B, Sk) bool, segment_ids (B, S),
    and block_ids (B, S): a row whose id is >= 0 also sees the later keys of its id (image
    blocks, computed apart: ``chunked.py``)."""

    key_padding: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None

    def any(self) -> bool:
        return self.key_padding is not None or self.segment_ids is not None


# -- calls ---------------------------------------------------------------------------------


def _windows(x_b: torch.Tensor, first: int, count: int, length: int, step: int) -> torch.Tensor:
    """(H, S, ...) -> (count, H, length, ...): window ``c`` is positions
    ``[first + c * step, first + c * step + length)``. A view; windows overlap when
    ``step < length``."""
    region = x_b.narrow(1, first, (count - 1) * step + length)
    return region.unfold(1, length, step).movedim(-1, 2).transpose(0, 1)


@dataclass(frozen=True)
class ChunkBatch:
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


def chunk_batches(run: Run, per_chunk: int, budget: int, *, interleave: bool) -> list[ChunkBatch]:
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
            calls.append(ChunkBatch(run, phase + start * stride, min(per_call, chunks - start), stride))
    return calls


@dataclass(frozen=True)
class ChunkPlan:
    """One call's runs, their bands and masks, and how its chunks are batched into calls of a
    chunk backend (``plan_chunks``)."""

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
                for call in chunk_batches(run, per_chunk, self.budget, interleave=backward):
                    yield run, self.stacking(run), b, call, self.mask(index, call, batch_masks, b, query.dtype)

    def _elements_per_chunk(
        self, run: Run, query, backend: ChunkBackend, batch_masks: BatchMasks, *, backward: bool
    ) -> int:
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

    def mask(self, index: int, call: ChunkBatch, batch_masks: BatchMasks, b: int, dtype: torch.dtype):
        """(additive mask, (count, rows) rows left without a key or None) of a call of run
        ``index``: the run's band shared by its chunks, or with batch masks a
        (count, 1, rows * g, keys) mask: band, key_padding[b, key] and
        segment_ids[b, row] == segment_ids[b, key]."""
        if not batch_masks.any():
            return self.masks[index], None
        run = call.run
        band = self.bands[index]
        conditions: list[torch.Tensor] = [] if band is None else [band]
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
        return additive_mask(stacked, dtype), ~visible.any(dim=-1)


@functools.lru_cache(maxsize=64)
def _cached_runs(seq_q, seq_k, left, right, group, chunk_rows, budget) -> tuple[Run, ...]:
    """Every layer of a model and both directions ask for the same runs: plain numbers, cached."""
    return tuple(plan_runs(seq_q, seq_k, left, right, chunk_rows=chunk_rows, group=group, mask_budget=budget))


def plan_chunks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, left: int, right: int, tuning: ChunkTuning
) -> ChunkPlan:
    """Runs, masks and the call budget (the size of the inputs of one batch row). The masks
    are made for each call (a few (rows, keys) bands), so no tensor outlives it."""
    kv_heads = key.shape[1]
    group = query.shape[1] // kv_heads
    budget = call_budget(query, key, value, tuning)
    chunk_rows = rows_per_chunk(left, right, group, tuning)
    seq_q, seq_k = query.shape[2], key.shape[2]
    runs = _cached_runs(seq_q, seq_k, left, right, group, chunk_rows, budget)
    bands = tuple(run_band(run, left, right, seq_k - seq_q, query.device) for run in runs)
    masks = tuple(
        None if band is None else additive_mask(band.repeat_interleave(1 if run.causal else group, 0), query.dtype)
        for run, band in zip(runs, bands, strict=True)
    )
    return ChunkPlan(runs, bands, masks, group, kv_heads, budget)
