"""generate() compiled with compile_pass: the same greedy tokens as eager, and decisions
that say which prefill and decode graphs were rewritten.

With transformers' default dynamic cache, sliding layers keep the last w - 1 keys: the
prefill of a prompt longer than the window is rewritten to the op; once a decode step's mask
exists it shows every cached key (the cache holds at most a window), and the mask is dropped.
With ``cache_implementation="static"`` transformers builds the masks outside the compiled
forward: tests/rules/test_mask_input.py covers that case."""

import re

import pytest
import torch
import transformers

import compile_pass
from tests.helpers.models import Capture, tiny_gemma4, token_batch

PROMPT, NEW_TOKENS = 12, 8  # the prompt is longer than the window (8)


def _mistral():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
    )
    return transformers.MistralForCausalLM._from_config(config, attn_implementation="sdpa")


MODELS = {"gemma4": tiny_gemma4, "mistral": _mistral}


def _generate(model, **options):
    with torch.no_grad():
        return model.generate(token_batch(PROMPT, batch=1), do_sample=False, max_new_tokens=NEW_TOKENS, **options)


# Each way once: the named backend (inductor), enable() (inductor's pre-grad pass), and the
# rewrite alone run eagerly (``Capture``), which checks Gemma-4's tokens without compiling
# its decode graphs a second time.
@pytest.mark.parametrize(("family", "way"), [("gemma4", "rewrite"), ("gemma4", "enable"), ("mistral", "backend")])
def test_generate_with_the_dynamic_cache(family, way):
    model = MODELS[family]().eval()
    expected = _generate(model)
    torch._dynamo.reset()
    eager_forward = model.forward
    with compile_pass.decisions() as report:
        if way in ("backend", "rewrite"):
            model.forward = torch.compile(eager_forward, backend="compile_pass" if way == "backend" else Capture())
            tokens = _generate(model)
        else:
            # A cache hit (an earlier run of this test) would reuse the rewritten artifact
            # without running the pass, and report no decisions.
            with torch._inductor.config.patch(fx_graph_cache=False), compile_pass.enable():
                model.forward = torch.compile(eager_forward)
                tokens = _generate(model)
    model.forward = eager_forward
    assert torch.equal(tokens, expected)
    verdicts = [d.verdict for d in report if d.rule != "topk_mask"]
    # The prefill: every sliding layer to the op.
    sliding_layers = 2  # either model
    assert verdicts.count("rewritten: window (7, 0)") == sliding_layers, verdicts
    # Decode steps whose sliding mask exists show every cached key: no mask at all.
    assert "rewritten: mask shows every key -> no mask" in verdicts, verdicts
    assert not [v for v in verdicts if "internal error" in v]


def test_chunked_prefill_of_a_left_padded_batch():
    """generate() with ``prefill_chunk_size``: the second chunk attends to the sliding cache's
    keys and its own, its padding read from the cache's first token on (a cache length that
    Dynamo makes a size input); rewritten, and the tokens are eager's."""
    model = tiny_gemma4().eval()
    prompt = token_batch(24)
    padding = torch.ones_like(prompt)
    padding[0, :5] = 0

    def generate():
        with torch.no_grad():
            return model.generate(
                prompt, attention_mask=padding, do_sample=False, max_new_tokens=4, prefill_chunk_size=12
            )

    expected = generate()
    torch._dynamo.reset()
    eager_forward = model.forward
    with compile_pass.decisions() as report:
        model.forward = torch.compile(eager_forward, backend=Capture())
        tokens = generate()
    model.forward = eager_forward
    assert torch.equal(tokens, expected)
    verdicts = [d.verdict for d in report if d.rule == "sliding_window"]
    # The first chunk's mask reads the padding from token 0, the second's from the cache's first.
    assert verdicts.count("rewritten: window (7, 0), key padding from attention_mask") == 2, verdicts
    second = [
        v for v in verdicts if v.startswith("rewritten: window (7, 0), key padding from attention_mask shifted by ")
    ]
    assert len(second) == 2 and re.fullmatch(r".* shifted by s\d+ - 7", second[0]), verdicts
