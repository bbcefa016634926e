"""Process groups of a few CPU processes (gloo) for the distributed tests and benchmarks."""

import os
import socket
import sys
from typing import NoReturn

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


def end_rank() -> NoReturn:
    """Destroy the process group and end this process at once, exit status 0, its results
    already written. Not through Python's finalization: the gloo thread that ran the last
    collective drops that work's tensors after ``wait`` returns, and dropping them takes the
    GIL; a thread that takes the GIL while the interpreter finalizes is ended inside that
    destructor and the process aborts ("terminate called without an active exception", seen in
    about 1 run in 30 of a two-rank FSDP2 test on 2 cores). ``os._exit`` ends every thread
    with the process instead."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
