"""Padded batches on transformers' Gemma-4 (tiny random config, fp32): what changes and what
does not when the sliding layers and the global one are rewritten.

The op computes a query row whose own token is padding as SDPA does (over the keys its window
sees; zeros where it sees none), so the rewritten model equals eager at every position:
- a loss that ignores padded positions (labels -100 there) and every gradient are eager's;
- so is a loss that reads padded positions, and the logits there.
Tolerances are tests/helpers/models.py's: 1e-4 relative to eager fp32 and eager fp64.
"""

import copy

import pytest
import torch

from tests.helpers.models import (
    CACHE,
    Capture,
    assert_close_scaled,
    assert_training_matches,
    cache_of,
    loss_and_grads,
    tiny_gemma4,
    token_batch,
)

LENGTH = 24


def _padding(pattern: str) -> torch.Tensor:
    """(2, LENGTH) attention_mask, 0 at padding."""
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    if pattern == "left":
        padding[0, :5] = 0
        padding[1, :11] = 0
    elif pattern == "right":
        padding[0, LENGTH - 3 :] = 0
        padding[1, LENGTH - 10 :] = 0
    elif pattern == "all-padding row":
        padding[0, :4] = 0
        padding[1] = 0
    return padding


PATTERNS = ["left", "right", "all-padding row"]


@pytest.fixture(scope="module")
def gemma():
    """One compiled model for the module: the padding is data, so every pattern reuses the graph."""
    torch._dynamo.reset()
    model = tiny_gemma4()
    assert model.config.attention_bias is False  # a zero attention row stays zero through o_proj
    capture = Capture()
    yield model, torch.compile(model, backend=capture, fullgraph=True), capture
    assert len(capture.graphs) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("pattern", PATTERNS)
def test_loss_ignoring_padding_and_every_gradient_match_eager(gemma, pattern):
    model, compiled, capture = gemma
    ids, padding = token_batch(LENGTH), _padding(pattern)
    labels = ids.masked_fill(padding == 0, -100)
    assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=labels, use_cache=False)
    assert [d.verdict for d in capture.report.rewritten()] == [
        "rewritten: window (7, 0), key padding from attention_mask"
    ] * 2 + ["rewritten: window (-1, 0), key padding from attention_mask"]  # the global layer: the document kernel


@pytest.mark.parametrize("pattern", PATTERNS)
def test_padded_positions_match_eager_too(gemma, pattern):
    """A loss that reads padded positions (labels on padding) and every gradient equal eager's:
    the op computes a padded query row over the keys its window sees, as SDPA does."""
    model, compiled, capture = gemma
    ids, padding = token_batch(LENGTH), _padding(pattern)
    # labels a copy: the same tensor as input_ids would be a different graph for Dynamo.
    inputs = dict(input_ids=ids, attention_mask=padding, labels=ids.clone(), use_cache=False)
    assert_training_matches(model, compiled, **inputs)
    assert [d.module for d in capture.report.rewritten()] == [f"model.layers.{k}.self_attn" for k in range(3)]
    logits, eager_logits = compiled(**inputs).logits.detach(), model(**inputs).logits.detach()
    assert_close_scaled(logits, eager_logits, "logits at every position")


def _two_calls_in_a_checkpoint(q, k, v, padding):
    """Two SDPA calls in one checkpoint body on a mask built there from the outer padding:
    the fuzzer (seed 110544) found the second call's padding passed into the body under the
    first one's argument name, which no longer compiled. Both calls keep SDPA now: eager's
    recomputation builds the mask from the padding again (tests/integrations/test_images.py writes it)."""
    from torch.utils.checkpoint import checkpoint

    def body(q, k, v, padding):
        positions = torch.arange(q.shape[2])
        band = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 4)
        mask = band[None, None] & padding[:, None, None, :].bool()
        first = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return first + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return checkpoint(body, q, k, v, padding, use_reentrant=False)


def test_two_calls_in_a_checkpoint_body_share_the_padding_passed_in():
    from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, 12:] = 0
    compiled, capture = compiled_with_capture(_two_calls_in_a_checkpoint)
    assert_same_as_eager(_two_calls_in_a_checkpoint, compiled, qkv(batch=2), padding)
    assert [d.verdict for d in capture.report] == [
        "kept: mask is window (3, 0), key padding from padding, but its checkpointed body builds the mask from "
        "padding again in the backward"
    ] * 2


@pytest.mark.parametrize("pattern", ["left", "all-padding row"])
def test_a_chunk_after_a_cache_matches_eager(pattern):
    """The second chunk of a left-padded batch's chunked prefill: 12 queries over the sliding
    cache's 7 keys and their own, the padding read from the cache's first token (5) on. Loss
    and every gradient equal eager's, fp32 and fp64 (each run with its own copy of the cache,
    built by its own model)."""
    model = tiny_gemma4()
    ids, padding = token_batch(LENGTH), _padding(pattern)
    split = 12

    def prefill(module):
        with torch.no_grad():
            return cache_of(module(input_ids=ids[:, :split], attention_mask=padding[:, :split], use_cache=True))

    torch._dynamo.reset()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    chunk = dict(
        input_ids=ids[:, split:],
        attention_mask=padding,
        labels=ids[:, split:].masked_fill(padding[:, split:] == 0, -100),
    )
    reference = copy.deepcopy(model).double()
    results = [
        loss_and_grads(m, **{CACHE: prefill(c)}, use_cache=True, **chunk)
        for m, c in ((compiled, model), (model, model), (reference, reference))
    ]
    (loss, grads), *references = results
    for ref_loss, ref_grads in references:
        assert_close_scaled(loss, ref_loss, "loss")
        for name in grads:
            assert_close_scaled(grads[name], ref_grads[name], name)
    sliding = [d.verdict for d in capture.report if d.rule == "sliding_window"]
    assert sliding.count("rewritten: window (7, 0), key padding from attention_mask shifted by 5") == 2, sliding
