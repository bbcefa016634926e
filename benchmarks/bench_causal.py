"""The causal rule on Gemma-4's full-attention layer: peak memory and time of a forward pass.

Same CPU-sized Gemma-4 as bench_model.py, inference (no_grad, use_cache=False), batch 1.
Both variants compile with backend="compile_pass" and the sliding rule on; they differ only
in the causal rule, which turns the full-attention layer's explicit (1, 1, S, S) causal mask
into SDPA's is_causal=True. Each runs in a fresh process with glibc's mmap threshold pinned
at 64 KiB (freed tensors leave resident memory at once); after a warm-up call (which
compiles), peak memory is the peak resident memory during one call above what the process
held before it, and time the median of the repeats.

    python benchmarks/bench_causal.py            # S = 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench_model import CONFIG
from measure import median_seconds, peak_mib, pinned_env


def run_child(causal_rule: bool, seq: int, repeats: int) -> dict:
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**CONFIG)).eval()
    compiled = torch.compile(model, backend="compile_pass", fullgraph=True, options={"causal_mask": causal_rule})
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))

    def call():
        with torch.no_grad():
            compiled(input_ids=ids, use_cache=False)

    call()  # compiles
    return {"peak_mib": peak_mib(call), "seconds": median_seconds(call, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child == "on", args.seqs[0], args.repeats)))
        return
    env = pinned_env()
    print(
        f"# Gemma-4 forward (no_grad), config of bench_model.py, fp32, batch 1; {os.cpu_count()} cores; "
        f"median of {args.repeats}"
    )
    print(f"{'S':>6} {'causal rule':>11} {'peak MiB':>9} {'forward s':>10}")
    for seq in args.seqs:
        results = {}
        for switch in ("off", "on"):
            cmd = [sys.executable, __file__, "--child", switch, "--seqs", str(seq), "--repeats", str(args.repeats)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            results[switch] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{seq:6d} {switch:>11} {results[switch]['peak_mib']:9.1f} {results[switch]['seconds']:10.2f}")
        saved = results["off"]["peak_mib"] - results["on"]["peak_mib"]
        print(
            f"{seq:6d} {'saved':>11} {saved:9.1f} MiB ({100 * saved / results['off']['peak_mib']:.0f}% of peak); "
            f"time x{results['off']['seconds'] / results['on']['seconds']:.2f}"
        )


if __name__ == "__main__":
    main()
