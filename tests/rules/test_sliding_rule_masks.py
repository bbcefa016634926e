"""The sliding rule on small hand-written attention functions: the rewritten graph, exact
windows, cases that must keep SDPA, and the proof against concrete evaluation."""

import re

import expecttest
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import compile_pass
from compile_pass.proof import Band, MaskEvaluator, prove_band
from tests.helpers.attention_reference import fa2_window_mask, random_qkv
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 4


def sliding_attention(q, k, v):
    """Masks built the way transformers builds them: index arithmetic and comparisons."""
    positions = torch.arange(q.shape[2], device=q.device)
    q_idx, kv_idx = positions[:, None], positions[None, :]
    mask = (kv_idx > q_idx - W) & (kv_idx <= q_idx)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class TestRewrittenGraph(expecttest.TestCase):
    def test_small_graph_snapshot(self):
        compiled, capture = compiled_with_capture(sliding_attention)
        assert_same_as_eager(sliding_attention, compiled)
        (gm,) = capture.graphs
        self.assertExpectedInline(
            gm.code.strip(),
            """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor, L_v_ : torch.Tensor):
    l_q_ = L_q_
    l_k_ = L_k_
    l_v_ = L_v_
    sliding_window_attention_forward_default = torch.ops.compile_pass.sliding_window_attention_forward.default(l_q_, l_k_, l_v_, 3, 0, 0.35355339059327373);  l_q_ = l_k_ = l_v_ = None
    getitem_2 = sliding_window_attention_forward_default[0];  sliding_window_attention_forward_default = None
    contiguous = getitem_2.contiguous();  getitem_2 = None
    return (contiguous,)""",  # noqa: E501 (a snapshot: printed lines as they are)
        )
        self.assertExpectedInline(
            capture.report.table(by_node=True),
            """\
node                          rule            decision                  kernel
scaled_dot_product_attention  sliding_window  rewritten: window (3, 0)  chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys
1 of 1 attention call rewritten""",  # noqa: E501 (a snapshot: printed lines as they are)
        )


def test_decisions_are_collected_inside_the_block_only():
    with compile_pass.decisions() as outer:
        compiled, _ = compiled_with_capture(sliding_attention)
        with compile_pass.decisions() as inner:
            compiled(*qkv())
    compiled_again, _ = compiled_with_capture(sliding_attention)
    compiled_again(*qkv())  # compiles anew, outside both blocks
    assert [d.verdict for d in outer] == [d.verdict for d in inner] == ["rewritten: window (3, 0)"]


@pytest.mark.parametrize(
    ("lower_bound", "left"),
    [(lambda kv, q: kv > q - W, W - 1), (lambda kv, q: kv >= q - W, W)],
    ids=["kv > q - w", "kv >= q - w"],
)
def test_windows_differing_by_one_key_are_told_apart(lower_bound, left):
    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        q_idx, kv_idx = positions[:, None], positions[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_bound(kv_idx, q_idx) & (kv_idx <= q_idx))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert capture.report[0].verdict == f"rewritten: window ({left}, 0)"


def test_bidirectional_band():
    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        distance = positions[None, :] - positions[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance < 3) & ~(distance < -5))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert capture.report[0].verdict == "rewritten: window (5, 2)"


def _mask_from_input(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _mask_with_unknown_op(q, k, v):
    positions = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(positions[None, :] - positions[:, None]) % 7 < W)


def _mask_with_float_arithmetic(q, k, v):
    positions = torch.arange(q.shape[2]).float() / 3  # not integers (tests/proof/test_spellings.py has those)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])


def _mask_not_a_band(q, k, v):
    positions = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] < 5)


def _mask_in_uint8(q, k, v):
    positions = torch.arange(q.shape[2], dtype=torch.uint8)  # would wrap past 255
    return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])


def _mask_after_narrowing_cast(q, k, v):
    positions = (torch.arange(q.shape[2]) * 2**28).to(torch.int32)  # wraps from position 8 on
    return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])


def _mask_with_wrapping_gather(q, k, v):
    positions = torch.arange(q.shape[2])
    shifted = positions[positions - 1]  # index -1 reads the last position
    return F.scaled_dot_product_attention(q, k, v, attn_mask=shifted[None, :] <= shifted[:, None])


