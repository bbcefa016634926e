"""Masks (and attention inputs) of tensor subclasses never break a compile: a mask built in the
graph and then viewed as a subclass is still a proven band; a graph input of a subclass (plain
``as_subclass``, ``__torch_function__``, ``__torch_dispatch__``) keeps SDPA with the reason,
since the ops take plain tensors and Dynamo traces a plain subclass on plain fake tensors."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from tests.helpers.models import Capture
from tests.helpers.small_graphs import qkv

W = 4


class PlainSubclass(torch.Tensor):
    pass


class FunctionSubclass(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class DispatchSubclass(torch.Tensor):
    """A wrapper subclass that runs every op on the tensor it wraps (traceable by Dynamo)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device, strides=inner.stride()
        )

    def __init__(self, inner):
        self.inner = inner

    def __repr__(self):  # as wrapper subclasses write it: torch's trace logging reprs inputs
        return f"DispatchSubclass({self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return DispatchSubclass(inner_tensors["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, DispatchSubclass) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(lambda t: DispatchSubclass(t) if isinstance(t, torch.Tensor) else t, out)


def _band(seq):
    i = torch.arange(seq)
    return (i[None, :] > i[:, None] - W) & (i[None, :] <= i[:, None])


def _band_as_subclass(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2]).as_subclass(PlainSubclass))


def _mask_given(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _padded_band(q, k, v, padding):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2]) & (padding[:, None, None, :] != 0))


def _as(kind, tensor):
    return DispatchSubclass(tensor) if kind is DispatchSubclass else tensor.as_subclass(kind)


def _run(fn, backend, *extra):
    torch._dynamo.reset()
    q, k, v = qkv(batch=2)
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, *extra)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = fn(q64, k64, v64, *extra)
    for ours, eager in zip((out, *grads), (ref, *torch.autograd.grad(ref.sum(), (q64, k64, v64))), strict=True):
        torch.testing.assert_close(
            torch.Tensor(ours) if type(ours) is not torch.Tensor else ours,
            torch.Tensor(eager) if type(eager) is not torch.Tensor else eager,
            atol=1e-12,
            rtol=0,
        )


@pytest.mark.parametrize("backend", ["capture", "compile_pass"])
def test_a_band_viewed_as_a_subclass_in_the_graph_is_rewritten(backend):
    capture = Capture()
    _run(_band_as_subclass, capture if backend == "capture" else backend)
    if backend == "capture":
        assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0)"]


@pytest.mark.parametrize("kind", [PlainSubclass, FunctionSubclass], ids=["as_subclass", "__torch_function__"])
@pytest.mark.parametrize("backend", ["capture", "compile_pass"])
def test_a_mask_input_of_a_subclass_keeps_sdpa(kind, backend):
    capture = Capture()
    mask = _as(kind, _band(16).expand(2, 1, 16, 16).clone())
    _run(_mask_given, capture if backend == "capture" else backend, mask)
    if backend == "capture":
        assert [d.verdict for d in capture.report] == [
            f"kept: attn_mask is computed from input mask, a {kind.__name__}: the op takes plain tensors"
        ]


def test_a_mask_input_of_a_dispatch_subclass_keeps_sdpa():
    capture = Capture()
    mask = DispatchSubclass(_band(16).expand(2, 1, 16, 16).clone())
    _run(_mask_given, capture, mask)
    _run(_mask_given, "compile_pass", mask)
    (decision,) = capture.report
    assert not decision.rewritten, decision.verdict


@pytest.mark.parametrize("kind", [PlainSubclass, FunctionSubclass], ids=["as_subclass", "__torch_function__"])
def test_padding_of_a_subclass_keeps_sdpa(kind):
    capture = Capture()
    padding = _as(kind, torch.tensor([[0] * 5 + [1] * 11, [1] * 16]))
    _run(_padded_band, capture, padding)
    _run(_padded_band, "compile_pass", padding)
    assert [d.verdict for d in capture.report] == [
        f"kept: attn_mask is computed from input padding, a {kind.__name__}: the op takes plain tensors"
    ]


def _padded_band_in_a_checkpoint(q, k, v, padding):
    mask = _band(q.shape[2]) & (padding[:, None, None, :] != 0)
    return torch.utils.checkpoint.checkpoint(_mask_given, q, k, v, mask, use_reentrant=False)


