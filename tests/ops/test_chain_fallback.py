"""The checked op's fallback for attention spelled out in ops (``ops/chain.py``): where the band
path does not run, ``mask_input_attention_forward(..., chain=True)`` computes the chain itself,
soft-capped scores plus a float mask, or with a bool mask's hidden scores replaced by the
chain's fill, against the fp64 chain: the output and every gradient, every row, rows that see
no key included (a finite fill's mean, with the gradient into q and k an added mask gives and
none where the fill replaces the scores; an -inf fill's NaN)."""

import pytest
import torch

from compile_pass.ops import runtime_mask
from tests.helpers.attention_reference import forward_and_grads, random_qkv

FILL = torch.finfo(torch.float32).min
NOT_A_BAND = torch.tensor([0, 0, 0, 0], dtype=torch.int64)  # the facts of a mask the check refused


def _visible(batch, seq):
    """A sliding band whose first rows of batch 1 see no key."""
    positions = torch.arange(seq)
    band = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 4)
    visible = band.expand(batch, 1, seq, seq).clone()
    if batch > 1:
        visible[1, :, :3] = False
    return visible


def _chain(q, k, v, mask, softcap, fill=None):
    """The chain in fp64, as transformers' eager attention spells it."""
    scores = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).mT) * 0.25
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + mask if mask.is_floating_point() else torch.where(mask, scores, fill)
    return torch.softmax(scores, dim=-1) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["uncapped", "capped"])
@pytest.mark.parametrize("form", ["added", "filled"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fallback_is_the_chain(form, softcap, dtype):
    q, k, v = random_qkv(2, 4, 2, 16, 16, 8, dtype)
    visible = _visible(2, 16)
    mask = torch.where(visible, 0.0, FILL).to(dtype) if form == "added" else visible
    fill = FILL if form == "filled" else None
    padding = torch.ones(2, 16, dtype=torch.bool)

    def op(q, k, v):
        out, *_ = runtime_mask.mask_input_attention_forward(
            q, k, v, mask, NOT_A_BAND, padding, 0.25, False, None, False, None, softcap, True, fill
        )
        return out

    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = forward_and_grads(op, (q, k, v), grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_mask = mask.double() if form == "added" else mask
    ref_out, ref_grads = forward_and_grads(lambda *x: _chain(*x, ref_mask, softcap, fill), ref_inputs, grad_out)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        torch.testing.assert_close(a.double(), b, atol=tolerance, rtol=tolerance, msg=name)
    mean = v[1].detach().double().mean(dim=1).repeat_interleave(2, 0)  # (heads, D)
    torch.testing.assert_close(out[1, :, :3].double(), mean[:, None].expand(-1, 3, -1), atol=1e-5, rtol=1e-5)
    if form == "filled":  # the fill replaced those rows' scores: no gradient reaches q there
        assert (grads[0][1, :, :3] == 0).all()
    else:
        assert grads[0][1, :, :3].abs().amax() > 0


def test_an_infinite_fill_gives_the_chains_nan():
    q, k, v = random_qkv(2, 4, 2, 16, 16, 8, torch.float64)
    with torch.no_grad():
        out, *_ = runtime_mask.mask_input_attention_forward(
            q, k, v, _visible(2, 16), NOT_A_BAND, torch.ones(2, 16, dtype=torch.bool), 0.25, False, chain=True
        )
    assert out[1, :, :3].isnan().all() and not out[0].isnan().any()


def test_a_cap_needs_the_chain_and_the_chain_takes_no_sinks():
    q, k, v = random_qkv(1, 4, 2, 8, 8, 8, torch.float32)
    args = (q, k, v, _visible(1, 8), NOT_A_BAND, torch.ones(1, 8, dtype=torch.bool), 0.25, False)
    with pytest.raises(ValueError, match="a softcap is a chain's"):
        runtime_mask.mask_input_attention_forward(*args, softcap=3.0)
    with pytest.raises(ValueError, match="a chain's call takes no sinks"):
        runtime_mask.mask_input_attention_forward(*args, sinks=torch.zeros(4), chain=True)
