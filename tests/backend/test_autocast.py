"""Mixed precision: SDPA under ``torch.autocast`` computes in the region's dtype, its inputs
cast there whatever dtypes they arrive in (Gemma-4 under bf16 autocast hands it fp32 q and k
from its norms and a bf16 v from a linear). The rules cast them as autocast does and rewrite.
Every test compares with eager under the same autocast, both against fp64; tests/ops/test_precision.py
does the same for a whole Gemma-4 training step."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.small_graphs import compiled_with_capture

W = 4


def _band(seq):
    i = torch.arange(seq)
    distance = i[None, :] - i[:, None]
    return (distance <= 0) & (distance > -W)


def _attend(q, k, v, weight, mask=None):
    """q and k as they come (fp32), v through a linear (bf16 under autocast)."""
    value = F.linear(v, weight)
    return F.scaled_dot_product_attention(q, k, value, attn_mask=_band(q.shape[2]) if mask is None else mask)


def _in_graph(q, k, v, weight, mask=None):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _attend(q, k, v, weight, mask)


def _additive(q, k, v, weight):
    band = _band(q.shape[2])
    return _attend(q, k, v, weight, torch.zeros(band.shape).masked_fill(~band, float("-inf")))


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=gen).requires_grad_() for _ in range(3))
    return q, k, v, torch.randn(16, 16, generator=gen).requires_grad_()


def _errors(fn, inputs, *extra, ambient):
    """Max |output - fp64| and max |gradient - fp64| of each input, under autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
        out = fn(*inputs, *extra)
    grads = torch.autograd.grad(out.float().sum(), inputs)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ref = _attend(*exact, *(e.double() if e.is_floating_point() else e for e in extra))
    ref_grads = torch.autograd.grad(ref.sum(), exact)
    return [
        (a.double() - b).abs().max().item() for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)
    ], out.dtype


@pytest.mark.parametrize("where", ["in the graph", "around the compiled call"])
def test_sdpa_under_autocast_is_rewritten_in_the_autocast_dtype(where):
    fn, ambient = (_in_graph, False) if where == "in the graph" else (_attend, True)
    compiled, capture = compiled_with_capture(fn)
    inputs = _inputs()
    ours, dtype = _errors(compiled, inputs, ambient=ambient)
    eager, eager_dtype = _errors(fn, inputs, ambient=ambient)
    assert dtype == eager_dtype == torch.bfloat16
    for a, b in zip(ours, eager, strict=True):
        assert a <= 1.25 * b + 1e-3, (ours, eager)
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0)"]


def test_a_mask_input_under_autocast():
    compiled, capture = compiled_with_capture(_in_graph)
    inputs = _inputs()
    mask = _band(48)[None, None].expand(2, 1, 48, 48).contiguous()
    ours, _ = _errors(compiled, inputs, mask, ambient=False)
    eager, _ = _errors(_in_graph, inputs, mask, ambient=False)
    for a, b in zip(ours, eager, strict=True):
        assert a <= 1.25 * b + 1e-3, (ours, eager)
    assert [d.rule for d in capture.report if d.rewritten] == ["mask_input"]


def test_an_additive_mask_autocast_would_cast_keeps_sdpa():
    compiled, capture = compiled_with_capture(_additive)
    inputs = _inputs()
    ours, _ = _errors(compiled, inputs, ambient=True)
    eager, _ = _errors(_additive, inputs, ambient=True)
    assert ours == eager
    assert [d.verdict for d in capture.report] == [
        "kept: autocast casts query, key, value and the additive mask to torch.bfloat16"
    ]
