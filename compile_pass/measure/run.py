"""One measurement on the device (``compile_pass.measure`` decides when): SDPA as a rule would leave a call
against each kernel that computes it exactly, forward and backward, at one length's shapes, on
random inputs made here, each kernel's results checked against SDPA's before it is timed. A
kernel runs inside the op (``kernel.only_kernel``), as the rewritten graph calls it: the op's
checks, layouts and autograd cost as much as a short call's kernel.

What SDPA runs is what the model runs: with a sliding band, padding, packed documents or image
blocks, the boolean mask a transformers model builds (made before the clock starts: a model
builds it once for every layer) and K/V repeated to the query heads (transformers repeats them
where SDPA gets a mask); a causal call with no mask runs ``is_causal``, and ``enable_gqa`` where
SDPA's flash kernel takes the head_dim, as the model would call it.

No SDPA caps its scores: what the op replaces for a soft-capped call is the chain of ops a model
spells it out in (Gemma-2's eager attention), which scores every pair as SDPA does and caps,
masks and normalises them in passes of its own. SDPA without the cap is timed in its place, a
bound the chain does not beat; the kernel's results are checked against the capped scores
written out in fp32. (On the CPU such calls are not measured: ``measure.why_not_measured``.)

The batch masks are laid out so that the kernel skips the least it ever skips: every key
valid, one document a row, one image block. SDPA's work does not depend on the mask's values
(it scores every pair), and a kernel's only shrinks as padding, documents or a smaller image
grow. Its calls may not: a kernel that runs one call per row or per document (the document
kernel) runs one call over the whole batch where no row is padded or packed, and pays a call's
fixed cost per row or document otherwise. So padded and packed calls are measured in a second
layout too, each row's tail padded or each row cut into documents of SPLIT_TOKENS tokens, each
layout's kernel against SDPA on the same masks, and the layout where the kernel fares worse
decides: a kernel measured faster in both is faster on the model's own batches.

Every tensor is made here from a generator of its own (the process's random streams are
untouched), outside any fake, tracing or autocast mode, and the device is synchronised before
each timed run, so pending work of the training stream is not counted.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from ..kernels.contract import Kernel, only_kernel
from ..ops.window_attention import sliding_window_attention
from ..registration import autograd_recorded
from ..window import UNBOUNDED, band_mask

# Each kernel's results against SDPA's (or, for soft-capped scores, against the scores written
# out in fp32), the largest difference over the largest magnitude of the reference: the bound
# the CUDA tests hold FA2 to in bf16 (tests/ops/test_op_cuda.py), tighter where the dtype allows.
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# Soft-capped calls are checked at no more than this many keys: SDPA computes no cap, and the
# written-out reference holds every score.
SOFTCAP_CHECK_KEYS = 1024
SOFTCAP = 50.0  # any cap: its value does not change the work
# A measurement is made only where its tensors take at most this share of the free memory.
MEMORY_SHARE = 0.5
# The second layout of padded and packed calls: documents this long, or this share of each
# row's keys padded at its end (no more than the window's left side, so that every row still
# sees a valid key).
SPLIT_TOKENS = 16
SPLIT_PADDING = 8  # one key in this many


@dataclass(frozen=True)
class Shape:
    """What one measurement makes: the call's sizes and form at one length."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    heads: int
    kv_heads: int
    keys: int  # Sq == Sk
    head_dim: int
    value_head_dim: int | None  # narrower than head_dim: zero-padded for the op, as the rewrite does
    left: int
    right: int
    key_padding: bool = False
    segment_ids: bool = False
    blocks: bool = False
    softcap: bool = False
    backward: bool = True  # False: the forward alone, under no_grad, as an eval step runs it

    @property
    def masked(self) -> bool:
        """Whether SDPA gets a mask (else ``is_causal`` or nothing, as the causal rule leaves it)."""
        plain = self.left == UNBOUNDED and self.right in (0, UNBOUNDED)
        return not plain or self.key_padding or self.segment_ids or self.blocks

    def bytes_needed(self) -> int:
        """About what the measurement allocates at once: inputs, outputs and gradients of SDPA
        (with K/V repeated) and of a kernel, and the mask with SDPA's float copy of it."""
        element = torch.empty((), dtype=self.dtype).element_size()
        tokens = self.batch * self.keys
        per_token = self.head_dim * (8 * self.heads + 6 * self.kv_heads)
        mask = self.batch * self.keys * self.keys * (1 + element) if self.masked else 0
        layouts = 2 if self.key_padding or self.segment_ids else 1  # a mask for each (``_Inputs.split``)
        return tokens * per_token * element + layouts * mask


