"""The report in the model's terms: module paths, layer types and source lines from Dynamo's
node metadata, identical decisions grouped by layer, one summary line, and messages that say
what happened when nothing was rewritten."""

import functools
import inspect
import logging
import unittest.mock

import expecttest
import pytest
import torch
import torch.nn.functional as F

import compile_pass
from benchmarks import families, packed_training
from compile_pass.kernels import contract as kernel
from compile_pass.report import ATTENTION, TOPK, Decision, Report
from tests.helpers.models import Capture, at_sdpa_call, checkpointed, side_effects_once, tiny_gemma4, token_batch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _decision(layer, verdict="window (7, 0)", rewritten=True, rule="sliding_window", **fields):
    return Decision(
        rule, "", f"attn_output_{layer}", rewritten, verdict, module=f"model.layers.{layer}.self_attn", **fields
    )


class TestTable(expecttest.TestCase):
    def test_identical_decisions_group_into_layer_ranges(self):
        sliding = dict(layer_type="sliding_attention", source="modeling.py:10")
        full = dict(layer_type="full_attention", source="modeling.py:10")
        report = Report(
            [_decision(k, **sliding) for k in (0, 1, 2, 4, 5, 7)]
            + [_decision(k, "dropout_p=0.1 (the op has no dropout)", False, **full) for k in (3, 6)],
            graphs=1,
        )
        self.assertExpectedInline(
            report.table(),
            """\
layers       module                    layer type         rule            decision
0-2, 4-5, 7  model.layers.*.self_attn  sliding_attention  sliding_window  rewritten: window (7, 0)
3, 6         model.layers.*.self_attn  full_attention     sliding_window  kept: dropout_p=0.1 (the op has no dropout)
called at modeling.py:10
6 of 8 attention calls rewritten, 2 kept""",
        )

    def test_different_sources_get_a_column_and_top_k_masks_their_own_count(self):
        report = Report(
            [
                _decision(0, source="a.py:1"),
                Decision(
                    "topk_mask",
                    "",
                    "topk",
                    True,
                    "top-k of the detached input",
                    module="model.layers.0.mlp",
                    source="b.py:2",
                    kind=TOPK,
                ),
                Decision(
                    "topk_mask",
                    "",
                    "topk_1",
                    False,
                    "largest=False",
                    module="model.layers.1.mlp",
                    source="b.py:2",
                    kind=TOPK,
                ),
            ],
            graphs=2,
        )
        self.assertExpectedInline(
            report.table(),
            """\
layers  module                    rule            decision                                source
0       model.layers.0.self_attn  sliding_window  rewritten: window (7, 0)                a.py:1
0       model.layers.0.mlp        topk_mask       rewritten: top-k of the detached input  b.py:2
1       model.layers.1.mlp        topk_mask       kept: largest=False                     b.py:2
1 of 1 attention call rewritten; 1 of 2 top-k masks rewritten, 1 kept (in 2 graphs)""",
        )

    def test_a_call_no_rule_rewrites_gives_every_rule_s_reason(self):
        decision = _decision(
            5,
            "dropout_p=0.1 (the op has no dropout)",
            False,
            other_reasons=(
                ("causal_mask", "mask is window (-1, 0), key padding from attention_mask, not plain causal"),
            ),
        )
        assert decision.verdict == "kept: dropout_p=0.1 (the op has no dropout)"  # the first rule's, as before
        assert decision.rules == "sliding_window, causal_mask"
        assert decision.full_verdict == (
            "kept: dropout_p=0.1 (the op has no dropout); "
            "mask is window (-1, 0), key padding from attention_mask, not plain causal"
        )
        # A second reason that opens like the first is shown from where they part.
        shared = _decision(
            5,
            "mask is window (-1, 0): no sliding window",
            False,
            other_reasons=(("causal_mask", "mask is window (-1, 0), not plain causal"),),
        )
        assert shared.full_verdict == "kept: mask is window (-1, 0): no sliding window; not plain causal"
        same = _decision(
            5, "mask op mod not understood", False, other_reasons=(("causal_mask", "mask op mod not understood"),)
        )
        assert same.full_verdict == "kept: mask op mod not understood"

    def test_by_node_lists_graph_nodes(self):
        report = Report(
            [_decision(0), Decision("sliding_window", "wrap_body_1", "attn_output", True, "window (7, 0)")], graphs=1
        )
        self.assertExpectedInline(
            report.table(by_node=True),
            """\
node                     module                    rule            decision
attn_output_0            model.layers.0.self_attn  sliding_window  rewritten: window (7, 0)
wrap_body_1.attn_output                            sliding_window  rewritten: window (7, 0)
2 of 2 attention calls rewritten""",
        )


