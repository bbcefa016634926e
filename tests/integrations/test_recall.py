"""Bands real code writes in other spellings: each form is rewritten and matches eager in fp64
(forward and the gradients of q, k, v), and a near miss of it stays kept or gets the
window it really has."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import masking_utils

from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 4
MIN = torch.finfo(torch.float64).min


def _positions(q):
    positions = torch.arange(q.shape[2])
    return positions[:, None], positions[None, :]


def _band(q):
    q_idx, kv_idx = _positions(q)
    return (kv_idx > q_idx - W) & (kv_idx <= q_idx)


def _attend(mask_of):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(q))


def _ones(q):
    return torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)


SPELLINGS = {
    # logic in torch.* and method spellings
    "torch.logical_and": (
        lambda q: torch.logical_and(_positions(q)[1] > _positions(q)[0] - W, _positions(q)[1] <= _positions(q)[0]),
        "window (3, 0)",
    ),
    "logical_not(kv > q)": (
        lambda q: torch.logical_and(
            _positions(q)[1] > _positions(q)[0] - W, torch.logical_not(_positions(q)[1] > _positions(q)[0])
        ),
        "window (3, 0)",
    ),
    ".logical_and()": (
        lambda q: (_positions(q)[1] > _positions(q)[0] - W).logical_and(_positions(q)[1] <= _positions(q)[0]),
        "window (3, 0)",
    ),
    "torch.gt/torch.le": (
        lambda q: torch.gt(_positions(q)[1], _positions(q)[0] - W) & torch.le(_positions(q)[1], _positions(q)[0]),
        "window (3, 0)",
    ),
    "logical_xor of disjoint halves": (
        lambda q: torch.logical_xor((_positions(q)[1] - _positions(q)[0]).abs() <= 2, torch.zeros_like(_ones(q))),
        "window (2, 2)",
    ),
    # triangles of ones, as hand-written and older model code builds them
    "ones.tril() & ones.triu(-3)": (lambda q: _ones(q).tril() & _ones(q).triu(-(W - 1)), "window (3, 0)"),
    "torch.tril(ones, 1) & torch.triu(ones, -2)": (
        lambda q: torch.tril(_ones(q), 1) & torch.triu(_ones(q), -2),
        "window (2, 1)",
    ),
    # value-preserving pass-throughs
    "view/reshape/contiguous/clone/.bool()": (
        lambda q: (
            _band(q).view(1, 1, q.shape[2], q.shape[2]).reshape(q.shape[2], q.shape[2]).contiguous().clone().bool()
        ),
        "window (3, 0)",
    ),
    ".t() of the mirrored band": (
        lambda q: ((_positions(q)[0] > _positions(q)[1] - W) & (_positions(q)[0] <= _positions(q)[1])).t(),
        "window (3, 0)",
    ),
    "transpose/permute": (lambda q: _band(q)[None].transpose(1, 2).permute(0, 2, 1)[0], "window (3, 0)"),
    "where(band, True, False)": (lambda q: torch.where(_band(q), True, False), "window (3, 0)"),
    # additive float masks of the band
    "where(band, 0, -inf)": (
        lambda q: torch.where(_band(q), torch.zeros((), dtype=torch.float64), float("-inf")),
        "window (3, 0) (additive mask)",
    ),
    "(~band).to(dtype) * min": (lambda q: (~_band(q)).to(q.dtype) * MIN, "window (3, 0) (additive mask)"),
    "zeros.masked_fill(~band, min)": (
        lambda q: torch.zeros(q.shape[2], q.shape[2], dtype=q.dtype).masked_fill(~_band(q), MIN),
        "window (3, 0) (additive mask)",
    ),
}


@pytest.mark.parametrize(("mask_of", "window"), SPELLINGS.values(), ids=SPELLINGS.keys())
def test_spellings_of_a_band_are_rewritten(mask_of, window):
    attend = _attend(mask_of)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    assert [d.verdict for d in capture.report] == [f"rewritten: {window}"]


NEAR_MISSES = {
    "ones.tril(-1): no diagonal": (
        lambda q: _ones(q).tril(-1) | (_positions(q)[0] == 0),  # row 0 keeps a key
        "kept: mask term",
    ),
    "transpose of the band: anti-causal": (lambda q: _band(q).t(), "rewritten: window (0, 3)"),
    "where(band, False, True)": (lambda q: torch.where(_band(q), False, True), "kept: mask"),
    "float mask with -1e9": (
        lambda q: (~_band(q)).to(q.dtype) * -1e9,
        "kept: mask (additive) product with a factor other than a finite fill",
    ),
    "float mask with the fp32 minimum on fp64": (
        lambda q: torch.zeros(q.shape[2], q.shape[2], dtype=q.dtype).masked_fill(
            ~_band(q), torch.finfo(torch.float32).min
        ),
        "kept: mask (additive) masked_fill with",
    ),
    "float mask of 1 where visible": (
        lambda q: torch.where(_band(q), torch.ones((), dtype=q.dtype), MIN),
        "kept: mask (additive) where with values other than 0",
    ),
    "reshape that reorders": (lambda q: _band(q).reshape(-1).reshape(q.shape[2], q.shape[2]).flip(0), "kept: mask"),
}


@pytest.mark.parametrize(("mask_of", "verdict"), NEAR_MISSES.values(), ids=NEAR_MISSES.keys())
def test_near_misses(mask_of, verdict):
    attend = _attend(mask_of)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = [d.verdict for d in capture.report]
    assert decision.startswith(verdict), decision


def _padded_additive(q, k, v, padding):
    mask = _band(q) & (padding[:, None, None, :] != 0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(~mask).to(q.dtype) * MIN)


def test_additive_mask_with_padding_is_kept():
    """Left padding leaves rows with no visible key: SDPA averages them under a finite fill,
    but the gradient of that average differs between SDPA's backends (the math backend's is the
    softmax's at p = 1/Sk, which the op's keyless_mean mode computes; the CPU kernel's is not),
    so no one result stands to be matched: the call is kept. Chains of ops are rewritten
    (tests/rules/test_keyless_chains.py)."""
    compiled, capture = compiled_with_capture(_padded_additive)
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, :5] = 0
    assert_same_as_eager(lambda *a: _padded_additive(*a, padding), lambda *a: compiled(*a, padding), qkv(batch=2))
    (decision,) = [d.verdict for d in capture.report]
    assert "whose gradient differs between its backends" in decision, decision
    q, k, v = qkv(batch=2)
    grads = []
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            grads.append(torch.autograd.grad(_padded_additive(q, k, v, padding).sum(), v)[0])
    assert not torch.allclose(*grads)  # the fact the decision rests on


# -- one query row: decoding ---------------------------------------------------------------


def _decode_step(window):
    """transformers' decode mask: the query at absolute position Sk - 1 over keys 0..Sk-1."""

    def attend(q, k, v):
        past = k.shape[2] - 1
        q_idx = torch.arange(1) + past
        kv_idx = torch.arange(k.shape[2])
        mask = (kv_idx[None, :] > q_idx[:, None] - window) & (kv_idx[None, :] <= q_idx[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


@pytest.mark.parametrize(
    ("window", "verdict"),
    [(W, "sliding_window rewritten: window (3, 0)"), (64, "causal_mask rewritten: mask shows every key -> no mask")],
    ids=["window-shorter-than-cache", "window-covers-the-cache"],
)
def test_single_query_decode_step(window, verdict):
    attend = _decode_step(window)
    compiled, capture = compiled_with_capture(attend)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    assert_same_as_eager(attend, compiled, (q, k, v))
    assert [f"{d.rule} {d.verdict}" for d in capture.report] == [verdict]


# -- transformers' vmap path ------------------------------------------------------------------


def _vmap_mask(mask_function):
    """transformers' sdpa_mask with use_vmap=True: what it runs when a model passes an
    and_mask_function or or_mask_function."""

    def attend(q, k, v):
        mask = masking_utils.sdpa_mask(
            batch_size=q.shape[0],
            q_length=q.shape[2],
            kv_length=k.shape[2],
            mask_function=mask_function(),
            allow_is_causal_skip=False,
            use_vmap=True,
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def _sliding():
    return masking_utils.sliding_window_causal_mask_function(W)


def _sliding_and_extra():
    return masking_utils.and_masks(
        masking_utils.sliding_window_causal_mask_function(W), lambda b, h, q_idx, kv_idx: q_idx >= 0
    )


def _chunked():
    return masking_utils.chunked_causal_mask_function(W, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize(
    ("mask_function", "verdict"),
    [
        (_sliding, "sliding_window rewritten: window (3, 0)"),
        (_sliding_and_extra, "sliding_window rewritten: window (3, 0)"),
        # Under vmap the chunk ids exist only inside the vmapped function, one scalar per
        # element: no tensor of the graph holds them for the op.
        (
            _chunked,
            "sliding_window kept: mask is window (3, 0), chunks of 4: ids (kv//4), but no tensor of the graph holds "
            "those ids",
        ),
    ],
    ids=["sliding", "sliding-and-an-extra-mask-function", "chunked-ids-only-under-vmap"],
)
def test_masks_built_under_vmap(mask_function, verdict):
    attend = _vmap_mask(mask_function)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(attend, compiled)
    (decision,) = [f"{d.rule} {d.verdict}" for d in capture.report]
    assert decision.startswith(verdict), decision


def test_dynamic_true_specializes_head_dim_and_rewrites():
    """With dynamic=True every size is symbolic, head_dim too: the rule reads it as the model
    constant it is (a guard), and one compile serves every sequence length."""
    from tests.helpers.models import Capture

    torch._dynamo.reset()
    capture = Capture()
    attend = _attend(_band)
    compiled = torch.compile(attend, backend=capture, dynamic=True)
    for length in (16, 11, 23):
        assert_same_as_eager(attend, compiled, qkv(length))
    assert [d.verdict for report in capture.reports for d in report] == ["rewritten: window (3, 0)"]


def test_multimodal_band_or_image_block_is_rewritten():
    """Gemma-4 with images: the sliding layers' mask is window AND (causal OR same image block),
    built by transformers' own functions; the op takes the block ids (tests/integrations/test_images.py)."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = Gemma4TextConfig(sliding_window=W)
    config._attn_implementation = "sdpa"

    def attend(q, k, v, mm_token_type_ids):
        embeds = q.new_zeros(q.shape[0], q.shape[2], 8)
        position_ids = torch.arange(q.shape[2])[None]
        blocks = get_block_sequence_ids_for_mask(mm_token_type_ids, q.device)
        masks = create_masks_for_vision_model(config, embeds, None, None, position_ids, blocks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks["sliding_attention"])

    image_tokens = torch.zeros(1, 16, dtype=torch.long)
    image_tokens[0, 3:9] = 1
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, image_tokens), lambda *a: compiled(*a, image_tokens))
    assert [d.verdict for d in capture.report] == [
        f"rewritten: window ({W - 1}, 0), image blocks from block_sequence_ids"
    ]
