"""Chunked band attention: O(S * (w + chunk)) compute and memory on any device.

Query rows are cut into chunks. A chunk's key span covers every key any of its rows can see,
so each row's softmax is complete inside its chunk: the forward writes final outputs and row
logsumexps, and the backward sums the key/value gradients of overlapping spans.

Which rows and keys each chunk takes, and how chunks are batched into calls, is the plan
(``plan.py``); each call runs on a chunk backend (``backends.py``: aten's fused
CPU kernel, or matmul/softmax elsewhere). A call whose band skips few keys runs as one call
over all keys instead (``whole_calls.py``). Here: the forward and backward over the plan's
calls, the rows of image blocks, and the kernel as the policy lists it (``ChunkedKernel``).

Query heads that share a key/value head (GQA) are stacked as rows of one kernel entry:
row ``s * g + m`` is query head ``h * g + m`` at position ``s``. The kernel then sees ``g``
times more rows per entry for the same span, which aten's CPU kernel computes in larger,
cheaper query blocks; the backward gets one key/value gradient per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from ...window import UNBOUNDED, band_mask, key_span
from ..contract import band_skips_little, measured_or_set, nothing_to_skip, short_call
from ..layout import accumulation_dtype, block_extents, empty_like_heads_last, new_logsumexp
from . import backends as chunk_backends
from .backends import FUSED_CPU, ChunkBackend
from .plan import BatchMasks, ChunkBatch, ChunkTuning, Run, additive_mask, plan_chunks
from .whole_calls import WholeCall, whole_backward, whole_call, whole_forward

Tensor = torch.Tensor


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


# Soft-capped calls with at most this many keys keep what computes them now: no SDPA takes a
# softcap, so the op is measured against the eager chain inductor compiles, which the rule
# leaves (``python benchmarks/bench_spelled.py --softcap 50 --clock cpu --threads 1 --dtype D
# --windows 128 512 2048 -1 --seqs 512 768 1024 2048 4096``: 8 heads of 64, fwd+bwd, CPU time
# of one thread, the machine loaded by others (load 5-10), 2026-11-28). fp32: from 512 keys
# every cell won (1.04-1.77x at 512, 1.34x and more at 768, 1.65-4.1x at 1024). bf16 (the
# chain's matmuls in bf16, the op's math in fp32): at 512 and 768 keys windows of 512 and more
# lost (0.67-0.84x), at 1024 they tied (1.01-1.14x), from 2048 every cell won (1.21x and more).
# fp16 is taken to be bf16's (not measured), other dtypes fp32's.
SOFTCAP_SHORT_KEYS = {torch.float32: 512, torch.bfloat16: 1024, torch.float16: 1024}


def softcap_slower(facts, tuning: ChunkTuning) -> str | None:
    """Why a soft-capped call may be slower on the chunked kernel than the chain of ops it
    replaces, on the CPU: a band that skips nothing (no side bounded but a causal one, which
    the kernel scores in blocks of rows, about half the square), or a call below the measured
    crossover. fp16 is taken to be bf16's (not measured), other dtypes fp32's."""
    if facts.left is not None and facts.right is not None:
        causal = facts.left == UNBOUNDED and facts.right == 0
        if UNBOUNDED in (facts.left, facts.right) and not causal:
            return (
                f"soft-capped scores under window ({facts.left}, {facts.right}): the band skips too little for the "
                "op's matmul/softmax per chunk to beat the chain (measured causal or bounded only)"
            )
    if tuning.short_keys is not None:
        most = tuning.short_keys
    else:
        most = measured_or_set(SOFTCAP_SHORT_KEYS.get(facts.dtype, SOFTCAP_SHORT_KEYS[torch.float32]))
    return band_skips_little(facts) or short_call(facts, most)


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
    chunk: ChunkBatch  # rows of the id's range, and the keys they see
    anchor: int  # the id's first position


def _block_calls(
    block_ids: torch.Tensor, left: int, right: int, seq_k: int, group: int, budget: int
) -> list[_BlockCall]:
    """Calls covering, per (batch row, id >= 0), the rows from the id's first to its last
    position; a range whose (rows * group, keys) mask would pass ``budget`` elements is cut
    into several calls of fewer rows. One host sync."""
    rows_of_ids, firsts, lasts, _ = block_extents(block_ids)
    calls = []
    for batch, first, last in torch.stack([rows_of_ids, firsts, lasts], dim=1).tolist():
        key_stop = key_span(first, last, seq_k, left, right, 0)[1]  # every row may see the id's last key
        rows = max(1, budget // max(1, group * (key_stop - key_span(first, first, seq_k, left, right, 0)[0])))
        for start in range(first, last + 1, rows):
            key_start = key_span(start, start, seq_k, left, right, 0)[0]
            run = Run(start, min(rows, last + 1 - start), 1, key_start, key_stop - key_start)
            calls.append(_BlockCall(batch, ChunkBatch(run, 0, 1, 1), first))
    return calls


def _block_mask(call: _BlockCall, batch_masks: BatchMasks, left: int, right: int):
    """((rows, keys) visible, (rows,) rows of the call's id) of a block call."""
    run = call.chunk.run
    if batch_masks.block_ids is None:
        raise ValueError("a block call without block_ids")
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
    is True get their old values back. ``write`` runs here, before this returns."""
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
        mask = additive_mask(visible.repeat_interleave(plan.group, 0), query.dtype)[None, None]
        chunk_out, chunk_lse = backend.forward(
            chunk.rows_of(stacked[b], plan.group), chunk.keys_of(key[b]), chunk.keys_of(value[b]), mask, scale
        )
        without_keys = ~visible.any(dim=-1)
        chunk_out = chunk_out.masked_fill(without_keys.repeat_interleave(plan.group)[:, None], 0)
        chunk_lse = chunk_lse.masked_fill(without_keys.repeat_interleave(plan.group), float("inf"))
        _keep_rows(out[b], run, ~member, partial(chunk.write_rows, out[b], chunk_out, plan.kv_heads))
        _keep_rows(logsumexp[b], run, ~member, partial(chunk.write_rows, logsumexp[b], chunk_lse, plan.kv_heads))


def _backward_blocks(inputs, key, value, grad_q, grad_k, grad_v, left, right, scale, batch_masks, backend, plan):
    """Adds the gradients of the rows of image blocks (the band pass gave them none)."""
    for call in _block_calls(batch_masks.block_ids, left, right, key.shape[2], plan.group, plan.budget):
        b, chunk, run = call.batch, call.chunk, call.chunk.run
        visible, member = _block_mask(call, batch_masks, left, right)
        mask = additive_mask(visible.repeat_interleave(plan.group, 0), grad_q.dtype)[None, None]
        grad_out_b, query_b, out_b, lse_b = (chunk.rows_of(x[b], plan.group) for x in inputs)
        # Rows of other ids in the call's range: lse +inf, so they add nothing.
        lse_b = lse_b[..., 0].masked_fill(~member.repeat_interleave(plan.group), float("inf"))
        chunk_dq, chunk_dk, chunk_dv = backend.backward(
            grad_out_b, query_b, chunk.keys_of(key[b]), chunk.keys_of(value[b]), out_b, lse_b, mask, scale
        )
        _keep_rows(grad_q[b], run, ~member, partial(chunk.write_rows, grad_q[b], chunk_dq, plan.kv_heads))
        chunk.add_keys(grad_k[b], chunk_dk)
        chunk.add_keys(grad_v[b], chunk_dv)


# -- the kernel ----------------------------------------------------------------------------


def chunked_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    left: int,
    right: int,
    scale: float,
    batch_masks: BatchMasks = BatchMasks(),
    *,
    backend: ChunkBackend | None = None,
    tuning: ChunkTuning = ChunkTuning(),
) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) of the window (left, right) and the batch masks, heads-last."""
    backend = backend or chunk_backends.backend_for(query.device)
    plan = plan_chunks(query, key, value, left, right, tuning)
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
            assert without_keys is not None  # both are made where batch_masks.any()
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
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    left: int,
    right: int,
    scale: float,
    batch_masks: BatchMasks = BatchMasks(),
    *,
    backend: ChunkBackend | None = None,
    tuning: ChunkTuning = ChunkTuning(),
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) from the forward's out and logsumexp, heads-last."""
    backend = backend or chunk_backends.backend_for(query.device)
    plan = plan_chunks(query, key, value, left, right, tuning)
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
    inputs: dict[int, tuple[Tensor, ...]] = {1: (grad_out, query, out, band_lse.unsqueeze(-1))}
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
        _backward_blocks(
            block_inputs, key, value, grad_q, grad_k, grad_v, left, right, scale, batch_masks, backend, plan
        )
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)


