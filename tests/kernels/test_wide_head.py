"""The wide-head Triton kernel (kernels/wide_head/__init__.py, head_dim 64-512, soft-capping): its forward,
logsumexp and every gradient against the fp64 reference, run on a CUDA GPU where there is one
and otherwise on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py);
its tiles (which fit a device, and the measured pick); its block table; and the policy's
answers for it on an sm90 GPU's facts."""

import ast
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from compile_pass.kernels import chunked, policy, wide_head
from compile_pass.kernels import contract as kernel
from compile_pass.kernels.contract import AttentionCall
from compile_pass.kernels.policy import SDPA_NAME, facts_of
from compile_pass.kernels.wide_head import tiles as wide_head_tiles
from compile_pass.kernels.wide_head.tiles import CONFIGS, Config, Tiles, fitting, shared_memory_estimate
from compile_pass.ops import runtime_mask
from tests.helpers.attention_reference import fa2_window_mask, random_qkv, reference_attention, reference_logsumexp
from tests.helpers.models import Capture, tiny_gemma4, token_batch
from tests.helpers.small_graphs import ask_as_if_on_cuda, pretend_gpu

# The Triton kernels run on CUDA tensors where a GPU is present, else interpreted on CPU ones.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = torch.device("cuda")
SM90 = (9, 0)
KIB = 1024


def _capped_logsumexp(q, k, left, right, scale, softcap, key_padding=None, segment_ids=None):
    """fp64 logsumexp of the capped scores ``softcap * tanh(scale q.k / softcap)`` over the keys
    each row sees (``reference_logsumexp``'s mask and convention)."""
    groups = q.shape[1] // k.shape[1]
    mask = fa2_window_mask(q.shape[2], k.shape[2], left, right)[None, None]
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = scale * q.double() @ k.double().repeat_interleave(groups, dim=1).mT
    lse = (softcap * torch.tanh(scores / softcap)).masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _check(
    dtype,
    head_dim,
    heads,
    kv_heads,
    seq_q,
    seq_k,
    window=(-1, 0),
    batch=1,
    key_padding=None,
    segment_ids=None,
    softcap=0.0,
    tiles=None,
    chosen=None,
):
    """The kernel's forward and backward, called as the op calls them, against fp64: at ``tiles``
    (default: the first config that fits, which the interpreter runs; on a GPU too, so that the
    tests compile one config per form), or as ``chosen`` (a ``WideHeadKernel``) picks them."""
    left, right = window
    q, k, v = (x.detach().to(DEVICE) for x in random_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype))
    masks = {
        name: None if mask is None else mask.to(DEVICE)
        for name, mask in (("key_padding", key_padding), ("segment_ids", segment_ids))
    }
    scale = head_dim**-0.5
    call = AttentionCall(q, k, v, left, right, scale, **masks, softcap=softcap)
    if chosen is None:
        masked = key_padding is not None or segment_ids is not None
        tiles = tiles or wide_head.WIDE_HEAD.candidates(DEVICE, dtype, head_dim, masked)[0]
        chosen = wide_head.WideHeadKernel(configs=(Config(tiles, 512),))
    assert chosen.cannot(call.facts) is None or DEVICE.type == "cpu"  # on the CPU: interpreted
    plan = chosen.plan(call)
    assert tiles is None or plan.candidates == (tiles,)  # forced: nothing else fits or is measured
    out, lse = chosen.forward(call, plan)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    grads = chosen.backward(call, plan, grad_out, out, lse)

    ref_inputs = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = reference_attention(*ref_inputs, left, right, scale, **masks, softcap=softcap)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out.double())
    if softcap:
        ref_lse = _capped_logsumexp(q, k, left, right, scale, softcap, **masks)
    else:
        ref_lse = reference_logsumexp(q, k, left, right, scale, **masks)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True):
        assert a.shape == b.shape and a.dtype == dtype and a.transpose(1, 2).is_contiguous(), name
        error = (a.double() - b).abs().max().item()
        # fp32 is computed with IEEE dots; bf16/fp16 as tests/ops/test_op_cuda.py bounds FA2: a few
        # ulps of the largest value (P and dS are rounded to the inputs' dtype, as in FA2).
        bound = (
            2e-5 * max(1.0, b.abs().max().item()) if dtype == torch.float32 else 3e-2 * max(1.0, b.abs().max().item())
        )
        assert error <= bound, (name, error, bound)
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and bool((lse[lse.isinf()] > 0).all())
    torch.testing.assert_close(lse.double()[~lse.isinf()], ref_lse[~ref_lse.isinf()], atol=1e-4, rtol=1e-4)
    return lse