@pytest.mark.parametrize(
    ("report", "message"),
    [
        (
            Report(graphs=2, disabled=True),
            "compile_pass is off (COMPILE_PASS_DISABLE=1): no rule ran, 2 graphs compiled unchanged",
        ),
        (
            Report(),
            "no graph was compiled here, so nothing was rewritten (a graph compiled before, or taken from "
            "inductor's caches under enable(), is not rewritten again)",
        ),
        (Report(graphs=1), "every rule is switched off: 1 graph compiled unchanged"),
        (
            Report(graphs=1, rules=["sliding_window"]),
            "no attention call or top-k mask found in 1 graph: a model that "
            "attends without torch.nn.functional.scaled_dot_product_attention has "
            'nothing to rewrite; load it with attn_implementation="sdpa"',
        ),
    ],
    ids=["kill-switch", "nothing-compiled", "rules-off", "nothing-found"],
)
def test_an_empty_report_says_why(report, message):
    assert report.table() == report.summary() == message


def test_layer_numbers_and_ranges():
    assert _decision(12).layer == 12
    assert Decision("r", "", "n", True, "x", module="model.attn").layer is None
    assert Decision("r", "", "n", True, "x").name == "n"
    from compile_pass.report import _ranges

    assert _ranges([7, 0, 1, 2, 4, 5, 5]) == "0-2, 4-5, 7"


class TestOnModels(expecttest.TestCase):
    def test_moe_routers_are_not_decisions(self):
        # Every MoE layer's router takes a top-k of expert scores; it builds no attention mask.
        model = tiny_gemma4(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
        capture = Capture()
        with self.assertLogs("compile_pass", level=logging.DEBUG) as logged:
            torch.compile(model, backend=capture, fullgraph=True)(input_ids=token_batch(16), use_cache=False)
        assert torch.topk in {node.target for node in capture.graphs[0].graph.nodes}
        self.assertExpectedInline(
            at_sdpa_call(capture.report.table()),
            """\
layers  module                    layer type         rule            decision                                        kernel
0-1     model.layers.*.self_attn  sliding_attention  sliding_window  rewritten: window (7, 0)                        chunked, aten's fused CPU flash kernel per chunk; one call where the band skips few keys
2       model.layers.2.self_attn  full_attention     causal_mask     rewritten: plain causal mask -> is_causal=True
called at transformers/integrations/sdpa_attention.py:<SDPA call>
3 of 3 attention calls rewritten""",  # noqa: E501 (a snapshot: printed lines as they are)
        )
        routers = [
            r.getMessage() for r in logged.records if r.levelno == logging.DEBUG and "builds no mask" in r.getMessage()
        ]
        assert len(routers) == 3
        assert routers[0] == "topk model.layers.0.router (topk) builds no mask"

    def test_a_padded_global_layer_is_kept_by_both_rules(self):
        # 16 tokens, below every measured crossover (the suite's setting of none put aside): the
        # sliding rule keeps the padded global layer for its length, the causal rule for its mask.
        model = tiny_gemma4(global_head_dim=512)
        capture = Capture()
        padding = torch.ones(2, 16, dtype=torch.long)
        padding[0, :3] = 0
        with unittest.mock.patch.object(kernel, "SHORT_KEYS_SETTING", None):
            torch.compile(model, backend=capture, fullgraph=True)(
                input_ids=token_batch(16), attention_mask=padding, use_cache=False
            )
        kept = capture.report.kept()[-1]
        assert (kept.module, kept.layer_type) == ("model.layers.2.self_attn", "full_attention")
        assert kept.rules == "sliding_window, causal_mask"
        why = kept.full_verdict
        assert why.startswith(
            "kept: mask is window (-1, 0), key padding from attention_mask: no sliding window, and no kernel is "
            "faster than SDPA for it here: "
        ) and why.endswith("; not plain causal"), why
        assert "documents: its 16 keys are at most" in why, why

    def test_checkpointed_layers_are_named_as_without_checkpointing(self):
        model = checkpointed(tiny_gemma4())
        capture = Capture()
        ids = token_batch(16)
        with side_effects_once():
            torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, labels=ids, use_cache=False)
        assert [d.where for d in capture.report] == [f"wrap_body_{k}.attn_output" for k in range(3)]
        assert [d.module for d in capture.report] == [f"model.layers.{k}.self_attn" for k in range(3)]
        assert [d.layer_type for d in capture.report] == ["sliding_attention"] * 2 + ["full_attention"]


