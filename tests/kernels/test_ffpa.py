"""ffpa-attn's kernel (kernels/ffpa.py) on the CPU, over tests/helpers/ffpa_emulation.py, a stand-in for
the ``ffpa_attn`` package written from its documented call contract and installed under that
name for each test only. The op runs as users call it (``sliding_window_attention``: the policy
routes it), forward and every gradient against the fp64 reference; then which calls the kernel
takes, and why not the others."""

import sys

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels import chunked, fa2, ffpa, policy
from compile_pass.kernels import contract as kernel
from compile_pass.kernels.policy import facts_of
from compile_pass.ops import runtime_mask
from tests.helpers import ffpa_emulation
from tests.helpers.attention_reference import fa2_window_mask, forward_and_grads, random_qkv, reference_attention
from tests.helpers.models import Capture, tiny_gemma4, token_batch

GPU = (9, 0)
CUDA = torch.device("cuda")
# A crossover table as gpu_check.py would fill it (none is measured yet): every length wins.
MEASURED = ffpa.FFPAKernel({(GPU, torch.bfloat16): 1, (GPU, torch.float16): 1})
# Largest error, relative to max(1, largest reference value), for the op's out, dq, dk, dv and
# the sinks' gradient: the emulation rounds once from fp64, the op then adds its own roundings
# (the gradient scaled for sinks, dK/dV summed over varlen passes in fp32), as for FA2
# (tests/kernels/flash_contract_cases.py).
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture
def installed(monkeypatch):
    """ffpa_attn is the emulation, asked for, on an emulated sm90 GPU where a crossover was
    measured: CPU tensors take the kernel where it is fast (before the chunked kernel, which
    takes the rest)."""
    ffpa_emulation.install(monkeypatch)
    monkeypatch.setenv(ffpa.USE_VARIABLE, "1")
    monkeypatch.setattr(fa2, "device_capability", lambda device: GPU)
    monkeypatch.setattr(ffpa_emulation, "device_capability", GPU)
    monkeypatch.setattr(policy, "POLICY", policy.KernelPolicy((MEASURED, chunked.ChunkedKernel())))
    ffpa._loaded.cache_clear()
    ffpa_emulation.calls.clear()
    yield
    ffpa._loaded.cache_clear()


def _check(q, k, v, window, sinks=None, **masks):
    """The op against the fp64 reference: out, dq, dk, dv (and the sinks' gradient)."""
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    expected = forward_and_grads(
        lambda q, k, v, s=None: reference_attention(q, k, v, *window, sinks=s, **masks), ref_inputs, grad_out
    )
    got = forward_and_grads(
        lambda q, k, v, s=None: sliding_window_attention(q, k, v, window=window, causal=False, sinks=s, **masks),
        inputs,
        grad_out,
    )
    ours, theirs = (got[0], *got[1]), (expected[0], *expected[1])
    names = ("out", "dq", "dk", "dv", "d sinks")[: len(ours)]  # d sinks where the call has sinks
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        error = (a.double() - b).abs().max().item()
        assert error <= TOLERANCE[q.dtype] * max(1.0, b.abs().max().item()), (name, error)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads", "kv_heads", "seq_q", "seq_k", "window"),
    [
        (torch.bfloat16, 512, 4, 2, 40, 40, (-1, 0)),  # Gemma-4's global layer, GQA 2:1
        (torch.float16, 320, 2, 1, 33, 33, (-1, 0)),
        (torch.bfloat16, 320, 2, 2, 20, 30, (-1, -1)),  # full attention, fewer queries than keys
    ],
    ids=["causal-512-gqa", "causal-320-fp16", "full-Sq<Sk"],
)
def test_dense_calls_match_fp64(installed, dtype, head_dim, heads, kv_heads, seq_q, seq_k, window):
    _check(*random_qkv(2, heads, kv_heads, seq_q, seq_k, head_dim, dtype), window)
    # The forward, and the backward's recomputation under autograd: ffpa ran both.
    assert ffpa_emulation.calls == {"varlen": 2, "varlen recording a graph": 1}


