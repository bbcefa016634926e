"""Segment ids computed in the graph: chunked attention (Llama-4's chunked layers attend where
``(kv - offset[b]) // c == (q - offset[b]) // c`` AND kv <= q) and document ids from an input.

Equal chunk ids put two positions less than c apart, so the mask is the window (c - 1, 0)
within segments: the op gets the ids the graph computed, read from the tensor that holds
them. Everything is compared in fp64 (forward at every position and the gradients of q, k, v)
or, for the model, loss and every gradient against eager fp32 and fp64."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.models import Capture, assert_training_matches, token_batch
from tests.helpers.small_graphs import (
    ask_as_if_on_cuda,
    assert_same_as_eager,
    compiled_with_capture,
    mask_input_paths,
    pretend_gpu,
    qkv,
)
from tests.integrations.test_recall_table import _model


@pytest.mark.parametrize("padding", ["none", "left-and-right", "packed"])
def test_llama4_chunked_layers_train_as_eager(padding):
    _, model = _model("Llama-4 (chunked)")  # chunks of 8, a chunked layer then a global one
    ids = token_batch(32)
    mask = None if padding != "left-and-right" else torch.ones_like(ids)
    if mask is not None:
        mask[1, :5] = 0  # the chunks of row 1 start after its padding
        mask[0, -3:] = 0
    # Packed: row 0 holds documents of 12 and 20 tokens, row 1 of 5, 19 and 8; chunks restart
    # with each document (they are counted over positions).
    positions = torch.cat([torch.arange(12), torch.arange(20), torch.arange(5), torch.arange(19), torch.arange(8)])
    extra = {"position_ids": positions.view(2, 32)} if padding == "packed" else {}
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    with mask_input_paths() as paths:
        assert_training_matches(
            model, compiled, input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **extra
        )
    # Packed: the positions pass the run-time check, so the band ran, not SDPA with the mask, in
    # the compiled forward of the chunked layer and of the global one (the document kernel).
    assert paths["band"] == (2 if padding == "packed" else 0), paths
    (chunked, full) = [d.verdict for d in capture.report if d.rule != "topk_mask"]
    assert (
        full
        == {
            "none": "rewritten: plain causal mask -> is_causal=True",
            "left-and-right": "rewritten: window (-1, 0), key padding from attention_mask",
            "packed": "rewritten: window (-1, 0), packed sequences from position_ids (positions checked at run time)",
        }[padding]
    ), full
    assert (
        chunked
        == {
            "none": "rewritten: window (7, 0), chunks of 8: ids (kv//8)",
            "left-and-right": (
                "rewritten: window (7, 0), key padding from attention_mask, chunks of 8: ids "
                "((kv - left_padding_tokens[b])//8)"
            ),
            "packed": (
                "rewritten: window (7, 0), packed sequences from position_ids, "
                "chunks of 8: ids (position_ids[b, kv]//8) (positions checked at run time)"
            ),
        }[padding]
    ), chunked


def _indices(q):
    positions = torch.arange(q.shape[2])
    return positions[:, None], positions[None, :]


def _shifted_chunks(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j - 3) // 8 == (i - 3) // 8) & (j <= i))


def _bidirectional_chunks(q, k, v):
    i, j = _indices(q)
    ids_j, ids_i = torch.div(j + 5, 6, rounding_mode="floor"), torch.div(i + 5, 6, rounding_mode="floor")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ids_j == ids_i)


def _int32_chunks_and_a_window(q, k, v):
    i, j = (x.int() for x in _indices(q))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j // 8 == i // 8) & (j <= i) & (j > i - 3))


def _batched_chunks(q, k, v):
    """transformers' form: (batch, 1, 1, S) ids, with a per-row offset counted from a mask."""
    b = torch.arange(q.shape[0])[:, None, None, None]
    i, j = (x[None, None] for x in _indices(q))
    keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool)
    offset = (keep.cumsum(-1) == 0).sum(-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=((j - offset[b]) // 4 == (i - offset[b]) // 4) & (j <= i))


def _document_ids(q, k, v, ids):
    b = torch.arange(q.shape[0])[:, None, None, None]
    i, j = (x[None, None] for x in _indices(q))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ids[b, i] == ids[b, j]) & (j <= i) & (j > i - 4))


