"""Attention spelled out in ops against SDPA with the same mask and against the op the
spelled_attention rule puts in its place: fwd+bwd time side by side, on the CPU.

One attention layer, (batch, heads, S, head_dim) in fp32 or bf16, an additive sliding-window
mask built in the graph as transformers builds it (0 on the band, the dtype's minimum elsewhere;
window -1: causal, a global layer):
- chain: the eager form (``q @ k^T * scale + mask``, ``softmax``, ``@ v``; with ``--sinks``
  GPT-OSS's ``cat`` of a per-head sink column, ``- max``, ``[..., :-1]``; with ``--softcap C``
  Gemma-2's ``w / C``, ``tanh``, ``* C`` before the mask and its softmax in float32), compiled
  by inductor (``torch.compile``, the default backend: what the chain costs without compile_pass);
- sdpa: SDPA with the same mask, compiled by inductor (without ``--sinks`` or ``--softcap``
  only: SDPA has neither);
- op: the chain compiled with ``backend="compile_pass"`` (the rule's rewrite; the script checks
  that it was rewritten).

The rule's speed claim is chain >= SDPA with the mask (so the kernel policy's crossovers, which
are the op's against SDPA with the mask, also hold against the chain) and chain >= op. With a
softcap no SDPA takes the call, so chain/op is the ratio itself: ``chunked.SOFTCAP_SHORT_KEYS``
is where it crosses 1.

    python benchmarks/bench_spelled.py --quick          # S = 512, 1024, a few seconds
    python benchmarks/bench_spelled.py --sinks --seqs 1024 2048 4096
    python benchmarks/bench_spelled.py --softcap 50 --dtype bf16 --windows 128 512 -1 --seqs 512 1024 2048 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")  # time the op at every length, as asked
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")  # by the static tables: nothing measured keeps SDPA

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from measure import median_seconds, processor  # noqa: E402


def _mask(seq: int, window: int, dtype) -> torch.Tensor:
    positions = torch.arange(seq)
    visible = positions[None, :] <= positions[:, None]
    if window > 0:
        visible = visible & (positions[None, :] > positions[:, None] - window)
    return torch.where(visible, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def chain(window: int, sinks: bool, softcap: float = 0.0):
    def attend(q, k, v, s):
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
        if softcap:
            scores = scores / softcap
            scores = torch.tanh(scores)
            scores = scores * softcap
        scores = scores + _mask(q.shape[2], window, q.dtype)
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


def step_time(fn, inputs, repeats: int, clock: str = "wall") -> float:
    def step():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))

    step()  # compiles
    step()
    if clock == "wall":
        return median_seconds(step, repeats)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times)


class Rewrites:
    """The compile_pass backend, counting the calls it rewrote."""

    def __init__(self):
        self.rewritten = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        import compile_pass

        self.rewritten += len(compile_pass.rewrite(gm).rewritten())
        return compile_fx(gm, example_inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--windows", type=int, nargs="+", default=[128], help="-1: causal, no window")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sinks", action="store_true")
    parser.add_argument("--softcap", type=float, default=0.0, help="Gemma-2's attn_logit_softcapping (0: none)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time, steadier than wall time on a machine others load (use --threads 1)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="S = 512 and 1024, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.repeats = [512, 1024], 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(
        f"# {processor()}, {torch.get_num_threads()} threads, {args.dtype}, heads {args.heads}, head_dim "
        f"{args.head_dim}, batch {args.batch}, sinks {args.sinks}, softcap {args.softcap}; fwd+bwd median of "
        f"{args.repeats} ({args.clock} time); load {os.getloadavg()[0]:.1f}"
    )
    print("S | window | chain s | sdpa s | op s | chain/sdpa | chain/op")
    without_sdpa = args.sinks or args.softcap
    for window in args.windows:
        for seq in args.seqs:
            torch._dynamo.reset()
            gen = torch.Generator().manual_seed(seq)
            shape = (args.batch, args.heads, seq, args.head_dim)
            inputs = [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(3)]
            inputs.append(torch.randn(args.heads, generator=gen).requires_grad_())
            spelled = chain(window, args.sinks, args.softcap)
            chain_s = step_time(torch.compile(spelled), inputs, args.repeats, args.clock)
            sdpa_s = None if without_sdpa else step_time(torch.compile(sdpa(window)), inputs, args.repeats, args.clock)
            rewrites = Rewrites()
            op_s = step_time(torch.compile(spelled, backend=rewrites), inputs, args.repeats, args.clock)
            if not rewrites.rewritten:
                raise SystemExit(f"S = {seq}, window {window}: the chain was not rewritten")
            sdpa_cells = [f"{sdpa_s:.4f}", f"{chain_s / sdpa_s:.2f}x"] if sdpa_s else ["-", "-"]
            print(
                f"{seq} | {window} | {chain_s:.4f} | {sdpa_cells[0]} | {op_s:.4f} | {sdpa_cells[1]} | "
                f"{chain_s / op_s:.2f}x"
            )


if __name__ == "__main__":
    main()
