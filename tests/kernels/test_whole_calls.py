"""Short calls as one fused call over all keys (``whole_calls.whole_call``), against the fp64 reference.

Where every key lies in every row's window, or the band skips too few keys for chunks to pay,
the chunked kernel runs the call as SDPA does: one call of aten's fused CPU kernel for the
whole batch, with its own causal masking where the band is exactly causal, else with one
additive mask. Each case asserts which form it takes, so that a change of the crossover cannot
quietly send it back to chunks, then checks out, dq, dk and dv in fp64 (1e-10).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from compile_pass import sliding_window_attention
from compile_pass.kernels.chunked import whole_calls
from compile_pass.kernels.contract import AttentionCall
from compile_pass.ops.window_attention import sliding_window_attention_forward
from tests.helpers.attention_reference import forward_and_grads, random_qkv, reference_attention
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 16  # a causal window of W keys: (W - 1, 0)


def _masks(batch, seq, form):
    """The batch masks of a form: key padding with a fully padded row, packed segments, images."""
    if form == "padded":
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[0, :3] = False  # left padding
        padding[1, seq - 5 :] = False  # right padding: rows past the run see the run's last keys
        padding[-1] = False  # a row with no key at all: zeros, no gradient
        return {"key_padding": padding}
    if form == "hole":  # a run of padding wider than the window: the rows after it see no key
        padding = torch.ones(batch, seq, dtype=torch.bool)
        padding[:, 5 : 5 + W + 4] = False
        padding[-1, -3:] = False
        return {"key_padding": padding}
    if form == "packed":
        ids = torch.zeros(batch, seq, dtype=torch.int64)
        ids[:, seq // 3 :] = 1
        ids[:, 2 * seq // 3 :] = 7
        return {"segment_ids": ids}
    if form == "packed, padded":
        return {**_masks(batch, seq, "packed"), **_masks(batch, seq, "padded")}
    if form == "images":
        ids = torch.full((batch, seq), -1)
        ids[:, 2:7] = 0
        ids[0, seq - 6 : seq - 1] = 1
        return {"block_ids": ids}
    return {}


# (name, seq_q, seq_k, window, form, the whole call's form: "causal" (the kernel's own causal
# masking), "causal mask" (that and a mask), "unmasked" or "mask")
CASES = [
    ("shorter than the window", 12, 12, (W - 1, 0), "", "causal"),
    ("exactly the window", W, W, (W - 1, 0), "", "causal"),
    ("unbounded causal", 40, 40, (-1, 0), "", "causal"),
    ("a band a little longer than the window", 2 * W, 2 * W, (W - 1, 0), "", "causal mask"),
    ("a two-sided band", 24, 24, (5, 3), "", "mask"),
    ("padded, a row without keys", 12, 12, (W - 1, 0), "padded", "causal mask"),
    ("padded, a hole wider than the window", 40, 40, (W - 1, 0), "hole", "causal mask"),
    ("padded, a two-sided band", 30, 30, (4, 2), "hole", "mask"),
    ("packed", 12, 12, (W - 1, 0), "packed", "causal mask"),
    ("packed, a band", 40, 40, (W - 1, 0), "packed", "causal mask"),
    ("packed and padded", 12, 12, (W - 1, 0), "packed, padded", "causal mask"),
    ("image blocks", 20, 20, (W - 1, 0), "images", "mask"),
    ("a prefill after a cache", 5, 12, (W - 1, 0), "", "mask"),
    ("more queries than keys", 12, 7, (W - 1, 0), "", "mask"),
    ("decoding one query", 1, 12, (W - 1, 0), "", "unmasked"),
    ("decoding, padded", 1, 12, (W - 1, 0), "padded", "mask"),
    ("a prefill after a cache, padded", 5, 40, (W - 1, 0), "hole", "mask"),
]


def _form(whole):
    if whole is None:
        return "chunks"
    if whole.mask is None:
        return "causal" if whole.causal else "unmasked"
    return "causal mask" if whole.causal else "mask"


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("name, seq_q, seq_k, window, form, expect", CASES, ids=[case[0] for case in CASES])
def test_short_calls_run_whole_and_match_fp64(name, seq_q, seq_k, window, form, expect, group):
    batch = 3
    q, k, v = random_qkv(batch, 2 * group, 2, seq_q, seq_k, 8, torch.float64)
    masks = _masks(batch, seq_k, form)
    left, right = window
    assert _form(whole_calls.whole_call(AttentionCall(q, k, v, left, right, 0.3, **masks))) == expect
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_grads = forward_and_grads(
        lambda *a: reference_attention(*a, left, right, 0.3, **masks), ref_inputs, grad_out
    )
    op = lambda *a: sliding_window_attention(*a, window=window, causal=False, scale=0.3, **masks)  # noqa: E731
    out, grads = forward_and_grads(op, (q, k, v), grad_out)
    for label, ours, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert (ours - ref).abs().max().item() < 1e-10, label
    assert out.transpose(1, 2).is_contiguous()  # heads-last, as the fake says


def test_past_the_crossover_the_band_runs_in_chunks():
    q, k, v = random_qkv(1, 2, 2, 512, 512, 8, torch.float64)
    for window, causal in (((W - 1, 0), True), ((W - 1, 3), False)):
        most = whole_calls.most_whole_keys(*window, 1, causal)
        assert most < 512
        shorter = AttentionCall(q[:, :, :most], k[:, :, :most], v[:, :, :most], *window, 0.3)
        assert _form(whole_calls.whole_call(shorter)) == ("causal mask" if causal else "mask")
        longer = AttentionCall(q[:, :, : most + 1], k[:, :, : most + 1], v[:, :, : most + 1], *window, 0.3)
        assert whole_calls.whole_call(longer) is None


def test_padding_inside_the_window_is_one_row_of_key_masks():
    """Where the window holds every key, a padded call's mask is the padding alone, (B, 1, 1, Sk),
    broadcast by the kernel: no (Sq, Sk) mask is built or read."""
    q, k, v = random_qkv(3, 4, 2, 12, 12, 8, torch.float32)
    masks = _masks(3, 12, "padded")
    whole = whole_calls.whole_call(AttentionCall(q, k, v, W - 1, 0, 0.3, **masks))
    assert whole.causal and whole.mask.shape == (3, 1, 1, 12)


def test_every_layer_and_both_directions_share_one_band_mask():
    """The band's additive mask depends on the lengths and the window only: the calls of one
    step (each layer, forward and backward) read one tensor instead of building it each time."""
    q, k, v = random_qkv(2, 4, 2, 40, 40, 8, torch.float32)
    first, again = (whole_calls.whole_call(AttentionCall(q, k, v, W - 1, 0, 0.3)) for _ in range(2))
    assert first.mask.shape == (40, 40) and again.mask is first.mask
    other_window = whole_calls.whole_call(AttentionCall(q, k, v, W - 2, 0, 0.3))
    assert other_window.mask is not first.mask


def _flash_calls(fn) -> dict[str, int]:
    with profile() as trace:
        fn()
    names = [event.name for event in trace.events()]
    return {
        direction: names.count(f"aten::_scaled_dot_product_flash_attention_for_cpu{direction}")
        for direction in ("", "_backward")
    }


def test_a_padded_batch_is_one_kernel_call_each_way():
    batch, seq = 4, 12
    q, k, v = random_qkv(batch, 4, 2, seq, seq, 8, torch.float32)
    padding = _masks(batch, seq, "padded")["key_padding"]
    out = None

    def forward():
        nonlocal out
        out = sliding_window_attention(q, k, v, window=(W - 1, 0), key_padding=padding)

    assert _flash_calls(forward) == {"": 1, "_backward": 0}
    assert _flash_calls(lambda: out.sum().backward()) == {"": 0, "_backward": 1}


@pytest.mark.parametrize("form", ["", "padded"])
def test_bf16_is_sdpa_with_the_mask(form):
    """In bf16 the whole call is SDPA's own call with the same mask: the same result as the
    program's SDPA with K/V repeated, to bf16's rounding of a few sums."""
    batch, seq = 3, 12
    q, k, v = random_qkv(batch, 4, 2, seq, seq, 64, torch.bfloat16)
    masks = _masks(batch, seq, form)
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None]
    if masks:
        visible = visible & masks["key_padding"][:, None, None, :]
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible)
    ours = sliding_window_attention(q, k, v, window=(W - 1, 0), **masks)
    has_keys = visible.any(-1, keepdim=True)
    torch.testing.assert_close(ours * has_keys, sdpa * has_keys, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("heads_last", [True, False])
@pytest.mark.parametrize("form", ["", "padded"])
def test_opcheck_on_whole_calls(heads_last, form):
    q, k, v = random_qkv(3, 4, 2, 12, 12, 8, torch.float32, heads_last=heads_last)
    padding = _masks(3, 12, form).get("key_padding")
    torch.library.opcheck(sliding_window_attention_forward, (q, k, v, W - 1, 0, 0.3, padding))


@pytest.mark.parametrize("causal", [True, False])
def test_aten_kernel_returns_zeros_and_no_gradient_for_rows_whose_keys_are_all_masked(causal):
    """The whole call's forward keeps the kernel's output for rows without keys as it is: this
    holds the kernel to zeros there (and no gradient through them), in every torch CI runs."""
    q, k, v = random_qkv(2, 4, 2, 12, 12, 8, torch.float32)
    visible = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    visible[0, :, :4] = False  # rows without keys
    visible[1, :, :, :3] = False  # rows 0..2 see only masked keys
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=0.3
    )
    assert torch.all(out[0, :, :4] == 0) and torch.all(out[1, :, :3] == 0)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        torch.ones_like(out), q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=0.3
    )
    assert torch.all(grads[0][0, :, :4] == 0) and torch.all(grads[0][1, :, :3] == 0)
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_rows_without_keys_have_logsumexp_inf():
    """As FA2 returns them, and as the context-parallel merge and the backward read them."""
    q, k, v = random_qkv(3, 4, 2, 12, 12, 8, torch.float64)
    padding = _masks(3, 12, "padded")["key_padding"]
    out, logsumexp = sliding_window_attention_forward(q, k, v, W - 1, 0, 0.3, padding)
    assert logsumexp.is_contiguous() and logsumexp.dtype == torch.float64
    without_keys = ~(torch.ones(12, 12, dtype=torch.bool).tril() & padding[:, None, :]).any(-1)  # (B, Sq)
    assert without_keys[0, :3].all() and without_keys[2].all() and not without_keys[1].any()
    assert torch.equal(torch.isinf(logsumexp), without_keys[:, None, :].expand(3, 4, 12))
    assert torch.all(logsumexp[2] == float("inf")) and torch.all(out[2] == 0)


# -- at graph time: a static length inside the window is plain causal attention ------------


def _sliding(q, k, v):
    positions = torch.arange(q.shape[2])
    distance = positions[None, :] - positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(distance <= 0) & (distance > -W))


def test_a_static_length_inside_the_window_runs_sdpa_causal_and_a_longer_one_the_op():
    """Compiled for one length of at most W, the band is SDPA's ``is_causal``: the causal rule
    rewrites it (no mask, no op). The next lengths compile once with a symbolic length: the
    op, which runs short calls whole at run time (no recompile)."""
    compiled, capture = compiled_with_capture(_sliding)
    for length in (W, 12, 3 * W, 9):
        assert_same_as_eager(_sliding, compiled, qkv(length))
    verdicts = [(d.rule, d.verdict) for report in capture.reports for d in report]
    assert verdicts == [
        ("causal_mask", "rewritten: plain causal mask -> is_causal=True"),
        ("sliding_window", f"rewritten: window ({W - 1}, 0)"),
    ]
    assert len(capture.graphs) == 2


def test_window_mask_is_the_band_over_every_position():
    from compile_pass.window import band_mask, window_mask

    for seq_q, seq_k in ((1, 9), (5, 9), (9, 9), (9, 5), (0, 4)):
        for left in (-1, 0, 2, 20):
            for right in (-1, 0, 3):
                expected = band_mask(torch.arange(seq_q), torch.arange(seq_k), left, right, seq_k - seq_q)
                assert torch.equal(window_mask(seq_q, seq_k, left, right, torch.device("cpu")), expected), (
                    seq_q,
                    seq_k,
                    left,
                    right,
                )
