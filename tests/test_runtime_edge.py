"""Regression tests for the edge where proven facts meet run time (issue 20): scales SDPA
computes differently by path, masks written between or during calls, tensors the op must not
hold on to. Each test compares with eager, forward and gradients, and fails on the code
before its fix."""

import math

import pytest
import torch
import torch.nn.functional as F

from compile_pass import sliding_window_attention
from tests.small_graphs import compiled_with_capture, qkv

W = 4


def _decisions(capture):
    return [(d.rule, d.verdict) for report in capture.reports for d in report]


def _band(seq, left=W - 1):
    positions = torch.arange(seq)
    distance = positions[None, :] - positions[:, None]
    return (distance <= 0) & (distance >= -left)


def _assert_matches_eager(fn, compiled, inputs, *extra):
    """Forward and gradients of q, k, v, NaN where eager has NaN."""
    out = compiled(*inputs, *extra)
    grads = torch.autograd.grad(out.nan_to_num().sum(), inputs, allow_unused=True)
    ref = fn(*inputs, *extra)
    ref_grads = torch.autograd.grad(ref.nan_to_num().sum(), inputs, allow_unused=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0, equal_nan=True)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, equal_nan=True)


# -- scales ------------------------------------------------------------------------------

SCALES = [0.0, -0.5, math.inf, math.nan]


def _sliding(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2]), scale=scale)


def _causal(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2], left=q.shape[2]), scale=scale)


@pytest.mark.parametrize("scale", SCALES, ids=["0", "negative", "inf", "nan"])
@pytest.mark.parametrize("attend", [_sliding, _causal], ids=["window", "causal"])
def test_a_scale_that_is_not_positive_and_finite_keeps_sdpa(attend, scale):
    fn = lambda q, k, v: attend(q, k, v, scale)  # noqa: E731
    compiled, capture = compiled_with_capture(fn)
    _assert_matches_eager(fn, compiled, qkv())
    decisions = _decisions(capture)
    assert decisions and all(
        verdict.startswith(f"kept: scale {scale!r} is not a positive finite number") for _, verdict in decisions
    ), decisions


@pytest.mark.parametrize("scale", SCALES, ids=["0", "negative", "inf", "nan"])
def test_a_scale_that_is_not_positive_and_finite_keeps_sdpa_for_a_mask_input(scale):
    fn = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # noqa: E731
    compiled, capture = compiled_with_capture(fn)
    _assert_matches_eager(fn, compiled, qkv(), _band(16)[None, None])
    (decision,) = capture.report
    assert not decision.rewritten and "mask_input" in decision.rules
    assert decision.reasons == (f"scale {scale!r} is not a positive finite number",), decision.reasons


@pytest.mark.parametrize("scale", SCALES, ids=["0", "negative", "inf", "nan"])
def test_the_op_refuses_a_scale_that_is_not_positive_and_finite(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        sliding_window_attention(q, k, v, window=(W - 1, 0), scale=scale)
