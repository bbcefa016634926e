"""The kernel policy: an ordered list of kernels (``kernels.contract`` is their contract), and the one
function that picks a call's kernel from its facts.

The same ``choose`` answers both times the question is asked: the rules at graph time (facts
from an SDPA call's fake tensors; where no kernel is exact and as fast as SDPA they keep SDPA,
so a rewrite never makes a layer slower) and the op at run time (``route``: facts from the
real tensors, then what only their values tell, such as whether each row's padding is one
run: a kernel whose ``plan`` says no passes the call on down the list). The rules and the ops
read ``POLICY``, the one instance, when they ask, so they cannot disagree; tests that tune the
chunked kernel or pretend to be on a GPU replace it.

Adding a kernel: one module with an object that keeps ``kernel.Kernel``'s contract, and its
place in ``KERNELS``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch

from ..window import UNBOUNDED
from . import chunked, documents, fa2, ffpa, wide_head
from .chunked.plan import ChunkTuning
from .contract import AttentionCall, CallFacts, Kernel, kernel_only, short_call
from .fa2 import flash_attn as flash
from .fa2 import torch_flash

SDPA_NAME = "SDPA with the mask"


class Verdict(Protocol):
    """A measured kernel's answer for one call (``compile_pass.measure.Verdict``)."""

    @property
    def slower(self) -> str | None:
        """Why it may be slower than SDPA; None: measured at least as fast."""

    @property
    def words(self) -> str:
        """What was measured, for the report."""

    @property
    def guard(self) -> Callable[[], object] | None:
        """Guards a symbolic length to where the answer holds."""

    @property
    def measured(self) -> bool:
        """False: the static tables answered all the same (the budget was spent)."""


class Measurements(Protocol):
    """What the policy asks of a measurement on the device. The measurement sits above the op
    (it times kernels inside it), so it is handed to the policy when it is imported
    (``measured_by``), never imported from here."""

    def measuring_device(self) -> torch.device | None:
        """The device calls of the meta device are answered for (``tune``), or None."""

    def verdict(self, kernel: Kernel, facts: CallFacts, *, run_time: bool) -> Verdict | None:
        """The measured answer for an exact kernel, or None: its static ``slower`` answers."""

    def unmeasured_note(self, facts: CallFacts, run_time: bool) -> str | None:
        """For the report: why a kernel chosen by its static table was not measured."""


class StaticTables:
    """No measurement: every kernel answers by its own static tables."""

    def measuring_device(self) -> torch.device | None:
        return None

    def verdict(self, kernel: Kernel, facts: CallFacts, *, run_time: bool) -> Verdict | None:
        return None

    def unmeasured_note(self, facts: CallFacts, run_time: bool) -> str | None:
        return None


MEASUREMENTS: Measurements = StaticTables()


def measured_by(measurements: Measurements) -> None:
    """Hand the policy the measurement it asks (``compile_pass.measure`` does, on import)."""
    global MEASUREMENTS
    MEASUREMENTS = measurements


# In order of preference: flash-attn's where a user asked for it, torch's FA2 on a GPU, the
# document kernel (packed or padded calls with no left bound, on the CPU), the chunked kernel,
# which computes every call exactly (fast on the CPU only), then the kernels
# for what FA2 does not take on CUDA: ffpa-attn's (head_dim 320-512) where a user asked for it,
# and the Triton kernel (head_dim 64-512, soft-capped scores). Those come after the chunked
# kernel, which is never fast on CUDA: each is chosen only where it is fast (ffpa: asked for;
# the Triton kernel: where its measured crossovers say it wins; FA2, earlier, takes what it
# can), and a call that runs with no fast kernel (slow_kernels, a direct call) keeps the first
# exact one: the chunked kernel, the one that has run on a GPU, where it takes the call.
KERNELS: tuple[Kernel, ...] = (
    flash.FLASH_ATTN,
    torch_flash.TORCH_FA2,
    documents.DOCUMENTS,
    chunked.ChunkedKernel(),
    ffpa.FFPA_ATTN,
    wide_head.WIDE_HEAD,
)


def statically_measured(kernel: Kernel, device: torch.device) -> bool:
    """Whether this project measured the kernel's own table (``slower``) on such a device
    (``measured_on``: device names as torch gives them), which then stands in for a measurement
    on the device."""
    names = getattr(kernel, "measured_on", ())
    return (
        bool(names)
        and device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_name(device) in names
    )


