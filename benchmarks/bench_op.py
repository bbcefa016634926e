"""The sliding-window op against masked SDPA, forward + backward, on the CPU.

Baseline: what transformers runs for a sliding layer under ``attn_implementation="sdpa"``
on the CPU: K/V repeated to the query heads (``repeat_kv``) and
``F.scaled_dot_product_attention`` with the explicit boolean band mask (batch, 1, S, S).
Candidate: ``compile_pass.sliding_window_attention(window=(w - 1, 0))`` on un-repeated K/V.
Both get the same seeded inputs, fp32 (``--dtype bf16``: bf16), batch 1, heads-last storage as model projections give.

``--sweep`` (``length_sweep.py``) times the op against SDPA with the mask at every length from
16 tokens, compiled with the length dynamic, for every window, head_dim, batch, form and dtype.

Every other measurement runs in a fresh process, after a warm-up step at S=256:
- time: the median of ``--repeats`` steps, the least of ``--rounds`` such processes (SDPA's
  and the op's alternate, so a burst of other work on the machine hits one round of each,
  not one variant);
- memory (``--memory``): glibc's mmap threshold is pinned at 64 KiB so freed tensors leave
  resident memory at once; the process's peak resident memory during one step, above what it
  held before (the inputs).
SDPA scores all S*S pairs whatever the window, so it is measured once per (S, head_dim) and
shared by the windows. A row's compute limit is S*S over the band's scores (row i sees
min(i + 1, w) keys): the ratio the op would reach if each of its scores cost what one of
SDPA's does. ``share`` is the measured ratio over that limit.

Each row prints as soon as it is measured, with the 1-minute load average then. Measurements
are appended to ``--results`` (JSON lines); rerunning with the same file skips what it holds,
so an interrupted sweep resumes where it stopped.

``--busy`` starts a CPU-bound process (a Python busy loop) next to every measurement, as
another job on the machine would: both variants are timed under the same load.

    python benchmarks/bench_op.py                        # w 256/512/1024 x head_dim 64/128/256 x S 4096/8192/16384
    python benchmarks/bench_op.py --windows 512 --head-dims 64 --seqs 4096 8192 --heads 4 2
    python benchmarks/bench_op.py --busy --results busy.jsonl
    python benchmarks/bench_op.py --memory --windows 1024 --head-dims 128 --seqs 2048 4096 8192 16384
    python benchmarks/bench_op.py --chunks --windows 256 --head-dims 64  # the op's time per query-chunk size, S=8192
    python benchmarks/bench_op.py --kernel               # aten's CPU kernel: cost per score by rows per entry
    python benchmarks/bench_op.py --ceiling --head-dims 64 128 --seqs 8192  # least time of aten calls over the band
    python benchmarks/bench_op.py --plot docs/op_speedup.png --windows 1024 --head-dims 128 --seqs 2048 4096 8192 16384
    python benchmarks/bench_op.py --images 4 256 --windows 512 --head-dims 128 --seqs 4096 8192   # with image blocks

``--images N L`` puts N images of L tokens each, evenly spaced, in the row: SDPA gets
Gemma-3/4's sliding mask with bidirectional image blocks (``kv > q - w AND (kv <= q OR same
image)``), the op the block ids (``block_ids=``).

``--chunked-attention`` reads each window w as a chunk size c: SDPA gets Llama-4's chunked
mask (``kv // c == q // c AND kv <= q``), the op the window (c - 1, 0) and the chunk ids
``i // c`` as ``segment_ids``, as the sliding rule rewrites a chunked layer.

    python benchmarks/bench_op.py --chunked-attention --windows 1024 8192 --head-dims 128 --seqs 8192 16384

``--value-head-dim DV`` gives the value a narrower head_dim than query and key (MLA-style
layers): SDPA takes it as is, the op zero-padded to the query's head_dim with its output sliced
back, as the rules rewrite such a call.

    python benchmarks/bench_op.py --windows 512 --head-dims 256 --value-head-dim 128 --seqs 512 1024 1536 2048

``--overhead`` splits one call of the op into its layers, forward and backward apart, at each
S and head_dim (window ``--windows``' first, batch 1, plain and padded rows): aten's fused
kernel as the op calls it; the kernel's own bookkeeping around it (the logsumexp's layout,
rows without keys); choosing the kernel and building its mask (``policy.route``); and the
custom op's dispatch and argument checks. Microseconds per call, the median of interleaved
repeats.

    python benchmarks/bench_op.py --overhead --windows 512 --head-dims 64 256 --seqs 16 64 512

``--cache C`` times a prefill chunk after a cache, as ``generate(prefill_chunk_size=S)`` runs
one: S queries over C cached keys and their own (``Sk = C + S``), the band aligned to the last
key, the first C // 2 keys padding (a left-padded row); forward only, under ``no_grad``.
SDPA gets the band AND the padding, the op ``key_padding=``.

    python benchmarks/bench_op.py --cache 511 --windows 512 --head-dims 256 --seqs 256 512 1024 2048
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

# The package next to this script, not whichever checkout an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import Results, median_seconds, peak_mib, pinned_env, plot_speedups, processor  # noqa: E402

BATCH = 1


def run_child(args: argparse.Namespace) -> dict:
    """One measurement: peak memory of one step (repeats == 0) or the median time."""
    import torch
    import torch.nn.functional as F

    import compile_pass
    from compile_pass.kernels import policy
    from compile_pass.kernels.chunked.plan import ChunkTuning

    if args.chunk is not None:  # the policy the op obeys, for this process
        policy.POLICY = policy.POLICY.with_chunking(ChunkTuning(query_chunk=args.chunk))
    heads, kv_heads = args.heads
    head_dim, window = args.head_dims[0], args.windows[0]
    value_dim = args.value_head_dim or head_dim
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def inputs(length):
        # (B, S, H, D) storage viewed as (B, H, S, D): the layout model projections produce.
        def make(count, rows=length, dim=head_dim):
            return torch.randn(BATCH, rows, count, dim, generator=gen).to(dtype).transpose(1, 2).requires_grad_()

        # heads-last, as the gradient arriving through out.transpose(1, 2).reshape(b, s, h * d)
        grad_out = torch.randn(BATCH, length, heads, value_dim, generator=gen).to(dtype).transpose(1, 2)
        keys = length + args.cache
        return make(heads), make(kv_heads, keys), make(kv_heads, keys, value_dim), grad_out

    groups = heads // kv_heads

    def repeat_kv(x):
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)

    def block_ids(length):
        """N images of L tokens, evenly spaced (ids 0..N-1), -1 elsewhere; None without images."""
        if not args.images:
            return None
        count, tokens = args.images
        ids = torch.full((BATCH, length), -1)
        for image in range(count):
            start = (image + 1) * length // (count + 1) - tokens // 2
            ids[:, start : start + tokens] = image
        return ids

    def cached_step(q, k, v, grad_out):
        """A prefill chunk after ``args.cache`` cached keys, a left-padded row; forward only."""
        keys = k.shape[2]
        padding = torch.ones(BATCH, keys, dtype=torch.bool)
        padding[:, : args.cache // 2] = False
        with torch.no_grad():
            if args.child == "sdpa":
                distance = torch.arange(keys)[None, :] - (torch.arange(q.shape[2]) + args.cache)[:, None]
                band = (distance <= 0) & (distance > -window)
                mask = (band[None] & padding[:, None, :])[:, None]
                F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
            else:
                compile_pass.sliding_window_attention(q, k, v, window=(window - 1, 0), key_padding=padding)

    def step(q, k, v, grad_out):
        if args.cache:
            return cached_step(q, k, v, grad_out)
        blocks = block_ids(q.shape[2])
        chunk_ids = torch.arange(q.shape[2]).expand(BATCH, -1) // window if args.chunked_attention else None
        if args.child == "sdpa" and chunk_ids is not None:
            same_chunk = (chunk_ids[:, :, None] == chunk_ids[:, None, :]) & torch.ones(
                q.shape[2], q.shape[2], dtype=torch.bool
            ).tril()
            out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=same_chunk[:, None])
        elif args.child == "sdpa":
            positions = torch.arange(q.shape[2])
            distance = positions[None, :] - positions[:, None]
            upper = distance <= 0
            if blocks is not None:  # the same image, seen in both directions
                upper = upper | ((blocks[:, :, None] >= 0) & (blocks[:, :, None] == blocks[:, None, :]))
            mask = (upper & (distance > -window)).expand(BATCH, q.shape[2], q.shape[2])[:, None]
            out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
        else:
            # A narrower value is zero-padded to the query's head_dim and the output sliced, as the rules rewrite it.
            padded = F.pad(v, (0, head_dim - value_dim)) if value_dim < head_dim else v
            out = compile_pass.sliding_window_attention(
                q, k, padded, window=(window - 1, 0), block_ids=blocks, segment_ids=chunk_ids
            )[..., :value_dim]
        out.backward(grad_out)
        for x in (q, k, v):
            x.grad = None

    step(*inputs(256))
    data = inputs(args.seqs[0])
    if args.repeats == 0:
        return {"peak_mib": peak_mib(lambda: step(*data))}
    return {"seconds": median_seconds(lambda: step(*data), args.repeats)}


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` CPU-bound processes running for the duration of the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def measure(
    results: Results, args, variant: str, seq: int, window: int, head_dim: int, *, memory=False, chunk=None, round=0
) -> dict:
    """Time (or peak memory) of one variant in a fresh process; SDPA's does not depend on w."""
    repeats = 0 if memory else args.repeats
    shared_window = variant == "sdpa"
    key = (
        f"{variant} S={seq} w={'any' if shared_window else window} D={head_dim} heads={args.heads[0]}/{args.heads[1]} "
        f"{'memory' if memory else f'median of {repeats}'} busy={args.busy} chunk={chunk} round={round}"
        f"{f' images={args.images}' if args.images else ''}{' chunked-attention' if args.chunked_attention else ''}"
        f"{f' cache={args.cache}' if args.cache else ''}"
        f"{f' value_dim={args.value_head_dim}' if args.value_head_dim else ''}"
        f"{' bf16' if args.dtype == 'bf16' else ''}"
    )
    cmd = [sys.executable, __file__, "--child", variant, "--seqs", str(seq), "--repeats", str(repeats)]
    cmd += ["--windows", str(window), "--head-dims", str(head_dim), "--heads", *map(str, args.heads)]
    cmd += ["--images", *map(str, args.images)] if args.images else []
    cmd += ["--chunked-attention"] if args.chunked_attention else []
    cmd += ["--cache", str(args.cache)]
    cmd += ["--value-head-dim", str(args.value_head_dim)] if args.value_head_dim else []
    cmd += ["--dtype", args.dtype]
    if chunk is not None:
        cmd += ["--chunk", str(chunk)]
    env = pinned_env() if memory else dict(os.environ)

    def run():
        with busy_processes(args.busy):
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])

    return results.measure(key, run)


