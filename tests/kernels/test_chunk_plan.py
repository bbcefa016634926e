"""The chunk plan against brute force: coverage, exact masks, few calls, O(S * (w + chunk)) spans."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_pass.kernels.chunked import plan as chunk_plan
from compile_pass.kernels.chunked.plan import plan_runs, run_band
from tests.helpers.attention_reference import fa2_window_mask

CPU = torch.device("cpu")
window_side = st.one_of(st.just(-1), st.integers(0, 40))


@settings(max_examples=300, deadline=None)
@given(
    seq_q=st.integers(1, 90),
    seq_k=st.integers(1, 90),
    left=window_side,
    right=window_side,
    chunk_rows=st.integers(1, 33),
    group=st.sampled_from([1, 2, 4]),
)
def test_runs_reproduce_the_window_exactly(seq_q, seq_k, left, right, chunk_rows, group):
    full = fa2_window_mask(seq_q, seq_k, left, right)
    covered_rows = torch.zeros(seq_q, dtype=torch.bool)
    runs = plan_runs(seq_q, seq_k, left, right, chunk_rows=chunk_rows, group=group)
    bounded = left >= 0 and right >= 0
    for run in runs:
        band = run_band(run, left, right, seq_k - seq_q, CPU)
        for index in range(run.count):
            rows, keys = run.chunk(index)
            assert 0 <= keys.start < keys.stop <= seq_k and 0 <= rows.start < rows.stop <= seq_q
            assert not covered_rows[rows].any(), "rows planned twice"
            covered_rows[rows] = True
            # Every key a row sees lies inside its chunk's span ...
            assert not full[rows, : keys.start].any() and not full[rows, keys.stop :].any()
            # ... and the run's one relative band (and, for a causal run, the kernel's own
            # mask of keys past the diagonal) is each chunk's exact mask.
            visible = torch.ones(run.rows, run.keys, dtype=torch.bool) if band is None else band
            if run.causal:
                assert run.count == 1 and rows.start + seq_k - seq_q == keys.start == 0
                visible = visible & torch.ones_like(visible).tril()
            assert torch.equal(full[rows, keys], visible)
            # Each row in a chunk sees at least one key, so no softmax is empty.
            assert visible.any(dim=1).all()
            if bounded:
                assert keys.stop - keys.start <= run.rows + left + right
        if run.count > 1:
            assert run.rows == chunk_rows, "only the inner run has several chunks"
    # Exactly the rows with a visible key are planned; the others stay zero.
    assert torch.equal(covered_rows, full.any(dim=1))
    # Bounded windows: the inner run, and at most EDGE_RUNS runs on each side of it.
    if bounded:
        assert sum(run.count > 1 for run in runs) <= 1
        assert len(runs) <= 2 * chunk_plan.EDGE_RUNS + 1
    # A causal window whose first row is aligned with key 0: a causal run (unless the inner
    # run starts at that row), then the inner run.
    if right == 0 and seq_q >= seq_k:
        assert len(runs) <= 2 and not any(run.causal for run in runs[1:])
        assert runs[0].causal or runs[0].first_row == seq_q - seq_k


def test_long_sequences_take_a_handful_of_runs():
    # A causal window of 512 over 8192 rows: one causal run for the first rows (the 511 whose
    # window is cut by key 0, and the 8192 - 511 = 7681 = 80 * 96 + 1 rows' remainder), then
    # one run of equal chunks that ends at the last row.
    head, inner = plan_runs(8192, 8192, 511, 0, chunk_rows=96, group=2)
    assert head == chunk_plan.Run(0, 512, 1, 0, 512, causal=True)
    assert inner == chunk_plan.Run(512, 96, 80, 1, 96 + 511)
    # Two-sided: at most EDGE_RUNS runs for the rows whose window is cut by key 0, the inner
    # run, and at most EDGE_RUNS for those cut by the last key or left over.
    runs = plan_runs(8192, 8192, 300, 200, chunk_rows=96, group=2)
    inner = [run for run in runs if run.count > 1]
    assert len(inner) == 1 and inner[0].first_row == 300 and inner[0].keys == 96 + 500
    assert len(runs) <= 2 * chunk_plan.EDGE_RUNS + 1 and not any(run.causal for run in runs)


def test_edge_runs_keep_their_masks_within_the_budget():
    # A window unbounded on the left and open on the right has no inner run: every row is
    # an edge row, in chunks whose (rows * group, keys) mask fits the budget (down to
    # chunk_rows).
    budget = 1 << 14
    runs = plan_runs(1000, 1000, -1, 3, chunk_rows=8, group=2, mask_budget=budget)
    assert all(run.rows == 8 or run.rows * 2 * run.keys <= budget for run in runs)
    assert sum(run.rows * run.count for run in runs) == 1000


def test_plain_causal_attention_is_one_causal_run_without_a_mask():
    (run,) = plan_runs(1000, 1000, -1, 0, chunk_rows=8, group=2, mask_budget=1 << 14)
    assert run == chunk_plan.Run(0, 1000, 1, 0, 1000, causal=True)
    assert run_band(run, -1, 0, 0, CPU) is None


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(1, 40),
    rows=st.integers(1, 20),
    extra_keys=st.integers(0, 60),
    budget_chunks=st.integers(1, 50),
    interleave=st.booleans(),
)
def test_calls_cover_each_chunk_once_within_the_budget(count, rows, extra_keys, budget_chunks, interleave):
    run = chunk_plan.Run(first_row=3, rows=rows, count=count, first_key=0, keys=rows + extra_keys)
    calls = chunk_plan.chunk_batches(run, per_chunk=10, budget=10 * budget_chunks, interleave=interleave)
    seen = []
    for call in calls:
        assert call.count <= budget_chunks
        seen += [call.first + i * call.stride for i in range(call.count)]
    assert sorted(seen) == list(range(count))
    strides = {call.stride for call in calls}
    assert len(strides) == 1
    (stride,) = strides
    if not interleave or count <= budget_chunks:
        # Consecutive chunks, in as few calls as the budget allows.
        assert stride == 1 and len(calls) == math.ceil(count / budget_chunks)
    else:
        # Interleaved just enough to fit the budget, never past disjoint spans.
        disjoint = math.ceil(run.keys / rows)
        assert stride == min(disjoint, math.ceil(count / budget_chunks))
        assert len(calls) == stride or stride == disjoint
