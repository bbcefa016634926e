"""Process groups of a few CPU processes (gloo) for the distributed tests and benchmarks."""

import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(rank: int, world: int, port: int) -> None:
    """Join the group on ``port``; one thread a process (tiny tensors, shared cores)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