def fastest_rounds(results: Results, args, seq: int, window: int, head_dim: int) -> tuple[dict, dict]:
    """SDPA's and the op's least time over ``args.rounds`` alternating rounds."""
    rounds = [
        [measure(results, args, variant, seq, window, head_dim, round=index) for variant in ("sdpa", "op")]
        for index in range(args.rounds)
    ]
    return tuple(min((pair[i] for pair in rounds), key=lambda record: record["seconds"]) for i in range(2))


def compute_limit(seq: int, window: int, cache: int = 0) -> float:
    """SDPA's S * (S + C) scores over the band's: row i sees min(i + C + 1, w) keys."""
    band = sum(min(row + cache + 1, window) for row in range(seq))
    return seq * (seq + cache) / band


def machine_line(args) -> str:
    import torch

    import compile_pass

    heads, kv_heads = args.heads
    load = os.getloadavg()
    busy = (
        f"{args.busy} CPU-bound process(es) started alongside each measurement"
        if args.busy
        else "nothing started alongside"
    )
    return (
        f"# {processor()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; {busy}\n"
        f"# compile_pass from {Path(compile_pass.__file__).parent}\n"
        f"# {'forward, a prefill chunk after ' + str(args.cache) + ' cached keys' if args.cache else 'fwd+bwd'}, "
        f"{args.dtype}, "
        f"batch {BATCH}, {heads} heads, {kv_heads} kv heads; median of {args.repeats}"
        + (f", least of {args.rounds} rounds" if args.rounds > 1 else "")
    )


