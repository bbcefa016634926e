"""Other spellings of the same band: float factories holding exact small integers behind
tril/triu and comparisons, dtype round trips, and the float values the proof must refuse
(they round, or are not integers)."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 4
BAND = f"rewritten: window ({W - 1}, 0)"


def _ones(q):
    return torch.ones(q.shape[2], q.shape[2], device=q.device)


def _tril_of_float_ones(q, k, v):
    """``torch.tril(torch.ones(S, S)).bool()``, the textbook causal mask, with a window cut by triu."""
    ones = _ones(q)
    mask = torch.tril(ones).bool() & torch.triu(ones, diagonal=-(W - 1)).bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _float_positions(q, k, v):
    positions = torch.arange(q.shape[2], device=q.device).float()
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) & (kv_idx > q_idx - W))


def _compared_with_zero(q, k, v):
    """A float 0/1 band compared with 0, the way code turns it into a fill condition."""
    ones = _ones(q)
    band = torch.tril(ones) * torch.triu(ones, diagonal=-(W - 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~(band == 0))


def _additive_from_float_ones(q, k, v):
    """0 on the band, -inf elsewhere, filled where the float 0/1 band is 0."""
    ones = _ones(q)
    outside = (torch.tril(ones) * torch.triu(ones, diagonal=-(W - 1))) == 0
    additive = torch.zeros(q.shape[2], q.shape[2], device=q.device, dtype=q.dtype).masked_fill(outside, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


def _through_int_and_back(q, k, v):
    positions = torch.arange(q.shape[2], device=q.device)
    mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.int().to(torch.int64).bool())


def _through_half_and_back(q, k, v):
    positions = torch.arange(q.shape[2], device=q.device)
    mask = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.half().bool())


@pytest.mark.parametrize(
    "fn",
    [
        _tril_of_float_ones,
        _float_positions,
        _compared_with_zero,
        _additive_from_float_ones,
        _through_int_and_back,
        _through_half_and_back,
    ],
)
def test_float_and_cast_spellings_of_the_band_are_rewritten(fn):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=16))
    (decision,) = capture.report
    assert decision.verdict.startswith(BAND), decision.verdict


def _band_of_positions(positions):
    return (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)


# Copies and casts in their other spellings: a detached or aliased band, aten's clone and
# _to_copy, type_as an int tensor, Tensor.to's aten overloads.
COPY_SPELLINGS = {
    ".detach()": lambda p: _band_of_positions(p).detach(),
    "torch.detach": lambda p: torch.detach(_band_of_positions(p)),
    "aten.clone": lambda p: torch.ops.aten.clone.default(_band_of_positions(p)),
    "aten.alias": lambda p: torch.ops.aten.alias.default(_band_of_positions(p)),
    "aten.contiguous": lambda p: torch.ops.aten.contiguous.default(_band_of_positions(p)),
    ".type_as(int32)": lambda p: _band_of_positions(p.type_as(torch.zeros(1, dtype=torch.int32))),
    "aten._to_copy(int32)": lambda p: _band_of_positions(torch.ops.aten._to_copy.default(p, dtype=torch.int32)),
    "aten.to.dtype(int32)": lambda p: _band_of_positions(torch.ops.aten.to.dtype(p, torch.int32)),
}


@pytest.mark.parametrize("spelling", COPY_SPELLINGS.values(), ids=COPY_SPELLINGS.keys())
def test_copies_and_casts_in_aten_spellings_keep_the_band(spelling):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=spelling(torch.arange(q.shape[2], device=q.device)))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled, qkv(seq=16))
    assert [d.verdict for d in capture.report] == [BAND]


def _bf16_positions_that_round(q, k, v):
    """bfloat16 holds integers exactly only up to 256: arange(300) rounds, and positions 257
    and 256 compare equal."""
    positions = torch.arange(q.shape[2], device=q.device, dtype=torch.bfloat16)
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) & (kv_idx > q_idx - W))


def _half_steps(q, k, v):
    positions = torch.arange(q.shape[2], device=q.device) * 0.5
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) & (kv_idx > q_idx - W))


def _fp16_sum_that_rounds(q, k, v):
    """Each factor is exact in float16, the products up to 1024 * 15 are not (past 2**11)."""
    positions = torch.arange(q.shape[2], device=q.device, dtype=torch.float16) * 1024
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) & (kv_idx > q_idx - 1024))


@pytest.mark.parametrize(
    ("fn", "seq", "verdict"),
    [
        (_bf16_positions_that_round, 300, "kept: mask arange (positions) may round in bfloat16"),
        (_half_steps, 16, "kept: mask operand 0.5 is not an integer"),
        (_fp16_sum_that_rounds, 16, "kept: mask mul (positions) may round in float16"),
    ],
    ids=["bf16-beyond-256", "half-steps", "fp16-product"],
)
def test_floats_that_round_or_are_not_integers_are_not_read_as_positions(fn, seq, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=seq))
    (decision,) = capture.report
    assert decision.verdict.startswith(verdict), decision.verdict


# -- type promotion: torch computes each comparison and sum in one dtype (found by review) ------


def _int64_plus_float32_that_cancels(q, k, v):
    """2**24 + 1 + p in int64 plus a float32 -2**24 is computed in float32, where 2**24 + 1 + p
    rounds: the formula p + 1 fits float32, but the operand does not."""
    shifted = torch.arange(q.shape[2]) + (2**24 + 1)
    positions = shifted + torch.full((q.shape[2],), -(2**24), dtype=torch.float32)
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv_idx <= q_idx) & (kv_idx > q_idx - W))


def _int64_compared_with_bfloat16(q, k, v):
    """kv - q + 260 > 256 in bfloat16: 257 rounds to 256."""
    positions = torch.arange(q.shape[2])
    distance = positions[None, :] - positions[:, None]
    edge = torch.full((1, 1), 256, dtype=torch.bfloat16)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance <= 0) & (distance + (256 + W) > edge))


def _int32_compared_with_a_0_dim_int64(q, k, v):
    """A 0-dim tensor takes the other operand's dtype: int64 -(2**32) - 3 is -3 in int32."""
    positions = torch.arange(q.shape[2], dtype=torch.int32)
    distance = positions[None, :] - positions[:, None]
    far = torch.full((), -(2**32) - 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance <= 0) & (distance >= -6) & (distance >= far))


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (
            _int64_plus_float32_that_cancels,
            "kept: mask add (positions) computes in float32, which may not hold its operand exactly",
        ),
        (_int64_compared_with_bfloat16, "kept: mask gt computes in bfloat16, which may not hold its operand exactly"),
        (
            _int32_compared_with_a_0_dim_int64,
            "kept: mask ge (ge_1) computes in int32, which may not hold its operand exactly",
        ),
    ],
    ids=["int64-plus-float32", "int64-vs-bfloat16", "int32-vs-0-dim-int64"],
)
def test_operands_are_read_in_the_dtype_torch_computes_in(fn, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=16))
    (decision,) = capture.report
    assert decision.verdict.startswith(verdict), decision.verdict


