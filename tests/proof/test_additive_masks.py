"""Additive float masks through ops that only copy or re-lay them out, and masks that add a bias.

A copy of a proven 0 / -inf mask (``contiguous``, ``clone``, ``detach``, a ``to`` to its own
dtype, in each spelling) holds the same values: it is rewritten as the mask itself, unless a
write reaches the mask or its copy. A mask that adds a bias (values other than 0 and the fill
from the model's parameters: a relative-position bias, a per-key gate) has no FA2 window: it
keeps SDPA, and the reason says so whichever op the reader meets first. Numerics in fp64 against
eager (tests/helpers/small_graphs.py); the families' models are transformers' own, tiny and random."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from compile_pass.proof import hidden_alike_below
from tests.helpers.models import Capture, token_batch
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 4
SEQ = 16
MIN = torch.finfo(torch.float64).min
BIAS = "kept: mask (additive) adds a bias"


def _band(q):
    positions = torch.arange(q.shape[2])
    q_idx, kv_idx = positions[:, None], positions[None, :]
    return (kv_idx > q_idx - W) & (kv_idx <= q_idx)


def _additive(q):
    return torch.where(_band(q), torch.zeros((), dtype=q.dtype), float("-inf"))


# -- copies of a proven mask ------------------------------------------------------------------

COPIES = {
    ".contiguous()": lambda m: m.contiguous(),
    ".clone()": lambda m: m.clone(),
    ".detach()": lambda m: m.detach(),
    "torch.clone": torch.clone,
    "torch.detach": torch.detach,
    "aten.clone": torch.ops.aten.clone.default,
    "aten.detach": torch.ops.aten.detach.default,
    "aten.alias": torch.ops.aten.alias.default,
    "aten._to_copy to its dtype": lambda m: torch.ops.aten._to_copy.default(m, dtype=m.dtype),
    ".clone(memory_format=...)": lambda m: m.clone(memory_format=torch.contiguous_format),
    "copies and a cast to its own dtype": lambda m: m.contiguous().to(m.dtype).clone(),
}


@pytest.mark.parametrize("copy", COPIES.values(), ids=COPIES.keys())
def test_a_copy_of_a_proven_additive_mask_is_read_as_the_mask(copy):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=copy(_additive(q)))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert [d.verdict for d in capture.report] == [f"rewritten: window ({W - 1}, 0) (additive mask)"]


def _write_copy(m):
    copied = m.clone()
    copied[:, 0] = 0.0  # every row now sees key 0: no band
    return copied


def _write_original_after_copy(m):
    copied = m.contiguous()  # the same tensor when m is contiguous: the write reaches the copy
    m[:, 0] = 0.0
    return copied


def _write_through_detached_alias(m):
    m.detach()[:, 0] = 0.0  # an alias of m's memory
    return m.clone()


def _cast_copy_written(m):
    copied = m.to(m.dtype, copy=True)
    copied[0].zero_()
    return copied


WRITES = {
    "copy written": _write_copy,
    "original written after contiguous": _write_original_after_copy,
    "written through detach": _write_through_detached_alias,
    "to(copy=True) written": _cast_copy_written,
}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_a_write_to_a_copied_mask_or_its_copy_keeps_sdpa(write):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=write(_additive(q)))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith("kept:") and "written" in decision, decision


def test_a_cast_to_another_dtype_is_not_a_copy():
    """bfloat16's minimum is a finite float64 above float64's: no fill after the cast, which is
    read as a cast (its fill checked), not as a copy."""

    def attend(q, k, v):
        mask = torch.where(
            _band(q), torch.zeros((), dtype=torch.bfloat16), torch.finfo(torch.bfloat16).min
        ).contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith("kept: mask (additive) cast"), decision


# -- masks that add a bias --------------------------------------------------------------------


class _Biased(nn.Module):
    """Attention whose additive mask carries a learned bias, built by ``make(self, q)``."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        gen = torch.Generator().manual_seed(1)
        self.table = nn.Parameter(torch.randn(2, 2 * SEQ, generator=gen, dtype=torch.float64))
        self.per_key = nn.Parameter(torch.randn(2, 1, dtype=torch.float64, generator=gen))

    def relative(self, q):
        """A relative-position bias per head: table[h, kv - q + S]."""
        positions = torch.arange(q.shape[2])
        return self.table[:, positions[None, :] - positions[:, None] + SEQ]

    def dynamic(self, v):
        """A bias per head and key from the values, as a learned gate computes it."""
        return torch.exp(self.per_key * F.softplus(v.sum(-1)))[:, :, None, :]

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.make(self, q, v))


BIASED = {
    # transformers' sdpa path with a position bias: where(mask, bias, min).contiguous()
    "where(band, bias, min).contiguous()": lambda m, q, v: torch.where(_band(q), m.relative(q), MIN)[None].contiguous(),
    "bias.masked_fill(~band, min)": lambda m, q, v: m.dynamic(v).masked_fill(~_band(q), MIN),
    # a head dimension merged as repeat_kv does: the reshape comes first
    "masked_fill, then repeat_kv's reshape": lambda m, q, v: (
        m.dynamic(v)[:, :1].masked_fill(~_band(q), MIN)[:, :, None].expand(-1, -1, 2, -1, -1).reshape(1, 2, SEQ, SEQ)
    ),
    "bias + additive mask": lambda m, q, v: m.relative(q) + _additive(q),
    "additive mask.contiguous() + bias": lambda m, q, v: _additive(q).contiguous() + m.relative(q),
    "bias added after a copy and a cast": lambda m, q, v: (_additive(q).clone() + m.dynamic(v)).to(q.dtype),
}