def sweep(args, results: Results) -> None:
    memory = args.memory
    header = f"{'w':>5} {'D':>4} {'S':>6} {'sdpa ms':>10} {'op ms':>9} {'ratio':>7} {'limit':>6} {'share':>6}"
    if memory:
        header += f" {'sdpa MiB':>9} {'op MiB':>8} {'mem ratio':>9}"
    print(header + f" {'load':>5}", flush=True)
    speedups = []
    for window in args.windows:
        for head_dim in args.head_dims:
            for seq in args.seqs:
                base, ours = fastest_rounds(results, args, seq, window, head_dim)
                ratio = base["seconds"] / ours["seconds"]
                limit = compute_limit(seq, window, args.cache)
                speedups.append(ratio)
                line = (
                    f"{window:5d} {head_dim:4d} {seq:6d} {base['seconds'] * 1e3:10.1f} {ours['seconds'] * 1e3:9.1f} "
                    f"{ratio:6.2f}x {limit:5.2f}x {ratio / limit:6.0%}"
                )
                if memory:
                    base_mib = measure(results, args, "sdpa", seq, window, head_dim, memory=True)["peak_mib"]
                    ours_mib = measure(results, args, "op", seq, window, head_dim, memory=True)["peak_mib"]
                    line += f" {base_mib:9.1f} {ours_mib:8.1f} {base_mib / ours_mib:8.1f}x"
                print(line + f" {max(base['load'], ours['load']):5.2f}", flush=True)
    if args.plot:
        (window,), (head_dim,) = args.windows, args.head_dims
        plot_speedups(
            args.plot,
            args.seqs,
            {
                "sliding_window_attention vs masked SDPA, fwd+bwd (measured)": speedups,
                "limit: S*S / band scores": [compute_limit(seq, window) for seq in args.seqs],
            },
            f"One sliding layer, w={window}, {args.heads[0]}/{args.heads[1]} heads, head_dim {head_dim}, fp32, CPU",
        )


