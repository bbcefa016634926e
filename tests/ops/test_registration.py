"""The ops' registration (``registration.py``): what ``torch.library.custom_op`` gave them,
kept, with the autograd kernel calling the kernel itself only where nothing stands between."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from compile_pass.ops import sliding_window_attention_backward, sliding_window_attention_forward
from compile_pass.registration import define_op
from tests.helpers.attention_reference import reference_attention

W = 4


def _inputs(requires_grad=False, dtype=torch.float64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 12, heads, 8, dtype=dtype).transpose(1, 2) for heads in (4, 2, 2))
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


class _OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_op_and_gets_its_result():
    """With a Python mode active the autograd kernel redispatches: the mode sees the op as one
    call (not the aten ops inside it), and the result is the direct call's."""
    q, k, v = _inputs()
    direct, direct_lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.3)
    with _OpsSeen() as seen:
        out, lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.3)
    assert seen.ops == ["compile_pass.sliding_window_attention_forward.default"]
    torch.testing.assert_close(out, direct, rtol=0, atol=0)
    torch.testing.assert_close(lse, direct_lse, rtol=0, atol=0)


@pytest.mark.parametrize("trailing", [0, 1])
def test_gradients_with_defaults_left_out(trailing):
    """The dispatcher drops trailing arguments equal to their defaults; the autograd kernel
    fills them back for the op's setup. Gradients match the fp64 reference."""
    q, k, v = _inputs(requires_grad=True)
    extra = (None,) * trailing
    out, lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.3, *extra)
    assert not lse.requires_grad
    assert type(out.grad_fn).__name__ == "sliding_window_attention_forwardBackward"
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_q, ref_k, ref_v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference_attention(ref_q, ref_k, ref_v, W - 1, 0, 0.3)
    ref_grads = torch.autograd.grad(ref, (ref_q, ref_k, ref_v), grad_out)
    torch.testing.assert_close(out, ref)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad)


def test_no_second_derivative():
    """The backward op has no derivative of its own: a gradient through it raises, as it did
    as a custom_op, instead of returning a wrong zero."""
    q, k, v = _inputs(requires_grad=True)
    out, lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.3)
    grad_out = torch.randn_like(out, requires_grad=True)
    with pytest.raises(RuntimeError, match="no derivative"):
        sliding_window_attention_backward(grad_out, q, k, v, out.detach(), lse, W - 1, 0, 0.3)


def test_a_kernel_that_aliases_is_caught():
    """custom_op checked on every call that no output aliases an input; opcheck's schema test
    (tests/ops/test_op.py) holds the kernels to it instead, and can fail: a kernel returning its
    input is reported."""

    def returns_input(x):
        return x

    op = define_op("test_registration_alias(Tensor x) -> Tensor", returns_input, lambda x: torch.empty_like(x))
    with pytest.raises(Exception, match="alias"):
        torch.library.opcheck(op, (torch.randn(3),), test_utils=("test_schema",))


def test_the_kernel_is_called_directly_only_for_plain_tensors():
    """Plain CPU tensors: the autograd kernel calls the kernel itself (no second crossing);
    fake tensors and a dispatch mode: through the dispatcher, which runs what they register."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensorMode

    callers = []

    def kernel(x):
        callers.append(sys._getframe(1).f_code.co_name)
        return x.clone()

    op = define_op(
        "test_registration_direct(Tensor x) -> Tensor",
        kernel,
        lambda x: torch.empty_like(x),
        setup_context=lambda ctx, inputs, output: None,
        backward=lambda ctx, grad: (grad,),
    )
    op(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    op(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(3))
    assert callers == ["below_autograd", "below_autograd"]
    with _OpsSeen():
        op(torch.randn(3))
    assert len(callers) == 3 and callers[-1] != "below_autograd"
    with FakeTensorMode():
        op(torch.randn(3))  # the fake runs: the kernel is not called
    assert len(callers) == 3
