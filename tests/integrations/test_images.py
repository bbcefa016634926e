"""Images: Gemma-4's sliding layers attend through the window OR bidirectionally inside each
image's block of tokens (``kv > q - w`` AND (``kv <= q`` OR same image)). The proof reads that
form with the block ids as data the op is given; the op computes it exactly for any ids
(contiguous or not, padded or not), checked here against an fp64 reference and against the
model in eager mode."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

from compile_pass.kernels import policy
from compile_pass.kernels.policy import facts_of
from compile_pass.ops.window_attention import sliding_window_attention
from tests.helpers.attention_reference import random_qkv, reference_attention
from tests.helpers.models import Capture, assert_training_matches, loss_and_grads, token_batch
from tests.helpers.small_graphs import assert_same_as_eager, compiled_with_capture, pretend_gpu, tune_chunks

IMAGE_TOKEN = 120
TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=8,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=128,
    max_position_embeddings=256,
    use_bidirectional_attention="vision",
    layer_types=["sliding_attention"] * 2 + ["full_attention"],
)
SLIDING = "rewritten: window (7, 0), image blocks from block_sequence_ids"
PADDED = "rewritten: window (7, 0), key padding from attention_mask, image blocks from block_sequence_ids"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _random_blocks(batch, seq, generator, contiguous):
    """Ids of a few images per row: one id per run of tokens, or ids repeated across runs."""
    ids = torch.full((batch, seq), -1)
    for b in range(batch):
        for image in range(3):
            start = int(torch.randint(0, seq, (), generator=generator))
            stop = min(seq, start + int(torch.randint(1, 12, (), generator=generator)))
            ids[b, start:stop] = image if contiguous else int(torch.randint(0, 2, (), generator=generator))
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("trial", range(8))
def test_the_op_computes_image_blocks_exactly(trial, dtype, monkeypatch):
    generator = torch.Generator().manual_seed(trial)
    seq = int(torch.randint(6, 48, (), generator=generator))
    left = int(torch.randint(0, 9, (), generator=generator))
    right = (0, 0, 2, -1)[trial % 4]
    kv_heads = (1, 2, 4)[trial % 3]
    # Many chunk edges at these lengths; a small call budget cuts an image's rows into calls.
    tune_chunks(monkeypatch, query_chunk=1 + trial % 5, call_budget=(None, 100)[trial % 2])
    query, key, value = random_qkv(2, 4, kv_heads, seq, seq, 8, dtype, seed=trial)
    blocks = _random_blocks(2, seq, generator, contiguous=trial % 2 == 0)
    padding = torch.rand(2, seq, generator=generator) > 0.25 if trial % 3 else None
    out = sliding_window_attention(
        query, key, value, window=(left, right), causal=False, key_padding=padding, block_ids=blocks
    )
    expected = reference_attention(query, key, value, left, right, key_padding=padding, block_ids=blocks)
    grad_out = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(out, (query, key, value), grad_out.to(dtype))
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad_out)
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    for name, grad, expected_grad in zip("qkv", grads, expected_grads, strict=True):
        torch.testing.assert_close(
            grad.double(),
            expected_grad.double(),
            atol=tolerance,
            rtol=tolerance,
            msg=lambda detail, name=name: f"d{name}: {detail}",
        )


def _gemma4_with_images():
    config = Gemma4Config(
        text_config=TEXT,
        vision_config=None,
        audio_config=None,
        image_token_id=IMAGE_TOKEN,
        boi_token_id=121,
        eoi_token_id=122,
        video_token_id=123,
        audio_token_id=124,
        boa_token_id=125,
        eoa_token_index=126,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Gemma4ForConditionalGeneration(config)


def _image_batch(length=32):
    """Two rows: an image of 10 tokens (longer than the window) and one of 6, with text around."""
    input_ids = token_batch(length) % 100
    token_types = torch.zeros_like(input_ids)
    for row, (start, stop) in enumerate([(4, 14), (20, 26)]):
        input_ids[row, start:stop] = IMAGE_TOKEN
        token_types[row, start:stop] = 1
    return dict(input_ids=input_ids, mm_token_type_ids=token_types, labels=input_ids, use_cache=False)


def _verdicts(capture):
    return [d.verdict for report in capture.reports for d in report if d.kind == "attention call"]


def test_gemma4_with_images_trains_as_eager():
    model = _gemma4_with_images()
    capture = Capture()
    assert_training_matches(model, torch.compile(model, backend=capture), **_image_batch())
    assert _verdicts(capture) == [SLIDING] * 2 + ["rewritten: plain causal mask -> is_causal=True"]


def test_gemma4_with_images_and_padding_trains_as_eager():
    """Right padding (a collator's) and left padding, with image blocks in both rows."""
    inputs = _image_batch()
    attention_mask = torch.ones_like(inputs["input_ids"])
    attention_mask[0, 28:] = 0
    attention_mask[1, :3] = 0
    model = _gemma4_with_images()
    capture = Capture()
    assert_training_matches(model, torch.compile(model, backend=capture), attention_mask=attention_mask, **inputs)
    assert _verdicts(capture)[:2] == [PADDED] * 2, _verdicts(capture)


def test_gemma4_with_images_and_packed_sequences_says_what_to_do():
    """Packed rows (position_ids restarting, no mask) with images: transformers applies the image
    overlay before it maps packed positions, so the mask reads the block ids at position values,
    not at token indices; no band describes that, and it stays SDPA, exactly as eager. The reason
    names that obstacle, not the positions' overflow the run-time check rules out, and says
    what to do: a padded batch is read without packed positions (and rewritten, above)."""
    inputs = _image_batch()
    positions = torch.cat([torch.arange(16), torch.arange(16)]).repeat(2, 1)
    model = _gemma4_with_images()
    capture = Capture()
    assert_training_matches(model, torch.compile(model, backend=capture), position_ids=positions, **inputs)
    sliding = _verdicts(capture)[:2]
    for verdict in sliding:
        assert verdict.startswith("kept: mask is a window OR a term over values it cannot read as positions"), verdict
        assert "even with input position_ids checked as packed positions at run time" in verdict
        assert "a padded batch, one sequence a row with its attention_mask" in verdict
        assert "overflow" not in verdict


def test_gemma4_with_images_under_bf16_autocast_is_as_close_to_fp64_as_eager():
    """fp32 weights under bf16 autocast (``TrainingArguments(bf16=True)``): the rewritten run's
    gradients are as close to fp64 as eager's under the same autocast (tests/helpers/precision.py's bar)."""
    model = _gemma4_with_images()
    batch = _image_batch()
    _, reference = loss_and_grads(copy.deepcopy(model).double(), **batch)
    norm = math.sqrt(sum((g**2).sum().item() for g in reference.values()))
    capture = Capture()
    compiled = torch.compile(model, backend=capture)

    def error(run):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, grads = loss_and_grads(run, **batch)
        return math.sqrt(sum(((grads[name].double() - g) ** 2).sum().item() for name, g in reference.items())) / norm

    ours, eager = error(compiled), error(model)
    assert ours <= 1.25 * eager + 0.01, (ours, eager)
    assert eager > 1e-3  # the measure can fail: a run that is not bf16 would show no error
    assert _verdicts(capture)[:2] == [SLIDING] * 2, _verdicts(capture)


# -- what the proof reads as image blocks, and what it does not -------------------------------

W = 4


def _window_or(block_term, outside=None, inside=lambda q, kv: kv <= q):
    def attend(q, k, v, ids):
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(q.shape[2])[None, :]
        term = block_term(ids[:, :, None], ids[:, None, :])
        mask = (j > i - W) & (inside(i, j) | term)
        if outside is not None:
            mask = mask & outside(i, j)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])

    return attend


