"""Doge's top-k masks with and without the top-k rule: peak memory and time of forward + backward.

Model: transformers' DogeForCausalLM, random weights: hidden 256, 2 layers, 8 query heads,
4 KV heads (head_dim 32), MLP 512, vocab 1024, keep_window_size 256, fp32, batch 1.
Four variants, each in a fresh process, same seeded weights and tokens, one run:
- eager:            the model as transformers runs it;
- eager + rule:     the graph Dynamo captures, rewritten by the rule, run without inductor
                    (what the rule itself changes);
- inductor:         backend="compile_pass" with every rule off, i.e. plain inductor;
- inductor + rule:  backend="compile_pass" with only the top-k rule.
glibc's mmap threshold is pinned at 64 KiB so freed tensors leave resident memory at
once. After a warm-up step (which compiles), peak memory is the peak resident memory during
one step above what the process held before it; time is the median of the repeats, measured
under the same allocator setting.

    python benchmarks/bench_topk.py
    python benchmarks/bench_topk.py --forward-only --seqs 4096   # inference: no backward
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from measure import median_seconds, peak_mib, pinned_env

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    keep_window_size=256,
    max_position_embeddings=8192,
    attn_implementation="sdpa",
)
VARIANTS = ("eager", "eager + rule", "inductor", "inductor + rule")


def run_child(variant: str, seq: int, repeats: int, forward_only: bool) -> dict:
    import torch
    from transformers import DogeConfig
    from transformers.models.doge.modeling_doge import DogeForCausalLM

    import compile_pass

    torch.manual_seed(0)
    model = DogeForCausalLM(DogeConfig(**CONFIG)).train()
    only_topk = {"sliding_window": False, "topk_mask": True}
    if variant == "eager":
        run = model
    elif variant == "eager + rule":

        def rewrite_then_run_eagerly(gm, example_inputs):
            compile_pass.rewrite(gm, **only_topk)
            return gm.forward

        run = torch.compile(model, backend=rewrite_then_run_eagerly, fullgraph=True)
    else:
        switches = only_topk if variant == "inductor + rule" else {"sliding_window": False, "topk_mask": False}
        run = torch.compile(model, backend="compile_pass", fullgraph=True, options=switches)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(seq))

    def step():
        model.zero_grad(set_to_none=True)
        if forward_only:
            with torch.no_grad():
                run(input_ids=ids, labels=ids, use_cache=False)
        else:
            run(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    step()  # compiles
    return {"peak_mib": peak_mib(step), "seconds": median_seconds(step, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-only", action="store_true", help="no_grad forward (inference)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.seqs[0], args.repeats, args.forward_only)))
        return

    env = pinned_env()
    print(
        f"# Doge, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
        f"{CONFIG['num_attention_heads']} heads, keep_window {CONFIG['keep_window_size']}, fp32, batch 1, "
        f"{'forward only (no_grad)' if args.forward_only else 'fwd+bwd'}; {os.cpu_count()} cores; "
        f"median of {args.repeats}"
    )
    print(f"{'S':>6} {'variant':>16} {'peak MiB':>9} {'step s':>7}")
    for seq in args.seqs:
        results = {}
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--child", variant, "--seqs", str(seq), "--repeats", str(args.repeats)]
            cmd += ["--forward-only"] if args.forward_only else []
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{seq:6d} {variant:>16} {results[variant]['peak_mib']:9.1f} {results[variant]['seconds']:7.2f}")
        for base in ("eager", "inductor"):
            before, after = results[base], results[f"{base} + rule"]
            saved = before["peak_mib"] - after["peak_mib"]
            print(
                f"{seq:6d} {base + ' saved':>16} {saved:9.1f} MiB ({saved * 2**20:,.0f} bytes, "
                f"{100 * saved / before['peak_mib']:.0f}% of peak); time x{before['seconds'] / after['seconds']:.2f}"
            )


if __name__ == "__main__":
    main()
