"""What was measured on the device (``compile_pass.measure`` decides when, ``measure.run`` runs it): the
key a call is measured under, the buckets its lengths round to, one kernel's measurement at one
bucket, and the process's table of them (read from and written to the cache:
``measure.store``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..kernels.contract import CallFacts
from .run import Outcome
from .store import MeasurementStore, cache_root, device_name

# A kernel is chosen where its median forward and backward is below SDPA's by this share; by the
# larger one where the budget left fewer than MANY_ROUNDS rounds (a single slow or fast run
# moves a median of one or two).
MARGIN, FEW_ROUNDS_MARGIN, MANY_ROUNDS = 0.05, 0.15, 3
FIRST_EDGE = 64


def edges() -> Iterator[int]:
    """64, 96, 128, 192, 256, 384, ...: each power of two and one and a half times it."""
    power = FIRST_EDGE
    while True:
        yield power
        yield power * 3 // 2
        power *= 2


def bucket(keys: int) -> int | None:
    """The largest edge at most ``keys``; None below the first (too short to measure)."""
    found = None
    edge_list = edges()
    while (edge := next(edge_list)) <= keys:
        found = edge
    return found


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
    backward: bool = True  # timed forward and backward; False: the forward alone (no_grad calls)

    @property
    def name(self) -> str:
        """The key's file name in the cache."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Measured:
    """One kernel measured at one bucket: the median milliseconds of its forward and backward
    and of SDPA's, timed in the same rounds; or why it was not timed."""

    kernel: str
    keys: int
    batch: int
    rounds: int
    sdpa_ms: float | None
    kernel_ms: float | None
    refused: str | None = None  # not for this bucket on this device: it differs from SDPA, or failed
    skipped: str | None = None  # not timed at this length: out of memory (it passes: never cached)
    why_not: str | None = None  # nothing timed (low memory): SDPA stays (it passes: never cached)
    replaced: str = "SDPA"  # what ``sdpa_ms`` timed: SDPA, or SDPA without the cap for a capped call
    cached: bool = False  # read from the cache directory
    source: str | None = None  # where it was measured, where not on this process's device ("rank 0")

    @classmethod
    def of(cls, kernel: str, keys: int, batch: int, outcome: Outcome) -> Measured:
        return cls(
            kernel,
            keys,
            batch,
            outcome.rounds,
            outcome.sdpa_ms,
            outcome.kernel_ms,
            outcome.refused,
            outcome.skipped,
            outcome.why_not,
            outcome.replaced,
        )

    def record(self) -> dict:
        fields = dataclasses.asdict(self)
        fields.pop("cached")
        fields.pop("source")
        return fields

    @classmethod
    def from_record(cls, record: object) -> Measured:
        """A record as the cache holds it, checked field by field: a ValueError says what is
        wrong with one that is damaged or was written by other code."""
        if not isinstance(record, Mapping):
            raise ValueError(f"not a record but {type(record).__name__}")
        for name, types in _RECORD_TYPES.items():
            if name in record and not (isinstance(record[name], types) and not isinstance(record[name], bool)):
                raise ValueError(f"{name} is {record[name]!r}")
        missing = [name for name in ("kernel", "keys", "batch", "rounds") if name not in record]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        for name in ("sdpa_ms", "kernel_ms"):
            value = record.get(name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} is {value!r}, not a finite time")
        if bucket(record["keys"]) != record["keys"]:
            raise ValueError(f"keys is {record['keys']}, not a bucket's edge")
        if record["rounds"] < 0 or record["batch"] < 1:
            raise ValueError(f"rounds {record['rounds']} and batch {record['batch']}")
        measured = cls(**{name: record[name] for name in _RECORD_TYPES if name in record}, cached=True)
        if not measured.lasting:
            raise ValueError("a passing outcome, not a verdict")
        return measured

    @property
    def lasting(self) -> bool:
        """A verdict that holds until the environment changes: timings, or a refusal (the kernel
        differs from SDPA or fails). Low memory and out of memory pass, and are not cached."""
        if self.why_not is not None or self.skipped is not None:
            return False
        return self.refused is not None or (self.kernel_ms is not None and self.sdpa_ms is not None)

    @property
    def wins(self) -> bool:
        """Faster than SDPA by the margin (the larger one for few rounds)."""
        if self.kernel_ms is None or self.sdpa_ms is None:
            return False
        margin = MARGIN if self.rounds >= MANY_ROUNDS else FEW_ROUNDS_MARGIN
        return self.kernel_ms * (1 + margin) <= self.sdpa_ms

    def words(self) -> str:
        """What was measured, in a user's words."""
        if self.why_not is not None:
            return f"{self.why_not} (at {self.keys} keys)"
        if self.refused is not None:
            return f"{self.refused} (checked at {self.keys} keys)"
        if self.skipped is not None:
            return f"not measured on this device: {self.skipped} (at {self.keys} keys)"
        if self.kernel_ms is None or self.sdpa_ms is None:
            return f"not measured on this device (at {self.keys} keys)"
        cached = ", cached" if self.cached else ""
        times = f"{milliseconds(self.kernel_ms)} ms, {self.replaced} {milliseconds(self.sdpa_ms)} ms"
        return f"measured on {self.source or 'this device'}: {times} at {self.keys} keys{cached}"


