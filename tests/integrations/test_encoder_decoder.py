"""An encoder-decoder with sliding windows, attention spelled out in ops (T5Gemma: soft-capped
scores, eager only), trained one step on a padded batch: the encoder's two-sided sliding
layers, its padded full layers, the decoder's self-attention (its padding computed from the ids
it shifts right: a buffer filled before it is read, ``proof/aliasing.py``) and the
cross-attention over the padded encoder states, each layer's decision, and the loss and every
gradient against eager (the language-model loss plus one over every encoder position, so that
padded rows and rows that see no key carry gradient)."""

import torch

from benchmarks import families
from tests.helpers.models import Capture, assert_close_scaled, token_batch


def _model():
    """T5Gemma as benchmarks/families.py builds it (window 8, scores capped at 5), in training."""
    _, model = families.family_model("T5Gemma")
    return model.train()


def _batch():
    ids = token_batch(24).clamp(min=3)
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[1, 7:] = 0  # right padding: the encoder's rows 15.. see no key in a window of 8 each side
    labels = token_batch(20, seed=1).clamp(min=3)
    labels[1, 6:] = -100  # the decoder's padding: shifted right, made pad_token_id
    return dict(input_ids=ids, attention_mask=padding, labels=labels)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    outputs = model(**batch)
    loss = outputs.loss + outputs.encoder_last_hidden_state.square().mean()
    loss.backward()
    return loss.detach(), {
        name.removeprefix("_orig_mod."): p.grad.detach().clone() for name, p in model.named_parameters()
    }


def _decisions(switches: dict):
    model, batch = _model(), _batch()
    torch._dynamo.reset()
    capture = Capture(**switches)
    loss, grads = _loss_and_grads(torch.compile(model, backend=capture), batch)
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    assert_close_scaled(loss, ref_loss, "loss")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], name)
    return [d.verdict for report in capture.reports for d in report]


SLIDING = "window (8, 8) (additive mask), key padding from attention_mask"
CAUSAL = "window (7, 0) (additive mask), key padding from shifted_input_ids"
FULL_CAUSAL = "window (-1, 0) (additive mask), key padding from shifted_input_ids"
BIDIRECTIONAL = "window (-1, -1) (additive mask), key padding from attention_mask"
MEAN_AND_CAP = ", rows without a visible key the mean of the values, soft-capped scores (cap 5)"


def test_every_layer_on_the_op_is_exact():
    """slow_kernels=True: every layer on the op, so every form is checked exact, whatever the
    policy would choose at this size."""
    verdicts = _decisions({"slow_kernels": True})
    assert sorted(verdicts) == sorted(
        f"rewritten: attention spelled out in ops: {band}{MEAN_AND_CAP}"
        for band in (SLIDING, BIDIRECTIONAL, CAUSAL, BIDIRECTIONAL, FULL_CAUSAL, BIDIRECTIONAL)
    )


def test_by_default_the_full_layers_keep_their_chain_where_no_kernel_is_faster():
    """The policy's answer on the CPU: soft-capped scores without a left bound (the encoder's
    full layers, the cross-attention) are kept, named; the sliding and the decoder's causal
    layers are rewritten."""
    verdicts = _decisions({})
    rewritten = sorted(v for v in verdicts if v.startswith("rewritten"))
    assert rewritten == sorted(
        f"rewritten: attention spelled out in ops: {band}{MEAN_AND_CAP}" for band in (SLIDING, CAUSAL, FULL_CAUSAL)
    )
    kept = [v for v in verdicts if v.startswith("kept")]
    assert len(kept) == 3 and all("no kernel is exact and as fast as SDPA here" in v for v in kept)
