"""Masks certified by the graph that built them, for context parallel across graph breaks
(rules/mask_certificate.py, ``certify_mask`` and ``certificate_of`` in
ops/mask_certificate.py): what the proof files, and what a block's op then refuses. The
sharded runs that use them are in tests/parallel/test_context_parallel.py."""

import pytest
import torch
import torch.fx.experimental._config as shapes_config

from compile_pass.ops.mask_certificate import Certificate, certificate_of
from tests.helpers.models import Capture

WINDOW = 3


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sliding(padding):
    """transformers' form: a window of WINDOW keys AND the key padding, (B, 1, L, L)."""
    i = torch.arange(padding.shape[1])
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)
    return band[None, None] & padding.bool()[:, None, None, :]


def _window_of_the_length(padding):
    i = torch.arange(padding.shape[1])
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - padding.shape[1] // 2))[None, None]


def _window_of_a_branch_on_another_size(padding, embeds):
    """The window chosen by the length of another input than the mask's own sizes."""
    width = 3 if embeds.shape[1] < 16 else 5
    i = torch.arange(padding.shape[1])
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - width))[None, None]


def _two_batch_symbols(padding, embeds):
    """As a mask graph after a graph break may see it: the batch and the query positions come
    from one input, the padding's rows and the keys from another, each with symbols of its own."""
    rows = torch.arange(embeds.shape[0])[:, None]
    q, kv = torch.arange(embeds.shape[1]), torch.arange(padding.shape[1])
    band = (kv[None, :] <= q[:, None]) & (kv[None, :] > q[:, None] - WINDOW)
    return band[None, None] & padding.bool()[rows, kv[None, :]][:, None, None, :]


def _padding(batch=2, seq=12):
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[1, :4] = 0
    return padding


def _certified(fn, *inputs, dynamic=True):
    capture = Capture(context_parallel=True)
    if dynamic:
        for tensor in inputs:
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
    mask = torch.compile(fn, backend=capture)(*inputs)
    (decision,) = capture.report
    return mask, decision.verdict


def _key(mask):
    return torch.zeros(mask.shape[0], 2, mask.shape[-1], 4)


def test_a_returned_mask_is_filed_with_its_window_and_padding():
    padding = _padding()
    mask, verdict = _certified(_sliding, padding)
    assert verdict.startswith(
        "rewritten: masks certified for the graphs that attend with them under context parallel: the mask of "
        "tests/rules/test_mask_certificate.py:"  # the line that builds it
    ), verdict
    assert verdict.endswith(f": window ({WINDOW - 1}, 0), key padding from padding"), verdict
    assert torch.equal(mask, _sliding(padding))
    found = certificate_of(mask, _key(mask))
    assert isinstance(found, Certificate), found
    assert found.window_left == WINDOW - 1 and found.positions is None
    assert torch.equal(found.key_padding, padding.bool())
    padding[0, 0] = 0  # the certificate holds the padding as it was when the mask was built
    assert bool(found.key_padding[0, 0])


def test_a_copy_a_written_mask_and_another_shape_have_no_certificate():
    mask, _ = _certified(_sliding, _padding())
    assert "not one a compiled graph proved and returned" in certificate_of(mask.clone(), _key(mask))
    assert "(batch, 1, 4, 4)" in certificate_of(mask, torch.zeros(2, 2, 4, 4))
    mask.data[0, 0, -1, 0] = True  # .data: a write the version counter does not see
    assert certificate_of(mask, _key(mask)) == "the mask was written after the graph that built it proved it"
    other, _ = _certified(_sliding, _padding())
    other.copy_(_sliding(_padding()))  # the same contents, written: the version counter sees it
    assert "not one a compiled graph proved and returned" in certificate_of(other, _key(other))


def test_masks_the_proof_cannot_carry_to_the_whole_sequence_are_not_filed():
    """A window computed from the shard's length, chosen by a branch on any size the graph
    takes, or a length the graph holds constant, would be the shard's own: kept, with the
    reason, and the mask carries no certificate."""
    mask, verdict = _certified(_window_of_the_length, _padding())
    assert verdict.startswith("kept: context parallel: no mask this graph returns is certified: "), verdict
    assert "depends on sizes" in verdict or "assumes of the sizes" in verdict, verdict
    assert isinstance(certificate_of(mask, _key(mask)), str)
    torch._dynamo.reset()
    with shapes_config.patch(use_duck_shape=False):
        mask, verdict = _certified(_window_of_a_branch_on_another_size, _padding(), torch.zeros(2, 12, 8))
    assert "the traced program assumes of the sizes" in verdict, verdict
    assert isinstance(certificate_of(mask, _key(mask)), str)
    torch._dynamo.reset()
    mask, verdict = _certified(_sliding, _padding(), dynamic=False)
    assert "the sequence length is static in this graph" in verdict, verdict
    assert isinstance(certificate_of(mask, _key(mask)), str)


def _rows_after_the_first(padding, embeds):
    """The padding read one row down: in range here (3 padding rows, 2 of the mask), but not
    where the two batches are equal, as certify_mask requires."""
    rows = torch.arange(embeds.shape[0])[:, None] + 1
    q, kv = torch.arange(embeds.shape[1]), torch.arange(padding.shape[1])
    band = (kv[None, :] <= q[:, None]) & (kv[None, :] > q[:, None] - WINDOW)
    return band[None, None] & padding.bool()[rows, kv[None, :]][:, None, None, :]


def test_one_size_with_two_symbols_is_proven_with_the_sizes_checked_at_run_time():
    """Past a graph break Dynamo may name one size with two symbols; indexing the padding's
    rows by the other's arange is then not provably in range. It is proven with the sizes
    certify_mask checks equal before it files the mask (the padding's rows and the mask's
    batch); an index that needs more than those is not certified."""
    padding, embeds = _padding(), torch.zeros(2, 12, 8)
    with shapes_config.patch(use_duck_shape=False):
        mask, verdict = _certified(_two_batch_symbols, padding, embeds)
        assert torch.equal(mask, _sliding(padding))
        assert verdict.endswith(f"window ({WINDOW - 1}, 0), key padding from padding"), verdict
        assert isinstance(certificate_of(mask, _key(mask)), Certificate)
        torch._dynamo.reset()
        mask, verdict = _certified(_rows_after_the_first, _padding(batch=3), embeds)
    assert verdict.startswith("kept: context parallel: no mask this graph returns is certified"), verdict
    assert isinstance(certificate_of(mask, _key(mask)), str)


@pytest.mark.parametrize(
    "queries, padding_rows", [(8, 2), (12, 3)], ids=["fewer queries than keys", "fewer rows than the padding"]
)
def test_a_mask_of_other_sizes_at_run_time_is_not_filed(queries, padding_rows):
    """The proof aligned query i on key i and read the padding at (batch, keys): a mask with
    fewer queries than keys, or fewer rows than the padding, is returned unfiled."""
    rows = 2
    padding, embeds = _padding(batch=padding_rows, seq=12), torch.zeros(rows, queries, 8)
    with shapes_config.patch(use_duck_shape=False):
        mask, verdict = _certified(_two_batch_symbols, padding, embeds)
    assert verdict.startswith("rewritten: masks certified"), verdict
    assert mask.shape == (rows, 1, queries, 12)
    assert "not one a compiled graph proved and returned" in certificate_of(mask, _key(mask))
