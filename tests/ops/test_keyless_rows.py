"""Rows that see no key as an additive mask's finite fill gives them (``ops/keyless_rows.py``):
the op with ``keyless_mean`` against the fp64 spelled-out chain (scores, soft-capped where
asked, plus a mask of 0 and the fp64 minimum, softmax, @ v: ``reference_attention(fill=)``),
the output and every gradient, every row; on each kernel the CPU runs (the chunked kernel's
chunks and whole calls, the document kernel) and the wide-head Triton kernel (interpreted).

Tolerances, relative to max(1, largest reference value), as tests/ops/test_sinks.py's.
"""

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels import chunked, documents, policy, wide_head
from compile_pass.kernels.chunked import whole_calls
from compile_pass.kernels.contract import AttentionCall, only_kernel
from compile_pass.ops import sliding_window_attention_forward
from compile_pass.ops.keyless_rows import KEYLESS_CHECK
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import tune_chunks

FILL = torch.finfo(torch.float64).min
BOUND = 2.0**100  # below what float32's minimum hides (its spacing there is 2**104)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    tune_chunks(monkeypatch, query_chunk=16)


def _masks(form, batch, seq):
    """Padding that leaves rows without keys: left padding (causal rows before the first token
    see none), a row of padding alone, right padding farther than a window reaches."""
    if form == "packed":  # packed documents behind left padding
        ids = torch.zeros(batch, seq, dtype=torch.long)
        ids[:, seq // 2 :] = 1
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[0, :7] = False
        return {"segment_ids": ids, "key_padding": padding}
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[0, : seq // 3] = False
    if batch > 1:
        padding[1, 10:] = False  # a window's rows past 10 + its reach see only padding
    if batch > 2:
        padding[2] = False
    return {"key_padding": padding}


def _check(q, k, v, window, softcap=0.0, **masks):
    """The op with ``keyless_mean`` against the fp64 chain: out, dq, dk, dv; returns out."""
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v)

    def op(q, k, v):
        return sliding_window_attention(
            q, k, v, window=window, causal=False, scale=0.25, softcap=softcap, keyless_mean=BOUND, **masks
        )

    def chain(q, k, v):
        return reference_attention(q, k, v, *window, 0.25, softcap=softcap, fill=FILL, **masks)

    out, grads = forward_and_grads(op, inputs, grad_out)
    ref_out, ref_grads = forward_and_grads(chain, [x.detach().double().requires_grad_() for x in inputs], grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert torch.isfinite(a).all(), name
        error = (a.double() - b).abs().max().item()
        allowed = TOLERANCE[q.dtype] * max(1.0, b.abs().max().item())
        assert error <= allowed, f"{name}: max error {error:.3g} > {allowed:.3g}"
    return out


def _route(q, k, v, window, **masks):
    call = AttentionCall(q, k, v, *window, 0.25, masks.get("key_padding"), masks.get("segment_ids"))
    return policy.POLICY.route(call)


# (name, seq, window, form, the kernel and plan the CPU routes to)
CASES = [
    ("sliding, padded", 96, (7, 0), "padded", "chunks"),
    ("sliding, padded, short", 40, (7, 0), "padded", "whole call"),
    ("two-sided, padded", 96, (6, 6), "padded", "chunks"),
    ("bidirectional, padded", 40, (-1, -1), "padded", "documents"),
    ("full causal, padded", 40, (-1, 0), "padded", "documents"),
    ("sliding, packed behind padding", 96, (7, 0), "packed", "chunks"),
]


def _kernel_of(route) -> str:
    if route.kernel is documents.DOCUMENTS:
        return "documents"
    assert isinstance(route.kernel, chunked.ChunkedKernel)
    return "whole call" if isinstance(route.plan, whole_calls.WholeCall) else "chunks"


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["uncapped", "capped"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("name", "seq", "window", "form", "kernel"), CASES, ids=[case[0] for case in CASES])
def test_rows_without_keys_get_the_chains_mean_and_gradient(name, seq, window, form, kernel, dtype, softcap):
    q, k, v = random_qkv(3, 4, 2, seq, seq, 16, DTYPES[dtype])  # GQA: 2 query heads per KV head
    masks = _masks(form, 3, seq)
    assert _kernel_of(_route(q, k, v, window, **masks)) == kernel
    out = _check(q, k, v, window, softcap, **masks)
    if form != "padded":
        return
    # Row 2 is padding alone: every row is the mean of its kv head's values.
    mean = v[2].detach().double().mean(dim=1).repeat_interleave(2, 0)
    torch.testing.assert_close(out[2].double(), mean[:, None, :].expand_as(out[2]), **_close(q.dtype))


def _close(dtype):
    return dict(atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype] * 4)


def test_more_queries_than_keys():
    """Sq > Sk under a causal window: the first Sq - Sk rows see no key, bottom-right aligned."""
    q, k, v = random_qkv(1, 4, 2, 20, 8, 16, torch.float64)
    out = _check(q, k, v, (3, 0))
    assert not (out[:, :, :12] == 0).any()


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["uncapped", "capped"])
def test_the_wide_head_kernel_under_triton(softcap):
    """The wide-head Triton kernel (head_dim 64), interpreted on the CPU, every call of the op
    routed to it: the mode is applied around whichever kernel runs."""
    q, k, v = random_qkv(2, 2, 1, 32, 32, 64, torch.float32)
    masks = _masks("padded", 2, 32)
    with only_kernel(wide_head.WIDE_HEAD):
        _check(q, k, v, (5, 0), softcap, **masks)


