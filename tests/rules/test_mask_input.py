"""Masks that cross graph boundaries (compile_pass/ops/mask_input.py, rules/mask_input.py):
what is known about a mask tensor, the op that reads it at run time, and models where the
mask is built in one graph (or in eager code) and used in others: an explicit graph break,
regional compilation of each decoder layer, activation checkpointing on top of each, and
generate() with a static cache. FSDP2 and DDP are in tests/parallel/test_distributed.py."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from compile_pass.ops import runtime_mask
from compile_pass.ops.runtime_mask import (
    check_mask,
    mask_facts,
    mask_input_attention_backward,
    mask_input_attention_forward,
)
from tests.helpers.attention_reference import fa2_window_mask, reference_attention
from tests.helpers.models import (
    Capture,
    assert_training_matches,
    checkpointed,
    side_effects_once,
    tiny_gemma4,
    token_batch,
)
from tests.helpers.small_graphs import compiled_with_capture, mask_input_paths, qkv


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def checks(monkeypatch):
    """The masks ``mask_facts`` checked, in order."""
    checked = []
    check = runtime_mask.check_mask
    monkeypatch.setattr(runtime_mask, "check_mask", lambda mask: checked.append(mask.shape) or check(mask))
    return checked


def _band_mask(batch, seq_q, seq_k, left, right, padding=None):
    mask = fa2_window_mask(seq_q, seq_k, left, right)[None, None].expand(batch, 1, seq_q, seq_k)
    if padding is not None:
        mask = mask & padding[:, None, None, :]
    return mask.contiguous()


# -- what is known about a mask tensor --------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_q", "seq_k", "left", "right"),
    [(16, 16, 3, 0), (16, 16, 2, 5), (16, 16, -1, 0), (16, 16, -1, -1), (4, 16, 3, 0), (1, 16, 7, 0)],
)
def test_check_reads_the_window_and_padding_exactly(seq_q, seq_k, left, right):
    padding = torch.ones(2, seq_k, dtype=torch.bool)
    padding[0, :3] = False
    facts = check_mask(_band_mask(2, seq_q, seq_k, left, right, padding))
    assert facts is not None
    # A side covering every key reads as unbounded.
    assert (facts.left, facts.right) == (
        -1 if left == -1 or left >= seq_k - 1 else left,
        -1 if right == -1 or right >= seq_q - 1 else right,
    )
    reference = _band_mask(2, seq_q, seq_k, facts.left, facts.right, facts.key_padding)
    assert torch.equal(reference, _band_mask(2, seq_q, seq_k, left, right, padding))


@settings(max_examples=60, deadline=None)
@given(
    seq=st.integers(2, 12),
    left=st.integers(0, 12),
    right=st.integers(0, 12),
    flip=st.tuples(st.integers(0, 11), st.integers(0, 11)),
)
def test_check_refuses_any_mask_one_entry_off_a_band(seq, left, right, flip):
    mask = _band_mask(1, seq, seq, left, right)
    row, column = flip[0] % seq, flip[1] % seq
    mask[0, 0, row, column] = ~mask[0, 0, row, column]
    facts = check_mask(mask)
    if facts is not None:  # the flip may make another band: then it must be exactly that band
        assert torch.equal(_band_mask(1, seq, seq, facts.left, facts.right, facts.key_padding), mask)


def _reference_facts(mask):
    """check_mask written the plain way: the extreme visible distances, the keys some row sees,
    and an element-wise comparison."""
    visible = mask[:, 0]
    seq_q, seq_k = visible.shape[1:]
    distance = torch.arange(seq_k)[None, :] - (torch.arange(seq_q)[:, None] + seq_k - seq_q)
    if not visible.any():
        return None
    lowest, highest = (
        distance.expand_as(visible)[visible].min().item(),
        distance.expand_as(visible)[visible].max().item(),
    )
    padding = visible.any(dim=1)
    band = (distance >= lowest) & (distance <= highest)
    if lowest > 0 or highest < 0 or not torch.equal(visible, band[None] & padding[:, None, :]):
        return None
    return lowest, highest, padding


@settings(max_examples=150, deadline=None)
@given(
    seq_q=st.sampled_from([1, 5, 63, 64, 65, 130]),
    seq_k=st.sampled_from([64, 65, 100, 130, 192]),
    left=st.integers(0, 140),
    right=st.integers(0, 140),
    pad=st.tuples(st.integers(0, 40), st.integers(0, 40)),
    flips=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 10**6), st.integers(0, 10**6)), max_size=3),
)
def test_check_agrees_with_the_plain_reading_across_blocks(seq_q, seq_k, left, right, pad, flips):
    """Masks wider than check_mask's 64-key blocks, with a tail, padding on both sides and
    entries flipped anywhere: the facts are exactly the plain reading's."""
    padding = torch.ones(2, seq_k, dtype=torch.bool)
    padding[0, : pad[0]] = False
    padding[1, seq_k - pad[1] :] = False
    mask = _band_mask(2, seq_q, seq_k, left, right, padding)
    for b, row, column in flips:
        mask[b, 0, row % seq_q, column % seq_k] ^= True
    facts, reference = check_mask(mask), _reference_facts(mask)
    assert (facts is None) == (reference is None)
    if facts is not None:
        lowest, highest, key_padding = reference
        assert facts.left == (-1 if lowest <= -(seq_k - 1) else -lowest)
        assert facts.right == (-1 if highest >= seq_q - 1 else highest)
        assert torch.equal(
            facts.key_padding if facts.key_padding is not None else torch.ones_like(key_padding), key_padding
        )


