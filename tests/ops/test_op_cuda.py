"""CUDA paths of the op: torch's FA2 (flash-attn's where asked for) where FA2 can run, the
chunked kernel everywhere else.

The kernel choice, the window check and the varlen layout are checked on the CPU; the
numerics need a CUDA GPU and skip cleanly without one. tests/test_torch_flash_contract.py
and tests/kernels/test_flash_contract.py run the FA2 kernels themselves on the CPU, over emulations
of aten's flash ops and of flash-attn's extension.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels import fa2
from compile_pass.kernels.chunked import backends as chunk_backends
from compile_pass.kernels.fa2 import flash_attn as flash
from compile_pass.kernels.fa2 import torch_flash
from compile_pass.kernels.fa2 import varlen as fa2_varlen
from compile_pass.kernels.policy import SDPA_NAME, facts_of
from compile_pass.ops import POLICY, sliding_window_attention_forward
from compile_pass.window import normalize_window
from tests.helpers import flash_emulation
from tests.helpers.attention_reference import fa2_window_mask, forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import NothingRegistered, pretend_gpu

CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# -- kernel choice, on the CPU ------------------------------------------------------------


def test_cpu_runs_the_fused_chunked_kernel_and_it_is_fast():
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        choice = POLICY.choose(facts_of("cpu", dtype, 256))
        assert choice.fast and choice.reason == "" and "fused CPU" in choice.name


@pytest.mark.parametrize(
    ("dtype", "head_dim", "why"),
    [
        (torch.bfloat16, 512, "head_dim"),  # Gemma-4 global layers
        (torch.bfloat16, 100, "head_dim"),  # not a multiple of 8
        (torch.float32, 128, "fp16 or bf16"),
    ],
)
def test_outside_fa2_limits_off_the_cpu_is_not_fast(monkeypatch, dtype, head_dim, why):
    pretend_gpu(monkeypatch)
    choice = POLICY.choose(facts_of(CUDA, dtype, head_dim))
    assert not choice.fast and choice.name == SDPA_NAME
    assert "torch's FA2: torch's FA2 takes" in choice.reason and why in choice.reason
    assert "chunked: on cuda the chunked kernel runs an unfused matmul/softmax, slower than SDPA" in choice.reason
    # Asked to rewrite anyway, the chunked kernel computes it.
    assert (
        POLICY.choose(facts_of(CUDA, dtype, head_dim), slower_allowed=True).name == "chunked, matmul/softmax per chunk"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_not_fast():
    choice = POLICY.choose(facts_of("cuda", torch.bfloat16, 256))
    assert not choice.fast and "torch's FA2: no CUDA GPU is available" in choice.reason


def test_the_meta_device_leaves_the_choice_to_the_real_one():
    """``inspect`` traces on the meta device, where nothing runs: the report shows what the
    proof allows, and the device the model compiles on decides."""
    choice = POLICY.choose(facts_of("meta", torch.float32, 512))
    assert choice.fast and choice.name == "chosen on the device the model runs on"


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("masks", [{}, {"key_padding": True}, {"segment_ids": True}, {"blocks": True}])
def test_torch_fa2_is_the_default_on_sm80_and_newer(monkeypatch, capability, masks):
    """Stock torch, no flash-attn: torch's own FA2, dense or varlen, is fast for bf16 and fp16."""
    pretend_gpu(monkeypatch, capability)
    for dtype in (torch.bfloat16, torch.float16):
        choice = POLICY.choose(facts_of(CUDA, dtype, 256, **masks))
        assert choice.fast and choice.kernel is torch_flash.TORCH_FA2
        varlen = " varlen" if masks.keys() & {"key_padding", "segment_ids"} else ""
        images = ", image rows by torch's FA2 varlen" if masks.get("blocks") else ""
        assert choice.name == f"torch's FA2{varlen}{images}"
        assert choice.passed_over == ("flash-attn: flash-attn is used only when asked for (COMPILE_PASS_FLASH_ATTN=1)",)


