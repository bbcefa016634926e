"""Context parallelism on the CPU with gloo: bytes each rank sends per sliding layer, a training
step's time, and the bytes a GPU cluster would send, from one formula.

1. Bytes (``--bytes``): one sliding layer's forward and backward on P ranks (gloo, one thread
   each), the sequence sharded contiguously. The halo exchange (window w) and the all-gather
   the op uses for full attention are both run, on the same inputs, and their bytes read from
   the op's counters (``ops.halo_exchange.exchanges``). Ring attention is not implemented
   here: its bytes are computed (each rank passes every other shard's K/V on in the forward,
   and K/V plus their gradients in the backward). The certified form (a block whose mask is an
   input, certified by the graph that built it: ``certified_attention_forward``) is run too:
   it does not save its halo, so its backward exchanges it again; its bytes, and both forms'
   time (median of ``--repeats`` forward + backward, with the mask's certificate check), are
   side by side.
2. Step (``--step``): a tiny Gemma-4 (hidden 512, 6 layers, window 512) training step at
   sequence length S: one process with 2 threads against 2 ranks with 1 thread each, both
   through compile_pass's rewrite (the rewritten graphs run eagerly: no inductor), median of
   ``--repeats`` steps. On 2 cores the 2 ranks share the machine the one process has alone.
3. Table (``--table``): the formula for a GPU cluster, bytes per rank per sliding layer per
   training step (forward + backward): halo 2 (w - 1) B Hkv D (e + 4) (K and V in e bytes,
   their gradients back in fp32), all-gather + reduce of the gradients
   2 (P - 1) (S / P) B Hkv D (e + 4), ring 2 (P - 1) (S / P) B Hkv D (2 e + 4).
4. Balance (``--balance``): one full-attention (global) layer's forward and backward on P ranks,
   contiguous shards against the head-tail layout, on the same inputs: each rank's CPU seconds
   in attention (the op's own counter, ``ExchangeLog.attention_seconds``: thread CPU time, so
   ranks sharing the 2 cores are measured alike), median of ``--repeats``.

    python benchmarks/bench_context_parallel.py --bytes --step --table --balance
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.helpers.gloo import end_rank, free_port, start  # noqa: E402

# -- 1. bytes ------------------------------------------------------------------------------------

LAYER = dict(batch=1, heads=8, kv_heads=4, head_dim=128, seq=8192, window=512)


def _bytes_worker(rank: int, world: int, port: int, path: str, repeats: int) -> None:
    from compile_pass.ops.mask_certificate import certify_mask
    from compile_pass.parallel.context_parallel import certified_attention_forward, context_parallel_attention
    from compile_pass.parallel.halo_exchange import exchanges

    start(rank, world, port)
    shard = LAYER["seq"] // world
    gen = torch.Generator().manual_seed(rank)

    def make(heads):
        return torch.randn(LAYER["batch"], heads, shard, LAYER["head_dim"], generator=gen).requires_grad_()

    q, k, v = make(LAYER["heads"]), make(LAYER["kv_heads"]), make(LAYER["kv_heads"])
    left = LAYER["window"] - 1
    i = torch.arange(shard)
    mask = certify_mask(((i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left))[None, None], left)
    scale = LAYER["head_dim"] ** -0.5
    group = dist.group.WORLD.group_name
    runs = {
        "halo": lambda: context_parallel_attention(q, k, v, window_left=left),
        "all-gather": lambda: context_parallel_attention(q, k, v, window_left=-1),
        "certified": lambda: certified_attention_forward(q, k, v, mask, scale, group, rank, world)[0],
    }
    sent, seconds = {}, {}
    for name, run in runs.items():
        with exchanges() as log:
            run().sum().backward()
        sent[name] = log.sent
        if name != "all-gather":
            times = []
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                run().sum().backward()
                times.append(time.perf_counter() - started)
            seconds[name] = sorted(times)[len(times) // 2]
    sent["seconds"] = seconds
    gathered = [None] * world
    dist.all_gather_object(gathered, sent)
    if rank == 0:
        Path(path).write_text(json.dumps(gathered))
    end_rank()


def bytes_table(worlds, repeats: int) -> None:
    batch, kv_heads, dim, seq, window = (LAYER[k] for k in ("batch", "kv_heads", "head_dim", "seq", "window"))
    print(
        f"# one sliding layer, fwd+bwd, fp32: batch {batch}, {kv_heads} KV heads, head_dim {dim}, S={seq}, w={window}"
    )
    print(
        f"{'ranks':>5} {'rank':>4} {'halo fwd':>10} {'halo bwd':>10} {'halo':>10} {'all-gather':>11} "
        f"{'ring (computed)':>16} {'all-gather/halo':>16}"
    )
    certified_rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "sent.json")
            torch.multiprocessing.spawn(_bytes_worker, args=(world, free_port(), path, repeats), nprocs=world)
            per_rank = json.loads(Path(path).read_text())
        shard_kv = 2 * (seq // world) * batch * kv_heads * dim  # K and V of one shard, elements
        for rank, sent in enumerate(per_rank):
            halo_forward = sent["halo"].get("halo", 0)
            halo_backward = sent["halo"].get("halo gradients", 0)
            halo = halo_forward + halo_backward
            gathered = sent["all-gather"].get("all-gather", 0) + sent["all-gather"].get("all-reduce", 0)
            ring = (world - 1) * shard_kv * (4 + 4 + 4)  # K/V forward, K/V again and dK/dV backward, fp32
            ratio = f"{gathered / halo:15.1f}x" if halo else f"{'(sends none)':>16}"
            print(
                f"{world:5d} {rank:4d} {_mib(halo_forward)} {_mib(halo_backward)} {_mib(halo)} {_mib(gathered):>11} "
                f"{_mib(ring):>16} {ratio}"
            )
            certified = sum(sent["certified"].get(kind, 0) for kind in ("halo", "halo gradients"))
            times = sent["seconds"]
            certified_rows.append(
                f"{world:5d} {rank:4d} {_mib(halo)} {_mib(certified)} {times['halo']:9.3f} {times['certified']:14.3f} "
                f"{times['halo'] / times['certified']:19.2f}x"
            )
    print(
        f"# the same layer with its mask an input, certified (FSDP2 around each block): the halo sent again in the "
        f"backward; fwd+bwd seconds, median of {repeats}, 1 thread a rank"
    )
    print(
        f"{'ranks':>5} {'rank':>4} {'halo':>10} {'certified':>10} {'halo s':>9} {'certified s':>14} "
        f"{'halo s / certified s':>20}"
    )
    print("\n".join(certified_rows))


def _mib(count: int) -> str:
    return f"{count / 2**20:8.2f}Mi"


# -- 2. a training step ----------------------------------------------------------------------------

CONFIG = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    global_head_dim=256,
    sliding_window=512,
    hidden_size_per_layer_input=64,
    vocab_size_per_layer_input=1024,
    max_position_embeddings=32768,
    attn_implementation="sdpa",
)


def _model():
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    return Gemma4ForCausalLM(Gemma4TextConfig(**CONFIG))


def _rewritten(model, **switches):
    import compile_pass

    def backend(gm, example_inputs):
        compile_pass.rewrite(gm, **switches)
        return gm.forward

    return torch.compile(model, backend=backend)


def _batch(seq: int):
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=gen)
    shift_labels = torch.full_like(input_ids, -100)
    shift_labels[:, :-1] = input_ids[:, 1:]
    return input_ids, torch.ones_like(input_ids), shift_labels, torch.arange(seq)[None]


def _time_steps(model, batch, items, repeats) -> float:
    input_ids, attention_mask, shift_labels, positions = batch

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            labels=shift_labels,
            shift_labels=shift_labels,
            num_items_in_batch=items,
            use_cache=False,
        ).loss
        loss.backward()

    step()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _step_worker(rank: int, world: int, port: int, path: str, seq: int, repeats: int) -> None:
    start(rank, world, port)
    shard = seq // world
    batch = [x[:, rank * shard : (rank + 1) * shard].contiguous() for x in _batch(seq)]
    for tensor in batch:  # the sequence length a symbol, as the rule requires
        torch._dynamo.mark_dynamic(tensor, 1)
    items = seq - 1
    seconds = _time_steps(_rewritten(_model(), context_parallel=True), batch, items, repeats)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"seconds": seconds, "peak_mib": _peak_mib()})
    if rank == 0:
        Path(path).write_text(json.dumps(gathered))
    end_rank()


def _peak_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def step_times(seq: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as folder:  # the ranks first: the one process's peak is then its own
        path = os.path.join(folder, "step.json")
        torch.multiprocessing.spawn(_step_worker, args=(2, free_port(), path, seq, repeats), nprocs=2)
        ranks = json.loads(Path(path).read_text())
    torch.set_num_threads(2)
    single = _time_steps(_rewritten(_model()), _batch(seq), seq - 1, repeats)
    single_peak = _peak_mib()
    print(
        f"# training step, Gemma-4 hidden {CONFIG['hidden_size']}, 6 layers, w={CONFIG['sliding_window']}, S={seq}, "
        f"fp32, median of {repeats}, compile_pass rewrite without inductor; peak = the process's peak resident memory"
    )
    print(f"{'':>26} {'step s':>7} {'peak MiB':>9}")
    print(f"{'one process, 2 threads':>26} {single:7.2f} {single_peak:9.0f}")
    for rank, found in enumerate(ranks):
        print(f"{f'rank {rank} of 2, 1 thread':>26} {found['seconds']:7.2f} {found['peak_mib']:9.0f}")
    slowest = max(found["seconds"] for found in ranks)
    print(
        f"one process / slowest rank: time {single / slowest:.2f}x; peak, rank / one process: "
        + ", ".join(f"{found['peak_mib'] / single_peak:.2f}" for found in ranks)
    )


# -- 3. the formula, for a GPU cluster -----------------------------------------------------------


def table() -> None:
    batch, kv_heads, dim, element = 1, 8, 256, 2  # bf16 K/V, fp32 gradients
    print(
        f"# bytes per rank per sliding layer per training step: batch {batch}, {kv_heads} KV heads, head_dim {dim}, "
        "bf16"
    )
    print(f"{'ranks':>5} {'S':>7} {'w':>5} {'halo':>10} {'all-gather':>11} {'ring':>10} {'all-gather/halo':>16}")
    per_position = batch * kv_heads * dim
    for ranks in (2, 8, 32):
        for seq in (32768, 131072, 262144):
            for window in (512, 1024, 4096):
                halo = 2 * (window - 1) * per_position * (element + 4)
                gathered = 2 * (ranks - 1) * (seq // ranks) * per_position * (element + 4)
                ring = 2 * (ranks - 1) * (seq // ranks) * per_position * (2 * element + 4)
                print(
                    f"{ranks:5d} {seq:7d} {window:5d} {_mib(halo)} {_mib(gathered):>11} {_mib(ring)} "
                    f"{gathered / halo:15.0f}x"
                )


# -- 4. the global layers' balance ------------------------------------------------------------------

GLOBAL_LAYER = dict(batch=1, heads=8, kv_heads=4, head_dim=256)


def _balance_worker(rank: int, world: int, port: int, path: str, seq: int, repeats: int) -> None:
    from compile_pass.parallel.context_parallel import context_parallel_attention, shard_sequence
    from compile_pass.parallel.halo_exchange import exchanges
    from compile_pass.parallel.shard_layout import LAYOUTS

    start(rank, world, port)
    gen = torch.Generator().manual_seed(0)
    shape = lambda heads: (GLOBAL_LAYER["batch"], heads, seq, GLOBAL_LAYER["head_dim"])  # noqa: E731
    whole = [
        torch.randn(shape(h), generator=gen)
        for h in (GLOBAL_LAYER["heads"], GLOBAL_LAYER["kv_heads"], GLOBAL_LAYER["kv_heads"])
    ]
    seconds = {}
    for layout in LAYOUTS:
        q, k, v = (shard_sequence(x, 2, layout=layout).requires_grad_() for x in whole)
        runs = []
        for _ in range(repeats + 1):  # the first warms up
            dist.barrier()
            with exchanges() as log:
                context_parallel_attention(q, k, v, window_left=-1, layout=layout).sum().backward()
            runs.append(log.attention_seconds)
        seconds[layout] = sorted(runs[1:])[len(runs[1:]) // 2]
    gathered = [None] * world
    dist.all_gather_object(gathered, seconds)
    if rank == 0:
        Path(path).write_text(json.dumps(gathered))
    end_rank()


def balance(worlds, seq: int, repeats: int) -> None:
    dims = ", ".join(f"{k} {v}" for k, v in GLOBAL_LAYER.items())
    print(
        f"# one full-attention layer, fwd+bwd, fp32, S={seq}, {dims}: CPU seconds in attention per rank, median of "
        f"{repeats}"
    )
    print(f"{'ranks':>5} {'rank':>4} {'contiguous s':>13} {'head-tail s':>12}")
    for world in worlds:
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "balance.json")
            torch.multiprocessing.spawn(_balance_worker, args=(world, free_port(), path, seq, repeats), nprocs=world)
            per_rank = json.loads(Path(path).read_text())
        for rank, seconds in enumerate(per_rank):
            print(f"{world:5d} {rank:4d} {seconds['contiguous']:13.3f} {seconds['head-tail']:12.3f}")
        for layout in ("contiguous", "head-tail"):
            times = [seconds[layout] for seconds in per_rank]
            print(
                f"{world:5d} {layout:>10}: slowest rank {max(times):.3f} s, slowest / fastest "
                f"{max(times) / min(times):.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", action="store_true")
    parser.add_argument("--step", action="store_true")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--balance", action="store_true")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.bytes:
        bytes_table(args.ranks, args.repeats)
    if args.step:
        step_times(args.seq, args.repeats)
    if args.table:
        table()
    if args.balance:
        balance(args.ranks, args.seq, args.repeats)
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")


if __name__ == "__main__":
    main()
