"""A buffer the graph creates and fills in place before anything reads it (an encoder-decoder's
decoder ids shifted right: ``new_zeros``, ``shifted[..., 1:] = ids[..., :-1]``, the start
token, ``masked_fill_`` of -100) is read by the proof as data, the values its writes left
(``proof/aliasing.py``, ``WriteAnalysis.filled_before_read``), never as the factory's zeros: a
key padding computed from it, or the buffer itself, reaches the op. Every near miss keeps
today's "written in place" refusal: a write after the mask read it (the op would read the buffer
later than the mask did), an alias that leaves the graph, a read before the last write that
feeds more than the writes. Each against eager, forward and gradients, every position."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

W = 4


def _band(q):
    positions = torch.arange(q.shape[2])
    return (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - W)


def _shifted(ids):
    """transformers' ``_shift_right``: the start token 1, -100 made padding (0)."""
    shifted = ids.new_zeros(ids.shape)
    shifted[..., 1:] = ids[..., :-1].clone()
    shifted[..., 0] = 1
    shifted.masked_fill_(shifted == -100, 0)
    return shifted


def _attend(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_band(q) & keep[:, None, None, :])


def shifted_ids(q, k, v, ids):
    return _attend(q, k, v, _shifted(ids) != 0)


def filled_by_copy(q, k, v, ids):
    """Filled through a view of it (``copy_`` into a slice), then read."""
    buffer = torch.zeros_like(ids)
    buffer[:, 2:].copy_(ids[:, :-2])
    buffer[:, :2] = 7
    return _attend(q, k, v, buffer != 0)


def kept_flags(q, k, v, ids):
    """A bool buffer filled by index and read as the padding itself: the op reads this very
    tensor, later than the mask did."""
    keep = torch.ones(ids.shape, dtype=torch.bool)
    keep[ids == 0] = False
    return _attend(q, k, v, keep)


def written_between_mask_and_attention(q, k, v, ids):
    """The mask reads the buffer, a write follows, then the attention: the op, reading the
    buffer where SDPA was, would see the write the mask did not."""
    keep = torch.ones(ids.shape, dtype=torch.bool)
    keep[ids == 0] = False
    mask = _band(q) & keep[:, None, None, :]
    keep[:, 3] = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def escapes(q, k, v, ids):
    keep = torch.ones(ids.shape, dtype=torch.bool)
    keep[ids == 0] = False
    return _attend(q, k, v, keep), keep


def read_feeds_more_than_the_writes(q, k, v, ids):
    keep = torch.ones(ids.shape, dtype=torch.bool)
    keep[:, 0] = False
    first = keep.sum()  # a read before the last write, used elsewhere
    keep[ids == 0] = False
    return _attend(q, k, v, keep) * first


def _ids():
    ids = torch.tensor([[5, 6, -100, 7, 8, 9, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0], [0] * 16])
    ids[1, :11] = torch.arange(2, 13)
    return ids


@pytest.mark.parametrize(
    ("fn", "padding_from"),
    [(shifted_ids, "shifted"), (filled_by_copy, "buffer"), (kept_flags, "keep")],
    ids=["shifted right", "filled through a view", "bool flags read as they are"],
)
def test_a_buffer_filled_before_it_is_read_is_data(fn, padding_from):
    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=16, batch=2), _ids())
    (decision,) = capture.report
    assert decision.verdict == f"rewritten: window (3, 0), key padding from {padding_from}", decision.verdict


@pytest.mark.parametrize(
    "fn", [written_between_mask_and_attention, escapes, read_feeds_more_than_the_writes], ids=lambda fn: fn.__name__
)
def test_near_misses_keep_the_written_in_place_refusal(fn):
    compiled, capture = compiled_with_capture(fn)
    q, k, v = qkv(seq=16, batch=2)
    out = compiled(q, k, v, _ids())
    ref = fn(q, k, v, _ids())
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    (decision,) = capture.report
    assert decision.verdict.startswith("kept: mask") and "is written in place by" in decision.verdict, decision.verdict
