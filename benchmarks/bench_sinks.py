"""A GPT-OSS attention layer with sinks, forward + backward on the CPU: the eager chain against the op.

Shapes: GPT-OSS's (64 query heads, 8 KV heads, head_dim 64), batch 1, fp32 by default, for its
two kinds of layer: sliding (window 128) and full causal.

Baseline: what transformers trains GPT-OSS with (``_supports_sdpa = False``): its own
``eager_attention_forward`` from ``modeling_gpt_oss`` on a real ``GptOssAttention`` (its
``sinks`` parameter): K/V repeated, ``q @ k^T * scaling``, the additive mask transformers
builds for eager attention (0 or the dtype's min), the sinks concatenated, minus the row max,
softmax, the sink column dropped, ``@ v``. Its fp32 scores alone are 64 x S^2 x 4 bytes per
copy (1 GiB at S = 2048, 4 GiB at 4096), and it holds several.
Candidate: ``compile_pass.sliding_window_attention(..., sinks=module.sinks)`` on un-repeated K/V.

Each number is measured in a fresh process after a warm-up step at S = 256 (as
``bench_op.py``): time, the median of ``--repeats`` steps; memory, the process's peak
resident memory during one step above what it held before (``measure.peak_mib``, glibc's
mmap threshold pinned). The eager chain runs only where its estimated peak
(``EAGER_COPIES`` copies of its scores) fits in 90% of the memory available when the row
starts; the op runs at every length.

    python benchmarks/bench_sinks.py                              # S = 1024 .. 16384, both layers
    python benchmarks/bench_sinks.py --seqs 512 1024 --repeats 2  # a quick check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# The package next to this script, not whichever checkout an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import median_seconds, peak_mib, pinned_env, processor  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 64, 8, 64, 128
LAYERS = {"sliding": WINDOW, "full": None}
# (B, H, S, S) fp32 score-sized tensors the eager chain holds at its peak, for the fit
# estimate: its measured peak was 3.4 and 3.2 of them at S = 512 and 1024 (this script); one
# more for margin.
EAGER_COPIES = 4


def _attention_module(dtype):
    """GPT-OSS's attention layer as transformers builds it, with random non-zero sinks."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    config = GptOssConfig(
        hidden_size=256,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        sliding_window=WINDOW,
        num_hidden_layers=2,
        attn_implementation="eager",
    )
    module = GptOssAttention(config, layer_idx=0).to(dtype)
    with torch.no_grad():
        module.sinks.copy_(torch.randn(HEADS, generator=torch.Generator().manual_seed(1)))
    return module


def _eager_mask(length: int, window: int | None, dtype):
    """The additive (1, 1, S, S) mask transformers hands eager attention: 0 where a query sees a
    key (causal, and within the window on a sliding layer), the dtype's min elsewhere."""
    import torch

    distance = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    visible = distance <= 0
    if window is not None:
        visible &= distance > -window
    return torch.zeros(length, length, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]


def run_child(args) -> dict:
    import torch
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    import compile_pass

    dtype = getattr(torch, args.dtype)
    module = _attention_module(dtype)
    window = LAYERS[args.layer]
    generator = torch.Generator().manual_seed(0)

    def inputs(length):
        # (B, S, H, D) storage viewed as (B, H, S, D): the layout the projections produce.
        def make(heads):
            return (
                torch.randn(1, length, heads, HEAD_DIM, generator=generator, dtype=dtype)
                .transpose(1, 2)
                .requires_grad_()
            )

        grad_out = torch.randn(1, length, HEADS, HEAD_DIM, generator=generator, dtype=dtype)
        return make(HEADS), make(KV_HEADS), make(KV_HEADS), grad_out

    def step(q, k, v, grad_out):
        if args.child == "eager":
            mask = _eager_mask(q.shape[2], window, dtype)
            out, _ = eager_attention_forward(module, q, k, v, mask, scaling=HEAD_DIM**-0.5)  # (B, S, H, D)
        else:
            left = -1 if window is None else window - 1
            out = compile_pass.sliding_window_attention(q, k, v, window=(left, 0), sinks=module.sinks).transpose(1, 2)
        out.backward(grad_out)
        for x in (q, k, v, module.sinks):
            x.grad = None

    step(*inputs(256))
    data = inputs(args.seqs[0])
    if args.repeats == 0:
        return {"peak_mib": peak_mib(lambda: step(*data))}
    return {"seconds": median_seconds(lambda: step(*data), args.repeats)}


def _available_mib() -> float:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) for line in meminfo if line.startswith("MemAvailable:")) / 1024


def _eager_fits(length: int, dtype_bytes: int) -> bool:
    scores_mib = HEADS * length * length * dtype_bytes / 2**20
    return EAGER_COPIES * scores_mib < 0.9 * _available_mib()


def _measure(args, variant: str, layer: str, length: int, memory: bool) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--layer",
        layer,
        "--seqs",
        str(length),
        "--repeats",
        str(0 if memory else args.repeats),
        "--dtype",
        args.dtype,
    ]
    done = subprocess.run(command, env=pinned_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", choices=["eager", "op"], help=argparse.SUPPRESS)
    parser.add_argument("--layer", choices=list(LAYERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    dtype_bytes = 4 if args.dtype == "float32" else 2
    print(
        f"# {processor()}; GPT-OSS attention {HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, batch 1, {args.dtype}, "
        "fwd+bwd"
    )
    print(
        f"# time: median of {args.repeats} steps; memory: peak resident MiB of one step; '-': the eager chain does "
        "not fit"
    )
    print(
        f"{'layer':>8} {'S':>6} {'eager s':>9} {'op s':>8} {'speedup':>8} {'eager MiB':>10} {'op MiB':>8} {'memory':>8}"
    )
    for layer in args.layers:
        for length in args.seqs:
            ours = {**_measure(args, "op", layer, length, False), **_measure(args, "op", layer, length, True)}
            if _eager_fits(length, dtype_bytes):
                eager = {
                    **_measure(args, "eager", layer, length, False),
                    **_measure(args, "eager", layer, length, True),
                }
                columns = (
                    f"{eager['seconds']:9.3f} {ours['seconds']:8.3f} {eager['seconds'] / ours['seconds']:7.1f}x "
                    f"{eager['peak_mib']:10.0f} {ours['peak_mib']:8.0f} "
                    f"{eager['peak_mib'] / max(ours['peak_mib'], 1):7.1f}x"
                )
            else:
                columns = f"{'-':>9} {ours['seconds']:8.3f} {'-':>8} {'-':>10} {ours['peak_mib']:8.0f} {'-':>8}"
            print(f"{layer:>8} {length:6d} {columns}", flush=True)


if __name__ == "__main__":
    main()
