"""Regression tests for the edge where proven facts meet run time (issue 20): scales SDPA
computes differently by path, masks written between or during calls, tensors the op must not
hold on to. Each test compares with eager, forward and gradients, and fails on the code
before its fix."""

import math

import pytest
import torch
import torch.nn.functional as F

from compile_pass import sliding_window_attention
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, mask_input_paths, qkv, tune_chunks

W = 4


def _decisions(capture):
    return [(d.rule, d.verdict) for report in capture.reports for d in report]


def _band(seq, left=W - 1):
    positions = torch.arange(seq)
    distance = positions[None, :] - positions[:, None]
    return (distance <= 0) & (distance >= -left)


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
    assert_same_as_eager(fn, compiled, qkv())
    decisions = _decisions(capture)
    assert decisions and all(
        verdict.startswith(f"kept: scale {scale!r} is not a positive finite number") for _, verdict in decisions
    ), decisions


@pytest.mark.parametrize("scale", SCALES, ids=["0", "negative", "inf", "nan"])
def test_a_scale_that_is_not_positive_and_finite_keeps_sdpa_for_a_mask_input(scale):
    fn = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # noqa: E731
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(), _band(16)[None, None])
    (decision,) = capture.report
    assert not decision.rewritten and "mask_input" in decision.rules
    assert decision.reasons == (f"scale {scale!r} is not a positive finite number",), decision.reasons


@pytest.mark.parametrize("scale", SCALES, ids=["0", "negative", "inf", "nan"])
def test_the_op_refuses_a_scale_that_is_not_positive_and_finite(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        sliding_window_attention(q, k, v, window=(W - 1, 0), scale=scale)


# -- facts about a mask input live for one graph call --------------------------------------


def _attend_with(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _mask_input(seq=16, left=W - 1):
    return _band(seq, left)[None, None].expand(1, 1, seq, seq).clone()


def _not_a_band(mask):
    """Writes a pattern no window describes: row 9 sees key 2 as well."""
    mask[0, 0, 9, 2] = True


WRITES = {
    # Each writes the mask without moving its version counter (checked in the test).
    "data": lambda mask: _not_a_band(mask.data),
    "untyped_storage": lambda mask: mask.untyped_storage().__setitem__(9 * 16 + 2, 1),
    "dlpack": lambda mask: _not_a_band(torch.from_dlpack(mask)),
    "numpy": lambda mask: mask.numpy().__setitem__((0, 0, 9, 2), True),
    "set_": lambda mask: _not_a_band(
        torch.empty(0, dtype=torch.bool).set_(mask.untyped_storage(), 0, mask.shape, mask.stride())
    ),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_mask_input_written_behind_the_version_counter_is_read_again(write):
    compiled, capture = compiled_with_capture(_attend_with)
    q, k, v = qkv(batch=1)
    mask = _mask_input()
    assert_same_as_eager(_attend_with, compiled, (q, k, v), mask)  # a band: the op's kernel
    version = mask._version
    WRITES[write](mask)
    assert mask._version == version and bool(mask[0, 0, 9, 2])
    assert_same_as_eager(_attend_with, compiled, (q, k, v), mask)  # no longer a band: SDPA's path
    assert [d.verdict for d in capture.report][0].startswith("rewritten: mask from input mask")


def _writes_its_mask_between_calls(q, k, v, mask):
    first = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    mask[..., 9, 2] = True
    return first + F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_graph_that_writes_its_mask_input_keeps_sdpa():
    compiled, capture = compiled_with_capture(_writes_its_mask_between_calls)
    q, k, v = qkv(batch=1)
    out = compiled(q, k, v, _mask_input())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = _writes_its_mask_between_calls(q, k, v, _mask_input())
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert [d.full_verdict for d in capture.report] == [
        "kept: mask input mask: l_mask_ is written in place by setitem"
    ] * 2


def test_a_mask_input_is_checked_once_per_graph_call(monkeypatch):
    from compile_pass.ops import runtime_mask

    checked = []
    check = runtime_mask.check_mask
    monkeypatch.setattr(runtime_mask, "check_mask", lambda mask: checked.append(1) or check(mask))

    def three_layers(q, k, v, mask):
        for _ in range(3):
            q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return q

    compiled, capture = compiled_with_capture(three_layers)
    q, k, v = qkv(batch=1)
    for call in (1, 2):
        assert_same_as_eager(three_layers, compiled, (q, k, v), _mask_input())
        assert len(checked) == call
    assert len([d for d in capture.report if d.rewritten]) == 3


def test_a_thread_writing_the_mask_leaves_no_stale_facts():
    """Writes from another thread race with the compiled call as they race with eager SDPA;
    once they are done, the next call reads the mask as it is."""
    import threading

    compiled, _ = compiled_with_capture(_attend_with)
    q, k, v = qkv(batch=1)
    mask = _mask_input()
    band = mask.clone()
    done = threading.Event()

    def flip():
        while not done.is_set():
            mask.data.copy_(band)
            mask.data[0, 0, 9, 2] = True

    writer = threading.Thread(target=flip)
    writer.start()
    try:
        for _ in range(20):
            compiled(q, k, v, mask)
    finally:
        done.set()
        writer.join()
    assert_same_as_eager(_attend_with, compiled, (q, k, v), mask)
    mask.data.copy_(band)
    assert_same_as_eager(_attend_with, compiled, (q, k, v), mask)


# -- the op keeps nothing the caller may write ----------------------------------------------


@pytest.mark.parametrize("pattern", ["band", "not a band"])
def test_a_mask_input_written_between_forward_and_backward(pattern):
    compiled, _ = compiled_with_capture(_attend_with)
    results = []
    for fn in (compiled, _attend_with):
        q, k, v = qkv(batch=1)
        mask = _mask_input()
        if pattern == "not a band":
            _not_a_band(mask)
        out = fn(q, k, v, mask)
        mask.fill_(True)  # SDPA keeps its own copy of the mask for the backward
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def _band_and_padding(q, k, v, padding):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q.shape[2]) & padding[:, None, None, :])


def test_a_padding_input_written_between_forward_and_backward():
    compiled, capture = compiled_with_capture(_band_and_padding)
    results = []
    for fn in (compiled, _band_and_padding):
        q, k, v = qkv(batch=2)
        padding = torch.ones(2, 16, dtype=torch.bool)
        padding[1, 12:] = False
        out = fn(q, k, v, padding)
        padding.fill_(False)
        results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0), key padding from padding"]