# -- clamps and elementwise extrema of positions -----------------------------------------------


def _indices(q):
    positions = torch.arange(q.shape[2], device=q.device)
    return positions[:, None], positions[None, :]


def _clamped_distance(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((i - j).clamp(min=0) < W) & (j <= i))


def _clamped_first_key(q, k, v):
    """The window's first key clamped at 0, as code computes a start index."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j >= torch.clamp_min(i - (W - 1), 0)) & (j <= i))


def _clamped_both_sides(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.clamp(j - i, -W, 1) > -W) & (j <= i))


def _distance_as_a_maximum(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.maximum(i - j, j - i) < W)


def _inverted_bounds(q, k, v):
    """torch gives max where min > max: (i - j).clamp(5, 2) is 2 everywhere, so the term is true."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((i - j).clamp(5, 2) <= 3) & (j <= i) & (j > i - W))


def _clamped_above_only(q, k, v):
    """clamp(max=W) < W + 1 holds for every distance: the mask is causal, no window."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((i - j).clamp(max=W) < W + 1) & (j <= i))


def _clamped_below_the_window(q, k, v):
    """clamp(min=W) < W + 1 keeps distances up to W (not W - 1): window (W, 0)."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((i - j).clamp(min=W) < W + 1) & (j <= i))


def _clamp_to_a_tensor(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((i - j).clamp(min=torch.tensor(0)) < W) & (j <= i))


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_clamped_distance, BAND),
        (_clamped_first_key, BAND),
        (_clamped_both_sides, BAND),
        (_distance_as_a_maximum, f"rewritten: window ({W - 1}, {W - 1})"),
        (_inverted_bounds, BAND),
        (_clamped_above_only, "rewritten: plain causal mask -> is_causal=True"),
        (_clamped_below_the_window, f"rewritten: window ({W}, 0)"),
        (_clamp_to_a_tensor, "kept: mask .clamp() with a bound that is not an integer constant"),
    ],
    ids=[
        "distance",
        "first-key",
        "both-sides",
        "maximum",
        "inverted-bounds",
        "above-only",
        "below-the-window",
        "tensor-bound",
    ],
)
def test_clamps_and_extrema_read_exactly(fn, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=12))
    (decision,) = [d.verdict for d in capture.report]
    assert decision == verdict or decision.startswith(verdict + " at tests/proof/test_spellings.py:"), decision


