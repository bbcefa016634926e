"""Regression tests for the holes an adversarial user found in the proof and the rules: each
program here was rewritten (or crashed the compile) although the graph does not prove the
rewrite. Every test compares with eager, forward and gradients, so a false rewrite fails on
its numbers as well as on its verdict."""

import logging

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass.rules import sliding_window
from tests.helpers.small_graphs import (
    ask_as_if_on_cuda,
    assert_same_as_eager,
    compiled_with_capture,
    mask_input_paths,
    qkv,
)

W = 4
INT64_MAX = 2**63 - 1


def _verdicts(capture, rule="sliding_window"):
    return [d.verdict for report in capture.reports for d in report if d.rule == rule]


def _band_of(distance_term):
    """SDPA with the mask ``distance_term(kv - q)`` AND causal, over arange positions."""

    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        distance = positions[None, :] - positions[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=distance_term(distance) & (distance <= 0))

    return attend


# -- 1. integer overflow ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("term", "verdict"),
    [
        # Reads as kv - q >= -1, but (kv - q) * 2**62 wraps: kv - q = -3, -4, -5 pass too.
        (lambda d: d * 2**62 >= -(2**62), "kept: mask mul may overflow int64"),
        (lambda d: d + (2**63 - 2) >= 2**63 - 2 - W, "kept: mask add may overflow int64"),
        (lambda d: d.to(torch.int32) * 2**30 >= -(2**30), "kept: mask mul may overflow int32"),
    ],
    ids=["int64-times-2**62", "int64-plus-2**63-2", "int32-times-2**30"],
)
def test_integer_overflow_is_not_a_bound(term, verdict):
    attend = _band_of(term)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = _verdicts(capture)
    assert decision.startswith(verdict + " at tests/proof/test_soundness.py:"), decision


@pytest.mark.parametrize(
    "reduce",
    [lambda flags: flags.sum(dim=[]), lambda flags: torch.sum(flags, dim=()), lambda flags: flags.sum()],
    ids=["dim=[]", "dim=()", "no-dim"],
)
def test_a_sum_over_every_dimension_counts_every_flag(reduce):
    """``sum(dim=[])`` sums every element, as ``sum()`` does: a count of 2 * 16 flags lies in
    [0, 32], not [0, 1] (a sum over no dimension), which would let the proof take
    ``count * 2**62`` for exact where it wraps."""
    from compile_pass.proof import AtomKind, MaskEvaluator

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda flags: reduce(flags) + 1, backend=backend, fullgraph=True)(torch.ones(2, 16, dtype=torch.bool))
    (graph,) = graphs
    evaluator = MaskEvaluator()
    (total,) = [node for node in graph.graph.nodes if "sum" in str(node.target)]
    evaluator.evaluate(total)
    (count,) = evaluator.atoms.of_kind(AtomKind.OPAQUE)
    assert count.known_range == (0, 32)


def _band_over_input_positions(q, k, v, positions):
    """transformers' packed-sequence mask, with the upper bound read on input positions."""
    first = positions[:, :1] - 1
    segments = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    b = torch.arange(positions.shape[0])[:, None, None, None]
    q_idx, kv_idx = torch.arange(q.shape[2])[None, None, :, None], torch.arange(q.shape[2])[None, None, None, :]
    same = segments[b, q_idx] == segments[b, kv_idx]
    causal_on_positions = positions[b, kv_idx] <= positions[b, q_idx]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & causal_on_positions & (kv_idx > q_idx - W))


@pytest.mark.parametrize(
    ("start", "path"),
    [(INT64_MAX - 7, "sdpa with the mask"), (2**30 - 8, "sdpa with the mask"), (5, "band")],
    ids=["wrapping", "past-the-checked-range", "in-range"],
)
def test_input_positions_that_wrap_inside_a_segment_are_not_read_as_distances(start, path):
    """Positions INT64_MAX - 7 .. INT64_MAX, INT64_MIN .. INT64_MIN + 7: every int64 difference
    is 1, so the ids see one segment, yet P[kv] <= P[q] is false across the wrap. The band
    over indices is proven for positions in [0, 2**30) only: outside, the op's run-time check
    runs SDPA with the mask."""
    positions = (torch.arange(16) + start)[None].repeat(2, 1)  # wraps at position 8 from INT64_MAX - 7
    compiled, capture = compiled_with_capture(_band_over_input_positions)
    with mask_input_paths() as paths:
        assert_same_as_eager(
            lambda *a: _band_over_input_positions(*a, positions), lambda *a: compiled(*a, positions), qkv(batch=2)
        )
    assert _verdicts(capture) == [
        f"rewritten: window ({W - 1}, 0), packed sequences from positions (positions checked at run time)"
    ]
    assert paths == {path: 1}


