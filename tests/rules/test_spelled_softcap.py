"""The spelled_attention rule on the last forms the families write: soft-capped scores (Gemma-2,
VaultGemma: ``tanh(s / cap) * cap``), sinks spelled as a logsumexp scaling (Granite-SWA,
GraniteMoE-SWA: ``(softmax(w) @ v) * sigmoid(logsumexp(w) - sink)``) and sinks per (batch, head,
row) concatenated as the last column (Inkling2's form). Each chain becomes the op exactly,
forward and every gradient (the sinks' included); a chain with any step off the algebra stays
as it is, with the step named. The op's own softcap and sinks are tested in tests/ops/test_softcap.py
and tests/ops/test_sinks.py."""

import expecttest
import pytest
import torch
import torch.nn.functional as F
import transformers

from compile_pass.ops import runtime_mask
from compile_pass.rules.sliding_window import OP
from tests.helpers.models import (
    Capture,
    assert_close_scaled,
    count_calls,
    every_position_loss_and_grads,
    fp64_reference,
    loss_and_grads,
    token_batch,
)
from tests.helpers.small_graphs import compiled_with_capture, qkv

W = 4
FILL = torch.finfo(torch.float64).min
CAP = 2.0


def _band(q, keep=None):
    """transformers' eager sliding mask: 0 on the band (W keys, causal), the dtype's minimum elsewhere."""
    positions = torch.arange(q.shape[2])
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)
    if keep is not None:
        visible = visible & keep[:, None, None, :]
    return torch.where(visible, torch.zeros((), dtype=q.dtype), FILL)


def _scores(q, k):
    return torch.matmul(q, k.transpose(2, 3)) * 0.5


def softcapped(q, k, v, sinks):
    """Gemma-2's eager_attention_forward, as transformers 5.24 spells it (its softmax in float32,
    here in q's own dtype: float32 would narrow float64)."""
    w = _scores(q, k)
    w = w / CAP
    w = torch.tanh(w)
    w = w * CAP
    w = w + _band(q)
    probs = F.softmax(w, dim=-1, dtype=q.dtype).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=0.0, training=True), v)


def softcapped_other_spelling(q, k, v, sinks):
    """The cap first in the product, the method tanh, the reciprocal inside, the mask first."""
    w = CAP * (_scores(q, k) * (1 / CAP)).tanh()
    return torch.matmul(F.softmax(_band(q) + w, dim=-1), v)


def lse_scaled(q, k, v, sinks, keep=None):
    """Granite-SWA's eager_attention_forward, as transformers 5.24 spells it."""
    w = _scores(q, k) + _band(q, keep)
    lse = torch.logsumexp(w, dim=-1)
    sink_scale = (lse - sinks.view(1, -1, 1)).to(torch.float64).sigmoid()
    probs = F.softmax(w, dim=-1, dtype=q.dtype).to(q.dtype)
    out = torch.matmul(F.dropout(probs, p=0.0, training=True), v)
    return out * sink_scale.unsqueeze(-1).to(out.dtype)


def lse_scaled_per_row(q, k, v, sinks):
    """The logsumexp scaling with a sink per (batch, head, row), the product's factors swapped."""
    w = _scores(q, k) + _band(q)
    row_sinks = sinks.view(1, -1, 1) * torch.linspace(0.5, 1.5, q.shape[2], dtype=q.dtype)
    scale = torch.sigmoid(torch.logsumexp(w, -1) - row_sinks.expand(q.shape[0], -1, -1).contiguous())
    return scale[..., None] * torch.matmul(F.softmax(w, dim=-1), v)


def per_row_column(q, k, v, sinks):
    """Inkling2's form: a sink logit per (batch, head, row), computed from the data (here from
    q), concatenated as the last column, then dropped after the softmax."""
    row_sinks = q.sum(-1) * 0.1 + sinks.view(1, -1, 1)  # (batch, heads, rows)
    logits = torch.cat([_scores(q, k) + _band(q), row_sinks.unsqueeze(-1)], dim=-1).to(q.dtype)
    probs = F.softmax(logits, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)


def _inputs(seed=0):
    q, k, v = qkv(seq=16, seed=seed, batch=2)
    q = (q.detach() * 3).requires_grad_()  # scores past the cap
    sinks = torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)).requires_grad_()
    return q, k, v, sinks


def _assert_exact(fn, compiled, inputs, *extra):
    out = compiled(*inputs, *extra)
    ref = fn(*inputs, *extra)
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, inputs, grad_out, allow_unused=True)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), (ref, *ref_grads), strict=False):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


