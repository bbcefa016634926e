"""The document kernel: attention with no left bound over packed documents or padded rows, on
the CPU, each document one call of aten's fused CPU flash kernel.

A full-attention layer's mask over a packed row is block-diagonal (causal, or bidirectional,
within each document): SDPA with that mask scores all S^2 pairs, the chunked kernel the whole
causal triangle. Here each document (a run of equal segment ids, FA2's varlen runs:
``fa2_varlen.segment_runs``) is one call over its own rows and keys, with the kernel's own
causal masking where the window is causal: sum(len_i^2) / 2 scores. Consecutive documents
shorter than GROUP_TOKENS together are one call with their block-diagonal mask, so that a row
of many tiny documents does not pay a call's fixed cost for each.

A padded row (its valid tokens one run [f, l]) is one call too, over the run's keys:
- causal (-1, 0): rows f.. against keys f..l with the kernel's top-left causal masking, so
  row f + t sees keys f..f + t, and every row past l (right padding) sees the whole run, as
  SDPA with the padded mask computes it; rows before f (left padding) see no key;
- bidirectional (-1, -1): every row against the run's keys, no mask.
A row with no valid token sees no key. Rows that see no key get zeros and a logsumexp of
+inf, as FA2 returns them, so they pass no gradient.

Every document's keys belong to its call alone, so the backward writes each gradient once (no
sums). Where every row is one document spanning it, or no row is padded (the batch turned out
unpacked at run time), the call is the one SDPA's ``is_causal`` (or unmasked) call makes: one
fused call over the whole batch (``whole_calls.whole_forward``).

``plan`` reads the runs (one host sync) and returns None where segments are not runs or a
row's valid tokens are not one run: the chunked kernel, next in the policy, takes the call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..window import UNBOUNDED
from .chunked import backends as chunk_backends
from .chunked.backends import FUSED_CPU
from .chunked.plan import additive_mask
from .chunked.whole_calls import WholeCall, whole_backward, whole_forward
from .contract import AttentionCall, CallFacts, measured_or_set, short_call
from .fa2 import varlen as fa2_varlen
from .layout import empty_like_heads_last, new_logsumexp

NAME = "documents"

# Calls with at most this many keys keep SDPA on the CPU (``kernel.short_call``), by the dtype
# the call computes in. Measured with ``python benchmarks/bench_documents.py --dtypes fp32 bf16
# --seqs 256 384 512 768 1024 --docs 1 2 8 32 128 --fractions 0 0.125 0.5 --repeats 7
# --threads 1`` (8/4 heads of 64, fwd+bwd, against SDPA with the block-diagonal or padded mask;
# twice, on 2 shared cores at load 8-14; benchmarks/RESULTS.md). fp32: at 256 keys packed rows
# ran at 0.59-1.29x, at 384 at 0.92-3.07x (the 0.92 a row of one document: the is_causal call
# itself, 0.90x of SDPA's), from 512 every cell at 1.09x or more (padded rows: 1.05x or more
# from 256). bf16: at 512 keys rows of 32 and 128 documents ran at 0.87-0.92x, from 768 every
# cell at 1.02x or more (1.05x with documents grouped). fp16 is taken to be bf16's (not
# measured); other dtypes fp32's.
SHORT_KEYS = {torch.float32: 384, torch.bfloat16: 512, torch.float16: 512}


def short_keys(dtype: torch.dtype) -> int:
    return measured_or_set(SHORT_KEYS.get(dtype, SHORT_KEYS[torch.float32]))


# Consecutive documents shorter than this together are one call, with their block-diagonal
# mask: a call's fixed cost (about 0.3 ms forward and backward, ``benchmarks/bench_documents.py``
# with 32 documents of 4 tokens) would otherwise dominate rows of many tiny documents.
GROUP_TOKENS = 128


class Document(NamedTuple):
    """One fused call: query rows [first_row, first_row + rows) of batch row ``batch`` against
    keys [first_key, first_key + keys); ``grouped``: several documents (rows == keys), each row
    seeing its own document's keys only (a mask built from the segment ids)."""

    batch: int
    first_row: int
    rows: int
    first_key: int
    keys: int
    grouped: bool = False


