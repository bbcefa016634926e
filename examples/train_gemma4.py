"""Train a Gemma-4 for a few steps with compile_pass and with plain inductor, and compare.

By default a small random Gemma-4 that fits a CPU (hidden 512, 6 layers: 5 sliding with
window 512, 1 global; no download) at sequence length 4096, where the sliding layers'
band is an eighth of the full attention square. ``--model PATH`` takes a local checkpoint
directory (weights loaded) or a config.json / config directory (random weights).

Both variants share one model. Each compiles on its first step (timed apart: compile time),
takes one more warm-up step, then the timed steps alternate between the two, so that a
machine that slows down or speeds up in between affects both alike. Prints the rewrite
decisions, the median step time and tokens per second of each, and the speedup with the
spread of the per-pair ratios. benchmarks/bench_model.py measures the same comparison in
fresh processes with inductor's caches off.

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``) unless you set the variable:
the op's CPU kernel runs many short parallel regions, and on a machine whose cores are also
busy with other work a spinning OpenMP thread stalls each of them (on 2 busy cores a step
took 36.9 s with the default policy and 12.9 s with PASSIVE; inductor's 27.6 s and 21.2 s).
The header prints the policy and the machine's load, so a run can be judged.

    python examples/train_gemma4.py                      # seq 4096, 3 timed steps each
    python examples/train_gemma4.py --seq 2048 --steps 5
    python examples/train_gemma4.py --model ./gemma-4-checkpoint --seq 8192
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# Read by OpenMP when torch loads, so set before the import (see above).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma4TextConfig  # noqa: E402

import compile_pass  # noqa: E402
from compile_pass.inspect import load_config  # noqa: E402

SMALL = dict(
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
)


def build_model(path: str | None):
    if path is None:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(Gemma4TextConfig(**SMALL), attn_implementation="sdpa")
    has_weights = os.path.isdir(path) and any(
        name.endswith((".safetensors", ".bin")) for name in os.listdir(path)
    )
    if has_weights:
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", local_files_only=True)
    return AutoModelForCausalLM.from_config(load_config(path), attn_implementation="sdpa")


def training_step(model, backend: str, batch):
    """A compiled forward + backward + SGD step; returns a function that runs one and gives
    its seconds."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        compiled(**batch).loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory, or config.json / config directory")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each variant (default 3)")
    args = parser.parse_args()
    started = time.perf_counter()

    model = build_model(args.model).train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    tokens = ids.numel()
    print(
        f"{type(model).__name__}, batch {args.batch} x seq {args.seq}, {args.steps} timed training steps each\n"
        f"{torch.get_num_threads()} threads on {os.cpu_count()} cores, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"load average {os.getloadavg()[0]:.1f} before starting",
        flush=True,
    )

    steps = {"compile_pass": training_step(model, "compile_pass", batch), "inductor": training_step(model, "inductor", batch)}
    compile_seconds = {}
    for name, step in steps.items():
        print(f"compiling with {name} (the first step compiles) ...", flush=True)
        if name == "compile_pass":
            with compile_pass.decisions() as report:  # made while the graph compiles
                compile_seconds[name] = step()
            print(report.table(), flush=True)
        else:
            compile_seconds[name] = step()
        step()  # warm-up

    # Alternate, each pair in the other order than the last, so that drift hits both.
    times = {name: [] for name in steps}
    order = list(steps)
    for _ in range(args.steps):
        for name in order:
            times[name].append(steps[name]())
        order.reverse()
    ours, theirs = (statistics.median(times[name]) for name in ("compile_pass", "inductor"))
    ratios = [b / a for a, b in zip(times["compile_pass"], times["inductor"])]

    print(f"\nfirst step (compiles): compile_pass {compile_seconds['compile_pass']:.1f} s, "
          f"inductor {compile_seconds['inductor']:.1f} s")
    print(f"step, median of {args.steps}:  compile_pass {ours:6.2f} s ({tokens / ours:6.0f} tokens/s)   "
          f"inductor {theirs:6.2f} s ({tokens / theirs:6.0f} tokens/s)")
    print(f"compile_pass speedup: x{theirs / ours:.2f} (per-pair ratios x{min(ratios):.2f} to x{max(ratios):.2f})")
    print(f"total {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