REWRITTEN = {
    "softcap": (softcapped, "window (3, 0) (additive mask), soft-capped scores (cap 2)"),
    "softcap, other spelling": (softcapped_other_spelling, "window (3, 0) (additive mask), soft-capped scores (cap 2)"),
    "lse scaling": (lse_scaled, "window (3, 0) (additive mask), attention sinks (logsumexp scaling)"),
    "lse scaling per row": (
        lse_scaled_per_row,
        "window (3, 0) (additive mask), attention sinks per row (logsumexp scaling)",
    ),
    "column per row": (per_row_column, "window (3, 0) (additive mask), attention sinks per row"),
}


@pytest.mark.parametrize("case", list(REWRITTEN))
def test_the_chain_becomes_the_op_exactly(case):
    fn, reason = REWRITTEN[case]
    compiled, capture = compiled_with_capture(fn)
    _assert_exact(fn, compiled, _inputs())
    (decision,) = capture.report
    assert decision.verdict == f"rewritten: attention spelled out in ops: {reason}"
    (graph,) = capture.graphs
    assert count_calls(graph, OP) == 1 and count_calls(graph, F.softmax) == 0  # the chain is gone
    assert count_calls(graph, torch.tanh) == count_calls(graph, torch.logsumexp) == 0


def test_the_lse_scaling_over_padding_is_exact_and_checks_its_sinks():
    """Rows that see no key (left padding): softmax(w) is an average under the mask's finite
    fill, and the scaling's sigmoid(lse - sink) is exactly 0 where the sink is above the fill,
    as the op's 0; a sink at the fill raises."""
    compiled, capture = compiled_with_capture(lse_scaled)
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[1, :6] = False
    _assert_exact(lse_scaled, compiled, _inputs(), keep)
    assert capture.report.rewritten()
    q, k, v, _ = _inputs()
    with pytest.raises(RuntimeError, match="attention sink is"):
        compiled(q, k, v, torch.tensor([0.5, FILL], dtype=torch.float64), keep)


class TestRewrittenGraph(expecttest.TestCase):
    def test_the_lse_scaling_becomes_one_op_in_place_of_the_product(self):
        compiled, capture = compiled_with_capture(lse_scaled)
        q, k, v, sinks = _inputs()
        compiled(q, k, v, sinks)
        (gm,) = capture.graphs
        self.assertExpectedInline(
            gm.code.strip(),
            """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_sinks_ : torch.Tensor, L_v_ : torch.Tensor):
    l_k_ = L_k_
    l_q_ = L_q_
    l_sinks_ = L_sinks_
    l_v_ = L_v_
    sliding_window_attention_forward_default = torch.ops.compile_pass.sliding_window_attention_forward.default(l_q_, l_k_, l_v_, 3, 0, 0.5, None, None, None, None, None, l_sinks_);  l_q_ = l_k_ = l_v_ = l_sinks_ = None
    getitem_4 = sliding_window_attention_forward_default[0];  sliding_window_attention_forward_default = None
    contiguous = getitem_4.contiguous();  getitem_4 = None
    return (contiguous,)""",  # noqa: E501 (a snapshot: printed lines as they are)
        )


def softcap_from_data(q, k, v, sinks):
    cap = q.abs().amax() + 1  # a tensor computed from the data
    w = torch.tanh(_scores(q, k) / cap) * cap
    return torch.matmul(F.softmax(w + _band(q), dim=-1), v)


def softcap_divisor_differs(q, k, v, sinks):
    w = torch.tanh(_scores(q, k) / 3.0) * CAP
    return torch.matmul(F.softmax(w + _band(q), dim=-1), v)


def softcap_of_a_sine(q, k, v, sinks):
    w = torch.sin(_scores(q, k) / CAP) * CAP
    return torch.matmul(F.softmax(w + _band(q), dim=-1), v)


def sine_after_a_product_mask(q, k, v, sinks):
    """The fuzzer's seed 7175: the mask first, a product of -inf, then a sine (the rule once
    raised naming the number)."""
    hidden = float("-inf") * torch.logical_not(_band(q) == 0).double()
    return torch.matmul(F.softmax(hidden + torch.sin(_scores(q, k) / CAP) * CAP, dim=-1), v)


def lse_sink_not_subtracted(q, k, v, sinks):
    w = _scores(q, k) + _band(q)
    scale = (sinks.view(1, -1, 1) - torch.logsumexp(w, dim=-1)).sigmoid()
    return torch.matmul(F.softmax(w, dim=-1), v) * scale.unsqueeze(-1)


def lse_over_the_query_axis(q, k, v, sinks):
    w = _scores(q, k) + _band(q)
    scale = (torch.logsumexp(w, dim=-2) - sinks.view(1, -1, 1)).sigmoid()
    return torch.matmul(F.softmax(w, dim=-1), v) * scale.unsqueeze(-1)