def _padding(seq, front, back):
    key_padding = torch.ones(1, seq, dtype=torch.bool)
    key_padding[0, :front] = False
    key_padding[0, seq - back :] = False
    return key_padding


def test_padded_rows_gqa_and_rows_without_keys():
    """head_dim 512, GQA 2:1, causal: a row padded on both sides (its first 17 rows see no key:
    zeros, logsumexp +inf, no gradient; the last 10 see the valid keys before them); 48 rows
    end in a part block."""
    lse = _check(torch.float32, 512, 2, 1, 48, 48, key_padding=_padding(48, 17, 10))
    assert bool(lse[0, :, :17].isinf().all()) and not bool(lse[0, :, 17:].isinf().any())


@pytest.mark.parametrize("head_dim", [64, 128, 256, 320])
def test_head_dims(head_dim):
    """Every head_dim class of the range, causal, GQA 2:1, fp32: one chunk (64), powers of two,
    and 320 (five 64-column chunks, the accumulator 512 wide); 40 rows (a part block)."""
    _check(torch.float32, head_dim, 2, 1, 40, 40)


def test_packed_rows_soft_capped():
    """Soft-capped scores with three documents whose ids are neither small nor sorted, head_dim
    128, fp32; a cap of 2 bends most scores (|scale q.k| of a few)."""
    segment_ids = torch.tensor([[900] * 20 + [-4] * 30 + [12] * 15])
    _check(torch.float32, 128, 2, 2, 65, 65, segment_ids=segment_ids, softcap=2.0)


def test_soft_capped_window_with_padding_bf16():
    """A cap, a left window and padding on both ends at once, GQA 2:1, head_dim 256, bf16."""
    _check(torch.bfloat16, 256, 2, 1, 48, 48, (9, 0), key_padding=_padding(48, 5, 6), softcap=5.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_causal_head_dim_512(dtype):
    _check(dtype, 512, 2, 1, 32, 32)


@pytest.mark.parametrize(
    "tiles",
    [Tiles(16, 32, 32, 4, 1), Tiles(64, 128, 64, 8, 1)],
    ids=["16x32-chunk32", "64x128-chunk64"],
)
def test_exact_at_forced_tiles(tiles):
    """The same call at two configs forced (each kernel's block table at its own sizes): head_dim
    96 (the accumulator 128 wide; 32-column chunks, or a 64-column chunk and a masked part),
    soft-capped, GQA 2:1, a left window and padding, 56 rows."""
    _check(torch.float32, 96, 2, 1, 56, 56, (30, 0), key_padding=_padding(56, 3, 4), softcap=4.0, tiles=tiles)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "head_dim", "heads", "kv_heads", "seq_q", "seq_k", "window", "masks", "softcap"),
    [
        # a left window, padding on both ends of a row, 257 rows
        (torch.bfloat16, 512, 2, 1, 257, 257, (70, 0), "padded", 0.0),
        # fewer queries than keys (bottom-right aligned), both sides unbounded, fp16
        (torch.float16, 320, 2, 2, 64, 200, (-1, -1), None, 0.0),
        # a segment id that comes back (not a run) and padding at once, capped
        (torch.float32, 512, 4, 2, 200, 200, (-1, 0), "both", 30.0),
        # head_dim 264: the last 64-column chunk holds 8 columns
        (torch.float32, 264, 2, 1, 100, 100, (-1, 0), None, 0.0),
        # head_dim 64, capped, fewer queries than keys with a right side, GQA 4:1, bf16
        (torch.bfloat16, 64, 4, 1, 50, 130, (40, 3), "padded", 1.0),
    ],
)
def test_more_forms(dtype, head_dim, heads, kv_heads, seq_q, seq_k, window, masks, softcap):
    key_padding = segment_ids = None
    if masks in ("padded", "both"):
        key_padding = _padding(seq_k, 20, 30)
    if masks == "both":
        segment_ids = torch.tensor([[1] * 60 + [2] * 70 + [1] * 70])
    _check(
        dtype,
        head_dim,
        heads,
        kv_heads,
        seq_q,
        seq_k,
        window,
        key_padding=key_padding,
        segment_ids=segment_ids,
        softcap=softcap,
    )


