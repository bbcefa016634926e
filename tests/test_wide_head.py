"""The wide-head Triton kernel (ops/wide_head.py, head_dim 257-512): its forward, logsumexp
and every gradient against the fp64 reference, run on a CUDA GPU where there is one and
otherwise on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py);
its block table; and the policy's answers for it on an sm90 GPU's facts."""

import ast
import sys
from pathlib import Path

import pytest
import torch

from compile_pass.ops import chunked, kernel, policy, wide_head
from compile_pass.ops.kernel import AttentionCall
from compile_pass.ops.policy import SDPA_NAME, facts_of
from tests.attention_reference import fa2_window_mask, random_qkv, reference_attention, reference_logsumexp
from tests.models import Capture, tiny_gemma4, token_batch
from tests.small_graphs import ask_as_if_on_cuda, pretend_gpu

# The Triton kernels run on CUDA tensors where a GPU is present, else interpreted on CPU ones.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = torch.device("cuda")
SM90 = (9, 0)


def _check(dtype, head_dim, heads, kv_heads, seq_q, seq_k, window=(-1, 0), batch=1, key_padding=None, segment_ids=None):
    """The kernel's forward and backward, called as the op calls them, against fp64."""
    left, right = window
    q, k, v = (x.detach().to(DEVICE) for x in random_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype))
    masks = {
        name: None if mask is None else mask.to(DEVICE)
        for name, mask in (("key_padding", key_padding), ("segment_ids", segment_ids))
    }
    scale = head_dim**-0.5
    call = AttentionCall(q, k, v, left, right, scale, **masks)
    assert wide_head.WIDE_HEAD.cannot(call.facts) is None or DEVICE.type == "cpu"  # on the CPU: interpreted
    plan = wide_head.WIDE_HEAD.plan(call)
    out, lse = wide_head.WIDE_HEAD.forward(call, plan)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    grads = wide_head.WIDE_HEAD.backward(call, plan, grad_out, out, lse)

    ref_inputs = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = reference_attention(*ref_inputs, left, right, scale, **masks)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.double())
    ref_lse = reference_logsumexp(q, k, left, right, scale, **masks)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert a.shape == b.shape and a.dtype == dtype and a.transpose(1, 2).is_contiguous(), name
        error = (a.double() - b).abs().max().item()
        # fp32 is computed with IEEE dots; bf16/fp16 as tests/test_op_cuda.py bounds FA2: a few
        # ulps of the largest value (P and dS are rounded to the inputs' dtype, as in FA2).
        bound = (
            2e-5 * max(1.0, b.abs().max().item()) if dtype == torch.float32 else 3e-2 * max(1.0, b.abs().max().item())
        )
        assert error <= bound, (name, error, bound)
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and bool((lse[lse.isinf()] > 0).all())
    torch.testing.assert_close(lse.double()[~lse.isinf()], ref_lse[~ref_lse.isinf()], atol=1e-4, rtol=1e-4)
    return lse


def test_padded_rows_gqa_and_rows_without_keys():
    """head_dim 512, GQA 2:1, causal: a row padded on both sides (its first 37 rows see no key:
    zeros, logsumexp +inf, no gradient; the last 50 see the valid keys before them); 200 rows
    end in a part block."""
    key_padding = torch.ones(1, 200, dtype=torch.bool)
    key_padding[0, :37] = False
    key_padding[0, 150:] = False
    lse = _check(torch.float32, 512, 2, 1, 200, 200, key_padding=key_padding)
    assert bool(lse[0, :, :37].isinf().all()) and not bool(lse[0, :, 37:].isinf().any())


