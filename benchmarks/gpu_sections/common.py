"""What every section of gpu_check.py shares: the sliding layer's shapes (Gemma-4 26B-A4B's),
the printer whose lines go to RESULTS.md, timings interleaved with CUDA events, a layer's
seeded inputs and its band mask, and the stand-ins that let ``--cpu-dry-run`` run a section's
code on the CPU."""

from __future__ import annotations

import contextlib
import statistics

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 16, 8, 256, 1024
QUEUED_CALLS = 8


class Printer:
    """Prints lines and keeps them for RESULTS.md."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)


def interleaved_medians_ms(steps: dict, repeats: int, calls: int = 1) -> dict[str, float]:
    """Median milliseconds of each step, the steps taking turns; one warm-up call each. With
    ``calls`` > 1 a timing spans that many calls back to back (per call: the CPU queues the
    next call while the GPU runs, as in a training step) and is divided by it."""
    import torch

    for step in steps.values():
        step()
    torch.cuda.synchronize()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(values) for name, values in times.items()}


def layer_medians_ms(say: Printer, seq: int, steps: dict, repeats: int, calls: int = 1) -> dict[str, float] | None:
    """``interleaved_medians_ms``, or None (said) when the GPU runs out of memory."""
    import torch

    try:
        return interleaved_medians_ms(steps, repeats, calls)
    except torch.cuda.OutOfMemoryError:
        say(f"{seq:6d} out of memory")
        return None
    finally:
        torch.cuda.empty_cache()


def layer_inputs(batch: int, seq: int, head_dim: int = HEAD_DIM):
    """Seeded bf16 q, k, v (requiring grad) and grad_out of one layer, each (B, S, H, D) as the
    projections produce it; attention layers pass ``.transpose(1, 2)`` views of them."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seq)

    def storage(heads):
        return torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    q, k, v = (storage(h).requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    return q, k, v, storage(HEADS)


def causal_band(seq: int, window: int):
    """The sliding band as transformers' boolean mask: key j visible from query i when i - w < j <= i."""
    import torch

    positions = torch.arange(seq, device="cuda")
    return (positions[None, :] > positions[:, None] - window) & (positions[None, :] <= positions[:, None])


@contextlib.contextmanager
def cpu_stand_ins():
    """For ``--cpu-dry-run``: torch.cuda's timing events, synchronize and memory statistics
    replaced by wall-clock events and zeros, so that a section's code runs on the CPU and the
    times it prints are the CPU's (memory 0). Nothing printed then is a GPU measurement."""
    import time

    import torch

    class WallClockEvent:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    names = ("Event", "synchronize", "reset_peak_memory_stats", "max_memory_allocated", "empty_cache")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.Event = WallClockEvent
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    torch.cuda.max_memory_allocated = lambda device=None: 0
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
