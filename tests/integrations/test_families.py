"""Every sliding-window model that builds masks like Gemma-4 is rewritten without naming it:
Mistral, Qwen2 and Gemma-3 from transformers, Gemma-4's bidirectional mode, and the causal
rule on full-attention layers. Numerics as in tests/helpers/models.py."""

import pytest
import torch
import transformers

from tests.helpers.models import CACHE, Capture, assert_training_matches, cache_of, tiny_gemma4, token_batch

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attn_implementation="sdpa",
)
FAMILIES = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(sliding_window=8, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(sliding_window=8, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
    ),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decisions(model, **inputs):
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    assert_training_matches(model, compiled, **inputs)
    return [(d.rule, d.verdict) for d in capture.report]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_families(family):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**COMMON, **extra))
    ids = token_batch(32)
    decisions = _decisions(model, input_ids=ids, labels=ids, use_cache=False)
    assert ("sliding_window", "rewritten: window (7, 0)") in decisions
    if family != "mistral":  # Mistral's layers all slide; the others have one full layer
        assert len(decisions) == 2 and decisions[0] == ("sliding_window", "rewritten: window (7, 0)")


def test_gemma4_bidirectional_sliding_layers():
    model = tiny_gemma4(use_bidirectional_attention="all")
    ids = token_batch(32)
    decisions = _decisions(model, input_ids=ids, labels=ids, use_cache=False)
    # transformers turns window 8 into |q - kv| <= 8 // 2 + 1 for bidirectional layers.
    assert decisions[:2] == [("sliding_window", "rewritten: window (5, 5)")] * 2
    assert decisions[2] == ("sliding_window", "kept: no mask (is_causal=False)")


def test_full_attention_layer_drops_its_mask():
    model = tiny_gemma4()
    ids = token_batch(32)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits
        ref = model.double()(input_ids=ids, use_cache=False).logits
    model.float()
    scale = max(1.0, ref.abs().max().item())
    assert (out.double() - ref).abs().max().item() <= 1e-4 * scale
    assert capture.report[-1].verdict == "rewritten: plain causal mask -> is_causal=True"
    (gm,) = capture.graphs
    # No (batch, 1, S, S) mask is built any more: nothing is expanded to S x S.
    assert not [n for n in gm.graph.nodes if n.name.startswith("attention_mask")]


def test_decoding_with_a_cache_is_bottom_right_aligned():
    import copy

    model = tiny_gemma4().eval()
    ids = token_batch(24)
    # 8 queries after the sliding cache's 7 keys: 2w - 1 keys, the fewest the rule rewrites.
    with torch.no_grad():
        cache = cache_of(model(input_ids=ids[:, :16], use_cache=True))
        reference_cache = copy.deepcopy(cache)
        capture = Capture()
        compiled = torch.compile(model, backend=capture, fullgraph=True)
        step = compiled(input_ids=ids[:, 16:24], **{CACHE: cache}, use_cache=True).logits
        reference = model.double()(
            input_ids=ids[:, 16:24],
            **{CACHE: _cache_in_double(reference_cache)},
            use_cache=True,
        ).logits
    model.float()
    assert [d.verdict for d in capture.report.rewritten()] == ["rewritten: window (7, 0)"] * 2
    scale = max(1.0, reference.abs().max().item())
    assert (step.double() - reference).abs().max().item() <= 1e-4 * scale


def _cache_in_double(cache):
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.double(), layer.values.double()
    return cache
