"""The document kernel (``kernels/documents.py``): windows with no left bound over packed documents
and padded rows, one fused CPU call per document, against the fp64 reference: the output, the
logsumexp, dq, dk and dv, with rows that see no key, GQA, sinks, and fp32 and bf16 against fp64.
"""

import pytest
import torch
from torch.profiler import profile

from compile_pass import sliding_window_attention
from compile_pass.kernels import chunked, documents, policy
from compile_pass.kernels import contract as kernel
from compile_pass.kernels.contract import AttentionCall
from compile_pass.kernels.fa2 import varlen as fa2_varlen
from compile_pass.ops.window_attention import sliding_window_attention_forward
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention, reference_logsumexp
from tests.helpers.small_graphs import pretend_gpu

SEQ = 24
SCALE = 0.3


def _packed(batch):
    """Documents of 1, 7, 4 and 12 tokens in row 0; two of 12 in row 1; one in row 2 (unpacked)."""
    ids = torch.zeros(batch, SEQ, dtype=torch.int64)
    ids[0] = torch.repeat_interleave(torch.tensor([0, 1, 2, 3]), torch.tensor([1, 7, 4, 12]))
    ids[1, 12:] = 5
    return {"segment_ids": ids}


def _padded(batch):
    """Left, right and both-sides padding, a row of padding alone, a row with none."""
    padding = torch.zeros(batch, SEQ, dtype=torch.bool)
    padding[0, 5:] = True  # left padding: rows 0-4 see no key (causal)
    padding[1, :17] = True  # right padding: rows 17.. see the whole run
    padding[2, 3:20] = True  # both sides
    padding[4] = True  # no padding; row 3 is padding alone
    return {"key_padding": padding}


FORMS = {"packed": _packed, "padded": _padded}


def _run(form, window, group, dtype, sinks=False, batch=5):
    q, k, v = random_qkv(batch, 2 * group, 2, SEQ, SEQ, 16, dtype)
    masks = FORMS[form](batch)
    extra = (
        {"sinks": torch.randn(2 * group, generator=torch.Generator().manual_seed(2), dtype=dtype).requires_grad_()}
        if sinks
        else {}
    )
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = (q, k, v, *extra.values())
    op = lambda q, k, v, *s: sliding_window_attention(  # noqa: E731
        q, k, v, window=window, causal=False, scale=SCALE, **masks, **dict(zip(extra, s, strict=True))
    )
    out, grads = forward_and_grads(op, inputs, grad_out)
    ref_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref = lambda q, k, v, *s: reference_attention(  # noqa: E731
        q, k, v, *window, SCALE, **masks, **dict(zip(extra, s, strict=True))
    )
    ref_out, ref_grads = forward_and_grads(ref, ref_inputs, grad_out)
    return (out, *grads), (ref_out, *ref_grads), masks


def _assert_documents_run(form, window, group=1):
    q, k, v = random_qkv(5, 2 * group, 2, SEQ, SEQ, 16, torch.float32)
    route = policy.POLICY.route(AttentionCall(q, k, v, *window, SCALE, **FORMS[form](5)))
    assert route.kernel is documents.DOCUMENTS and not route.plan.whole


# (form, GROUP_TOKENS): documents each one call, consecutive ones up to 8 tokens together, or
# the default; a padded row is one call whatever the grouping.
FORMS_AND_GROUPING = [("packed", 0), ("packed", 8), ("packed", documents.GROUP_TOKENS), ("padded", 0)]
FORM_IDS = ["packed-each-alone", "packed-some-grouped", "packed-grouped", "padded"]


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)], ids=["causal", "bidirectional"])
@pytest.mark.parametrize(("form", "group_tokens"), FORMS_AND_GROUPING, ids=FORM_IDS)
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_exact_against_fp64(form, group_tokens, window, group, monkeypatch):
    monkeypatch.setattr(documents, "GROUP_TOKENS", group_tokens)
    _assert_documents_run(form, window, group)
    ours, reference, _ = _run(form, window, group, torch.float64)
    for label, a, b in zip(("out", "dq", "dk", "dv"), ours, reference, strict=True):
        assert (a - b).abs().max().item() < 1e-10, label


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("form", list(FORMS))
def test_logsumexp_and_rows_without_keys(form, window):
    q, k, v = random_qkv(5, 4, 2, SEQ, SEQ, 16, torch.float64)
    masks = FORMS[form](5)
    out, logsumexp = sliding_window_attention_forward(q, k, v, *window, SCALE, **masks)
    expected = reference_logsumexp(q, k, *window, SCALE, **masks)
    assert torch.equal(torch.isinf(logsumexp), torch.isinf(expected))  # +inf exactly where no key is seen
    seen = ~torch.isinf(expected)
    assert (logsumexp[seen] - expected[seen]).abs().max().item() < 1e-10
    assert torch.all(out.transpose(1, 2)[~seen.transpose(1, 2)] == 0)
    if form == "padded":  # left padding under a causal window, and the row of padding alone
        assert torch.isinf(logsumexp[3]).all() and torch.isinf(logsumexp[0, :, :5]).all() == (window == (-1, 0))


