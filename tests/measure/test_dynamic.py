"""Dynamic lengths in measure mode, the default: ``mark_dynamic`` on the sequence, at a
bucket's edge and off it, with a short and with the default budget, ``dynamic=True`` and
automatic dynamic shapes compile, and run exactly at every length. The measurement never
guards a length the user marked dynamic: such calls get one answer for the marked range."""

import pytest
import torch
import torch.nn.functional as F

from compile_pass import measure
from compile_pass.measure.table import TABLE, Measured
from tests.helpers.models import Capture, assert_training_matches, tiny_gemma4, token_batch
from tests.helpers.small_graphs import qkv

EDGE = 256  # a bucket's edge


def banded_attention_with_a_branch(q, k, v):
    """A sliding window of 16, and a branch of the model's own on the length: a guard
    ``length <= 256`` that, beside a measurement's ``length >= 256``, pins the length."""
    n = q.shape[2]
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 16)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out * 2 if n <= EDGE else out


def test_a_marked_length_at_a_bucket_edge_with_a_cached_win_and_the_models_own_guard_compiles():
    """With a fresh inductor cache, then a warm one (the same graph compiled again)."""
    from torch._inductor.utils import fresh_inductor_cache

    q, k, v = (t.detach().float() for t in qkv(EDGE))
    capture = Capture()
    torch.compile(banded_attention_with_a_branch, backend=capture)(q, k, v)  # measures the key
    (key, measured), *_ = TABLE.entries()
    TABLE.add(key, Measured(measured.kernel, EDGE, 1, 5, 100.0, 1.0), None)  # as if it had won there
    with fresh_inductor_cache():
        for _ in ("fresh", "warm"):
            torch._dynamo.reset()
            compiled = torch.compile(banded_attention_with_a_branch, backend="compile_pass")
            for length in (EDGE, EDGE - 56, EDGE + 72):
                q, k, v = (t.detach().float() for t in qkv(length))
                for tensor in (q, k, v):
                    torch._dynamo.mark_dynamic(tensor, 2)
                out = compiled(q, k, v)
                expected = banded_attention_with_a_branch(*(t.detach().double() for t in (q, k, v)))
                torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def _model():
    return tiny_gemma4(max_position_embeddings=1024)


def _train_at(model, compiled, length):
    ids = token_batch(length)
    assert_training_matches(model, compiled, input_ids=ids, labels=ids)


@pytest.mark.parametrize(
    ("traced", "budget"),
    [pytest.param(traced, budget, marks=pytest.mark.slow) for traced in (256, 200) for budget in ("0.05,0.2", None)],
)
def test_a_gemma4_length_marked_dynamic_compiles_and_trains_exactly_at_every_length(monkeypatch, traced, budget):
    if budget is None:
        monkeypatch.delenv(measure.SECONDS_VARIABLE)
    else:
        monkeypatch.setenv(measure.SECONDS_VARIABLE, budget)
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="compile_pass")
    ids = token_batch(traced)
    torch._dynamo.mark_dynamic(ids, 1)
    assert_training_matches(model, compiled, input_ids=ids, labels=ids)
    _train_at(model, compiled, traced + 70)  # past the traced length: the same graph, or a guarded other


def test_a_marked_range_gets_one_answer_its_shortest_lengths_and_the_report_says_so(monkeypatch):
    capture = Capture()
    torch._dynamo.reset()
    model = _model()
    ids = token_batch(256)
    torch._dynamo.mark_dynamic(ids, 1, min=128, max=512)
    torch.compile(model, backend=capture)(input_ids=ids)
    (sliding, *_), *_ = [[d for d in report if "sliding" in d.layer_type] for report in capture.reports]
    assert "one answer for every length its marked dynamic range takes, from 128" in sliding.reason + sliding.kernel
    assert {m.keys for _, m in TABLE.entries()} == {128}  # measured at the range's shortest only


def test_a_marked_range_from_short_lengths_keeps_sdpa_and_says_how_to_measure_it():
    capture = Capture()
    torch._dynamo.reset()
    ids = token_batch(256)
    torch._dynamo.mark_dynamic(ids, 1)  # from 2 tokens up
    torch.compile(_model(), backend=capture)(input_ids=ids)
    sliding = [d for report in capture.reports for d in report if "sliding" in d.layer_type]
    assert sliding and all(not d.rewritten for d in sliding)
    # from 2 tokens, or from past the window where a rule guarded the length to that side
    assert "its length is marked dynamic from " in sliding[0].reason
    assert "mark_dynamic(..., min=64)" in sliding[0].reason
    assert TABLE.measured == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dynamic=True", "automatic"])
def test_unmarked_dynamic_lengths_compile_and_run_exactly(how):
    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend="compile_pass", dynamic=True if how == "dynamic=True" else None)
    for length in (192, 256, 320):  # automatic: the second length compiles a dynamic graph
        _train_at(model, compiled, length)


def banded_attention(q, k, v):
    """The same window with no branch on the length (a min/max mark forbids any guard inside
    its range: a branch of the model's would fail the compile whatever the pass does)."""
    n = q.shape[2]
    i = torch.arange(n)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 16)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("budget", ["1,4", "0,0"])
def test_a_length_marked_from_128_gets_its_shortest_lengths_answer_measured_or_not(monkeypatch, budget):
    monkeypatch.setenv(measure.SECONDS_VARIABLE, budget)
    q, k, v = (t.detach().float() for t in qkv(EDGE))
    for tensor in (q, k, v):
        torch._dynamo.mark_dynamic(tensor, 2, min=128, max=512)
    capture = Capture()
    torch._dynamo.reset()
    out = torch.compile(banded_attention, backend=capture)(q, k, v)
    torch.testing.assert_close(out, banded_attention(q, k, v), atol=1e-5, rtol=1e-5)
    (decision,) = [d for report in capture.reports for d in report if d.rule == "sliding_window"]
    said = decision.reason + decision.kernel
    if budget == "0,0":  # the static tables would guard the length: SDPA stays
        assert not decision.rewritten and "SDPA stays for a length marked dynamic (no guard may decide it)" in said
        assert TABLE.measured == 0
    else:
        assert "one answer for every length its marked dynamic range takes, from 128" in said
        assert {m.keys for _, m in TABLE.entries()} == {128}
