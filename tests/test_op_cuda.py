"""CUDA paths of the op: FA2 where flash-attn imports, the chunked kernel everywhere else.

The kernel-choice rule itself is checked on the CPU; the numerics need a CUDA GPU
and skip cleanly without one (and without flash-attn for the FA2 tests).
"""

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.ops import chunked, flash
from compile_pass.ops.window import normalize_window
from tests.attention_reference import forward_and_grads, random_qkv, reference_attention

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_flash_attn = pytest.mark.skipif(
    not torch.cuda.is_available() or flash.flash_ops() is None, reason="needs a CUDA GPU and flash-attn >= 2.7"
)


@pytest.mark.parametrize(
    ("device_type", "dtype", "head_dim", "available", "expected"),
    [
        ("cuda", torch.bfloat16, 256, True, True),
        ("cuda", torch.float16, 128, True, True),
        ("cuda", torch.bfloat16, 512, True, False),  # Gemma-4 global layers
        ("cuda", torch.bfloat16, 100, True, False),  # not a multiple of 8
        ("cuda", torch.float32, 128, True, False),
        ("cuda", torch.bfloat16, 128, False, False),  # flash-attn not installed
        ("cpu", torch.bfloat16, 128, True, False),
    ],
)
def test_kernel_choice_depends_only_on_device_dtype_and_head_dim(device_type, dtype, head_dim, available, expected):
    assert flash.flash_supports(device_type, dtype, head_dim, available) is expected


def test_cpu_never_takes_the_flash_path():
    q, _, _ = random_qkv(1, 2, 2, 4, 4, 64, torch.bfloat16)
    assert not flash.use_flash(q)


@pytest.mark.parametrize(("version", "parsed"), [("2.8.3", (2, 8)), ("2.7.0.post2", (2, 7)), ("2.6.3", (2, 6))])
def test_version_parsing(version, parsed):
    assert flash._version_tuple(version) == parsed
    assert (parsed >= flash.MIN_VERSION) is (parsed[1] >= 7)


def _check_on_cuda(dtype, head_dim, window, causal, seq_q, seq_k):
    left, right = normalize_window(window, causal)
    q, k, v = (x.detach().cuda().requires_grad_() for x in random_qkv(2, 8, 2, seq_q, seq_k, head_dim, dtype))
    grad_out = torch.randn(q.shape, dtype=torch.float64, device="cuda")
    out, grads = forward_and_grads(
        lambda *a: sliding_window_attention(*a, window=window, causal=causal), (q, k, v), grad_out
    )
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(lambda *a: reference_attention(*a, left, right), ref_inputs, grad_out)
    # bf16/fp16: a few ulps of the largest values (outputs ~1, gradients ~ a few).
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=3e-2, msg=name)


@needs_flash_attn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("window", "causal"), [((255, 0), True), ((64, 32), False), ((-1, 0), True)])
@pytest.mark.parametrize(("seq_q", "seq_k"), [(1000, 1000), (100, 1000)])
def test_flash_attn_path_matches_reference(dtype, window, causal, seq_q, seq_k):
    assert flash.use_flash(torch.empty(1, 1, 1, 128, dtype=dtype, device="cuda"))
    _check_on_cuda(dtype, 128, window, causal, seq_q, seq_k)


@needs_cuda
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 512)])
def test_chunked_kernel_on_cuda_matches_reference(dtype, head_dim):
    # fp32 and head_dim 512 are outside FA2's limits: the chunked kernel runs on the GPU.
    assert chunked.backend_for(torch.device("cuda")) is chunked.MATH
    _check_on_cuda(dtype, head_dim, (255, 0), True, 700, 700)


def test_varlen_layout_of_padded_and_packed_batches():
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    layout = flash.varlen_layout(padding, None)
    assert layout.tokens.tolist() == [2, 3, 4, 5, 6, 7]
    assert layout.cu_seqlens.tolist() == [0, 3, 6] and layout.max_seqlen == 3
    packed = flash.varlen_layout(None, torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]))
    assert packed.tokens.tolist() == list(range(10))
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 6, 8, 10] and packed.max_seqlen == 3
    # Masks unpadding would change: a hole in a row, a segment id that comes back, both kinds.
    assert flash.varlen_layout(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), None) is None
    assert flash.varlen_layout(None, torch.tensor([[0, 1, 0]])) is None
    assert flash.varlen_layout(padding, torch.zeros(2, 5, dtype=torch.long)) is None


@needs_flash_attn
@pytest.mark.parametrize("kind", ["padding", "segments"])
def test_flash_attn_varlen_matches_reference(kind):
    seq = 300
    q, k, v = (x.detach().cuda().requires_grad_() for x in random_qkv(2, 8, 2, seq, seq, 128, torch.bfloat16))
    if kind == "padding":
        extra = {"key_padding": torch.ones(2, seq, dtype=torch.bool, device="cuda")}
        extra["key_padding"][0, :40] = False
        extra["key_padding"][1, -70:] = False
    else:
        segments = torch.zeros(2, seq, dtype=torch.long, device="cuda")
        segments[0, 100:] = 1
        segments[1, 250:] = 1
        extra = {"segment_ids": segments}
    assert flash.varlen_layout(extra.get("key_padding"), extra.get("segment_ids")) is not None
    grad_out = torch.randn(q.shape, dtype=torch.float64, device="cuda")
    out, grads = forward_and_grads(lambda *a: sliding_window_attention(*a, window=(63, 0), **extra), (q, k, v), grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(lambda *a: reference_attention(*a, 63, 0, **extra), ref_inputs, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=3e-2, msg=name)