# The fields of a cached record and the types each may hold (ints and floats: JSON's numbers).
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "kernel": (str,),
    "keys": (int,),
    "batch": (int,),
    "rounds": (int,),
    "sdpa_ms": (int, float, type(None)),
    "kernel_ms": (int, float, type(None)),
    "refused": (str, type(None)),
    "skipped": (str, type(None)),
    "why_not": (str, type(None)),
    "replaced": (str,),
}


class Table:
    """Every measurement this process knows (made here, read from the cache, or broadcast), by
    key, kernel and bucket."""

    def __init__(self) -> None:
        self._measured: dict[MeasureKey, dict[str, dict[int, Measured]]] = {}
        self._loaded: set[tuple[MeasureKey, str]] = set()  # (key, kernel) read from the cache
        self.measured = 0  # measurements this process made (the tests count them)
        self.version = 0  # moves with every measurement added: answers remembered from before are stale
        self.asked: set[MeasureKey] = set()  # keys a verdict was asked for (``tune`` prints them)

    def clear(self) -> None:
        """Forgets every measurement (the cache directory keeps its own): a new process, as far
        as this table can tell."""
        self._measured.clear()
        self._loaded.clear()
        self.asked.clear()
        self.measured = 0
        self.version += 1

    def buckets(
        self, key: MeasureKey, kernel: str, device: torch.device, *, cached: bool = True
    ) -> dict[int, Measured]:
        """A kernel's buckets for the key, with its records in the cache directory read once
        (not in ``remeasure``). A record that fails its checks (``Measured.from_record``, or a
        kernel or bucket other than its file's name says) is ignored, with one warning naming
        the file: its bucket is measured again, and the file written anew."""
        known = self._measured.setdefault(key, {}).setdefault(kernel, {})
        if cached and (key, kernel) not in self._loaded:
            self._loaded.add((key, kernel))
            for path, record in MeasurementStore(cache_root(), device).load(key.name, _slug(kernel)):
                try:
                    if isinstance(record, ValueError):  # not JSON
                        raise record
                    measured = Measured.from_record(record)
                    if measured.kernel != kernel or path.stem != f"{key.name}-{_slug(kernel)}-{measured.keys}":
                        raise ValueError(f"it holds {measured.kernel} at {measured.keys} keys, not what its name says")
                except ValueError as error:
                    _warn_damaged(path, str(error))
                    continue
                known.setdefault(measured.keys, measured)
                self.version += 1
        return known

    def add(self, key: MeasureKey, measured: Measured, device: torch.device | None) -> None:
        """A measurement, written to the cache where ``device`` is given (made here) and it is
        a lasting verdict; one that passes (low memory, out of memory) is kept in memory until
        the next compile (``forget_passing``), then measured again."""
        self._measured.setdefault(key, {}).setdefault(measured.kernel, {})[measured.keys] = measured
        self.version += 1
        if device is not None:
            self.measured += 1
            if measured.lasting:
                MeasurementStore(cache_root(), device).save(key.name, _part(measured), measured.record())

    def adopt(self, key: MeasureKey, kernel: str, buckets: Mapping[int, Measured]) -> None:
        """Another process's complete answer for a kernel of the key (rank 0's), in place of
        whatever this one knows or its cache holds: nothing of its own is read for it after."""
        self._loaded.add((key, kernel))
        self._measured.setdefault(key, {})[kernel] = dict(buckets)
        self.version += 1

    def forget(self, key: MeasureKey, device: torch.device) -> None:
        """Every verdict of the key, here and in the cache (``remeasure`` measures it afresh)."""
        self._measured.pop(key, None)
        self._loaded = {loaded for loaded in self._loaded if loaded[0] != key}
        MeasurementStore(cache_root(), device).remove(key.name)
        self.version += 1

    def forget_passing(self) -> None:
        """Outcomes that pass (low memory, out of memory): a new compile measures them again."""
        for kernels in self._measured.values():
            for buckets in kernels.values():
                for edge in [edge for edge, measured in buckets.items() if not measured.lasting]:
                    del buckets[edge]
        self.version += 1

    def of_keys(self, keys: set[MeasureKey]) -> dict[MeasureKey, dict[str, dict[int, Measured]]]:
        """The measurements of ``keys``, as the table holds them (what rank 0 broadcasts)."""
        return {key: self._measured[key] for key in keys if key in self._measured}

    def entries(self, keys: set[MeasureKey] | None = None) -> list[tuple[MeasureKey, Measured]]:
        """(key, measurement) pairs, by key, length and kernel; of ``keys`` only where given."""
        found = [
            (key, measured)
            for key, kernels in self._measured.items()
            if keys is None or key in keys
            for buckets in kernels.values()
            for measured in buckets.values()
        ]
        return sorted(found, key=lambda pair: (str(pair[0]), pair[1].keys, pair[1].kernel))