# -- the tiles: which fit a device, and the measured pick -----------------------------------


# The most shared memory Triton 3.9 allocated for any kernel of these tiles, bf16, at sm80, sm90
# and sm100 (benchmarks/wide_head_compile.py, each config at its widest head_dim): the estimate
# that prunes by a device's shared memory must not be below it.
COMPILED_SHARED_KIB = {
    (Tiles(32, 64, 64, 8, 1), 512, False): 132,
    (Tiles(32, 64, 64, 8, 1), 512, True): 68,
    (Tiles(32, 64, 128, 8, 1), 512, False): 132,
    (Tiles(16, 32, 64, 8, 1), 512, False): 65,
    (Tiles(64, 64, 64, 8, 1), 256, False): 104,
    (Tiles(64, 32, 64, 4, 1), 128, False): 44,
    (Tiles(64, 32, 64, 4, 1), 128, True): 16,
}


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 320, 512])
def test_configs_are_pruned_by_shared_memory(head_dim, dtype, masked):
    """What fits 99 KiB (sm86, sm89, sm120), 163 KiB (A100) and 227 KiB (H100, B200) of shared
    memory per block, by the estimate: nested, in the list's order, each within the size; only
    configs meant for this head_dim (``widest``), no chunk wider than the padded head_dim, no
    second stage where masks make the key loop read block flags; 8 KiB fits none."""
    width = wide_head_tiles.padded_head_dim(head_dim)
    unlimited = fitting(CONFIGS, None, head_dim, dtype, masked)
    widest = {config.tiles: config.widest for config in CONFIGS}
    assert unlimited and all(widest[tiles] >= width and tiles.d_chunk <= width for tiles in unlimited)
    assert not masked or all(tiles.stages == 1 for tiles in unlimited)
    sizes = {size: fitting(CONFIGS, size * KIB, head_dim, dtype, masked) for size in (99, 163, 227)}
    for size, fits in sizes.items():
        assert all(shared_memory_estimate(tiles, head_dim, dtype, masked) <= size * KIB for tiles in fits)
        left_out = set(unlimited) - set(fits)
        assert all(shared_memory_estimate(tiles, head_dim, dtype, masked) > size * KIB for tiles in left_out)
        assert list(fits) == [tiles for tiles in unlimited if tiles in fits]  # the list's order
    assert set(sizes[99]) <= set(sizes[163]) <= set(sizes[227])
    assert fitting(CONFIGS, 8 * KIB, head_dim, dtype, masked) == ()


def test_what_fits_where():
    """At head_dim 512 in bf16: 99 KiB takes only 16 x 32 tiles without masks (the stationary rows'
    chunks are hoisted out of the key loop there) but 32 x 64 with them; 163 KiB takes 32 x 64
    (the tiles chosen before tuning) either way; 64 stationary rows are for head_dim 256 and
    below, a 128-column chunk not for head_dim 64, a second stage only without masks. Every
    head_dim of the range has a config on every sm80+ GPU (99 KiB or more) in fp16 and bf16."""
    old_default = Tiles(32, 64, 64, 8, 1)
    plain_99 = fitting(CONFIGS, 99 * KIB, 512, torch.bfloat16, False)
    assert plain_99 and {(t.stationary, t.streamed) for t in plain_99} == {(16, 32)}
    assert old_default in fitting(CONFIGS, 99 * KIB, 512, torch.bfloat16, True)
    assert all(old_default in fitting(CONFIGS, 163 * KIB, 512, torch.bfloat16, m) for m in (False, True))
    assert not any(t.stationary == 64 for t in fitting(CONFIGS, None, 320, torch.bfloat16, False))
    assert any(t.stationary == 64 for t in fitting(CONFIGS, None, 256, torch.bfloat16, False))
    assert not any(t.d_chunk == 128 for t in fitting(CONFIGS, None, 64, torch.bfloat16, False))
    assert any(t.d_chunk == 128 for t in fitting(CONFIGS, None, 128, torch.bfloat16, False))
    assert any(t.stages == 2 for t in fitting(CONFIGS, None, 512, torch.bfloat16, False))
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in range(64, 513):
            for masked in (False, True):
                assert fitting(CONFIGS, 99 * KIB, head_dim, dtype, masked), (dtype, head_dim, masked)
    for (tiles, head_dim, masked), kib in COMPILED_SHARED_KIB.items():
        assert shared_memory_estimate(tiles, head_dim, torch.bfloat16, masked) >= kib * KIB, tiles


