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


def assert_same_as_eager(fn, compiled, inputs=None, *extra):
    """Forward at every position and the gradients of q, k, v equal eager's (fp64, same
    arithmetic or reassociated), NaN where eager has NaN; ``extra`` are further arguments of
    both calls (a mask, a padding)."""
    q, k, v = inputs if inputs is not None else qkv()
    out = compiled(q, k, v, *extra)
    grads = torch.autograd.grad(out.nan_to_num().sum(), (q, k, v), allow_unused=True)
    ref = fn(q, k, v, *extra)
    ref_grads = torch.autograd.grad(ref.nan_to_num().sum(), (q, k, v), allow_unused=True)
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, equal_nan=True)
