"""Attention sinks (one logit per query head) on the sliding-window op, against the fp64
spelled-out form transformers' eager GPT-OSS attention runs (scores, the sink column
concatenated, softmax, the column dropped, @ v; ``reference_attention(..., sinks=)``):
the output and every gradient, the sinks' included, through the chunked kernel's chunks and
its whole call; and against transformers' own GPT-OSS eager attention. The FA2 kernels are
checked in tests/kernels/flash_contract_cases.py, the mask-input op in tests/rules/test_mask_input.py,
context parallel in tests/parallel/test_context_parallel.py.

Tolerances, relative to max(1, largest reference value): fp64 1e-10, fp32 2e-5, bf16 1.6e-2
(tests/kernels/flash_contract_cases.py's, for the same inputs ~ N(0, 1)).
"""

import pytest
import torch

from compile_pass import sliding_window_attention
from compile_pass.kernels import policy
from compile_pass.kernels.chunked import whole_calls
from compile_pass.kernels.contract import AttentionCall
from compile_pass.ops import sliding_window_attention_forward
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import tune_chunks

W = 24
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # 16-row chunks: a bounded window over 120 keys runs chunks, over 40 one whole call.
    tune_chunks(monkeypatch, query_chunk=16)


def _masks(form, batch, seq):
    if form == "padded":  # row 0 left-padded (its first rows see no key), row 1 right-padded with a hole
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[0, : seq // 3] = False
        padding[1, -5:] = False
        padding[1, seq // 2] = False
        return {"key_padding": padding}
    if form == "packed":
        ids = torch.zeros(batch, seq, dtype=torch.long)
        ids[0, seq // 4 :] = 1
        ids[0, seq // 4 + 6 :] = 2  # a segment shorter than the window
        ids[1, seq // 2 :] = 9
        return {"segment_ids": ids}
    if form == "images":
        ids = torch.full((batch, seq), -1)
        ids[0, 3:33] = 0
        ids[1, 20:26] = 4
        return {"block_ids": ids}
    return {}


def _sinks(heads, dtype, seed=7):
    # Around a row's logsumexp over a few dozen keys (~3-4): c = sigmoid(lse - sink) is far from 0 and 1.
    return (3 + torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).to(dtype)


def _plan(q, k, v, window, masks) -> str:
    call = AttentionCall(
        q, k, v, *window, 0.25, masks.get("key_padding"), masks.get("segment_ids"), masks.get("block_ids")
    )
    return "whole call" if isinstance(policy.POLICY.route(call).plan, whole_calls.WholeCall) else "chunks"


def _check(q, k, v, sinks, window, **masks):
    """The op's output and (dq, dk, dv, d sinks) against the fp64 spelled-out form; returns them."""
    left, right = window
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v, sinks)
    op = lambda q, k, v, s: sliding_window_attention(q, k, v, window=window, causal=False, sinks=s, **masks)  # noqa: E731
    out, grads = forward_and_grads(op, inputs, grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v, s: reference_attention(q, k, v, left, right, sinks=s, **masks), ref_inputs, grad_out
    )
    assert out.dtype == q.dtype and grads[3].dtype == sinks.dtype
    for name, a, b in zip(("out", "dq", "dk", "dv", "d sinks"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert torch.isfinite(a).all(), name
        error = (a.double() - b).abs().max().item()
        allowed = TOLERANCE[q.dtype] * max(1.0, b.abs().max().item())
        assert error <= allowed, f"{name}: max error {error:.3g} > {allowed:.3g}"
    return out, grads


# (name, seq, window, form, the chunked kernel's plan)
CASES = [
    ("sliding", 120, (W - 1, 0), "", "chunks"),
    ("sliding, short", 40, (W - 1, 0), "", "whole call"),
    ("full causal", 60, (-1, 0), "", "whole call"),
    ("two-sided band", 120, (9, 4), "", "chunks"),
    ("sliding, padded", 120, (W - 1, 0), "padded", "chunks"),
    ("sliding, padded, short", 40, (W - 1, 0), "padded", "whole call"),
    ("full causal, padded", 60, (-1, 0), "padded", "whole call"),
    ("sliding, packed", 120, (W - 1, 0), "packed", "chunks"),
    ("sliding, packed, short", 40, (W - 1, 0), "packed", "whole call"),
    ("sliding, images", 48, (W - 1, 0), "images", "chunks"),
]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("name", "seq", "window", "form", "plan"), CASES, ids=[case[0] for case in CASES])
def test_sinks_match_the_spelled_out_form(name, seq, window, form, plan, dtype):
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, DTYPES[dtype])  # GQA: 2 query heads per KV head
    sinks = _sinks(4, DTYPES[dtype]).requires_grad_()
    masks = _masks(form, 2, seq)
    assert _plan(q, k, v, window, masks) == plan
    out, (dq, *_) = _check(q, k, v, sinks, window, **masks)
    if form == "padded" and window[1] == 0:  # row 0's first rows see only padding: zeros, no gradient
        assert (out[0, :, : seq // 3] == 0).all() and (dq[0, :, : seq // 3] == 0).all()


def _row_sinks(batch, heads, seq, dtype, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return (3 + torch.randn(batch, heads, seq, generator=gen, dtype=torch.float64)).to(dtype)


ROW_CASES = [
    case
    for case in CASES
    if case[0] in ("sliding", "sliding, short", "full causal, padded", "sliding, packed", "sliding, images")
]


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
@pytest.mark.parametrize(("name", "seq", "window", "form", "plan"), ROW_CASES, ids=[case[0] for case in ROW_CASES])
def test_sinks_per_row_match_the_spelled_out_form(name, seq, window, form, plan, dtype):
    """A sink logit per (batch, head, query row) (Inkling2's, from the hidden states), with its
    per-row gradient."""
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, DTYPES[dtype])
    sinks = _row_sinks(2, 4, seq, DTYPES[dtype]).requires_grad_()
    masks = _masks(form, 2, seq)
    assert _plan(q, k, v, window, masks) == plan
    _, grads = _check(q, k, v, sinks, window, **masks)
    assert grads[3].shape == (2, 4, seq)


def test_rows_without_keys_and_sinks_of_another_dtype():
    """Sq > Sk under a causal window: the first Sq - Sk rows see no key and return zeros; bf16
    inputs with fp32 sinks, whose gradient comes back in fp32."""
    q, k, v = random_qkv(1, 4, 2, 10, 4, 16, torch.bfloat16)
    sinks = _sinks(4, torch.float32).requires_grad_()
    out, (dq, *_) = _check(q, k, v, sinks, (2, 0))
    assert (out[:, :, :6] == 0).all() and (dq[:, :, :6] == 0).all()
    assert (out[:, :, 6:] != 0).any()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_sinks_under_torch_compile(backend):
    """fullgraph: the op traced with its fake; the sinks' backward compiled (inductor, 15 s: slow)."""
    torch._dynamo.reset()
    q, k, v = random_qkv(2, 4, 2, 120, 120, 16, torch.float32)
    sinks = _sinks(4, torch.float32).requires_grad_()
    masks = _masks("padded", 2, 120)

    def attend(q, k, v, s):
        return sliding_window_attention(q * 2.0, k, v, window=(W - 1, 0), sinks=s * 1.5, **masks)

    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out, grads = forward_and_grads(torch.compile(attend, backend=backend, fullgraph=True), (q, k, v, sinks), grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    ref_out, ref_grads = forward_and_grads(
        lambda q, k, v, s: reference_attention(q * 2.0, k, v, W - 1, 0, sinks=s * 1.5, **masks), ref_inputs, grad_out
    )
    for a, b in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=5e-5)


def test_opcheck_with_sinks():
    q, k, v = random_qkv(2, 4, 2, 40, 40, 16, torch.float32)
    sinks = _sinks(4, torch.float32).requires_grad_()
    padding = _masks("padded", 2, 40)["key_padding"]
    torch.library.opcheck(
        sliding_window_attention_forward, (q, k, v, W - 1, 0, 0.25, padding, None, None, None, None, sinks)
    )


def test_rejects_bad_sinks():
    q, k, v = random_qkv(1, 4, 2, 8, 8, 16, torch.float32)
    for sinks, message in [
        (torch.zeros(2), "2 logits for 4 query heads"),
        (torch.zeros(4, dtype=torch.long), "floating tensor of one logit"),
        (torch.zeros(1, 4), "floating tensor of one logit"),
        (torch.zeros(1, 4, 7), r"not one per \(batch, head, row\): \(1, 4, 8\)"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            sliding_window_attention(q, k, v, window=(3, 0), sinks=sinks)


@pytest.mark.parametrize("sliding_window", [8, None], ids=["sliding", "full"])
def test_equals_transformers_gpt_oss_eager_attention(sliding_window):
    """transformers' own GPT-OSS eager attention (``eager_attention_forward`` on a
    ``GptOssAttention`` and its ``sinks`` parameter, with the additive mask it is handed)
    against the op, fp64: the output and every gradient, the sinks' parameter's included."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

    config = GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        sliding_window=8,
        attn_implementation="eager",
    )
    module = GptOssAttention(config, layer_idx=0).double()
    with torch.no_grad():
        module.sinks.copy_(_sinks(4, torch.float64))
    seq = 40
    distance = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    visible = (distance <= 0) & ((distance > -sliding_window) if sliding_window else True)
    mask = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~visible, torch.finfo(torch.float64).min)[None, None]
    q, k, v = random_qkv(2, 4, 2, seq, seq, 16, torch.float64)
    grad_out = torch.randn(2, seq, 4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    left = -1 if sliding_window is None else sliding_window - 1
    results = []
    for attend in (
        lambda: eager_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0],
        lambda: sliding_window_attention(q, k, v, window=(left, 0), scale=module.scaling, sinks=module.sinks).transpose(
            1, 2
        ),
    ):
        out = attend()
        results.append([out, *torch.autograd.grad(out, (q, k, v, module.sinks), grad_out)])
    for name, ours, theirs in zip(("out", "dq", "dk", "dv", "d sinks"), results[1], results[0], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10, msg=name)
