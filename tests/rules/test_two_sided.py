"""Two-sided windows in every spelling transformers writes (``abs(kv - q) < w``, the OR of a
causal band and a two-sided one, ``(kv - q).abs() <= w - 1``, ``w > abs(q - kv)``, the
bidirectional mask functions of ``masking_utils``, a padding-only bidirectional mask), each
read as a bound on ``kv - q``; near misses (an ``abs`` of something else, a distance at least
``c``) kept with the step named. Gemma-3 trained bidirectionally has both layers on the op."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, masking_utils

from tests.helpers.models import Capture, assert_training_matches, token_batch
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 5


def _distance(q):
    positions = torch.arange(q.shape[2], device=q.device)
    return positions[None, :] - positions[:, None]  # kv - q


def abs_below(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_distance(q).abs() < W)


def abs_or_causal_band(q, k, v):  # Gemma-3's bidirectional sliding layers
    d = _distance(q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(torch.abs(-d) < W) | ((d <= 0) & (d > -W)))


def abs_at_most(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_distance(q).abs() <= W - 1)


def bound_above_abs(q, k, v):
    positions = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=W > abs(positions[:, None] - positions[None, :]))


def overlay_of_masking_utils(q, k, v):
    """``sliding_window_bidirectional_mask_function``, evaluated as ``sdpa_mask`` does: vmap
    over the indices."""
    function = masking_utils.sliding_window_bidirectional_mask_function(W - 1)
    n = q.shape[2]
    index = torch.arange(n)
    mask = torch.vmap(torch.vmap(function, in_dims=(None, None, None, 0)), in_dims=(None, None, 0, None))(
        torch.tensor(0), torch.tensor(0), index, index
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "spelling", [abs_below, abs_or_causal_band, abs_at_most, bound_above_abs, overlay_of_masking_utils]
)
def test_each_spelling_of_a_two_sided_window_is_read_and_exact(spelling):
    compiled, capture = compiled_with_capture(spelling)
    assert_same_as_eager(spelling, compiled, qkv(seq=24))
    (decision,) = [d for d in capture.report if d.rule == "sliding_window"]
    assert decision.verdict == f"rewritten: window ({W - 1}, {W - 1})"


def _padded_bidirectional(q, k, v, padding):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=padding[:, None, None, :].bool())


def test_a_bidirectional_padding_only_mask_is_a_full_window_with_key_padding():
    q, k, v = qkv(seq=24, batch=2)
    padding = torch.ones(2, 24, dtype=torch.long)
    padding[1, 17:] = 0
    compiled, capture = compiled_with_capture(_padded_bidirectional)
    assert_same_as_eager(_padded_bidirectional, compiled, (q, k, v), padding)
    (decision,) = capture.report
    assert decision.verdict == "rewritten: window (-1, -1), key padding from padding"


def abs_of_a_sum(q, k, v):
    positions = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(positions[None, :] + positions[:, None]).abs() <= 8)


def abs_at_least(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_distance(q).abs() >= 3)


def abs_of_a_scaled_distance(q, k, v):
    positions = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(positions[None, :] - 2 * positions[:, None]).abs() < 4)


@pytest.mark.parametrize(
    ("near_miss", "reason"),
    [
        (abs_of_a_sum, "mask term kv + q <= 8 is not a bound on kv - q"),
        (abs_at_least, "is not one interval of kv - q"),
        (abs_of_a_scaled_distance, "is not a bound on kv - q"),
    ],
)
def test_near_misses_of_a_two_sided_window_are_kept_naming_the_step(near_miss, reason):
    compiled, capture = compiled_with_capture(near_miss)
    assert_same_as_eager(near_miss, compiled, qkv(seq=24))
    (decision,) = [d for d in capture.report if d.rule == "sliding_window"]
    assert not decision.rewritten and reason in decision.reason


@pytest.mark.parametrize("padded", [False, True])
def test_gemma3_trained_bidirectionally_has_both_layers_on_the_op_and_trains_exactly(padded):
    config = Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=9,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True,
        attn_implementation="sdpa",
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    ids = token_batch(24)
    inputs = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones_like(ids)
        mask[1, 18:] = 0
        inputs["attention_mask"] = mask
    torch._dynamo.reset()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    assert_training_matches(model, compiled, **inputs)
    verdicts = {d.layer_type: d.verdict for report in capture.reports for d in report}
    window = config.sliding_window - 1  # transformers halves the window of a bidirectional Gemma-3
    padding = ", key padding from attention_mask" if padded else ""
    assert verdicts["sliding_attention"] == f"rewritten: window ({window}, {window}){padding}"
    assert verdicts["full_attention"].startswith("rewritten: window (-1, -1)") or (
        not padded and "no mask" in verdicts["full_attention"]
    )
