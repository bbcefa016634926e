"""Attention spelled out in ops against SDPA with the same mask and against the op the
spelled_attention rule puts in its place: fwd+bwd time side by side, on the CPU.

One attention layer, (batch, heads, S, head_dim) fp32, an additive sliding-window mask built
in the graph as transformers builds it (0 on the band, the dtype's minimum elsewhere):
- chain: the eager form (``q @ k^T * scale + mask``, ``softmax``, ``@ v``; with ``--sinks``
  GPT-OSS's ``cat`` of a per-head sink column, ``- max``, ``[..., :-1]``), compiled by inductor
  (``torch.compile``, the default backend: what the chain costs without compile_pass);
- sdpa: SDPA with the same mask, compiled by inductor (without ``--sinks`` only: SDPA has none);
- op: the chain compiled with ``backend="compile_pass"`` (the rule's rewrite; the report says so).

The rule's speed claim is chain >= SDPA with the mask (so the kernel policy's crossovers, which
are the op's against SDPA with the mask, also hold against the chain) and chain >= op.

    python benchmarks/bench_spelled.py --quick          # S = 512, 1024, a few seconds
    python benchmarks/bench_spelled.py --sinks --seqs 1024 2048 4096
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")  # time the op at every length, as asked

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from measure import median_seconds, processor  # noqa: E402


def _mask(seq: int, window: int, dtype) -> torch.Tensor:
    positions = torch.arange(seq)
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    return torch.where(visible, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def chain(window: int, sinks: bool):
    def attend(q, k, v, s):
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + _mask(q.shape[2], window, q.dtype)
        if sinks:
            column = s.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
            logits = torch.cat([scores, column], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    return attend


def sdpa(window: int):
    def attend(q, k, v, s):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(q.shape[2], window, q.dtype))

    return attend


def step_time(fn, inputs, repeats: int) -> float:
    def step():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))

    step()  # compiles
    step()
    return median_seconds(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sinks", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="S = 512 and 1024, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.repeats = [512, 1024], 2
    import compile_pass  # noqa: F401 - registers the backend

    print(
        f"# {processor()}, {torch.get_num_threads()} threads, fp32, heads {args.heads}, head_dim {args.head_dim}, "
        f"window {args.window}, batch {args.batch}, sinks {args.sinks}; fwd+bwd median of {args.repeats}"
    )
    print("S | chain s | sdpa s | op s | chain/sdpa | chain/op")
    for seq in args.seqs:
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(seq)
        shape = (args.batch, args.heads, seq, args.head_dim)
        inputs = [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]
        inputs.append(torch.randn(args.heads, generator=gen).requires_grad_())
        spelled = chain(args.window, args.sinks)
        chain_s = step_time(torch.compile(spelled), inputs, args.repeats)
        sdpa_s = None if args.sinks else step_time(torch.compile(sdpa(args.window)), inputs, args.repeats)
        op_s = step_time(torch.compile(spelled, backend="compile_pass"), inputs, args.repeats)
        sdpa_text = f"{sdpa_s:.4f} | {chain_s / sdpa_s:.2f}x" if sdpa_s else "- | -"
        sdpa_cells = sdpa_text.split(" | ")
        print(f"{seq} | {chain_s:.4f} | {sdpa_cells[0]} | {op_s:.4f} | {sdpa_cells[1]} | {chain_s / op_s:.2f}x")


if __name__ == "__main__":
    main()
