"""The wide-head kernel's tiles: the list of configs, which of them fit a device, and the one
measured fastest there for each of its kernels (``wide_head.py`` launches through ``launch``).

Each kernel holds ``stationary`` rows (forward, dQ: query rows; dK, dV: keys) with their one
(rows, D_PAD) fp32 accumulator, and streams blocks of ``streamed`` rows of the other side past
them, whose (streamed, D_PAD) operand of the wide ``tl.dot`` is staged in shared memory.

How a tile is chosen: per kernel (forward, dV, dK, dQ) and per key (``TuneKey``: the device,
dtype, head_dim, the masks and the cap present, the GQA group, and the sizes rounded up to
powers of two), the first launch times every config that fits the device on the call's own
tensors and keeps the fastest for the process. Each kernel reads a block table at its own tile
sizes, computed for the call when a kernel first asks for them (``wide_head.WidePlan``), so the
four kernels may pick different tiles. The two other ways were passed over: one table at the
finest size that each kernel ORs over its sub-blocks costs loads in every inner loop and a
table up to 16 times larger; timing the whole forward and backward per config forces one tile
on kernels that want different ones (the query-stationary forward, the key-stationary dK).
Under Triton's interpreter (the CPU tests) nothing is timed: the first config that fits runs.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class Tiles(NamedTuple):
    stationary: int  # rows held, with their accumulator
    streamed: int  # rows of the other side per step
    d_chunk: int  # head_dim columns per step of the scores' accumulation
    warps: int
    stages: int


class Config(NamedTuple):
    tiles: Tiles
    widest: int  # the widest padded head_dim the config is for (wider, it spills kilobytes)


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a power of two (the accumulator's width: ``tl.arange`` needs one)."""
    return 1 << (head_dim - 1).bit_length()


# Every config compiles for sm80, sm90 and sm100 with the ptxas in triton 3.9's wheel, at its
# widest head_dim, with and without masks: ``python benchmarks/wide_head_compile.py`` prints each
# kernel's registers, spills and shared memory (its table is in benchmarks/RESULTS.md). ``widest``
# is the widest head_dim at which none of a config's kernels spills more than 1 KiB on any
# of the three, masks and a cap on. The list was chosen from a wider set compiled for sm90 at
# head_dim 512 (``--candidates``): there 64 stationary rows spill 2-6 KiB in their worst kernel
# and 128-key streams 1.3-14 KiB; 4 warps spill 0.8-1.6 KiB past 16 x 32 (their 8-warp twins
# 0.1-0.5). Stages: Triton 3.9 pipelines these key loops only for sm100 at head_dim 256 here (a
# 2-stage config took 88 KiB of shared memory there against its 1-stage twin's 40, and compiled
# to the twin's registers and shared memory elsewhere), so one 2-stage twin per range is kept;
# where the loop reads block flags (masks) it is not pipelined, and 2-stage configs are not
# measured there.
# In order: the first that fits is what runs unmeasured (the interpreter, a CUDA graph capture).
CONFIGS: tuple[Config, ...] = (
    Config(Tiles(64, 32, 64, 4, 1), 128),
    Config(Tiles(32, 128, 64, 8, 1), 128),
    Config(Tiles(64, 64, 64, 8, 1), 256),
    Config(Tiles(64, 64, 64, 8, 2), 256),
    Config(Tiles(32, 64, 64, 4, 1), 256),
    Config(Tiles(32, 64, 64, 8, 1), 512),
    Config(Tiles(32, 32, 64, 8, 1), 512),
    Config(Tiles(16, 64, 64, 8, 1), 512),
    Config(Tiles(16, 32, 64, 8, 1), 512),
    Config(Tiles(16, 32, 64, 4, 1), 512),
    Config(Tiles(32, 64, 32, 8, 1), 512),
    Config(Tiles(32, 64, 128, 8, 1), 512),
    Config(Tiles(32, 64, 64, 8, 2), 512),
)
SCRATCH = 4 * 1024  # what Triton allocates besides the operands (reductions, layout changes): at most 4 KiB seen


def shared_memory_estimate(tiles: Tiles, head_dim: int, dtype: torch.dtype, masked: bool) -> int:
    """Bytes of shared memory a kernel at these tiles takes at most (an upper bound of what
    Triton allocates, checked against its compiler's report by benchmarks/wide_head_compile.py):
    the streamed (rows, D_PAD) operand of the wide dot; the chunks of both sides for each stage;
    and, where the key loop reads no block flags (no masks), the stationary rows' chunks of up to
    two operands, which the compiler hoists out of the loop (dK: K and V; dQ: Q and dO)."""
    size = torch.empty((), dtype=dtype).element_size()
    width = padded_head_dim(head_dim)
    wide = tiles.streamed * width * size
    chunks = (tiles.stationary + tiles.streamed) * min(tiles.d_chunk, width) * size * tiles.stages
    hoisted = 0 if masked else 2 * tiles.stationary * width * size
    return wide + chunks + hoisted + SCRATCH