def _chunks_of_documents(q, k, v, ids):
    """Two sets of ids: documents from an input, and chunks of 4 positions counted from the
    row's start (they cross document boundaries)."""
    b = torch.arange(q.shape[0])[:, None, None, None]
    i, j = (x[None, None] for x in _indices(q))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(ids[b, i] == ids[b, j]) & (j // 4 == i // 4) & (j <= i))


def _three_sets_of_ids(q, k, v, ids):
    b = torch.arange(q.shape[0])[:, None, None, None]
    i, j = (x[None, None] for x in _indices(q))
    same = (ids[b, i] == ids[b, j]) & (j // 4 == i // 4) & ((j + 1) // 3 == (i + 1) // 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (j <= i))


DOCUMENTS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0, 1] * 8])  # row 1: ids that come back


@pytest.mark.parametrize(
    ("fn", "batch", "extra", "verdict"),
    [
        (_shifted_chunks, 1, (), "rewritten: window (7, 0), chunks of 8: ids ((kv - 3)//8)"),
        (_bidirectional_chunks, 1, (), "rewritten: window (5, 5), chunks of 6: ids ((kv + 5)//6)"),
        (_int32_chunks_and_a_window, 1, (), "rewritten: window (2, 0), chunks of 8: ids (kv//8)"),
        (_batched_chunks, 2, (), "rewritten: window (3, 0), chunks of 4: ids ((kv - offset[b])//4)"),
        (_document_ids, 2, (DOCUMENTS,), "rewritten: window (3, 0), segment ids from ids"),
        # (L, L) ids for a batch of 2: one row of ids, expanded to the batch.
        (_shifted_chunks, 2, (), "rewritten: window (7, 0), chunks of 8: ids ((kv - 3)//8)"),
        (
            _chunks_of_documents,
            2,
            (DOCUMENTS,),
            "rewritten: window (3, 0), segment ids from ids, chunks of 4: ids (kv//4)",
        ),
    ],
    ids=[
        "shifted",
        "bidirectional",
        "int32-and-a-window",
        "batched",
        "document-ids",
        "one-row-for-the-batch",
        "chunks-of-documents",
    ],
)
def test_segment_ids_computed_in_the_graph_are_the_ops(fn, batch, extra, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(lambda *a: fn(*a, *extra), lambda *a: compiled(*a, *extra), qkv(batch=batch))
    assert [d.verdict for d in capture.report] == [verdict]


def _chunks_by(divide):
    def attend(q, k, v):
        i, j = _indices(q)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(divide(j) == divide(i)) & (j <= i))

    return attend


def _chunk_causal(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=j // 4 <= i // 4)


def _unequal_chunks(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j // 8 == i // 4) & (j <= i))


@pytest.mark.parametrize(
    ("fn", "batch", "verdict"),
    [
        # Truncation rounds -1 // 4 to 0, putting -3..3 in one chunk: not proven.
        (
            _chunks_by(lambda x: torch.div(x - 2, 4, rounding_mode="trunc")),
            1,
            "kept: mask div without rounding_mode='floor'",
        ),
        (
            _chunks_by(lambda x: x // torch.tensor(4)),
            1,
            "kept: mask floordiv by a tensor: only a positive integer constant is proven",
        ),
        # Ids, but not chunks of consecutive positions: no window follows from them, and the
        # layer is a full one over documents of 2 and 3 tokens (the document kernel's).
        (_chunks_by(lambda x: (3 * x) // 8), 1, "rewritten: window (-1, 0), segment ids ((3*kv)//8)"),
        (_chunk_causal, 1, "kept: mask term ((kv//4)) <= ((q//4)) is not a bound on kv - q"),
        (_unequal_chunks, 1, "kept: mask term Eq((kv//8), (q//4)) is not a bound on kv - q"),
    ],
    ids=["trunc", "tensor-divisor", "scaled-positions", "chunk-causal", "unequal-chunks"],
)
def test_near_misses(fn, batch, verdict):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(batch=batch))
    (decision,) = [d.verdict for d in capture.report]
    assert decision == verdict or decision.startswith(verdict + " at tests/kernels/test_chunks.py:"), decision


def test_three_sets_of_ids_are_kept():
    fn = _three_sets_of_ids
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(lambda *a: fn(*a, DOCUMENTS), lambda *a: compiled(*a, DOCUMENTS), qkv(batch=2))
    verdict = "kept: mask has more than two sets of segment ids; the op takes two at most"
    (decision,) = [d.verdict for d in capture.report]
    assert decision == verdict or decision.startswith(verdict + " at tests/kernels/test_chunks.py:"), decision


def test_padding_and_segment_ids_together_keep_sdpa_where_fa2_runs(monkeypatch):
    """FA2's varlen op takes key padding or segment ids, not both: a padded chunked layer
    would run the chunked kernel's unfused fallback on a GPU, slower than SDPA, so SDPA stays.
    On the CPU both run the chunked kernel on aten's fused kernel, as fast as SDPA per score."""
    from compile_pass.kernels import policy
    from compile_pass.kernels.policy import facts_of

    assert policy.POLICY.choose(facts_of("cpu", torch.float32, 64, key_padding=True, segment_ids=True)).fast
    pretend_gpu(monkeypatch)
    assert policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 64, key_padding=True)).fast
    choice = policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 64, key_padding=True, segment_ids=True))
    assert not choice.fast and "key padding or segment ids, not both" in choice.reason

    ask_as_if_on_cuda(monkeypatch)
    compiled, capture = compiled_with_capture(_batched_chunks_with_padding)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :3] = 0
    half = [x.detach().bfloat16().requires_grad_() for x in qkv(batch=2)]  # a dtype FA2 takes
    assert_same_as_eager(lambda *a: _batched_chunks_with_padding(*a, padding), lambda *a: compiled(*a, padding), half)
    (verdict,) = [d.verdict for d in capture.report]
    assert verdict.startswith("kept: mask is window (3, 0), key padding from padding, chunks of 4"), verdict
    assert "torch's FA2: torch's FA2's varlen op takes key padding or segment ids, not both" in verdict, verdict