def _mask_written_after_building(q, k, v):
    positions = torch.arange(q.shape[2])
    mask = positions[None, :] <= positions[:, None]
    mask[:, 0] = False  # no longer a band
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _positions_shifted_in_place(q, k, v):
    positions = torch.arange(q.shape[2])
    view = positions[None]
    view.add_(0)  # writes through a view of the positions
    return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])


def _segments_not_from_consecutive_positions(q, k, v, positions):
    """Like transformers' packed-sequence ids, but a new segment only where positions jump by 2:
    within a "segment" positions need not follow each other, so no band follows."""
    first = positions[:, :1] - 1
    segments = (torch.diff(positions, prepend=first, dim=-1) != 2).cumsum(-1)
    b = torch.arange(positions.shape[0])[:, None, None, None]
    q_idx, kv_idx = torch.arange(q.shape[2])[None, None, :, None], torch.arange(q.shape[2])[None, None, None, :]
    same = segments[b, q_idx] == segments[b, kv_idx]
    band = (positions[b, kv_idx] <= positions[b, q_idx]) & (positions[b, kv_idx] > positions[b, q_idx] - W)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & band)


def _with_dropout(q, k, v):
    positions = torch.arange(q.shape[2])
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx > q_idx - W) & (kv_idx <= q_idx), dropout_p=0.5)


@pytest.mark.parametrize(
    ("fn", "extra", "verdict"),
    [
        (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            (),
            "kept: no mask: SDPA runs its causal kernel (is_causal=True), no band to skip",
        ),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), (), "kept: no mask (is_causal=False)"),
        (_mask_from_input, (torch.ones(16, 16, dtype=torch.bool).tril(),), "kept: mask depends on input mask"),
        (_mask_with_unknown_op, (), "kept: mask op mod not understood"),
        (
            _mask_with_float_arithmetic,
            (),
            "kept: mask op truediv (positions) not understood",
        ),
        (_mask_not_a_band, (), "kept: mask term kv < 5 is not a bound on kv - q"),
        (_with_dropout, (), "kept: dropout_p=0.5 (the op has no dropout)"),
        (
            _mask_in_uint8,
            (),
            "kept: mask getitem produces torch.uint8; only integer, bool and integer-valued float index arithmetic "
            "is proven",
        ),
        (_mask_after_narrowing_cast, (), "kept: mask .to() (positions) may overflow int32"),
        (_mask_with_wrapping_gather, (), "kept: mask index not provably in range"),
        (_mask_written_after_building, (), "kept: mask mask is written in place by setitem"),
        (_positions_shifted_in_place, (), "kept: mask view is written in place by .add_()"),
        (
            _segments_not_from_consecutive_positions,
            (torch.arange(16)[None].expand(1, -1).contiguous(),),
            # The ids are read as any ids (the op would be given them); the window over
            # positions is what stays unproven.
            "kept: mask depends on input positions",
        ),
    ],
    ids=[
        "causal",
        "no-mask",
        "graph-input",
        "unknown-op",
        "float",
        "not-a-band",
        "dropout",
        "uint8",
        "narrowing-cast",
        "wrapping-gather",
        "mask-mutated",
        "positions-mutated",
        "fake-segments",
    ],
)
def test_kept_with_a_reason(fn, extra, verdict):
    compiled, capture = compiled_with_capture(fn)
    q, k, v = qkv()
    if verdict.startswith("kept: dropout"):
        compiled(q, k, v, *extra)
    else:
        assert_same_as_eager(lambda *a: fn(*a, *extra), lambda *a: compiled(*a, *extra))
    (decision,) = [d.verdict for d in capture.report]
    # Reasons end with the user's source line of the op that stopped the proof (tested below).
    assert decision == verdict or decision.startswith(verdict + " at tests/rules/test_sliding_rule_masks.py:"), decision
    assert not capture.report.rewritten()


def _aligned_to_the_last_key(q, k, v):
    """Decoding with a cache: queries are the last Sq positions of Sk."""
    offset = k.shape[2] - q.shape[2]
    q_idx = (torch.arange(q.shape[2]) + offset)[:, None]
    kv_idx = torch.arange(k.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx > q_idx - W) & (kv_idx <= q_idx))


