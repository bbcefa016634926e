"""One Gemma-4 training step, compiled with plain inductor and with compile_pass, on the CPU.

Model: transformers' Gemma4ForCausalLM with random weights and a CPU-sized config:
hidden 512, 6 layers (5 sliding with window 512 and head_dim 64, 1 global with head_dim 128),
8 query heads, 4 KV heads, MLP 2048, vocab 4096, fp32, batch 1. A step is forward + backward of
the language-model loss. The two variants run in fresh processes with the same seeded
weights and tokens, in one run of this script, with inductor's caches off so both compile
from scratch:
- compile: seconds for the first call at each length (compile + one step) minus one step;
- rewrite: seconds compile_pass spends in its rewrite, included in compile;
- step: median seconds of the following steps.

    python benchmarks/bench_model.py                 # S = 2048, 4096, 8192
    python benchmarks/bench_model.py --seqs 2048 --repeats 2
    python benchmarks/bench_model.py --plot docs/model_speedup.png   # also draw the speedups
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    global_head_dim=128,
    sliding_window=512,
    hidden_size_per_layer_input=64,
    vocab_size_per_layer_input=4096,
    max_position_embeddings=32768,
    attn_implementation="sdpa",
)


def run_child(variant: str, seqs: list[int], repeats: int) -> dict:
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    import compile_pass.backend  # noqa: F401  (the module; the package exports the function)

    entry_points = sys.modules["compile_pass.backend"]
    rewrite_seconds = []
    if variant == "compile_pass":
        rewrite = entry_points.rewrite

        def timed_rewrite(gm, **switches):
            start = time.perf_counter()
            report = rewrite(gm, **switches)
            rewrite_seconds.append(time.perf_counter() - start)
            return report

        entry_points.rewrite = timed_rewrite  # backend() looks rewrite up at call time
        backend = entry_points.backend
    else:
        backend = "inductor"

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**CONFIG)).train()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    results = {}
    for seq in seqs:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))

        def step():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            return time.perf_counter() - start

        first = step()
        steps = [step() for _ in range(repeats)]
        median = statistics.median(steps)
        results[seq] = {"step": median, "compile": first - median}
    return {"by_seq": results, "rewrite": rewrite_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="write the step speedup against S as a PNG (needs matplotlib)")
    parser.add_argument("--child", choices=["inductor", "compile_pass"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.seqs, args.repeats)))
        return

    import torch

    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    results = {}
    for variant in ("inductor", "compile_pass"):
        cmd = [sys.executable, __file__, "--child", variant, "--repeats", str(args.repeats), "--seqs"]
        done = subprocess.run(cmd + [str(s) for s in args.seqs], check=True, capture_output=True, text=True, env=env)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])

    print(f"# {os.cpu_count()} cores, torch {torch.__version__}; Gemma-4 {CONFIG['num_hidden_layers']} layers, "
          f"hidden {CONFIG['hidden_size']}, window {CONFIG['sliding_window']}, fp32, batch 1, fwd+bwd; "
          f"median of {args.repeats}")
    print(f"{'S':>6} {'inductor s':>11} {'compile_pass s':>15} {'speedup':>8} "
          f"{'compile inductor s':>19} {'compile compile_pass s':>23} {'overhead':>9}")
    base, ours = results["inductor"]["by_seq"], results["compile_pass"]["by_seq"]
    for seq in args.seqs:
        b, o = base[str(seq)], ours[str(seq)]
        print(f"{seq:6d} {b['step']:11.2f} {o['step']:15.2f} {b['step'] / o['step']:7.2f}x "
              f"{b['compile']:19.1f} {o['compile']:23.1f} {100 * (o['compile'] / b['compile'] - 1):+8.1f}%")
    rewrites = results["compile_pass"]["rewrite"]
    print(f"# compile_pass rewrite: {len(rewrites)} graphs, {sum(rewrites):.3f} s in all")
    if args.plot:
        from measure import plot_speedups

        speedups = [base[str(s)]["step"] / ours[str(s)]["step"] for s in args.seqs]
        plot_speedups(
            args.plot,
            args.seqs,
            {"compile_pass vs inductor, training step (measured)": speedups},
            f"Gemma-4 ({CONFIG['num_hidden_layers']} layers, window {CONFIG['sliding_window']}), fp32, CPU",
        )


if __name__ == "__main__":
    main()