def test_packed_rows_head_dim_320():
    """head_dim 320 (five chunks of 64 columns), 1:1, causal, fp32: three documents
    with ids that are neither small nor sorted, 257 rows (a block of one row at the end)."""
    segment_ids = torch.tensor([[900] * 70 + [-4] * 130 + [12] * 57])
    _check(torch.float32, 320, 1, 1, 257, 257, segment_ids=segment_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_causal_head_dim_512(dtype):
    _check(dtype, 512, 2, 1, 64, 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads", "kv_heads", "seq_q", "seq_k", "window", "masks"),
    [
        # a left window, padding on both ends of a row, 257 rows
        (torch.bfloat16, 512, 2, 1, 257, 257, (70, 0), "padded"),
        # fewer queries than keys (bottom-right aligned), both sides unbounded, fp16
        (torch.float16, 320, 2, 2, 64, 200, (-1, -1), None),
        # a segment id that comes back (not a run) and padding at once
        (torch.float32, 512, 4, 2, 200, 200, (-1, 0), "both"),
        # head_dim 264: the last 64-column chunk holds 8 columns
        (torch.float32, 264, 2, 1, 100, 100, (-1, 0), None),
    ],
)
def test_more_forms(dtype, head_dim, heads, kv_heads, seq_q, seq_k, window, masks):
    key_padding = segment_ids = None
    if masks in ("padded", "both"):
        key_padding = torch.ones(1, seq_k, dtype=torch.bool)
        key_padding[0, :20] = False
        key_padding[0, -30:] = False
    if masks == "both":
        segment_ids = torch.tensor([[1] * 60 + [2] * 70 + [1] * 70])
    _check(dtype, head_dim, heads, kv_heads, seq_q, seq_k, window, key_padding=key_padding, segment_ids=segment_ids)


# -- the block table: pure torch, fast ---------------------------------------------------


def _call(seq_q, seq_k, window, key_padding=None, segment_ids=None, batch=1):
    q = torch.empty(batch, 2, seq_q, 320)
    k = torch.empty(batch, 1, seq_k, 320)
    return AttentionCall(q, k, k, *window, 1.0, key_padding, segment_ids)


BLOCK_M, BLOCK_N = 64, 32


def test_packed_rows_skip_other_documents_blocks():
    """Four documents of 64 tokens in a row of 256, causal, 64 x 32 tiles: only each
    document's own triangle is live (its 2 key blocks of 32 per query block, 8 in all), against
    2 + 4 + 6 + 8 = 20 for the plain causal row; a key block of padding is dead."""
    segment_ids = torch.arange(4).repeat_interleave(64)[None]
    packed = wide_head.block_table(_call(256, 256, (-1, 0), segment_ids=segment_ids), BLOCK_M, BLOCK_N)
    plain = wide_head.block_table(_call(256, 256, (-1, 0)), BLOCK_M, BLOCK_N)
    assert int(packed.live.sum()) == 8 and int(plain.live.sum()) == 20
    assert packed.key_first.tolist() == [[0, 2, 4, 6]] and packed.key_last.tolist() == [[1, 3, 5, 7]]
    key_padding = torch.ones(1, 256, dtype=torch.bool)
    key_padding[0, :40] = False  # key block 0 all padding, block 1 partly
    padded = wide_head.block_table(_call(256, 256, (-1, 0), key_padding=key_padding), BLOCK_M, BLOCK_N)
    assert not bool(padded.live[0, :, 0].any()) and padded.key_first[0].tolist() == [1, 1, 1, 1]
    assert padded.query_first[0, 0].item() > padded.query_last[0, 0].item()  # no query block sees key block 0


@pytest.mark.parametrize("seed", range(4))
def test_block_table_covers_every_visible_pair(seed):
    """Every (row, key) the reference's mask shows lies in a live block pair (only dead pairs
    are skipped), over random windows, lengths, padding and segment ids."""
    gen = torch.Generator().manual_seed(seed)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (), generator=gen))]

    seq = int(torch.randint(1, 300, (), generator=gen))
    seq_q = pick(seq, max(1, seq // 3))
    window = (pick(-1, 0, 7, 100), pick(-1, 0, 5))
    key_padding = torch.rand(2, seq, generator=gen) > pick(0.0, 0.5, 0.95)
    segment_ids = torch.randint(-3, 3, (2, seq), generator=gen).cumsum(1) if seq_q == seq and seed % 2 else None
    table = wide_head.block_table(_call(seq_q, seq, window, key_padding, segment_ids, batch=2), BLOCK_M, BLOCK_N)
    mask = fa2_window_mask(seq_q, seq, *window)[None] & key_padding[:, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    rows, keys = torch.arange(seq_q) // BLOCK_M, torch.arange(seq) // BLOCK_N
    live = table.live.bool()[:, rows][:, :, keys]
    assert not bool((mask & ~live).any())
    for b in range(2):  # every live pair lies within its rows' and keys' ranges
        for qb, kb in table.live[b].nonzero().tolist():
            assert table.key_first[b, qb] <= kb <= table.key_last[b, qb]
            assert table.query_first[b, kb] <= qb <= table.query_last[b, kb]


# -- the policy, on an sm90 GPU's facts ----------------------------------------------------


def test_unmeasured_it_keeps_sdpa(monkeypatch):
    pretend_gpu(monkeypatch, SM90)
    for dtype in (torch.bfloat16, torch.float16):
        choice = policy.POLICY.choose(facts_of(CUDA, dtype, 512, keys=32768))
        assert not choice.fast and choice.name == SDPA_NAME
        assert f"{wide_head.NAME}: {wide_head.NOT_MEASURED}" in choice.reason
        # What runs anyway (slow_kernels, a direct call) is the chunked kernel, as before.
        assert isinstance(policy.POLICY.first(facts_of(CUDA, dtype, 512)), chunked.ChunkedKernel)


def test_routes_by_the_crossovers_it_is_given(monkeypatch):
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)  # the measured crossovers, not the suite's 0
    pretend_gpu(monkeypatch, SM90)
    measured = policy.POLICY.with_wide_head_crossovers({(SM90, torch.bfloat16): 8192})
    for masks in ({}, {"key_padding": True}, {"segment_ids": True}, {"key_padding": True, "segment_ids": True}):
        choice = measured.choose(facts_of(CUDA, torch.bfloat16, 512, keys=8192, **masks))
        assert choice.fast and isinstance(choice.kernel, wide_head.WideHeadKernel), masks
        assert (
            choice.name == choice.kernel.describe(None)
            and measured.first(facts_of(CUDA, torch.bfloat16, 512, **masks)) is choice.kernel
        )
    shorter = measured.choose(facts_of(CUDA, torch.bfloat16, 320, keys=8191))
    assert not shorter.fast and "its 8191 keys are at most 8191" in shorter.reason
    for dtype, head_dim, capability, why in (
        (torch.float16, 512, SM90, "no crossover for sm90 torch.float16"),
        (torch.bfloat16, 512, (8, 0), "no crossover for sm80 torch.bfloat16"),
        (torch.bfloat16, 576, SM90, "takes head_dim 257-512, not 576"),
        (torch.bfloat16, 512, (7, 5), "needs sm80 or newer"),
    ):
        pretend_gpu(monkeypatch, capability)
        choice = measured.choose(facts_of(CUDA, dtype, head_dim, keys=16384))
        assert not choice.fast and why in choice.reason, (dtype, head_dim, capability, choice.reason)
    pretend_gpu(monkeypatch, SM90)
    assert (
        "takes no image blocks" in measured.choose(facts_of(CUDA, torch.bfloat16, 512, keys=16384, blocks=True)).reason
    )
    # head_dim 256 stays with FA2; the CPU with the chunked kernel.
    assert measured.choose(facts_of(CUDA, torch.bfloat16, 256, keys=16384)).name == "torch's FA2"
    assert "runs only on CUDA, not cpu" in wide_head.WIDE_HEAD.cannot(facts_of("cpu", torch.bfloat16, 512))
    # The process-wide policy is untouched.
    assert not policy.POLICY.choose(facts_of(CUDA, torch.bfloat16, 512, keys=16384)).fast


def test_triton_is_optional(monkeypatch):
    """Without triton the kernel says why it cannot run; only wide_head_kernels.py imports
    triton, and only wide_head.py's ``_kernels`` imports it, when a call runs."""
    pretend_gpu(monkeypatch, SM90)
    monkeypatch.setitem(sys.modules, "triton", None)
    wide_head.triton_missing.cache_clear()
    try:
        assert "triton is not importable" in wide_head.WIDE_HEAD.cannot(facts_of(CUDA, torch.bfloat16, 512))
    finally:
        monkeypatch.undo()
        wide_head.triton_missing.cache_clear()
    package = Path(wide_head.__file__).parent.parent
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level imports
            names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            names += [getattr(node, "module", None) or ""]
            if any(name.split(".")[0] == "triton" for name in names):
                assert path.name == "wide_head_kernels.py", path
            assert "wide_head_kernels" not in names, path


# -- the rules: a global layer goes to the op only where the crossover says ------------------


@pytest.mark.parametrize("padded", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "padded"])
def test_a_global_layer_goes_to_the_op_where_its_crossover_says(monkeypatch, padded):
    """Gemma-4's global layer (head_dim 512), as if on sm90: with a crossover given for fp32
    the sliding rule takes it, window (-1, 0) (padded: with its key padding), naming the
    wide-head kernel; with the default, empty table it stays as before (the causal rule's
    is_causal, or SDPA with the padded mask). The rewritten graph (run on the CPU, by the
    chunked kernel) matches eager."""
    pretend_gpu(monkeypatch, SM90)
    inputs = {"input_ids": token_batch(24), "use_cache": False}
    if padded:
        padding = torch.ones(2, 24, dtype=torch.long)
        padding[0, :5] = 0
        inputs["attention_mask"] = padding
    model = tiny_gemma4(global_head_dim=512)
    expected = model(**inputs).logits
    for table, rewritten_by in (
        ({}, ("sliding_window", False) if padded else ("causal_mask", True)),
        ({(SM90, torch.float32): 16}, ("sliding_window", True)),
    ):
        monkeypatch.setattr(policy, "POLICY", policy.KernelPolicy().with_wide_head_crossovers(table))
        ask_as_if_on_cuda(monkeypatch)
        torch._dynamo.reset()
        capture = Capture()
        logits = torch.compile(model, backend=capture, fullgraph=True)(**inputs).logits
        (full,) = [d for d in capture.report if d.layer_type == "full_attention"]
        assert (full.rule, full.rewritten) == rewritten_by, full
        if table:
            assert full.kernel == wide_head.WIDE_HEAD.describe(None) and "(-1, 0)" in full.reason, full
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)