def test_packed_and_padded_rows_match_fp64(installed):
    """Causal, head_dim 512, GQA 2:1: three documents packed in a row (segment ids), then a
    batch with a left-padded and a right-padded row: the varlen layouts' calls (the padded
    rows after a run see it all, as SDPA computes them), every row against fp64."""
    q, k, v = random_qkv(1, 4, 2, 37, 37, 512, torch.bfloat16)
    _check(q, k, v, (-1, 0), segment_ids=torch.tensor([[3] * 10 + [7] * 20 + [9] * 7]))
    assert ffpa_emulation.calls == {"varlen": 2, "varlen recording a graph": 1}
    q, k, v = random_qkv(2, 4, 2, 24, 24, 512, torch.bfloat16, seed=1)
    key_padding = torch.ones(2, 24, dtype=torch.bool)
    key_padding[0, :5] = False
    key_padding[1, 18:] = False
    ffpa_emulation.calls.clear()
    _check(q, k, v, (-1, 0), key_padding=key_padding)
    assert ffpa_emulation.calls["varlen recording a graph"] >= 1  # the sequences' pass, and the padded rows' after them


def test_sinks_and_the_backwards_given_output(installed):
    """With sinks the op calls the backward with the output rescaled (not the one ffpa
    computed): the recomputation's logsumexp term makes it FA2's backward all the same."""
    q, k, v = random_qkv(1, 4, 2, 30, 30, 320, torch.bfloat16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    _check(q, k, v, (-1, 0), sinks=sinks)
    assert ffpa_emulation.calls["varlen recording a graph"] == 1


def test_the_calls_it_takes_and_why_not_the_others(installed, monkeypatch):
    take = dict(keys=4096, left=-1, right=0)
    choice = policy.POLICY.choose(facts_of(CUDA, torch.bfloat16, 512, **take))
    assert choice.kernel is MEASURED and choice.fast
    assert policy.POLICY.choose(facts_of(CUDA, torch.float16, 320, key_padding=True, **take)).name.startswith(
        "ffpa-attn varlen"
    )
    assert policy.POLICY.choose(facts_of(CUDA, torch.bfloat16, 512, **dict(take, right=-1))).kernel is MEASURED
    for facts, why in (
        (facts_of(CUDA, torch.float32, 512, **take), "takes fp16 or bf16, not torch.float32"),
        (facts_of(CUDA, torch.bfloat16, 256, **take), "takes head_dim 320-512 in steps of 32, not 256"),
        (facts_of(CUDA, torch.bfloat16, 330, **take), "not 330"),
        (facts_of(CUDA, torch.bfloat16, 576, **take), "not 576"),
        (facts_of(CUDA, torch.bfloat16, 512, **dict(take, left=1023)), "not window (1023, 0)"),
        (facts_of(CUDA, torch.bfloat16, 512, **dict(take, right=4)), "not window (-1, 4)"),
        (facts_of(CUDA, torch.bfloat16, 512, keys=4096), "this call's window is not known here"),
        (facts_of(CUDA, torch.bfloat16, 512, same_lengths=False, **take), "causal calls with Sq == Sk only"),
        (facts_of(CUDA, torch.bfloat16, 512, blocks=True, **take), "takes no image blocks"),
        (facts_of(CUDA, torch.bfloat16, 512, key_padding=True, segment_ids=True, **take), "not both"),
    ):
        assert why in ffpa.FFPA_ATTN.cannot(facts), (facts, ffpa.FFPA_ATTN.cannot(facts))
    assert "sm80 or newer" in _reason_on((7, 5))
    assert "runs only on CUDA, not cpu" in _reason_on(None, device="cpu")
    assert "no CUDA GPU is available" in _reason_on(None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.version, "hip", "6.4")
        assert "do not run on ROCm" in _reason_on(GPU)
    ffpa_emulation.install(monkeypatch, "0.2.3")
    assert "ffpa-attn 0.2.3 is installed; 0.2.4 or newer is needed" in _reason_on(GPU)
    monkeypatch.setitem(sys.modules, "ffpa_attn.cute", None)  # its CuTe-DSL backend does not load
    assert "ffpa-attn >= 0.2.4 is not installed or does not load (ModuleNotFoundError" in _reason_on(GPU)
    monkeypatch.setitem(sys.modules, "ffpa_attn", None)  # not installed
    assert "ffpa-attn >= 0.2.4 is not installed or does not load" in _reason_on(GPU)
    monkeypatch.delenv(ffpa.USE_VARIABLE)
    assert "used only when asked for (COMPILE_PASS_FFPA=1)" in _reason_on(GPU)
    assert ffpa_emulation.calls == {}


def _reason_on(capability, device=CUDA):
    ffpa._loaded.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa2, "device_capability", lambda device: capability)
        return ffpa.FFPA_ATTN.cannot(facts_of(device, torch.bfloat16, 512, keys=4096, left=-1, right=0))


