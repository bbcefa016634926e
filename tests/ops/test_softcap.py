"""Soft-capped scores (FA2's ``softcap``: ``cap * tanh(s / cap)`` before the mask, Gemma-2's
``attn_logit_softcapping``) on the sliding-window op, against the fp64 spelled-out form
(``reference_attention(..., softcap=)``): the output and every gradient, through the chunked
kernel called directly and through the op, every batch form, with sinks per head and per row.
flash-attn's kernels take it in tests/kernels/flash_contract_cases.py; the rule that reads the tanh
chain is tested in tests/rules/test_spelled_softcap.py.

Tolerances as tests/ops/test_sinks.py's: relative to max(1, largest reference value), fp64 1e-10,
fp32 2e-5, bf16 1.6e-2.
"""

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels import chunked, policy
from compile_pass.kernels import contract as kernel
from compile_pass.kernels.chunked import backends as chunk_backends
from compile_pass.kernels.chunked.plan import BatchMasks, ChunkTuning
from compile_pass.kernels.contract import CallFacts
from compile_pass.ops import sliding_window_attention_forward
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import tune_chunks
from tests.ops.test_sinks import TOLERANCE, W, _masks, _sinks

CAP = 1.5  # scores of q ~ 3 N(0, 1) reach several caps: tanh's saturation is exercised
SCALE = 0.25


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    tune_chunks(monkeypatch, query_chunk=16)


def _inputs(seq, dtype, heads=4, kv_heads=2):
    q, k, v = random_qkv(2, heads, kv_heads, seq, seq, 16, dtype)
    return (q.detach() * 3).requires_grad_(), k, v  # scores well past the cap


def _compare(ours, refs, dtype):
    for name, a, b in zip(("out", "dq", "dk", "dv", "d sinks"), ours, refs, strict=False):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        error = (a.double() - b).abs().max().item()
        allowed = TOLERANCE[dtype] * max(1.0, b.abs().max().item())
        assert error <= allowed, f"{name}: max error {error:.3g} > {allowed:.3g}"


def _check(q, k, v, window, sinks=None, cap=CAP, **masks):
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)

    def op(q, k, v, s=None):
        return sliding_window_attention(
            q, k, v, window=window, causal=False, scale=SCALE, softcap=CAP, sinks=s, **masks
        )

    def reference(q, k, v, s=None):
        return reference_attention(q, k, v, *window, SCALE, sinks=s, softcap=CAP, **masks)

    out, grads = forward_and_grads(op, inputs, grad_out)
    ref_out, ref_grads = forward_and_grads(reference, [x.detach().double().requires_grad_() for x in inputs], grad_out)
    _compare((out, *grads), (ref_out, *ref_grads), q.dtype)
    return out, grads


CASES = [
    ("sliding", 120, (W - 1, 0), ""),
    ("sliding, short", 40, (W - 1, 0), ""),
    ("full causal", 60, (-1, 0), ""),
    ("two-sided band", 120, (9, 4), ""),
    ("sliding, padded", 120, (W - 1, 0), "padded"),
    ("full causal, padded", 60, (-1, 0), "padded"),
    ("sliding, packed", 120, (W - 1, 0), "packed"),
    ("sliding, images", 48, (W - 1, 0), "images"),
]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


# Every case in fp64; the low-precision dtypes on the forms that differ in how they round.
DTYPE_CASES = [(*case, "fp64") for case in CASES] + [
    (*case, dtype)
    for case in CASES
    if case[0] in ("sliding", "sliding, padded", "sliding, packed")
    for dtype in ("fp32", "bf16")
]


