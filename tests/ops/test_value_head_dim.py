"""A value head_dim smaller than query and key's (MLA-style sliding layers): the rewrite zero-pads
V to the query's head_dim and slices the op's output back, so every kernel computes it exactly,
the output at every position and each gradient (the padded columns of dV are dropped by the
slice's backward). A wider value than query keeps SDPA."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from compile_pass.kernels import policy
from compile_pass.kernels.policy import facts_of
from tests.helpers.models import Capture, assert_training_matches, token_batch
from tests.helpers.small_graphs import compiled_with_capture, pretend_gpu

WINDOW = 5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _sliding(q, k, v, padding):
    """A sliding layer as a model writes it: the band with key padding, K/V repeated."""
    seq = q.shape[2]
    positions = torch.arange(seq)
    distance = positions[None, :] - positions[:, None]
    mask = ((distance <= 0) & (distance > -WINDOW))[None, None] & padding[:, None, None, :]
    group = q.shape[1] // k.shape[1]
    return (
        F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
        .transpose(1, 2)
        .reshape(q.shape[0], seq, -1)
    )


def _inputs(head_dim, value_dim, seq=24, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)

    def make(heads, dim):  # heads-last storage, as projections give it
        return torch.randn(2, seq, heads, dim, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()

    padding = torch.ones(2, seq, dtype=torch.bool)
    padding[1, 18:] = False  # a right-padded row: its padded rows see keys, all rows are compared
    return make(4, head_dim), make(2, head_dim), make(2, value_dim), padding


@pytest.mark.parametrize("value_dim", [8, 5])
def test_a_narrower_value_is_rewritten_exactly(value_dim):
    q, k, v, padding = _inputs(16, value_dim)
    compiled, capture = compiled_with_capture(_sliding)
    out = compiled(q, k, v, padding)
    assert [d.verdict for d in capture.report] == [f"rewritten: window ({WINDOW - 1}, 0), key padding from padding"]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = _sliding(q, k, v, padding)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    assert out.shape == expected.shape and out.stride() == expected.stride()
    for ours, theirs in zip((out, *grads), (expected, *expected_grads), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


def test_a_narrower_value_in_fp32_matches_fp64():
    q, k, v, padding = _inputs(16, 8, dtype=torch.float32)
    compiled, capture = compiled_with_capture(_sliding)
    out = compiled(q, k, v, padding)
    assert capture.report[0].rewritten
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _sliding(*wide, padding)
    expected_grads = torch.autograd.grad(expected.sum(), wide)
    for ours, theirs in zip((out, *grads), (expected, *expected_grads), strict=True):
        torch.testing.assert_close(ours.double(), theirs, atol=2e-5, rtol=2e-5)


def test_a_wider_value_keeps_sdpa():
    q, k, v, padding = _inputs(8, 16)
    compiled, capture = compiled_with_capture(_sliding)
    torch.testing.assert_close(compiled(q, k, v, padding), _sliding(q, k, v, padding), atol=0, rtol=0)
    (decision,) = capture.report
    assert not decision.rewritten
    assert "value head_dim 16 is wider than query and key's 8" in decision.verdict


def test_a_narrower_value_is_measured_on_the_cpu_only(monkeypatch):
    """The padded call does more work than SDPA's on the narrower value: its crossover is
    measured on the CPU (benchmarks/bench_op.py --value-head-dim), on no GPU yet: where torch's
    FA2 would take the call with equal head_dims (an sm90 GPU), SDPA stays."""
    narrow = dict(same_lengths=True, keys=4096, left=511, value_head_dim=128)
    assert policy.POLICY.choose(facts_of("cpu", torch.float32, 256, **narrow)).fast
    pretend_gpu(monkeypatch)
    assert policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 256, **{**narrow, "value_head_dim": None})).fast
    on_gpu = policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 256, **narrow))
    assert not on_gpu.fast
    assert "value zero-padded from head_dim 128 to 256: not measured on a GPU" in on_gpu.reason


def test_dots3_sliding_layers_with_a_narrower_value_train_as_eager():
    """transformers' dots3_note: its sliding layers have head_dim 256 and a value head_dim of 128."""
    config = transformers.Dots3NoteTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=8,
        pad_token_id=0,
        layer_types=["sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "dense"],
        kv_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
    )
    torch.manual_seed(0)
    model = transformers.Dots3NoteForCausalLM._from_config(config, attn_implementation="sdpa")
    capture = Capture()
    ids = token_batch(24)
    assert_training_matches(model, torch.compile(model, backend=capture), input_ids=ids, labels=ids, use_cache=False)
    verdicts = [d.verdict for d in capture.report if d.kind == "attention call"]
    assert verdicts == ["rewritten: window (7, 0)"] * 2, verdicts
