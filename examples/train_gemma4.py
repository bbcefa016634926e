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
The header says what the run will do and about how long it takes, and prints the policy and
the machine's load, so a run can be judged; a line per step shows progress.

    python examples/train_gemma4.py                      # seq 4096, 3 timed steps each
    python examples/train_gemma4.py --seq 2048 --steps 5
    python examples/train_gemma4.py --model ./gemma-4-checkpoint --seq 8192
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Read by OpenMP when torch loads, so set before the import (see above).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma4TextConfig  # noqa: E402

import compile_pass  # noqa: E402
from compile_pass.backend import NO_COMPILER_ADVICE  # noqa: E402
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


DEFAULTS = dict(model=None, seq=4096, batch=1, steps=3)
# What the defaults took end to end (README.md, docs/getting-started.md): 2 cores, the inductor
# cache empty or warm, idle or busy with other work.
MEASURED = "about 3 minutes on 2 idle cores with inductor's cache empty, 2 with it warm, up to 10 on 2 busy cores"


def say_what_happens(args) -> None:
    """What the run does and how long it takes here, before anything slow starts."""
    model = "a small random Gemma-4 (6 layers: 5 sliding with window 512, 1 global; no download)"
    print(
        f"This trains {model if args.model is None else args.model} on batch {args.batch} x seq {args.seq} "
        f'twice, with backend="compile_pass" and with plain inductor: each compiles on its first step '
        f"(a minute or more), takes a warm-up step, then {args.steps} timed steps alternate between the two.",
        flush=True,
    )
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    if all(getattr(args, name) == value for name, value in DEFAULTS.items()):
        busy = " It is busy: expect the longer end." if load >= cores / 2 else ""
        print(
            f"With these settings it took {MEASURED}. This machine: {cores} cores, load average {load:.1f}.{busy}",
            flush=True,
        )
    else:
        print(
            f"The defaults took {MEASURED}; longer sequences and more steps take longer. "
            f"This machine: {cores} cores, load average {load:.1f}.",
            flush=True,
        )


def check_compiler() -> None:
    """inductor compiles the CPU kernels with a C++ compiler: say what to install before starting."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # inductor's InvalidCxxCompiler, or the search's own error
        sys.exit(f"{NO_COMPILER_ADVICE} ({error})")


def build_model(path: str | None):
    if path is None:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(Gemma4TextConfig(**SMALL), attn_implementation="sdpa")
    has_weights = os.path.isdir(path) and any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path))
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
    parser.add_argument("--seq", type=int, default=DEFAULTS["seq"])
    parser.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="timed steps of each variant (default 3)")
    args = parser.parse_args()
    started = time.perf_counter()
    check_compiler()
    say_what_happens(args)

    model = build_model(args.model).train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    tokens = ids.numel()
    print(
        f"{type(model).__name__}, batch {args.batch} x seq {args.seq}, {args.steps} timed training steps each\n"
        f"{torch.get_num_threads()} threads on {os.cpu_count()} cores, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
        f"load average {os.getloadavg()[0]:.1f} before starting",
        flush=True,
    )

    steps = {
        "compile_pass": training_step(model, "compile_pass", batch),
        "inductor": training_step(model, "inductor", batch),
    }
    compile_seconds = {}
    for name, step in steps.items():
        print(f"compiling with {name} (the first step compiles) ...", flush=True)
        if name == "compile_pass":
            with compile_pass.decisions() as report:  # made while the graph compiles
                compile_seconds[name] = step()
        else:
            compile_seconds[name] = step()
        print(f"  {name}: compiled and stepped in {compile_seconds[name]:.1f} s; a warm-up step ...", flush=True)
        step()

    # Alternate, each pair in the other order than the last, so that drift hits both.
    times = {name: [] for name in steps}
    order = list(steps)
    for index in range(args.steps):
        for name in order:
            times[name].append(steps[name]())
        print(
            f"step {index + 1}/{args.steps}: compile_pass {times['compile_pass'][-1]:.2f} s, "
            f"inductor {times['inductor'][-1]:.2f} s",
            flush=True,
        )
        order.reverse()
    ours, theirs = (statistics.median(times[name]) for name in ("compile_pass", "inductor"))
    ratios = [b / a for a, b in zip(times["compile_pass"], times["inductor"], strict=True)]

    print("\nwhat compile_pass did to each attention call:")
    print(report.table())
    print(
        f"\nfirst step (compiles): compile_pass {compile_seconds['compile_pass']:.1f} s, "
        f"inductor {compile_seconds['inductor']:.1f} s"
    )
    print(
        f"step, median of {args.steps}:  compile_pass {ours:6.2f} s ({tokens / ours:6.0f} tokens/s)   "
        f"inductor {theirs:6.2f} s ({tokens / theirs:6.0f} tokens/s)"
    )
    print(f"compile_pass speedup: x{theirs / ours:.2f} (per-pair ratios x{min(ratios):.2f} to x{max(ratios):.2f})")
    print(f"total {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