@pytest.mark.parametrize("capability", [None, (7, 5), (8, 0), (9, 0)])
@pytest.mark.parametrize("flash_attn_asked", [False, True])
def test_first_is_the_choice_of_choose(monkeypatch, capability, flash_attn_asked):
    """``first`` (asked on every call of the op, without words) answers as ``choose`` does:
    the fast kernel, else the first exact one (rewritten with ``slow_kernels``)."""
    if capability is not None:
        pretend_gpu(monkeypatch, capability)
    if flash_attn_asked:
        monkeypatch.setenv(flash.USE_VARIABLE, "1")
    for device in ("cpu", "cuda", "meta"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            for head_dim in (64, 100, 256, 512):
                for masks in (
                    {},
                    {"key_padding": True},
                    {"segment_ids": True, "same_lengths": False},
                    {"blocks": True},
                ):
                    for sizes in ({}, {"same_lengths": False, "keys": 100, "left": 511}):
                        facts = facts_of(device, dtype, head_dim, **{**masks, **sizes})
                        chosen = POLICY.choose(facts).kernel or POLICY.choose(facts, slower_allowed=True).kernel
                        assert type(POLICY.first(facts)) is type(chosen) and POLICY.first(facts).name == chosen.name, (
                            facts
                        )


@pytest.mark.parametrize("capability", [(7, 5), (7, 0)])
def test_below_sm80_nothing_is_fast(monkeypatch, capability):
    pretend_gpu(monkeypatch, capability)
    choice = POLICY.choose(facts_of(CUDA, torch.bfloat16, 128))
    assert not choice.fast and f"torch's FA2 needs sm80 or newer, not sm{capability[0]}{capability[1]}" in choice.reason


def test_an_activated_flash_implementation_other_than_fa2_sends_calls_elsewhere(monkeypatch):
    """``activate_flash_attention_impl`` puts another kernel (FA3 on sm90) under aten's flash
    ops, with another window clamp: torch's FA2 kernel steps aside while it is active."""
    pretend_gpu(monkeypatch)
    attention = torch.nn.attention
    attention.register_flash_attention_impl("compile_pass_test_impl", register_fn=NothingRegistered)
    attention.activate_flash_attention_impl("compile_pass_test_impl")
    try:
        choice = POLICY.choose(facts_of(CUDA, torch.bfloat16, 128))
        assert not choice.fast and "aten's flash ops run compile_pass_test_impl" in choice.reason
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None
    assert POLICY.choose(facts_of(CUDA, torch.bfloat16, 128)).kernel is torch_flash.TORCH_FA2


def test_flash_attn_only_when_asked_for(monkeypatch):
    pretend_gpu(monkeypatch)
    monkeypatch.delenv(flash.USE_VARIABLE, raising=False)
    assert "only when asked for" in flash.unavailable_reason(CUDA, torch.bfloat16, 128)
    monkeypatch.setenv(flash.USE_VARIABLE, "1")
    if flash.flash_attn_version() is None:  # this machine: asked for, and not installed
        assert flash.unavailable_reason(CUDA, torch.bfloat16, 128) == "flash-attn >= 2.7 is not installed"
        assert POLICY.choose(facts_of(CUDA, torch.bfloat16, 128)).kernel is torch_flash.TORCH_FA2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_gpu_check_says_it_needs_a_gpu():
    script = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--no-record"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "no CUDA GPU" in done.stderr, done.stderr[-2000:]


def test_fa2_is_never_tried_without_a_cuda_gpu(monkeypatch):
    monkeypatch.setenv(flash.USE_VARIABLE, "1")
    for kernel in (flash, torch_flash):
        reason = kernel.unavailable_reason(torch.device("cpu"), torch.bfloat16, 128)
        assert reason is not None and "cpu" in reason


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("2.8.3", (2, 8, 3)), ("2.7.4.post1", (2, 7, 4)), ("2.7.0.post2", (2, 7, 0)), ("2.6", (2, 6, 0))],
)
def test_release_parsing(version, parsed):
    assert flash.release(version) == parsed


