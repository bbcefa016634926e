"""Padded batches on transformers' Gemma-4 (tiny random config, fp32): what changes and what
does not when the sliding layers are rewritten.

The op returns zeros at a query row whose own token is padding (FA2 varlen semantics), so:
- at every non-padded position the rewritten model equals eager: padded keys are masked, so
  a padded position never reaches a non-padded one;
- a loss that ignores padded positions (labels -100 there) and every gradient are eager's;
- a loss that reads padded positions differs there, and only there: it is eager's with the
  attention output of padded rows zeroed in the rewritten layers.
Tolerances are tests/models.py's: 1e-4 relative to eager fp32 and eager fp64.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.models import Capture, assert_close_scaled, assert_training_matches, loss_and_grads, tiny_gemma4, token_batch

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
    ] * 5


def _zero_padded_rows(model, modules, padding):
    """Hooks that zero the output of ``modules`` (attention layers) at padded query rows: the
    FA2 varlen semantics the rewritten layers have, written on eager."""
    keep = padding.to(next(model.parameters()).dtype)[:, :, None]

    def hook(module, args, output):
        return (output[0] * keep, *output[1:])

    return [model.get_submodule(name).register_forward_hook(hook) for name in modules]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_with_labels_on_padding_only_padded_positions_differ(gemma, pattern):
    model, compiled, capture = gemma
    ids, padding = token_batch(LENGTH), _padding(pattern)
    # labels a copy: the same tensor as input_ids would be a different graph for Dynamo.
    inputs = dict(input_ids=ids, attention_mask=padding, labels=ids.clone(), use_cache=False)
    loss, grads = loss_and_grads(compiled, **inputs)
    rewritten = [d.module for d in capture.report.rewritten()]
    assert rewritten == [f"model.layers.{k}.self_attn" for k in range(5)]

    # Eager with padded rows zeroed in the rewritten layers: the same loss, every gradient.
    reference = copy.deepcopy(model).double()
    for eager in (model, reference):
        hooks = _zero_padded_rows(eager, rewritten, padding)
        try:
            expected_loss, expected_grads = loss_and_grads(eager, **inputs)
        finally:
            for handle in hooks:
                handle.remove()
        assert_close_scaled(loss, expected_loss, "loss")
        for name, grad in grads.items():
            assert_close_scaled(grad, expected_grads[name], name)

    # And plain eager, at non-padded positions: the same logits, and the same loss over them.
    valid = padding.bool()
    # (With grad mode on, as in training: a no_grad call would compile a second graph.)
    logits, eager_logits = compiled(**inputs).logits.detach(), model(**inputs).logits.detach()
    assert_close_scaled(logits[valid], eager_logits[valid], "logits at non-padded positions")
    scored = valid[:, :-1]  # position t predicts token t + 1

    def loss_over_non_padded(found_logits):
        return F.cross_entropy(found_logits[:, :-1][scored].double(), ids[:, 1:][scored])

    assert_close_scaled(loss_over_non_padded(logits), loss_over_non_padded(eager_logits), "loss over non-padded")