def _aligned_to_the_first_key(q, k, v):
    q_idx, kv_idx = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx > q_idx - W) & (kv_idx <= q_idx))


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_aligned_to_the_last_key, "rewritten: window (3, 0)"),
        (_aligned_to_the_first_key, "kept: mask excludes the aligned diagonal (kv == q + Sk - Sq): not an FA2 window"),
    ],
    ids=["bottom-right", "top-left"],
)
def test_fewer_queries_than_keys(fn, verdict):
    compiled, capture = compiled_with_capture(fn)
    q, k, v = random_qkv(1, 2, 2, 5, 16, 8, torch.float64, heads_last=False)
    assert_same_as_eager(fn, compiled, (q, k, v))
    assert [d.verdict for d in capture.report if d.rule == "sliding_window"] == [verdict]


def _band_and_padding_by_batch_row(q, k, v, padding):
    """transformers' padded mask: key kv of batch row b is visible where padding[b, kv] != 0."""
    positions = torch.arange(q.shape[2])
    band = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band & (padding[:, None, None, :] != 0))


def _band_and_padding_of_row_0(q, k, v, padding):
    """Every batch row masked with row 0's padding."""
    positions = torch.arange(q.shape[2])
    band = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band & (padding[0] != 0))


def _right_padding(batch, seq=16, padded=3):
    """No query row loses every key of its band, so eager SDPA has no NaN rows to compare."""
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[:, seq - padded :] = 0
    padding[-1, 1] = 0  # a hole: row-wise paddings differ when batch > 1
    return padding


@pytest.mark.parametrize(
    ("fn", "batch", "padding_batch", "verdict"),
    [
        (_band_and_padding_by_batch_row, 2, 2, "rewritten: window (3, 0), key padding from padding"),
        (_band_and_padding_by_batch_row, 1, 1, "rewritten: window (3, 0), key padding from padding"),
        (_band_and_padding_of_row_0, 1, 1, "rewritten: window (3, 0), key padding from padding"),
        (
            _band_and_padding_of_row_0,
            2,
            2,
            "kept: mask is window (3, 0), key padding from padding, but reads row 0 of padding for every batch row",
        ),
        (
            _band_and_padding_by_batch_row,
            2,
            1,
            "kept: mask is window (3, 0), key padding from padding, but padding is not (batch, keys)",
        ),
    ],
    ids=["per-row", "batch-1", "row-0-of-batch-1", "row-0-of-batch-2", "padding-broadcast-over-batch"],
)
def test_key_padding_is_rewritten_only_when_it_is_per_batch_row(fn, batch, padding_batch, verdict):
    compiled, capture = compiled_with_capture(fn)
    padding = _right_padding(padding_batch)
    assert_same_as_eager(lambda *a: fn(*a, padding), lambda *a: compiled(*a, padding), qkv(batch=batch))
    assert [d.verdict for d in capture.report] == [verdict]


# -- the proof against concrete evaluation -------------------------------------------

_terms = st.sampled_from(["kv - q", "q - kv", "kv", "q", "kv + q", "abs(kv - q)", "abs(kv + q)"])
_comparisons = st.sampled_from(["<", "<=", ">", ">=", "=="])


def _atom():
    return st.tuples(_terms, _comparisons, st.integers(-6, 6)).map(lambda t: f"(({t[0]}) {t[1]} {t[2]})")


_programs = st.recursive(
    _atom(),
    lambda inner: st.one_of(
        st.tuples(inner, inner).map(lambda t: f"({t[0]} & {t[1]})"),
        st.tuples(inner, inner).map(lambda t: f"({t[0]} | {t[1]})"),
        inner.map(lambda t: f"(~{t})"),
    ),
    max_leaves=4,
)


@settings(max_examples=60, deadline=None)
@given(program=_programs)
def test_proof_never_calls_a_non_band_a_band(program):
    """Trace a random mask program with a dynamic length, prove it, and check any band
    verdict against the mask evaluated concretely at several lengths."""
    source = (
        f"def make(x):\n    p = torch.arange(x.shape[0])\n    q, kv = p[:, None], p[None, :]\n    return {program}\n"
    )
    namespace = {"torch": torch}
    exec(source, namespace)  # noqa: S102 - the program is built from the grammar above
    make = namespace["make"]
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(make, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True, dynamic=True)
    compiled(torch.empty(7))
    (gm,) = graphs
    (mask_node,) = gm.graph.find_nodes(op="output")[0].args[0]
    verdict = prove_band(MaskEvaluator(), mask_node)
    if isinstance(verdict, Band):
        for length in (2, 5, 9, 16):
            expected = fa2_window_mask(length, length, verdict.left, verdict.right)
            # SDPA broadcasts the mask to (Sq, Sk); so does the verdict.
            actual = make(torch.empty(length)).expand(length, length)
            assert torch.equal(actual, expected), (program, verdict, length)