class _Marked(torch.Tensor):
    """A tensor subclass with nothing overridden, as ``as_subclass`` makes."""


@pytest.mark.parametrize("pattern", ["band", "not a band"])
def test_a_tensor_subclass_mask_input(pattern):
    """Kept: the op would meet the subclass at run time, which AOTAutograd's run-time analysis
    of custom ops refuses (through inductor the rewrite broke the compile); exact either way,
    through the rewritten graph run eagerly and through inductor."""
    compiled, capture = compiled_with_capture(_attend_with)
    q, k, v = qkv(batch=1)
    mask = _mask_input()
    if pattern == "not a band":
        _not_a_band(mask)
    assert_same_as_eager(_attend_with, compiled, (q, k, v), mask.as_subclass(_Marked))
    assert [d.verdict for d in capture.report] == [
        "kept: attn_mask is computed from input mask, a _Marked: the op takes plain tensors"
    ]
    torch._dynamo.reset()
    inductor = torch.compile(_attend_with, backend="compile_pass", fullgraph=True)
    assert_same_as_eager(_attend_with, inductor, (q, k, v), mask.as_subclass(_Marked))


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.register_buffer("mask", _mask_input())

    def forward(self, q, k, v):
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask))


def test_load_state_dict_swaps_a_mask_buffer_after_compiled_calls():
    """Nothing holds a weak reference to the mask (``swap_tensors`` refuses a tensor that has
    one). Through the real backend: a capturing test backend keeps the graphs' fake tensors,
    whose converter holds weak references of its own."""
    torch._dynamo.reset()
    layer = _Layer()
    compiled = torch.compile(layer, backend="compile_pass")
    q, k, v = qkv(batch=1)
    with mask_input_paths() as paths:
        assert_same_as_eager(layer, compiled, (q, k, v))
    assert paths == {"band": 1}
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        layer.load_state_dict(_Layer().state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    torch._dynamo.reset()


# -- non-finite inputs ----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["key", "value"])
def test_a_nan_reaches_the_rows_whose_window_sees_it_and_no_row_beyond_its_chunk(where, monkeypatch):
    """The op's semantics for a NaN at one position of K or V (documented in docs/kernels.md):
    every row whose window sees the position is NaN, as in eager; so may be rows of the same
    chunk (their chunk's keys include it, masked); rows further away stay finite. Eager SDPA
    with an explicit mask is NaN in every row (NaN + -inf for a key, 0 * NaN for a value)."""
    rows = 8
    tune_chunks(monkeypatch, query_chunk=rows)
    q, k, v = (t.detach() for t in qkv(seq=64, batch=1))
    position = 20
    (k if where == "key" else v)[0, 0, position] = float("nan")
    out = sliding_window_attention(q, k, v, window=(W - 1, 0))
    nan_rows = out.isnan().any(dim=-1)[0, 0]  # query head 0 reads kv head 0
    assert nan_rows[position : position + W].all()  # the rows that see it
    assert not nan_rows[: position - rows].any() and not nan_rows[position + W - 1 + rows :].any()
    assert not out[0, 1].isnan().any()  # the other kv head's rows never see it
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=_band(64))
    assert eager[0, 0].isnan().any(dim=-1).all()  # masked scores or probabilities meet the NaN too


@pytest.mark.parametrize(
    ("before", "after", "backend"),
    [("band", "causal", "capture"), ("causal", "band", "capture"), ("band", "not a band", "compile_pass")],
)
def test_a_checkpointed_layer_reads_its_mask_again_when_recomputed(before, after, backend):
    """Written behind the version counter between forward and backward: eager's checkpoint
    recomputes the layer from the mask as it is then, and so must the rewritten body. From a
    band to a mask that is none, the recomputed call saves a mask copy the first run did not:
    torch's eager checkpoint (which the capturing backend runs) refuses recomputed tensors of
    another size, so that case runs through the real backend, whose recomputation is AOT's."""
    from torch.utils.checkpoint import checkpoint

    def layer(q, k, v, mask):
        return checkpoint(_attend_with, q, k, v, mask, use_reentrant=False)

    def mask_of(kind):
        mask = _mask_input(left=16 if kind == "causal" else W - 1)
        if kind == "not a band":
            _not_a_band(mask)
        return mask

    torch._dynamo.reset()
    compiled = compiled_with_capture(layer)[0] if backend == "capture" else torch.compile(layer, backend=backend)
    results = []
    with mask_input_paths() as paths:
        for fn in (compiled, layer):
            q, k, v = qkv(batch=1)
            mask = mask_of(before)
            out = fn(q, k, v, mask)
            mask.data.copy_(mask_of(after))
            results.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert sum(paths.values()) >= 2  # the first run, and the recomputation
    torch._dynamo.reset()