def test_a_global_layers_mask_input_runs_the_band_where_its_crossover_says(monkeypatch):
    """A causal mask that reaches the graph as an input (the mask_input op reads its band at
    run time), head_dim 512, as if on sm90: plain and padded, it runs SDPA (is_causal, or with
    the mask) by default and the band, window (-1, 0), where a crossover says the wide-head
    kernel wins; the band path's result (the chunked kernel on the CPU) matches fp64."""
    from compile_pass.ops import runtime_mask

    pretend_gpu(monkeypatch, SM90)
    q, k, v = random_qkv(2, 2, 2, 40, 40, 512, torch.float32)
    causal = fa2_window_mask(40, 40, -1, 0)
    padding = torch.ones(2, 40, dtype=torch.bool)
    padding[0, :5] = False
    for key_padding in (None, padding):
        mask = causal.expand(2, 1, 40, 40) if key_padding is None else causal & key_padding[:, None, None, :]
        facts, mask_padding = torch.ops.compile_pass.mask_facts(mask)
        default = runtime_mask.SDPA_WITH_MASK if key_padding is not None else runtime_mask.CAUSAL
        for table, path in (({}, default), ({(SM90, torch.float32): 16}, runtime_mask.BAND)):
            monkeypatch.setattr(policy, "POLICY", policy.KernelPolicy().with_wide_head_crossovers(table))
            ask_as_if_on_cuda(monkeypatch)
            decided = runtime_mask.decide(q, k, mask, facts, mask_padding)
            assert decided[0] == path, (key_padding is not None, table, decided)
            if path == runtime_mask.BAND:
                assert decided[1:3] == (-1, 0) and (decided[3] is None) == (key_padding is None)
                out = torch.ops.compile_pass.mask_input_attention_forward(
                    q, k, v, mask, facts, mask_padding, 512**-0.5, False
                )[0]
                reference = reference_attention(*(x.double() for x in (q, k, v)), -1, 0, 512**-0.5, key_padding)
                torch.testing.assert_close(out.double(), reference, atol=2e-5, rtol=2e-5)
