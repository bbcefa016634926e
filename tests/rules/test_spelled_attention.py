"""Attention spelled out in ops (transformers' eager attention; GPT-OSS's, with its sinks): the
chain read step by step becomes the sliding-window op, exact in the forward and every gradient
(the sinks' included); a chain with any step off stays as it is, with the step named."""

import expecttest
import pytest
import torch
import torch.nn.functional as F

from compile_pass.rules.sliding_window import OP
from tests.helpers.models import (
    GPT_OSS_WINDOW,
    Capture,
    assert_close_scaled,
    checkpointed,
    count_calls,
    fp64_reference,
    loss_and_grads,
    tiny_gpt_oss,
    token_batch,
)
from tests.helpers.small_graphs import compiled_with_capture, qkv

W = 4
FILL = torch.finfo(torch.float64).min


def _band(q, keep=None):
    """transformers' eager sliding mask: 0 on the band (W keys, causal) where ``keep`` (batch,
    keys) keeps the key, the dtype's minimum elsewhere."""
    positions = torch.arange(q.shape[2])
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    if keep is not None:
        visible = visible & keep[:, None, None, :]
    return torch.where(visible, torch.zeros((), dtype=q.dtype), FILL)


def _logits_with_sink(q, k, sinks):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.5 + _band(q)
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    return torch.cat([scores, column], dim=-1)


def with_sinks(q, k, v, sinks):
    """GPT-OSS's eager_attention_forward, as transformers 5.24 spells it."""
    logits = _logits_with_sink(q, k, sinks)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(F.dropout(probs, p=0.0, training=True).to(v.dtype), v)


def _padded_with_sinks(q, k, v, sinks, keep):
    """With sinks over a band and a key padding (``keep``): rows may see no key."""
    scores = torch.matmul(q, k.transpose(2, 3)) + _band(q, keep)
    column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    logits = torch.cat([scores, column], dim=-1)
    return torch.matmul(F.softmax(logits, dim=-1)[..., :-1], v)


def without_sinks(q, k, v, sinks):
    """Llama's (softmax in float32 and back, here in q's own dtype: float32 would narrow float64),
    divided by a scale, the mask added first."""
    scores = _band(q) + torch.matmul(q, k.transpose(-1, -2)) / 2.0
    probs = F.softmax(scores, dim=-1, dtype=q.dtype).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=0.3, training=False), v)


def with_aten_mt(q, k, v, sinks):
    """k^T as aten's ``mT`` op, as Dynamo traces ``k.mT`` in a checkpoint body on torch 2.14."""
    scores = torch.matmul(q, torch.ops.aten.mT(k)) / 2.0 + _band(q)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def sink_off_the_wrong_end(q, k, v, sinks):
    logits = _logits_with_sink(q, k, sinks)
    return torch.matmul(F.softmax(logits, dim=-1)[..., 1:], v)


def max_of_another_tensor(q, k, v, sinks):
    logits = _logits_with_sink(q, k, sinks)
    other = torch.matmul(q, q.transpose(2, 3))
    return torch.matmul(F.softmax(logits - other.amax(-1, keepdim=True), dim=-1)[..., :-1], v)


def softmax_over_queries(q, k, v, sinks):
    scores = torch.matmul(q, k.transpose(2, 3)) + _band(q)
    return torch.matmul(F.softmax(scores, dim=-2), v)


def dropout_in_training(q, k, v, sinks):
    scores = torch.matmul(q, k.transpose(2, 3)) + _band(q)
    return torch.matmul(F.dropout(F.softmax(scores, dim=-1), p=0.1, training=True), v)


def biased_before_the_mask(q, k, v, sinks):
    """A bias computed from the data added to the scores before the mask (Inkling2's relative
    position bias): no FA2 window carries it."""
    bias = q.sum(-1, keepdim=True) * 0.1
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.5 + bias + _band(q)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def probabilities_returned(q, k, v, sinks):
    scores = torch.matmul(q, k.transpose(2, 3)) + _band(q)
    probs = F.softmax(scores, dim=-1)
    return torch.matmul(probs, v), probs


def _inputs(seed=0):
    q, k, v = qkv(seq=16, seed=seed, batch=2)
    sinks = torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    return q, k, v, sinks


@pytest.mark.parametrize("fn", [with_sinks, without_sinks, with_aten_mt], ids=["sinks", "no-sinks", "aten-mT"])
def test_the_chain_becomes_the_op_exactly(fn):
    compiled, capture = compiled_with_capture(fn)
    inputs = _inputs()
    out = compiled(*inputs)
    ref = fn(*inputs)
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out, allow_unused=True)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *ref_grads), strict=True):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)
    (decision,) = capture.report
    sink = ", attention sinks" if fn is with_sinks else ""
    assert decision.verdict == f"rewritten: attention spelled out in ops: window ({W - 1}, 0) (additive mask){sink}"
    (graph,) = capture.graphs
    assert count_calls(graph, OP) == 1 and count_calls(graph, F.softmax) == 0  # the chain is gone


