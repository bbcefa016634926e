"""What was measured on the device (``measure.py`` decides when, ``measure_run.py`` runs it): the
key a call is measured under, the buckets its lengths round to, one bucket's measurement, and
the process's table of them (read from and written to the cache: ``measure_store.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .kernel import CallFacts
from .measure_run import Outcome
from .measure_store import MeasurementStore, cache_root, device_name

# A kernel is chosen where its median forward and backward is below SDPA's by this share.
MARGIN = 0.05
FIRST_EDGE = 64


def edges() -> Iterator[int]:
    """64, 96, 128, 192, 256, 384, ...: each power of two and one and a half times it."""
    power = FIRST_EDGE
    while True:
        yield power
        yield power * 3 // 2
        power *= 2


def bucket(keys: int) -> int | None:
    """The largest edge at most ``keys``; None below the first (the static tables decide)."""
    found = None
    for edge in edges():
        if edge > keys:
            return found
        found = edge


def next_edge(edge: int) -> int:
    return next(e for e in edges() if e > edge)


def previous_edge(edge: int) -> int | None:
    return bucket(edge - 1)


# -- keys and measurements ------------------------------------------------------------------


def batch_form(facts: CallFacts) -> str:
    parts = [name for name, given in (("padded", facts.key_padding), ("packed", facts.segment_ids)) if given]
    parts += ["images"] if facts.blocks else []
    return "+".join(parts) or "dense"


@dataclass(frozen=True)
class MeasureKey:
    """What a measurement holds for, at every length of its buckets."""

    device: str
    dtype: str
    head_dim: int
    value_head_dim: int | None
    heads: int
    kv_heads: int
    left: int
    right: int
    form: str
    softcap: bool

    @property
    def name(self) -> str:
        """The key's file name in the cache."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Measured:
    """One bucket's measurement: median milliseconds of a forward and backward."""

    keys: int
    batch: int
    rounds: int
    sdpa_ms: float | None
    kernel_ms: Mapping[str, float]
    refused: Mapping[str, str]
    skipped: Mapping[str, str]
    why_not: str | None = None
    cached: bool = False  # read from the cache directory

    @classmethod
    def of(cls, keys: int, batch: int, outcome: Outcome) -> Measured:
        return cls(
            keys,
            batch,
            outcome.rounds,
            outcome.sdpa_ms,
            dict(outcome.kernel_ms),
            dict(outcome.refused),
            dict(outcome.skipped),
            outcome.why_not,
        )

    def record(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("cached")
        return fields

    @classmethod
    def from_record(cls, record: Mapping) -> Measured:
        names = {f.name for f in dataclasses.fields(cls)} - {"cached"}
        return cls(**{name: record[name] for name in names}, cached=True)

    def decides(self, kernel: str) -> bool:
        """Whether this bucket says anything of ``kernel``: measured, refused, passed over (out
        of memory), or nothing measured."""
        return self.why_not is not None or any(kernel in said for said in (self.kernel_ms, self.refused, self.skipped))

    def wins(self, kernel: str) -> bool:
        time, sdpa = self.kernel_ms.get(kernel), self.sdpa_ms
        return time is not None and sdpa is not None and time * (1 + MARGIN) <= sdpa

    def words(self, kernel: str) -> str:
        """What was measured, in a user's words."""
        if self.why_not is not None:
            return f"{self.why_not} (at {self.keys} keys)"
        if kernel in self.refused:
            return f"{self.refused[kernel]} (checked at {self.keys} keys)"
        if kernel in self.skipped:
            return f"not measured on this device: {self.skipped[kernel]} (at {self.keys} keys)"
        cached = ", cached" if self.cached else ""
        return (
            f"measured on this device: {self.kernel_ms[kernel]:.3g} ms, SDPA {self.sdpa_ms:.3g} ms "
            f"at {self.keys} keys{cached}"
        )


class Table:
    """Every measurement this process knows: made here, read from the cache, or broadcast."""

    def __init__(self) -> None:
        self._buckets: dict[MeasureKey, dict[int, Measured]] = {}
        self._loaded: set[MeasureKey] = set()
        self.measured = 0  # measurements this process made (the tests count them)
        self.version = 0  # moves with every measurement added: answers remembered from before are stale
        self.asked: set[MeasureKey] = set()  # keys a verdict was asked for (``tune`` prints them)

    def clear(self) -> None:
        """Forgets every measurement (the cache directory keeps its own): a new process, as far
        as this table can tell."""
        self._buckets.clear()
        self._loaded.clear()
        self.asked.clear()
        self.measured = 0
        self.version += 1

    def buckets(self, key: MeasureKey, device: torch.device, *, cached: bool = True) -> dict[int, Measured]:
        """The key's buckets, with those in the cache directory read once (not in ``remeasure``)."""
        known = self._buckets.setdefault(key, {})
        if cached and key not in self._loaded:
            self._loaded.add(key)
            for record in MeasurementStore(cache_root(), device).load(key.name):
                try:
                    measured = Measured.from_record(record)
                except (KeyError, TypeError):
                    continue
                known.setdefault(measured.keys, measured)
                self.version += 1
        return known

    def add(self, key: MeasureKey, measured: Measured, device: torch.device | None) -> None:
        """A measurement, written to the cache where ``device`` is given (made here)."""
        self._buckets.setdefault(key, {})[measured.keys] = measured
        self.version += 1
        if device is not None:
            self.measured += 1
            MeasurementStore(cache_root(), device).save(key.name, measured.keys, measured.record())

    def entries(self, keys: set[MeasureKey] | None = None) -> list[tuple[MeasureKey, Measured]]:
        """(key, bucket) measurements, by key and length; of ``keys`` only where given."""
        return [
            (key, m)
            for key, buckets in self._buckets.items()
            if keys is None or key in keys
            for _, m in sorted(buckets.items())
        ]


def table_text(entries: Sequence[tuple[MeasureKey, Measured]]) -> str:
    """The measurements as a markdown table: a row a key and length, each kernel's median
    forward and backward against SDPA's, and whether it wins by the margin."""
    header = "| dtype | head_dim | heads / KV | window | batch form | keys | SDPA ms | kernels | |"
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, m in entries:
        dim = f"{key.head_dim}" + (f" (value {key.value_head_dim})" if key.value_head_dim else "")
        form = key.form + (", soft-capped" if key.softcap else "")
        if m.why_not is not None:
            kernels = m.why_not
        else:
            said = [f"{name} {ms:.3g} ms{' (wins)' if m.wins(name) else ''}" for name, ms in m.kernel_ms.items()]
            said += [f"{name}: {why}" for name, why in {**m.refused, **m.skipped}.items()]
            kernels = "; ".join(said) or "none measured"
        sdpa = "—" if m.sdpa_ms is None else f"{m.sdpa_ms:.3g}"
        cached = "cached" if m.cached else f"{m.rounds} rounds"
        row = [key.dtype, dim, f"{key.heads} / {key.kv_heads}", f"({key.left}, {key.right})", form, str(m.keys), sdpa]
        lines.append("| " + " | ".join([*row, kernels.replace("|", "\\|"), cached]) + " |")
    return "\n".join(lines)


TABLE = Table()


def key_of(facts: CallFacts, device: torch.device) -> MeasureKey:
    return MeasureKey(
        device_name(device),
        str(facts.dtype).removeprefix("torch."),
        facts.head_dim,
        facts.value_head_dim,
        facts.heads,
        facts.kv_heads,
        facts.left,
        facts.right,
        batch_form(facts),
        facts.softcap,
    )