def _segments_of_one_input_window_on_another(q, k, v, positions, other):
    """Segment ids from ``positions``, the window read on ``other``: inside a segment of
    ``positions`` nothing says how ``other`` moves."""
    segments = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    b = torch.arange(positions.shape[0])[:, None, None, None]
    q_idx, kv_idx = torch.arange(q.shape[2])[None, None, :, None], torch.arange(q.shape[2])[None, None, None, :]
    same = segments[b, q_idx] == segments[b, kv_idx]
    window = (other[b, kv_idx] <= other[b, q_idx]) & (other[b, kv_idx] > other[b, q_idx] - W)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & window)


def test_a_window_on_other_positions_than_the_segments_is_kept():
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None].repeat(2, 1)
    other = torch.arange(16).flip(0)[None].repeat(2, 1)  # in range, but not the ids' positions
    compiled, capture = compiled_with_capture(_segments_of_one_input_window_on_another)
    assert_same_as_eager(
        lambda *a: _segments_of_one_input_window_on_another(*a, positions, other),
        lambda *a: compiled(*a, positions, other),
        qkv(batch=2),
    )
    (verdict,) = _verdicts(capture)
    # the obstacle with the ids' positions checked at run time
    assert verdict.startswith("kept: mask depends on input other, even with input positions checked"), verdict


def _additive_band_in_float32(q, k, v):
    """An additive band built in float32 whatever the query's dtype: SDPA accepts a float32
    mask with float64 queries, and its CPU kernel then does not add it as the band's 0/-inf
    (it gives other results, 2.9 apart on these inputs)."""
    positions = torch.arange(q.shape[2])
    band = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    mask = torch.zeros(q.shape[2], q.shape[2]).masked_fill(~band, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_an_additive_mask_of_another_dtype_than_the_query_keeps_sdpa():
    compiled, capture = compiled_with_capture(_additive_band_in_float32)
    assert_same_as_eager(_additive_band_in_float32, compiled)  # fp64 queries
    assert _verdicts(capture) == [
        "kept: additive mask in torch.float32 with torch.float64 queries: only a mask of the queries' dtype is read "
        "as SDPA adds it"
    ]


# -- 2. writes through any alias -----------------------------------------------------------


def _positions_written(write):
    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        write(positions)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=(positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None]),
        )

    return attend


def _mask_written(write):
    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
        write(mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


WRITES = {
    "torch.clamp_": _positions_written(lambda p: torch.clamp_(p, max=5)),
    "torch.neg_": _positions_written(torch.neg_),
    "narrow-fill_": _positions_written(lambda p: torch.narrow(p, 0, 0, 1).fill_(3)),
    "select-fill_": _positions_written(lambda p: torch.select(p, 0, 2).fill_(9)),
    "unsqueeze-mul_": _positions_written(lambda p: torch.unsqueeze(p, 0).mul_(2)),
    "unfold-mul_": _positions_written(lambda p: p.unfold(0, 1, 1).mul_(2)),
    "diagonal-fill_": _mask_written(lambda m: torch.diagonal(m, -W - 1).fill_(True)),
    "flatten-fill_": _mask_written(lambda m: torch.flatten(m)[: W * 3].fill_(True)),
    "movedim-copy_": _mask_written(lambda m: torch.movedim(m, 0, 1).copy_(m.clone())),
    ".T-copy_": _mask_written(lambda m: m.T.copy_(m.clone())),
    ".mT-copy_": _mask_written(lambda m: m.mT.copy_(m.clone())),
}


@pytest.mark.parametrize("attend", WRITES.values(), ids=WRITES.keys())
def test_a_write_through_any_alias_keeps_sdpa(attend):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: mask ") and "written in place by" in verdict, verdict


def _padding_written_after_the_mask(q, k, v, padding):
    positions = torch.arange(q.shape[2])
    band = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    mask = band & (padding[:, None, None, :] != 0)
    padding[:, 1::2] = 0  # after the mask is built: SDPA does not see it, the op would
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_padding_written_after_the_mask_is_built_keeps_sdpa():
    compiled, capture = compiled_with_capture(_padding_written_after_the_mask)
    # Each run writes its padding: give eager and compiled their own copy.
    assert_same_as_eager(
        lambda *a: _padding_written_after_the_mask(*a, torch.ones(1, 16, dtype=torch.long)),
        lambda *a: compiled(*a, torch.ones(1, 16, dtype=torch.long)),
    )
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: mask ") and "padding_ is written in place by setitem" in verdict, verdict


def _repeat_kv(x, groups):
    """transformers' repeat_kv."""
    batch, heads, seq, dim = x.shape
    return x[:, :, None, :, :].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)