def lse_of_other_scores(q, k, v, sinks):
    w = _scores(q, k) + _band(q)
    scale = (torch.logsumexp(_scores(q, q) + _band(q), dim=-1) - sinks.view(1, -1, 1)).sigmoid()
    return torch.matmul(F.softmax(w, dim=-1), v) * scale.unsqueeze(-1)


def lse_of_shifted_scores(q, k, v, sinks):
    w = _scores(q, k) + _band(q)
    shifted = w - w.amax(-1, keepdim=True)
    scale = (torch.logsumexp(shifted, dim=-1) - sinks.view(1, -1, 1)).sigmoid()
    return torch.matmul(F.softmax(shifted, dim=-1), v) * scale.unsqueeze(-1)


def lse_scaling_with_a_tanh(q, k, v, sinks):
    w = _scores(q, k) + _band(q)
    scale = torch.tanh(torch.logsumexp(w, dim=-1) - sinks.view(1, -1, 1))
    return torch.matmul(F.softmax(w, dim=-1), v) * scale.unsqueeze(-1)


def lse_scaling_promoted(q, k, v, sinks):
    w = _scores(q, k).float() + _band(q).float()
    scale = (torch.logsumexp(w, dim=-1) - sinks.view(1, -1, 1)).sigmoid().double()
    return (torch.matmul(F.softmax(w, dim=-1), v.float()) * scale.unsqueeze(-1)).double()


def column_per_row_broadcast(q, k, v, sinks):
    row_sinks = q.sum(-1)[:1] * 0.1  # (1, heads, rows): broadcast over the batch
    logits = torch.cat([_scores(q, k) + _band(q), row_sinks.unsqueeze(-1).expand(2, -1, -1, -1)], dim=-1)
    return torch.matmul(F.softmax(logits, dim=-1)[..., :-1], v)


KEPT = {
    "softcap from data": (
        softcap_from_data,
        "w multiplies tanh by add (cap), not a constant positive finite number (a soft-cap computed from data?)",
    ),
    "softcap divisor differs": (
        softcap_divisor_differs,
        "soft-cap w: tanh(s / 3.0) * 2.0, a divisor and a multiplier that differ",
    ),
    "sine": (softcap_of_a_sine, "w scales sin by 2.0, not matmul(q, k^T) by a number (biased scores?)"),
    "sine after a product mask": (
        sine_after_a_product_mask,
        "hidden scales -inf by .double(), not matmul(q, k^T) by a number (biased scores?)",
    ),
    "lse: sink not subtracted": (
        lse_sink_not_subtracted,
        "sub_1 subtracts the logsumexp from .view() (1, 2, 1): the sink is not subtracted from it",
    ),
    "lse: over the query axis": (
        lse_over_the_query_axis,
        "logsumexp logsumexp is over dim -2, not the key axis (without keepdim)",
    ),
    "lse: of other scores": (
        lse_of_other_scores,
        "logsumexp logsumexp is of add (add_1), not of the scores the softmax reads (w)",
    ),
    "lse: of shifted scores": (
        lse_of_shifted_scores,
        "logsumexp logsumexp is of sub (shifted), not of the scores the softmax reads (w)",
    ),
    "lse: a tanh, no sigmoid": (
        lse_scaling_with_a_tanh,
        "the attention is scaled by tanh (scale), not a sigmoid of the logsumexp minus a sink",
    ),
    "lse: the product promoted": (
        lse_scaling_promoted,
        "mul_1 is torch.float64 (2, 2, 16, 8), the attention it scales torch.float32 (2, 2, 16, 8): the scale is no "
        "(batch, heads, rows) factor in its dtype",
    ),
    "column per row, broadcast": (
        column_per_row_broadcast,
        "the sink column expand expands .unsqueeze(), not a (heads,) tensor viewed as (1, heads, 1, 1)",
    ),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_a_chain_off_the_algebra_is_kept_naming_the_step(case):
    fn, step = KEPT[case]
    compiled, capture = compiled_with_capture(fn)
    inputs = _inputs()
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), atol=0, rtol=0, equal_nan=True)  # the chain as it was
    (decision,) = capture.report
    assert decision.verdict == f"kept: attention spelled out in ops, but {step}"


# -- the families, from transformers' own modeling code ---------------------------------------

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    attn_implementation="eager",
    use_cache=False,
)
GEMMAS = {
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=16)),
    "vaultgemma": (
        transformers.VaultGemmaConfig,
        dict(head_dim=16, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"]),
    ),
}