@pytest.mark.parametrize(
    ("name", "seq", "window", "form", "dtype"), DTYPE_CASES, ids=[f"{case[0]}-{case[-1]}" for case in DTYPE_CASES]
)
def test_softcap_matches_the_spelled_out_form(name, seq, window, form, dtype):
    q, k, v = _inputs(seq, DTYPES[dtype])  # GQA: 2 query heads per KV head
    masks = _masks(form, 2, seq)
    out, (dq, *_) = _check(q, k, v, window, **masks)
    if form == "padded" and window[1] == 0:  # row 0's first rows see only padding: zeros, no gradient
        assert (out[0, :, : seq // 3] == 0).all() and (dq[0, :, : seq // 3] == 0).all()


@pytest.mark.parametrize("per", ["head", "row"])
@pytest.mark.parametrize("form", ["", "padded", "packed"])
def test_softcap_with_sinks(form, per):
    """Sinks apply to the capped scores' logsumexp; the sink itself is not capped."""
    seq = 64
    q, k, v = _inputs(seq, torch.float64)
    sinks = _sinks(4, torch.float64) if per == "head" else _row_sinks(2, 4, seq, torch.float64)
    _check(q, k, v, (W - 1, 0), sinks.requires_grad_(), **_masks(form, 2, seq))


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
@pytest.mark.parametrize("form", ["", "padded"])
def test_a_cap_above_the_unshifted_range(form, dtype):
    """Above ``UNSHIFTED_SOFTCAP`` exp(t) may leave the float range: the rows are shifted by
    their max, as softmax is; scores of q ~ 60 N(0, 1) reach the cap."""
    q, k, v = _inputs(64, DTYPES[dtype])
    q = (q.detach() * 20).requires_grad_()
    _check(q, k, v, (W - 1, 0), cap=2 * chunk_backends.UNSHIFTED_SOFTCAP, **_masks(form, 2, 64))


@pytest.mark.slow
def test_the_compiled_math_of_large_calls(monkeypatch):
    """Calls of at least ``COMPILED_SOFTCAP_SCORES`` scores run the same math compiled by inductor
    (here every call: the threshold set to 0), forward and backward against fp64."""
    monkeypatch.setattr(chunk_backends, "COMPILED_SOFTCAP_SCORES", 0)
    for math in (chunk_backends._CAPPED_FORWARD, chunk_backends._CAPPED_BACKWARD):
        monkeypatch.setattr(math, "compiled", None)
    q, k, v = _inputs(120, torch.float32)
    _check(q, k, v, (W - 1, 0), **_masks("padded", 2, 120))
    assert chunk_backends._CAPPED_FORWARD.compiled is not None and chunk_backends._CAPPED_BACKWARD.compiled is not None
    assert not chunk_backends._CompiledMath.broken


def _row_sinks(batch, heads, seq, dtype, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return (3 + torch.randn(batch, heads, seq, generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize(
    ("form", "window"),
    [("padded", (-1, 0)), ("packed", (-1, 0)), ("", (W - 1, 0))],
    ids=["causal-padded", "causal-packed", "sliding"],
)
def test_causal_calls_run_in_blocks_of_rows(monkeypatch, form, window):
    """A causal call's rows in blocks (``CAUSAL_BLOCK_ROWS``, here 16 of the 48 and more rows the
    plan's causal run holds), each over the keys up to its last row, masks and all."""
    monkeypatch.setattr(chunk_backends, "CAUSAL_BLOCK_ROWS", 16)
    tune_chunks(monkeypatch, query_chunk=48)
    blocked = []
    blocks = chunk_backends._causal_blocks
    monkeypatch.setattr(chunk_backends, "_causal_blocks", lambda *a: blocked.append(blocks(*a)) or blocked[-1])
    q, k, v = _inputs(100, torch.float64)
    _check(q, k, v, window, **_masks(form, 2, 100))
    assert any(len(b) > 1 for b in blocked)


@pytest.mark.parametrize("form", ["", "padded", "packed", "images"])
def test_the_chunked_kernel_directly(form):
    """chunked_forward / chunked_backward on the soft-capping backend, without the op."""
    seq, window = 90, (W - 1, 0)
    q, k, v = (x.detach() for x in _inputs(seq, torch.float64))
    masks = _masks(form, 2, seq)
    batch_masks = BatchMasks(masks.get("key_padding"), masks.get("segment_ids"), masks.get("block_ids"))
    backend = chunk_backends.softcapped(CAP)
    tuning = ChunkTuning(query_chunk=16)
    out, lse = chunked.chunked_forward(q, k, v, *window, SCALE, batch_masks, backend=backend, tuning=tuning)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = chunked.chunked_backward(
        grad_out, q, k, v, out, lse, *window, SCALE, batch_masks, backend=backend, tuning=tuning
    )
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v: reference_attention(q, k, v, *window, SCALE, softcap=CAP, **masks), inputs, grad_out
    )
    _compare((out, *grads), (ref_out, *ref_grads), torch.float64)


def test_softcap_under_torch_compile_and_opcheck():
    torch._dynamo.reset()
    q, k, v = _inputs(64, torch.float32)
    padding = _masks("padded", 2, 64)["key_padding"]
    torch.library.opcheck(
        sliding_window_attention_forward, (q, k, v, W - 1, 0, SCALE, padding, None, None, None, None, None, CAP)
    )

    def attend(q, k, v):
        return sliding_window_attention(q, k, v, window=(W - 1, 0), scale=SCALE, softcap=CAP, key_padding=padding)

    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, grads = forward_and_grads(torch.compile(attend, backend="aot_eager", fullgraph=True), (q, k, v), grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v: reference_attention(q, k, v, W - 1, 0, SCALE, softcap=CAP, key_padding=padding),
        ref_inputs,
        grad_out,
    )
    _compare((out, *grads), (ref_out, *ref_grads), torch.float32)


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan")])
def test_rejects_a_softcap_that_is_not_a_finite_number_at_least_0(softcap):
    q, k, v = random_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        sliding_window_attention(q, k, v, window=(3, 0), softcap=softcap)


def test_the_policy_routes_soft_capped_calls_by_their_own_crossover(monkeypatch):
    """On the CPU the chunked kernel takes soft-capped calls (matmul/softmax per chunk) from
    the crossover against the compiled chain (``chunked.SOFTCAP_SHORT_KEYS``); on a GPU it is
    not measured, and torch's FA2, which has no softcap, cannot take them."""
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)  # the measured crossovers, not the suite's 0
    plain = policy.KernelPolicy()
    fewest = chunked.SOFTCAP_SHORT_KEYS[torch.float32] + 1
    facts = CallFacts(torch.device("cpu"), torch.float32, 64, keys=fewest, left=127, right=0, softcap=True)
    choice = plain.choose(facts)
    assert (
        isinstance(choice.kernel, chunked.ChunkedKernel)
        and choice.name == "chunked, soft-capped matmul/softmax per chunk"
    )
    short = plain.choose(facts._replace(keys=fewest - 1))
    assert not short.fast and "too few for the band to repay" in short.reason
    gpu = plain.choose(facts._replace(device=torch.device("cuda"), dtype=torch.bfloat16))
    assert not gpu.fast and "soft-capped scores run an unfused matmul/softmax per chunk" in gpu.reason
    assert plain.choose(facts._replace(left=-1, keys=8192)).fast  # causal: scored in blocks of rows
    no_band = plain.choose(facts._replace(left=-1, right=-1, keys=8192))
    assert not no_band.fast and "the band skips too little" in no_band.reason
