"""Suite-wide set-up.

The suite runs in parallel processes (pytest-xdist, ``-n 2`` in pyproject's pytest options):
each worker gets an equal share of the machine's cores for torch's intra-op threads, so that
two workers on 2 cores do not both spin two OpenMP threads on them.
"""

import os

import torch


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(workers)))
