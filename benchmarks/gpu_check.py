"""Check and measure the op on a CUDA GPU, at Gemma-4 26B-A4B's sliding-layer shapes.

One command for whoever has a GPU (stock CUDA torch; flash-attn too, if installed, is timed
beside it and checked by its contract tests):

    python benchmarks/gpu_check.py                    # everything but the profile
    python benchmarks/gpu_check.py --seqs 4096 8192 --model-seqs 4096 --repeats 5
    python benchmarks/gpu_check.py --skip-tests --no-record --sections padded profile short
    python benchmarks/gpu_check.py --skip-tests --sections model --model-padded --model-seqs 1024 2048
    python benchmarks/gpu_check.py --skip-tests --no-record --sections global     # the global layer alone
    python benchmarks/gpu_check.py --skip-tests --no-record --sections packed     # packed full-attention layers
    python benchmarks/gpu_check.py --cpu-dry-run --seqs 64 100 --repeats 1          # no GPU: its code runs

1. tests: pytest on tests/ops/test_op_cuda.py (each FA2 kernel, its varlen path and the chunked
   kernel on the GPU against the fp64 reference), tests/kernels/test_flash_contract.py,
   tests/kernels/test_torch_flash.py and tests/kernels/test_wide_head.py (the Triton kernel on the GPU);
then the ``--sections`` asked for (all but ``profile`` by default):
2. ``layer``: one sliding layer, forward + backward, bf16, batch 1, 16 query / 8 KV heads,
   head_dim 256, window 1024 (w - 1 = 1023 keys back plus the query's own): the op; what
   transformers runs under sdpa (K/V repeated, SDPA with the boolean band mask); torch's FA2
   called directly (``aten::_flash_attention_forward/_backward``, window (1023, 0)); and,
   where it is installed, flash-attn's ``flash_attn_func`` with the same window. Repeats are
   interleaved (op, sdpa, torch FA2, ..., op, ...) and timed with CUDA events; medians. The
   op should be within 5% of torch's FA2 (``op / torch FA2 <= 1.05``), the kernel it runs,
   at least with calls queued back to back as in a training step (the 'queued' columns);
   ``global``: a global layer (head_dim 512, 16/8 heads, causal; plain, padded, packed) at
   ``--seqs``: the wide-head Triton kernel against SDPA with K/V repeated (as transformers
   calls it: the memory-efficient kernel) and FlexAttention with 32 x 32 tiles, and ffpa-attn's
   kernel (``kernels/ffpa.py``) where ffpa-attn loads (else the line says why not): time, TFLOP/s,
   peak memory; the data for ``wide_head.CROSSOVERS`` and ``ffpa.CROSSOVERS``. Then a soft-capped
   causal layer (Gemma-2's cap 50) at head_dim 128 and 256: the wide-head kernel against
   transformers' eager attention and FlexAttention with the cap, beside SDPA without the cap.
   Under each shape, the tiles the wide-head kernels measured and picked on this GPU (first
   launch per shape). ``--cpu-dry-run`` runs this section on the CPU at tiny sizes (Triton
   interpreted) to prove its code, measuring nothing;
   ``packed``: a full-attention layer (head_dim 128 and 256, 16/8 heads, causal) over 1, 4, 8
   and 16 packed documents and over a padded row, at ``--packed-seqs`` (8k-32k): the op (torch's
   FA2 varlen, a sequence per document) against SDPA with the block-diagonal mask and against
   SDPA's ``is_causal``: the data for a GPU crossover of packed and padded full layers, which
   keep SDPA on a GPU until measured (``--cpu-dry-run --sections packed`` runs its code on the CPU);
3. ``padded``: a padded batch: the op on left- and right-padded batches (1/8 and 1/2 of each
   row padding) against no padding, with the sequences' varlen pass in its two forms
   (gathered, in place): the data for ``fa2_varlen.IN_PLACE_MOST_PADDING``; ``profile``: where one
   left-padded call's time goes, per form;
   ``short``: short lengths (``--short-seqs``): the op against SDPA with the mask, head_dim
   256 and batch 4 unless ``--short-head-dims`` and ``--short-batches`` ask for others,
   plain and left-padded (a layout per call, and one shared), w = 512 and 1024, calls
   queued: the data for the CUDA crossovers (``fa2.SHORT_KEYS``);
4. ``model``: a training step of a 6-layer Gemma-4 (5 sliding layers, 1 global with
   head_dim 512) at the same head shapes, bf16, compiled with ``backend=compile_pass.backend``
   against plain inductor: interleaved medians and peak memory; ``--model-padded`` takes a
   batch of 2 with a row left-padded by a quarter. Lengths at or below the crossovers keep
   SDPA (COMPILE_PASS_SHORT_KEYS=0 rewrites them, to measure there);
   ``measure``: kernel choice measured on this GPU (``measure_on_device.py``, the cache ignored):
   Gemma-4's global layer (causal; plain, padded, packed) and sliding layer (plain, padded,
   packed, images), GPT-OSS's sliding and full layers, a narrower value, at ``--seqs``: each
   kernel against SDPA, checked first, the choice and the table; GPT-OSS's attention spelled
   out in ops and compiled against SDPA with the mask; then the ``model`` step with
   measurement on (its first compile's time against inductor's);
5. the printed lines, headed by the GPU's name and the date, are appended to
   benchmarks/RESULTS.md (``--no-record`` skips that).

Without a CUDA GPU it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_model import CONFIG as CPU_MODEL_CONFIG

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
HEADS, KV_HEADS, HEAD_DIM, WINDOW = 16, 8, 256, 1024
# The CPU benchmark's model at 26B-A4B's attention shapes; a small vocabulary keeps the
# logits of long sequences in memory.
MODEL_CONFIG = dict(
    CPU_MODEL_CONFIG,
    hidden_size=2048,
    intermediate_size=4096,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    global_head_dim=512,
    sliding_window=WINDOW,
    vocab_size=32768,
    vocab_size_per_layer_input=32768,
)
TARGET_OVER_FA2 = 1.05
QUEUED_CALLS = 8
SECTIONS = ("layer", "global", "packed", "padded", "profile", "short", "model", "measure")


class Printer:
    """Prints lines and keeps them for RESULTS.md."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def interleaved_medians_ms(steps: dict, repeats: int, calls: int = 1) -> dict[str, float]:
    """Median milliseconds of each step, the steps taking turns; one warm-up call each. With
    ``calls`` > 1 a timing spans that many calls back to back (per call: the CPU queues the
    next call while the GPU runs, as in a training step) and is divided by it."""
    import torch

    for step in steps.values():
        step()
    torch.cuda.synchronize()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


