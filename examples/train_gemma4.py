"""Train a Gemma-4 for a few steps with compile_pass, and with plain inductor to compare.

By default a small random Gemma-4 that fits a CPU (hidden 512, 6 layers: 5 sliding with
window 512, 1 global; no download). ``--model PATH`` takes a local checkpoint directory
(weights loaded) or a config.json / config directory (random weights).

Prints the rewrite decisions, then tokens per second for the same steps compiled with
``backend="compile_pass"`` and with plain inductor, after one warm-up step each (which
compiles). benchmarks/bench_model.py measures the same comparison more carefully.

    python examples/train_gemma4.py
    python examples/train_gemma4.py --seq 4096 --steps 3
    python examples/train_gemma4.py --model ./gemma-4-checkpoint --seq 8192
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig

import compile_pass
from compile_pass.inspect import load_config

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


def tokens_per_second(model, backend, batch, steps: int) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        compiled(**batch).loss.backward()
        optimizer.step()

    step()  # compiles
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch["input_ids"].numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory, or config.json / config directory")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    model = build_model(args.model).train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}

    print(f"{type(model).__name__}, batch {args.batch} x seq {args.seq}, {args.steps} training steps each\n")
    with compile_pass.decisions() as report:  # made while the graph compiles
        ours = tokens_per_second(model, "compile_pass", batch, args.steps)
    print(report.table())
    inductor = tokens_per_second(model, "inductor", batch, args.steps)
    print(f"\ncompile_pass: {ours:8.0f} tokens/s")
    print(f"inductor:     {inductor:8.0f} tokens/s   (compile_pass x{ours / inductor:.2f})")


if __name__ == "__main__":
    main()