def milliseconds(ms: float) -> str:
    """3 significant figures, never in exponent form: 0.0412, 3.27, 81.6, 1104."""
    return f"{ms:.0f}" if ms >= 1000 else f"{ms:.3g}"


def _slug(kernel: str) -> str:
    return hashlib.sha256(kernel.encode()).hexdigest()[:8]


def _part(measured: Measured) -> str:
    """A record's part of its file name: its kernel and bucket."""
    return f"{_slug(measured.kernel)}-{measured.keys}"


_WARNED_FILES: set[str] = set()


def _warn_damaged(path, why: str) -> None:
    if str(path) not in _WARNED_FILES:
        _WARNED_FILES.add(str(path))
        warnings.warn(f"compile_pass: ignored the cached measurement {path} ({why}): measured again", stacklevel=4)


def table_text(entries: Sequence[tuple[MeasureKey, Measured]]) -> str:
    """The measurements as a markdown table: a row a key, length and kernel, its median forward
    and backward against SDPA's (without the cap for a soft-capped call) in the same rounds,
    and the verdict."""
    header = (
        "| dtype | head_dim | heads / KV | window | batch form | keys | kernel | kernel ms | replaced ms | verdict | |"
    )
    lines = [header, "| --- " * 11 + "|"]
    for key, m in entries:
        dim = f"{key.head_dim}" + (f" (value {key.value_head_dim})" if key.value_head_dim else "")
        form = key.form + (", soft-capped" if key.softcap else "") + ("" if key.backward else ", forward alone")
        verdict = "wins" if m.wins else (m.why_not or m.refused or m.skipped or "slower")
        times = ["—" if ms is None else milliseconds(ms) for ms in (m.kernel_ms, m.sdpa_ms)]
        row = [key.dtype, dim, f"{key.heads} / {key.kv_heads}", f"({key.left}, {key.right})", form, str(m.keys)]
        cached = "cached" if m.cached else f"{m.rounds} round{'s' if m.rounds != 1 else ''}"
        lines.append("| " + " | ".join([*row, m.kernel, *times, verdict.replace("|", "\\|"), cached]) + " |")
    return "\n".join(lines)


TABLE = Table()


def key_of(facts: CallFacts, device: torch.device) -> MeasureKey:
    """The key a call is measured under on ``device`` (its shape and window known: a call
    without them is not measured)."""
    heads, kv_heads, left, right = facts.heads, facts.kv_heads, facts.left, facts.right
    if heads is None or kv_heads is None or left is None or right is None:
        raise ValueError(f"a call is measured with its heads and window known, not {facts}")
    return MeasureKey(
        device_name(device),
        str(facts.dtype).removeprefix("torch."),
        facts.head_dim,
        facts.value_head_dim,
        heads,
        kv_heads,
        left,
        right,
        batch_form(facts),
        facts.softcap,
        facts.grad,
    )