def test_window_is_exact_exactly_when_fa2_clamping_changes_nothing():
    """Brute force over small sizes: FA2's mask after its own clamping (as
    tests/helpers/flash_emulation.py reproduces it) against the window's definition."""
    sides = [-1, *range(0, 9)]
    for seq_q in range(1, 9):
        for seq_k in range(1, 7):
            for left in sides:
                for right in sides:
                    clamped = flash_emulation._clamp_window(left, right, seq_k)
                    as_run = flash_emulation._kernel_window(*clamped, seq_k)
                    same = torch.equal(
                        flash_emulation._visible(seq_q, seq_k, *as_run), fa2_window_mask(seq_q, seq_k, left, right)
                    )
                    assert fa2.window_is_exact(seq_q, seq_k, left, right) is same, (seq_q, seq_k, left, right)


# -- varlen layout, on the CPU ---------------------------------------------------------------


def test_varlen_layout_of_padded_and_packed_batches():
    padding = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    sequences, after = fa2_varlen.varlen_layout(padding, None, 1, 0).passes
    assert sequences.query_tokens.tolist() == sequences.key_tokens.tolist() == [2, 3, 4, 10, 11, 12]
    # The all-padding row is no sequence at all.
    assert sequences.cu_seqlens_q.tolist() == [0, 3, 6] and sequences.max_seqlen_q == 3
    assert sequences.cu_seqlens_q.dtype == torch.int32 and (sequences.left, sequences.right) == (1, 0)
    # Window (1, 0): of the padded rows, only row 2's position 3 sees a valid key (position 2).
    assert after.query_tokens.tolist() == [13] and after.key_tokens.tolist() == [12]
    assert after.kept_rows.tolist() == [0] and (after.left, after.right) == (0, 0)
    packed = fa2_varlen.varlen_layout(None, torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]), 3, 0)
    (packed_pass,) = packed.passes
    assert packed_pass.query_tokens is None and packed_pass.key_tokens is None  # the batch in place
    assert packed_pass.cu_seqlens_q.tolist() == [0, 2, 5, 6, 8, 10] and packed_pass.max_seqlen_q == 3
    (nothing,) = fa2_varlen.varlen_layout(torch.zeros(2, 4, dtype=torch.bool), None, 3, 0).passes
    assert nothing.query_tokens.numel() == 0 and nothing.cu_seqlens_q.tolist() == [0] and nothing.max_seqlen_q == 0
    # Masks unpadding would change: a hole in a row, a segment id that comes back, both kinds.
    assert fa2_varlen.varlen_layout(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool), None, 3, 0) is None
    assert fa2_varlen.varlen_layout(None, torch.tensor([[0, 1, 0]]), 3, 0) is None
    assert fa2_varlen.varlen_layout(padding, torch.zeros(3, 5, dtype=torch.long), 3, 0) is None


def test_padded_rows_on_both_sides_get_their_own_passes():
    """Rows before and after each run, with stand-ins so that every sequence of a pass has
    the same rows; rows before the run are read backwards."""
    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    _, after, before = fa2_varlen.varlen_layout(padding, None, 2, 1).passes
    # After: row 0 has 1 padded row (6), row 1 has 4 of which 2 are within reach (3, 4).
    assert after.query_tokens.tolist() == [6, 6, 10, 11] and after.kept_rows.tolist() == [0, 2, 3]
    assert after.key_tokens.tolist() == [4, 5, 8, 9] and after.cu_seqlens_k.tolist() == [0, 2, 4]
    assert (after.left, after.right, after.max_seqlen_q, after.max_seqlen_k) == (0, 1, 2, 2)
    # Before, read backwards: row 0's position 1 sees position 2; row 1's position 0 sees 1.
    assert before.query_tokens.tolist() == [1, 7] and before.key_tokens.tolist() == [2, 8]
    assert (before.left, before.right) == (0, 0)