def test_a_subclass_reaches_a_checkpoint_body_through_its_operands():
    """The mask enters the body as a placeholder: the subclass is followed through the call."""
    capture = Capture()
    padding = torch.tensor([[0] * 5 + [1] * 11, [1] * 16]).as_subclass(PlainSubclass)
    _run(_padded_band_in_a_checkpoint, capture, padding)
    assert [d.verdict for d in capture.report] == [
        "kept: attn_mask is computed from input padding, a PlainSubclass: the op takes plain tensors"
    ]


# -- query, key and value: plain where the op meets them (compile_pass/subclasses.py) -------------


def _projected(q, k, v, weight):
    """Attention over a band whose query is projected by ``weight``, as a quantized layer's is."""
    return F.scaled_dot_product_attention(q @ weight, k, v, attn_mask=_band(q.shape[2]))


def _as_given(q, k, v, weight):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2])) + weight.sum()


def _handed_on(q, k, v, weight):
    """``contiguous()`` of a contiguous tensor hands the same object back."""
    return F.scaled_dot_product_attention(weight.contiguous(), k, v, attn_mask=_band(q.shape[2]))


def _projected_mask(q, k, v, weight):
    """A mask computed through a product that makes a new, plain tensor: still computed from the
    subclass, which the mask's proof would read through."""
    mask = _band(q.shape[2]) & ((weight @ weight)[:1, :1] != 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _run_with_weight(fn, backend, kind):
    torch._dynamo.reset()
    q, k, v = qkv(batch=2)
    weight = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if fn is _handed_on:
        weight = torch.randn(2, 2, 16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weight = torch.nn.Parameter(_as(kind, weight))
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, weight)
    grad = lambda y, xs: torch.autograd.grad(y.sum(), xs, allow_unused=True, materialize_grads=True)  # noqa: E731
    grads = grad(out, (q, k, v, weight))
    plain = torch.nn.Parameter(
        torch.Tensor(weight.detach()).clone() if kind is not DispatchSubclass else weight.inner.clone()
    )
    ref = fn(q, k, v, plain)
    for ours, eager in zip((out, *grads), (ref, *grad(ref, (q, k, v, plain))), strict=True):
        unwrap = lambda t: t.inner if isinstance(t, DispatchSubclass) else torch.Tensor(t)  # noqa: E731
        torch.testing.assert_close(unwrap(ours), unwrap(eager), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", [PlainSubclass, FunctionSubclass], ids=["as_subclass", "__torch_function__"])
@pytest.mark.parametrize("backend", ["capture", "compile_pass"])
def test_a_query_made_by_an_op_on_a_function_subclass_is_rewritten(kind, backend):
    """Dynamo traces __torch_function__ into the graph and runs it with subclass dispatch off:
    the product is a new, plain tensor (bitsandbytes' Params4bit reaches its 4-bit matmul so)."""
    capture = Capture()
    _run_with_weight(_projected, capture if backend == "capture" else backend, kind)
    if backend == "capture":
        assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0)"]


@pytest.mark.parametrize("fn", [_as_given, _handed_on], ids=["the input itself", "handed on by contiguous()"])
def test_a_query_that_may_be_the_subclass_object_keeps_sdpa(fn):
    capture = Capture()
    if fn is _as_given:  # the query itself is the subclass input
        torch._dynamo.reset()
        q, k, v = qkv(batch=2)
        weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        torch.compile(fn, backend=capture, fullgraph=True)(q.detach().as_subclass(FunctionSubclass), k, v, weight)
        expected = "kept: query may be a FunctionSubclass at run time (from input q): the op takes plain tensors"
    else:
        _run_with_weight(fn, capture, FunctionSubclass)
        expected = "kept: query may be a FunctionSubclass at run time (from input weight): the op takes plain tensors"
    assert [d.verdict for d in capture.report] == [expected]


def test_a_query_of_a_dispatch_subclass_that_carries_itself_keeps_sdpa():
    """Dynamo's fake product is a DispatchSubclass: at run time the query is one."""
    capture = Capture()
    _run_with_weight(_projected, capture, DispatchSubclass)
    (decision,) = capture.report
    assert decision.verdict.startswith("kept: query may be a DispatchSubclass at run time"), decision.verdict


def test_a_mask_computed_from_a_subclass_through_a_plain_result_keeps_sdpa():
    capture = Capture()
    _run_with_weight(_projected_mask, capture, FunctionSubclass)
    assert [d.verdict for d in capture.report] == [
        "kept: attn_mask is computed from input weight, a FunctionSubclass: the op takes plain tensors"
    ]