def _kv_written_after_repeat(q, k, v):
    k, v = k * 1, v * 1  # own copies the function may write
    repeated_k, repeated_v = _repeat_kv(k, 2), _repeat_kv(v, 2)
    k.mul_(2)  # SDPA reads the repeated copy, taken before this write
    positions = torch.arange(q.shape[2])
    mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, repeated_k, repeated_v, attn_mask=mask)


def test_kv_written_after_repeat_kv_is_read_repeated():
    compiled, capture = compiled_with_capture(_kv_written_after_repeat)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_same_as_eager(_kv_written_after_repeat, compiled, (q, k, v))
    assert _verdicts(capture) == ["rewritten: window (3, 0)"]
    (gm,) = capture.graphs
    (op,) = gm.graph.find_nodes(op="call_function", target=sliding_window.OP)
    assert op.args[1].target == "reshape", "the op must read the repeated key, not its written source"


def _repeat_heads(index):
    """A GQA repeat of (B, H, S, D) K/V to g * H heads, inserting the group axis by ``index``."""

    def attend(q, k, v):
        batch, heads, seq, dim = k.shape
        groups = q.shape[1] // heads

        def repeat(x):
            return x[index].expand(batch, heads, groups, seq, dim).reshape(batch, heads * groups, seq, dim)

        positions = torch.arange(seq)
        mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)

    return attend


@pytest.mark.parametrize(
    "index",
    [
        (slice(None), slice(None), None, slice(None), slice(None)),
        (slice(None), slice(None), None),
        (slice(None), slice(None), None, slice(None)),
    ],
    ids=["x[:, :, None, :, :]", "x[:, :, None]", "x[:, :, None, :]"],
)
def test_kv_repeated_per_kv_head_is_read_before_the_repeat(index):
    """Head h * g + m of the repeat is source head h, whether the trailing dimensions are
    spelled out or not: the op reads the source and repeats nothing."""
    attend = _repeat_heads(index)
    compiled, capture = compiled_with_capture(attend)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_same_as_eager(attend, compiled, (q, k, v))
    (gm,) = capture.graphs
    (op,) = gm.graph.find_nodes(op="call_function", target=sliding_window.OP)
    assert [node.op for node in op.args[1:3]] == ["placeholder", "placeholder"]


def test_kv_repeated_group_major_is_read_repeated():
    """``x[:, None]`` makes head m * H + h from source head h: not the op's convention, so
    the op reads the repeated copy (the shapes of the expand do not match either)."""

    def attend(q, k, v):
        batch, heads, seq, dim = k.shape
        groups = q.shape[1] // heads

        def repeat(x):
            return x[:, None].expand(batch, groups, heads, seq, dim).reshape(batch, heads * groups, seq, dim)

        positions = torch.arange(seq)
        mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
        return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)

    compiled, capture = compiled_with_capture(attend)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_same_as_eager(attend, compiled, (q, k, v))
    (gm,) = capture.graphs
    (op,) = gm.graph.find_nodes(op="call_function", target=sliding_window.OP)
    assert op.args[1].target == "reshape"


# -- 3. slices whose start has an unknown sign ------------------------------------------------


