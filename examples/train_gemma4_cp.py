"""Context parallel beside FSDP2 on one DeviceMesh: a small random Gemma-4 trained on 4
processes as a 2 x 2 mesh ("dp", "cp"), each dp row on its own rows of the batch, each cp rank
on one contiguous shard of the sequence. The first step's loss and gradients are checked
against one process over the whole batch and sequence.

    torchrun --nproc-per-node 4 examples/train_gemma4_cp.py [--seq 64] [--steps 3] [--per-block]

gloo on the CPU (NCCL where CUDA is present). What each part does:
- ``fully_shard(model, mesh=mesh)``: FSDP2 over both dimensions of the mesh (parameters
  replicated over dp, sharded over cp); it reduces every gradient over all the ranks that
  saw a part of the batch, so no hand-written all-reduce;
- ``options={"context_parallel": mesh["cp"]}``: every attention call attends across the cp
  ranks' shards (sliding layers by a halo, the full-attention layer by an all-gather);
- the loss: each rank's token losses summed, over the whole batch's token count, times the
  mesh's size, because FSDP2 averages the ranks' gradients.
``--per-block``: FSDP2 around each decoder block too, whose hooks break the graph, so the
masks are built in graphs of their own; those graphs certify them for the blocks' (docs/distributed.md,
"FSDP2 around each block"). Compiled with ``dynamic=True`` and ints specialised.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

import compile_pass  # noqa: F401  (registers the ops; the backend is named below)


def tiny_model(window: int) -> Gemma4ForCausalLM:
    config = Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        sliding_window=window,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
        max_position_embeddings=4096,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)  # the same weights on every rank
    return Gemma4ForCausalLM(config)


def global_batch(rows: int, seq: int):
    """input_ids, attention_mask (some rows padded), labels shifted once over the whole
    sequence (they are sharded as they are), position_ids."""
    ids = torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -seq // 5 :] = 0  # right padding
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[attention_mask == 0] = -100
    positions = torch.arange(seq).repeat(rows, 1)
    return ids, attention_mask, labels, positions


def step(model, ids, attention_mask, labels, positions, items: int, scale: float = 1.0):
    loss = model(
        input_ids=ids,
        attention_mask=attention_mask,
        labels=labels,
        shift_labels=labels,
        position_ids=positions,
        num_items_in_batch=items,
        use_cache=False,
    ).loss
    (loss * scale).backward()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64, help="tokens per row, over all cp ranks")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-block", action="store_true", help="FSDP2 around each decoder block too")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)  # the processes share the machine's cores
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "cp"))
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    shard = args.seq // mesh["cp"].size()
    rows_per_dp = 2
    batch = [x.to(device) for x in global_batch(rows_per_dp * mesh["dp"].size(), args.seq)]
    items = int((batch[2] != -100).sum())  # the whole batch's tokens: every rank divides by it

    # One process over the whole batch and sequence, on every rank, for the check.
    reference = tiny_model(args.window).to(device)
    reference_loss = step(reference, *batch, items)

    model = tiny_model(args.window).to(device)
    if args.per_block:
        for block in model.model.layers:
            fully_shard(block, mesh=mesh)
        torch._dynamo.config.specialize_int = True  # the window a constant where the masks are built
    fully_shard(model, mesh=mesh)
    options = {"context_parallel": mesh["cp"]}
    # Past a graph break sizes are static unless dynamic=True: a shard's length must be a symbol.
    compiled = torch.compile(model, backend="compile_pass", options=options, dynamic=True if args.per_block else None)
    rows, columns = slice(dp * rows_per_dp, (dp + 1) * rows_per_dp), slice(cp * shard, (cp + 1) * shard)
    shards = [x[rows, columns].contiguous() for x in batch]
    for tensor in shards:  # the sequence length a symbol: the shard's program is the sequence's
        torch._dynamo.mark_dynamic(tensor, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for number in range(args.steps):
        loss = step(compiled, *shards, items, scale=mesh.size())
        dist.all_reduce(loss)  # the ranks' parts of the loss add up to the whole batch's
        if number == 0:
            worst = max(
                ((p.grad.full_tensor() - r.grad).abs().max() / r.grad.abs().max().clamp(min=1)).item()
                for p, r in zip(model.parameters(), reference.parameters(), strict=True)
            )
            if dist.get_rank() == 0:
                blocks = ", FSDP2 around each block" if args.per_block else ""
                print(
                    f"mesh dp x cp = 2 x 2{blocks}, {args.seq} tokens a row in shards of {shard}, window {args.window}"
                )
                print(f"one process:   loss {reference_loss.item():.6f}")
                print(f"2 x 2 mesh:    loss {loss.item():.6f}; worst gradient difference {worst:.2e} (relative)")
                matches = abs(loss.item() - reference_loss.item()) < 1e-4 and worst < 1e-4
                print("loss and gradients match one process" if matches else "MISMATCH with one process")
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {number}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
