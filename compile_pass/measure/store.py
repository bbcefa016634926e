"""Where kernel measurements made on the device persist between runs (``measure`` makes them).

One directory per environment: the device, torch's, triton's and compile_pass's versions and a
hash of the source of every module a measurement runs (found by following the imports), so
that another device, another release or a changed kernel measures afresh rather than reading
numbers that no longer hold. Inside it, one small JSON file per (call key, kernel, length
bucket): a measurement is written whole to a temporary file in the
same directory and renamed over its name (``os.replace``, atomic), so a reader sees a whole
entry or none, and processes writing at once (ranks, DataLoader workers, two jobs) lose no
entry: each writes its own files, and two that measure the same bucket both write a whole one.

The directory is ``COMPILE_PASS_CACHE_DIR`` where set, else ``compile_pass/measurements`` under
inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, or its default in the temporary
directory), which ``rm -r`` clears like inductor's own caches.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import torch

from .. import sources

CACHE_DIR_VARIABLE = "COMPILE_PASS_CACHE_DIR"
# What a measurement runs: the op, SDPA as the rules leave a call, every kernel, and all they
# import (``measure.run`` imports the op, which imports the policy and its kernels).
_MEASURED_CODE = "compile_pass.measure.run"


def cache_root() -> Path:
    """The directory that holds every environment's measurements."""
    given = os.environ.get(CACHE_DIR_VARIABLE)
    if given:
        return Path(given)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "compile_pass" / "measurements"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.cache
def ops_source_hash() -> str:
    """A hash of the source of every module a measurement runs, found by following the imports
    from the one that runs it: a change to any of them, the kernels' helpers outside their
    folder included, measures afresh."""
    digest = hashlib.sha256()
    for name in sorted(sources.imported_closure({_MEASURED_CODE})):
        digest.update(name.encode())
        digest.update(sources.modules()[name].read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def cpu_name() -> str:
    """The CPU's model as the kernel reports it (``/proc/cpuinfo``), else the platform's."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The device as a measurement is keyed by: a CUDA GPU's name and capability, or the CPU's
    model and the threads torch computes with (a measurement with 2 threads says nothing of 16)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def environment(device: torch.device) -> dict[str, str]:
    """What makes two measurements comparable: the device and every release and source the
    kernels run."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "compile_pass": _version("compile_pass"),
        "ops": ops_source_hash(),
    }


class MeasurementStore:
    """The measurements of one environment on disk, by (key name, bucket)."""

    def __init__(self, root: Path, device: torch.device):
        self.environment = environment(device)
        fingerprint = hashlib.sha256(json.dumps(self.environment, sort_keys=True).encode()).hexdigest()[:16]
        self.directory = root / fingerprint

    def load(self, key_name: str, kernel_slug: str) -> list[tuple[Path, object]]:
        """Every bucket measured for a key's kernel, as written, by file: the parsed JSON, or a
        ValueError where a file is not JSON (another process's partial temporary files have
        other names and are never read). The reader checks each record."""
        records: list[tuple[Path, object]] = []
        if not self.directory.is_dir():
            return records
        for path in sorted(self.directory.glob(f"{key_name}-{kernel_slug}-*.json")):
            try:
                records.append((path, json.loads(path.read_text())))
            except OSError:
                continue
            except ValueError as error:
                records.append((path, ValueError(f"not JSON: {error}")))
        return records

    def remove(self, key_name: str) -> None:
        """Every record of a key (``remeasure``); one another process removed first is gone."""
        if self.directory.is_dir():
            for path in self.directory.glob(f"{key_name}-*.json"):
                try:
                    path.unlink()
                except OSError:
                    pass

    def save(self, key_name: str, part: str, record: dict) -> None:
        """Writes one record of a key (``part`` names it: a kernel and a bucket) atomically. An
        unwritable directory only loses the cache: the measurement stays in memory here."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            described = self.directory / "environment.json"
            if not described.exists():
                _write_atomically(described, json.dumps(self.environment, indent=1, sort_keys=True))
            _write_atomically(self.directory / f"{key_name}-{part}.json", json.dumps(record, sort_keys=True))
        except OSError:
            pass


def _write_atomically(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
