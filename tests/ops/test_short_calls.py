"""Short calls keep SDPA on the CPU: up to the measured crossover (``chunked.SHORT_KEYS``) the
op's fixed cost per call outweighs the band, so the sliding rule keeps SDPA there. A graph
compiled for a symbolic length answers for its traced length with a guard: a length on the
other side compiles a second graph with the other answer, and each graph then serves its side
with no further compilation."""

import re

import pytest
import torch
import torch.nn.functional as F

from compile_pass.kernels import contract as kernel
from compile_pass.ops.window_attention import sliding_window_attention_forward
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv, tune_chunks

WINDOW = 8
SHORT = 32  # the crossover these tests set: short graphs at 24 or fewer keys, long ones at 40 or more


def attention(q, k, v, padding=None):
    """A sliding layer as transformers writes it: the band (and padding) as a boolean mask."""
    positions = torch.arange(q.shape[2])
    distance = positions[None, :] - positions[:, None]
    mask = ((distance <= 0) & (distance > -WINDOW))[None, None]
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_calls(graph):
    return [node for node in graph.graph.nodes if node.target is F.scaled_dot_product_attention]


def op_calls(graph):
    return [node for node in graph.graph.nodes if node.target is sliding_window_attention_forward]


def sliding_verdicts(capture):
    return [d.verdict for report in capture.reports for d in report if d.rule == "sliding_window"]


def test_the_crossover_by_dtype_and_the_suites_setting(monkeypatch):
    """Without COMPILE_PASS_SHORT_KEYS the measured crossover of the call's dtype holds (fp32
    512 keys, bf16 and fp16 1024); the suite sets 0, every length rewritten."""
    from compile_pass.kernels.policy import POLICY, facts_of

    def fast(dtype, keys):
        return POLICY.choose(facts_of("cpu", dtype, 64, keys=keys, left=511)).fast

    assert kernel.SHORT_KEYS_SETTING == "0" and fast(torch.float32, 16) and fast(torch.bfloat16, 16)
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    assert not fast(torch.float32, 512) and fast(torch.float32, 513)
    assert not fast(torch.bfloat16, 1024) and fast(torch.bfloat16, 1025)
    assert not fast(torch.float16, 1024) and fast(torch.float16, 1025)
    assert not fast(torch.float64, 512) and fast(torch.float64, 513)
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", "100")
    assert not fast(torch.bfloat16, 100) and fast(torch.bfloat16, 101)


@pytest.mark.parametrize(
    "seq, verdict", [(24, "kept: .*its 24 keys are at most 32"), (32, "kept: .*its 32 keys"), (40, "rewritten")]
)
def test_static_length_keeps_sdpa_up_to_the_crossover_and_says_why(monkeypatch, seq, verdict):
    tune_chunks(monkeypatch, short_keys=SHORT)
    compiled, capture = compiled_with_capture(attention)
    assert_same_as_eager(attention, compiled, qkv(seq=seq))
    (graph,) = capture.graphs
    rewritten = seq > SHORT
    assert len(op_calls(graph)) == rewritten and len(sdpa_calls(graph)) == (not rewritten)
    (said,) = sliding_verdicts(capture)
    assert re.match(verdict, said), said