def test_a_kept_reason_names_the_source_line_of_the_op():
    import inspect

    compiled, capture = compiled_with_capture(_mask_with_unknown_op)
    compiled(*qkv())
    source, first = inspect.getsourcelines(_mask_with_unknown_op)
    line = first + next(k for k, text in enumerate(source) if "% 7" in text)
    assert (
        capture.report[0].verdict
        == f"kept: mask op mod not understood at tests/rules/test_sliding_rule_masks.py:{line}"
    )


# -- key padding read past the cache's start ------------------------------------------


def _band_and_padding_from(first):
    """The band aligned to the last key AND key kv's padding read at padding[b, first(L, Sk) + kv],
    L the padding's length: a prefill chunk after a cache, whose first key is token first."""

    def attention(q, k, v, padding):
        offset = k.shape[2] - q.shape[2]
        q_idx = (torch.arange(q.shape[2]) + offset)[:, None]
        kv_idx = torch.arange(k.shape[2])[None, :]
        start = first(padding.shape[1], k.shape[2])
        visible = padding[:, start : start + k.shape[2]] != 0
        band = (kv_idx > q_idx - W) & (kv_idx <= q_idx)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band & visible[:, None, None, :])

    return attention


@pytest.mark.parametrize(
    ("first", "queries", "length", "dynamic", "verdict"),
    [
        (lambda L, Sk: L - Sk, 5, 21, False, "rewritten: window (3, 0), key padding from padding shifted by 5"),
        (lambda L, Sk: 3, 5, 21, False, "rewritten: window (3, 0), key padding from padding shifted by 3"),
        (lambda L, Sk: 1, 16, 17, False, "rewritten: window (3, 0), key padding from padding shifted by 1"),
        (
            lambda L, Sk: L - Sk,
            5,
            21,
            True,
            "rewritten: window (3, 0), key padding from padding shifted by {size} - 16",
        ),
        (lambda L, Sk: 2, 5, 21, True, "rewritten: window (3, 0), key padding from padding shifted by 2"),
        (
            lambda L, Sk: L - Sk - 3,
            5,
            21,
            True,
            "rewritten: window (3, 0), key padding from padding shifted by {size} - 19",
        ),
        (lambda L, Sk: 0, 5, 21, False, "rewritten: window (3, 0), key padding from padding"),  # its first Sk columns
    ],
    ids=[
        "last-keys",
        "inner-keys",
        "self-attention",
        "dynamic-last-keys",
        "dynamic-inner-keys",
        "dynamic-start",
        "first-keys",
    ],
)
def test_key_padding_read_past_the_cache_start(first, queries, length, dynamic, verdict):
    """Each query sees the keys its window and the padding at their own token allow, at every
    position (padded rows and keys included), forward and gradients against eager, where the
    padding is read from the cache's first token on (batched generation's prefill chunks)."""
    fn = _band_and_padding_from(first)
    compiled, capture = compiled_with_capture(fn)
    q, k, v = random_qkv(2, 2, 2, queries, 16, 8, torch.float64, heads_last=False)
    padding = torch.ones(2, length, dtype=torch.long)
    padding[0, :9] = 0  # row 0: the first keys of the call are padding
    padding[1, ::3] = 0  # row 1: every third token, so any other start reads other keys as padding
    if dynamic:
        torch._dynamo.mark_dynamic(padding, 1)
    assert_same_as_eager(lambda *a: fn(*a, padding), lambda *a: compiled(*a, padding), (q, k, v))
    (decision,) = [d.verdict for d in capture.report if d.rule == "sliding_window"]
    # {size}: the padding's length, a symbol named by Dynamo
    assert re.fullmatch(re.escape(verdict).replace(re.escape("{size}"), r"s\d+") + "( at .*)?", decision), decision


