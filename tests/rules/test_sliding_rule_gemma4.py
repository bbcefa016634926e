"""The sliding rule on transformers' own Gemma-4 (tiny random config, fp32, CPU).

Numerics: ``assert_training_matches`` (tests/helpers/models.py) compares loss and every parameter
gradient with eager fp32 and eager fp64 at 1e-4 relative.
"""

import logging

import expecttest
import pytest
import torch

import compile_pass
from compile_pass.backend import RewritePass
from compile_pass.ops import sliding_window_attention_forward
from tests.helpers.models import (
    Capture,
    assert_training_matches,
    at_sdpa_call,
    checkpointed,
    count_calls,
    side_effects_once,
    tiny_gemma4,
    token_batch,
)

SDPA = torch._C._nn.scaled_dot_product_attention
OP = sliding_window_attention_forward


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TestGemma4Decisions(expecttest.TestCase):
    def test_exactly_the_sliding_layers_are_rewritten(self):
        model = tiny_gemma4()
        capture = Capture()
        torch.compile(model, backend=capture, fullgraph=True)(input_ids=token_batch(32), use_cache=False)
        (gm,) = capture.graphs
        assert count_calls(gm, OP) == 2
        assert count_calls(gm, SDPA) == 1
        self.assertExpectedInline(
            at_sdpa_call(capture.report.table()),
            """\
layers  module                    layer type         rule            decision                                        kernel
0-1     model.layers.*.self_attn  sliding_attention  sliding_window  rewritten: window (7, 0)                        chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys
2       model.layers.2.self_attn  full_attention     causal_mask     rewritten: plain causal mask -> is_causal=True
called at transformers/integrations/sdpa_attention.py:<SDPA call>
3 of 3 attention calls rewritten""",  # noqa: E501 (a snapshot: printed lines as they are)
        )
        # K/V go to the op un-repeated, and the sliding mask's construction is gone.
        for node in gm.graph.find_nodes(op="call_function", target=OP):
            assert node.args[1].meta["example_value"].shape[1] == 2
        assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "cumsum"][1:]

    def test_global_layer_with_a_wide_head_is_kept_for_its_mask(self):
        """head_dim 512 is past FA2's limit, but on the CPU the op's kernel is as fast as SDPA at
        any head_dim: the mask, plain causal, is what keeps the layer (the causal rule is off)."""
        model = tiny_gemma4(global_head_dim=512)
        capture = Capture(causal_mask=False)
        torch.compile(model, backend=capture, fullgraph=True)(input_ids=token_batch(16), use_cache=False)
        assert capture.report[-1].verdict == "kept: mask is window (-1, 0): no sliding window"
        assert len(capture.report.rewritten()) == 2

    def test_padded_batch_is_rewritten_with_key_padding(self):
        model = tiny_gemma4()
        capture = Capture()
        torch.compile(model, backend=capture, fullgraph=True)(
            input_ids=token_batch(16), attention_mask=left_and_right_padding(16), use_cache=False
        )
        self.assertExpectedInline(
            at_sdpa_call(capture.report.table()),
            """\
layers  module                    layer type         rule            decision                                                    kernel
0-1     model.layers.*.self_attn  sliding_attention  sliding_window  rewritten: window (7, 0), key padding from attention_mask   chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys
2       model.layers.2.self_attn  full_attention     sliding_window  rewritten: window (-1, 0), key padding from attention_mask  documents, aten's fused CPU flash kernel once per padded row, the rest skipped
called at transformers/integrations/sdpa_attention.py:<SDPA call>
3 of 3 attention calls rewritten""",  # noqa: E501 (a snapshot: printed lines as they are)
        )


def left_and_right_padding(length, left=5, right=3):
    """Row 0 padded on the left, row 1 on the right, as tokenizers do."""
    padding = torch.ones(2, length, dtype=torch.long)
    padding[0, :left] = 0
    padding[1, length - right :] = 0
    return padding


def test_padded_training_matches_eager_and_padding_changes_do_not_recompile():
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(24)
    for left, right in ((5, 3), (2, 7)):
        padding = left_and_right_padding(24, left, right)
        labels = ids.masked_fill(padding == 0, -100)  # the loss reads valid tokens only
        assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=labels, use_cache=False)
    assert len(capture.graphs) == 1
    assert len(capture.report.rewritten()) == 3  # the global layer too, on the document kernel