def _ids(seq=16):
    ids = torch.full((1, seq), -1)
    ids[0, 3:9] = 0
    ids[0, 11:14] = 1
    return ids


@pytest.mark.parametrize(
    "block_term",
    [
        lambda a, b: (a >= 0) & (a == b),
        lambda a, b: (b == a) & (b >= 0),
        lambda a, b: (a > -1) & (a == b),
    ],
    ids=["query-sign", "key-sign", "greater-than-minus-one"],
)
def test_spellings_of_an_image_block_rewrite(block_term):
    attend = _window_or(block_term)
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, _ids()), lambda *a: compiled(*a, _ids()))
    assert [d.verdict for d in capture.report] == ["rewritten: window (3, 0), image blocks from ids"]


@pytest.mark.parametrize(
    ("attend", "reason"),
    [
        # Without the sign test, text tokens (id -1) would see every later text token.
        (_window_or(lambda a, b: a == b), "kept: mask depends on input ids"),
        # An upper bound outside the OR cuts the blocks too: not the op's form.
        (
            _window_or(lambda a, b: (a >= 0) & (a == b), outside=lambda q, kv: kv <= q + 2),
            "kept: mask bounds kv - q from above outside its OR with image blocks",
        ),
        # A lower bound inside the OR is not the window's left side for image rows.
        (
            _window_or(lambda a, b: (a >= 0) & (a == b), inside=lambda q, kv: (kv <= q) & (kv >= q - 1)),
            "kept: mask is a window OR an image block where the window's side is",
        ),
        # Ids compared at another row than their own position.
        (_window_or(lambda a, b: (a >= 0) & (a == b.flip(-1))), "kept: mask is a window OR a term"),
    ],
    ids=["no-sign-test", "upper-bound-outside", "lower-bound-inside", "ids-of-another-position"],
)
def test_forms_the_op_does_not_compute_keep_sdpa(attend, reason):
    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, _ids()), lambda *a: compiled(*a, _ids()))
    (verdict,) = [d.verdict for d in capture.report]
    assert verdict.startswith(reason), verdict


