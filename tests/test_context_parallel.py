"""Context parallelism on the CPU with gloo: the sequence sharded over 2 and 4 processes, each
rank one contiguous shard. The op (sliding layers by halo exchange, full-attention layers by
all-gather) against one process over the whole sequence, fp64, forward and every gradient;
then a transformers model compiled with ``options={"context_parallel": True}``, loss and every
gradient against the single-process run."""

import json
import socket

import pytest
import torch
import torch.distributed as dist

from compile_pass.ops.context_parallel import context_parallel_attention, exchanges
from compile_pass.ops.window_attention import sliding_window_attention
from tests.attention_reference import random_qkv

SEQ = 24


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _op_cases():
    """(name, window left, padded): windows wider than a shard (a halo over several ranks),
    narrower, and unbounded (a full-attention layer)."""
    return [("w4", 3, False), ("w10", 9, True), ("w17", 16, False), ("full", -1, True)]


def _full_padding():
    padding = torch.ones(2, SEQ, dtype=torch.bool)
    padding[1, SEQ - 3 :] = False  # right padding: in the last shard
    return padding


def _op_worker(rank: int, world: int, port: int, result_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    shard = SEQ // world
    rows = slice(rank * shard, (rank + 1) * shard)
    result = {}
    for name, left, padded in _op_cases():
        q, k, v = random_qkv(2, 4, 2, SEQ, SEQ, 8, torch.float64, seed=3)
        grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        padding = _full_padding() if padded else None
        # One process over the whole sequence.
        whole = sliding_window_attention(q, k, v, window=(left, 0), key_padding=padding)
        whole_grads = torch.autograd.grad(whole, (q, k, v), grad_out)
        # This rank's shard.
        local = [x.detach()[:, :, rows].clone().requires_grad_() for x in (q, k, v)]
        with exchanges() as log:
            out = context_parallel_attention(
                *local, window_left=left, key_padding=None if padding is None else padding[:, rows]
            )
            grads = torch.autograd.grad(out, local, grad_out[:, :, rows])
        errors = [(out - whole[:, :, rows]).abs().max().item()]
        errors += [(g - w[:, :, rows]).abs().max().item() for g, w in zip(grads, whole_grads)]
        result[name] = {"error": max(errors), "sent": log.sent}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(result_path, "w") as out_file:
            json.dump(gathered, out_file)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def op_results(request, tmp_path_factory):
    world = request.param
    path = str(tmp_path_factory.mktemp("cp") / "result.json")
    torch.multiprocessing.spawn(_op_worker, args=(world, _free_port(), path), nprocs=world)
    with open(path) as result_file:
        return world, json.load(result_file)


def test_the_op_equals_one_process_over_the_whole_sequence(op_results):
    world, per_rank = op_results
    for rank, result in enumerate(per_rank):
        for name, found in result.items():
            assert found["error"] <= 1e-12, (world, rank, name, found)


def test_a_sliding_window_sends_only_its_halo(op_results):
    """Bytes each rank sends in one forward: K and V of the last w - 1 positions (over as many
    shards as that takes) for a sliding window, its whole shard to every other rank for a
    full-attention layer (with its padding, one byte a position)."""
    world, per_rank = op_results
    shard = SEQ // world
    key_bytes = 2 * 2 * 8 * 8  # one position of K: batch 2, 2 KV heads, head_dim 8, fp64
    for rank, result in enumerate(per_rank):
        for name, left in (("w4", 3), ("w17", 16)):
            # Rank r sends rank r + h (h = 1 .. ceil(left / shard)) its last min(shard, left - (h - 1) * shard) positions.
            hops = [(h, min(shard, left - (h - 1) * shard)) for h in range(1, -(-left // shard) + 1)]
            positions = sum(n for h, n in hops if rank + h < world)
            assert result[name]["sent"].get("halo", 0) == positions * 2 * key_bytes, (rank, name, result[name])
        full = (world - 1) * shard * (2 * key_bytes + 2)
        assert result["full"]["sent"]["all-gather"] == full, (rank, result["full"])
