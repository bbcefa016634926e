"""The chunk plan against brute force: coverage, exact masks, few calls, O(S * (w + chunk)) spans."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_pass.ops import chunked
from compile_pass.ops.chunked import plan_runs, run_band
from tests.attention_reference import fa2_window_mask

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
            # ... and the run's one relative band is each chunk's exact mask.
            visible = torch.ones(run.rows, run.keys, dtype=torch.bool) if band is None else band
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
        assert len(runs) <= 2 * chunked.EDGE_RUNS + 1


def test_long_sequences_take_a_handful_of_runs():
    # A causal window of 512 over 8192 rows: the first 511 rows (window cut by key 0) in
    # EDGE_RUNS runs, then one run of equal chunks, then the rows that do not fill a chunk.
    runs = plan_runs(8192, 8192, 511, 0, chunk_rows=96, group=2)
    inner = [run for run in runs if run.count > 1]
    assert len(inner) == 1 and inner[0].first_row == 511 and inner[0].keys == 96 + 511
    assert len(runs) == chunked.EDGE_RUNS + 2
    assert runs[-1].first_row == inner[0].first_row + inner[0].count * 96 and runs[-1].count == 1


def test_edge_runs_keep_their_masks_within_the_budget():
    # An unbounded window has no inner run: every row is an edge row, in chunks whose
    # (rows * group, keys) mask fits the budget (down to chunk_rows).
    budget = 1 << 14
    runs = plan_runs(1000, 1000, -1, 0, chunk_rows=8, group=2, mask_budget=budget)
    assert all(run.rows == 8 or run.rows * 2 * run.keys <= budget for run in runs)
    assert sum(run.rows * run.count for run in runs) == 1000


@settings(max_examples=100, deadline=None)
@given(
    count=st.integers(1, 40),
    rows=st.integers(1, 20),
    extra_keys=st.integers(0, 60),
    budget_chunks=st.integers(1, 50),
    disjoint=st.booleans(),
)
def test_calls_cover_each_chunk_once_within_the_budget(count, rows, extra_keys, budget_chunks, disjoint):
    run = chunked.Run(first_row=3, rows=rows, count=count, first_key=0, keys=rows + extra_keys)
    calls = chunked._calls(run, per_chunk=10, budget=10 * budget_chunks, disjoint_spans=disjoint)
    seen = []
    for call in calls:
        assert call.count <= budget_chunks
        chunks = [call.first + i * call.stride for i in range(call.count)]
        seen += chunks
        if disjoint and call.count > 1:
            # Consecutive spans of a call do not overlap: one add per call sums its gradients.
            assert call.step >= run.keys
    assert sorted(seen) == list(range(count))
    if disjoint and count > 1:
        assert len(calls) <= math.ceil(run.keys / rows) * math.ceil(math.ceil(count / math.ceil(run.keys / rows)) / budget_chunks)
    else:
        assert len(calls) == math.ceil(count / budget_chunks)