class TestRewrittenGraph(expecttest.TestCase):
    def test_the_padded_chain_with_sinks_becomes_one_op_and_the_sink_check(self):
        compiled, capture = compiled_with_capture(_padded_with_sinks)
        q, k, v, sinks = _inputs()
        compiled(q, k, v, sinks, torch.ones(2, 16, dtype=torch.bool))
        (gm,) = capture.graphs
        self.assertExpectedInline(
            gm.code.strip(),
            """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_keep_ : torch.Tensor, L_sinks_ : torch.Tensor, L_v_ : torch.Tensor):
    l_k_ = L_k_
    l_q_ = L_q_
    l_keep_ = L_keep_
    l_sinks_ = L_sinks_
    l_v_ = L_v_
    lt = torch.lt(l_sinks_, inf)
    gt_1 = torch.gt(l_sinks_, -1.7976931348623157e+308)
    logical_and = torch.logical_and(lt, gt_1);  lt = gt_1 = None
    all_1 = torch.all(logical_and);  logical_and = None
    _assert_async = torch._assert_async(all_1, "compile_pass: an attention sink is +inf or NaN, or, where rows may see no key, not above the attention mask's fill (-inf or the dtype's minimum): the result would differ from eager; compile with spelled_attention=False");  all_1 = _assert_async = None
    ne = l_keep_ != 0;  l_keep_ = None
    sliding_window_attention_forward_default = torch.ops.compile_pass.sliding_window_attention_forward.default(l_q_, l_k_, l_v_, 3, 0, 1.0, ne, None, None, None, None, l_sinks_);  l_q_ = l_k_ = l_v_ = ne = l_sinks_ = None
    getitem_6 = sliding_window_attention_forward_default[0];  sliding_window_attention_forward_default = None
    contiguous = getitem_6.contiguous();  getitem_6 = None
    return (contiguous,)""",  # noqa: E501 (a snapshot: printed lines as they are)
        )


@pytest.mark.parametrize(
    ("fn", "step"),
    [
        (
            sink_off_the_wrong_end,
            "getitem_4 slices (Ellipsis, slice(1, None, None)) off the softmax, not its last column",
        ),
        (max_of_another_tensor, "sub_1 subtracts .amax(), not the row max of cat (logits)"),
        (softmax_over_queries, "softmax softmax over dim -2, not the key axis"),
        (dropout_in_training, "dropout dropout with p=0.1 in training"),
        (probabilities_returned, "the probabilities probs is also used by output"),
        (biased_before_the_mask, "add adds mul (bias) to the scores before the mask: a bias no FA2 window carries"),
    ],
    ids=["sink-wrong-end", "max-of-other", "softmax-over-queries", "dropout", "probabilities-returned", "biased"],
)
def test_a_near_miss_is_kept_naming_the_step(fn, step):
    compiled, capture = compiled_with_capture(fn)
    inputs = _inputs()
    torch.manual_seed(0)
    out = compiled(*inputs)
    torch.manual_seed(0)
    ref = fn(*inputs)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)  # the chain as it was
    (decision,) = capture.report
    assert decision.verdict == f"kept: attention spelled out in ops, but {step}"
    assert not capture.report.rewritten()


def _gpt_oss_trains_as_eager(model, **inputs):
    """Every attention layer on the op; loss and every gradient (the sinks' included) against
    eager fp32 and eager fp64 (whose experts run the eager loop: grouped_mm takes no fp64)."""
    torch._dynamo.reset()
    capture = Capture()
    loss, grads = loss_and_grads(torch.compile(model, backend=capture), **inputs)
    decisions = [d for report in capture.reports for d in report]
    assert len(decisions) == model.config.num_hidden_layers and all(d.rewritten for d in decisions), decisions
    assert all(d.reason.endswith("attention sinks") for d in decisions)
    eager_loss, eager_grads = loss_and_grads(model, **inputs)
    ref_loss, ref_grads = loss_and_grads(fp64_reference(model), **inputs)
    assert_close_scaled(loss, eager_loss, "loss vs eager")
    assert_close_scaled(loss, ref_loss, "loss vs fp64")
    assert grads.keys() == ref_grads.keys() and sum("sinks" in name for name in grads) == 2
    for name in grads:
        assert_close_scaled(grads[name], eager_grads[name], name)
        assert_close_scaled(grads[name], ref_grads[name], name)
    return decisions


def test_gpt_oss_trains_on_the_op_padded_batch_included():
    model = tiny_gpt_oss()
    ids = token_batch(12)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :5] = 0  # left padding: rows 0-4 of row 1 see no key
    decisions = _gpt_oss_trains_as_eager(
        model, input_ids=ids, attention_mask=padding, labels=ids.masked_fill(padding == 0, -100)
    )
    assert [d.reason for d in decisions] == [
        f"attention spelled out in ops: window ({GPT_OSS_WINDOW - 1}, 0) (additive mask), key padding from "
        "attention_mask, attention sinks",
        "attention spelled out in ops: window (-1, 0) (additive mask), key padding from attention_mask, attention "
        "sinks",
    ]


