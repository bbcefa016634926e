"""The top-k rule on transformers' Doge and on top-k masks written in flash-dmattn's styles.

Where the rewritten graph runs the same arithmetic as eager (the rule changes only which
mask tensor marks the same positions), results must be bit-identical: max |diff| == 0.
bf16 is compared with an fp64 eager reference at 2e-2 relative to each tensor's largest
magnitude (bf16 keeps 8 significant bits), and fp32 inductor at 1e-4.
"""

import copy

import expecttest
import pytest
import torch
import torch.nn.functional as F
from transformers import DogeConfig
from transformers.models.doge.modeling_doge import DogeForCausalLM

from tests.helpers.models import Capture, assert_close_scaled, loss_and_grads

KEEP = 8


def tiny_doge(dtype=torch.float32) -> DogeForCausalLM:
    config = DogeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        keep_window_size=KEEP,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return DogeForCausalLM(config).to(dtype)


def tokens(length=32):
    return torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))


def assert_training_matches_fp64(model, compiled, tolerance):
    """Loss and every gradient of ``compiled`` against the fp64 eager model, scaled as in tests/helpers/models.py."""
    ids = tokens()
    loss, grads = loss_and_grads(compiled, input_ids=ids, labels=ids, use_cache=False)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model).double(), input_ids=ids, labels=ids, use_cache=False)
    assert grads.keys() == ref_grads.keys()
    assert_close_scaled(loss, ref_loss, "loss", tolerance)
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], name, tolerance)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pattern_lines(code: str) -> str:
    """The lines from the first top-k's input to the fill it decides."""
    lines = [line.strip() for line in code.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("detach"))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("attn_mask_2"))
    return "\n".join(lines[start : end + 1])


class TestDoge(expecttest.TestCase):
    def test_detached_scatter_form_and_identical_training(self):
        model = tiny_doge()
        capture = Capture()
        compiled = torch.compile(model, backend=capture, fullgraph=True)
        ids = tokens()
        loss, grads = loss_and_grads(compiled, input_ids=ids, labels=ids, use_cache=False)
        eager_loss, eager_grads = loss_and_grads(model, input_ids=ids, labels=ids, use_cache=False)
        assert torch.equal(loss, eager_loss)
        for name, grad in grads.items():
            assert torch.equal(grad, eager_grads[name]), name
        topk_decisions = [d.verdict for d in capture.report if d.rule == "topk_mask"]
        assert topk_decisions == ["rewritten: top-k of the detached input; float active mask -> bool scatter"] * 2
        (gm,) = capture.graphs
        self.assertExpectedInline(
            _pattern_lines(gm.code),
            """\
detach = attn_mask_1.detach()
topk = torch.topk(detach, 8, dim = -1, largest = True, sorted = False);  detach = None
topk_indices = topk[1];  topk = None
zeros_like_2 = torch.zeros_like(attn_mask_1, dtype = torch.bool)
scatter_2 = zeros_like_2.scatter(-1, topk_indices, True);  zeros_like_2 = topk_indices = None
invert = ~scatter_2;  scatter_2 = None
attn_mask_2 = attn_mask_1.masked_fill(invert, -3.4028234663852886e+38);  attn_mask_1 = invert = None""",
        )
        # No float helper mask and no == 0.0 pass remain.
        assert "active_mask" not in gm.code and "== 0.0" not in gm.code

    def test_bf16_against_fp64(self):
        model = tiny_doge(torch.bfloat16)
        assert_training_matches_fp64(model, torch.compile(model, backend=Capture(), fullgraph=True), 2e-2)


def test_doge_training_through_the_backend_with_inductor():
    model = tiny_doge()
    assert_training_matches_fp64(model, torch.compile(model, backend="compile_pass", fullgraph=True), 1e-4)


def test_switched_off_leaves_the_float_form():
    capture = Capture(topk_mask=False)
    torch.compile(tiny_doge(), backend=capture, fullgraph=True)(input_ids=tokens(), use_cache=False)
    assert not [d for d in capture.report if d.rule == "topk_mask"]
    assert "== 0.0" in capture.graphs[0].code


