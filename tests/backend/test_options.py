"""One check of rule switches and options for every way in: the same mistake gets the same
answer, a ValueError naming the rule switches, before anything is rewritten or compiled."""

import importlib
import re

import pytest
import torch
import torch.nn.functional as F

import compile_pass
from compile_pass.backend import validate_options

SWITCHES = (
    "Rule switches are causal_mask, mask_certificate, mask_input, sharded_attention, sliding_window, "
    "spelled_attention, topk_mask (True or False); "
    "settings are context_parallel, context_parallel_layout, measure, slow_kernels (True or False; context_parallel "
    "also a ProcessGroup or a DeviceMesh dimension, context_parallel_layout 'contiguous' or 'head-tail', measure "
    "'measure' or 'static' or 'remeasure')"
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def attend(q, k, v):
    positions = torch.arange(q.shape[2])
    mask = (positions[None, :] > positions[:, None] - 4) & (positions[None, :] <= positions[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def qkv():
    return torch.randn(3, 1, 2, 16, 8).unbind(0)


def test_a_misspelled_switch_gets_one_answer_by_every_way_in(monkeypatch):
    expected = "got unknown option 'sliding_windw' (did you mean 'sliding_window'?). " + SWITCHES
    with pytest.raises(ValueError, match=f"^{re.escape('compile_pass.rewrite() ' + expected)}$"):
        compile_pass.rewrite(torch.fx.symbolic_trace(torch.nn.Identity()), sliding_windw=False)
    with pytest.raises(ValueError, match=f"^{re.escape('compile_pass.enable() ' + expected)}$"):
        with compile_pass.enable(sliding_windw=False):
            pass

    # Through the backend the check runs when Dynamo hands over the graph, before the rules
    # and inductor; Dynamo wraps what a backend raises in BackendCompilerFailed.
    compiled_by_inductor = []
    monkeypatch.setattr(
        importlib.import_module("torch._inductor.compile_fx"),
        "compile_fx",
        lambda *a, **k: compiled_by_inductor.append(a),
    )
    with compile_pass.decisions() as report:
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as failure:
            torch.compile(attend, backend="compile_pass", options={"sliding_windw": False})(*qkv())
    error = failure.value.inner_exception
    assert isinstance(error, ValueError)
    assert str(error) == (
        'torch.compile(backend="compile_pass", options=...) '
        + expected
        + "; every other key must be an inductor config option (torch._inductor.list_options())"
    )
    assert not compiled_by_inductor and not report and report.graphs == 0


def test_an_inductor_option_given_to_enable_or_rewrite_says_where_it_goes():
    with pytest.raises(ValueError, match=r"'max_autotune', an inductor config option, not a compile_pass rule switch"):
        with compile_pass.enable(max_autotune=True):
            pass
    with pytest.raises(
        ValueError, match=r"options=\{'max_autotune': \.\.\.\}\) or set torch\._inductor\.config\.max_autotune"
    ):
        compile_pass.rewrite(torch.fx.symbolic_trace(torch.nn.Identity()), max_autotune=True)


def test_a_switch_takes_a_bool():
    with pytest.raises(ValueError, match="rule switch 'causal_mask' takes True or False, got 'off'"):
        validate_options({"causal_mask": "off"}, "test", inductor_takes_rest=True)
    with pytest.raises(ValueError, match="setting 'slow_kernels' takes True or False, got 1"):
        validate_options({"slow_kernels": 1}, "test", inductor_takes_rest=True)
    with pytest.raises(
        ValueError,
        match="test: context_parallel takes True or False, a ProcessGroup or one dimension of a DeviceMesh, got 2",
    ):
        validate_options({"context_parallel": 2}, "test", inductor_takes_rest=True)
    with pytest.raises(
        ValueError, match="test: setting 'context_parallel_layout' takes one of 'contiguous', 'head-tail', got 'zigzag'"
    ):
        validate_options({"context_parallel_layout": "zigzag"}, "test", inductor_takes_rest=True)


def test_backend_options_split_into_switches_and_inductor_options():
    switches, inductor = validate_options(
        {"sliding_window": False, "max_autotune": True, "triton.cudagraphs": False, "epilogue-fusion": True},
        "test",
        inductor_takes_rest=True,
    )
    assert switches == {"sliding_window": False}
    # Spelled as torch.compile(options=...) accepts them for the default backend.
    assert inductor == {"max_autotune": True, "triton.cudagraphs": False, "epilogue_fusion": True}


def test_backend_options_switch_a_rule_off_and_reach_inductor():
    with compile_pass.decisions() as report:
        compiled = torch.compile(
            attend, backend="compile_pass", options={"sliding_window": False, "max_autotune": False}
        )
        q, k, v = qkv()
        torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))
    assert [(d.rules, d.full_verdict) for d in report] == [
        ("causal_mask", "kept: mask is window (3, 0), not plain causal")
    ]


def test_no_cpu_compiler_says_what_to_install():
    """inductor needs a C++ compiler for CPU kernels; without one the backend says how to get one."""
    no_compiler = torch._inductor.config.patch({"cpp.cxx": ("no-such-c++-compiler",), "fx_graph_cache": False})
    with no_compiler, torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(lambda x: (x * 2).sin(), backend="compile_pass")
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"apt-get install g\+\+") as failed:
            compiled(torch.randn(8))
    assert "no working C++ compiler" in str(failed.value)