def test_key_padding_with_fewer_queries_than_keys_keeps_sdpa_where_fa2_runs(monkeypatch):
    """FA2 runs padded self-attention only (Sq == Sk, as varlen calls); a padded prefill chunk
    after a cache would take the chunked kernel's unfused fallback there, slower than SDPA."""
    from compile_pass.kernels import policy
    from compile_pass.kernels.policy import facts_of
    from tests.helpers.small_graphs import ask_as_if_on_cuda, pretend_gpu

    assert policy.POLICY.choose(facts_of("cpu", torch.float32, 64, key_padding=True, same_lengths=False)).fast
    pretend_gpu(monkeypatch)
    assert policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 64, key_padding=True)).fast
    assert policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 64, same_lengths=False)).fast  # FA2's own alignment
    ask_as_if_on_cuda(monkeypatch)
    fn = _band_and_padding_from(lambda L, Sk: L - Sk)
    compiled, capture = compiled_with_capture(fn)
    q, k, v = random_qkv(2, 2, 2, 5, 16, 8, torch.bfloat16, heads_last=False)  # a dtype FA2 takes
    padding = torch.ones(2, 20, dtype=torch.long)
    padding[0, :6] = 0
    assert_same_as_eager(lambda *a: fn(*a, padding), lambda *a: compiled(*a, padding), (q, k, v))
    (verdict,) = [d.verdict for d in capture.report]
    assert verdict.startswith("kept: mask is window (3, 0), key padding from padding shifted by 4, but no kernel"), (
        verdict
    )
    assert "torch's FA2: torch's FA2 runs key padding or segment ids as varlen calls for Sq == Sk only" in verdict


@pytest.mark.parametrize(("queries", "keys", "rewritten"), [(2, 6, False), (2, 7, True), (6, 6, True)])
def test_a_chunk_after_a_cache_is_rewritten_where_the_band_skips_enough(queries, keys, rewritten):
    """With fewer queries than keys, the band skips little of what SDPA scores until there are
    2w - 1 keys (benchmarks/bench_op.py --cache): below that SDPA stays. Self-attention
    (Sq == Sk) is not concerned."""
    compiled, capture = compiled_with_capture(_aligned_to_the_last_key)
    q, k, v = random_qkv(1, 2, 2, queries, keys, 8, torch.float64, heads_last=False)
    assert_same_as_eager(_aligned_to_the_last_key, compiled, (q, k, v))
    (verdict,) = [d.verdict for d in capture.report if d.rule == "sliding_window"]
    if rewritten:
        assert verdict == "rewritten: window (3, 0)", verdict
    else:
        assert verdict.startswith("kept: mask is window (3, 0), but no kernel is exact and as fast as SDPA here: "), (
            verdict
        )
        assert (
            "chunked: its 6 keys after a cache may be fewer than 2w - 1 = 7, where the band skips too little for the "
            "op to be as fast as SDPA; " in verdict
        ), verdict
        assert verdict.endswith("; slow_kernels=True rewrites anyway"), verdict


def _the_same_read_after_the_call(q, k, v, padding):
    """The program reads the padding's last Sk columns again after the call, as the op's read
    does: that node runs after the call, so the op's copy cannot be taken from it."""
    offset = k.shape[2] - q.shape[2]
    q_idx, kv_idx = (torch.arange(q.shape[2]) + offset)[:, None], torch.arange(k.shape[2])[None, :]
    band = (kv_idx > q_idx - W) & (kv_idx <= q_idx)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=band & (padding[:, -k.shape[2] :] != 0)[:, None, None, :])
    return out + torch.narrow(padding, 1, -k.shape[2], k.shape[2]).sum()


def test_a_read_of_the_padding_after_the_call_is_not_reused():
    compiled, capture = compiled_with_capture(_the_same_read_after_the_call)
    q, k, v = random_qkv(3, 2, 2, 5, 16, 8, torch.float64, heads_last=False)
    padding = torch.ones(3, 21, dtype=torch.long)
    padding[0, :9] = 0
    padding[2, ::3] = 0
    fn = _the_same_read_after_the_call
    assert_same_as_eager(lambda *a: fn(*a, padding), lambda *a: compiled(*a, padding), (q, k, v))
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0), key padding from padding shifted by 5"]