def test_dynamic_length_compiles_one_graph_per_side_of_the_crossover(monkeypatch):
    """Padded calls, the length dynamic: a short graph (SDPA with the mask, unchanged), then a
    long one (the op); each later length runs the graph of its side, exactly, with no third
    compilation."""
    tune_chunks(monkeypatch, short_keys=SHORT)
    compiled, capture = compiled_with_capture(attention)

    def run(seq):
        q, k, v = qkv(seq=seq, seed=seq, batch=2)
        padding = torch.ones(2, seq, dtype=torch.bool)
        padding[1, : seq // 3] = False  # left padding in row 1
        for tensor in (q, k, v):
            torch._dynamo.mark_dynamic(tensor, 2)
        torch._dynamo.mark_dynamic(padding, 1)
        assert_same_as_eager(attention, compiled, (q, k, v), padding)

    run(24)
    run(48)
    assert len(capture.graphs) == 2
    short, long = capture.graphs
    assert len(sdpa_calls(short)) == 1 and not op_calls(short)
    assert len(op_calls(long)) == 1 and not sdpa_calls(long)
    kept, rewritten = sliding_verdicts(capture)
    assert "its 24 keys at tracing are at most 32" in kept and "a longer one compiles another" in kept, kept
    assert rewritten.startswith("rewritten"), rewritten
    for seq in (16, 32, 33, 40):  # both sides of the crossover, its edge included
        run(seq)
    assert len(capture.graphs) == 2


def test_short_plain_calls_run_sdpa_causal_kernel(monkeypatch):
    """Where the crossover is within the window, the short graph's guard tells the causal rule
    that every key lies inside the window: SDPA runs with is_causal and no mask at all."""
    tune_chunks(monkeypatch, short_keys=WINDOW)
    compiled, capture = compiled_with_capture(attention)
    q, k, v = qkv(seq=6)
    for tensor in (q, k, v):
        torch._dynamo.mark_dynamic(tensor, 2)
    assert_same_as_eager(attention, compiled, (q, k, v))
    (graph,) = capture.graphs
    (call,) = sdpa_calls(graph)
    assert call.kwargs.get("is_causal") is True and call.kwargs.get("attn_mask") is None, call.kwargs


CACHED_RUN = """
import torch
import compile_pass
from compile_pass.ops.window_attention import sliding_window_attention_forward as op
from torch._dynamo.utils import counters
from tests.ops.test_short_calls import attention

with compile_pass.enable():
    compiled = torch.compile(attention)
    for seq in (24, 48, 16, 40):
        q, k, v = (torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 2)
        compiled(q, k, v).sum().backward()  # compiles where no graph takes the length
        with torch.profiler.profile() as profile:
            out = compiled(q, k, v)
        calls = sum(event.name == op.name() for event in profile.events())
        torch.testing.assert_close(out, attention(q, k, v), atol=1e-12, rtol=0)
        print(seq, calls)
print("graphs", counters["stats"]["unique_graphs"])
"""


def test_a_warm_inductor_cache_keeps_the_guard(tmp_path):
    """Under ``enable()`` the rewrite is a pre-grad pass, which a hit in inductor's caches
    skips: the guard must come back with the cached graph, or a short graph would serve long
    lengths. Two processes, the second on the first's cache: each compiles one graph a side."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, COMPILE_PASS_SHORT_KEYS=str(SHORT), TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    root = Path(__file__).resolve().parent.parent.parent
    expected = "24 0\n48 1\n16 0\n40 1\ngraphs 2\n"  # the op's forward runs past the crossover
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CACHED_RUN], cwd=root, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout == expected, done.stdout


def test_the_gpu_crossover_by_call_form(monkeypatch):
    """On a GPU, torch's FA2 is taken past the crossovers measured on an H200: 512 keys for a
    plain call, 1024 for the varlen calls of padding, segment ids or image blocks."""
    from compile_pass.kernels.policy import POLICY, facts_of
    from tests.helpers.small_graphs import pretend_gpu

    pretend_gpu(monkeypatch)
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)

    def fast(keys, dtype=torch.bfloat16, **masks):
        choice = POLICY.choose(facts_of("cuda", dtype, 256, keys=keys, left=1023, **masks))
        assert choice.name.startswith("torch's FA2" if choice.fast else "SDPA with the mask"), choice
        return choice.fast

    assert not fast(512) and fast(513) and not fast(512, torch.float16) and fast(513, torch.float16)
    for mask in ("key_padding", "segment_ids", "blocks"):
        assert not fast(1024, **{mask: True}) and fast(1025, **{mask: True}), mask
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", "0")
    assert fast(16) and fast(16, key_padding=True)


def _attend_with_mask_input(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(("seq", "rewritten"), [(24, False), (40, True)])
def test_a_mask_input_keeps_sdpa_up_to_the_crossover(monkeypatch, seq, rewritten):
    """A block compiled on its own gets its mask as an input (the mask_input rule, checked at
    run time): a short call keeps SDPA there as well, with the crossover in its reason."""
    tune_chunks(monkeypatch, short_keys=SHORT)
    compiled, capture = compiled_with_capture(_attend_with_mask_input)
    i = torch.arange(seq)
    mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)).expand(2, 1, seq, seq).clone()
    assert_same_as_eager(_attend_with_mask_input, compiled, qkv(seq=seq, batch=2), mask)
    (graph,) = capture.graphs
    assert len(sdpa_calls(graph)) == (not rewritten)
    (decision,) = capture.report
    said = dict([(decision.rule, decision.reason), *decision.other_reasons])["mask_input"]
    assert decision.rewritten is rewritten and (rewritten or f"its {seq} keys are at most {SHORT}" in said), said