def chunk_sweep(args, results: Results) -> None:
    from compile_pass.kernels.chunked.plan import rows_per_chunk

    (window,), (head_dim,) = args.windows, args.head_dims
    heads, kv_heads = args.heads
    default = rows_per_chunk(window - 1, 0, heads // kv_heads)
    chunks = (None, 32, 48, 64, 96, 128, 192, 256, 384)
    # Rounds in the outer loop: a burst of other work hits one round of every size, not one size.
    rounds = [
        {chunk: measure(results, args, "op", 8192, window, head_dim, chunk=chunk, round=index) for chunk in chunks}
        for index in range(args.rounds)
    ]
    least = {chunk: min((r[chunk] for r in rounds), key=lambda record: record["seconds"]) for chunk in chunks}
    default_s = least[None]["seconds"]
    print(
        f"# window {window}, head_dim {head_dim}, S=8192; default: {default} rows per chunk, {default_s * 1e3:.1f} ms"
    )
    for chunk in chunks[1:]:
        record = least[chunk]
        seconds = record["seconds"]
        print(
            f"chunk {chunk:4d}  op {seconds * 1e3:8.1f} ms  time / default {seconds / default_s:.2f}  load "
            f"{record['load']:.2f}",
            flush=True,
        )


def kernel_blocks(args) -> None:
    """aten's CPU flash kernel alone, one thread, CPU time: forward + backward cost per score
    of batches of (rows, keys) entries with a shared additive mask, as the op calls it. The
    kernel cuts an entry's rows into blocks of 32 below 192 rows, 64 below 768, 256 above."""

    import torch

    torch.set_num_threads(1)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    keys, heads = 607, args.heads[1]

    def cpu_seconds(call) -> float:
        call()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.process_time()
            call()
            best = min(best, time.process_time() - start)
        return best

    for head_dim in args.head_dims:
        print(
            f"# head_dim {head_dim}, {keys} keys an entry, {heads} heads; fwd+bwd ns per score, least of {args.repeats}"
        )
        costs = {}
        for rows in (64, 128, 192, 384, 768):
            entries = max(1, (1 << 22) // (rows * keys * heads))
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(entries, heads, rows, head_dim, generator=gen)
            k, v = (torch.randn(entries, heads, keys, head_dim, generator=gen) for _ in range(2))
            mask = torch.zeros(rows, keys)
            out, lse = forward(q, k, v, 0.0, False, attn_mask=mask, scale=0.125)
            grad = torch.randn_like(out)
            seconds = cpu_seconds(partial(forward, q, k, v, 0.0, False, attn_mask=mask, scale=0.125))
            seconds += cpu_seconds(partial(backward, grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=0.125))
            costs[rows] = seconds / (entries * heads * rows * keys) * 1e9
        for rows, cost in costs.items():
            print(f"rows {rows:4d}  {cost:6.2f} ns/score  x{cost / costs[768]:.2f} of 768 rows", flush=True)


def kernel_ceiling(args) -> None:
    """What aten's CPU flash kernel allows, timed alone (fwd+bwd, median of ``--repeats``, all
    threads): SDPA's one masked (S, S) call against the least time of the band's interior
    chunks of r query rows (stacked per KV head as the op does) computed in one batched call,
    either as the op computes them (w + r - 1 keys, one shared mask) or split into a mask-free
    rectangle of w - r - 1 keys plus a masked call over the 2r keys of its two triangles (what
    a logsumexp merge of the parts would run). Inputs are contiguous copies, and the first w
    rows, edges, copies and the merge are left out: no plan made of these calls beats the
    printed time, so ``share`` bounds what the op can reach with this kernel."""
    import torch

    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    heads, kv_heads = args.heads
    group = heads // kv_heads

    def seconds(entries: int, entry_heads: int, rows: int, keys: int, head_dim: int, masked: bool) -> float:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(entries, rows, entry_heads, head_dim, generator=gen).transpose(1, 2)
        k, v = (torch.randn(entries, keys, entry_heads, head_dim, generator=gen).transpose(1, 2) for _ in range(2))
        mask = torch.zeros(rows, keys) if masked else None
        out, lse = forward(q, k, v, 0.0, False, attn_mask=mask)
        grad = torch.randn_like(out)

        def step():
            forward(q, k, v, 0.0, False, attn_mask=mask)
            backward(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask)

        step()  # warm-up
        return median_seconds(step, args.repeats)

    print(
        f"{'w':>5} {'D':>4} {'S':>6} {'sdpa ms':>10} {'chunks':>14} {'split':>14} {'ceiling':>8} {'limit':>6} "
        f"{'share':>6}"
    )
    for window in args.windows:
        for head_dim in args.head_dims:
            for seq in args.seqs:
                sdpa = seconds(1, heads, seq, seq, head_dim, masked=True)
                chunked, split = {}, {}
                for rows in (32, 64, 96, 128, 192, 256, 384):
                    entries = max(1, round((seq - window) / rows))
                    chunked[rows] = seconds(entries, kv_heads, rows * group, window + rows - 1, head_dim, masked=True)
                    if rows < window - 1:
                        split[rows] = seconds(
                            entries, kv_heads, rows * group, window - rows - 1, head_dim, masked=False
                        )
                        split[rows] += seconds(entries, kv_heads, rows * group, 2 * rows, head_dim, masked=True)
                best = min(min(chunked.values()), min(split.values(), default=float("inf")))
                limit = compute_limit(seq, window)

                def least(times):
                    if not times:
                        return f"{'-':>14}"
                    rows = min(times, key=times.get)
                    return f"{times[rows] * 1e3:8.1f} r={rows:<3d}"

                print(
                    f"{window:5d} {head_dim:4d} {seq:6d} {sdpa * 1e3:10.1f} {least(chunked)} {least(split)} "
                    f"{sdpa / best:7.2f}x {limit:5.2f}x {sdpa / best / limit:6.0%}",
                    flush=True,
                )


def call_overhead(args) -> None:
    import torch

    torch.manual_seed(0)
    heads, kv_heads = args.heads
    print("    S    D    form  direction   aten us  +kernel us  +route us     +op us  op total us  aten share")
    for seq in args.seqs:
        for head_dim in args.head_dims:
            for form in ("plain", "padded"):
                for line in overhead_rows(seq, head_dim, form, heads, kv_heads, args.windows[0], args.repeats):
                    print(line, flush=True)


def overhead_rows(seq: int, head_dim: int, form: str, heads: int, kv_heads: int, window: int, repeats: int):
    """``call_overhead``'s forward and backward rows of one length, head_dim and form."""
    import statistics

    import torch

    from compile_pass.kernels import policy
    from compile_pass.kernels.contract import AttentionCall

    forward = torch.ops.compile_pass.sliding_window_attention_forward.default
    backward = torch.ops.compile_pass.sliding_window_attention_backward.default
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def make(count):  # heads-last storage, as projections give it
        return torch.randn(BATCH, seq, count, head_dim).transpose(1, 2)

    q, k, v, grad_out = make(heads), make(kv_heads), make(kv_heads), make(heads)
    padding = torch.ones(BATCH, seq, dtype=torch.bool)
    padding[:, : seq // 8] = False
    padding = padding if form == "padded" else None
    scale = head_dim**-0.5
    call = AttentionCall(q, k, v, window - 1, 0, scale, padding)
    route = policy.POLICY.route(call)
    whole = route.plan
    out, lse = route.kernel.forward(call, whole)

    def routed_forward():
        chosen = policy.POLICY.route(call)
        return chosen.kernel.forward(call, chosen.plan)

    def routed_backward():
        chosen = policy.POLICY.route(call)
        return chosen.kernel.backward(call, chosen.plan, grad_out, out, lse)

    layers = {
        "forward": {
            "aten": lambda: fused(q, k, v, 0.0, whole.causal, attn_mask=whole.mask, scale=scale),
            "kernel": lambda: route.kernel.forward(call, whole),
            "route": routed_forward,
            "op": lambda: forward(q, k, v, window - 1, 0, scale, padding),
        },
        "backward": {
            "aten": lambda: fused_backward(
                grad_out, q, k, v, out, lse, 0.0, whole.causal, attn_mask=whole.mask, scale=scale
            ),
            "kernel": lambda: route.kernel.backward(call, whole, grad_out, out, lse),
            "route": routed_backward,
            "op": lambda: backward(grad_out, q, k, v, out, lse, window - 1, 0, scale, padding),
        },
    }
    for direction, calls in layers.items():
        inner = max(3, int(2000 / (1 + seq * seq * head_dim / 4e5)))
        times = {name: [] for name in calls}
        for _ in range(repeats):
            for name, run in calls.items():
                times[name].append(median_seconds(run, inner) * 1e6)
        us = {name: statistics.median(values) for name, values in times.items()}
        yield (
            f"{seq:5d} {head_dim:4d} {form:>7s} {direction:>10s} {us['aten']:9.1f} "
            f"{us['kernel'] - us['aten']:+11.1f} {us['route'] - us['kernel']:+10.1f} {us['op'] - us['route']:+10.1f} "
            f"{us['op']:12.1f} {us['aten'] / us['op']:10.0%}"
        )


def main() -> None:
    if "--sweep" in sys.argv[1:]:  # every length, as a compiled model runs the op: length_sweep.py
        import length_sweep

        return length_sweep.main([arg for arg in sys.argv[1:] if arg != "--sweep"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 512, 1024], help="w: each query sees w keys")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, nargs=2, default=[8, 4], metavar=("HEADS", "KV_HEADS"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternating SDPA/op processes per row; the least time counts"
    )
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (two more processes a row)")
    parser.add_argument("--busy", type=int, nargs="?", const=1, default=0, help="CPU-bound processes to run alongside")
    parser.add_argument("--results", help="JSON-lines file of measurements, appended to and reused (resume)")
    parser.add_argument("--chunks", action="store_true", help="the op's time per query-chunk size at S=8192")
    parser.add_argument(
        "--kernel", action="store_true", help="aten's CPU kernel alone: cost per score by rows per entry"
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="aten's CPU kernel alone: the least time of the band's chunks"
    )
    parser.add_argument("--images", type=int, nargs=2, metavar=("N", "L"), help="N images of L tokens each in the row")
    parser.add_argument(
        "--chunked-attention", action="store_true", help="each window w is a chunk size: Llama-4's chunked mask"
    )
    parser.add_argument("--overhead", action="store_true", help="one call of the op split into its layers, fwd and bwd")
    parser.add_argument(
        "--cache", type=int, default=0, help="a prefill chunk after this many cached keys (forward only)"
    )
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the inputs' dtype (timed rows)")
    parser.add_argument(
        "--value-head-dim",
        type=int,
        help="a narrower value head_dim: SDPA takes it as is, the op zero-padded (sliced back)",
    )
    parser.add_argument(
        "--plot", help="write the speedup against S as a PNG (one window and head_dim; needs matplotlib)"
    )
    parser.add_argument("--child", choices=["sdpa", "op"], help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args)))
        return
    results = Results(args.results)
    print(machine_line(args), flush=True)
    if args.overhead:
        call_overhead(args)
    elif args.kernel:
        kernel_blocks(args)
    elif args.ceiling:
        kernel_ceiling(args)
    elif args.chunks:
        chunk_sweep(args, results)
    else:
        sweep(args, results)
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end", flush=True)


if __name__ == "__main__":
    main()