def test_batch_of_one_with_attention_mask_is_rewritten():
    # A tokenizer's single sequence comes with an attention_mask; a batch-1 input has its
    # batch position pinned to 0, and the rule checks that call and mask both have batch 1.
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(24, batch=1)
    for padding in (torch.ones_like(ids), left_and_right_padding(24)[:1]):
        labels = ids.masked_fill(padding == 0, -100)
        assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=labels, use_cache=False)
    assert len(capture.graphs) == 1
    # The global layer too: the unpadded row runs one causal call (the batch turned out unpadded).
    assert [d.verdict for d in capture.report.rewritten()] == [
        "rewritten: window (7, 0), key padding from attention_mask"
    ] * 2 + ["rewritten: window (-1, 0), key padding from attention_mask"]


def test_dynamic_sequence_lengths_compile_once():
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    for length in (24, 40, 17):
        ids = token_batch(length, seed=length)
        torch._dynamo.mark_dynamic(ids, 1)
        assert_training_matches(model, compiled, input_ids=ids, labels=ids)
    assert len(capture.graphs) == 1
    assert len(capture.report.rewritten()) == 2


def test_dynamic_true_reads_the_module_floats_its_guards_pin():
    """``torch.compile(dynamic=True)`` passes a module's float attributes (the attention's
    dropout and scale) as inputs; SDPA's checks pin them with guards, so the rule reads the
    pinned values (the old rule kept every call: "dropout_p=item_11 (the op has no dropout)").
    Another dropout recompiles with the new value, and is kept."""
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True, dynamic=True)
    ids = token_batch(24)
    assert_training_matches(model, compiled, input_ids=ids, labels=ids)
    assert [d.verdict for d in capture.report.rewritten()] == ["rewritten: window (7, 0)"] * 2
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.25
    compiled(input_ids=token_batch(24), labels=token_batch(24))
    assert len(capture.graphs) == 2
    kept = [d.verdict for d in capture.reports[1] if d.layer_type == "sliding_attention"]
    assert kept == ["kept: dropout_p=0.25 (the op has no dropout)"] * 2


def test_a_float_scale_pinned_by_guards_is_read_and_another_recompiles():
    """Under dynamic=True a float argument is traced as a symbol, which SDPA's checks pin with a
    guard: the op is built with the pinned scale, and another scale must not reuse that graph."""
    capture = Capture()

    def attend(q, k, v, scale):
        i = torch.arange(q.shape[2])
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64) for _ in range(3))
    compiled = torch.compile(attend, backend=capture, dynamic=True)
    for scale in (0.3, 0.5):
        torch.testing.assert_close(compiled(q, k, v, scale), attend(q, k, v, scale), rtol=1e-12, atol=1e-12)
    assert [d.verdict for report in capture.reports for d in report] == ["rewritten: window (3, 0)"] * 2


def test_activation_checkpointing_bodies_are_rewritten():
    model = checkpointed(tiny_gemma4())
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    with side_effects_once():
        assert_training_matches(model, compiled, input_ids=ids, labels=ids, use_cache=False)
    sliding = [d.where for d in capture.report.rewritten() if d.rule == "sliding_window"]
    assert sliding == [f"wrap_body_{k}.attn_output" for k in range(2)]
    assert [d.where for d in capture.report.rewritten() if d.rule == "causal_mask"] == ["wrap_body_2.attn_output"]
    (gm,) = capture.graphs
    assert count_calls(gm, OP) == 2
    # No mask enters any body any more.
    for k in range(3):
        body = getattr(gm, f"wrap_body_{k}")
        assert not any(n.name.startswith("attention_mask") for n in body.graph.find_nodes(op="placeholder"))