# -- flash-dmattn's styles --------------------------------------------------------------

MIN = torch.finfo(torch.float64).min


def _attend(query, key, value, bias, keep_mask):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias.masked_fill(~keep_mask, MIN))


def ones_when_no_mask(query, key, value, bias):
    """Older style: an all-true mask allocated when none is given, then top-k of the masked bias."""
    attention_mask = torch.ones_like(bias, dtype=torch.bool)
    masked = bias.masked_fill(~attention_mask, MIN)
    indices = torch.topk(masked, KEEP, dim=-1, largest=True, sorted=False).indices
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, True)
    return _attend(query, key, value, bias, keep)


def validity_form(query, key, value, bias, attention_mask):
    """Top-k values compared with min decide which picks count: rows with fewer than k allowed
    keys must not gain masked ones."""
    masked = bias.masked_fill(~attention_mask, MIN)
    values, indices = torch.topk(masked, KEEP, dim=-1, largest=True, sorted=False)
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, values != MIN)
    return _attend(query, key, value, bias, keep)


def float_active_mask(query, key, value, bias, attention_mask):
    """transformers' Doge style on a given mask."""
    masked = bias.masked_fill(~attention_mask, MIN)
    active = torch.zeros_like(masked, dtype=masked.dtype)
    indices = torch.topk(masked, KEEP, dim=-1, largest=True, sorted=False).indices
    active = active.scatter(-1, indices, 1.0)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=masked.masked_fill(active == 0.0, MIN))


def _inputs(with_mask: bool, seq=24):
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, 3, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 3, seq, seq, generator=gen, dtype=torch.float64)
    tensors = [t.requires_grad_() for t in (query, key, value, bias)]
    if not with_mask:
        return tensors
    # Causal, so early rows have fewer than KEEP allowed keys.
    return tensors + [torch.ones(seq, seq, dtype=torch.bool).tril()]


def _assert_bit_identical(fn, inputs):
    """Compile with only the top-k rule; forward and the gradients of q, k, v and the bias must
    equal eager's bit for bit. Returns the capture."""
    capture = Capture(sliding_window=False, causal_mask=False)
    compiled = torch.compile(fn, backend=capture, fullgraph=True)
    differentiable = inputs[:4]
    out = compiled(*inputs)
    grads = torch.autograd.grad(out.sum(), differentiable)
    ref = fn(*inputs)
    ref_grads = torch.autograd.grad(ref.sum(), differentiable)
    for a, b in zip((out, *grads), (ref, *ref_grads), strict=True):
        assert torch.equal(a, b)
    return capture


@pytest.mark.parametrize(
    ("fn", "with_mask", "verdicts"),
    [
        (
            ones_when_no_mask,
            False,
            ["rewritten: masked_fill with an all-false mask removed", "rewritten: top-k of the detached input"],
        ),
        (validity_form, True, ["rewritten: top-k of the detached input"]),
        (float_active_mask, True, ["rewritten: top-k of the detached input; float active mask -> bool scatter"]),
    ],
    ids=["ones-when-no-mask", "validity", "float-active-mask"],
)
def test_flash_dmattn_styles(fn, with_mask, verdicts):
    capture = _assert_bit_identical(fn, _inputs(with_mask))
    assert [d.verdict for d in capture.report] == verdicts
    (gm,) = capture.graphs
    assert "ones_like" not in gm.code
    assert all(node.args[0].target == "detach" for node in gm.graph.find_nodes(op="call_function", target=torch.topk))


def _values_in_the_loss(query, key, value, bias):
    values, indices = torch.topk(bias, KEEP, dim=-1)
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, True)
    return _attend(query, key, value, bias, keep) + values.sum()


def _top_k_over_queries(query, key, value, bias):
    indices = torch.topk(bias, KEEP, dim=-2).indices
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-2, indices, True)
    return _attend(query, key, value, bias, keep)


def _smallest_k(query, key, value, bias):
    indices = torch.topk(bias, KEEP, dim=-1, largest=False).indices
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, True)
    return _attend(query, key, value, bias, keep)