# -- boolean combinations of bounds, and casts of additive masks ---------------------------------


def _nanogpt_band(q, k, v):
    """nanoGPT's spelling: causal ones minus the ones more than W - 1 back, then ``.bool()``
    (``(d <= 0 | d <= -W) & ~(d <= 0 & d <= -W)`` over d = kv - q)."""
    ones = _ones(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.tril(ones) - torch.tril(ones, -W)).bool())


def _nanogpt_band_negated(q, k, v):
    """The difference taken the other way round is -1 on the band: still nonzero there."""
    ones = _ones(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.tril(ones, -W) - torch.tril(ones)).bool())


def _two_bands_apart(q, k, v):
    """Causal keys except W - 1 .. 1 back: two runs of keys, no band."""
    ones = _ones(q)
    mask = (torch.tril(ones) - torch.tril(ones, -1) + torch.tril(ones, -W)).bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _xor_of_bounds(q, k, v):
    """``d >= -W + 1`` XOR ``d > 0`` is the band ``-W < d <= 0``."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j - i >= -W + 1) ^ (j - i > 0))


def _causal_but_one_diagonal(q, k, v):
    """Causal keys except the one two back: two runs of keys, no band."""
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j - i <= 0) ^ (j - i == -2))


def _additive_cast_to_the_query_dtype(q, k, v):
    """A float32 0/-inf band cast to the query's dtype, as code that builds masks once does."""
    i, j = _indices(q)
    band = (j <= i) & (j > i - W)
    additive = torch.zeros(band.shape).masked_fill(~band, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


def _additive_minimum_cast_down(q, k, v):
    """float64's minimum is -inf in float32, still a fill there."""
    i, j = _indices(q)
    band = (j <= i) & (j > i - W)
    additive = torch.zeros(band.shape, dtype=torch.float64).masked_fill(~band, torch.finfo(torch.float64).min).float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=additive).double()


def _additive_bf16_minimum_cast_up(q, k, v):
    """bfloat16's minimum is a finite float32 above float32's minimum: not read as a fill."""
    i, j = _indices(q)
    band = (j <= i) & (j > i - W)
    additive = torch.zeros(band.shape, dtype=torch.bfloat16).masked_fill(~band, torch.finfo(torch.bfloat16).min).float()
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=additive).double()


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_nanogpt_band, BAND),
        (_nanogpt_band_negated, BAND),
        (_two_bands_apart, "kept: mask term"),
        (_xor_of_bounds, BAND),
        (_causal_but_one_diagonal, "kept: mask term"),
        (_additive_cast_to_the_query_dtype, BAND + " (additive mask)"),
        (_additive_minimum_cast_down, BAND + " (additive mask)"),
        (
            _additive_bf16_minimum_cast_up,
            "kept: mask (additive) cast .float() (additive) to torch.float32 turns the fill",
        ),
    ],
    ids=[
        "nanogpt",
        "nanogpt-negated",
        "two-bands",
        "xor-band",
        "xor-two-runs",
        "additive-to",
        "fp64-min-to-fp32",
        "bf16-min-to-fp32",
    ],
)
def test_boolean_combinations_and_casts_of_bounds(fn, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=12))
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith(verdict), decision
