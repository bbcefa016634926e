"""Gemma-4 on stock torch, as on a GPU with no flash-attn: the rules choose torch's own FA2 for
the sliding layers in bf16 (the policy's answer as if on sm80 and sm90), and a training step
runs them through aten's flash ops, here CPU kernels that keep their CUDA contract
(tests/helpers/torch_flash_emulation.py), against eager and fp64.
"""

import pytest
import torch

from compile_pass.kernels import fa2
from tests.helpers import flash_emulation, torch_flash_emulation
from tests.helpers.models import Capture, at_sdpa_call, sliding_layers, tiny_gemma4, token_batch
from tests.helpers.precision import REWRITE_ONLY, training_errors
from tests.helpers.small_graphs import ask_as_if_on_cuda, pretend_gpu

FA2_SHAPES = dict(head_dim=64, global_head_dim=512)  # FA2 takes head_dim 64; the global layers 512, as Gemma-4's


def _padded(length):
    padding = torch.ones(2, length, dtype=torch.long)
    padding[0, :5] = 0  # left padding
    padding[1, length - 3 :] = 0  # right padding
    return padding


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_gemma4_sliding_layers_get_torch_fa2_for_cuda_bf16(monkeypatch, capability, padded):
    """The rules' graph-time answer for CUDA, bf16 weights, as if on that GPU: every sliding
    layer rewritten to the op on torch's FA2 (varlen with padding); the global layer
    (head_dim 512, past FA2) keeps SDPA's own causal path."""
    pretend_gpu(monkeypatch, capability)
    ask_as_if_on_cuda(monkeypatch)
    model = tiny_gemma4(torch.bfloat16, **FA2_SHAPES)
    capture = Capture()
    inputs = {"input_ids": token_batch(24), "use_cache": False}
    if padded:
        inputs["attention_mask"] = _padded(24)
    torch.compile(model, backend=capture, fullgraph=True)(**inputs)
    sliding = [d for d in capture.report if d.layer_type == "sliding_attention"]
    assert len(sliding) == sliding_layers(model) == 2
    kernel = "torch's FA2 varlen" if padded else "torch's FA2"
    assert {(d.rewritten, d.kernel) for d in sliding} == {(True, kernel)}, at_sdpa_call(capture.report.table())
    # With padding, one varlen layout per graph call, shared by the sliding layers.
    (graph,) = capture.graphs
    layouts = [n for n in graph.graph.nodes if n.target is torch.ops.compile_pass.varlen_layout.default]
    assert len(layouts) == int(padded)
    (full,) = [d for d in capture.report if d.layer_type == "full_attention"]
    # Plain causal: SDPA's is_causal path; with padding, SDPA with its mask.
    assert (full.rewritten, full.rule) == ((False, "sliding_window") if padded else (True, "causal_mask")), full


@pytest.fixture
def aten_flash_on_cpu(monkeypatch):
    """aten's flash ops run on the CPU, on an emulated sm90 GPU, for this test only."""
    emulation = torch_flash_emulation.install()
    monkeypatch.setattr(fa2, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(flash_emulation, "device_capability", (9, 0))
    flash_emulation.reset_records()
    yield
    emulation.uninstall()


@pytest.mark.parametrize(
    ("dtype", "autocast"), [(torch.bfloat16, None), (torch.float32, torch.bfloat16)], ids=["bf16", "autocast-bf16"]
)
def test_gemma4_training_step_through_atens_flash_ops(aten_flash_on_cpu, dtype, autocast):
    """bf16 weights, and fp32 weights under bf16 autocast: the rewritten graph's sliding
    layers run forward and backward through aten's flash ops, K/V un-repeated, and the step is
    as close to fp64 as eager's (the bar of tests/ops/test_precision.py)."""
    errors = training_errors(dtype, variants=REWRITE_ONLY, autocast=autocast)
    assert errors["rewritten"]["calls"] == 3  # 2 sliding layers, 1 global layer's causal mask
    assert flash_emulation.calls["aten_fwd"] == flash_emulation.calls["fwd"] == 2
    assert flash_emulation.calls["aten_bwd"] == flash_emulation.calls["bwd"] == 2
    ours, eager = errors["rewritten, eager"], errors["eager"]
    slack = {
        "grad norm": 0.01,
        "grad max": 0.01 * errors["fp64"]["grad max"],
        "logits max": 0.01 * errors["fp64"]["logits max"],
    }
    for name, extra in slack.items():
        assert ours[name] <= 1.25 * eager[name] + extra, (name, ours, eager)
    assert eager["grad norm"] > 1e-3  # the measure can fail: half precision shows an error