@pytest.mark.parametrize(("form", "group_tokens"), FORMS_AND_GROUPING, ids=FORM_IDS)
def test_sinks_with_their_gradient(form, group_tokens, monkeypatch):
    monkeypatch.setattr(documents, "GROUP_TOKENS", group_tokens)
    ours, reference, _ = _run(form, (-1, 0), 2, torch.float64, sinks=True)
    for label, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ours, reference, strict=True):
        assert (a - b).abs().max().item() < 1e-10, label


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_lower_precisions_against_fp64(form, dtype):
    """As close to fp64 as SDPA with the same mask in the same dtype is (its error, doubled,
    with a floor at the dtype's rounding)."""
    ours, reference, masks = _run(form, (-1, 0), 2, dtype)
    q, k, v = random_qkv(5, 4, 2, SEQ, SEQ, 16, dtype)
    visible = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
    if "key_padding" in masks:
        visible = visible & masks["key_padding"][:, None, None, :]
    else:
        ids = masks["segment_ids"]
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=visible, scale=SCALE, enable_gqa=True
    )
    baseline = forward_and_grads(sdpa, (q, k, v), grad_out)
    floor = 1e-6 if dtype == torch.float32 else 2e-2
    for label, a, b, s in zip(("out", "dq", "dk", "dv"), ours, reference, (baseline[0], *baseline[1]), strict=True):
        sdpa_error = (s.double() - b).abs().max().item()
        assert (a.double() - b).abs().max().item() <= max(2 * sdpa_error, floor), label


def _flash_calls(fn) -> dict[str, int]:
    with profile() as trace:
        fn()
    names = [event.name for event in trace.events()]
    return {
        direction: names.count(f"aten::_scaled_dot_product_flash_attention_for_cpu{direction}")
        for direction in ("", "_backward")
    }


@pytest.mark.parametrize(
    "masks",
    [
        {"segment_ids": torch.tensor([[3] * SEQ, [7] * SEQ])},
        {"key_padding": torch.ones(2, SEQ, dtype=torch.bool)},
    ],
    ids=["one-document-a-row", "no-padding"],
)
def test_an_unpacked_batch_is_one_causal_call_each_way(masks):
    """The batch turned out unpacked at run time: one fused call over the whole batch with the
    kernel's own causal masking, the call SDPA's ``is_causal`` makes; exact against fp64."""
    q, k, v = random_qkv(2, 4, 2, SEQ, SEQ, 16, torch.float64)
    route = policy.POLICY.route(AttentionCall(q, k, v, -1, 0, SCALE, **masks))
    assert route.kernel is documents.DOCUMENTS and route.plan.whole and route.plan.causal
    out = None

    def forward():
        nonlocal out
        out = sliding_window_attention(q, k, v, window=(-1, 0), scale=SCALE, **masks)

    assert _flash_calls(forward) == {"": 1, "_backward": 0}
    assert _flash_calls(lambda: out.sum().backward()) == {"": 0, "_backward": 1}
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    assert (out - sdpa).abs().max().item() < 1e-12


@pytest.mark.parametrize(
    ("group_tokens", "calls"),
    [(0, 4 + 2 + 3), (8, 3 + 2 + 3), (documents.GROUP_TOKENS, 1 + 1 + 3)],
    ids=["each-alone", "some-grouped", "grouped"],
)
def test_one_call_per_document_or_group(monkeypatch, group_tokens, calls):
    """Rows of 4, 2 and 1 documents and two more of one: a call per document, or per run of
    consecutive documents that fit ``GROUP_TOKENS`` together (1 + 7 tokens with 8)."""
    monkeypatch.setattr(documents, "GROUP_TOKENS", group_tokens)
    q, k, v = random_qkv(5, 4, 2, SEQ, SEQ, 16, torch.float32)
    masks = _packed(5)
    out = None

    def forward():
        nonlocal out
        out = sliding_window_attention(q, k, v, window=(-1, 0), **masks)

    assert _flash_calls(forward) == {"": calls, "_backward": 0}
    assert _flash_calls(lambda: out.sum().backward()) == {"": 0, "_backward": calls}


