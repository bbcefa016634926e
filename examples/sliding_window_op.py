"""The sliding-window op next to what transformers runs for a sliding layer today.

Runs on the CPU in a few seconds: one Gemma-4-shaped sliding layer (8 query heads,
4 KV heads, head_dim 128, window 512) at S=4096, forward + backward, with
``compile_pass.sliding_window_attention`` and with masked SDPA on repeated K/V.
Prints the largest difference between the two and the time of one run of each;
benchmarks/bench_op.py measures properly.
"""

import time

import torch
import torch.nn.functional as F

import compile_pass

BATCH, HEADS, KV_HEADS, HEAD_DIM, WINDOW, SEQ = 1, 8, 4, 128, 512, 4096


def main():
    torch.manual_seed(0)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2).requires_grad_()
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2).requires_grad_()
    v = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM).transpose(1, 2).requires_grad_()
    grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)

    def masked_sdpa():
        positions = torch.arange(SEQ)
        distance = positions[None, :] - positions[:, None]
        band = (distance <= 0) & (distance > -WINDOW)  # kv <= q and kv > q - w
        groups = HEADS // KV_HEADS
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=band
        )

    def sliding_window():
        return compile_pass.sliding_window_attention(q, k, v, window=(WINDOW - 1, 0))

    results = {}
    for name, attend in (("masked SDPA", masked_sdpa), ("sliding_window_attention", sliding_window)):
        torch.autograd.grad(attend(), (q, k, v), grad_out)  # warm-up: first calls load kernels
        start = time.perf_counter()
        out = attend()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results[name] = (time.perf_counter() - start, out, grads)
        print(f"{name:>26}: {results[name][0] * 1e3:7.1f} ms  (forward + backward, S={SEQ}, w={WINDOW}, one run)")

    (_, out_a, grads_a), (_, out_b, grads_b) = results.values()
    diff = max((a - b).abs().max().item() for a, b in zip((out_a, *grads_a), (out_b, *grads_b), strict=True))
    print(f"largest difference in output and gradients: {diff:.2e}")


if __name__ == "__main__":
    main()
