"""The sliding-window op against an fp64 SDPA reference: forward and dq, dk, dv.

Tolerances (inputs ~ N(0, 1)):
- fp64: 1e-10 absolute; the kernels are exact up to summation order.
- fp32: 2e-5 absolute and relative; float32 round-off over a few hundred keys.
- bf16: at most twice the error of SDPA itself run in bf16 on the same inputs and
  mask (what transformers runs today), plus 2**-8 (one bf16 ulp at 1.0) of slack.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass.kernels import chunked
from compile_pass.kernels.chunked import backends as chunk_backends
from compile_pass.ops import sliding_window_attention_backward, sliding_window_attention_forward
from compile_pass.window import normalize_window
from tests.helpers.attention_reference import fa2_window_mask, forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import tune_chunks

W = 24  # window in keys for the sliding case: window=(W - 1, 0)
WINDOWS = {
    "sliding": ((W - 1, 0), True),
    "bidirectional": ((9, 4), False),
    "causal_unbounded": ((-1, 0), True),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # 16-row chunks: the sequences below cross many chunk edges and both mask-free
    # and masked chunks.
    tune_chunks(monkeypatch, query_chunk=16)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _check_against_reference(query, key, value, window, causal, *, sdpa_baseline=None, grad_out=None, **batch_masks):
    """Output and dq/dk/dv against the fp64 reference; ``batch_masks`` (key_padding,
    segment_ids) go to both, and ``grad_out`` (random by default) to every backward.
    Returns the op's output."""
    left, right = normalize_window(window, causal)
    if grad_out is None:
        grad_out = torch.randn(query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    op = lambda q, k, v: sliding_window_attention(q, k, v, window=window, causal=causal, **batch_masks)  # noqa: E731
    ref_inputs = [x.detach().double().requires_grad_() for x in (query, key, value)]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v: reference_attention(q, k, v, left, right, **batch_masks), ref_inputs, grad_out
    )
    out, grads = forward_and_grads(op, (query, key, value), grad_out)
    assert out.dtype == query.dtype and out.shape == query.shape
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    names = ("out", "dq", "dk", "dv")
    ours = (out, *grads)
    refs = (ref_out, *ref_grads)
    if query.dtype == torch.float64:
        for name, a, b in zip(names, ours, refs, strict=True):
            assert _max_err(a, b) < 1e-10, name
    elif query.dtype == torch.float32:
        for name, a, b in zip(names, ours, refs, strict=True):
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)
    else:
        baseline_out, baseline_grads = forward_and_grads(sdpa_baseline, (query, key, value), grad_out)
        for name, a, b, base in zip(names, ours, refs, (baseline_out, *baseline_grads), strict=True):
            allowed = 2 * _max_err(base, b) + 2**-8
            assert _max_err(a, b) <= allowed, f"{name}: {_max_err(a, b)} > {allowed}"
    return out


def _bf16_sdpa(left, right):
    def run(q, k, v):
        groups = q.shape[1] // k.shape[1]
        mask = fa2_window_mask(q.shape[2], k.shape[2], left, right)
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask
        )

    return run


