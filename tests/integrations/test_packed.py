"""Packed sequences: ``position_ids`` that restart at each sequence and no attention mask, as
TRL's ``packing=True`` / ``padding_free=True`` and transformers' ``DataCollatorWithFlattening``
pass them. transformers masks attention to each sequence with ids computed from the
positions, and the sliding window over position values; the rule proves that window over
token indices inside a segment, for positions in a range the op checks at run time, and
takes SDPA with the mask itself wherever the check fails."""

import pytest
import torch

from tests.helpers.models import (
    Capture,
    assert_close_scaled,
    assert_training_matches,
    loss_and_grads,
    packed_window_function,
    tiny_gemma4,
    token_batch,
)
from tests.helpers.small_graphs import mask_input_paths

LENGTH = 32
PACKED = "rewritten: window (7, 0), packed sequences from position_ids (positions checked at run time)"
# The global layer: block-diagonal causal attention (the document kernel, one call per document).
PACKED_FULL = "rewritten: window (-1, 0), packed sequences from position_ids (positions checked at run time)"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _positions(lengths, batch=1, start=0):
    row = torch.cat([torch.arange(length) for length in lengths]) + start
    return row.repeat(batch, 1)


def _train(positions, batch, against_fp64=True):
    """Loss and every gradient against eager (and eager fp64, where fp32 holds the positions
    exactly: rotary embeddings of positions near 2**40 differ between the two)."""
    model = tiny_gemma4()
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    inputs = dict(input_ids=token_batch(positions.shape[1], batch=batch), position_ids=positions, use_cache=False)
    inputs["labels"] = inputs["input_ids"]
    with mask_input_paths() as paths:
        if against_fp64:
            assert_training_matches(model, compiled, **inputs)
        else:
            (loss, grads), (eager_loss, eager_grads) = (
                loss_and_grads(compiled, **inputs),
                loss_and_grads(model, **inputs),
            )
            assert_close_scaled(loss, eager_loss, "loss vs eager")
            for name in grads:
                assert_close_scaled(grads[name], eager_grads[name], name)
    verdicts = [d.verdict for report in capture.reports for d in report if d.kind == "attention call"]
    return verdicts, paths


@pytest.mark.parametrize(
    ("lengths", "batch"),
    [((12, 20), 1), ((3, 5, 9, 15), 1), ((12, 20), 2), ((LENGTH,), 1)],
    ids=["two-sequences", "four-sequences-some-shorter-than-the-window", "batch-2", "one-sequence"],
)
def test_packed_batches_train_as_eager(lengths, batch):
    verdicts, paths = _train(_positions(lengths, batch), batch)
    assert verdicts[:3] == [PACKED] * 2 + [PACKED_FULL], verdicts  # the sliding layers, the global one
    assert paths == {"band": 3}


def test_one_row_of_positions_for_a_larger_batch():
    """``position_ids`` of shape (1, S) with a batch of 2, which transformers expands over the
    batch: every row's packed ids come from the one row of positions."""
    verdicts, paths = _train(_positions((12, 20), batch=1), batch=2)
    assert verdicts[:3] == [PACKED] * 2 + [PACKED_FULL], verdicts
    assert paths == {"band": 3}


@pytest.mark.parametrize(
    ("start", "against_fp64"),
    [(-3, True), (2**40, False), (2**63 - 20, False)],
    ids=["negative", "beyond-the-checked-range", "near-the-int64-limit"],
)
def test_positions_outside_the_checked_range_take_sdpa_with_the_mask(start, against_fp64):
    """The band over indices equals the mask only for positions the proof could bound; the
    op checks them and otherwise runs SDPA with the mask transformers built, exactly."""
    verdicts, paths = _train(_positions((12, 20), start=start), 1, against_fp64)
    assert verdicts[:3] == [PACKED] * 2 + [PACKED_FULL], verdicts
    assert paths == {"sdpa with the mask": 3}