def _trains_as_eager(model, *, fp64=True, **inputs):
    """Every attention layer on the op; loss and every gradient against eager fp32 and, where
    asked, eager fp64. Returns the decisions' reasons."""
    torch._dynamo.reset()
    capture = Capture()
    loss, grads = loss_and_grads(torch.compile(model, backend=capture), **inputs)
    decisions = [d for report in capture.reports for d in report]
    assert len(decisions) == model.config.num_hidden_layers and all(d.rewritten for d in decisions), decisions
    references = [loss_and_grads(model, **inputs)] + ([loss_and_grads(fp64_reference(model), **inputs)] if fp64 else [])
    for ref_loss, ref_grads in references:
        assert_close_scaled(loss, ref_loss, "loss")
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            assert_close_scaled(grads[name], ref_grads[name], name)
    return [d.reason for d in decisions]


@pytest.mark.parametrize("family", list(GEMMAS))
def test_soft_capped_families_train_on_the_op(family):
    """Gemma-2 and VaultGemma (eager attention: transformers gives soft-capped models no SDPA
    path), a sliding and a full layer, scores soft-capped at 5 (their released 50 would not cap
    a tiny model's scores)."""
    config_class, extra = GEMMAS[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**COMMON, **extra, sliding_window=W, attn_logit_softcapping=5.0)
    )
    ids = token_batch(12)
    reasons = _trains_as_eager(model, input_ids=ids, labels=ids)
    assert reasons == [
        f"attention spelled out in ops: window ({W - 1}, 0) (additive mask), soft-capped scores (cap 5)",
        "attention spelled out in ops: window (-1, 0) (additive mask), soft-capped scores (cap 5)",
    ]


def _granite(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(**COMMON, sliding_window=W, layer_types=["sliding_attention", "full_attention"], **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # released checkpoints' sinks are learned; initialised they are 0
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    return model


def test_granite_swa_trains_on_the_op_padded_batch_included():
    """The logsumexp scaling with its sinks' gradients; left padding, whose first rows see no
    key (compared with eager fp32: eager fp64 is NaN there, its softmax cast to float32 turns
    the fp64 fill into -inf)."""
    model = _granite(transformers.GraniteSWAConfig)
    ids = token_batch(12)
    reasons = _trains_as_eager(model, input_ids=ids, labels=ids)
    assert reasons == [
        f"attention spelled out in ops: window ({W - 1}, 0) (additive mask), attention sinks (logsumexp scaling)",
        "attention spelled out in ops: window (-1, 0) (additive mask), attention sinks (logsumexp scaling)",
    ]
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :5] = 0
    inputs = dict(input_ids=ids, attention_mask=padding, labels=ids.masked_fill(padding == 0, -100))
    assert all("key padding from attention_mask" in reason for reason in _trains_as_eager(model, fp64=False, **inputs))


@pytest.mark.slow
def test_granitemoe_swa_trains_on_the_op():
    model = _granite(transformers.GraniteMoeSWAConfig, num_local_experts=4, num_experts_per_tok=2)
    ids = token_batch(12)
    assert all(
        reason.endswith("attention sinks (logsumexp scaling)")
        for reason in _trains_as_eager(model, input_ids=ids, labels=ids)
    )


@pytest.mark.parametrize(
    ("start", "path"),
    [(0, "band"), (2**30, "the chain of ops"), (-(2**63) + 2, "the chain of ops")],
    ids=["checked", "positions out of range", "positions that wrap"],
)
def test_packed_soft_capped_rows_are_checked_and_fall_back_to_the_chain(start, path):
    """Packed rows (position_ids restarting per sequence, no attention_mask: TRL's packing) go to
    the op that checks the positions at run time. Where they pass, the band kernel computes the
    capped scores; where they fail, the op computes the chain itself (``ops/chain.py``): SDPA
    has no cap, and rows that see no key (positions near int64's minimum wrap the window's
    bound, hiding every key) get the chain's mean of the values and its gradient. Each trains as
    eager."""
    config_class, extra = GEMMAS["gemma2"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**COMMON, **extra, sliding_window=W, attn_logit_softcapping=5.0)
    )
    ids = token_batch(12)
    positions = (torch.cat([torch.arange(5), torch.arange(7)]) + start).repeat(2, 1)
    torch._dynamo.reset()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    with torch.profiler.profile() as profile:
        loss, grads = every_position_loss_and_grads(compiled, input_ids=ids, position_ids=positions)
    decisions = [d for report in capture.reports for d in report]
    assert len(decisions) == 2 and all(d.rewritten for d in decisions), [d.verdict for d in decisions]
    assert all(d.kernel.endswith("or the chain of ops where the positions fail their check") for d in decisions)
    ran = {event.name.removeprefix(runtime_mask.PATH_RECORD) for event in profile.events()}
    assert path in ran and not {"sdpa with the mask", "sdpa causal", "sdpa without a mask"} & ran
    ref_loss, ref_grads = every_position_loss_and_grads(model, input_ids=ids, position_ids=positions)
    assert_close_scaled(loss, ref_loss, "loss")
    for name in grads:
        assert_close_scaled(grads[name], ref_grads[name], name)
