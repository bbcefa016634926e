"""The chunked kernel across its call boundaries, at its own chunk sizes, against the fp64 reference.

The kernel computes the rows whose window lies inside the keys as one run of equal chunks
(one call forward, a few backward), and the rows whose window is cut by either end in a few
runs of one chunk each. Each case below asserts the structure it is meant to cross (which
runs exist, where they end), so that a change of chunk sizes cannot quietly make it trivial,
then checks the output and dq, dk, dv in fp64 (1e-10).
"""

import math

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels.chunked import backends as chunk_backends
from compile_pass.kernels.chunked import plan as chunk_plan
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import tune_chunks

W = 64  # causal window of W keys: window=(W - 1, 0)


def _chunk_rows(left, right, group):
    return chunk_plan.rows_per_chunk(left, right, group)


def _runs(seq_q, seq_k, left, right, group):
    return chunk_plan.plan_runs(seq_q, seq_k, left, right, chunk_rows=_chunk_rows(left, right, group), group=group)


def _check(q, k, v, left, right, **batch_masks):
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(
        lambda *a: reference_attention(*a, left, right, **batch_masks), ref_inputs, grad_out
    )
    op = lambda *a: sliding_window_attention(*a, window=(left, right), causal=False, **batch_masks)  # noqa: E731
    out, grads = forward_and_grads(op, (q, k, v), grad_out)
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert (ours - ref).abs().max().item() < 1e-10, name
    return out