class BandAttention(torch.nn.Module):
    """Not a transformers module: says its layer type through a plain attribute."""

    layer_type = "local"

    def forward(self, q, k, v):
        positions = torch.arange(q.shape[2])
        mask = (positions[None, :] > positions[:, None] - 4) & (positions[None, :] <= positions[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


SDPA_LINE = inspect.getsourcelines(BandAttention.forward)[1] + 3


def test_module_layer_type_and_source_line_of_a_user_module():
    blocks = torch.nn.ModuleList([BandAttention(), BandAttention()])

    def attend_twice(q, k, v):
        return blocks[1](blocks[0](q, k, v), k, v)

    capture = Capture()
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    torch.compile(attend_twice, backend=capture, fullgraph=True)(q, k, v)
    # A closure's module is named from its root variable, here "blocks".
    assert [(d.module, d.layer_type, d.source) for d in capture.report] == [
        (f"blocks.{k}", "local", f"tests/backend/test_report.py:{SDPA_LINE}") for k in (0, 1)
    ]


def _passes_through(forward):
    """A decorator as transformers puts on its models' forwards: a wrapper taking ``*args``,
    whose frame Dynamo compiles first, so that the module is ``args[0]`` there."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class DecoratedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([BandAttention(), BandAttention()])

    @_passes_through
    def forward(self, q, k, v):
        return self.layers[1](self.layers[0](q, k, v), k, v)


def test_a_decorated_forward_names_its_modules_as_the_model_does():
    """The wrapper's ``args[0]`` is the model, as ``self`` is: the module column and the layer
    type read through it (they said ``args[0].layers.0``, and no layer type)."""
    capture = Capture()
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    torch.compile(DecoratedModel(), backend=capture, fullgraph=True)(q, k, v)
    assert [(d.module, d.layer_type) for d in capture.report] == [(f"layers.{k}", "local") for k in (0, 1)]


def test_a_transformers_causal_lm_compiled_whole_names_its_layers_and_their_types():
    config, model = families.family_model("Qwen3")  # sliding and full layers
    capture = Capture()
    with torch.no_grad():
        torch.compile(model, backend=capture)(input_ids=token_batch(32))
    assert [(d.module, d.layer_type) for d in capture.report] == [
        (f"model.layers.{index}.self_attn", layer_type) for index, layer_type in enumerate(config.layer_types)
    ]


def test_a_function_without_modules_is_reported_by_node():
    def attend(q, k, v):
        positions = torch.arange(q.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])

    capture = Capture()
    torch.compile(attend, backend=capture, fullgraph=True)(*torch.randn(3, 1, 2, 16, 8).unbind(0))
    (decision,) = capture.report
    assert (decision.module, decision.layer_type, decision.name) == ("", "", "scaled_dot_product_attention")
    assert capture.report.table().splitlines()[0].split() == ["node", "rule", "decision"]


def test_kill_switch_and_nothing_compiled_say_so(monkeypatch):
    model = tiny_gemma4()
    ids = token_batch(16)
    monkeypatch.setenv("COMPILE_PASS_DISABLE", "1")
    with compile_pass.decisions() as report:
        torch.compile(model, backend=Capture(), fullgraph=True)(input_ids=ids, use_cache=False)
    assert report.table() == "compile_pass is off (COMPILE_PASS_DISABLE=1): no rule ran, 1 graph compiled unchanged"
    monkeypatch.delenv("COMPILE_PASS_DISABLE")
    compiled = torch.compile(model, backend=Capture(), fullgraph=True)
    compiled(input_ids=ids, use_cache=False)
    with compile_pass.decisions() as report:
        compiled(input_ids=ids, use_cache=False)  # compiled before the block: nothing new
    assert report.table().startswith("no graph was compiled here")


def test_attention_calls_are_counted_apart_from_top_k_masks():
    report = Report(
        [_decision(0), _decision(1, "x", False), Decision("topk_mask", "", "topk", True, "t", kind=TOPK)], graphs=1
    )
    assert report.summary() == "1 of 2 attention calls rewritten, 1 kept; 1 of 1 top-k mask rewritten"
    assert {d.kind for d in report} == {ATTENTION, TOPK}


class _ModuleFloats(torch.nn.Module):
    """Dropout and scale from float attributes, as transformers' attention layers read them."""

    def __init__(self):
        super().__init__()
        self.dropout, self.scaling = 0.0, 0.5

    def forward(self, q, k, v):
        positions = torch.arange(q.shape[2])
        mask = (positions[None, :] > positions[:, None] - 4) & (positions[None, :] <= positions[:, None])
        dropout = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scaling)


@pytest.mark.parametrize("way_in", ["backend", "enable"])
def test_dynamic_true_reports_the_graph_that_runs(way_in):
    """With dynamic=True Dynamo first traces float attributes as run-time values (the call is
    kept: its dropout is unknown), then throws that graph away and traces again with them
    constant: the report holds the second attempt's decision only."""
    torch._dynamo.reset()
    q, k, v = torch.randn(3, 1, 2, 16, 8).unbind(0)
    module = _ModuleFloats().eval()
    with compile_pass.decisions() as report:
        if way_in == "backend":
            out = torch.compile(module, backend="compile_pass", dynamic=True)(q, k, v)
        else:
            with compile_pass.enable(), torch._inductor.config.patch(fx_graph_cache=False):
                out = torch.compile(module, dynamic=True)(q, k, v)
    torch.testing.assert_close(out, module(q, k, v))
    assert (report.graphs, [d.verdict for d in report]) == (1, ["rewritten: window (3, 0)"])


def _break_before_first_layer(model):
    """A graph break between the embeddings (and the masks) and the decoder layers, as a hook
    Dynamo cannot trace leaves one: the first graph holds no attention call."""
    model.model.layers[0].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    return model


def test_a_graph_without_attention_next_to_graphs_with_it_gives_no_advice():
    """Graph breaks leave graphs without attention (the embeddings, the masks, per-layer
    inputs): their own reports say only that, and the compile's report counts the calls of
    the graphs that have them. Loading with attn_implementation="sdpa" is no advice here."""
    capture = Capture()
    ids = token_batch(16)
    with compile_pass.decisions() as report:
        torch.compile(_break_before_first_layer(tiny_gemma4()), backend=capture)(input_ids=ids, use_cache=False)
    without = [graph_report for graph_report in capture.reports if not graph_report]
    assert without and len(without) < len(capture.reports), [r.summary() for r in capture.reports]
    assert {graph_report.summary() for graph_report in without} == {"no attention call or top-k mask in this graph"}
    assert "attn_implementation" not in report.table()
    # The calls of the graphs that have them (as many as Dynamo compiled: transformers 5.23's
    # identical layers share one graph, 5.24's do not).
    calls = sum(len(graph_report) for graph_report in capture.reports)
    assert calls >= 2 and report.summary().startswith(f"{calls} of {calls} attention calls rewritten"), report.summary()


def test_a_compile_with_no_attention_at_all_says_so_once():
    """Where no graph of the compile attends through SDPA, its report says so once, with what
    to do, however many graphs the compile made."""

    def no_attention(x):
        x = torch.relu(x @ x.T)
        torch._dynamo.graph_break()
        return x.sum()

    capture = Capture()
    with compile_pass.decisions() as report:
        torch.compile(no_attention, backend=capture)(torch.randn(4, 4))
    assert report.graphs == len(capture.reports) == 2
    assert report.table().count('attn_implementation="sdpa"') == 1, report.table()
    assert report.summary().startswith("no attention call or top-k mask found in 2 graphs")
    assert all("attn_implementation" not in graph_report.table() for graph_report in capture.reports)


def test_packed_positions_with_the_default_cache_get_a_hint_not_a_miss():
    """A training forward with packed position_ids and transformers' default use_cache=True:
    transformers passes a cache, skips the packed-documents mask and runs SDPA causal over the
    whole row. The report says that no mask was built from the positions and what to pass, as a
    hint (the graph cannot show whether the rows pack documents); with use_cache=False the mask
    is built from them and the hint is gone."""
    model = packed_training.model("Llama").train()
    ids = token_batch(16)
    positions = torch.arange(8).repeat(2, 2)  # two documents of 8 tokens a row
    capture = Capture()
    torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, labels=ids, position_ids=positions)
    hint = (
        "kept: no mask: SDPA runs its causal kernel (is_causal=True), no band to skip; input position_ids builds no "
        "mask here: if its rows pack several documents, pass use_cache=False (transformers masks packed documents "
        "only without a cache; with one, each row attends across its documents)"
    )
    verdicts = {d.full_verdict for d in capture.report}
    assert verdicts == {hint}, verdicts
    torch._dynamo.reset()
    capture = Capture()
    torch.compile(model, backend=capture, fullgraph=True)(
        input_ids=ids, labels=ids, position_ids=positions, use_cache=False
    )
    assert all("use_cache" not in d.full_verdict and "packed sequences" in d.reason for d in capture.report)
    # Without position_ids the graph shows nothing about documents: no hint, and still no miss.
    torch._dynamo.reset()
    capture = Capture()
    torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, labels=ids)
    assert {d.full_verdict for d in capture.report} <= {
        "kept: no mask: SDPA runs its causal kernel (is_causal=True), no band to skip",
        "rewritten: plain causal mask -> is_causal=True",
    }