@pytest.mark.parametrize(
    "masks",
    [
        {"segment_ids": torch.tensor([[0] * 8 + [1] * 8 + [0] * 8] * 2)},  # an id that comes back
        {"key_padding": torch.tensor([[True] * 8 + [False] * 4 + [True] * 12] * 2)},  # a hole
    ],
    ids=["segments-not-runs", "padding-with-a-hole"],
)
def test_masks_that_are_not_runs_fall_back_to_the_chunked_kernel(masks):
    q, k, v = random_qkv(2, 4, 2, SEQ, SEQ, 16, torch.float64)
    call = AttentionCall(q, k, v, -1, 0, SCALE, **masks)
    assert documents.document_plan(call) is None
    assert isinstance(policy.POLICY.route(call).kernel, chunked.ChunkedKernel)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = forward_and_grads(
        lambda *a: sliding_window_attention(*a, window=(-1, 0), scale=SCALE, **masks), (q, k, v), grad_out
    )
    ref_out, ref_grads = forward_and_grads(
        lambda *a: reference_attention(*a, -1, 0, SCALE, **masks),
        [x.detach().clone().requires_grad_() for x in (q, k, v)],
        grad_out,
    )
    for a, b in zip((out, *grads), (ref_out, *ref_grads), strict=True):
        assert (a - b).abs().max().item() < 1e-10


# -- what the kernel answers the policy -----------------------------------------------------


def _facts(**fields):
    base = dict(same_lengths=True, keys=4096, left=-1, right=0)
    return policy.facts_of("cpu", torch.float32, 64, **{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({}, "no documents"),
        ({"key_padding": True, "segment_ids": True}, "not both"),
        ({"segment_ids": True, "left": 127}, "not window (127, 0)"),
        ({"segment_ids": True, "right": 3}, "not window (-1, 3)"),
        ({"segment_ids": True, "same_lengths": False}, "Sq == Sk only"),
        ({"segment_ids": True, "blocks": True}, "image blocks"),
    ],
)
def test_what_the_document_kernel_cannot_take(fields, why):
    assert why in documents.DOCUMENTS.cannot(_facts(**fields))


def test_the_policy_answers_for_full_layers(monkeypatch):
    """Packed and padded calls with no left bound go to the document kernel from its crossover;
    a plain causal call, which SDPA runs as ``is_causal``, to no kernel on the CPU; on a GPU
    none is measured for either yet."""
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)  # the measured crossovers, not the suite's 0
    for masks in ({"segment_ids": True}, {"key_padding": True}, {"key_padding": True, "right": -1}):
        long = policy.POLICY.choose(_facts(**masks))
        assert long.kernel is documents.DOCUMENTS, long
        short = policy.POLICY.choose(_facts(keys=documents.short_keys(torch.float32), **masks))
        assert short.kernel is not documents.DOCUMENTS
    plain = policy.POLICY.choose(_facts(sdpa_unmasked=True))
    assert not plain.fast and "nothing left to skip" in plain.reason
    pretend_gpu(monkeypatch)
    for masks in ({"segment_ids": True}, {"sdpa_unmasked": True}):
        on_gpu = policy.POLICY.choose(_facts(**masks)._replace(device=torch.device("cuda"), dtype=torch.bfloat16))
        assert not on_gpu.fast and "torch's FA2: " in on_gpu.reason, on_gpu


def test_ids_whose_differences_wrap_are_not_read_as_runs(monkeypatch):
    """Segment ids are data: 0, 2**62, -2**63, -2**62, 0 step up by 2**62 each once the
    differences wrap (int64), yet id 0 comes back. Read by comparisons, they are not runs
    (the chunked kernel runs the call), and the first and last tokens see each other."""
    monkeypatch.setattr(documents, "GROUP_TOKENS", 0)  # documents read as runs would be apart
    ids = torch.tensor([[0, 2**62, -(2**63), -(2**62), 0]])
    q, k, v = random_qkv(1, 2, 2, 5, 5, 8, torch.float64)
    call = AttentionCall(q, k, v, -1, -1, SCALE, segment_ids=ids)
    assert documents.document_plan(call) is None
    assert fa2_varlen.varlen_layout(None, ids, -1, -1) is None  # FA2's varlen calls on a GPU read them so too
    out = sliding_window_attention(q, k, v, window=(-1, -1), causal=False, scale=SCALE, segment_ids=ids)
    reference = reference_attention(q, k, v, -1, -1, SCALE, segment_ids=ids)
    assert (out - reference).abs().max().item() < 1e-10