def _packed_and_padded(q, k, v, positions, padding):
    """transformers' own mask functions: the sliding window over packed positions, AND key padding."""
    from transformers import masking_utils as mu

    batch, length = q.shape[0], q.shape[2]
    function = packed_window_function(8, positions)
    mask = mu.sdpa_mask(
        batch_size=batch,
        q_length=length,
        kv_length=length,
        q_offset=0,
        mask_function=function,
        attention_mask=padding,
        allow_is_causal_skip=False,
        use_vmap=False,
    )
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_packed_sequences_with_key_padding_keep_the_padding():
    """The band, the packed sequences and the padding: all three reach the op (a rewrite that
    dropped the padding was found by the fuzzer, seed 60085)."""
    from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

    positions = _positions((5, 11), batch=2)
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[0, 13:] = False
    padding[1, :2] = False
    compiled, capture = compiled_with_capture(_packed_and_padded)
    with mask_input_paths() as paths:
        assert_same_as_eager(_packed_and_padded, compiled, qkv(batch=2), positions, padding)
    (decision,) = capture.report
    assert decision.verdict == (
        "rewritten: window (7, 0), key padding from padding, packed sequences from positions (positions checked at "
        "run time)"
    )
    assert paths == {"band": 1}


# -- found by the adversarial review (each fails on the code before its fix) -------------------


def _ids(positions):
    return (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)


def _ids_of_each_row_window_on_row_0(q, k, v, positions):
    """Equal ids at row b say that row b's positions are consecutive, nothing of row 0's."""
    ids = _ids(positions)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    row0 = positions[0]
    window = (row0[None, :] <= row0[:, None]) & (row0[None, :] > row0[:, None] - 2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=same & window[None, None])


def _ids_from_a_cast_that_rounds(q, k, v, positions):
    """bfloat16 holds 255 and rounds 257 to 256: the float differences see one segment where
    the integer positions jump by 2."""
    rounded = positions.to(torch.bfloat16)
    ids = (torch.diff(rounded, prepend=rounded[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    same = ids[:, None, :, None] == ids[:, None, None, :]
    q_pos, kv_pos = positions[:, None, :, None], positions[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=same & (kv_pos <= q_pos) & (kv_pos > q_pos - 2)
    )


@pytest.mark.parametrize(
    ("fn", "positions"),
    [
        (
            _ids_of_each_row_window_on_row_0,
            torch.stack([torch.tensor([0, 1, 2, 3, 100, 101, 102, 103]), torch.arange(8)]),
        ),
        (_ids_from_a_cast_that_rounds, torch.tensor([[250, 251, 252, 253, 254, 255, 257, 258]] * 2)),
    ],
    ids=["ids-of-row-b-window-on-row-0", "ids-from-a-rounding-cast"],
)
def test_packed_forms_the_lemma_does_not_cover_are_kept(fn, positions):
    from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

    compiled, capture = compiled_with_capture(fn)
    assert_same_as_eager(fn, compiled, qkv(seq=8, batch=2), positions)
    (decision,) = capture.report
    assert not decision.rewritten, decision.verdict


def _three_layers(q, k, v, first, second):
    def layer(x, positions):
        ids = _ids(positions)
        same = ids[:, None, :, None] == ids[:, None, None, :]
        q_pos, kv_pos = positions[:, None, :, None], positions[:, None, None, :]
        mask = same & (kv_pos <= q_pos) & (kv_pos > q_pos - 3)
        return torch.nn.functional.scaled_dot_product_attention(x, k, v, attn_mask=mask)

    return layer(layer(layer(q, first), second), first)


def test_calls_on_two_position_inputs_each_check_their_own():
    """Positions P1, P2, then P1 again in one graph: each call's band assumes (and checks) the
    one input its mask reads; the third call once failed with an internal error."""
    from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, qkv

    first = torch.cat([torch.arange(5), torch.arange(7)])[None].repeat(2, 1)
    second = torch.cat([torch.arange(8), torch.arange(4)])[None].repeat(2, 1)
    compiled, capture = compiled_with_capture(_three_layers)
    with mask_input_paths() as paths:
        assert_same_as_eager(_three_layers, compiled, qkv(seq=12, batch=2), first, second)
    assert [d.verdict for d in capture.report] == [
        f"rewritten: window (2, 0), packed sequences from {name} (positions checked at run time)"
        for name in ("first", "second", "first")
    ]
    assert paths == {"band": 3}