def test_check_refuses_a_mask_whose_bytes_are_not_0_or_1():
    mask = _band_mask(1, 80, 80, 3, 0)
    mask.view(torch.uint8)[0, 0, 40, 40] = 2  # still "true" to SDPA, but not a bool's byte
    assert check_mask(mask) is None


# -- the op --------------------------------------------------------------------------------------


def _qkv(seq_q=16, seq_k=16, heads=4, kv_heads=2):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq_q, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(2, kv_heads, seq_k, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
    return q, k, v


def _forward_and_grads(fn, inputs):
    out = fn(*inputs)
    return [out, *torch.autograd.grad(out, inputs, torch.ones_like(out))]


def _attend(mask, scale=0.3):
    """The op as the rule calls it: the mask's facts, then the call."""
    return lambda *a: mask_input_attention_forward(*a, mask, *mask_facts(mask), scale, True)[0]


@pytest.mark.parametrize(
    ("mask", "path"),
    [
        (lambda: _band_mask(2, 16, 16, 3, 0), "band"),
        (lambda: _band_mask(2, 16, 16, -1, 0), "sdpa causal"),
        (lambda: _band_mask(2, 16, 16, -1, -1), "sdpa without a mask"),
        (lambda: torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3, "sdpa with the mask"),
        (lambda: _band_mask(2, 4, 16, 3, 0), "band"),
        # A full-attention layer's padded mask: the band, on the document kernel.
        (lambda: _band_mask(2, 16, 16, -1, 0, _left_padded_row(2, 16)), "band"),
        (lambda: _band_mask(2, 16, 16, -1, -1, _left_padded_row(2, 16)), "band"),
    ],
    ids=["band", "causal", "all-visible", "not-a-band", "fewer-queries", "causal-padded", "all-visible-padded"],
)
def test_op_matches_sdpa_on_every_path(mask, path):
    mask = mask()
    q, k, v = _qkv(seq_q=mask.shape[2])
    scale = 8**-0.5
    with mask_input_paths() as paths:
        ours = _forward_and_grads(_attend(mask, scale), (q, k, v))
    reference = _forward_and_grads(
        lambda *a: F.scaled_dot_product_attention(*a, attn_mask=mask, scale=scale, enable_gqa=True), (q, k, v)
    )
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert paths == {path: 1}


def test_op_with_padding_matches_sdpa_at_every_row():
    """Padded query rows too: a right-padded row sees the last valid keys of its window."""
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[0, :4] = False  # left padding
    padding[1, 13:] = False  # right padding
    mask = _band_mask(2, 16, 16, 3, 0, padding)
    assert _assert_op_matches_sdpa(mask) == {"band": 1}


def test_a_key_no_row_sees_is_no_reason_to_change_its_query_row():
    """A mask that hides one token from every row (not padding: the user does not want it
    attended) reads as a key column no row sees; that token's own query row still attends."""
    mask = _band_mask(2, 16, 16, 3, 0)
    mask[..., 9] = False
    assert _assert_op_matches_sdpa(mask) == {"band": 1}


def _assert_op_matches_sdpa(mask):
    """The op's forward and gradients equal SDPA's; returns the paths the op took."""
    q, k, v = _qkv()
    with mask_input_paths() as paths:
        ours = _forward_and_grads(_attend(mask), (q, k, v))
    reference = _forward_and_grads(
        lambda *a: F.scaled_dot_product_attention(*a, attn_mask=mask, scale=0.3, enable_gqa=True), (q, k, v)
    )
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    return paths


@pytest.mark.parametrize(
    ("mask", "path"),
    [
        (lambda: _band_mask(2, 16, 16, 3, 0, _left_padded_row(2, 16)), "band"),
        (lambda: _band_mask(2, 16, 16, -1, 0), "sdpa causal"),
        (lambda: _band_mask(2, 16, 16, -1, -1), "sdpa without a mask"),
        (lambda: _random_mask_with_a_row_that_sees_nothing(), "sdpa with the mask"),
    ],
    ids=["band", "causal", "all-visible", "not-a-band"],
)
@pytest.mark.parametrize("shape", [(4,), (2, 4, 16)], ids=["per-head", "per-row"])
def test_op_with_sinks_matches_the_spelled_out_form_on_every_path(mask, path, shape):
    """One logit per query head or per (batch, head, row), applied from each path's logsumexp:
    output and every gradient, the sinks' included, against the fp64 spelled-out form; rows
    that see no key return zeros."""
    mask = mask()
    q, k, v = _qkv()
    sinks = (1 + torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).requires_grad_()
    attend = lambda q, k, v, s: mask_input_attention_forward(  # noqa: E731
        q, k, v, mask, *mask_facts(mask), 0.3, True, None, False, s
    )[0]
    with mask_input_paths() as paths:
        ours = _forward_and_grads(attend, (q, k, v, sinks))
    reference = _forward_and_grads(
        lambda *a: reference_attention(*a[:3], -1, -1, 0.3, sinks=a[3], mask=mask), (q, k, v, sinks)
    )
    for name, a, b in zip(("out", "dq", "dk", "dv", "d sinks"), ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    assert paths == {path: 1}
    sees_nothing = ~mask.any(dim=-1)  # (B, 1, Sq)
    assert bool(sees_nothing.any()) is (path in ("band", "sdpa with the mask"))
    assert (ours[0].masked_select(sees_nothing[..., None]) == 0).all()


def test_sinks_refused_where_sdpa_returns_no_logsumexp():
    """SDPA off its fused CPU kernel returns no logsumexp: a call with sinks there raises."""
    mask = _random_mask_with_a_row_that_sees_nothing()
    q, k, v = (x.detach() for x in _qkv())
    with (
        torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH),
        pytest.raises(RuntimeError, match="logsumexp"),
    ):
        mask_input_attention_forward(q, k, v, mask, *mask_facts(mask), 0.3, True, None, False, torch.zeros(4))
    assert runtime_mask.sinks_refused(torch.device("cpu")) is None
    assert "cuda" in runtime_mask.sinks_refused(torch.device("cuda"))


def _left_padded_row(batch, seq):
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[0, :4] = False  # under a causal band, row 0's first 4 rows see no key
    return padding


def _random_mask_with_a_row_that_sees_nothing():
    mask = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 5] = False
    return mask


