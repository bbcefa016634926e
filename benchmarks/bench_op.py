"""The sliding-window op against masked SDPA, forward + backward, on the CPU.

Baseline: what transformers runs for a sliding layer under ``attn_implementation="sdpa"``
on the CPU: K/V repeated to the query heads (``repeat_kv``) and
``F.scaled_dot_product_attention`` with the explicit boolean band mask (batch, 1, S, S).
Candidate: ``compile_pass.sliding_window_attention(window=(w - 1, 0))`` on un-repeated K/V.

Each (variant, S) is measured in two fresh processes, after a warm-up step at S=256
that loads the kernels' code:
- memory: glibc's mmap threshold is pinned at 64 KiB so freed tensors leave resident
  memory at once; peak memory is the process's peak resident memory during one
  forward + backward, above what it held before (the inputs);
- time: default allocator, median of the repeats. Both variants use the same
seeded inputs and the same thread count, in one run of this script.

    python benchmarks/bench_op.py                 # the issue's configuration
    python benchmarks/bench_op.py --seqs 2048 --repeats 2
    python benchmarks/bench_op.py --chunks        # query-chunk sweep at S=8192
    python benchmarks/bench_op.py --chunks --window 512 --head-dim 256   # Gemma-4's default sliding shape
    python benchmarks/bench_op.py --plot docs/op_speedup.png   # also draw the printed speedups
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from measure import median_seconds, peak_mib, pinned_env, plot_speedups

BATCH, HEADS, KV_HEADS = 1, 8, 4


def run_child(variant: str, seq: int, repeats: int, chunk: int | None, window: int, head_dim: int) -> dict:
    """repeats == 0 measures peak memory of one step; otherwise the median time."""
    import torch
    import torch.nn.functional as F

    import compile_pass
    from compile_pass.ops import chunked

    if chunk is not None:
        chunked.QUERY_CHUNK = chunk
    gen = torch.Generator().manual_seed(0)

    def inputs(length):
        # (B, S, H, D) storage viewed as (B, H, S, D): the layout model projections produce.
        def make(heads):
            return torch.randn(BATCH, length, heads, head_dim, generator=gen).transpose(1, 2).requires_grad_()

        # heads-last, as the gradient arriving through out.transpose(1, 2).reshape(b, s, h * d)
        grad_out = torch.randn(BATCH, length, HEADS, head_dim, generator=gen).transpose(1, 2)
        return make(HEADS), make(KV_HEADS), make(KV_HEADS), grad_out

    groups = HEADS // KV_HEADS

    def repeat_kv(x):
        b, h, s, d = x.shape
        return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)

    def step(q, k, v, grad_out):
        if variant == "sdpa":
            positions = torch.arange(q.shape[2])
            distance = positions[None, :] - positions[:, None]
            mask = ((distance <= 0) & (distance > -window)).expand(BATCH, 1, q.shape[2], q.shape[2])
            out = F.scaled_dot_product_attention(q, repeat_kv(k), repeat_kv(v), attn_mask=mask)
        else:
            out = compile_pass.sliding_window_attention(q, k, v, window=(window - 1, 0))
        out.backward(grad_out)
        for x in (q, k, v):
            x.grad = None

    step(*inputs(256))
    args = inputs(seq)
    if repeats == 0:
        return {"peak_mib": peak_mib(lambda: step(*args))}
    return {"seconds": median_seconds(lambda: step(*args), repeats)}


def _child(variant: str, seq: int, repeats: int, shape: argparse.Namespace, env: dict, chunk: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--seqs", str(seq), "--repeats", str(repeats)]
    cmd += ["--window", str(shape.window), "--head-dim", str(shape.head_dim)]
    if chunk is not None:
        cmd += ["--chunk", str(chunk)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_time(variant: str, seq: int, repeats: int, shape: argparse.Namespace, chunk: int | None = None) -> float:
    return _child(variant, seq, repeats, shape, dict(os.environ), chunk)["seconds"]


def measure_peak_mib(variant: str, seq: int, shape: argparse.Namespace) -> float:
    return _child(variant, seq, 0, shape, pinned_env(), None)["peak_mib"]


def machine_line() -> str:
    import torch

    return (
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", action="store_true", help="sweep the query chunk size at S=8192")
    parser.add_argument("--plot", help="write the speedup against S as a PNG (needs matplotlib)")
    parser.add_argument("--window", type=int, default=1024, help="w: each query sees w keys (default 1024)")
    parser.add_argument("--head-dim", type=int, default=128, help="default 128")
    parser.add_argument("--child", choices=["sdpa", "op"], help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_child(args.child, args.seqs[0], args.repeats, args.chunk, args.window, args.head_dim)))
        return

    print(machine_line())
    print(
        f"# fwd+bwd, fp32, batch {BATCH}, {HEADS} heads, {KV_HEADS} kv heads, "
        f"head_dim {args.head_dim}, window {args.window}; median of {args.repeats}"
    )
    if args.chunks:
        from compile_pass.ops.chunked import rows_per_chunk

        default = rows_per_chunk(args.window - 1, 0)
        default_s = measure_time("op", 8192, args.repeats, args)
        print(f"default: {default} rows per chunk, {default_s * 1e3:.1f} ms")
        for chunk in (32, 64, 96, 128, 160, 192, 256):
            seconds = measure_time("op", 8192, args.repeats, args, chunk)
            print(f"chunk {chunk:4d}  S=8192  op {seconds * 1e3:8.1f} ms  time / default {seconds / default_s:.2f}")
        return
    print(f"{'S':>6} {'sdpa ms':>10} {'op ms':>9} {'speedup':>8} {'sdpa MiB':>9} {'op MiB':>8} {'mem ratio':>9}")
    speedups = []
    for seq in args.seqs:
        base_s, ours_s = measure_time("sdpa", seq, args.repeats, args), measure_time("op", seq, args.repeats, args)
        base_mib, ours_mib = measure_peak_mib("sdpa", seq, args), measure_peak_mib("op", seq, args)
        speedups.append(base_s / ours_s)
        print(
            f"{seq:6d} {base_s * 1e3:10.1f} {ours_s * 1e3:9.1f} {base_s / ours_s:7.2f}x "
            f"{base_mib:9.1f} {ours_mib:8.1f} {base_mib / ours_mib:8.1f}x"
        )
    if args.plot:
        w = args.window
        limit = [seq / (w - w**2 / (2 * seq)) for seq in args.seqs]  # S*S over band scores
        plot_speedups(
            args.plot,
            args.seqs,
            {"sliding_window_attention vs masked SDPA, fwd+bwd (measured)": speedups, "limit: S*S / band scores": limit},
            f"One sliding layer, w={w}, {HEADS}/{KV_HEADS} heads, head_dim {args.head_dim}, fp32, CPU",
        )


if __name__ == "__main__":
    main()
