"""Small attention functions compiled through compile_pass's rewrite and run eagerly: the
helpers the rule tests share."""

import torch

from tests.models import Capture


def qkv(seq=16, seed=0, batch=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 2, seq, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3)]


def compiled_with_capture(fn, **switches):
    torch._dynamo.reset()
    capture = Capture(**switches)
    return torch.compile(fn, backend=capture, fullgraph=True), capture


def assert_same_as_eager(fn, compiled, inputs=None, rows=None):
    """Forward and the gradients of q, k, v equal eager's (fp64, same arithmetic or reassociated).
    ``rows`` (batch, 1, Sq, 1) weights the output rows compared and differentiated: 0 leaves
    out the query rows the op, by design, does not compute as SDPA does (padded queries)."""
    q, k, v = inputs if inputs is not None else qkv()
    weights = rows if rows is not None else 1.0
    out = compiled(q, k, v) * weights
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = fn(q, k, v) * weights
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