def _batched_chunks_with_padding(q, k, v, padding):
    b = torch.arange(q.shape[0])[:, None, None, None]
    i, j = (x[None, None] for x in _indices(q))
    offset = (padding.cumsum(-1) == 0).sum(-1)
    same_chunk = (j - offset[b]) // 4 == (i - offset[b]) // 4
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same_chunk & (j <= i) & (padding[:, None, None, :] != 0))


def _chunked_causal(q, k, v):
    i, j = _indices(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j // 4 == i // 4) & (j <= i))


def _checkpointed_then_again(q, k, v):
    """The same ids built inside an activation-checkpoint body and again in the outer graph
    after its call: the body's op may only read a tensor defined before that call."""
    attended = torch.utils.checkpoint.checkpoint(_chunked_causal, q, k, v, use_reentrant=False)
    return _chunked_causal(attended, k, v)


def test_ids_are_read_from_a_tensor_defined_before_the_call():
    compiled, capture = compiled_with_capture(_checkpointed_then_again)
    assert_same_as_eager(_checkpointed_then_again, compiled)
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0), chunks of 4: ids (kv//4)"] * 2


def test_without_that_check_the_graphs_are_restored(monkeypatch):
    """The same program with the check taken away: the body's op reads a node of the outer
    graph built after the body's call. The graphs fail their check and are put back as they
    were (the body's and the outer one), every call kept: the compile does not break."""
    from compile_pass.rules import batch_terms, sliding_window

    for module in (batch_terms, sliding_window):
        monkeypatch.setattr(module, "defined_before", lambda tensor, node: True)
    compiled, capture = compiled_with_capture(_checkpointed_then_again)
    assert_same_as_eager(_checkpointed_then_again, compiled)
    verdicts = [d.verdict for d in capture.report]
    assert len(verdicts) == 2 and all("the rewritten graph failed its check" in v for v in verdicts), verdicts


def _ids_twice(q, k, v):
    """The same chunk ids as an (S, S) comparison and as (batch, 1, 1, S) tensors."""
    i, j = _indices(q)
    rows = torch.zeros(q.shape[0], 1, 1, 1, dtype=torch.long)
    batched_i, batched_j = (i[None, None] + rows) // 4, (j[None, None] + rows) // 4
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j // 4 == i // 4) & (batched_j == batched_i) & (j <= i))


def test_every_tensor_holding_the_ids_is_tried():
    """With a symbolic batch the (1, S) ids cannot be expanded to it; the (batch, 1, 1, S)
    tensor holding the same ids can be read as they are."""
    compiled, capture = compiled_with_capture(_ids_twice)
    q, k, v = qkv(batch=2)
    for tensor in (q, k, v):
        torch._dynamo.mark_dynamic(tensor, 0)
    assert_same_as_eager(_ids_twice, compiled, (q, k, v))
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0), chunks of 4: ids (kv//4)"]