class DocumentPlan(NamedTuple):
    causal: bool  # the kernel's own top-left causal masking in every call
    documents: tuple[Document, ...]  # empty with ``whole``
    whole: bool  # one call over the whole batch: every row one document spanning it
    # Some rows are in no call (they see no key) and some keys in none (padding): the results
    # start as zeros, with a logsumexp of +inf.
    uncovered: bool


def _causal(call: AttentionCall) -> bool:
    return call.right == 0


def document_plan(call: AttentionCall) -> DocumentPlan | None:
    """The calls of each document, or None where the documents are not runs."""
    causal = _causal(call)
    if call.segment_ids is not None:
        runs = fa2_varlen.segment_runs(call.segment_ids)
        if runs is None:
            return None
        lengths, sequences, _ = runs
        batch, seq = call.segment_ids.shape
        if sequences == batch:  # one document a row
            return DocumentPlan(causal, (), True, False)
        return DocumentPlan(causal, _grouped(lengths[:sequences].tolist(), seq), False, False)
    padding = call.key_padding
    if padding is None:  # neither: no documents (``cannot`` says so)
        return None
    first, _, counts, has_hole = fa2_varlen.padding_runs(padding)
    batch, seq = padding.shape
    rows = torch.stack([first, counts, has_hole.long()], dim=1).tolist()  # the one host sync
    if any(hole for _, _, hole in rows):
        return None
    if all(count == seq for _, count, _ in rows):  # no padding
        return DocumentPlan(causal, (), True, False)
    documents = []
    for b, (start, count, _) in enumerate(rows):
        if count == 0:
            continue  # a row of padding alone: no row of it sees a key
        if causal:  # rows before the run see no key; rows past it see all of it
            documents.append(Document(b, start, seq - start, start, count))
        else:
            documents.append(Document(b, 0, seq, start, count))
    return DocumentPlan(causal, tuple(documents), False, True)


def _grouped(lengths: list[int], seq: int) -> tuple[Document, ...]:
    """The calls of documents of these lengths, in order over the flattened batch: each one
    alone, or consecutive ones that fit GROUP_TOKENS in one row together."""
    calls: list[Document] = []
    start = 0
    for length in lengths:
        batch, first = divmod(start, seq)
        last = calls[-1] if calls else None
        if last is not None and last.batch == batch and last.rows + length <= GROUP_TOKENS:
            rows = last.rows + length
            calls[-1] = Document(batch, last.first_row, rows, last.first_key, rows, grouped=True)
        else:
            calls.append(Document(batch, first, length, first, length))
        start += length
    return tuple(calls)


