"""Activation checkpointing of a forward that writes Python state: transformers' Gemma-4 stores
each layer type's K/V for later layers (KV sharing) inside the checkpointed layer since 5.24.

Dynamo traces such a forward only with ``skip_fwd_side_effects_in_bwd_under_checkpoint``
(the write is made once, in the forward; eager's recomputation makes it again). The setting
is the user's (docs/training.md, "Gradient checkpointing"); without it the checkpointed calls leave the
graph, and compile_pass says which setting compiles them. With it, Gemma-4's KV-shared layers
train as eager does: the layers that read the stored K/V get them through the graph."""

import importlib
import logging

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.models import (
    Capture,
    assert_training_matches,
    checkpointed,
    side_effects_once,
    sliding_layers,
    tiny_gemma4,
    token_batch,
)
from tests.helpers.small_graphs import qkv

W = 4
driver = importlib.import_module("compile_pass.backend")  # the module; the package's attribute is the function


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _storing_checkpoint(store):
    """A checkpointed sliding attention whose forward keeps its K/V in ``store``, as Gemma-4's
    KV-sharing layers do."""

    def body(q, k, v):
        store["kv"] = (k, v)
        i = torch.arange(q.shape[2])
        mask = (i[None, :] > i[:, None] - W) & (i[None, :] <= i[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    # Work before the checkpoint, as a model's embedding: that graph reaches the backend.
    return lambda q, k, v: torch.utils.checkpoint.checkpoint(body, q * 2, k, v, use_reentrant=False)


def test_a_checkpointed_write_that_breaks_the_graph_names_the_setting(monkeypatch, caplog):
    monkeypatch.setattr(driver, "_checkpoint_breaks_told", False)
    capture = Capture()
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="compile_pass"):
        torch.compile(_storing_checkpoint({}), backend=capture)(q, k, v)
    assert "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True" in caplog.text
    assert not [d for report in capture.reports for d in report.rewritten()]


def test_with_the_setting_the_checkpointed_write_compiles_and_matches_eager():
    capture, store, eager_store = Capture(), {}, {}
    with side_effects_once():
        compiled = torch.compile(_storing_checkpoint(store), backend=capture, fullgraph=True)
        q, k, v = qkv()
        out = compiled(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    reference = _storing_checkpoint(eager_store)(q, k, v)
    for ours, eager in zip((out, *grads), (reference, *torch.autograd.grad(reference.sum(), (q, k, v))), strict=True):
        torch.testing.assert_close(ours, eager, atol=1e-12, rtol=0)
    # The write was made, once, with the forward's values.
    torch.testing.assert_close(store["kv"][0], k, atol=0, rtol=0)
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0)"]


def test_kv_shared_gemma4_layers_under_checkpointing_train_as_eager():
    """The last two of six layers (one sliding, one full) reuse the K/V that layers 2 and 3
    store (``num_kv_shared_layers=2``), every layer checkpointed: loss and every gradient as
    eager's (which replays the stores in its recomputation) and fp64's, every sliding layer
    rewritten, the shared one included."""
    kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    model = checkpointed(tiny_gemma4(num_hidden_layers=6, num_kv_shared_layers=2, layer_types=kinds))
    modes = getattr(model.config, "kv_sharing_modes", None)
    if modes is not None:  # the installed transformers says which layers store and reuse
        assert "store" in modes and modes.count("reuse") == 2, modes
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    with side_effects_once():
        assert_training_matches(model, compiled, input_ids=ids, labels=ids, use_cache=False)
    sliding = [d for d in capture.report.rewritten() if d.rule == "sliding_window"]
    assert len(sliding) == sliding_layers(model) == 4


class _Attention(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx  # as transformers' attention modules declare it

    def forward(self, q, k, v):
        i = torch.arange(q.shape[2])
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=(i[None, :] > i[:, None] - W) & (i[None, :] <= i[:, None])
        )


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = _Attention(layer_idx)

    def forward(self, q, k, v):
        torch._dynamo.graph_break()  # as a checkpointed layer that writes Python state breaks it
        return self.self_attn(q, k, v)


class _Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(0), _Layer(1)])

    def forward(self, q, k, v):
        for layer in self.layers:
            q = layer(q, k, v)
        return q


def test_a_graph_that_starts_inside_a_layer_names_the_layer():
    """After a graph break inside a layer, Dynamo's graph starts in the layer's own frame: the
    call's module path is only ``self_attn`` (the frame's ``self`` is the layer), so the report
    names the layer by the index the attention module declares."""
    capture = Capture()
    torch.compile(_Layers(), backend=capture)(*qkv())
    # The second layer runs the first one's compiled frame (the same code, its guards pass).
    (decision,) = [d for report in capture.reports for d in report]
    assert (decision.module, decision.name, decision.layer) == ("self_attn", "self_attn (layer 0)", 0)
    (report,) = [report for report in capture.reports if len(report)]
    assert report.table().splitlines()[1].startswith("0       self_attn (layer 0)")