def _no_left_bound(facts) -> str | None:
    """Why the chunked kernel may be slower than SDPA on a call with no left bound. Such a call
    is one run over every key: with a causal window and Sq == Sk, the kernel's own causal
    masking over the triangle, where SDPA with the mask scores the square. Measured for the full
    layers of a model spelled out in ops, with sinks (``benchmarks/bench_model.py --model
    gpt-oss``), and for packed and padded rows (``benchmarks/bench_documents.py``'s chunked
    column against SDPA with the mask, two runs: fp32 0.91-1.13x at 512 keys, 1.19x or more from
    768; bf16 0.89-1.12x at 512, 0.95-1.29x at 768, 1.17x or more from 1024), within the
    crossovers of SHORT_KEYS. Where SDPA runs the call without its mask itself, nothing is left to
    skip (``never_faster``); other such calls are not measured."""
    if facts.blocks:
        return "image blocks with no left bound: not measured against SDPA"
    if facts.right != 0 or not facts.same_lengths:
        return f"with no left bound, only causal calls with Sq == Sk are measured, not window (-1, {facts.right})"
    return None


@dataclass(frozen=True)
class ChunkedKernel:
    """The chunked kernel as the policy lists it: exact for every window, device, dtype and
    batch mask, so it takes every call no kernel before it takes. As fast as SDPA where its
    chunks run aten's fused CPU kernel (per score the kernel SDPA runs, on S * (w + chunk)
    scores instead of S * S); elsewhere an unfused matmul/softmax that is slower."""

    tuning: ChunkTuning = ChunkTuning()  # passed to every chunked call
    name = "chunked"

    def describe(self, facts) -> str:
        if facts.softcap:
            return "chunked, soft-capped matmul/softmax per chunk"
        if chunk_backends.backend_for(facts.device) is FUSED_CPU:  # the crossover is ``whole_call``'s
            return "chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys"
        return "chunked, matmul/softmax per chunk"

    def cannot(self, facts) -> str | None:
        return None

    def never_faster(self, facts) -> str | None:
        """A call SDPA computes without its mask is one run over every key: on the CPU the fused
        kernel SDPA's is_causal runs itself, elsewhere an unfused one. Where the op replaces a
        chain of ops (``spelled``, soft-capped scores), not SDPA, this does not hold."""
        return nothing_to_skip(facts)

    def slower(self, facts) -> str | None:
        if facts.softcap:
            if facts.device.type != "cpu":
                return (
                    f"on {facts.device.type} soft-capped scores run an unfused matmul/softmax per chunk, not measured"
                )
            return softcap_slower(facts, self.tuning)
        if chunk_backends.backend_for(facts.device) is not FUSED_CPU:
            return f"on {facts.device.type} the chunked kernel runs an unfused matmul/softmax, slower than SDPA"
        if facts.left == UNBOUNDED:
            why = _no_left_bound(facts)
            if why is not None:
                return why
        return band_skips_little(facts) or short_call(facts, short_keys(facts.dtype, self.tuning))

    def plan(self, call):
        if call.softcap:  # chunks of the matmul/softmax backend: no fused call takes a softcap
            return ()
        return whole_call(call, self.tuning) or ()

    def _backend(self, call) -> ChunkBackend | None:
        """The backend of a call's chunks: the soft-capping one, or the device's (None)."""
        return chunk_backends.softcapped(call.softcap) if call.softcap else None

    def forward(self, call, plan):
        if isinstance(plan, WholeCall):
            return whole_forward(call.query, call.key, call.value, call.scale, plan)
        masks = BatchMasks(call.key_padding, call.segment_ids, call.block_ids)
        return chunked_forward(
            call.query,
            call.key,
            call.value,
            call.left,
            call.right,
            call.scale,
            masks,
            backend=self._backend(call),
            tuning=self.tuning,
        )

    def backward(self, call, plan, grad_out, out, logsumexp):
        if isinstance(plan, WholeCall):
            return whole_backward(grad_out, call.query, call.key, call.value, out, logsumexp, call.scale, plan)
        masks = BatchMasks(call.key_padding, call.segment_ids, call.block_ids)
        return chunked_backward(
            grad_out,
            call.query,
            call.key,
            call.value,
            out,
            logsumexp,
            call.left,
            call.right,
            call.scale,
            masks,
            backend=self._backend(call),
            tuning=self.tuning,
        )