def _group_mask(call: AttentionCall, doc: Document, causal: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """The (1, 1, rows, rows) additive mask of a group of documents, None for one document."""
    if not doc.grouped or call.segment_ids is None:
        return None
    ids = call.segment_ids[doc.batch, doc.first_row : doc.first_row + doc.rows]
    visible = ids[:, None] == ids[None, :]
    if causal:
        visible = visible.tril()
    return additive_mask(visible, dtype)[None, None]


def documents_forward(call: AttentionCall, plan: DocumentPlan) -> tuple[torch.Tensor, torch.Tensor]:
    query, key, value = call.query, call.key, call.value
    if plan.whole:
        return whole_forward(query, key, value, call.scale, WholeCall(plan.causal, None, None))
    out = empty_like_heads_last(query)
    logsumexp = new_logsumexp(query)
    if plan.uncovered:
        out.zero_()
        logsumexp.fill_(float("inf"))
    for doc in plan.documents:
        b, rows, keys = _slices(doc)
        mask = _group_mask(call, doc, plan.causal, query.dtype)
        doc_out, doc_lse = FUSED_CPU.forward(
            query[b, :, rows], key[b, :, keys], value[b, :, keys], mask, call.scale, plan.causal
        )
        out[b, :, rows] = doc_out
        logsumexp[b, :, rows] = doc_lse
    return out, logsumexp


def documents_backward(
    call: AttentionCall, plan: DocumentPlan, grad_out: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query, key, value = call.query, call.key, call.value
    if plan.whole:
        return whole_backward(
            grad_out, query, key, value, out, logsumexp, call.scale, WholeCall(plan.causal, None, None)
        )
    # Each document's keys are its call's alone: every gradient is written once, in its dtype.
    grads = [empty_like_heads_last(x) for x in (query, key, value)]
    if plan.uncovered:
        for grad in grads:
            grad.zero_()
    grad_q, grad_k, grad_v = grads
    for doc in plan.documents:
        b, rows, keys = _slices(doc)
        doc_dq, doc_dk, doc_dv = FUSED_CPU.backward(
            grad_out[b, :, rows],
            query[b, :, rows],
            key[b, :, keys],
            value[b, :, keys],
            out[b, :, rows],
            logsumexp[b, :, rows],
            _group_mask(call, doc, plan.causal, query.dtype),
            call.scale,
            plan.causal,
        )
        grad_q[b, :, rows] = doc_dq
        grad_k[b, :, keys] = doc_dk
        grad_v[b, :, keys] = doc_dv
    return grad_q, grad_k, grad_v


def _slices(doc: Document) -> tuple[slice, slice, slice]:
    """(batch, rows, keys) of a document as slices, which keep the batch dimension (a view)."""
    rows = slice(doc.first_row, doc.first_row + doc.rows)
    return slice(doc.batch, doc.batch + 1), rows, slice(doc.first_key, doc.first_key + doc.keys)


class DocumentKernel:
    """Windows with no left bound, causal or bidirectional, over packed documents (segment ids
    that are runs) or padded rows (each row's valid tokens one run), Sq == Sk, on the CPU."""

    name = NAME

    def __repr__(self) -> str:
        return "DocumentKernel()"

    def describe(self, facts: CallFacts) -> str:
        what = "document" if facts.segment_ids else "padded row"
        return f"documents, aten's fused CPU flash kernel once per {what}, the rest skipped"

    def cannot(self, facts: CallFacts) -> str | None:
        if chunk_backends.backend_for(facts.device) is not FUSED_CPU:
            return f"the document kernel runs aten's fused CPU flash kernel, on the CPU only, not {facts.device.type}"
        if facts.softcap:
            return "the document kernel takes no soft-capped scores"
        if facts.blocks:
            return "the document kernel takes no image blocks"
        if not facts.batch_masks:
            return "no documents: the document kernel takes key padding or segment ids"
        if facts.key_padding and facts.segment_ids:
            return "the document kernel takes key padding or segment ids, not both"
        if not facts.same_lengths:
            return "the document kernel takes Sq == Sk only"
        if facts.left != UNBOUNDED or facts.right not in (0, UNBOUNDED):
            return (
                f"the document kernel computes causal or bidirectional attention with no left bound, "
                f"not window ({facts.left}, {facts.right}) (a bounded window is the chunked kernel's)"
            )
        return None

    def slower(self, facts: CallFacts) -> str | None:
        if facts.value_head_dim is not None:
            return f"value zero-padded from head_dim {facts.value_head_dim} to {facts.head_dim}: not measured"
        return short_call(facts, short_keys(facts.dtype))

    def plan(self, call: AttentionCall) -> DocumentPlan | None:
        return document_plan(call)

    def forward(self, call: AttentionCall, plan: DocumentPlan):
        return documents_forward(call, plan)

    def backward(self, call: AttentionCall, plan: DocumentPlan, grad_out, out, logsumexp):
        return documents_backward(call, plan, grad_out, out, logsumexp)


DOCUMENTS = DocumentKernel()