def test_image_blocks_have_a_fast_kernel_on_the_cpu_and_where_fa2_runs(monkeypatch):
    """The chunked kernel on aten's CPU kernel; torch's FA2 where it runs (the image rows by
    one more varlen call, tests/test_torch_flash_contract.py), so the rule rewrites there."""
    assert policy.POLICY.choose(facts_of("cpu", torch.float32, 64, blocks=True)).fast
    pretend_gpu(monkeypatch)
    choice = policy.POLICY.choose(facts_of("cuda", torch.bfloat16, 64, blocks=True))
    assert choice.fast and choice.name == "torch's FA2, image rows by torch's FA2 varlen"


def test_causal_or_image_blocks_without_a_window_is_not_plain_causal():
    """Gemma-3's full-attention layers with images: causal OR the same image block, no window.
    Not plain causal (image rows see later tokens of their image): SDPA stays."""

    def attend(q, k, v, ids):
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(q.shape[2])[None, :]
        same_block = (ids[:, :, None] >= 0) & (ids[:, :, None] == ids[:, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=((j <= i) | same_block)[:, None])

    compiled, capture = compiled_with_capture(attend)
    assert_same_as_eager(lambda *a: attend(*a, _ids()), lambda *a: compiled(*a, _ids()))
    verdicts = sorted(d.verdict for d in capture.report)
    assert verdicts == ["kept: mask is window (-1, 0), image blocks from ids: no sliding window"], verdicts


# -- the op's per-batch operands are its own ---------------------------------------------------


def _attend_with(term):
    """A window AND key padding, a window AND segment ids, or a window OR image blocks, from
    a (batch, S) input."""

    def mask_of(i, j, x):
        if term == "padding":
            return (j > i - W) & (j <= i) & (x[:, None, :] != 0)
        if term == "segments":
            return (j > i - W) & (j <= i) & (x[:, :, None] == x[:, None, :])
        return (j > i - W) & ((j <= i) | ((x[:, :, None] >= 0) & (x[:, :, None] == x[:, None, :])))

    def attend(q, k, v, x, checkpointed):
        def masked(q, k, v, x):
            i = torch.arange(q.shape[2])[:, None]
            j = torch.arange(q.shape[2])[None, :]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(i, j, x)[:, None])

        if checkpointed == "mask in the body":  # eager's recomputation reads x again, as written
            return torch.utils.checkpoint.checkpoint(masked, q, k, v, x, use_reentrant=False)
        i = torch.arange(q.shape[2])[:, None]
        j = torch.arange(q.shape[2])[None, :]
        mask = mask_of(i, j, x)[:, None]
        if checkpointed:
            sdpa = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
            return torch.utils.checkpoint.checkpoint(sdpa, q, k, v, mask, use_reentrant=False)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


@pytest.mark.parametrize(
    "checkpointed", [False, True, "mask in the body"], ids=["plain", "checkpointed", "mask-in-body"]
)
@pytest.mark.parametrize("term", ["padding", "segments", "blocks"])
@pytest.mark.parametrize("backend", ["compile_pass", "capture"])
def test_a_write_to_the_input_between_forward_and_backward_changes_nothing(term, checkpointed, backend):
    """Eager's backward reads the mask it built; the op's must not read the caller's padding or
    ids again, even where AOTAutograd's partitioner would recompute a copy or an activation
    checkpoint reruns its body. Where the body builds the mask itself, eager's recomputation
    reads the written input: so must the program, and SDPA stays there. The write goes through
    numpy, which torch's version counter does not see."""
    attend = _attend_with(term)
    compiled = torch.compile(attend, backend=Capture() if backend == "capture" else backend)

    def gradients(fn):
        x = _ids().repeat(2, 1) if term != "padding" else (_ids().repeat(2, 1) >= 0).long()
        q, k, v = (t.requires_grad_() for t in random_qkv(2, 2, 2, 16, 16, 8, torch.float64, seed=1))
        out = fn(q, k, v, x, checkpointed)
        x.numpy()[:] = {"padding": 0, "segments": 7, "blocks": -1}[term]
        return torch.autograd.grad(out.sum(), (q, k, v))

    for ours, eager in zip(gradients(compiled), gradients(attend), strict=True):
        torch.testing.assert_close(ours, eager, atol=1e-12, rtol=0)


def test_segment_ids_with_block_ids_are_refused():
    query, key, value = random_qkv(1, 2, 2, 8, 8, 4, torch.float64)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="segment_ids and block_ids together"):
        sliding_window_attention(query, key, value, window=(3, 0), segment_ids=ids, block_ids=ids)