def test_op_passes_opcheck():
    q, k, v = (t.detach() for t in _qkv())
    for mask in (_band_mask(2, 16, 16, 3, 0), _band_mask(2, 16, 16, 3, 0) & (torch.rand(16, 16) > 0.5)):
        torch.library.opcheck(mask_facts, (mask,))
        torch.library.opcheck(mask_input_attention_forward, (q, k, v, mask, *mask_facts(mask), 0.3, True))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(
        mask_input_attention_forward, (q, k, v, mask, *mask_facts(mask), 0.3, True, None, False, sinks)
    )


# -- models where the mask crosses a graph boundary -------------------------------------------------


def _graph_break_before_layers(model):
    """A forward pre-hook on the first decoder layer that breaks the graph: the mask is built in
    the graph before it and reaches the layers' graph as an input (FSDP2's hooks do the same)."""
    model.model.layers[0].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_graph_break_between_mask_and_layers(checkpointing, checks):
    model = tiny_gemma4()
    _graph_break_before_layers(model)
    if checkpointing:
        checkpointed(model)
    capture = Capture()
    compiled = torch.compile(model, backend=capture)
    ids = token_batch(32)
    with mask_input_paths() as paths, side_effects_once():
        assert_training_matches(model, compiled, input_ids=ids, labels=ids, use_cache=False)
    verdicts = [d.verdict for report in capture.reports for d in report if d.rule == "mask_input"]
    # Layers of one shape share a compiled graph, so there are fewer decisions than layers.
    assert verdicts and all(v.startswith("rewritten: mask from input attention_mask") for v in verdicts), verdicts
    # checkpointing runs each layer's forward again, on the facts its first run read
    assert paths == {"band": 2 * (2 if checkpointing else 1), "sdpa causal": 1 * (2 if checkpointing else 1)}
    # After the break each decoder layer runs as a graph call of its own: one check each, and
    # one more when a checkpointed layer is recomputed (it reads its mask again, as eager does).
    assert len(checks) == 3 * (2 if checkpointing else 1)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_regional_compilation_of_each_decoder_layer(checkpointing, checks):
    model = tiny_gemma4()
    if checkpointing:
        checkpointed(model)
    reference = tiny_gemma4()
    capture = Capture()
    for layer in model.model.layers:
        layer.compile(backend=capture)
    ids = token_batch(32)
    with mask_input_paths() as paths, side_effects_once():
        assert_training_matches(reference, model, input_ids=ids, labels=ids, use_cache=False)
    verdicts = [d.verdict for report in capture.reports for d in report if d.rule == "mask_input"]
    assert verdicts and all(v.startswith("rewritten: mask from input") for v in verdicts), verdicts
    # The masks were built in eager code: each layer's graph checks the one it receives.
    assert paths["band"] == 2 * (2 if checkpointing else 1)
    assert len(checks) == sum(paths.values())  # a check for each run of a layer, recomputed ones too