@dataclass
class Outcome:
    """One kernel at one length: the median milliseconds of its forward and backward and of
    SDPA's, timed in turn in the same rounds; or why it was not timed."""

    rounds: int = 0
    sdpa_ms: float | None = None
    kernel_ms: float | None = None
    refused: str | None = None  # not at this length on this device: it differs from SDPA, or failed
    skipped: str | None = None  # not timed at this length: out of memory
    why_not: str | None = None  # nothing timed: SDPA stays
    replaced: str = "SDPA"  # what ``sdpa_ms`` timed


def free_bytes(device: torch.device) -> int:
    """Memory a measurement may take: free on the GPU (with what torch's allocator holds unused),
    or the CPU's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: not a reason to refuse


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (``mode="reduce-overhead"``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


class _Inputs:
    """Random q, k, v, an output gradient and the batch masks of a shape, on its device."""

    def __init__(self, shape: Shape, keys: int):
        device, dtype = shape.device, shape.dtype
        generator = torch.Generator(device=device).manual_seed(keys)

        def random(heads: int, dim: int) -> torch.Tensor:  # (B, S, H, D) storage, as projections give it
            x = torch.randn(shape.batch, keys, heads, dim, generator=generator, device=device, dtype=torch.float32)
            return x.to(dtype).transpose(1, 2)

        value_dim = shape.value_head_dim or shape.head_dim
        self.query = random(shape.heads, shape.head_dim).requires_grad_()
        self.key = random(shape.kv_heads, shape.head_dim).requires_grad_()
        self.value = random(shape.kv_heads, value_dim).requires_grad_()
        self.grad_out = random(shape.heads, value_dim)
        self.scale = 1.0 / math.sqrt(shape.head_dim)
        self.key_padding = torch.ones(shape.batch, keys, dtype=torch.bool, device=device) if shape.key_padding else None
        self.segment_ids = (
            torch.zeros(shape.batch, keys, dtype=torch.int64, device=device) if shape.segment_ids else None
        )
        self.block_ids = None
        if shape.blocks:
            self.block_ids = torch.full((shape.batch, keys), -1, dtype=torch.int64, device=device)
            self.block_ids[:, keys // 4 : keys // 2] = 0
        self.mask = self._mask(shape, keys) if shape.masked else None

    def split(self, shape: Shape, keys: int) -> _Inputs | None:
        """The same q, k, v and output gradient with the padded or packed layout's second form
        (the module's docstring): each row's last keys padded, or documents of SPLIT_TOKENS
        tokens; None where the call has neither, or its window leaves no key to pad."""
        split = copy.copy(self)
        if self.key_padding is not None:
            padded = keys // SPLIT_PADDING if shape.left == UNBOUNDED else min(keys // SPLIT_PADDING, shape.left)
            if padded == 0:
                return None
            split.key_padding = self.key_padding.clone()
            split.key_padding[:, keys - padded :] = False
        elif self.segment_ids is not None:
            documents = torch.arange(keys, device=shape.device) // SPLIT_TOKENS
            split.segment_ids = documents.expand(shape.batch, keys).contiguous()
        else:
            return None
        split.mask = split._mask(shape, keys)
        return split

    def _mask(self, shape: Shape, keys: int) -> torch.Tensor:
        """The (B, 1, S, S) boolean mask a model builds for this form."""
        positions = torch.arange(keys, device=shape.device)
        if self.block_ids is None:
            visible = band_mask(positions, positions, shape.left, shape.right, 0)[None, None]
        else:
            ids = self.block_ids
            same_block = (ids[:, None, :, None] == ids[:, None, None, :]) & (ids >= 0)[:, None, :, None]
            beyond_right = band_mask(positions, positions, UNBOUNDED, shape.right, 0)[None, None] | same_block
            visible = band_mask(positions, positions, shape.left, UNBOUNDED, 0)[None, None] & beyond_right
        if self.key_padding is not None:
            visible = visible & self.key_padding[:, None, None, :]
        if self.segment_ids is not None:
            ids = self.segment_ids
            visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
        return visible.expand(shape.batch, 1, keys, keys).contiguous()


def _sdpa_step(shape: Shape, inputs: _Inputs) -> Callable[[], tuple[torch.Tensor, ...]]:
    """SDPA's forward and backward as the model runs it: (out, dq, dk, dv)."""
    group = shape.heads // shape.kv_heads
    repeat = group > 1 and (inputs.mask is not None or shape.head_dim > 256)

    def repeated(x: torch.Tensor) -> torch.Tensor:
        if not repeat:
            return x
        batch, kv_heads, seq, dim = x.shape
        return x[:, :, None].expand(batch, kv_heads, group, seq, dim).reshape(batch, kv_heads * group, seq, dim)

    causal = inputs.mask is None and shape.right == 0

    def step():
        q, k, v = inputs.query, inputs.key, inputs.value
        with torch.set_grad_enabled(shape.backward):
            out = F.scaled_dot_product_attention(
                q,
                repeated(k),
                repeated(v),
                attn_mask=inputs.mask,
                is_causal=causal,
                scale=inputs.scale,
                enable_gqa=group > 1 and not repeat,
            )
        return _with_gradients(shape, out, (q, k, v), inputs.grad_out)

    return step


def _with_gradients(shape: Shape, out: torch.Tensor, inputs: tuple, grad_out: torch.Tensor) -> tuple:
    """(out, dq, dk, dv) of a training step; (out,) of a forward alone."""
    if not shape.backward:
        return (out,)
    return (out, *torch.autograd.grad(out, inputs, grad_out))


def _op_step(kernel: Kernel, shape: Shape, inputs: _Inputs, softcap: float) -> Callable[[], tuple]:
    """The op's forward and backward on the inputs, running ``kernel`` alone, as the rewritten
    graph calls it (its checks, layouts and autograd count with the kernel's work): (out, dq,
    dk, dv), a narrower value zero-padded first and the result sliced back, as the rewrite does."""
    value_dim = shape.value_head_dim
    pad = (0, shape.head_dim - value_dim) if value_dim is not None else None
    masks = dict(key_padding=inputs.key_padding, segment_ids=inputs.segment_ids, block_ids=inputs.block_ids)

    def step():
        query, key, value = inputs.query, inputs.key, inputs.value
        with only_kernel(kernel), torch.set_grad_enabled(shape.backward):
            out = sliding_window_attention(
                query,
                key,
                value if pad is None else F.pad(value, pad),
                window=(shape.left, shape.right),
                causal=False,
                scale=inputs.scale,
                softcap=softcap,
                **masks,
            )
            if pad is not None:
                out = out[..., :value_dim]
            return _with_gradients(shape, out, (query, key, value), inputs.grad_out)

    return step


def _softcap_reference(shape: Shape, inputs: _Inputs) -> Callable[[], tuple]:
    """Soft-capped attention written out in fp32 (SDPA computes no cap): (out, dq, dk, dv)."""
    group = shape.heads // shape.kv_heads

    def step():
        q, k, v = inputs.query, inputs.key, inputs.value
        k32, v32 = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
        scores = (q.float() @ k32.transpose(-1, -2)) * inputs.scale
        scores = SOFTCAP * torch.tanh(scores / SOFTCAP)
        if inputs.mask is not None:
            scores = scores.masked_fill(~inputs.mask, float("-inf"))
        elif shape.right == 0:
            scores = scores.masked_fill(~torch.ones_like(scores, dtype=torch.bool).tril(), float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v32
        return (out, *torch.autograd.grad(out, (q, k, v), inputs.grad_out.float()))

    return step


def _difference(
    results: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], dtype: torch.dtype, against: str = "SDPA's"
) -> str | None:
    """How a kernel's (out, dq, dk, dv) differ from the reference's, past the dtype's bound; None
    where each is within it."""
    bound = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    names = ("the output", "dQ", "dK", "dV")[: len(results)]  # the forward alone: the output only
    for name, got, expected in zip(names, results, reference[: len(results)], strict=True):
        if got.shape != expected.shape:
            return f"{name} is shaped {tuple(got.shape)}, not {tuple(expected.shape)}"
        expected = expected.double()
        scale = expected.abs().max().item()
        error = (got.double() - expected).abs().max().item()
        if not error <= bound * max(scale, 1e-6):  # also NaN
            return f"{name} differs from {against} by {error:.2e}, over {bound:g} of its scale {scale:.2e}"
    return None


def _attempt(step: Callable[[], tuple]) -> tuple | BaseException:
    """What ``step`` returns, or what it raised."""
    try:
        return step()
    except Exception as error:  # noqa: BLE001 - a kernel that cannot run is passed over, whatever it raised
        return error


def _failure(error: BaseException) -> str:
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message[:200]}"


