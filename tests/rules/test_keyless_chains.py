"""Attention spelled out in ops whose rows may see no key (left padding, a window past the
padding, a row of padding alone): with an additive mask of a finite fill each such row's
softmax is uniform, and the rule hands the op the bound below which the fill hides every score
alike (``keyless_mean``, ``ops/keyless_rows.py``); the op then computes what the chain does,
forward and every gradient, every row. A fill that is -inf somewhere on the way, or that
replaces the scores instead of being added to them, keeps the chain with the step named.
The families: Gemma-2 and VaultGemma (soft-capped, eager only), padded, with a loss over every
position (the padded rows' outputs included)."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from compile_pass.rules.sliding_window import OP
from tests.helpers.models import Capture, assert_close_scaled, count_calls, every_position_loss_and_grads, token_batch
from tests.helpers.small_graphs import compiled_with_capture, qkv
from tests.rules.test_spelled_softcap import COMMON, GEMMAS  # the soft-capped families as built there

W = 4
FILL = torch.finfo(torch.float64).min
CAP = 2.0


def _visible(q, padding):
    positions = torch.arange(q.shape[2])
    band = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    return band & padding[:, None, None, :]


def added(q, k, v, padding):
    """transformers' eager attention: scores plus a 0 / fill mask, softmax, @ v."""
    mask = torch.where(_visible(q, padding), torch.zeros((), dtype=q.dtype), FILL)
    w = torch.matmul(q, k.transpose(2, 3)) * 0.5 + mask
    return torch.matmul(F.softmax(w, dim=-1), v)


def added_capped(q, k, v, padding):
    w = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.5 / CAP) * CAP
    return torch.matmul(
        F.softmax(w + torch.where(_visible(q, padding), torch.zeros((), dtype=q.dtype), FILL), dim=-1), v
    )


def added_infinite(q, k, v, padding):
    mask = torch.zeros((), dtype=q.dtype).masked_fill(~_visible(q, padding), float("-inf"))
    return torch.matmul(F.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.5 + mask, dim=-1), v)


def filled_in(q, k, v, padding):
    """The fill in place of the scores: a row without keys has no gradient into them."""
    w = (torch.matmul(q, k.transpose(2, 3)) * 0.5).masked_fill(~_visible(q, padding), FILL)
    return torch.matmul(F.softmax(w, dim=-1), v)


def _padding():
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[0, :5] = False  # left padding: rows 0-4 see no key
    padding[1, 6:] = False  # right padding: rows 9.. are past the window's reach
    return padding


def _assert_exact(fn, compiled, padding):
    q, k, v = qkv(seq=16, batch=2)
    q = (q.detach() * 3).requires_grad_()  # scores past the cap
    out, ref = compiled(q, k, v, padding), fn(q, k, v, padding)
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)
    keyless = ~_visible(q, padding).any(-1)  # (2, 1, 16)
    assert keyless[0, 0, :5].all() and keyless[1, 0, 9:].all()
    return grads


@pytest.mark.parametrize(("fn", "cap"), [(added, ""), (added_capped, ", soft-capped scores (cap 2)")])
def test_rows_without_keys_become_the_op_exactly(fn, cap):
    compiled, capture = compiled_with_capture(fn)
    dq, _, _ = _assert_exact(fn, compiled, _padding())
    assert dq[0, :, :5].abs().amax() > 0  # the mean's gradient reaches q, as the chain's does
    (decision,) = capture.report
    assert decision.verdict == (
        "rewritten: attention spelled out in ops: window (3, 0) (additive mask), key padding from padding, rows "
        f"without a visible key the mean of the values{cap}"
    )
    (graph,) = capture.graphs
    assert count_calls(graph, OP) == 1 and count_calls(graph, F.softmax) == 0


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (added_infinite, "the softmax of an -inf fill (NaN) where the op gives 0"),
        (filled_in, "the mean of the values with no gradient into their scores (the fill replaces them)"),
    ],
    ids=["-inf fill", "fill in place of the scores"],
)
def test_rows_the_op_cannot_give_what_the_chain_does_keep_it(fn, why):
    compiled, capture = compiled_with_capture(fn)
    padding = _padding()
    q, k, v = qkv(seq=16, batch=2)
    torch.testing.assert_close(compiled(q, k, v, padding), fn(q, k, v, padding), equal_nan=True)
    (decision,) = capture.report
    assert decision.verdict.startswith("kept: attention spelled out in ops: mask is window (3, 0)")
    assert f"but the chain gives rows without a visible key {why}" in decision.verdict


def test_a_fill_that_is_not_finite_in_the_chains_dtype_is_kept():
    """A float32 mask of float32's minimum added to bfloat16 scores: that fill is -inf in
    bfloat16, a dtype the sum may be computed in, so the rows are not proven uniform."""

    def mixed(q, k, v, padding):
        mask = torch.where(_visible(q, padding), 0.0, torch.finfo(torch.float32).min).float()
        w = torch.matmul(q, k.transpose(2, 3)) * 0.5 + mask
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)

    compiled, capture = compiled_with_capture(mixed)
    q, k, v = (x.detach().bfloat16() for x in qkv(seq=16, batch=2))
    compiled(q, k, v, _padding())
    (decision,) = capture.report
    assert "that is not finite in each of bfloat16, float32" in decision.verdict, decision.verdict


@pytest.mark.parametrize("family", list(GEMMAS))
def test_padded_soft_capped_families_train_on_the_op(family):
    """Left and right padding, every attention layer on the op, loss and every gradient as eager
    fp32 (eager fp64 reads no chain: its softmax narrows to float32, where the fill is -inf)."""
    config_class, extra = GEMMAS[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**COMMON, **extra, sliding_window=W, attn_logit_softcapping=5.0)
    )
    ids = token_batch(12)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[0, :5] = 0
    padding[1, 7:] = 0
    torch._dynamo.reset()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    loss, grads = every_position_loss_and_grads(compiled, input_ids=ids, attention_mask=padding)
    decisions = [d for report in capture.reports for d in report]
    assert len(decisions) == 2 and all(d.rewritten for d in decisions), [d.verdict for d in decisions]
    assert all("rows without a visible key the mean of the values" in d.reason for d in decisions)
    ref_loss, ref_grads = every_position_loss_and_grads(model, input_ids=ids, attention_mask=padding)
    assert_close_scaled(loss, ref_loss, "loss")
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], name)