def test_lengths_and_measured_crossovers(installed, monkeypatch):
    """Asked for but measured on no GPU (the shipped table): never taken, and the reason says
    so; a measured crossover for the GPU and dtype routes from its length, and another dtype
    stays unmeasured; COMPILE_PASS_SHORT_KEYS sets one for all measured ones."""
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)

    def fast(chosen, keys, dtype=torch.bfloat16):
        return chosen.choose(facts_of(CUDA, dtype, 512, keys=keys, left=-1, right=0)).fast

    shipped = policy.POLICY.replacing(ffpa.FFPA_ATTN)
    assert not fast(shipped, 32768)
    reason = shipped.choose(facts_of(CUDA, torch.bfloat16, 512, keys=32768, left=-1, right=0)).reason
    assert "ffpa-attn is not measured on a GPU yet" in reason and "no crossover for sm90 torch.bfloat16" in reason
    measured = policy.POLICY.replacing(ffpa.FFPAKernel({(GPU, torch.bfloat16): 4096}))
    assert fast(measured, 4096) and not fast(measured, 4095) and not fast(measured, 32768, torch.float16)
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", "100")
    assert fast(measured, 101) and not fast(measured, 100)


def test_a_global_layer_goes_to_ffpa_when_asked(installed, monkeypatch):
    """Gemma-4 in bf16 with a global layer of head_dim 512: asked for, the sliding rule takes
    that layer, window (-1, 0), to ffpa (which then runs it, emulated), and the mask-input op
    runs its band there; not asked for, the layer keeps the causal rule's SDPA as before."""
    inputs = {"input_ids": token_batch(24), "use_cache": False}
    model = tiny_gemma4(torch.bfloat16, global_head_dim=512)
    expected = model(**inputs).logits.float()
    for asked in (True, False):
        if not asked:
            monkeypatch.delenv(ffpa.USE_VARIABLE)
        torch._dynamo.reset()
        ffpa_emulation.calls.clear()
        capture = Capture()
        logits = torch.compile(model, backend=capture, fullgraph=True)(**inputs).logits.float()
        (full,) = [d for d in capture.report if d.layer_type == "full_attention"]
        if asked:
            assert (full.rule, full.rewritten) == ("sliding_window", True) and full.kernel.startswith("ffpa-attn"), full
            assert "(-1, 0)" in full.reason and ffpa_emulation.calls["varlen"] == 1
        else:
            assert (full.rule, full.rewritten) == ("causal_mask", True) and not ffpa_emulation.calls, full
        torch.testing.assert_close(logits, expected, atol=3e-2, rtol=3e-2)
    monkeypatch.setenv(ffpa.USE_VARIABLE, "1")
    q, k, v = random_qkv(2, 2, 2, 40, 40, 512, torch.bfloat16)
    mask = fa2_window_mask(40, 40, -1, 0).expand(2, 1, 40, 40)
    facts, padding = torch.ops.compile_pass.mask_facts(mask)
    assert runtime_mask.decide(q, k, mask, facts, padding)[:3] == (runtime_mask.BAND, -1, 0)
    monkeypatch.delenv(ffpa.USE_VARIABLE)
    assert runtime_mask.decide(q, k, mask, facts, padding)[0] == runtime_mask.CAUSAL
