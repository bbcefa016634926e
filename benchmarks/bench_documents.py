"""Full-attention layers over packed documents and padded rows on the CPU: the op's document
kernel (and the chunked kernel) against SDPA with the mask, forward + backward, side by side.

Packed: one row of S tokens cut into N documents of equal length (N = 1: the batch turned out
unpacked), causal within each. SDPA gets the block-diagonal causal mask (batch, 1, S, S) that
transformers builds for packed ``position_ids``, with K/V repeated to the query heads
(``repeat_kv``); the op the segment ids, K/V as they are.

Padded: a batch of ``--batch`` rows of S tokens, row b right-padded by ``fraction * S * b /
(batch - 1)`` tokens (the first row not at all, the last by the fraction), so the rows' lengths
differ as a padded batch's do. SDPA gets causal AND the key padding, the op ``key_padding=``.

With no document boundary or padding at all (N = 1, fraction 0) the op also runs against
SDPA's ``is_causal`` (what SDPA runs for an unpacked batch): the ``causal`` column.

Each variant is one forward and backward on the same seeded inputs, heads-last storage as
model projections give; the variants of a cell are timed in turn, ``--repeats`` rounds, and
each takes its median (a burst of other work hits one round of each, not one variant). Ratios
are SDPA's time over the variant's: above 1 the variant is faster. Each cell prints when it is
measured, with the 1-minute load average.

    python benchmarks/bench_documents.py                                   # fp32 and bf16, the default grid
    python benchmarks/bench_documents.py --dtypes fp32 --seqs 256 512 768 1024 --docs 1 4 --fractions 0 0.5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import compile_pass  # noqa: E402
from compile_pass.kernels import chunked, documents, policy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _heads_last(batch, seq, heads, dim, dtype, gen, grad=True):
    x = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    return x.requires_grad_() if grad else x


def _step(forward, inputs, grad_out, kernel=None):
    """One forward and backward; with ``kernel``, the op's policy holds only it (both ways), so
    the op runs it whatever its crossover says."""

    def run():
        saved = policy.POLICY
        if kernel is not None:
            policy.POLICY = policy.KernelPolicy(kernels=(kernel,))
        try:
            torch.autograd.grad(forward(), inputs, grad_out)
        finally:
            policy.POLICY = saved

    return run


def cell(form, dtype, seq, count, args):
    """{variant: seconds} of one cell: ``count`` documents (packed) or a padding ``fraction``."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads = args.heads
    batch = 1 if form == "packed" else args.batch
    q = _heads_last(batch, seq, heads, args.head_dim, dtype, gen)
    k, v = (_heads_last(batch, seq, kv_heads, args.head_dim, dtype, gen) for _ in range(2))
    grad_out = _heads_last(batch, seq, heads, args.head_dim, dtype, gen, grad=False)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    if form == "packed":
        ids = torch.arange(seq) * count // seq  # count documents of equal length
        mask = (causal & (ids[:, None] == ids[None, :]))[None, None]
        masks = {"segment_ids": ids[None]}
        plain = count == 1
    else:
        valid = torch.ones(batch, seq, dtype=torch.bool)
        for b in range(batch):
            padded = round(count * seq * b / max(1, batch - 1))
            if padded:
                valid[b, seq - padded :] = False
        mask = causal[None, None] & valid[:, None, None, :]
        masks = {"key_padding": valid}
        plain = count == 0
    groups = heads // kv_heads

    def sdpa(**how):
        return lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **how
        )

    def op():
        return compile_pass.sliding_window_attention(q, k, v, window=(-1, 0), **masks)

    steps = {
        "sdpa": _step(sdpa(attn_mask=mask), (q, k, v), grad_out),
        "documents": _step(op, (q, k, v), grad_out, documents.DOCUMENTS),
        "chunked": _step(op, (q, k, v), grad_out, chunked.ChunkedKernel()),
    }
    if plain:
        steps["causal"] = _step(sdpa(is_causal=True), (q, k, v), grad_out)
    for run in steps.values():  # warm-up
        run()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, run in steps.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 768, 1024, 2048, 4096])
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 2, 4, 8, 32], help="documents in a packed row")
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=[0.0, 0.125, 0.5], help="the last row's padded share"
    )
    parser.add_argument("--forms", nargs="+", choices=["packed", "padded"], default=["packed", "padded"])
    parser.add_argument("--heads", type=int, nargs=2, default=[8, 4], metavar=("HEADS", "KV_HEADS"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="rows of a padded batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch's threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, heads {args.heads[0]}/{args.heads[1]}, "
        f"head_dim {args.head_dim}; ratios are SDPA's time over each variant's (above 1: faster)"
    )
    for name in args.dtypes:
        for form in args.forms:
            for seq in args.seqs:
                for count in args.docs if form == "packed" else args.fractions:
                    what = f"{count} docs" if form == "packed" else f"padded {count:g}"
                    if form == "packed" and seq % count:
                        continue
                    times = cell(form, DTYPES[name], seq, count, args)
                    sdpa = times.pop("sdpa")
                    line = f"{name} {form:6} S={seq:5} {what:12} sdpa-mask {sdpa * 1e3:8.2f} ms"
                    for variant, seconds in times.items():
                        line += f" | {variant} {seconds * 1e3:8.2f} ms {sdpa / seconds:5.2f}x"
                    if "causal" in times:
                        line += f" | documents vs is_causal {times['causal'] / times['documents']:4.2f}x"
                    print(f"{line} | load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