@pytest.mark.slow
def test_gpt_oss_unpadded_and_checkpointed_train_on_the_op():
    ids = token_batch(12)
    _gpt_oss_trains_as_eager(tiny_gpt_oss(), input_ids=ids, labels=ids)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :5] = 0
    inputs = dict(input_ids=ids, attention_mask=padding, labels=ids.masked_fill(padding == 0, -100))
    _gpt_oss_trains_as_eager(checkpointed(tiny_gpt_oss()), **inputs)


@pytest.mark.slow
def test_gpt_oss_through_inductor_trains_as_eager():
    """backend="compile_pass" as users call it: the rewritten graph compiled by inductor,
    checkpointed and padded (the sink check in the recomputed body)."""
    model = checkpointed(tiny_gpt_oss())
    ids = token_batch(12)
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :5] = 0
    inputs = dict(input_ids=ids, attention_mask=padding, labels=ids.masked_fill(padding == 0, -100))
    torch._dynamo.reset()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss, grads = loss_and_grads(torch.compile(model, backend="compile_pass"), **inputs)
    calls = [event.name for event in profile.events() if event.name == "compile_pass::sliding_window_attention_forward"]
    assert len(calls) >= 2, calls  # both layers, forward (and again in the checkpoint's recomputation)
    ref_loss, ref_grads = loss_and_grads(fp64_reference(model), **inputs)
    assert_close_scaled(loss, ref_loss, "loss vs fp64")
    for name in ref_grads:
        assert_close_scaled(grads[name], ref_grads[name], name)


def test_a_sink_at_the_fill_raises_where_rows_may_see_no_key():
    """A row without a visible key puts its weight on the sink (0 out) only where the sink is
    above the fill; a sink of -inf would average the row's values: the run-time check says so."""
    padded = _padded_with_sinks
    compiled, capture = compiled_with_capture(padded)
    q, k, v, sinks = _inputs()
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, :6] = False
    torch.testing.assert_close(compiled(q, k, v, sinks, keep), padded(q, k, v, sinks, keep), atol=1e-12, rtol=0)
    assert capture.report.rewritten()
    with pytest.raises(RuntimeError, match="attention sink is"):
        compiled(q, k, v, torch.tensor([0.5, float("-inf")], dtype=torch.float64), keep)


def test_a_sink_of_inf_raises():
    """The chain's softmax is NaN at a sink of +inf, where the op would return 0: checked at run
    time wherever the chain had a sink, rows without keys or not."""
    compiled, capture = compiled_with_capture(with_sinks)
    q, k, v, sinks = _inputs()
    torch.testing.assert_close(compiled(q, k, v, sinks), with_sinks(q, k, v, sinks), atol=1e-12, rtol=0)
    assert capture.report.rewritten()
    assert with_sinks(q, k, v, torch.tensor([0.5, float("inf")], dtype=torch.float64)).isnan().any()
    with pytest.raises(RuntimeError, match="attention sink is"):
        compiled(q, k, v, torch.tensor([0.5, float("inf")], dtype=torch.float64))


def _eager_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=W,
        max_position_embeddings=256,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return MistralForCausalLM(config)


def _trains_as_fp64(model, **inputs) -> list[str]:
    """The compiled step's loss and gradients against eager fp64; the decisions' verdicts."""
    torch._dynamo.reset()
    capture = Capture()
    loss, grads = loss_and_grads(torch.compile(model, backend=capture), **inputs)
    ref_loss, ref_grads = loss_and_grads(fp64_reference(model), **inputs)
    assert_close_scaled(loss, ref_loss, "loss vs fp64")
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], name)
    return [d.verdict for report in capture.reports for d in report]


def test_a_sliding_model_run_eagerly_gets_the_op():
    """Mistral with attn_implementation="eager": no sinks; every sliding layer on the op."""
    ids = token_batch(12)
    assert (
        _trains_as_fp64(_eager_mistral(), input_ids=ids, labels=ids)
        == [f"rewritten: attention spelled out in ops: window ({W - 1}, 0) (additive mask)"] * 2
    )


def test_packed_rows_run_eagerly_are_checked_with_the_chain_as_fallback():
    """Packed rows (position_ids restarting per sequence, TRL's packing) under an additive mask
    without sinks: the op checks the positions at run time, and where they fail computes the
    chain itself with its additive mask (``ops/chain.py``). The step is eager's, in fp64."""
    ids = token_batch(12)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)
    verdicts = _trains_as_fp64(_eager_mistral(), input_ids=ids, position_ids=positions, labels=ids)
    assert (
        verdicts
        == [
            f"rewritten: attention spelled out in ops: window ({W - 1}, 0) (additive mask), packed sequences from "
            "position_ids (positions checked at run time)"
        ]
        * 2
    )