def _slice_from_a_symbolic_start(q, k, v):
    """``arange(2L)[L - 3:]`` reads L - 3, L - 2, ...: the proof may not read the start as
    counted from the end (-3 + 2L) because its sign is unknown. Truly, the first term is
    kv > q - 2L - W: always true, so the mask is plain causal."""
    length = q.shape[2]
    shifted = torch.arange(2 * length)[length - 3 :][:length]
    positions = torch.arange(length)
    mask = (positions[None, :] > shifted[:, None] - 3 * length + 3 - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_slice_start_of_unknown_sign_is_not_counted_from_the_end():
    compiled, capture = compiled_with_capture(_slice_from_a_symbolic_start)
    for length in (16, 9, 23):  # the second length recompiles with a symbolic length
        assert_same_as_eager(_slice_from_a_symbolic_start, compiled, qkv(length))
    (dynamic,) = _verdicts(capture)
    # At length 16 the start is 13 and the band (35, 0): every key lies in the window, so
    # the sliding rule leaves it to the causal rule (plain causal at this static length).
    assert _verdicts(capture, "causal_mask") == ["rewritten: plain causal mask -> is_causal=True"]
    # Dynamo guarded on the start's sign while tracing (L >= 3), so the start is read as it is,
    # and the bound, kv > q - 2L - 4, depends on L: kept.
    assert dynamic == "kept: mask term kv > q - 2*s0 - 4 depends on sizes (s0)", dynamic


# -- 4. arguments by keyword ----------------------------------------------------------------


def _fill_by_keyword(q, k, v):
    scores = q @ k.transpose(-1, -2)
    mask = ~torch.ones_like(scores, dtype=torch.bool)
    return scores.masked_fill(mask=mask, value=0.0) @ v


def _topk_by_keyword(q, k, v):
    bias = q @ k.transpose(-1, -2)
    indices = torch.topk(input=bias, k=3).indices
    keep = torch.zeros_like(bias).scatter(-1, indices, value=1.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(keep == 0, -1e9))


def _sdpa_by_keyword(q, k, v):
    positions = torch.arange(q.shape[2])
    mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask, scale=0.5)


@pytest.mark.parametrize(
    ("attend", "rule", "verdicts"),
    [
        (_fill_by_keyword, "topk_mask", ["rewritten: masked_fill with an all-false mask removed"]),
        (_topk_by_keyword, "topk_mask", ["rewritten: top-k of the detached input; float active mask -> bool scatter"]),
        (_sdpa_by_keyword, "sliding_window", ["rewritten: window (3, 0)"]),
    ],
    ids=["masked_fill(mask=, value=)", "topk(input=, k=), scatter(value=)", "sdpa(query=, key=, value=)"],
)
def test_arguments_by_keyword(attend, rule, verdicts):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert _verdicts(capture, rule) == verdicts


# -- 5. the op's preconditions, checked before rewriting ---------------------------------------


