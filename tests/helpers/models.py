"""Tiny random transformers models (no downloads), a backend that captures rewritten graphs,
and training comparisons.

Tolerance: compiled graphs (inductor, or the rewritten graph run eagerly) against eager fp32
and an fp64 eager reference, as max |a - b| <= 1e-4 * max(1, max |b|) per tensor: fp32
round-off through a few layers, with reassociation by inductor.
"""

import copy
import inspect

import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

import compile_pass

GEMMA_WINDOW = 8

# transformers 5.24 renamed the models' `past_key_values` (argument and output field) to
# `cache`, keeping the old name with a deprecation until 5.40; older releases know only it.
CACHE = "cache" if "cache" in inspect.signature(Gemma4ForCausalLM.forward).parameters else "past_key_values"


def cache_of(output):
    """The cache a forward with ``use_cache=True`` returned, by the installed release's name."""
    return getattr(output, CACHE)


def tiny_gemma4(dtype=torch.float32, **overrides) -> Gemma4ForCausalLM:
    """3 layers (2 sliding, window 8, head_dim 16; then 1 global, head_dim 32), 4 query heads per 2
    KV heads: every kind of Gemma-4 call (a sliding layer with no layer before it, one after
    another, the global one) with half the layers of the released 5:1 pattern's 6 to trace."""
    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        layer_types=["sliding_attention"] * 2 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=GEMMA_WINDOW,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return Gemma4ForCausalLM(Gemma4TextConfig(**settings)).to(dtype)


GPT_OSS_WINDOW = 4


def tiny_gpt_oss(dtype=torch.float32, **overrides):
    """GPT-OSS (eager attention: transformers gives it no SDPA path) with 2 layers (sliding,
    window 4; then full), 4 query heads per 2 KV heads, its MoE (4 experts, 2 per token) and
    random non-zero sinks."""
    from transformers import GptOssConfig, GptOssForCausalLM

    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=GPT_OSS_WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
        use_cache=False,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**settings))
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks)
    return model.to(dtype)


def fp64_reference(model):
    """A float64 copy of ``model`` for eager reference runs; MoE experts on transformers' eager
    loop, which takes float64 (its grouped_mm path does not)."""
    reference = copy.deepcopy(model)
    if hasattr(reference.config, "_experts_implementation"):
        reference.config._experts_implementation = "eager"
    return reference.double()


class Capture:
    """A torch.compile backend: rewrite with compile_pass, keep graph and report, run eagerly."""

    def __init__(self, **switches):
        self.switches = switches
        self.graphs = []
        self.reports = []

    def __call__(self, gm, example_inputs):
        report = compile_pass.rewrite(gm, **self.switches)
        self.reports.append(report)
        self.graphs.append(gm)
        return gm.forward

    @property
    def report(self):
        (report,) = self.reports
        return report


def checkpointed(model):
    """``model`` with non-reentrant activation checkpointing on every layer, as the Trainer turns
    it on (``activation_checkpointing_enable`` where the installed transformers has it: it
    deprecates the older name)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def side_effects_once():
    """The Dynamo setting the README tells users to set for a checkpointed forward that writes
    Python state (Gemma-4's KV sharing since transformers 5.24): such a forward compiles, its
    writes made once, in the forward."""
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def sliding_layers(model) -> int:
    """How many of the model's layers are sliding ones, as the installed transformers built the
    config (5.24 forces Gemma-4's last layer to full attention)."""
    return list(model.config.layer_types).count("sliding_attention")


def packed_window_function(window: int, positions: torch.Tensor, ids_positions: torch.Tensor | None = None):
    """The mask function transformers builds for a sliding window over packed sequences, as the
    installed version spells it: 5.24 remaps the positions and ANDs the sequence ids; earlier
    releases had one function (``packed_sequence_compatibility_function``) for both. The ids
    come from ``ids_positions`` where given (the fuzzer's near misses), else ``positions``."""
    from transformers import masking_utils as mu

    ids = mu.find_packed_sequence_indices(positions if ids_positions is None else ids_positions)
    window_function = mu.sliding_window_causal_mask_function(window)
    if hasattr(mu, "remap_positions_for_packed_sequence"):
        remapped = mu.remap_positions_for_packed_sequence(window_function, positions)
        return mu.and_masks(remapped, mu.packed_sequence_mask_function(ids))
    return mu.packed_sequence_compatibility_function(window_function, positions, ids)


def at_sdpa_call(text: str) -> str:
    """``text`` with ``transformers/integrations/sdpa_attention.py:N`` written as ``...:<SDPA
    call>`` where N is the line at which the installed transformers calls SDPA (read from its
    source): a report's line is checked without a test pinning a line of transformers."""
    import inspect

    from transformers.integrations import sdpa_attention

    lines = inspect.getsource(sdpa_attention).splitlines()
    (line,) = [number for number, text_line in enumerate(lines, 1) if "scaled_dot_product_attention(" in text_line]
    path = "transformers/integrations/sdpa_attention.py"
    return text.replace(f"{path}:{line}", f"{path}:<SDPA call>")


def count_calls(gm, target) -> int:
    """Calls of ``target`` in the graph and its activation-checkpoint bodies."""
    from compile_pass.graphs import scopes

    return sum(1 for scope in scopes(gm) for node in scope.module.graph.nodes if node.target is target)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    # A compiled module names its parameters "_orig_mod.<name>".
    return loss.detach(), {
        name.removeprefix("_orig_mod."): p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad  # frozen weights (LoRA's base model) have no gradient
    }


def every_position_loss_and_grads(model, **inputs):
    """As ``loss_and_grads``, the loss the mean square of every position's logits, padded rows
    included, so that rows that see no key carry gradient (a language-model loss masks them out)."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).logits.float().square().mean()
    loss.backward()
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return loss.detach(), {name.removeprefix("_orig_mod."): p.grad.detach().clone() for name, p in trained}


TOLERANCE = 1e-4


def assert_close_scaled(actual, expected, name="", tolerance=TOLERANCE):
    scale = max(1.0, expected.abs().max().item())
    error = (actual.double() - expected.double()).abs().max().item()
    assert error <= tolerance * scale, f"{name}: {error} > {tolerance * scale}"


def assert_training_matches(model, compiled, **inputs):
    """Loss and every parameter gradient against eager fp32 and eager fp64."""
    loss, grads = loss_and_grads(compiled, **inputs)
    eager_loss, eager_grads = loss_and_grads(model, **inputs)
    reference = copy.deepcopy(model).double()
    ref_loss, ref_grads = loss_and_grads(reference, **inputs)
    assert_close_scaled(loss, eager_loss, "loss vs eager")
    assert_close_scaled(loss, ref_loss, "loss vs fp64")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close_scaled(grads[name], eager_grads[name], name)
        assert_close_scaled(grads[name], ref_grads[name], name)


def token_batch(length, batch=2, seed=0):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