def test_context_manager_on_and_off(caplog):
    # On inside the block, off after it, for one small function compiled by inductor each
    # time (whole models under enable() are the Trainer's test, tests/integrations/test_integrations.py).
    def banded(q, k, v):
        positions = torch.arange(q.shape[2])
        distance = positions[None, :] - positions[:, None]
        mask = (distance <= 0) & (distance > -4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    # A cache hit reuses the rewritten artifact without running (or logging) the pass again.
    no_caches = (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    with no_caches[0], no_caches[1], caplog.at_level(logging.INFO, logger="compile_pass"):
        torch._dynamo.reset()
        with compile_pass.enable():
            torch.testing.assert_close(torch.compile(banded, fullgraph=True)(q, k, v), banded(q, k, v))
        assert "rewritten: window (3, 0)" in caplog.text
        caplog.clear()
        torch._dynamo.reset()
        # Off after the block: the same banded SDPA is neither rewritten nor reported.
        torch.testing.assert_close(torch.compile(banded, fullgraph=True)(q, k, v), banded(q, k, v))
    assert not caplog.records
    from torch._inductor import config

    assert config.pre_grad_custom_pass is None


def test_rule_set_changes_the_cache_key():
    assert RewritePass().uuid() != RewritePass(sliding_window=False).uuid()
    assert RewritePass().uuid() == RewritePass().uuid()


def test_kill_switch(monkeypatch):
    monkeypatch.setenv("COMPILE_PASS_DISABLE", "1")
    capture = Capture()
    torch.compile(tiny_gemma4(), backend=capture, fullgraph=True)(input_ids=token_batch(16), use_cache=False)
    assert len(capture.report) == 0
    assert count_calls(capture.graphs[0], SDPA) == 3


def test_padded_batch_inside_activation_checkpointing():
    model = checkpointed(tiny_gemma4())
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids, padding = token_batch(16), left_and_right_padding(16)
    labels = ids.masked_fill(padding == 0, -100)
    with side_effects_once():
        assert_training_matches(model, compiled, input_ids=ids, attention_mask=padding, labels=labels, use_cache=False)
    assert [d.verdict for d in capture.report.rewritten()] == [
        "rewritten: window (7, 0), key padding from attention_mask"
    ] * 2 + ["rewritten: window (-1, 0), key padding from attention_mask"]


def packed_positions(*lengths):
    """position_ids of sequences packed into one row, restarting at 0 for each."""
    row = torch.cat([torch.arange(n) for n in lengths])
    return row[None].expand(2, -1).contiguous()


def test_packed_sequences_from_input_positions_are_rewritten_and_match_eager():
    """transformers bounds the window on the packed positions themselves (P[kv] > P[q] - w).
    For positions in the range the op checks at run time that is the band over indices inside
    each sequence (tests/integrations/test_packed.py has the rest); a new packing pattern is data and
    reuses the compiled graph."""
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(24)
    for lengths in ((10, 14), (5, 3, 16)):
        assert_training_matches(
            model, compiled, input_ids=ids, position_ids=packed_positions(*lengths), labels=ids, use_cache=False
        )
    assert len(capture.graphs) == 1
    verdicts = [d.verdict for d in capture.report][:3]
    assert verdicts == [
        f"rewritten: window ({window}, 0), packed sequences from position_ids (positions checked at run time)"
        for window in (7, 7, -1)
    ]


def test_an_upgrade_of_compile_pass_misses_the_compile_caches(tmp_path, monkeypatch):
    """Through the backend way in too: inductor's FX-graph and AOTAutograd caches key on the
    rewritten graph, not on what the package's ops do (an op's fake may change its sizes), so
    a changed source must change the key, or a warm cache serves the old compile."""
    import importlib

    from torch._dynamo.utils import counters

    backend = importlib.import_module("compile_pass.backend")  # the module, not the function

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    def banded(q, k, v):
        positions = torch.arange(q.shape[2])
        distance = positions[None, :] - positions[:, None]
        mask = (distance <= 0) & (distance > -4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def cache_hits() -> int:
        torch._dynamo.reset()
        counters.clear()
        q, k, v = torch.randn(3, 1, 2, 16, 8, requires_grad=True).unbind(0)
        torch.compile(banded, backend="compile_pass", fullgraph=True)(q, k, v).sum().backward()
        return counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]

    caches = (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    )
    with caches[0], caches[1]:
        assert cache_hits() == 0
        assert cache_hits() > 0  # the same package: the cache serves it
        upgrade = tmp_path / "upgrade.py"
        upgrade.write_text("# a later release\n")
        sources = backend._package_sources()
        monkeypatch.setattr(backend, "_package_sources", lambda: [*sources, str(upgrade)])
        assert cache_hits() == 0