@pytest.mark.parametrize("make", BIASED.values(), ids=BIASED.keys())
def test_a_mask_that_adds_a_bias_is_kept_for_the_bias(make):
    model = _Biased(make)
    compiled, capture = compiled_with_capture(model)
    assert_same_as_eager(model, compiled, qkv(seq=SEQ))
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith(BIAS) and "no FA2 window carries it" in decision, decision


NOT_BIASED = {
    # 1 where visible: constant values, named as they are
    "where(band, 1, min)": (
        lambda q: torch.where(_band(q), torch.ones((), dtype=q.dtype), MIN),
        "kept: mask (additive) where with values other than 0",
    ),
    # 0 / -inf through an op the reader does not know, computed from the band alone
    "log of the band": (lambda q: _band(q).to(q.dtype).log(), "kept: mask (additive) float mask op .log()"),
    "(1 - band) * min": (
        lambda q: (1.0 - _band(q).to(q.dtype)) * MIN,
        "kept: mask (additive) product of a float tensor",
    ),
}


@pytest.mark.parametrize(("mask_of", "verdict"), NOT_BIASED.values(), ids=NOT_BIASED.keys())
def test_a_mask_of_constants_is_not_called_a_bias(mask_of, verdict):
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(q))

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith(verdict), decision


class _ChosenKeys(nn.Module):
    """A 0 / fill mask made by a factory on a parameter (``new_full``: its dtype and device,
    not its values) with 0 scattered at keys a learned score picks, as an indexer picks them
    (DeepSeek-V4's compressed keys): no value other than 0 and the fill, so no bias."""

    def __init__(self):
        super().__init__()
        self.score = nn.Parameter(torch.randn(SEQ, dtype=torch.float64, generator=torch.Generator().manual_seed(2)))

    def forward(self, q, k, v):
        chosen = self.score.topk(3).indices.expand(1, 1, SEQ, 3)
        mask = self.score.new_full((1, 1, SEQ, SEQ), MIN)
        mask.scatter_(-1, chosen, 0.0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_fill_made_from_a_parameters_dtype_is_not_called_a_bias():
    model = _ChosenKeys()
    compiled, capture = compiled_with_capture(model)
    assert_same_as_eager(model, compiled, qkv(seq=SEQ))
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith("kept: mask (additive)") and "bias" not in decision, decision


def test_a_float_mask_from_the_caller_is_not_called_a_bias():
    """The caller's float mask may well be 0 / fill: its values are unknown, not a bias."""

    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous() + _additive(q))

    mask = torch.zeros(SEQ, SEQ, dtype=torch.float64)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, mask), lambda *a: compiled(*a, mask))
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith("kept: mask (additive)") and "bias" not in decision, decision


# -- the families whose masks add one ---------------------------------------------------------

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def _doge(key_value_heads):
    """A per-key bias from the values (its dynamic mask), masked_fill'd by the sliding mask;
    with fewer key-value heads than heads, repeat_kv reshapes it first."""
    config = transformers.DogeConfig(**COMMON, num_key_value_heads=key_value_heads, sliding_window=8)
    return transformers.DogeForCausalLM, config


def _inkling():
    """A relative-position bias from the hidden states, which transformers' sdpa path puts
    into the mask (``where(mask, bias, min).contiguous()``); a sliding layer and a full one."""
    config = transformers.InklingTextConfig(
        **COMMON,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=8,
        d_rel=4,
        rel_extent=16,
        layer_types=["hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "dense"],
    )
    return transformers.InklingForCausalLM, config


@pytest.mark.parametrize(
    "family", [lambda: _doge(2), lambda: _doge(4), _inkling], ids=["doge-repeat-kv", "doge", "inkling"]
)
def test_families_whose_mask_adds_a_bias_keep_it_for_the_bias(family):
    model_class, config = family()
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="sdpa").eval()
    torch._dynamo.reset()
    capture = Capture()
    ids = token_batch(32)
    with torch.no_grad():
        logits = torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, use_cache=False).logits
        reference = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)
    verdicts = [d.verdict for d in capture.report]
    assert len(verdicts) == 2 and all(v.startswith(BIAS) for v in verdicts), verdicts


@pytest.mark.parametrize(
    ("fill", "dtypes"),
    [
        (torch.finfo(torch.float32).min, (torch.float32,)),
        (torch.finfo(torch.bfloat16).min, (torch.bfloat16, torch.float32)),
        (torch.finfo(torch.float64).min, (torch.float64,)),
    ],
    ids=["float32", "bfloat16 upcast", "float64"],
)
def test_the_bound_below_which_a_fill_hides_every_score_alike(fill, dtypes):
    """``hidden_alike_below``: every score up to the bound, added to the fill, rounds to the fill
    itself in each dtype (so a row of filled scores is uniform), and one four times as large
    (the fill's spacing) does not."""
    bound = hidden_alike_below(fill, dtypes)
    for dtype in dtypes:
        stored = torch.tensor(fill, dtype=dtype)
        for score in (bound, -bound, bound / 3):
            assert stored + torch.tensor(score, dtype=dtype) == stored
    spacing = torch.tensor(4 * bound, dtype=dtypes[-1])
    assert torch.tensor(fill, dtype=dtypes[-1]) + spacing != torch.tensor(fill, dtype=dtypes[-1])


def test_a_fill_that_is_not_finite_in_a_dtype_hides_nothing_alike():
    assert hidden_alike_below(float("-inf"), (torch.float32,)) is None
    assert hidden_alike_below(torch.finfo(torch.float32).min, (torch.float32, torch.bfloat16)) is None  # -inf there
    assert hidden_alike_below(torch.finfo(torch.float32).min, (torch.float32,)) == 2.0**102