def layer_medians_ms(say: Printer, seq: int, steps: dict, repeats: int, calls: int = 1) -> dict[str, float] | None:
    """``interleaved_medians_ms``, or None (said) when the GPU runs out of memory."""
    import torch

    try:
        return interleaved_medians_ms(steps, repeats, calls)
    except torch.cuda.OutOfMemoryError:
        say(f"{seq:6d} out of memory")
        return None
    finally:
        torch.cuda.empty_cache()


def run_tests(say: Printer) -> bool:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "tests/ops/test_op_cuda.py",
        "tests/kernels/test_flash_contract.py",
        "tests/kernels/test_torch_flash.py",
        "tests/kernels/test_wide_head.py",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    say(f"$ {' '.join(command[2:])}")
    for line in done.stdout.strip().splitlines()[-12:]:
        say(f"  {line}")
    if "SKIPPED" in done.stdout:
        say("  note: skipped tests above did not run on this machine")
    return done.returncode == 0


def layer_inputs(batch: int, seq: int, head_dim: int = HEAD_DIM):
    """Seeded bf16 q, k, v (requiring grad) and grad_out of one layer, each (B, S, H, D) as the
    projections produce it; attention layers pass ``.transpose(1, 2)`` views of them."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seq)

    def storage(heads):
        return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (storage(h).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, storage(HEADS)


def causal_band(seq: int, window: int):
    """The sliding band as transformers' boolean mask: key j visible from query i when i - w < j <= i."""
    import torch

    positions = torch.arange(seq, device="cuda")
    return (positions[None, :] > positions[:, None] - window) & (positions[None, :] <= positions[:, None])


def time_layer(say: Printer, seqs: list[int], repeats: int) -> None:
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention

    try:
        from flash_attn import flash_attn_func
    except ImportError:
        flash_attn_func = None
        say("# flash-attn is not importable: no direct flash-attn timing")
    groups = HEADS // KV_HEADS
    say(
        f"# one sliding layer, fwd+bwd, bf16, batch 1, {HEADS} heads, {KV_HEADS} kv heads, "
        f"head_dim {HEAD_DIM}, window {WINDOW}; interleaved median of {repeats}, ms"
    )
    say(
        f"# 'queued': the same, {QUEUED_CALLS} calls back to back per timing (the CPU runs ahead of the GPU, "
        "as in a training step), ms per call"
    )
    say(
        f"{'S':>6} {'op':>9} {'sdpa':>9} {'torch FA2':>10} {'flash-attn':>11} {'sdpa/op':>8} {'op/torch FA2':>13} "
        f"{'op queued':>10} {'FA2 queued':>11} {'op/FA2 queued':>14}"
    )

    def one_length(seq):
        q, k, v, grad_out = layer_inputs(1, seq)
        # SDPA layout: (B, H, S, D) views of that storage, as attention layers pass them.
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        band = causal_band(seq, WINDOW)

        def gradients(out, grad):
            torch.autograd.grad(out, (q, k, v), grad)

        steps = {
            "op": lambda: gradients(sliding_window_attention(q_, k_, v_, window=(WINDOW - 1, 0)), grad_out_),
            "sdpa": lambda: gradients(
                F.scaled_dot_product_attention(
                    q_,
                    k_.repeat_interleave(groups, dim=1),
                    v_.repeat_interleave(groups, dim=1),
                    attn_mask=band[None, None],
                ),
                grad_out_,
            ),
        }

        def raw_fa2():
            scale = HEAD_DIM**-0.5
            window = dict(scale=scale, window_size_left=WINDOW - 1, window_size_right=0)
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q.detach(), k.detach(), v.detach(), None, None, seq, seq, 0.0, False, False, **window
            )
            torch.ops.aten._flash_attention_backward(
                grad_out,
                q.detach(),
                k.detach(),
                v.detach(),
                out,
                lse,
                None,
                None,
                seq,
                seq,
                0.0,
                False,
                rng,
                unused,
                **window,
            )

        steps["torch FA2"] = raw_fa2  # on the (B, S, H, D) storage itself
        if flash_attn_func is not None:
            steps["flash-attn"] = lambda: gradients(
                flash_attn_func(q, k, v, causal=True, window_size=(WINDOW - 1, 0)), grad_out
            )
        ms = layer_medians_ms(say, seq, steps, repeats)
        queued = layer_medians_ms(say, seq, {name: steps[name] for name in ("op", "torch FA2")}, repeats, QUEUED_CALLS)
        if ms is None or queued is None:
            return
        ratio, queued_ratio = ms["op"] / ms["torch FA2"], queued["op"] / queued["torch FA2"]
        ms.setdefault("flash-attn", float("nan"))
        say(
            f"{seq:6d} {ms['op']:9.2f} {ms['sdpa']:9.2f} {ms['torch FA2']:10.2f} {ms['flash-attn']:11.2f} "
            f"{ms['sdpa'] / ms['op']:7.2f}x {ratio:12.3f}{' ' if ratio <= TARGET_OVER_FA2 else '!'} "
            f"{queued['op']:10.2f} {queued['torch FA2']:11.2f} "
            f"{queued_ratio:13.3f}{' ' if queued_ratio <= TARGET_OVER_FA2 else '!'}"
        )

    for seq in seqs:
        one_length(seq)
    say(f"# '!': the op is more than {100 * (TARGET_OVER_FA2 - 1):.0f}% slower than torch's FA2 called directly")