def _sequences(group):
    """(name, seq_q, seq_k, the runs the plan must have) for a causal window of W keys."""
    rows = _chunk_rows(W - 1, 0, group)
    return [
        ("shorter than the window", W // 2, W // 2, "causal"),
        ("window and part of a chunk", W - 1 + 3 * rows + rows // 2, W - 1 + 3 * rows + rows // 2, "causal+inner"),
        ("a whole number of chunks", W - 1 + 4 * rows, W - 1 + 4 * rows, "causal+inner"),
        ("more queries than keys", W + 3 * rows + 40, W + 3 * rows, "causal+inner"),
        ("decoding one query", 1, W + 3 * rows, "edges"),
        ("decoding a few queries", 5, W + 3 * rows, "edges"),
        ("a prefill against a cache", W + 2 * rows + 3, W + 2 * rows + 3 + W // 2, "edges+inner+edges"),
    ]


CASES = [(group, *case) for group in (1, 2, 4) for case in _sequences(group)]


@pytest.mark.parametrize(
    ("group", "name", "seq_q", "seq_k", "expect"), CASES, ids=[f"g{c[0]}-{c[1].replace(' ', '-')}" for c in CASES]
)
def test_causal_window_across_runs(group, name, seq_q, seq_k, expect):
    left, right = W - 1, 0
    rows = _chunk_rows(left, right, group)
    runs = _runs(seq_q, seq_k, left, right, group)
    inner = [run for run in runs if run.count > 1]
    if expect == "causal":
        (run,) = runs
        assert run.causal
    elif expect == "causal+inner":
        # The rows whose window starts before key 0, and those left over by the chunks, in
        # one causal run; the inner run ends at the last row.
        head, body = runs
        assert head.causal and head.first_row == seq_q - seq_k
        assert left <= head.rows < left + rows
        assert body.count >= 2 and body.first_row + body.count * rows == seq_q
    elif expect == "edges":
        assert not inner and not any(run.causal for run in runs)
    else:
        (body,) = inner
        before, after = runs[: runs.index(body)], runs[runs.index(body) + 1 :]
        assert before and after and not any(run.causal for run in runs)
    q, k, v = random_qkv(2, 2 * group, 2, seq_q, seq_k, 32, torch.float64)
    _check(q, k, v, left, right)


@pytest.mark.parametrize("group", [1, 2])
def test_two_sided_window_has_edge_runs_at_both_ends(group):
    left, right = 40, 20
    rows = _chunk_rows(left, right, group)
    seq = left + right + 3 * rows + 7
    runs = _runs(seq, seq, left, right, group)
    inner = next(run for run in runs if run.count > 1)
    # Rows whose window is cut by the last key come after the inner run.
    assert inner.first_row == left and inner.first_row + inner.count * rows <= seq - right
    assert runs[-1].first_row + runs[-1].rows == seq
    q, k, v = random_qkv(2, 2 * group, 2, seq, seq, 32, torch.float64)
    _check(q, k, v, left, right)


def _padding_and_segments(batch, seq):
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[0, : seq // 3] = False  # left padding: the first rows see only padding
    padding[1, -9:] = False  # right padding
    padding[1, seq // 2] = False  # a hole
    segments = torch.zeros(batch, seq, dtype=torch.long)
    segments[0, seq // 4 :] = 1
    segments[0, seq // 4 + 5 :] = 2  # a segment shorter than a chunk
    segments[1, seq // 2 :] = 1
    return padding, segments


@pytest.mark.parametrize("budget", [None, 4096], ids=["one-call-per-run", "small-call-budget"])
@pytest.mark.parametrize("masks", ["key_padding", "segment_ids", "both"])
def test_batch_masks_across_runs_and_calls(masks, budget, monkeypatch):
    """Key padding and segment ids build per-chunk masks; with a small budget the inner run
    is split into several calls in both directions."""
    tune_chunks(monkeypatch, call_budget=budget)
    group = 2
    rows = _chunk_rows(W - 1, 0, group)
    seq = W - 1 + 5 * rows + rows // 3
    padding, segments = _padding_and_segments(2, seq)
    chosen = {
        "key_padding": {"key_padding": padding},
        "segment_ids": {"segment_ids": segments},
        "both": {"key_padding": padding, "segment_ids": segments},
    }[masks]
    calls = _count_calls(monkeypatch)
    q, k, v = random_qkv(2, 2 * group, 2, seq, seq, 32, torch.float64)
    out = _check(q, k, v, W - 1, 0, **chosen)
    inner = next(run for run in _runs(seq, seq, W - 1, 0, group) if run.count > 1)
    per_batch_row = calls["forward"] / 2
    if budget is None:
        assert per_batch_row == len(_runs(seq, seq, W - 1, 0, group))
    else:
        assert per_batch_row > len(_runs(seq, seq, W - 1, 0, group)), "the inner run was not split"
    assert inner.count >= 5
    if "key_padding" in chosen:  # left-padded row 0: its first rows return zeros
        assert torch.equal(out[0, :, : seq // 3], torch.zeros_like(out[0, :, : seq // 3]))


def _count_calls(monkeypatch):
    calls = {"forward": 0, "backward": 0}
    fused = chunk_backends.FUSED_CPU

    def forward(*args):
        calls["forward"] += 1
        return fused.forward(*args)

    def backward(*args):
        calls["backward"] += 1
        return fused.backward(*args)

    counting = chunk_backends.ChunkBackend(forward, backward, fused.holds_scores)
    monkeypatch.setattr(chunk_backends, "backend_for", lambda device: counting)
    return calls


@pytest.mark.parametrize("budget", [None, 1 << 18], ids=["default-budget", "budget-splits-the-backward"])
def test_a_long_sequence_takes_a_handful_of_calls(budget, monkeypatch):
    """The point of the runs: one call per run forward; backward too while a call's
    per-chunk gradients fit the budget, else the inner run's chunks interleaved over at most
    ceil(span / rows) calls."""
    tune_chunks(monkeypatch, call_budget=budget)
    calls = _count_calls(monkeypatch)
    seq, window, group = 2048, 256, 2
    q, k, v = random_qkv(1, 2 * group, 2, seq, seq, 16, torch.float32)
    sliding_window_attention(q, k, v, window=(window - 1, 0)).sum().backward()
    runs = _runs(seq, seq, window - 1, 0, group)
    inner = next(run for run in runs if run.count > 1)
    assert calls["forward"] == len(runs) <= chunk_plan.EDGE_RUNS + 2
    if budget is None:
        assert calls["backward"] == len(runs)
    else:
        assert len(runs) < calls["backward"] <= len(runs) - 1 + math.ceil(inner.keys / inner.rows)


def test_logsumexp_layout_and_rows_without_keys():
    # Sq > Sk with a causal window: the first Sq - Sk rows see no key: zeros and lse +inf.
    q, k, v = random_qkv(2, 4, 2, 300, 200, 16, torch.float32)
    out, lse = torch.ops.compile_pass.sliding_window_attention_forward(q, k, v, W - 1, 0, 0.25)
    assert lse.shape == (2, 4, 300) and lse.is_contiguous() and lse.dtype == torch.float32
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(out[:, :, :100], torch.zeros_like(out[:, :, :100]))
    assert torch.isinf(lse[:, :, :100]).all() and torch.isfinite(lse[:, :, 100:]).all()
