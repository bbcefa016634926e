"""Tiny random transformers models (no downloads), a backend that captures rewritten graphs,
and training comparisons.

Tolerance: compiled graphs (inductor, or the rewritten graph run eagerly) against eager fp32
and an fp64 eager reference, as max |a - b| <= 1e-4 * max(1, max |b|) per tensor: fp32
round-off through a few layers, with reassociation by inductor.
"""

import copy

import torch
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

import compile_pass

GEMMA_WINDOW = 8


def tiny_gemma4(dtype=torch.float32, **overrides) -> Gemma4ForCausalLM:
    """6 layers (5 sliding, window 8, head_dim 16; 1 global, head_dim 32), 4 query heads per 2 KV heads."""
    settings = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
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


def count_calls(gm, target) -> int:
    """Calls of ``target`` in the graph and its activation-checkpoint bodies."""
    from compile_pass.graphs import scopes

    return sum(
        1 for scope in scopes(gm) for node in scope.module.graph.nodes if node.target is target
    )


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