def test_a_device_that_fits_no_config_is_refused(monkeypatch):
    """Where no config fits the GPU's shared memory, ``cannot`` says so (the policy passes the
    kernel over) and ``plan`` declines."""
    pretend_gpu(monkeypatch, SM90)
    monkeypatch.setattr(wide_head, "shared_memory_of", lambda device: 16 * KIB)
    why = wide_head.WIDE_HEAD.cannot(facts_of(CUDA, torch.bfloat16, 512, key_padding=True))
    assert why == (
        f"no tile config of {wide_head.NAME} fits the GPU's 16 KiB of shared memory per block at head_dim 512 in "
        "torch.bfloat16 with masks"
    )
    monkeypatch.setattr(wide_head, "shared_memory_of", lambda device: 227 * KIB)
    assert wide_head.WIDE_HEAD.cannot(facts_of(CUDA, torch.bfloat16, 512)) is None


def test_the_interpreter_runs_the_first_config_that_fits(monkeypatch):
    """Under TRITON_INTERPRET=1 (no shared-memory limit) a launch runs once, at the first config
    the pruning keeps, and records no pick: nothing is measured."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as tests/conftest.py sets it without CUDA
    assert wide_head_tiles.interpreting()
    candidates = fitting(CONFIGS, wide_head_tiles.shared_memory_of(DEVICE), 64, torch.float32, False)
    assert candidates[0] == CONFIGS[0].tiles
    runs = []
    key = wide_head_tiles.TuneKey("forward", "cpu", torch.float32, 64, False, True, False, False, False, 1, 64, 64, 2)
    assert wide_head_tiles.launch(key, candidates, runs.append) == candidates[0]
    assert runs == [candidates[0]] and key not in wide_head_tiles.picks()


def test_the_measured_pick(monkeypatch):
    """Measured (as on a GPU, here with a wall clock): the fastest config is picked; one that
    fails to compile or launch is passed over with a warning naming it; the pick is kept, so a
    second launch of the same key measures nothing and runs the pick."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(wide_head_tiles, "interpreting", lambda: False)
    monkeypatch.setattr(wide_head_tiles, "_PICKS", {})
    slow, fast, broken = Tiles(16, 32, 64, 4, 1), Tiles(32, 64, 64, 8, 1), Tiles(64, 128, 64, 8, 1)
    runs = []

    def run(tiles):
        runs.append(tiles)
        if tiles == broken:
            raise OutOfResources(300 * KIB, 227 * KIB, "shared memory")
        time.sleep(0.004 if tiles == slow else 0.0005)

    key = wide_head_tiles.TuneKey("dK", "test", torch.bfloat16, 512, False, True, True, False, True, 2, 4096, 4096, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        picked = wide_head_tiles.launch(key, (slow, broken, fast), run, time_ms=wide_head_tiles.wall_clock_ms)
    assert picked == fast and runs[-1] == fast and wide_head_tiles.picks() == {key: fast}
    assert set(runs) == {slow, fast, broken}
    assert [str(w.message) for w in caught if str(broken) in str(w.message)], [str(w.message) for w in caught]
    runs.clear()
    assert wide_head_tiles.launch(key, (slow, broken, fast), run, time_ms=wide_head_tiles.wall_clock_ms) == fast
    assert runs == [fast]


def test_each_kernel_measures_its_tiles_and_stays_exact(monkeypatch):
    """As on a GPU, with measuring on (timed here by the wall clock, on the interpreter): each of
    the four kernels measures the two configs at its first launch, each at its own block table,
    and keeps its own pick; the call, run at the picks, is exact against fp64."""
    monkeypatch.setattr(wide_head_tiles, "interpreting", lambda: False)
    monkeypatch.setattr(wide_head_tiles, "_PICKS", {})
    monkeypatch.setattr(wide_head_tiles, "TIMED_RUNS", 1)  # the interpreter is slow; what is timed does not matter
    configs = (Config(Tiles(16, 32, 32, 4, 1), 512), Config(Tiles(32, 64, 64, 8, 1), 512))
    wide = wide_head.WideHeadKernel(configs=configs)
    _check(torch.float32, 64, 1, 1, 36, 36, key_padding=_padding(36, 2, 3), chosen=wide)
    picks = wide_head_tiles.picks()
    assert sorted(key.kernel for key in picks) == ["dK", "dQ", "dV", "forward"]
    assert set(picks.values()) <= {config.tiles for config in configs}


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
    for dtype, head_dim, softcap in (
        (torch.bfloat16, 512, False),
        (torch.float16, 512, False),
        (torch.bfloat16, 256, True),
        (torch.float32, 128, False),
    ):
        choice = policy.POLICY.choose(facts_of(CUDA, dtype, head_dim, keys=32768, softcap=softcap))
        assert not choice.fast and choice.name == SDPA_NAME
        assert f"{wide_head.NAME}: {wide_head.NOT_MEASURED}" in choice.reason, choice.reason
        # What runs anyway (slow_kernels, a direct call) is the first exact kernel: the chunked
        # kernel, as before, where it caps scores.
        first = policy.POLICY.first(facts_of(CUDA, dtype, head_dim, softcap=softcap))
        assert first.cannot(facts_of(CUDA, dtype, head_dim, softcap=softcap)) is None
        assert isinstance(first, chunked.ChunkedKernel) or (softcap and first is wide_head.WIDE_HEAD)


def test_routes_by_the_crossovers_it_is_given(monkeypatch):
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)  # the measured crossovers, not the suite's 0
    pretend_gpu(monkeypatch, SM90)
    measured = policy.POLICY.with_wide_head_crossovers({(SM90, torch.bfloat16): 8192})
    for masks in ({}, {"key_padding": True}, {"segment_ids": True}, {"key_padding": True, "segment_ids": True}):
        for head_dim, softcap in ((512, False), (320, True), (256, True), (64, True)):
            choice = measured.choose(facts_of(CUDA, torch.bfloat16, head_dim, keys=8192, softcap=softcap, **masks))
            assert choice.fast and isinstance(choice.kernel, wide_head.WideHeadKernel), (masks, head_dim)
            assert (
                choice.name == choice.kernel.describe(None)
                and measured.first(facts_of(CUDA, torch.bfloat16, head_dim, softcap=softcap, **masks)) is choice.kernel
            )
    shorter = measured.choose(facts_of(CUDA, torch.bfloat16, 320, keys=8191))
    assert not shorter.fast and "its 8191 keys are at most 8191" in shorter.reason
    for dtype, head_dim, capability, why in (
        (torch.float16, 512, SM90, "no crossover for sm90 torch.float16"),
        (torch.bfloat16, 512, (8, 0), "no crossover for sm80 torch.bfloat16"),
        (torch.bfloat16, 576, SM90, "takes head_dim 64-512, not 576"),
        (torch.bfloat16, 32, SM90, "takes head_dim 64-512, not 32"),
        (torch.bfloat16, 512, (7, 5), "needs sm80 or newer"),
    ):
        pretend_gpu(monkeypatch, capability)
        choice = measured.choose(facts_of(CUDA, dtype, head_dim, keys=16384, softcap=True))
        assert not choice.fast and why in choice.reason, (dtype, head_dim, capability, choice.reason)
    pretend_gpu(monkeypatch, SM90)
    assert (
        "takes no image blocks" in measured.choose(facts_of(CUDA, torch.bfloat16, 512, keys=16384, blocks=True)).reason
    )
    # Where torch's FA2 takes the call (head_dim <= 256, no cap) it stays first; the CPU keeps
    # the chunked kernel.
    for head_dim in (64, 128, 256):
        assert measured.choose(facts_of(CUDA, torch.bfloat16, head_dim, keys=16384)).name == "torch's FA2"
    assert "runs only on CUDA, not cpu" in wide_head.WIDE_HEAD.cannot(facts_of("cpu", torch.bfloat16, 512))
    # The process-wide policy is untouched.
    assert not policy.POLICY.choose(facts_of(CUDA, torch.bfloat16, 512, keys=16384)).fast