def test_image_pass_covers_each_image_and_the_keys_its_rows_see():
    """Row 0: an image at 3..5 with window left 2 sees keys 1..5; row 1 (left padding at 0..1):
    an image at 2..3 whose keys stop at the first valid token, 2."""
    blocks = torch.full((2, 8), -1)
    blocks[0, 3:6] = 7
    blocks[1, 2:4] = 0
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[1, :2] = False
    images = fa2_varlen.image_pass(blocks, padding, 2, 0)
    assert images.query_tokens.tolist() == [3, 4, 5, 10, 11]
    assert images.key_tokens.tolist() == [1, 2, 3, 4, 5, 10, 11]
    assert images.cu_seqlens_q.tolist() == [0, 3, 5] and images.cu_seqlens_k.tolist() == [0, 5, 7]
    assert (images.left, images.right, images.max_seqlen_q, images.max_seqlen_k) == (2, -1, 3, 5)
    assert fa2_varlen.image_pass(blocks, padding, 2, 1) is None  # a bidirectional window
    padding[0, 5] = False  # an image row that is padding
    assert fa2_varlen.image_pass(blocks, padding, 2, 0) is None
    blocks[1, 6] = 0  # an id in two runs
    assert fa2_varlen.image_pass(blocks, None, 2, 0) is None


# -- numerics on a CUDA GPU ---------------------------------------------------------------


@pytest.fixture(params=["torch", "flash-attn"])
def fa2_kernel(request, monkeypatch):
    """Each FA2 kernel in turn, where it runs here (flash-attn only when installed)."""
    if request.param == "flash-attn":
        monkeypatch.setenv(flash.USE_VARIABLE, "1")
    kernel = torch_flash.TORCH_FA2 if request.param == "torch" else flash.FLASH_ATTN
    reason = kernel.calls.unavailable_reason(CUDA, torch.bfloat16, 128)
    if reason is not None:
        pytest.skip(reason)
    return kernel


def _check_on_cuda(dtype, head_dim, window, causal, seq_q, seq_k, heads_last=True, with_sinks=False, **batch_masks):
    """The op on CUDA against the fp64 reference; ``with_sinks``: random sinks (one per query
    head, fp32), against the spelled-out form, their gradient too."""
    left, right = normalize_window(window, causal)
    inputs = [
        x.detach().cuda().requires_grad_()
        for x in random_qkv(2, 8, 2, seq_q, seq_k, head_dim, dtype, heads_last=heads_last)
    ]
    if with_sinks:
        inputs.append((4 + torch.randn(8, generator=torch.Generator().manual_seed(3))).cuda().requires_grad_())
    batch_masks = {name: mask.cuda() for name, mask in batch_masks.items()}
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).cuda()
    out, grads = forward_and_grads(
        lambda q, k, v, s=None: sliding_window_attention(q, k, v, window=window, causal=causal, sinks=s, **batch_masks),
        inputs,
        grad_out,
    )
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v, s=None: reference_attention(q, k, v, left, right, sinks=s, **batch_masks), ref_inputs, grad_out
    )
    # bf16/fp16: a few ulps of the largest value (outputs ~1; a sequence's first key gathers
    # a dv of ~10 from every row that sees it, where one bf16 ulp is 0.06).
    names = ("out", "dq", "dk", "dv", "d sinks")[: 1 + len(grads)]  # d sinks where the call has sinks
    for name, a, b in zip(names, (out, *grads), (ref_out, *ref_grads), strict=True):
        error = (a.double() - b).abs().max().item()
        assert error <= 3e-2 * max(1.0, b.abs().max().item()), (name, error)
    for tensor in (out, *grads[:3]):
        assert tensor.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("window", "causal"), [((255, 0), True), ((64, 32), False), ((-1, 0), True)])
