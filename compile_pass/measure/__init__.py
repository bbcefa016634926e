"""Kernel choice measured on the device a call runs on, checked against SDPA first, and cached.

The policy (``kernels.policy``) asks here, for the kernels that compute a call exactly, in its list's
order up to the first that wins, whether each was measured at least as fast as SDPA for such a
call on this device. A call is keyed by what decides the work (``MeasureKey``: the device,
dtype, head_dim and value head_dim, heads and KV heads, the window, the batch form,
soft-capping) and its number of keys, rounded down to a bucket (``measured.edges``: 64, 96, 128,
192, 256, ... keys). Where no measurement covers the call, one is made (``measure.run``): SDPA
as the rule would leave the call against the kernel, forward and backward, timed in turn, the
median of repeated rounds, the kernel's results checked against SDPA's first (a kernel that
differs or fails is never chosen for the key, with one warning). A kernel is chosen where its
median beats SDPA's by ``MARGIN`` (more with few rounds), so that noise does not flip a choice that is then cached
(``measure.store``).

Each bucket is measured at its smallest length: a band kernel's advantage over SDPA grows with
the length (SDPA scores every pair), so a length is decided by its own bucket, else by the
longest measured bucket below it where the kernel won. A graph traced with a symbolic length
(the size hint decides) is guarded to the lengths its answer holds for, as inductor guards its
own size-dependent choices: from the shortest bucket of the run of measured wins that holds
the hint up, or below the next bucket where it lost. At graph time the search measures the
neighbouring buckets too, downward while the kernel wins and upward while it loses, as the
budget allows, so one guard covers most lengths a run trains on; the op at run time reads the
same table and measures only a bucket nothing covers.

Measurement is bounded: ``COMPILE_PASS_MEASURE_SECONDS`` per key and per compile (defaults
below), shapes that would not fit half the free memory are not measured (SDPA stays, with that
reason), and nothing is measured with fake tensors, while a CUDA graph is captured, under
``torch.distributed`` at run time, or for decoding-shaped calls (Sq != Sk: the static tables
decide those); a call under 64 keys keeps SDPA (too short to measure: the op's fixed cost per
call is most of it). ``COMPILE_PASS_MEASURE`` (or the option ``measure``) chooses: ``measure`` (the
default), ``static`` (the tables measured by this project only), or ``remeasure`` (measure
again, clearing the key's verdicts). Under ``torch.distributed`` each question is answered by
rank 0 for the whole group (``_agree``): every rank routes a given call the same way and makes
the same collectives; every rank must then compile the same graphs in the same order (DDP,
FSDP, context parallel). A length the user marked dynamic is never guarded: one answer holds
for its whole range (``_marked_dynamic_from``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from ..kernels import contract as kernel_settings
from ..kernels import policy
from ..kernels.contract import CallFacts, Kernel
from . import run as measure_run
from .run import Shape
from .store import cache_root
from .table import FIRST_EDGE, TABLE, Measured, bucket, key_of, next_edge, previous_edge

MODE_VARIABLE = "COMPILE_PASS_MEASURE"
SECONDS_VARIABLE = "COMPILE_PASS_MEASURE_SECONDS"
MEASURE, STATIC, REMEASURE = "measure", "static", "remeasure"
MODES = (MEASURE, STATIC, REMEASURE)
REPEATS = 5
# Seconds a key may spend measuring (its search over lengths) and a compile in all. A Gemma-4
# model has two keys a length (sliding and global layers): a first compile measures for a few
# seconds on the CPU and well under one on a GPU; a second run reads the cache.
SECONDS_PER_KEY, SECONDS_PER_COMPILE = 4.0, 12.0


@dataclass(frozen=True)
class Settings:
    mode: str = MEASURE
    seconds_per_key: float = SECONDS_PER_KEY
    seconds_per_compile: float = SECONDS_PER_COMPILE


def settings_from_environment() -> Settings:
    """The settings ``COMPILE_PASS_MEASURE`` and ``COMPILE_PASS_MEASURE_SECONDS`` ("per key" or
    "per key,per compile") give; a value that cannot be read raises, naming the variable."""
    return _settings(os.environ.get(MODE_VARIABLE, MEASURE), os.environ.get(SECONDS_VARIABLE))


@functools.lru_cache(maxsize=16)
def _settings(mode: str, seconds: str | None) -> Settings:
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode!r}: expected one of {', '.join(MODES)}")
    if not seconds:
        return Settings(mode)
    try:
        values = [float(part) for part in seconds.split(",")]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or not all(math.isfinite(value) and value >= 0 for value in values):
        raise ValueError(
            f"{SECONDS_VARIABLE}={seconds!r}: expected seconds per key, or per key,per compile "
            "(finite numbers, 0 or more)"
        )
    return Settings(mode, values[0], values[1] if len(values) == 2 else max(values[0], SECONDS_PER_COMPILE))


@dataclass
class _Session:
    """The settings in force and the seconds a compile has spent measuring."""

    settings: Settings
    spent: float = 0.0
    spent_on: dict = dataclasses.field(default_factory=dict)  # MeasureKey -> seconds it spent measuring
    measure_on: torch.device | None = None  # measure calls of any device on this one (tune, tests)
    remeasured: set = dataclasses.field(default_factory=set)  # keys ``remeasure`` cleared in this session
    # The symbols of sizes the user marked dynamic in the graph being compiled: never guarded.
    marked_dynamic: frozenset = frozenset()


_SESSIONS: list[_Session] = []


def _session() -> _Session:
    if _SESSIONS:
        return _SESSIONS[-1]
    return _Session(settings_from_environment())


@contextlib.contextmanager
def compiling(mode: str | None = None, marked_dynamic: frozenset = frozenset()) -> Iterator[None]:
    """A compile's measurements: a fresh budget, outcomes that pass (low memory) measured
    again, and ``mode`` in place of the environment's; ``marked_dynamic``: the symbols of the
    sizes the user marked dynamic in the graph (``graphs.marked_dynamic_symbols``). Inside
    ``measuring_on`` (``tune``), its settings (mode and seconds) in place of the environment's,
    and its device."""
    TABLE.forget_passing()
    outer = _SESSIONS[-1] if _SESSIONS and _SESSIONS[-1].measure_on is not None else None
    settings = outer.settings if outer is not None else settings_from_environment()
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"measure={mode!r}: expected one of {', '.join(MODES)}")
        settings = dataclasses.replace(settings, mode=mode)
    _SESSIONS.append(
        _Session(settings, measure_on=outer.measure_on if outer is not None else None, marked_dynamic=marked_dynamic)
    )
    try:
        yield
    finally:
        _SESSIONS.pop()


@contextlib.contextmanager
def measuring_on(device: torch.device | str, mode: str = MEASURE, seconds_per_key: float | None = None):
    """Calls of any device (the meta device of an offline trace) measured on ``device``: what
    ``python -m compile_pass tune`` measures ahead of a run."""
    settings = dataclasses.replace(settings_from_environment(), mode=mode)
    if seconds_per_key is not None:
        settings = dataclasses.replace(
            settings, seconds_per_key=seconds_per_key, seconds_per_compile=max(seconds_per_key, 1e9)
        )
    _SESSIONS.append(_Session(settings, measure_on=torch.device(device)))
    try:
        yield
    finally:
        _SESSIONS.pop()


def verdicts_digest() -> str:
    """A digest of every verdict a compile could read: the cache directory's records (by name,
    size and time written). Inductor's cache key under ``enable()`` holds it (``RewritePass``)."""
    digest = hashlib.sha256()
    root = cache_root()
    if root.is_dir():
        for path in sorted(root.rglob("*.json")):
            try:
                stat = path.stat()
            except OSError:
                continue
            digest.update(f"{path.relative_to(root)} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def mode() -> str:
    return _session().settings.mode


def measuring_device() -> torch.device | None:
    """The device calls of any device are measured on (``measuring_on``), or None."""
    return _session().measure_on


_WARNED: set[tuple[str, str]] = set()


# -- verdicts ----------------------------------------------------------------------------------


def _int(size) -> int:
    """A size as a number: itself, or a symbolic size's hint (the length the graph is traced at)."""
    return size if isinstance(size, int) else int(size.node.hint)


def _known(size) -> bool:
    return size is not None and (isinstance(size, int) or size.node.hint is not None)


class Verdict(NamedTuple):
    """A measured kernel's answer for one call."""

    slower: str | None  # why it may be slower than SDPA; None: measured at least as fast
    words: str  # what was measured, for the report
    # Guards a symbolic length to the lengths the answer holds for: called by the policy for the
    # answers it reads (a kernel after the one it chooses adds no guard).
    guard: Callable[[], object] | None = None
    measured: bool = True  # False: the static tables answered (the budget was spent first)


def why_not_measured(facts: CallFacts, run_time: bool) -> str | None:
    """Why a call is left to the static tables, or None where it is measured."""
    session = _session()
    if session.settings.mode == STATIC:
        return "static tables (measure='static')"
    device = session.measure_on or facts.device
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        return f"nothing to measure on {device.type}"
    if (facts.spelled or facts.softcap) and device.type == "cpu":
        # What the op replaces is a chain of ops compiled by inductor, which cannot be compiled
        # and timed inside the compile that asks (inductor's bookkeeping fails). SDPA, the bound
        # timed in its place elsewhere, runs on the CPU the fused kernel the op's whole calls
        # run, and without a cap it is far faster than capped math: it would keep calls the op
        # wins against the chain (bench_spelled.py, with --softcap).
        return "attention spelled out in ops on the CPU keeps the crossovers measured against the compiled chain"
    if not facts.same_lengths or facts.left is None or facts.right is None:
        return "decoding-shaped calls are left to the static tables"
    if not all(_known(size) for size in (facts.keys, facts.batch, facts.heads, facts.kv_heads, facts.queries)):
        return "the call's shape is not known here"
    if measure_run.capturing(device):
        return "a CUDA graph is being captured"
    if run_time and _distributed():
        return "under torch.distributed only graph time measures (rank 0, broadcast)"
    return None


def unmeasured_note(facts: CallFacts, run_time: bool) -> str | None:
    """For the report, why a kernel chosen by its static table was not measured, where measuring
    is on (None under measure='static', where nothing is)."""
    if _session().settings.mode == STATIC:
        return None
    return why_not_measured(facts, run_time)


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def verdict(kernel: Kernel, facts: CallFacts, *, run_time: bool) -> Verdict | None:
    """The measured answer for ``kernel`` (exact for the call, not covered by a table this
    project measured on this device), measuring where nothing covers the call yet; None where
    the call is not measured (``why_not_measured``): the kernel's static ``slower`` answers."""
    numbers = all(isinstance(size, int) for size in (facts.keys, facts.batch, facts.queries))
    if numbers and not (_distributed() and not run_time):
        # Number sizes (the op's question on every call): the answers are remembered. Not at
        # graph time under torch.distributed, where every question is one collective that every
        # rank makes, whatever it remembers.
        session = _session()
        remembered = (kernel.name, facts, run_time, TABLE.version, session.settings, session.measure_on)
        if remembered not in _ANSWERS:
            if len(_ANSWERS) > 4096:
                _ANSWERS.clear()
            _ANSWERS[remembered] = _verdict(kernel, facts, run_time)
        return _ANSWERS[remembered]
    return _verdict(kernel, facts, run_time)


_ANSWERS: dict = {}  # ``verdict`` for number sizes, by (kernel, facts, the table's version, settings)


def _verdict(kernel: Kernel, facts: CallFacts, run_time: bool) -> Verdict | None:
    if why_not_measured(facts, run_time) is not None:
        return None
    session = _session()
    marked_from = _marked_dynamic_from(facts.keys, session)
    keys = _int(facts.keys) if marked_from is None else marked_from
    if bucket(keys) is None:
        # Too short to measure: the op's fixed cost per call is most of such a call. SDPA stays,
        # and a symbolic length is guarded below the first bucket, which longer lengths measure.
        guard = None
        if not isinstance(facts.keys, int) and marked_from is None:
            guard = functools.partial(guard_or_false, facts.keys < FIRST_EDGE)
        why = f"its {keys} keys are fewer than {FIRST_EDGE}: SDPA stays where a call is too short to measure"
        if marked_from is not None:
            why = (
                f"its length is marked dynamic from {marked_from} keys, fewer than {FIRST_EDGE}: one answer "
                "holds for every length it may take, its shortest's, and SDPA stays where a call is too short "
                f"to measure (mark_dynamic(..., min={FIRST_EDGE}) or more lets it be measured)"
            )
        if (setting := kernel_settings.SHORT_KEYS_SETTING) is not None:
            why += f" (COMPILE_PASS_SHORT_KEYS={setting} sets the crossover of measure='static')"
        return Verdict(why, why, guard)
    device = session.measure_on or facts.device
    key = key_of(facts, device)
    TABLE.asked.add(key)
    search = not isinstance(facts.keys, int) and marked_from is None
    try:
        if _distributed() and not run_time:
            buckets = _agree(key, facts, keys, kernel, device, search)
        else:
            _measure_around(key, facts, keys, kernel, device, search=search)
            buckets = TABLE.buckets(key, kernel.name, device, cached=session.settings.mode != REMEASURE)
    except Exception as error:  # noqa: BLE001 - a failed measurement leaves the choice to the static tables
        _warn_once(kernel.name, f"measuring failed ({type(error).__name__}: {error}); the static tables decide")
        return None
    answer = _answer(buckets, keys, facts.keys if marked_from is None else keys)
    if answer is None:  # nothing covers the call: the budget was spent before its bucket
        if marked_from is not None:  # the static tables guard the length: SDPA stays unguarded
            why = "not measured (budget spent): SDPA stays for a length marked dynamic (no guard may decide it)"
            return Verdict(why, why, measured=False)
        static = kernel.slower(facts)
        words = "not measured (budget spent): decided by the static tables"
        return Verdict(None if static is None else f"{static}; {words}", words, measured=False)
    if not facts.grad:  # a no_grad call: its own key, timed as it runs
        words = f"{answer.words}, the forward alone (a no_grad call)"
        answer = answer._replace(words=words, slower=None if answer.slower is None else words)
    if marked_from is not None:
        words = f"{answer.words}; one answer for every length its marked dynamic range takes, from {marked_from}"
        return answer._replace(words=words, slower=None if answer.slower is None else words)
    return answer


def _marked_dynamic_from(size, session: _Session) -> int | None:
    """The shortest length of a symbolic size the user marked dynamic (``mark_dynamic``): such
    a size is never guarded (a guard, with any other guard on it, may pin it to one value, which
    fails the compile), so its calls get one answer for the whole range: its shortest length's,
    which holds for every longer one (a band kernel's advantage over SDPA grows with the length).
    None for a number or an unmarked size."""
    if isinstance(size, int) or not session.marked_dynamic:
        return None
    expr = size.node.expr
    if not expr.free_symbols & session.marked_dynamic:
        return None
    lower = size.node.shape_env.bound_sympy(expr).lower
    return max(int(lower), 0) if lower.is_finite else 0


def _edge(keys: int) -> int:
    """The bucket of a length long enough to be measured (``_verdict`` keeps the others)."""
    edge = bucket(keys)
    if edge is None:
        raise ValueError(f"{keys} keys are too few to measure")
    return edge


def _covering(buckets: Mapping[int, Measured], keys: int) -> Measured | None:
    """The measurement that decides ``keys``: its own bucket's, else the longest measured bucket
    below it where the kernel won; None where neither says."""
    edge = _edge(keys)
    if edge in buckets:
        return buckets[edge]
    below = [e for e in buckets if e < edge]
    if below and buckets[max(below)].wins:
        return buckets[max(below)]
    return None


def _answer(buckets: Mapping[int, Measured], keys: int, size) -> Verdict | None:
    """The answer of the bucket that decides ``keys`` (a refusal or a failure decides its own
    bucket only), with the guard that keeps a symbolic ``size`` where it holds; None where no
    measurement covers the call."""
    measured = _covering(buckets, keys)
    if measured is None:
        return None
    guard = None
    if not isinstance(size, int):
        guard = functools.partial(_guard, size, dict(buckets), measured.keys, measured.wins)
    words = measured.words()
    if measured.keys != bucket(keys):
        words += f" (the longest length measured below this call's {keys})"
    return Verdict(None if measured.wins else words, words, guard)


def _guard(size, buckets: Mapping[int, Measured], edge: int, wins: bool) -> None:
    """Guards a symbolic length to the lengths the answer holds for (inductor's way with its own
    size-dependent choices): from the first bucket of the run of wins that holds ``edge`` up to
    the next bucket up where the kernel lost, if one was measured; or below the next bucket up
    where the kernel wins (the next bucket where none is measured)."""
    if wins:
        first = edge
        while (below := previous_edge(first)) is not None and below in buckets and buckets[below].wins:
            first = below
        guard_or_false(size >= first)
        lost = sorted(e for e, m in buckets.items() if e > edge and not m.wins)
        if lost:
            guard_or_false(size < lost[0])
        return
    above = sorted(e for e, m in buckets.items() if e > edge and m.wins)
    guard_or_false(size < (above[0] if above else next_edge(edge)))


def _measure_around(key, facts, keys: int, kernel: Kernel, device, *, search: bool) -> None:
    """Measures the call's bucket where nothing covers it; with ``search`` (a symbolic length),
    then the buckets below while the kernel wins there, or above while it loses, within the
    key's and the compile's budgets."""
    session = _session()
    if session.settings.mode == REMEASURE and key not in session.remeasured:
        session.remeasured.add(key)
        TABLE.forget(key, device)  # every verdict of the key, at every length, measured afresh
    buckets = TABLE.buckets(key, kernel.name, device, cached=session.settings.mode != REMEASURE)
    if _covering(buckets, keys) is not None:
        return
    started = time.perf_counter()

    def left() -> float:
        spent = time.perf_counter() - started
        by_key = session.settings.seconds_per_key - session.spent_on.get(key, 0.0) - spent
        return min(by_key, session.settings.seconds_per_compile - session.spent - spent)

    edge = _edge(keys)
    measured = _measure_bucket(key, facts, edge, kernel, device, left())
    while search and measured is not None and measured.sdpa_ms is not None and measured.kernel_ms is not None:
        step = previous_edge(edge) if measured.wins else next_edge(edge)
        if step is None or step in buckets or left() <= 0:
            break
        # A longer bucket costs about the square of the lengths' ratio more.
        cost = 1e-3 * (measured.sdpa_ms + measured.kernel_ms) * (REPEATS + 2)
        if step > edge and cost * (step / edge) ** 2 > left():
            break
        edge, measured = step, _measure_bucket(key, facts, step, kernel, device, left())
    spent = time.perf_counter() - started
    session.spent += spent
    session.spent_on[key] = session.spent_on.get(key, 0.0) + spent


def _measure_bucket(key, facts, edge: int, kernel: Kernel, device, seconds: float) -> Measured | None:
    """One bucket measured and added to the table (and the cache); None where no time is left."""
    if seconds <= 0:
        return None
    shape = Shape(
        device,
        facts.dtype,
        _int(facts.batch),
        facts.heads,
        facts.kv_heads,
        edge,
        facts.head_dim,
        facts.value_head_dim,
        facts.left,
        facts.right,
        facts.key_padding,
        facts.segment_ids,
        facts.blocks,
        facts.softcap,
        facts.grad,
    )
    outcome = measure_run.measure(shape, kernel, seconds, REPEATS)
    if outcome.refused is not None:
        _warn_once(kernel.name, f"not used for such calls on this device at {edge} keys: {outcome.refused}")
    measured = Measured.of(kernel.name, edge, shape.batch, outcome)
    TABLE.add(key, measured, device)
    return measured


def _warn_once(kernel: str, why: str) -> None:
    if (kernel, why) not in _WARNED:
        _WARNED.add((kernel, why))
        warnings.warn(f"compile_pass: {kernel}: {why}", stacklevel=3)


def _agree(key, facts, keys: int, kernel: Kernel, device, search: bool) -> Mapping[int, Measured]:
    """Rank 0's complete answer for the kernel at this key, the same on every rank: rank 0
    measures what it asks (under its own key: its device and threads) and broadcasts every
    bucket it then holds, refusals included, and each rank answers from those alone, never
    from its own cache. Every rank makes the same two collectives whatever it holds: the
    questions gathered (so that rank 0 sees ranks that ask different things, which the static
    tables then answer on every rank), then rank 0's answer broadcast."""
    dist = torch.distributed
    question = (dataclasses.replace(key, device=""), kernel.name, keys, search)
    asked: list = [None] * dist.get_world_size()
    dist.all_gather_object(asked, question)
    shared: list = [None]
    if dist.get_rank() == 0:
        try:  # every rank waits for the broadcast: rank 0 must reach it whatever fails here
            if any(other != question for other in asked):
                _warn_once(kernel.name, "the ranks asked about different calls at once; the static tables decide")
            else:
                _measure_around(key, facts, keys, kernel, device, search=search)
                mode = _session().settings.mode
                shared = [dict(TABLE.buckets(key, kernel.name, device, cached=mode != REMEASURE))]
        except Exception as error:  # noqa: BLE001 - the static tables decide what was not measured
            _warn_once(kernel.name, f"measuring failed ({type(error).__name__}: {error})")
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is None:
        raise RuntimeError("rank 0 measured nothing for this call")
    buckets = shared[0]
    if dist.get_rank() != 0:
        buckets = {edge: dataclasses.replace(m, source="rank 0") for edge, m in buckets.items()}
    TABLE.adopt(key, kernel.name, buckets)
    return buckets


class DeviceMeasurements:
    """This module as the policy asks it (``policy.Measurements``)."""

    def measuring_device(self) -> torch.device | None:
        return measuring_device()

    def verdict(self, kernel: Kernel, facts: CallFacts, *, run_time: bool) -> Verdict | None:
        return verdict(kernel, facts, run_time=run_time)

    def unmeasured_note(self, facts: CallFacts, run_time: bool) -> str | None:
        return unmeasured_note(facts, run_time)


policy.measured_by(DeviceMeasurements())