def test_global_layers_up_to_head_dim_256_are_taken_only_where_measured(monkeypatch):
    """A global layer (causal, no left bound; plain or padded) at head_dim 128 or 256 goes to the
    op (the policy's answer, asked by the sliding rule and the mask-input op) only where a
    kernel is the policy's choice by a measured crossover: never with the empty table; where
    torch's FA2 could take it (fp16/bf16) it is not measured for calls with no left bound and
    passes it on, so the wide-head kernel takes it where its crossover for that dtype is given,
    as in fp32 (no FA2)."""
    monkeypatch.setattr(kernel, "SHORT_KEYS_SETTING", None)
    pretend_gpu(monkeypatch, SM90)
    ask_as_if_on_cuda(monkeypatch)
    for head_dim in (128, 256):
        for padding in (False, True):
            for table, dtype, taken in (
                ({}, torch.bfloat16, False),
                ({}, torch.float32, False),
                ({(SM90, torch.bfloat16): 16}, torch.bfloat16, True),
                ({(SM90, torch.float32): 16}, torch.float32, True),
            ):
                measured = policy.KernelPolicy().with_wide_head_crossovers(table)
                for keys in (None, 4096):  # the rule asks without the length first
                    facts = facts_of(CUDA, dtype, head_dim, key_padding=padding, keys=keys, left=-1, right=0)
                    choice = measured.choose(facts)
                    assert choice.fast == taken, (head_dim, table, keys, choice)
                    assert not taken or isinstance(choice.kernel, wide_head.WideHeadKernel), choice
                    if dtype == torch.bfloat16:
                        assert "torch's FA2: with no left bound" in "; ".join(choice.passed_over), choice
                monkeypatch.setattr(policy, "POLICY", measured)
                ask_as_if_on_cuda(monkeypatch)
                q, k = (torch.empty(1, 2, 4096, head_dim, dtype=dtype) for _ in range(2))
                key_padding = torch.ones(1, 4096, dtype=torch.bool) if padding else None
                path = runtime_mask._full_layer_path(q, k, -1, 0, key_padding, False)[0]
                assert (path == runtime_mask.BAND) == taken, (head_dim, table)


def test_triton_is_optional(monkeypatch):
    """Without triton the kernel says why it cannot run; only the kernels' modules import
    triton, and only wide_head.py's ``_kernels`` imports them, when a call runs."""
    pretend_gpu(monkeypatch, SM90)
    monkeypatch.setitem(sys.modules, "triton", None)
    wide_head.triton_missing.cache_clear()
    try:
        assert "triton is not importable" in wide_head.WIDE_HEAD.cannot(facts_of(CUDA, torch.bfloat16, 512))
    finally:
        monkeypatch.undo()
        wide_head.triton_missing.cache_clear()
    package = Path(wide_head.__file__).parent.parent.parent
    triton_code = {package / "kernels" / "wide_head" / name for name in ("forward.py", "backward.py")}
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module-level imports
            names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            names += [getattr(node, "module", None) or ""]
            if any(name.split(".")[0] == "triton" for name in names):
                assert path in triton_code, path
            if path.parent.name == "wide_head":  # the kernels' own imports: relative ones name the module
                assert "forward" not in names or path.name == "backward.py", path
                assert "backward" not in names, path


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
