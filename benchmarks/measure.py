"""Peak resident memory and median time of a step, for the benchmark child processes.

Peak memory is the process's peak resident memory (VmHWM) during one call, above what it
held before (VmRSS). Run children with MALLOC_MMAP_THRESHOLD_=65536 (``PINNED_MALLOC``) so
that freed tensors leave resident memory at once instead of staying in glibc's heap.
"""

import json
import os
import statistics
import time
from pathlib import Path

PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def processor() -> str:
    """The CPU's model and the vector ISA torch's kernels use, for a results header: bf16 times
    differ by an order of magnitude between machines (one sweep cell took 0.18 s on one and
    2.2 s on another)."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            name = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_mib(call) -> float:
    """MiB of resident memory ``call()`` needed above what the process held before it."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    call()
    return (_status_kib("VmHWM") - before) / 1024


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pinned_env() -> dict:
    return dict(os.environ, **PINNED_MALLOC)


def plot_speedups(path: str, seqs: list[int], series: dict[str, list[float]], title: str) -> None:
    """Speedup against sequence length, one line per series (a label starting "limit": dashed, grey),
    both axes logarithmic so that 0.9x and 50x read on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        dashed = label.startswith("limit")
        axes.plot(seqs, values, "--" if dashed else "o-", color="gray" if dashed else None, label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(seqs, [str(seq) for seq in seqs], rotation=45)
    axes.set_yscale("log")
    values = [value for line in series.values() for value in line if value == value]  # NaN: no cell
    ticks = [t for t in (0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 50, 100) if min(values) / 1.5 <= t <= max(values) * 1.5]
    axes.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    axes.minorticks_off()
    axes.set_xlabel("sequence length S")
    axes.set_ylabel("speedup")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


class Results:
    """Measurements by key, appended to a JSON-lines file when one is given; a rerun with the
    same file reuses what it holds (an interrupted sweep resumes where it stopped)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.held: dict[str, dict] = {}
        if self.path and self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line)
                self.held[record["key"]] = record

    def add(self, key: str, record: dict) -> dict:
        record = {"key": key, **record}
        self.held[key] = record
        if self.path:
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")
        return record

    def measure(self, key: str, run) -> dict:
        if key not in self.held:
            self.add(key, {**run(), "load": os.getloadavg()[0], "when": time.strftime("%Y-%m-%d %H:%M")})
        return self.held[key]