def _banded(q, k, v):
    positions = torch.arange(q.shape[2])
    mask = (positions[None, :] > positions[:, None] - W) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _segment_read_as_padding(q, k, v, positions):
    first = positions[:, :1] - 1
    segments = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
    idx = torch.arange(q.shape[2])
    band = (idx[None, :] > idx[:, None] - W) & (idx[None, :] <= idx[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band & (segments[:, None, None, :] != 0))


def _shapes(q_shape, kv_shape, v_dim=None):
    gen = torch.Generator().manual_seed(0)
    make = lambda shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()  # noqa: E731
    v_shape = (*kv_shape[:3], v_dim or kv_shape[3])
    return make(q_shape), make(kv_shape), make(v_shape)


@pytest.mark.parametrize(
    ("inputs", "verdict"),
    [
        (
            _shapes((1, 2, 16, 8), (1, 2, 16, 8), v_dim=16),
            "kept: value head_dim 16 is wider than query and key's 8 (the op zero-pads a narrower value only)",
        ),
        (_shapes((1, 1, 16, 8), (1, 2, 16, 8)), "kept: 1 query heads are not a multiple of 2 key/value heads"),
        (_shapes((2, 2, 16, 8), (1, 2, 16, 8)), "kept: key/value batch differs from query's (broadcast)"),
    ],
    ids=["wider-value-head-dim", "one-query-head-two-kv-heads", "kv-batch-broadcast"],
)
def test_calls_the_op_cannot_compute_keep_sdpa(inputs, verdict):
    compiled, capture = compiled_with_capture(_banded)
    assert_same_as_eager(_banded, compiled, inputs)
    assert _verdicts(capture) == [verdict]


def test_segment_ids_read_like_a_padding_keep_sdpa():
    compiled, capture = compiled_with_capture(_segment_read_as_padding)
    positions = torch.cat([torch.arange(4), torch.arange(12)])[None].repeat(2, 1)  # two segments: ids 0 and 1
    assert_same_as_eager(
        lambda *a: _segment_read_as_padding(*a, positions), lambda *a: compiled(*a, positions), qkv(batch=2)
    )
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: mask depends on input positions, even with input positions checked"), verdict


def test_an_exception_inside_a_rule_keeps_the_call_and_warns(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(sliding_window, "mask_band", broken)
    compiled, capture = compiled_with_capture(_banded)
    with caplog.at_level(logging.WARNING, logger="compile_pass"):
        assert_same_as_eager(_banded, compiled)
    assert _verdicts(capture) == ["kept: internal error: RuntimeError: boom"]
    assert "internal error: RuntimeError: boom" in caplog.text
    (gm,) = capture.graphs
    assert gm.graph.find_nodes(op="call_function", target=torch._C._nn.scaled_dot_product_attention)


def _out_of_order(replace):
    """``replace``, then a node inserted first that reads the graph's result: a graph that
    fails its check."""

    def out_of_order(plan, context):
        dead = replace(plan, context)
        graph = plan.site.node.graph
        output = graph.output_node()
        with graph.inserting_before(next(iter(graph.nodes))):
            graph.call_function(torch.neg, (output.args[0],))  # reads the result before it exists
        return dead

    return out_of_order


def test_a_rewritten_graph_that_fails_its_check_is_restored_and_warns(monkeypatch, caplog):
    """A replacement that leaves the graph invalid (a node read before it is defined, as a
    checkpoint body's op once was handed) must not break the compile: every graph is put back
    as it was, each rewrite reported kept, with a warning."""
    monkeypatch.setattr(sliding_window, "replace", _out_of_order(sliding_window.replace))
    compiled, capture = compiled_with_capture(_banded)
    with caplog.at_level(logging.WARNING, logger="compile_pass"):
        assert_same_as_eager(_banded, compiled)
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: internal error: the rewritten graph failed its check (RuntimeError"), verdict
    assert "the rewritten graph failed its check" in caplog.text
    (gm,) = capture.graphs
    assert gm.graph.find_nodes(op="call_function", target=torch._C._nn.scaled_dot_product_attention)
    assert not gm.graph.find_nodes(op="call_function", target=torch.neg)


def test_the_restored_graph_compiles_with_inductor(monkeypatch):
    """The graphs put back keep what AOTAutograd reads of Dynamo's placeholders (the source
    Dynamo sets on each), so the fallback compiles as plain inductor does."""
    monkeypatch.setattr(sliding_window, "replace", _out_of_order(sliding_window.replace))
    torch._dynamo.reset()
    with compile_pass.decisions() as report:
        compiled = torch.compile(_banded, backend="compile_pass", fullgraph=True)
        assert_same_as_eager(_banded, compiled)
    (decision,) = report
    assert decision.verdict.startswith("kept: internal error: the rewritten graph failed its check"), decision.verdict


# -- 7. the top-k rule ---------------------------------------------------------------------


def _active_mask(active_value, *, dtype=None, reduce=None, write_zero=False):
    def attend(q, k, v):
        bias = q @ k.transpose(-1, -2)
        zeros = torch.zeros_like(bias, dtype=dtype or bias.dtype)
        if write_zero:
            zeros[..., 0] = 5
        indices = torch.topk(bias, 3, dim=-1).indices
        extra = {"reduce": reduce} if reduce else {}
        active = zeros.scatter(-1, indices, active_value, **extra)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(active == 0, -1e9))

    return attend


TOPK_CASES = {
    "1e-50-rounds-to-0-in-fp32": (_active_mask(1e-50, dtype=torch.float32), "rewritten: top-k of the detached input"),
    "0.5-truncates-to-0-in-int64": (_active_mask(0.5, dtype=torch.int64), "rewritten: top-k of the detached input"),
    "reduce-multiply": (_active_mask(1.0, reduce="multiply"), "kept: active scatters with reduce='multiply'"),
    "zero-mask-written": (
        _active_mask(1.0, write_zero=True),
        "kept: the zero mask of active may be written: zeros is written in place by setitem",
    ),
}


@pytest.mark.parametrize(("attend", "verdict"), TOPK_CASES.values(), ids=TOPK_CASES.keys())
def test_topk_active_masks_the_rule_must_not_turn_into_bool(attend, verdict):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert _verdicts(capture, "topk_mask") == [verdict]
    (gm,) = capture.graphs
    assert "== 0" in gm.code, "the float active mask must stay"


def _fill_that_broadcasts(q, k, v):
    scores = q @ k.transpose(-1, -2)
    row = scores[0, 0, 0]  # (S,)
    widened = row.masked_fill(~torch.ones_like(scores[0, 0], dtype=torch.bool), 0.0)  # (S, S)
    return (scores + widened) @ v


def _fill_with_an_overflowing_mask(q, k, v):
    scores = q @ k.transpose(-1, -2)
    positions = torch.arange(q.shape[2])
    never_negative_unless_it_wraps = (positions * 2**62)[None, :] < 0  # wraps from position 2 on
    return scores.masked_fill(never_negative_unless_it_wraps, 0.0) @ v


@pytest.mark.parametrize(
    ("attend", "verdicts"),
    [
        (_fill_that_broadcasts, ["kept: masked_fill with an all-false mask broadcasts its input"]),
        (_fill_with_an_overflowing_mask, []),
    ],
    ids=["broadcasting", "overflowing-formula"],
)
def test_fills_that_are_not_no_ops_stay(attend, verdicts):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert _verdicts(capture, "topk_mask") == verdicts
    (gm,) = capture.graphs
    assert "masked_fill" in gm.code


def test_a_fill_value_that_is_a_tensor_keeps_the_fill():
    """``x.masked_fill(all-false, v)`` with a tensor ``v`` that requires grad: eager's result
    requires grad (v's gradient is 0); returning ``x`` instead would cut v from the graph."""

    def scale_by_fill(q, k, v, fill):
        scores = q @ k.transpose(-1, -2)
        kept = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool), fill)
        return kept @ v

    q, k, v = qkv()
    fill = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    compiled, capture = compiled_with_capture(scale_by_fill)
    out = compiled(q, k, v, fill)
    grads = torch.autograd.grad(out.sum(), (q, k, v, fill))
    ref = scale_by_fill(q, k, v, fill)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v, fill))
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert _verdicts(capture, "topk_mask") == [
        "kept: masked_fill with an all-false mask, but its fill value is a tensor"
    ]