sliding_window_attention = compile_pass.sliding_window_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq", [1, W - 1, W, W + 1, 3 * W + 5])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_windows_and_lengths(kind, seq, dtype):
    window, causal = WINDOWS[kind]
    q, k, v = random_qkv(2, 4, 2, seq, seq, 32, dtype)
    _check_against_reference(q, k, v, window, causal, sdpa_baseline=_bf16_sdpa(*normalize_window(window, causal)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gqa_and_head_dims(groups, head_dim, dtype):
    q, k, v = random_qkv(1, 2 * groups, 2, 3 * W + 5, 3 * W + 5, head_dim, dtype)
    left, right = W - 1, 0
    _check_against_reference(q, k, v, (left, right), True, sdpa_baseline=_bf16_sdpa(left, right))


@pytest.mark.parametrize("seq_q", [1, 7, W + 1])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_fewer_queries_than_keys_is_bottom_right_aligned(kind, seq_q):
    window, causal = WINDOWS[kind]
    q, k, v = random_qkv(2, 4, 2, seq_q, 3 * W + 5, 32, torch.float32)
    _check_against_reference(q, k, v, window, causal)


def test_rows_without_keys_are_zero_with_zero_gradients():
    # Sq > Sk with a causal window: the first Sq - Sk rows see no key at all.
    q, k, v = random_qkv(1, 2, 1, 10, 4, 16, torch.float32)
    out = sliding_window_attention(q, k, v, window=(2, 0))
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    assert out[:, :, 6:].abs().sum() > 0
    _check_against_reference(q, k, v, (2, 0), True)
    (dq,) = torch.autograd.grad(sliding_window_attention(q, k, v, window=(2, 0)).sum(), (q,))
    assert torch.equal(dq[:, :, :6], torch.zeros_like(dq[:, :, :6]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16], ids=["fp64", "fp16"])
def test_other_dtypes(dtype):
    q, k, v = random_qkv(1, 4, 2, 3 * W + 5, 3 * W + 5, 64, dtype)
    if dtype == torch.float64:
        _check_against_reference(q, k, v, (W - 1, 0), True)
    else:
        left, right = W - 1, 0
        _check_against_reference(q, k, v, (left, right), True, sdpa_baseline=_bf16_sdpa(left, right))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_math_chunk_backend_matches_reference(kind, dtype):
    """The device-agnostic chunk backend (used off the CPU without FA2), run here on the CPU."""
    window, causal = WINDOWS[kind]
    left, right = normalize_window(window, causal)
    q, k, v = random_qkv(2, 4, 2, 3 * W + 5, 3 * W + 5, 32, dtype)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(32)
    with torch.no_grad():
        args = (q, k, v, left, right, scale)
        out, lse = chunked.chunked_forward(*args, backend=chunk_backends.MATH)
        fused_out, fused_lse = chunked.chunked_forward(*args, backend=chunk_backends.FUSED_CPU)
        grads = chunked.chunked_backward(
            grad_out.to(dtype), q, k, v, out, lse, left, right, scale, backend=chunk_backends.MATH
        )
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(lambda *a: reference_attention(*a, left, right), ref_inputs, grad_out)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert _max_err(a, b) < tol, name
    # Both backends return the same row statistics the backward relies on.
    assert _max_err(lse, fused_lse) < tol
    assert _max_err(out, fused_out) < tol


def test_window_definition_on_a_literal_example():
    # Sq=3, Sk=5, window (1, 0): query i is aligned with key i + 2 and sees keys i+1..i+2.
    expected = torch.tensor(
        [
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(fa2_window_mask(3, 5, 1, 0), expected)
    q, k, v = random_qkv(1, 1, 1, 3, 5, 8, torch.float64)
    out = sliding_window_attention(q, k, v, window=(1, 0))
    # Row 0 attends exactly keys 1 and 2.
    weights = torch.softmax((q[0, 0, 0] @ k[0, 0, 1:3].T) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(out[0, 0, 0], weights @ v[0, 0, 1:3])


def test_output_layout_is_heads_last():
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16, torch.float32, heads_last=False)
    out = sliding_window_attention(q, k, v, window=(7, 0))
    assert out.transpose(1, 2).is_contiguous()


def _last_dim_strided(x):
    return x.detach().mT.contiguous().mT.requires_grad_(x.requires_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inputs_whose_last_dimension_is_not_contiguous(dtype):
    """Regression: aten's CPU flash kernel read such inputs as if contiguous (max error 2.2)
    and its bf16 backward raised; the op now copies them once."""
    q, k, v = (_last_dim_strided(x) for x in random_qkv(2, 4, 2, 3 * W + 5, 3 * W + 5, 32, dtype))
    assert all(x.stride(-1) != 1 for x in (q, k, v))
    _check_against_reference(q, k, v, (W - 1, 0), True, sdpa_baseline=_bf16_sdpa(W - 1, 0))
    # The gradient arriving from the model may be strided the same way (.to keeps strides).
    grad_out = _last_dim_strided(torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    assert grad_out.to(dtype).stride(-1) != 1
    _check_against_reference(q, k, v, (W - 1, 0), True, sdpa_baseline=_bf16_sdpa(W - 1, 0), grad_out=grad_out)


@pytest.mark.parametrize("layout", ["transposed", "contiguous", "last_dim_strided"])
def test_opcheck(layout):
    q, k, v = random_qkv(2, 4, 2, 3 * W + 5, 3 * W + 5, 16, torch.float32, heads_last=layout == "transposed")
    if layout == "last_dim_strided":
        q, k, v = (_last_dim_strided(x) for x in (q, k, v))
    torch.library.opcheck(sliding_window_attention_forward, (q, k, v, W - 1, 0, 0.25))
    with torch.no_grad():
        out, lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.25)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        sliding_window_attention_backward, (grad_out, q.detach(), k.detach(), v.detach(), out, lse, W - 1, 0, 0.25)
    )


def test_compiled_fullgraph_dynamic_sequence_one_compile():
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def attend(q, k, v):
        return sliding_window_attention(q * 2.0, k, v, window=(W - 1, 0)).sum(dim=1)

    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    for seq in (3 * W + 5, 2 * W, 5 * W + 1):
        q, k, v = random_qkv(1, 4, 2, seq, seq, 32, torch.float32, seed=seq)
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 2)
        grad_out = torch.randn(1, seq, 32, dtype=torch.float64)
        out, grads = forward_and_grads(compiled, (q, k, v), grad_out)
        ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ref_out, ref_grads = forward_and_grads(
            lambda q_, k_, v_: reference_attention(q_ * 2.0, k_, v_, W - 1, 0).sum(dim=1), ref_inputs, grad_out
        )
        for a, b in zip((out, *grads), (ref_out, *ref_grads), strict=True):
            torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5)
    assert counter.frame_count == 1


def test_rejects_bad_input():
    q, k, v = random_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="dropout"):
        sliding_window_attention(q, k, v, window=(3, 0), dropout_p=0.1)
    with pytest.raises(ValueError, match="window left"):
        sliding_window_attention(q, k, v, window=(-2, 0))
    with pytest.raises(RuntimeError, match="multiple of key/value heads"):
        q3, k3, v3 = random_qkv(1, 3, 2, 8, 8, 16, torch.float32)
        sliding_window_attention(q3, k3, v3, window=(3, 0))
    with pytest.raises(RuntimeError, match="dtypes differ"):
        sliding_window_attention(q, k.double(), v.double(), window=(3, 0))
    with pytest.raises(RuntimeError, match="4-D"):
        sliding_window_attention(q[0], k[0], v[0], window=(3, 0))


def _padding(batch, seq, seed=5):
    """Left padding on row 0 (its first rows see only padded keys), right padding and a hole on row 1."""
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[0, : seq // 3] = False
    padding[1, -5:] = False
    padding[1, seq // 2] = False
    return padding


@pytest.mark.parametrize("backend", ["fused_cpu", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_key_padding_matches_reference(kind, dtype, backend, monkeypatch):
    window, causal = WINDOWS[kind]
    if backend == "math":
        monkeypatch.setattr(chunk_backends, "backend_for", lambda device: chunk_backends.MATH)
    seq = 3 * W + 5
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, dtype)
    out = _check_against_reference(q, k, v, window, causal, key_padding=_padding(2, seq))
    if kind != "bidirectional":  # causal: row 0's first rows see only padding
        assert torch.equal(out[0, :, : seq // 3], torch.zeros_like(out[0, :, : seq // 3]))


def test_opcheck_with_key_padding():
    seq = 3 * W + 5
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, torch.float32)
    padding = _padding(2, seq)
    torch.library.opcheck(sliding_window_attention_forward, (q, k, v, W - 1, 0, 0.25, padding))
    with torch.no_grad():
        out, lse = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.25, padding)
    torch.library.opcheck(
        sliding_window_attention_backward,
        (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, W - 1, 0, 0.25, padding),
    )


@pytest.mark.parametrize("backend", ["fused_cpu", "math"])
@pytest.mark.parametrize("kind", list(WINDOWS))
def test_segment_ids_match_reference(kind, backend, monkeypatch):
    """Packed sequences: three segments on row 0 (one shorter than the window), one on row 1."""
    window, causal = WINDOWS[kind]
    if backend == "math":
        monkeypatch.setattr(chunk_backends, "backend_for", lambda device: chunk_backends.MATH)
    seq = 3 * W + 5
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, torch.float64)
    segments = torch.zeros(2, seq, dtype=torch.long)
    segments[0, 30:] = 1
    segments[0, 36:] = 2
    _check_against_reference(q, k, v, window, causal, segment_ids=segments)


def test_varlen_layout_needs_padding_or_segment_ids():
    with pytest.raises(ValueError, match="needs key_padding or segment_ids"):
        torch.ops.compile_pass.varlen_layout(None, None, W - 1, 0, torch.bfloat16, 64)


def test_a_layout_comes_with_its_sizes():
    q, k, v = random_qkv(1, 2, 2, 8, 8, 16, torch.float32, seed=0)
    pieces = torch.zeros(4, 9, dtype=torch.int64)
    with pytest.raises(ValueError, match="layout and layout_sizes come together"):
        sliding_window_attention_forward(q, k, v, 3, 0, 0.25, None, None, None, pieces, None)
