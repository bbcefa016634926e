"""The chunk plan against brute force: coverage, exact masks, and the O(S * (w + chunk)) bound."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_pass.ops.chunked import plan_chunks
from tests.attention_reference import fa2_window_mask

window_side = st.one_of(st.just(-1), st.integers(0, 40))


@settings(max_examples=300, deadline=None)
@given(
    seq_q=st.integers(1, 90),
    seq_k=st.integers(1, 90),
    left=window_side,
    right=window_side,
    chunk_rows=st.integers(1, 33),
)
def test_plan_reproduces_the_window_exactly(seq_q, seq_k, left, right, chunk_rows):
    full = fa2_window_mask(seq_q, seq_k, left, right)
    planned = torch.zeros_like(full)
    covered_rows = torch.zeros(seq_q, dtype=torch.bool)
    chunks = plan_chunks(
        seq_q, seq_k, left, right, dtype=torch.float32, device=torch.device("cpu"), chunk_rows=chunk_rows
    )
    for chunk in chunks:
        rows, keys = chunk.rows, chunk.keys
        assert rows.stop - rows.start <= chunk_rows
        assert not covered_rows[rows].any(), "rows planned twice"
        covered_rows[rows] = True
        # Every key a row sees lies inside its chunk's span.
        assert not full[rows, : keys.start].any() and not full[rows, keys.stop :].any()
        visible = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.bool)
        if chunk.mask is not None:
            visible = chunk.mask == 0
        planned[rows, keys] = visible
        # Each row in a chunk sees at least one key, so no softmax is empty.
        assert visible.any(dim=1).all()
        if left >= 0 and right >= 0:
            assert keys.stop - keys.start <= (rows.stop - rows.start) + left + right
    assert torch.equal(planned, full)
    # Exactly the rows with a visible key are planned; the others stay zero.
    assert torch.equal(covered_rows, full.any(dim=1))