def test_a_fill_of_a_strided_input_keeps_the_fill():
    """masked_fill returns a new, contiguous tensor for a non-dense input (a slice): a view
    of the result that eager allows fails on the input's strides."""

    def view_of_fill(q, k, v):
        scores = (q @ k.transpose(-1, -2))[..., :8]  # (1, 2, 16, 8): not dense
        kept = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool), 0.0)
        return kept.view(1, 2, 128).sum(-1, keepdim=True).unsqueeze(-1) * v

    compiled, capture = compiled_with_capture(view_of_fill)
    assert_same_as_eager(view_of_fill, compiled)
    assert _verdicts(capture, "topk_mask") == [
        "kept: masked_fill with an all-false mask, but its input's strides are not the result's"
    ]


def _band_then_view(q, k, v, mask=None):
    """SDPA with a band mask (built here, or given), then a view that needs SDPA's layout."""
    if mask is None:
        i = torch.arange(q.shape[2])
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(out.shape[0], -1)[:, None, :, None]


@pytest.mark.parametrize("rule", ["sliding_window", "mask_input"])
def test_the_op_returns_sdpa_layout(rule):
    """SDPA's result is laid out like a (batch, heads, seq, dim)-contiguous query, so a view
    that eager allows must work on the op's result too (it is stored heads-last)."""
    q, k, v = qkv()
    assert q.is_contiguous()
    if rule == "sliding_window":
        attend, inputs = _band_then_view, (q, k, v)
    else:
        i = torch.arange(q.shape[2])
        mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W))[None, None]

        def attend(q, k, v):
            return _band_then_view(q, k, v, mask)

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled, inputs=inputs if rule == "sliding_window" else None)
    assert [v.split(":")[0] for v in _verdicts(capture, rule)] == ["rewritten"], _all_verdicts(capture)


# -- never slower ---------------------------------------------------------------------------


def test_a_device_where_the_op_has_no_fast_kernel_keeps_sdpa(monkeypatch):
    """Asked as if the call ran on CUDA with no GPU there (and fp64, which FA2 does not take):
    the op would run the chunked kernel's unfused fallback, so SDPA stays, with the reasons."""
    ask_as_if_on_cuda(monkeypatch)
    compiled, capture = compiled_with_capture(_banded)
    assert_same_as_eager(_banded, compiled)
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: mask is window (3, 0), but no kernel is exact and as fast as SDPA here: "), verdict
    assert "chunked: on cuda the chunked kernel runs an unfused matmul/softmax, slower than SDPA" in verdict, verdict
    assert verdict.endswith("; slow_kernels=True rewrites anyway"), verdict