def _indices_gathered(query, key, value, bias):
    indices = torch.topk(bias, KEEP, dim=-1).indices
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, True)
    return _attend(query, key, value, bias, keep) + bias.gather(-1, indices).sum()


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_values_in_the_loss, "kept: top-k values feed sum_1"),
        (_top_k_over_queries, "kept: top-k over dim -2, not the last"),
        (_smallest_k, "kept: largest=False"),
        (_indices_gathered, "kept: top-k indices feed gather, not a scatter"),
    ],
    ids=["values-differentiated", "not-last-dim", "smallest", "indices-gathered"],
)
def test_kept_with_a_reason(fn, verdict):
    capture = _assert_bit_identical(fn, _inputs(with_mask=False))
    assert [d.verdict for d in capture.report] == [verdict]
    (gm,) = capture.graphs
    assert not any(node.target == "detach" for node in gm.graph.nodes)


# -- MoE routers: a top-k that builds no attention mask is no decision -------------------------


def _tiny_router_model(family: str):
    """A tiny random MoE model whose router's top-k indices reach a ``scatter_``: DeepSeek-V3's
    group choice (its picks fill a group mask that masks expert scores) and Llama-4's scores
    (the picks' values scattered into -inf logits)."""
    import transformers

    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "deepseek-v3":
        config = transformers.DeepseekV3Config(
            **dict(common, num_key_value_heads=4),
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
        model_class = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.Llama4TextConfig(
            **common,
            intermediate_size=128,
            intermediate_size_mlp=128,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            moe_layers=[0, 1],
            no_rope_layers=[1, 1],
        )
        model_class = transformers.Llama4ForCausalLM
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("family", ["deepseek-v3", "llama-4"])
def test_router_top_k_is_no_decision(family, caplog):
    """The routers' top-k are logged at DEBUG, not reported as kept top-k masks, and the graph
    keeps them as they were; training still matches eager."""
    import logging

    model = _tiny_router_model(family)
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = tokens()
    with caplog.at_level(logging.DEBUG, logger="compile_pass"):
        loss, grads = loss_and_grads(compiled, input_ids=ids, labels=ids, use_cache=False)
    eager_loss, eager_grads = loss_and_grads(model, input_ids=ids, labels=ids, use_cache=False)
    assert_close_scaled(loss, eager_loss, "loss")
    for name, grad in grads.items():
        assert_close_scaled(grad, eager_grads[name], name)
    assert [d.verdict for d in capture.report if d.kind == "top-k mask"] == []
    router_lines = [r.getMessage() for r in caplog.records if "build no attention mask" in r.getMessage()]
    assert len(router_lines) == 2, router_lines  # one router per layer
    (gm,) = capture.graphs
    assert not any(node.target == "detach" for node in gm.graph.nodes)


def _spelled_out_values_in_the_loss(query, key, value, bias):
    """A top-k mask on scores that a softmax normalises (attention spelled out in ops), kept."""
    values, indices = torch.topk(bias, KEEP, dim=-1)
    keep = torch.zeros_like(bias, dtype=torch.bool).scatter(-1, indices, True)
    scores = query @ key.transpose(-1, -2) + bias.masked_fill(~keep, MIN)
    return torch.softmax(scores, dim=-1) @ value + values.sum()


def _mask_returned(query, key, value, bias):
    """A kept top-k mask the graph returns: where it goes is not this graph's to see."""
    values, indices = torch.topk(bias, KEEP, dim=-1)
    return torch.zeros_like(bias).scatter_(-1, indices, 1.0), values.sum()


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_spelled_out_values_in_the_loss, "kept: top-k values feed sum_1"),
        (_mask_returned, "kept: top-k indices feed scatter_, not a scatter"),
    ],
    ids=["softmax", "returned"],
)
def test_kept_attention_masks_are_reported_without_sdpa(fn, verdict):
    capture = Capture(sliding_window=False, causal_mask=False, spelled_attention=False)
    torch.compile(fn, backend=capture, fullgraph=True)(*_inputs(with_mask=False))
    assert [d.verdict for d in capture.report] == [verdict]