def test_generate_with_a_static_cache():
    model = tiny_gemma4().eval()
    ids = token_batch(12, batch=1)
    with torch.no_grad():
        expected = model.generate(ids, do_sample=False, max_new_tokens=6, cache_implementation="static")
        capture = Capture()
        model.forward = torch.compile(model.forward, backend=capture)
        with mask_input_paths() as paths:
            tokens = model.generate(ids, do_sample=False, max_new_tokens=6, cache_implementation="static")
    assert torch.equal(tokens, expected)
    verdicts = {d.verdict for report in capture.reports for d in report if d.rule == "mask_input"}
    assert verdicts and all(v.startswith("rewritten: mask from input attention_mask") for v in verdicts), verdicts
    # The prefill's sliding mask is a band; a decode step's over the static cache's slots is
    # whatever the cache holds: read exactly, and run as SDPA does where it is no band.
    assert paths["band"] >= 2  # the prefill: each sliding layer


def _checkpointed_attention(q, k, v, mask):
    attend = lambda q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    return torch.utils.checkpoint.checkpoint(attend, q, k, v, mask, use_reentrant=False)


def test_a_mask_input_written_before_a_checkpoints_recomputation():
    """A checkpoint body's mask input, a band at the forward, written through numpy (which the
    version counter does not see) before the backward: eager's recomputation runs SDPA with the
    written mask. So must the op's, whose path then differs from the forward's; torch's
    checkpoint refuses saved tensors whose shapes differ (fuzzer seed 610449)."""
    compiled, capture = compiled_with_capture(_checkpointed_attention)

    def gradients(fn):
        q, k, v = qkv(batch=2)
        i = torch.arange(16)
        mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)).expand(2, 1, 16, 16).clone()
        out = fn(q, k, v, mask)
        mask.numpy()[:] = ~mask.numpy()  # no band: the recomputation takes SDPA with the mask
        mask.numpy()[..., 0] = True  # every row sees a key
        return torch.autograd.grad(out.sum(), (q, k, v))

    for ours, eager in zip(gradients(compiled), gradients(_checkpointed_attention), strict=True):
        torch.testing.assert_close(ours, eager, atol=1e-12, rtol=0)
    assert [d.verdict for d in capture.report] == [
        "rewritten: mask from input mask: its band is read at run time, once per graph call"
    ]