def test_scores_the_fill_may_not_hide_raise():
    """A score near the bound (or NaN) fails the run-time check: the fill would not hide it."""
    q, k, v = random_qkv(1, 2, 1, 16, 16, 8, torch.float32)
    masks = {"key_padding": torch.arange(16)[None] >= 4}
    with torch.no_grad():
        huge = sliding_window_attention(q, k, v, window=(3, 0), keyless_mean=BOUND, **masks)
        assert huge.isfinite().all()
        with pytest.raises(RuntimeError, match="fill may not hide"):
            sliding_window_attention(q * 2.0**60, k * 2.0**40, v, window=(3, 0), keyless_mean=BOUND, **masks)
        with pytest.raises(RuntimeError, match="fill may not hide"):
            sliding_window_attention(q.clone().fill_(float("nan")), k, v, window=(3, 0), keyless_mean=BOUND, **masks)
    assert KEYLESS_CHECK.startswith("compile_pass:")


def test_rows_with_keys_are_untouched_and_zeros_stay_the_default():
    """Without the mode a row that sees no key is 0; with it only such rows change."""
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16, torch.float32)
    masks = _masks("padded", 2, 40)
    with torch.no_grad():
        zeros = sliding_window_attention(q, k, v, window=(7, 0), **masks)
        means = sliding_window_attention(q, k, v, window=(7, 0), keyless_mean=BOUND, **masks)
    changed = (zeros != means).any(dim=-1)
    assert changed.any()
    assert (zeros[changed] == 0).all()


def test_rejects_the_mode_with_sinks_or_below_zero():
    q, k, v = random_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="without sinks"):
        sliding_window_attention(q, k, v, window=(3, 0), sinks=torch.zeros(4), keyless_mean=BOUND)
    with pytest.raises(ValueError, match="must be >= 0"):
        sliding_window_attention(q, k, v, window=(3, 0), keyless_mean=-1.0)


def test_under_torch_compile_and_opcheck():
    torch._dynamo.reset()
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16, torch.float32)
    masks = _masks("padded", 2, 40)

    def attend(q, k, v):
        return sliding_window_attention(q * 2.0, k, v, window=(7, 0), keyless_mean=BOUND, **masks)

    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, grads = forward_and_grads(torch.compile(attend, backend="aot_eager", fullgraph=True), (q, k, v), grad_out)
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v: reference_attention(q * 2.0, k, v, 7, 0, fill=FILL, **masks),
        [x.detach().double().requires_grad_() for x in (q, k, v)],
        grad_out,
    )
    for a, b in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5)
    padding = masks["key_padding"]
    torch.library.opcheck(
        sliding_window_attention_forward,
        (q, k, v, 7, 0, 0.25, padding),
        {"keyless_mean": BOUND},
    )