def test_slow_kernels_forces_the_rewrite_by_every_way_in(monkeypatch):
    """The same call as above with the setting: rewritten by the backend (callable and name),
    by enable() and by rewrite(), and still exact (the op runs here, on the CPU)."""
    import compile_pass

    ask_as_if_on_cuda(monkeypatch)
    forced = "rewritten: window (3, 0)"
    compiled, capture = compiled_with_capture(_banded, slow_kernels=True)
    assert_same_as_eager(_banded, compiled)
    assert _verdicts(capture) == [forced]
    for way_in in ("backend", "enable"):
        torch._dynamo.reset()
        with compile_pass.decisions() as report:
            if way_in == "backend":
                compiled = torch.compile(_banded, backend="compile_pass", options={"slow_kernels": True})
                compiled(*qkv())
            else:
                # fx_graph_cache off: a hit from an earlier run would skip the pass.
                with torch._inductor.config.patch(fx_graph_cache=False), compile_pass.enable(slow_kernels=True):
                    compiled = torch.compile(_banded)
                    compiled(*qkv())
        assert [d.verdict for d in report] == [forced], way_in
    torch._dynamo.reset()


def test_a_bound_beyond_every_distance_is_no_bound():
    """kv - q >= -2**63 holds for all positions: the window's left side is unbounded, not a
    number the op's int64 window argument cannot hold (found by the long fuzzer run)."""
    attend = _band_of(lambda d: torch.ge(d, -(2**63)))
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert [d.verdict for d in capture.report] == ["rewritten: plain causal mask -> is_causal=True"]


# -- found by an adversarial review after the fuzzer's classes were fixed -------------------


def _all_verdicts(capture):
    return [d.verdict for report in capture.reports for d in report]


def _full_then(band_op, write):
    """A -inf filled tensor, written in place, then triu/tril'd into an additive mask."""

    def attend(q, k, v):
        filled = torch.full((q.shape[2], q.shape[2]), float("-inf"), dtype=q.dtype)
        write(filled)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band_op(filled))

    return attend


@pytest.mark.parametrize(
    "attend",
    [
        # Every query also sees keys 0..3: reads as plain causal without the write.
        _full_then(lambda m: m.triu(1), lambda m: m[:, :4].fill_(0.0)),
        # Key 0 visible to every query: reads as window (3, -1) without the write.
        _full_then(lambda m: m.tril(-4), lambda m: m[:, 0].fill_(0.0)),
    ],
    ids=["triu-causal", "tril-window"],
)
def test_a_write_to_the_filled_tensor_behind_triu_or_tril_keeps_sdpa(attend):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    verdicts = _all_verdicts(capture)
    assert verdicts and not any(v.startswith("rewritten") for v in verdicts), verdicts


def test_two_cumsums_over_one_input_are_two_segment_ids():
    """Two segment-id tensors built from the same positions, one of them written: each is
    its own function, so seg_a(q) == seg_b(kv) is not 'the same packed sequence'."""

    def attend(q, k, v, positions):
        difference = torch.diff(positions, prepend=positions[:, :1] - 1)
        starts_a, starts_b = difference != 1, difference != 1
        starts_b[:, 6] = True
        seg_a, seg_b = starts_a.cumsum(-1), starts_b.cumsum(-1)
        i = torch.arange(q.shape[2])
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        mask = band[None, None] & (seg_a[:, None, :, None] == seg_b[:, None, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(seq=12, batch=2)
    positions = torch.arange(12)[None].repeat(2, 1)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, positions), lambda *a: compiled(*a, positions), inputs=(q, k, v))
    assert not any(v.startswith("rewritten") for v in _verdicts(capture)), _verdicts(capture)


def test_opaque_values_of_a_checkpoint_body_and_its_parent_are_two_functions():
    """Node names restart in a checkpoint body: the body's opaque ``x`` and the parent's are
    different values, so x_body(kv) == x_parent(kv) is not always true."""
    from torch.utils.checkpoint import checkpoint

    def body(q, k, v, x_parent):
        x = torch.arange(q.shape[2]) % 2  # opaque to the proof (mod)
        i = torch.arange(q.shape[2])
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band & (x_parent[None, :] == x[None, :]))

    def attend(q, k, v):
        x = torch.arange(q.shape[2]) % 3  # same node name in the parent graph
        return checkpoint(body, q, k, v, x, use_reentrant=False)

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled, inputs=qkv(seq=12))
    assert not any(v.startswith("rewritten") for v in _verdicts(capture)), _verdicts(capture)