class _LargestNewTensor(TorchDispatchMode):
    """The largest tensor (bytes) any op returns while the mode is on."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in torch.utils._pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel() * value.element_size())
        return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("path", ["sdpa with the mask", "sdpa causal", "sdpa without a mask"])
def test_sdpa_paths_are_sdpas_own_kernels_forward_and_backward(path, dtype):
    """Where the op runs SDPA, its result and gradients are SDPA's, bit for bit, and its
    backward holds no (Sq, Sk) fp32 score matrix per head (SDPA's fused backward: O(S) state)."""
    batch, heads, seq = 2, 4, 64
    masks = {
        "sdpa with the mask": torch.rand(batch, 1, seq, seq, generator=torch.Generator().manual_seed(1)) > 0.3,
        "sdpa causal": _band_mask(batch, seq, seq, -1, 0),
        "sdpa without a mask": _band_mask(batch, seq, seq, -1, -1),
    }
    mask = masks[path]
    if path == "sdpa with the mask":
        mask[0, 0, 5] = False  # a row that sees no key
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(seq, seq, heads))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    facts = mask_facts(mask)
    with mask_input_paths() as paths:
        out, lse, decision, saved = mask_input_attention_forward(q, k, v, mask, *facts, 0.3, True)
    assert paths == {path: 1}
    ours = [out, *torch.autograd.grad(out, (q, k, v), grad_out)]
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    expected = [reference, *torch.autograd.grad(reference, (q, k, v), grad_out)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, expected, strict=True):
        assert torch.equal(a, b), (name, (a.double() - b.double()).abs().max())
    with _LargestNewTensor() as recorded, torch.no_grad():
        mask_input_attention_backward(grad_out, q, k, v, saved, out, lse, decision, facts[1], 0.3, True)
    scores = batch * heads * seq * seq * 4  # one fp32 (Sq, Sk) matrix per head
    assert 0 < recorded.largest < scores, (recorded.largest, scores)


@pytest.mark.parametrize("path", ["sdpa with the mask", "sdpa causal"])
def test_sdpa_paths_off_the_cpus_fused_kernel_recompute_under_autograd(monkeypatch, path):
    """Where SDPA would not run aten's fused CPU kernel (on a GPU), the op's backward runs SDPA
    again under autograd, inside the backward op's kernel, which the dispatcher runs below
    autograd: its gradients are SDPA's all the same (here on the CPU, the fused kernel ruled out)."""
    from compile_pass.ops import sdpa

    monkeypatch.setattr(sdpa, "_fused_cpu", lambda *args: False)
    mask = {
        "sdpa with the mask": torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3,
        "sdpa causal": _band_mask(2, 16, 16, -1, 0),
    }[path]
    q, k, v = _qkv(16, 16)
    with mask_input_paths() as paths:
        ours = _forward_and_grads(_attend(mask), (q, k, v))
    assert paths == {path: 1}
    reference = _forward_and_grads(
        lambda *a: F.scaled_dot_product_attention(*a, attn_mask=mask, scale=0.3, enable_gqa=True), (q, k, v)
    )
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