def _out_of_memory(error: BaseException) -> bool:
    """Whether a run failed for want of memory, which passes (not a refusal): torch's and
    Python's errors for it, and the plain RuntimeError of the CPU's allocator or a CUDA call."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error)
    return isinstance(error, RuntimeError) and (
        "DefaultCPUAllocator" in message or "can't allocate memory" in message or "out of memory" in message.lower()
    )


def measure(shape: Shape, kernel: Kernel, seconds: float, repeats: int) -> Outcome:
    """SDPA and ``kernel`` at ``shape``: the kernel's results checked first (a kernel that
    differs or fails is refused at this length), then up to ``repeats`` rounds, each timing SDPA
    and the kernel in turn, while the rounds fit ``seconds`` (one round at least)."""
    outcome = Outcome()
    needed, free = shape.bytes_needed(), free_bytes(shape.device)
    if needed > MEMORY_SHARE * free:
        outcome.why_not = (
            f"not measured: the call's tensors need about {_gib(needed)}, more than "
            f"{MEMORY_SHARE:.0%} of the {_gib(free)} free on {shape.device.type}"
        )
        return outcome
    # Real tensors whatever mode traces (fake tensors at graph time), autograd recorded for SDPA's
    # backward even inside an op's kernel (the op measures at run time below autograd).
    with _disable_current_modes(), torch.inference_mode(False), autograd_recorded(), _no_autocast():
        return _measure(shape, kernel, seconds, repeats, outcome)


def _no_autocast() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def _measure(shape: Shape, kernel: Kernel, seconds: float, repeats: int, outcome: Outcome) -> Outcome:
    started = time.perf_counter()
    inputs = _Inputs(shape, shape.keys)
    split = inputs.split(shape, shape.keys)
    if shape.softcap:  # no SDPA caps its scores: it stands for the chain, which scores as much and more
        outcome.replaced = "SDPA without the cap"
    softcap = SOFTCAP if shape.softcap else 0.0
    steps = []  # (SDPA, the kernel) of each layout, each checked
    for layout in (inputs,) if split is None else (inputs, split):
        sdpa = _sdpa_step(shape, layout)
        _synchronize(shape.device)
        reference = _attempt(sdpa)
        if isinstance(reference, BaseException):
            why = "out of memory" if _out_of_memory(reference) else _failure(reference)
            outcome.why_not = f"not measured: {outcome.replaced} itself failed ({why})"
            return outcome
        step = _op_step(kernel, shape, layout, softcap)
        if shape.softcap:
            problem = _check_softcap(kernel, shape, split=layout is split)
            if problem is None:  # a first run at this length, so that no timed run is its first
                first_run = _attempt(step)
                problem = first_run if isinstance(first_run, BaseException) else None
                del first_run
        else:
            result = _attempt(step)
            problem = result if isinstance(result, BaseException) else _difference(result, reference, shape.dtype)
            del result
        del reference
        if isinstance(problem, BaseException):
            if _out_of_memory(problem):
                outcome.skipped = "out of memory at this length"
            else:
                outcome.refused = f"failed on this device: {_failure(problem)}"
            return outcome
        if problem is not None:
            outcome.refused = f"differs on this device: {problem}"
            return outcome
        steps.append((sdpa, step))
    _synchronize(shape.device)
    # A first timed round after each one's first run; more while they fit ``seconds``.
    times = [([_timed(sdpa, shape.device)], [_timed(step, shape.device)]) for sdpa, step in steps]
    per_round = sum(sdpa_times[0] + kernel_times[0] for sdpa_times, kernel_times in times)
    rounds = 1 + max(0, min(repeats - 1, int((seconds - (time.perf_counter() - started)) / max(per_round, 1e-9))))
    for _ in range(rounds - 1):
        for (sdpa, step), (sdpa_times, kernel_times) in zip(steps, times, strict=True):
            sdpa_times.append(_timed(sdpa, shape.device))
            kernel_times.append(_timed(step, shape.device))
    outcome.rounds = rounds
    # The layout where the kernel fares worst against SDPA decides.
    medians = [(1e3 * _median(sdpa_times), 1e3 * _median(kernel_times)) for sdpa_times, kernel_times in times]
    outcome.sdpa_ms, outcome.kernel_ms = max(medians, key=lambda pair: pair[1] / max(pair[0], 1e-12))
    return outcome


def _check_softcap(kernel: Kernel, shape: Shape, split: bool = False) -> BaseException | str | None:
    """A kernel's soft-capped results against the scores written out in fp32, at no more than
    SOFTCAP_CHECK_KEYS keys (with a first run, so its timing run is not its first); ``split``:
    in the second layout of padded and packed calls (``_Inputs.split``)."""
    keys = min(shape.keys, SOFTCAP_CHECK_KEYS)
    small_shape = dataclasses.replace(shape, keys=keys)
    whole = _Inputs(shape, keys)
    small = whole.split(small_shape, keys) if split else whole
    if small is None:
        return None
    reference = _attempt(_softcap_reference(small_shape, small))
    if isinstance(reference, BaseException):
        return f"the fp32 reference failed: {_failure(reference)}"
    result = _attempt(_op_step(kernel, small_shape, small, SOFTCAP))
    if isinstance(result, BaseException):
        return result
    return _difference(result, reference, shape.dtype, "the capped scores written out's")


def _timed(step: Callable[[], tuple], device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    step()
    _synchronize(device)
    return time.perf_counter() - start


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])