GLOBAL_HEAD_DIM = 512
# FlexAttention's tiles that compile at head_dim 512 on an H100 (NeMo-Automodel's Gemma-4 path;
# shared/REFERENCE.md, section 10), forward and backward, with BlockMask blocks of 32 x 32.
FLEX_TILES = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_M1=32, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=32, num_stages=1, num_warps=4)
FLEX_BLOCK = (32, 32)
PACKED_DOCUMENTS = 4


def global_masks(form: str, seq: int, device: str):
    """One form of a global layer's causal mask, batch 1: (key_padding, segment_ids, SDPA's
    boolean mask or None for ``is_causal``, Flex's mask_mod, the (query, key) pairs it shows).
    ``padded``: the first quarter of the row is padding (left padding); ``packed``: the row
    holds PACKED_DOCUMENTS documents of equal length."""
    import torch

    positions = torch.arange(seq, device=device)
    if form == "causal":
        return None, None, None, lambda b, h, q, kv: kv <= q, seq * (seq + 1) // 2
    if form == "padded":
        pad = seq // 4
        key_padding = (positions >= pad)[None]
        valid = key_padding[0]
        mask = (positions[None, :] <= positions[:, None]) & valid[None, :]
        return key_padding, None, mask, lambda b, h, q, kv: (kv <= q) & valid[kv], (seq - pad) * (seq - pad + 1) // 2
    length = -(-seq // PACKED_DOCUMENTS)
    documents = positions // length
    mask = (positions[None, :] <= positions[:, None]) & (documents[None, :] == documents[:, None])
    lengths = torch.bincount(documents).tolist()
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return None, documents[None], mask, lambda b, h, q, kv: (kv <= q) & (documents[kv] == documents[q]), pairs


def global_layers(
    say: Printer, seqs: list[int], repeats: int, device: str = "cuda", heads: int = HEADS, kv_heads: int = KV_HEADS
) -> None:
    """A global layer (head_dim 512, GQA, causal; plain, padded and packed), fwd+bwd: the
    wide-head Triton kernel (kernels/wide_head/__init__.py, called directly as the op's kernel), and
    ffpa-attn's (kernels/ffpa.py, likewise) where it loads, against what transformers runs, SDPA
    with K/V repeated to the query heads (it passes ``enable_gqa`` only up to head_dim 256,
    and SDPA then picks its memory-efficient kernel), and against
    FlexAttention compiled with 32 x 32 tiles. Time, TFLOP/s and peak memory side by side.

    TFLOP/s counts the useful work: 14 x pairs x D x H FLOPs, where pairs are the (query, key)
    pairs the mask shows: the forward's two matmuls (Q K^T, P V) and the backward's five (Q K^T
    again, dO V^T, P^T dO, dS^T Q, dS K), each 2 x pairs x D x H. For a causal row, pairs ~
    S^2 / 2: 7 x S^2 x D x H, shared/REFERENCE.md's 3.5 x 2 x S^2 x D x H."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compile_pass.kernels import ffpa, wide_head
    from compile_pass.kernels.contract import AttentionCall

    groups = heads // kv_heads
    on_gpu = device == "cuda"
    # Compiled on the GPU; eager (its reference path) in a CPU dry run, which proves the calls only.
    flex = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    if not on_gpu:
        say("# (dry run: Flex eager and forward only, as the CPU has no Flex backward)")
    ffpa_missing = ffpa.cannot_run(torch.device(device), torch.bfloat16, GLOBAL_HEAD_DIM)
    if ffpa_missing:
        say(f"# ffpa-attn not timed: {ffpa_missing}")
    ffpa_columns = "" if ffpa_missing else f" | {'ffpa ms':>9} {'TF/s':>6} {'GiB':>6} {'sdpa/ffpa':>9}"
    say(
        f"# global layer, fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads, head_dim {GLOBAL_HEAD_DIM}, "
        "causal "
        f"(padded: a quarter of the row left-padded; packed: {PACKED_DOCUMENTS} documents); interleaved median of "
        f"{repeats}, ms; TFLOP/s = 14 x visible pairs x D x H / time; peak GiB of one call"
    )
    say(
        f"{'form':>7} {'S':>6} | {'kernel ms':>9} {'TF/s':>6} {'GiB':>6} | {'sdpa backend':>20} {'ms':>8} {'TF/s':>6} "
        f"{'GiB':>6} | {'flex32 ms':>9} {'TF/s':>6} {'GiB':>6} | {'sdpa/kernel':>11} {'flex/kernel':>11}{ffpa_columns}"
    )

    def one_case(form, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(h):
            return torch.randn(1, seq, h, GLOBAL_HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads)
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        key_padding, segment_ids, mask, mask_mod, pairs = global_masks(form, seq, device)
        # Compiled on the GPU: built eagerly, a 32k mask holds S^2 intermediates.
        block_mask = create_block_mask(
            mask_mod, 1, None, seq, seq, device=device, BLOCK_SIZE=FLEX_BLOCK, _compile=on_gpu
        )
        scale = GLOBAL_HEAD_DIM**-0.5
        call = AttentionCall(q_.detach(), k_.detach(), v_.detach(), -1, 0, scale, key_padding, segment_ids)

        def step_of(chosen):  # the op's kernel called as the op calls it, forward and backward
            def step():
                plan = chosen.plan(call)
                out, lse = chosen.forward(call, plan)
                chosen.backward(call, plan, grad_out_, out, lse)

            return step

        def repeated_kv():
            return k_.repeat_interleave(groups, dim=1), v_.repeat_interleave(groups, dim=1)

        def sdpa():
            k_full, v_full = repeated_kv()
            out = F.scaled_dot_product_attention(
                q_,
                k_full,
                v_full,
                attn_mask=None if mask is None else mask[None, None],
                is_causal=mask is None,
                scale=scale,
            )
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def flex_step():
            if not on_gpu:  # Flex has no backward on the CPU: the dry run calls its forward only
                return flex(
                    q_.detach(),
                    k_.detach(),
                    v_.detach(),
                    block_mask=block_mask,
                    scale=scale,
                    enable_gqa=True,
                    kernel_options=FLEX_TILES,
                )
            out = flex(q_, k_, v_, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=FLEX_TILES)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        k_full, _ = repeated_kv()
        backend = torch._fused_sdp_choice(
            q_, k_full, k_full, None if mask is None else mask[None, None], 0.0, mask is None, scale=scale
        )
        backend = torch.nn.attention.SDPBackend(backend).name
        del k_full
        steps = {"kernel": step_of(wide_head.WIDE_HEAD), "sdpa": sdpa, "flex": flex_step}
        if not ffpa_missing:
            steps["ffpa"] = step_of(ffpa.FFPA_ATTN)
        peaks = {}
        try:
            for name, step in steps.items():
                step()  # compiles Flex; the kernels' first launch
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        except torch.cuda.OutOfMemoryError:
            say(f"{form:>7} {seq:6d} out of memory")
            torch.cuda.empty_cache()
            return
        ms = layer_medians_ms(say, seq, steps, repeats)
        if ms is None:
            return
        flops = 14 * pairs * GLOBAL_HEAD_DIM * heads
        tflops = {name: flops / (value * 1e-3) / 1e12 for name, value in ms.items()}
        say(
            f"{form:>7} {seq:6d} | {ms['kernel']:9.2f} {tflops['kernel']:6.1f} {peaks['kernel']:6.2f} | {backend:>20} "
            f"{ms['sdpa']:8.2f} {tflops['sdpa']:6.1f} {peaks['sdpa']:6.2f} | {ms['flex']:9.2f} {tflops['flex']:6.1f} "
            f"{peaks['flex']:6.2f} | {ms['sdpa'] / ms['kernel']:10.2f}x {ms['flex'] / ms['kernel']:10.2f}x"
            + (
                ""
                if ffpa_missing
                else f" | {ms['ffpa']:9.2f} {tflops['ffpa']:6.1f} {peaks['ffpa']:6.2f} {ms['sdpa'] / ms['ffpa']:8.2f}x"
            )
        )
        say(tile_picks(call))

    for form in ("causal", "padded", "packed"):
        for seq in seqs:
            one_case(form, seq)


def tile_picks(call) -> str:
    """The tiles each wide-head kernel ran at for this call: the pick the kernel measured on this
    device (``wide_head_tiles.picks``), or, where nothing was measured (interpreted), the first
    config that fits."""
    from compile_pass.kernels import wide_head
    from compile_pass.kernels.wide_head import tiles as wide_head_tiles

    picks = wide_head_tiles.picks()
    masked = call.key_padding is not None or call.segment_ids is not None
    first = wide_head.WIDE_HEAD.candidates(call.query.device, call.query.dtype, call.query.shape[-1], masked)[0]
    ran = {name: picks.get(wide_head.tune_key(name, call)) for name in ("forward", "dV", "dK", "dQ")}
    how = "measured on this device" if all(ran.values()) else "not all measured: the first config that fits ran"
    cells = ", ".join(f"{name} {tuple(tiles or first)}" for name, tiles in ran.items())
    return f"#   tiles (stationary, streamed, d_chunk, warps, stages), {how}: {cells}"


SOFTCAP = 50.0  # Gemma-2's attention cap
SOFTCAP_HEAD_DIMS = (128, 256)


def softcap_layers(
    say: Printer, seqs: list[int], repeats: int, device: str = "cuda", heads: int = HEADS, kv_heads: int = KV_HEADS
) -> None:
    """A soft-capped causal layer (Gemma-2's: ``cap * tanh(scores / cap)``, cap 50) at head_dim
    128 and 256, fwd+bwd, bf16: the wide-head Triton kernel (called as the op calls it) against
    what transformers runs for such models (eager attention: K/V repeated, the S^2 scores, tanh,
    the causal mask, softmax in fp32), against FlexAttention with the cap as its score_mod, and
    beside torch's FA2 on the same layer without the cap (SDPA ``is_causal``: no torch kernel
    caps), which says what the cap costs. Time and peak memory side by side; the tiles picked."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compile_pass.kernels import wide_head
    from compile_pass.kernels.contract import AttentionCall

    groups = heads // kv_heads
    on_gpu = device == "cuda"
    flex = torch.compile(flex_attention, dynamic=False) if on_gpu else flex_attention
    say(
        f"# soft-capped causal layer (cap {SOFTCAP:g}), fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads; "
        f"interleaved median of {repeats}, ms; peak GiB of one call; 'sdpa, no cap': the layer without the cap"
    )
    say(
        f"{'D':>4} {'S':>6} | {'kernel ms':>9} {'GiB':>6} | {'eager ms':>9} {'GiB':>6} | {'flex ms':>9} {'GiB':>6} | "
        f"{'sdpa, no cap':>12} | {'eager/kernel':>12} {'flex/kernel':>11} {'kernel/no cap':>13}"
    )

    def one_case(head_dim, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(h, head_dim=head_dim, seq=seq, gen=gen):
            return torch.randn(1, seq, h, head_dim, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads)
        q_, k_, v_, grad_out_ = (x.transpose(1, 2) for x in (q, k, v, grad_out))
        scale = head_dim**-0.5
        call = AttentionCall(q_.detach(), k_.detach(), v_.detach(), -1, 0, scale, softcap=SOFTCAP)
        block_mask = create_block_mask(lambda b, h, i, j: j <= i, 1, None, seq, seq, device=device, _compile=on_gpu)

        def kernel_step(call=call):
            plan = wide_head.WIDE_HEAD.plan(call)
            out, lse = wide_head.WIDE_HEAD.forward(call, plan)
            wide_head.WIDE_HEAD.backward(call, plan, grad_out_, out, lse)

        def eager(seq=seq, q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v):
            scores = q_ @ k_.repeat_interleave(groups, dim=1).mT * scale
            scores = torch.tanh(scores / SOFTCAP) * SOFTCAP
            causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores.float(), dim=-1).to(q_.dtype)
            out = probs @ v_.repeat_interleave(groups, dim=1)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def capped(score, b, h, i, j):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        def flex_step(q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v, block_mask=block_mask):
            if not on_gpu:  # Flex has no backward on the CPU: the dry run calls its forward only
                return flex(q_.detach(), k_.detach(), v_.detach(), capped, block_mask, scale=scale, enable_gqa=True)
            out = flex(q_, k_, v_, capped, block_mask, scale=scale, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        def uncapped(q_=q_, k_=k_, v_=v_, grad_out_=grad_out_, q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=True)
            torch.autograd.grad(out, (q, k, v), grad_out_)

        steps = {"kernel": kernel_step, "eager": eager, "flex": flex_step, "no cap": uncapped}
        peaks = {}
        for name, step in steps.items():
            try:
                step()  # compiles Flex; the kernels' first launch (which measures their tiles)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            except torch.cuda.OutOfMemoryError:
                peaks[name] = float("nan")
                torch.cuda.empty_cache()
        ms = layer_medians_ms(say, seq, {name: steps[name] for name in steps if peaks[name] == peaks[name]}, repeats)
        if ms is None:
            return
        ms = {name: ms.get(name, float("nan")) for name in steps}  # nan: out of memory
        say(
            f"{head_dim:4d} {seq:6d} | {ms['kernel']:9.2f} {peaks['kernel']:6.2f} | {ms['eager']:9.2f} "
            f"{peaks['eager']:6.2f} | {ms['flex']:9.2f} {peaks['flex']:6.2f} | {ms['no cap']:12.2f} | "
            f"{ms['eager'] / ms['kernel']:11.2f}x {ms['flex'] / ms['kernel']:10.2f}x "
            f"{ms['kernel'] / ms['no cap']:12.2f}x"
        )
        say(tile_picks(call))

    for head_dim in SOFTCAP_HEAD_DIMS:
        for seq in seqs:
            one_case(head_dim, seq)


# The packed section: documents a row, and head_dims (FA2's range) of a full-attention layer.
PACKED_COUNTS = (1, 4, 8, 16)
PACKED_HEAD_DIMS = (128, 256)


def packed_full_layers(
    say: Printer,
    seqs: list[int],
    repeats: int,
    device: str = "cuda",
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dims=PACKED_HEAD_DIMS,
) -> None:
    """A full-attention layer over packed documents and padded rows, fwd+bwd, bf16, batch 1:
    the op (on a GPU torch's FA2 varlen, one sequence per document: the policy keeps SDPA for
    such calls until this measures them, and the op, called directly, runs its first exact
    kernel) against what transformers runs, SDPA with the block-diagonal causal mask (or the
    padded one) and K/V repeated, and against SDPA's ``is_causal`` on the same row unpacked
    (the least an unpacked row costs). Forms: N documents of equal length (N = 1: the batch
    turned out unpacked, the op's one causal call), and a row whose first quarter is padding.
    Time and peak memory side by side; the ratios are SDPA's time over the op's: the data for a
    GPU crossover of such calls (none yet: ``fa2.no_left_bound_unmeasured``)."""
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention

    groups = heads // kv_heads
    say(
        f"# packed full-attention layer, fwd+bwd, bf16, batch 1, {heads} heads, {kv_heads} kv heads, causal; "
        f"interleaved median of {repeats}, ms; peak GiB of one call; ratio = sdpa / op"
    )
    say(
        f"{'D':>4} {'form':>9} {'S':>6} {'sdpa mask':>10} {'GiB':>6} {'is_causal':>10} {'op':>9} {'GiB':>6} "
        f"{'mask/op':>8} {'causal/op':>9}"
    )

    def one_case(head_dim, form, seq):
        gen = torch.Generator(device=device).manual_seed(seq)

        def storage(count):
            return torch.randn(1, seq, count, head_dim, device=device, dtype=torch.bfloat16, generator=gen)

        q, k, v = (storage(h).transpose(1, 2).requires_grad_() for h in (heads, kv_heads, kv_heads))
        grad_out = storage(heads).transpose(1, 2)
        positions = torch.arange(seq, device=device)
        causal = positions[None, :] <= positions[:, None]
        if form == "padded":
            valid = positions >= seq // 4
            mask, masks = causal & valid[None, :], {"key_padding": valid[None]}
        else:
            ids = positions * int(form.split()[0]) // seq
            mask, masks = causal & (ids[None, :] == ids[:, None]), {"segment_ids": ids[None]}

        def sdpa(**how):
            def step():
                out = F.scaled_dot_product_attention(
                    q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), **how
                )
                torch.autograd.grad(out, (q, k, v), grad_out)

            return step

        def op():
            out = sliding_window_attention(q, k, v, window=(-1, 0), **masks)
            torch.autograd.grad(out, (q, k, v), grad_out)

        steps = {"mask": sdpa(attn_mask=mask[None, None]), "causal": sdpa(is_causal=True), "op": op}
        ms = layer_medians_ms(say, seq, steps, repeats)
        if ms is None:
            return
        peaks = {}
        for name in ("mask", "op"):
            torch.cuda.reset_peak_memory_stats()
            steps[name]()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        say(
            f"{head_dim:4d} {form:>9} {seq:6d} {ms['mask']:10.2f} {peaks['mask']:6.2f} {ms['causal']:10.2f} "
            f"{ms['op']:9.2f} {peaks['op']:6.2f} {ms['mask'] / ms['op']:7.2f}x {ms['causal'] / ms['op']:8.2f}x"
        )

    forms = [f"{count} docs" for count in PACKED_COUNTS] + ["padded"]
    for head_dim in head_dims:
        for form in forms:
            for seq in seqs:
                one_case(head_dim, form, seq)  # its tensors freed before the next


@contextlib.contextmanager
def cpu_stand_ins():
    """For ``--cpu-dry-run``: torch.cuda's timing events, synchronize and memory statistics
    replaced by wall-clock events and zeros, so that a section's code runs on the CPU and the
    times it prints are the CPU's (memory 0). Nothing printed then is a GPU measurement."""
    import time

    import torch

    class WallClockEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    names = ("Event", "synchronize", "reset_peak_memory_stats", "max_memory_allocated", "empty_cache")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.Event = WallClockEvent
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    torch.cuda.max_memory_allocated = lambda device=None: 0
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def time_model(say: Printer, seqs: list[int], repeats: int, padded: bool = False) -> None:
    """The training step, compile_pass against inductor; ``padded``: a batch of 2 whose second
    row is left-padded by a quarter (attention_mask, labels -100 there), as TRL pads."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    import compile_pass

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**MODEL_CONFIG)).to("cuda", torch.bfloat16).train()
    models = {"inductor": copy.deepcopy(model), "compile_pass": model}
    compiled = {
        "inductor": torch.compile(models["inductor"], fullgraph=True),
        "compile_pass": torch.compile(models["compile_pass"], backend=compile_pass.backend, fullgraph=True),
    }
    c = MODEL_CONFIG
    batch = "batch 2, the second row left-padded by a quarter" if padded else "batch 1"
    say(
        f"# Gemma-4 {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
        f"{c['num_key_value_heads']} kv heads, head_dim {c['head_dim']} (global {c['global_head_dim']}), "
        f"window {c['sliding_window']}, bf16, {batch}, fwd+bwd; interleaved median of {repeats}"
    )
    say(
        f"{'S':>6} {'inductor ms':>12} {'compile_pass ms':>16} {'speedup':>8} {'inductor GiB':>13} "
        f"{'compile_pass GiB':>17}"
    )

    def one_length(seq):
        rows = 2 if padded else 1
        ids = torch.randint(
            0,
            MODEL_CONFIG["vocab_size"],
            (rows, seq),
            device="cuda",
            generator=torch.Generator(device="cuda").manual_seed(seq),
        )
        inputs = {"input_ids": ids, "labels": ids}
        if padded:
            attention_mask = torch.ones_like(ids)
            attention_mask[1, : seq // 4] = 0
            inputs = {
                "input_ids": ids,
                "attention_mask": attention_mask,
                "labels": ids.masked_fill(attention_mask == 0, -100),
            }

        def step_of(name):
            def step():
                models[name].zero_grad(set_to_none=True)
                compiled[name](**inputs, use_cache=False).loss.backward()

            return step

        steps = {name: step_of(name) for name in compiled}
        try:
            first = {}
            with compile_pass.decisions() as report:
                for name, step in steps.items():  # compiles; the timed warm-up below reuses it
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    first[name] = time.perf_counter() - started
            say(
                f"# first step at {seq} (compiles where no graph takes the length): "
                f"inductor {first['inductor']:.1f} s, compile_pass {first['compile_pass']:.1f} s "
                "(its kernel measurements included)"
            )
            if seq == seqs[0]:
                for line in report.table().splitlines():
                    say(f"#   {line}")
            peaks = {}
            for name, step in steps.items():
                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            ms = interleaved_medians_ms(steps, repeats)
        except torch.cuda.OutOfMemoryError:
            say(f"{seq:6d} out of memory")
            torch.cuda.empty_cache()
            return
        say(
            f"{seq:6d} {ms['inductor']:12.1f} {ms['compile_pass']:16.1f} {ms['inductor'] / ms['compile_pass']:7.2f}x "
            f"{peaks['inductor']:13.2f} {peaks['compile_pass']:17.2f}"
        )

    for seq in seqs:
        one_length(seq)


def measured_on_this_gpu(say: Printer, seqs: list[int], model_seqs: list[int], repeats: int, skip_model: bool) -> None:
    """Kernel choice measured on this GPU (``measure_on_device.py``): every case measured afresh
    (the cache ignored), the choices, the table; the chain of ops against SDPA with the mask;
    then the training step with measurement on, its first compile's time against inductor's."""
    import measure_on_device

    from compile_pass import measure

    cases = [case for case in measure_on_device.CASES if case != "chain"]
    measure_on_device.measure_cases(say, "cuda", cases, seqs, "bfloat16", again=True)
    measure_on_device.chain_against_sdpa(say, seqs, repeats)
    if not skip_model:
        say(f"# the training step with kernels measured on this GPU (measure={measure.mode()!r})")
        time_model(say, model_seqs, repeats)


def record(say: Printer, argv: list[str]) -> None:
    import torch

    name = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    block = "\n".join([f"$ python benchmarks/gpu_check.py {' '.join(argv)}".rstrip(), *say.lines])
    with open(RESULTS, "a") as results:
        results.write(f"\n## gpu_check.py on {name}, {date}\n\n```\n{block}\n```\n")
    print(f"appended to {RESULTS.relative_to(ROOT)}")


@contextlib.contextmanager
def sequences_pass(most_padding: float):
    """The padded sequences' pass in one form while inside: ``fa2_varlen.IN_PLACE_MOST_PADDING`` set
    (-1: gathered always, 1: in place always), the op's own threshold restored after."""
    from compile_pass.kernels.fa2 import varlen as fa2_varlen

    default = fa2_varlen.IN_PLACE_MOST_PADDING
    fa2_varlen.IN_PLACE_MOST_PADDING = most_padding
    try:
        yield
    finally:
        fa2_varlen.IN_PLACE_MOST_PADDING = default


def time_padded_rows(say: Printer, seqs: list[int], repeats: int) -> None:
    """The cost of a padded batch: the op on a batch of 4 with the same valid tokens per row,
    left-padded (no padded row sees a key: the sequences' pass alone) and right-padded (the
    padded rows within the window see the last keys: one more varlen call), against no
    padding at all; each with the sequences' pass in its two forms, on the valid tokens
    gathered and on the batch in place (its padding runs computed and dropped), at a light
    and a heavy share of padding: the data for ``fa2_varlen.IN_PLACE_MOST_PADDING``."""
    import torch

    from compile_pass import sliding_window_attention
    from compile_pass.kernels.fa2 import varlen as fa2_varlen

    batch = 4
    say(
        f"# padded rows: one sliding layer, fwd+bwd, bf16, batch {batch}, window {WINDOW}, the op called directly; "
        f"interleaved median of {repeats}, ms; 'gathered'/'in place': the sequences' pass's two forms"
    )
    say(
        f"{'S':>6} {'padding':>8} {'no padding':>11} {'left gathered':>14} {'left in place':>14} "
        f"{'right gathered':>15} {'right in place':>15} {'gathered/in place':>18}"
    )
    default = fa2_varlen.IN_PLACE_MOST_PADDING

    def one_length(seq):
        leaves = layer_inputs(batch, seq)
        q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
        for share in (8, 2):
            padded = seq // share
            left = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
            left[:, :padded] = False
            right = left.flip(-1).contiguous()

            def step(padding, most_padding):
                def run():
                    with sequences_pass(most_padding):
                        out = sliding_window_attention(q, k, v, window=(WINDOW - 1, 0), key_padding=padding)
                        torch.autograd.grad(out, (q, k, v), grad_out)

                return run

            steps = {"none": step(None, default)}
            for name, padding in (("left", left), ("right", right)):
                steps[f"{name} gathered"] = step(padding, -1.0)
                steps[f"{name} in place"] = step(padding, 1.0)
            ms = layer_medians_ms(say, seq, steps, repeats)
            if ms is None:
                continue
            ratios = "/".join(f"{ms[f'{name} gathered'] / ms[f'{name} in place']:.2f}" for name in ("left", "right"))
            say(
                f"{seq:6d} {f'1/{share}':>8} {ms['none']:11.2f} {ms['left gathered']:14.2f} "
                f"{ms['left in place']:14.2f} "
                f"{ms['right gathered']:15.2f} {ms['right in place']:15.2f} {ratios + 'x':>18}"
            )

    for seq in seqs:
        one_length(seq)
    say(f"# the op's choice: in place up to {default:.0%} padding")


def profile_padded_call(say: Printer, seq: int) -> None:
    """Where a left-padded call's time goes, per form of the sequences' pass: the CUDA time of
    the ops of one fwd+bwd under torch.profiler (batch 4, 1/8 of each row padding)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from compile_pass import sliding_window_attention

    batch = 4
    leaves = layer_inputs(batch, seq)
    q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
    padding = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    padding[:, : seq // 8] = False

    def call():
        out = sliding_window_attention(q, k, v, window=(WINDOW - 1, 0), key_padding=padding)
        torch.autograd.grad(out, (q, k, v), grad_out)

    for form, most_padding in (("gathered", -1.0), ("in place", 1.0)):
        with sequences_pass(most_padding):
            call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        say(f"# profile: one left-padded call, S {seq}, batch {batch}, the sequences' pass {form}; CUDA time by op")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=48)
        for line in table.splitlines():
            say(f"#   {line}")


def time_short_lengths(say: Printer, seqs: list[int], repeats: int, head_dims=(HEAD_DIM,), batches=(4,)) -> None:
    """Where torch's FA2 starts to beat SDPA with the mask: the data for the CUDA crossovers
    (``fa2.SHORT_KEYS``). One sliding layer, fwd+bwd, bf16, by head_dim and batch (Gemma-4's
    256 and 4 unless asked; smaller heads and batches do less work a call), each call queued behind
    the last as in a training step; the op against SDPA with the boolean band mask (and the
    padding) and K/V repeated, as transformers calls it. Forms: plain; padded (every row but the
    first, the only one at batch 1, left-padded by a quarter), the op called directly (a layout
    per call, one host sync); padded with one layout for all calls, as the layers of a
    rewritten graph share one."""
    import torch
    import torch.nn.functional as F

    from compile_pass import sliding_window_attention
    from compile_pass.ops import sliding_window_attention_forward

    groups = HEADS // KV_HEADS
    say(
        f"# short lengths: one sliding layer, fwd+bwd, bf16, {QUEUED_CALLS} calls queued per timing; "
        f"median of {repeats}, ms per call; ratio = sdpa / op; 'shared': one varlen layout for every call"
    )
    say(f"{'D':>4} {'B':>2} {'w':>5} {'form':>13} {'S':>6} {'sdpa':>9} {'op':>9} {'ratio':>7}")
    cells = [
        (d, b, w, f)
        for d in head_dims
        for b in batches
        for w in (512, WINDOW)
        for f in ("plain", "padded", "padded shared")
    ]

    def one_cell(head_dim, batch, window, form, seq):
        leaves = layer_inputs(batch, seq, head_dim)
        q, k, v, grad_out = (x.transpose(1, 2) for x in leaves)
        padding = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
        if form != "plain":
            padding[1 if batch > 1 else 0 :, : seq // 4] = False  # left padding in every row but the first (if any)
        mask = causal_band(seq, window)[None, None] & padding[:, None, None, :]
        layout = torch.ops.compile_pass.varlen_layout(padding, None, window - 1, 0, torch.bfloat16, head_dim)

        def sdpa():
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask
            )
            torch.autograd.grad(out, (q, k, v), grad_out)

        def op():
            if form == "padded shared":
                out, _ = sliding_window_attention_forward(
                    q, k, v, window - 1, 0, head_dim**-0.5, padding, None, None, *layout
                )
            else:
                key_padding = padding if form == "padded" else None
                out = sliding_window_attention(q, k, v, window=(window - 1, 0), key_padding=key_padding)
            torch.autograd.grad(out, (q, k, v), grad_out)

        ms = layer_medians_ms(say, seq, {"sdpa": sdpa, "op": op}, repeats, QUEUED_CALLS)
        if ms is None:
            return
        say(
            f"{head_dim:4d} {batch:2d} {window:5d} {form:>13} {seq:6d} {ms['sdpa']:9.3f} {ms['op']:9.3f} "
            f"{ms['sdpa'] / ms['op']:6.2f}x"
        )

    for head_dim, batch, window, form in cells:
        for seq in seqs:
            one_cell(head_dim, batch, window, form, seq)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--model-seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--model-padded", action="store_true", help="the training step on a padded batch of 2")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=[name for name in SECTIONS if name != "profile"],
        help="what to measure (default: all but the profile)",
    )
    parser.add_argument(
        "--short-seqs",
        type=int,
        nargs="*",
        default=[128, 256, 512, 1024, 2048],
        help="lengths of the short-length table (none: skip it)",
    )
    parser.add_argument(
        "--short-head-dims", type=int, nargs="+", default=[HEAD_DIM], help="head_dims of the short-length table"
    )
    parser.add_argument("--short-batches", type=int, nargs="+", default=[4], help="batches of the short-length table")
    parser.add_argument(
        "--packed-seqs", type=int, nargs="+", default=[8192, 16384, 32768], help="lengths of the packed section"
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the global and packed sections asked for on the CPU at --seqs with 2 heads / 1 KV head "
        "(Triton interpreted, wall-clock times, memory 0; the op's CPU kernels in the packed one): proves "
        "their code runs; measures nothing",
    )
    args = parser.parse_args()

    if args.cpu_dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the wide-head kernels are created
        say = Printer()
        say("# CPU dry run: nothing below is a GPU measurement")
        with cpu_stand_ins():
            if "global" in args.sections:
                global_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1)
                softcap_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1)
            if "packed" in args.sections:
                packed_full_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1, head_dims=(16,))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: gpu_check.py measures the CUDA path and needs one", file=sys.stderr)
        return 1
    from compile_pass.kernels.fa2 import flash_attn as flash
    from compile_pass.kernels.policy import facts_of
    from compile_pass.ops import POLICY

    say = Printer()
    major, minor = torch.cuda.get_device_capability()
    version = flash.flash_attn_version()
    say(
        f"# {torch.cuda.get_device_name()} (sm{major}{minor}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"flash-attn {'.'.join(map(str, version)) if version else 'not installed'}"
    )
    choice = POLICY.choose(facts_of("cuda", torch.bfloat16, HEAD_DIM))
    say(f"# kernel at these shapes: {choice.name}, fast: {choice.fast}{f' ({choice.reason})' if choice.reason else ''}")
    choice = POLICY.choose(facts_of("cuda", torch.bfloat16, 512, keys=max(args.seqs)))
    say(
        f"# kernel of a global layer (head_dim 512, {max(args.seqs)} keys): {choice.name}, fast: {choice.fast}"
        f"{f' ({choice.reason})' if choice.reason else ''}"
    )
    tests_passed = True
    if not args.skip_tests:
        tests_passed = run_tests(say)
    sections = set(args.sections)
    if "layer" in sections:
        time_layer(say, args.seqs, args.repeats)
    if "global" in sections:
        global_layers(say, args.seqs, args.repeats)
        softcap_layers(say, args.seqs, args.repeats)
    if "packed" in sections:
        packed_full_layers(say, args.packed_seqs, args.repeats)
    if "padded" in sections:
        time_padded_rows(say, args.seqs[:2], args.repeats)
    if "profile" in sections:
        profile_padded_call(say, args.seqs[0])
    if "short" in sections and args.short_seqs:
        time_short_lengths(say, args.short_seqs, args.repeats, args.short_head_dims, args.short_batches)
    if "model" in sections and not args.skip_model:
        time_model(say, args.model_seqs, args.repeats, args.model_padded)
    if "measure" in sections:
        measured_on_this_gpu(say, args.seqs, args.model_seqs, args.repeats, args.skip_model)
    if not args.no_record:
        record(say, sys.argv[1:])
    return 0 if tests_passed else 1


if __name__ == "__main__":
    sys.exit(main())