class KernelChoice(NamedTuple):
    kernel: Kernel | None  # None: no kernel here is exact and as fast as SDPA, which stays
    name: str  # what runs, in words (``SDPA with the mask`` when SDPA stays)
    passed_over: tuple[str, ...] = ()  # "kernel: why not", for each kernel before it
    # The kernel was measured at least as fast as SDPA on this device (now, or in the cache), or by
    # a table this project measured on such a device; False where a static table decided.
    measured: bool = False

    @property
    def fast(self) -> bool:
        return self.kernel is not None

    @property
    def reason(self) -> str:
        """Why no kernel is exact and as fast as SDPA; "" when one is."""
        return "" if self.fast else "; ".join(self.passed_over)


class Route(NamedTuple):
    """The kernel of one call at run time, the same in its forward and its backward."""

    kernel: Kernel | None  # None: nothing to compute (an empty batch, no queries or keys)
    plan: Any = None


@dataclass(frozen=True)
class KernelPolicy:
    kernels: tuple[Kernel, ...] = KERNELS

    def with_chunking(self, tuning: ChunkTuning) -> KernelPolicy:
        """This policy with the chunked kernel tuned as given."""
        return self.replacing(chunked.ChunkedKernel(tuning))

    def replacing(self, kernel: Kernel) -> KernelPolicy:
        """This policy with ``kernel`` in place of the kernel of its type (one tuned, or routed
        by other crossovers)."""
        return replace(self, kernels=tuple(kernel if type(k) is type(kernel) else k for k in self.kernels))

    def with_wide_head_crossovers(self, crossovers: Mapping[tuple[tuple[int, int], torch.dtype], int]) -> KernelPolicy:
        """This policy with the wide-head kernel routed by these crossovers ((CUDA capability,
        dtype) -> the fewest keys at which it wins) in place of ``wide_head.CROSSOVERS``."""
        return self.replacing(wide_head.WideHeadKernel(crossovers))

    def choose(self, facts: CallFacts, *, slower_allowed: bool = False, run_time: bool = False) -> KernelChoice:
        """The first kernel that computes such a call exactly and at least as fast as SDPA
        (``slower_allowed``: the first that computes it exactly), with why each kernel before
        it was passed over; no kernel (SDPA stays) where there is none.

        As fast as SDPA by a measurement on this device (``compile_pass.measure``), made now where none
        covers the call, for every kernel that no table this project measured covers here
        (``measured_on``); by the kernel's own ``slower`` (the static tables) where the call
        is not measured (``measure.why_not_measured``). ``run_time``: asked by the op, where
        under torch.distributed nothing is measured.

        On the meta device (shapes only, nothing runs) the answer is the chunked kernel's,
        counted as fast, so that an offline report shows what the proof allows, with the
        devices whose measured crossover keeps SDPA at this length (a call with no left bound only
        where a kernel wins on the CPU at some length, else the CPU's answer); under
        ``measure.measuring_on`` (``python -m compile_pass tune``) the call is answered for that
        device instead."""
        return self._choice(facts, slower_allowed, run_time)

    def _choice(
        self, facts: CallFacts, slower_allowed: bool, run_time: bool, words: bool = True, measured: bool = True
    ) -> KernelChoice:
        """``choose``'s answer; without ``words`` (the op's question on every call) no kernel
        describes itself and no reason is kept; without ``measured``, by the static tables."""
        if facts.device.type == "meta":
            target = MEASUREMENTS.measuring_device()
            if target is None:
                if facts.left == UNBOUNDED:  # no left bound: where no kernel wins on the CPU whatever the length
                    on_cpu = facts._replace(device=torch.device("cpu"), keys=None)
                    cpu_choice = self._choice(on_cpu, False, run_time, words, measured=False)
                    if not cpu_choice.fast:
                        return cpu_choice
                return KernelChoice(
                    chunked.ChunkedKernel(), "chosen on the device the model runs on" + self._short_on(facts)
                )
            facts = facts._replace(device=target)
        passed_over: list[str] = []
        for kernel in self.kernels:
            why = kernel.cannot(facts)
            verdict = None
            never_faster = getattr(kernel, "never_faster", None)
            if why is None and not slower_allowed and never_faster is not None:
                why = never_faster(facts)  # nothing a measurement could change: not measured
            if why is None and not slower_allowed:
                # Measured one at a time, in the list's order, up to the first that wins.
                if measured and not statically_measured(kernel, facts.device):
                    verdict = MEASUREMENTS.verdict(kernel, facts, run_time=run_time)
                if verdict is not None and verdict.guard is not None:
                    verdict.guard()
                why = kernel.slower(facts) if verdict is None else verdict.slower
            if why is None:
                if not words:
                    return KernelChoice(kernel, "")
                if verdict is not None:
                    said = f"{kernel.describe(facts)} ({verdict.words})"
                else:
                    unmeasured = MEASUREMENTS.unmeasured_note(facts, run_time) if measured else None
                    said = kernel.describe(facts) + ("" if unmeasured is None else f" (not measured: {unmeasured})")
                on_device = (verdict is not None and verdict.measured) or statically_measured(kernel, facts.device)
                return KernelChoice(kernel, said, tuple(passed_over), measured=on_device and not slower_allowed)
            if words:
                passed_over.append(f"{kernel.name}: {why}")
        return KernelChoice(None, SDPA_NAME, tuple(passed_over))

    def _short_on(self, facts: CallFacts) -> str:
        """Where a call this long keeps SDPA for its length (``kernel.short_call``): on the CPU
        by the chunked kernel's crossover (the document kernel's with no left bound), on a GPU
        by FA2's (which has none with no left bound); "" where on neither."""
        tuning = next(kernel.tuning for kernel in self.kernels if isinstance(kernel, chunked.ChunkedKernel))
        no_left_bound = facts.left == UNBOUNDED
        cpu_keys = documents.short_keys(facts.dtype) if no_left_bound else chunked.short_keys(facts.dtype, tuning)
        devices = []
        if short_call(facts, cpu_keys):
            devices.append("the CPU")
        if facts.dtype in fa2.DTYPES and not no_left_bound and short_call(facts, fa2.short_keys(facts)):
            devices.append("a GPU")
        gpu = ""
        if no_left_bound:
            gpu = "; on a GPU SDPA stays unless a kernel's crossover measured there wins (FA2's: sliding windows only)"
        if not devices:
            return gpu
        return f"; at {facts.keys} keys SDPA stays on {' and on '.join(devices)}, below a measured crossover{gpu}"

    def first(self, facts: CallFacts, *, measured: bool = True) -> Kernel | None:
        """The kernel a call with these facts tries first at run time: the first that is exact
        and fast, else the first that is exact (the rule rewrote it with ``slow_kernels``).
        ``choose``'s answer at run time, without its words, which every call of the op would
        pay for (the measured answers are remembered: ``measure.verdict``); None where none is exact.
        ``measured=False`` asks the static tables only: code Dynamo traces (the op's Python entry) asks so."""
        only = kernel_only()
        if only is not None:  # a measurement times this kernel through the op
            return only
        # The devices the tensors are on, whoever asks.
        choice = self._choice(facts, False, True, words=False, measured=measured)
        return choice.kernel or next((k for k in self.kernels if k.cannot(facts) is None), None)

    def route(self, call: AttentionCall) -> Route:
        """The kernel of one call of the op: the first in the list that is exact and fast for
        its facts, else the first that is exact, and whose ``plan`` takes the call's values."""
        batch, heads, seq_q, _ = call.query.shape
        if 0 in (batch, heads, seq_q, call.key.shape[2]):
            return Route(None)  # nothing to attend; FA2 would reject batch 0
        only = kernel_only()
        if only is not None:  # a measurement's kernel, whatever the list: its results are checked there
            plan = only.plan(call)
            if plan is None:
                raise RuntimeError(f"{only.name}: its plan does not take the measured layout")
            return Route(only, plan)
        facts = call.facts
        first = self.first(facts)
        for kernel in self.kernels[self.kernels.index(first) :] if first is not None else ():
            if kernel.cannot(facts) is None:
                plan = kernel.plan(call)
                if plan is not None:
                    return Route(kernel, plan)
        raise RuntimeError(f"no kernel of {self.kernels} computes this call")  # the chunked kernel takes every call


POLICY = KernelPolicy()


def facts_of(device: torch.device | str, dtype: torch.dtype, head_dim: int, **masks) -> CallFacts:
    """``CallFacts`` from a device given as a string too: what the rules and tests ask with."""
    return CallFacts(torch.device(device), dtype, head_dim, **masks)