@pytest.mark.parametrize(("seq_q", "seq_k"), [(1000, 1000), (100, 1000), (1000, 990)])
def test_fa2_path_matches_reference(fa2_kernel, dtype, window, causal, seq_q, seq_k):
    _check_on_cuda(dtype, 128, window, causal, seq_q, seq_k)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_fa2_path_with_b_h_s_d_contiguous_inputs(fa2_kernel, head_dim):
    _check_on_cuda(torch.bfloat16, head_dim, (255, 0), True, 700, 700, heads_last=False)
    q, k, v = (x.detach().cuda() for x in random_qkv(2, 8, 2, 300, 300, head_dim, torch.bfloat16, heads_last=False))
    torch.library.opcheck(sliding_window_attention_forward, (q, k, v, 63, 0, 0.0625))


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize(("window", "causal"), [((127, 0), True), ((-1, 0), True)], ids=["sliding", "full"])
def test_fa2_path_with_sinks_matches_reference(fa2_kernel, window, causal, padded):
    """GPT-OSS's sinks, applied from FA2's logsumexp (ops/sinks.py)."""
    padding = torch.ones(2, 600, dtype=torch.bool)
    padding[0, :150] = False  # left padding: row 0's first rows see no key
    masks = {"key_padding": padding} if padded else {}
    _check_on_cuda(torch.bfloat16, 64, window, causal, 600, 600, with_sinks=True, **masks)


def test_more_queries_than_keys_with_unbounded_right_side_falls_back(fa2_kernel):
    _check_on_cuda(torch.bfloat16, 128, (16, -1), False, 300, 100)


@pytest.mark.parametrize("most_padding", [-1.0, 1.0], ids=["gathered", "in_place"])
@pytest.mark.parametrize("kind", ["padding", "segments", "padding_only"])
def test_fa2_varlen_matches_reference(fa2_kernel, kind, most_padding, monkeypatch):
    """Padded and packed batches; the sequences' pass on the valid tokens gathered, and on
    the batch in place with its padding runs computed and dropped."""
    monkeypatch.setattr(fa2_varlen, "IN_PLACE_MOST_PADDING", most_padding)
    seq = 300
    if kind == "segments":
        segments = torch.zeros(2, seq, dtype=torch.long)
        segments[0, 100:] = 1
        segments[1, 250:] = 1
        masks = {"segment_ids": segments}
    else:
        padding = torch.zeros(2, seq, dtype=torch.bool)
        if kind == "padding":
            padding[0, 40:] = True  # left padding
            padding[1, :-70] = True  # right padding
        masks = {"key_padding": padding}
    _check_on_cuda(torch.bfloat16, 128, (63, 0), True, seq, seq, **masks)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
def test_image_blocks_on_fa2_path_match_reference(fa2_kernel, padded):
    """The band by FA2, the image rows by one more varlen call (an image longer than the
    window in row 0, two short ones in row 1)."""
    seq = 300
    blocks = torch.full((2, seq), -1)
    blocks[0, 20:120] = 0
    blocks[1, 150:170] = 0
    blocks[1, 200:205] = 1
    masks = {"block_ids": blocks}
    if padded:
        masks["key_padding"] = torch.ones(2, seq, dtype=torch.bool)
        masks["key_padding"][0, :10] = False
    _check_on_cuda(torch.bfloat16, 128, (63, 0), True, seq, seq, **masks)


def test_empty_batch_on_fa2_path(fa2_kernel):
    q, k, v = (x.detach().cuda().requires_grad_() for x in random_qkv(0, 8, 2, 64, 64, 128, torch.bfloat16))
    out = sliding_window_attention(q, k, v, window=(15, 0))
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape


@needs_cuda
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 64), (torch.bfloat16, 512)])
def test_chunked_kernel_on_cuda_matches_reference(dtype, head_dim):
    # fp32 and head_dim 512 are outside FA2's limits: the chunked kernel runs on the GPU.
    assert chunk_backends.backend_for(CUDA) is chunk_backends.MATH
    assert not POLICY.choose(facts_of(CUDA, dtype, head_dim)).fast
    _check_on_cuda(dtype, head_dim, (255, 0), True, 700, 700)
