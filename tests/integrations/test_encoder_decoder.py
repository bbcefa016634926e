"""An encoder-decoder with sliding windows, attention spelled out in ops (T5Gemma: soft-capped
scores, eager only), trained one step on a padded batch: the encoder's two-sided sliding
layers, its padded full layers, the decoder's self-attention (its padding computed from the ids
it shifts right: a buffer filled before it is read, ``proof/aliasing.py``) and the
cross-attention over the padded encoder states, each layer's decision, and the loss and every
gradient against eager (the language-model loss plus one over every encoder position, so that
padded rows and rows that see no key carry gradient)."""

import torch
import transformers

from tests.helpers.models import Capture, assert_close_scaled, token_batch

W = 4
MODULE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=W,
    max_position_embeddings=256,
    layer_types=["sliding_attention", "full_attention"],
    attn_logit_softcapping=5.0,
    bos_token_id=1,
    pad_token_id=0,
    eos_token_id=2,
)


def _model():
    torch.manual_seed(0)
    config = transformers.T5GemmaConfig(
        encoder=dict(MODULE), decoder=dict(MODULE), vocab_size=128, attn_implementation="eager"
    )
    return transformers.T5GemmaForConditionalGeneration(config).train()


def _batch():
    ids = token_batch(12).clamp(min=3)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, 7:] = 0  # right padding: the encoder's rows 11.. see no key in a window of 4 each side
    labels = token_batch(10, seed=1).clamp(min=3)
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


SLIDING = "window (4, 4) (additive mask), key padding from attention_mask"
CAUSAL = "window (3, 0) (additive mask), key padding from shifted_input_ids"
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