def fitting(
    configs: tuple[Config, ...], shared_memory: int | None, head_dim: int, dtype: torch.dtype, masked: bool
) -> tuple[Tiles, ...]:
    """The tiles of the configs, in their order, that a device with ``shared_memory`` bytes per
    block (opt-in; None: no limit, Triton's interpreter) runs for calls of this head_dim and
    dtype, with key padding or segment ids (``masked``) or not: the configs for this head_dim
    (``widest``), with a d-chunk no wider than the padded head_dim, one stage where masked, and
    whose shared memory fits."""
    width = padded_head_dim(head_dim)
    return tuple(
        tiles
        for tiles, widest in configs
        if width <= widest
        and tiles.d_chunk <= width
        and not (masked and tiles.stages > 1)
        and (shared_memory is None or shared_memory_estimate(tiles, head_dim, dtype, masked) <= shared_memory)
    )


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def shared_memory_of(device: torch.device) -> int | None:
    """Opt-in shared memory per block of a CUDA device in bytes; None off CUDA (Triton's
    interpreter has no limit) or where no CUDA device can be asked."""
    if device.type != "cuda" or not torch.cuda.is_available() or interpreting():
        return None
    properties = torch.cuda.get_device_properties(device)
    # torch 2.15's stubs name the field, older ones do not: the ignore is unused on 2.15
    optin: int = properties.shared_memory_per_block_optin  # type: ignore[attr-defined, unused-ignore]
    return optin


class TuneKey(NamedTuple):
    """What a pick holds for: one kernel on one device, dtype, head_dim and mask set, at sizes in
    the same powers of two (the tile that wins depends on how many programs fill the GPU)."""

    kernel: str  # forward, dV, dK, dQ
    device: str  # the GPU's name and capability
    dtype: torch.dtype
    head_dim: int
    left: bool  # the window's sides present
    right: bool
    key_padding: bool
    segment_ids: bool
    softcap: bool
    group: int  # query heads per KV head (the key-stationary kernels loop over them)
    queries: int  # powers of two at least as large
    keys: int
    programs: int  # batch * heads


def size_bucket(size: int) -> int:
    return 1 << max(0, (size - 1).bit_length())


@functools.cache
def device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


# The pick for each (key, configs) of this process: the fastest config measured.
_PICKS: dict[tuple[TuneKey, tuple[Tiles, ...]], Tiles] = {}
TIMED_RUNS = 3  # each config's median of this many runs after its first (which compiles it)


def picks() -> dict[TuneKey, Tiles]:
    """What was measured in this process: each key's fastest config."""
    return {key: tiles for (key, _), tiles in _PICKS.items()}


def launch(
    key: TuneKey,
    candidates: tuple[Tiles, ...],
    run: Callable[[Tiles], None],
    time_ms: Callable[[Callable[[Tiles], None], Tiles], float] | None = None,
) -> Tiles:
    """Run one kernel (``run(tiles)`` launches it at those tiles) at the tiles measured fastest
    for ``key`` among ``candidates``, measuring them on this first launch (each run overwrites
    the same outputs: every config computes the call) and keeping the pick for the process.
    Not measured, the first candidate runs: under Triton's interpreter, with one candidate, or
    inside a CUDA graph's capture (no pick kept then). ``time_ms(run, tiles)``: how one config
    is timed (``cuda_time_ms`` where there is CUDA, else ``wall_clock_ms``)."""
    if not candidates:
        raise RuntimeError(f"no tile config of the wide-head kernel fits this device for {key}")
    picked = _PICKS.get((key, candidates))
    if picked is None and (interpreting() or len(candidates) == 1 or _capturing()):
        picked = candidates[0]
    if picked is None:
        timer = time_ms or (cuda_time_ms if torch.cuda.is_available() else wall_clock_ms)
        picked = measure(key, candidates, run, timer)
        _PICKS[(key, candidates)] = picked
    run(picked)
    return picked


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _launch_errors() -> tuple[type[BaseException], ...]:
    """Triton's errors for a config this device cannot run (compilation, resources)."""
    from triton.compiler import errors as compiler_errors
    from triton.runtime import errors as runtime_errors

    names = ("OutOfResources", "PTXASError")
    found = [getattr(runtime_errors, name) for name in names if hasattr(runtime_errors, name)]
    return (*found, compiler_errors.CompilationError)


def cuda_time_ms(run: Callable[[Tiles], None], tiles: Tiles) -> float:
    """The median of TIMED_RUNS runs at these tiles, timed with CUDA events on the current stream."""
    runs = []
    for _ in range(TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(tiles)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


def wall_clock_ms(run: Callable[[Tiles], None], tiles: Tiles) -> float:
    """The median of TIMED_RUNS runs at these tiles by the wall clock (off CUDA: the tests, which
    measure on Triton's interpreter)."""
    runs = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        run(tiles)
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def measure(
    key: TuneKey,
    candidates: tuple[Tiles, ...],
    run: Callable[[Tiles], None],
    time_ms: Callable[[Callable[[Tiles], None], Tiles], float],
) -> Tiles:
    """The fastest candidate: each run once first (which compiles it; a config that fails to
    compile or launch is passed over with a warning), then timed by ``time_ms``."""
    errors = _launch_errors()
    times: dict[Tiles, float] = {}
    for tiles in candidates:
        try:
            run(tiles)
        except errors as error:
            warnings.warn(f"wide-head kernel {key.kernel}: {tiles} does not run on {key.device}: {error}", stacklevel=2)
            continue
        times[tiles] = time_ms(run, tiles)
    if not times:
        raise RuntimeError(f"no tile config of the wide-head kernel runs on {key.device} for {key}")
    best = min(times, key=times.__getitem__)
    log.info("wide-head %s: %s at %.3f ms of %d configs for %s", key.kernel, best, times[best], len(times), key)
    return best