def test_two_inputs_shown_by_one_name_are_two_functions():
    """``P`` and ``kwargs["P"]`` are both shown as input P; they are two paddings."""

    def attend(q, k, v, P, kwargs):
        i = torch.arange(q.shape[2])
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        mask = band[None, None] & (kwargs["P"][:, None, None, :] != 0) & (P[:, None, None, :] != 0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(seq=12, batch=2)
    ones = torch.ones(2, 12, dtype=torch.long)
    holes = ones.clone()
    holes[:, [5, 9]] = 0
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(
        lambda *a: attend(*a, ones, {"P": holes}), lambda *a: compiled(*a, ones, {"P": holes}), inputs=(q, k, v)
    )
    assert _verdicts(capture) == ["kept: mask depends on inputs P, P#2 (several key paddings)"]


def test_a_python_int_is_not_a_size():
    """With dynamic=True an int argument is a SymInt; a branch makes it nonnegative, which
    does not bound it below 2**31: arange(S) + offset wraps for offset near 2**63."""

    def attend(q, k, v, offset: int):
        if offset < 0:
            offset = 0
        positions = torch.arange(q.shape[2]) + offset
        mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    _, capture = compiled_with_capture(attend)
    compiled = torch.compile(attend, backend=capture, dynamic=True, fullgraph=True)
    offset = 2**63 - 8
    assert_same_as_eager(lambda *a: attend(*a, offset), lambda *a: compiled(*a, offset))
    (verdict,) = _verdicts(capture)
    assert verdict.startswith("kept: mask add (positions) may overflow int64"), verdict


def test_a_float16_mask_filled_with_its_finite_minimum_is_kept():
    """-65504 does not hide a key whose score is above it by more than fp16's range: eager
    attends to it (scores are computed in fp32), the op would not."""
    seq, window = 8, 2

    def attend(q, k, v):
        i = torch.arange(q.shape[2])
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        mask = torch.zeros(q.shape[2], q.shape[2], dtype=q.dtype).masked_fill(~band, torch.finfo(torch.float16).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.full((1, 1, seq, 8), 200.0, dtype=torch.float16)
    k = torch.full((1, 1, seq, 8), -200.0, dtype=torch.float16)
    k[..., 0, :] = 0
    v = torch.arange(seq, dtype=torch.float16)[None, None, :, None].expand(1, 1, seq, 8).contiguous()
    compiled, capture = compiled_with_capture(attend)
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
    assert not any(v.startswith("rewritten") for v in _all_verdicts(capture)), _all_verdicts(capture)


def _packed_ids_before_a_checkpoint(q, k, v, positions):
    """Packed ids computed before a checkpointed body that builds the window over positions
    itself: its recomputation reads the positions again, as written, against the ids of before."""
    first = positions[:, :1] - 1
    ids = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)

    def body(q, k, v, positions, ids):
        same = ids[:, None, :, None] == ids[:, None, None, :]
        pq, pk = positions[:, None, :, None], positions[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (pk <= pq) & (pk > pq - 4))

    return torch.utils.checkpoint.checkpoint(body, q, k, v, positions, ids, use_reentrant=False)


def test_packed_ids_made_before_a_checkpoint_meet_the_positions_it_reads_again():
    compiled, capture = compiled_with_capture(_packed_ids_before_a_checkpoint)

    def gradients(fn):
        q, k, v = qkv(batch=2)
        positions = torch.cat([torch.arange(10), torch.arange(6)]).repeat(2, 1)
        out = fn(q, k, v, positions)
        positions.numpy()[:] = positions.numpy()[:, ::-1]  # still in range: the check passes
        return torch.autograd.grad(out.sum(), (q, k, v))

    for ours, eager in zip(gradients(compiled), gradients(_packed_ids_before_a_checkpoint), strict=True):
        torch.testing.assert_close(ours, eager, atol=1e-12, rtol=0)
    (verdict,) = [d.verdict for d in capture.report]
    assert verdict.startswith("kept: mask is window (3, 0), packed sequences from positions"), verdict
    assert verdict.endswith("again in the backward"), verdict
