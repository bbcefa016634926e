"""The contract every kernel of the sliding-window op keeps (``policy.KernelPolicy`` lists them).

A kernel answers from a call's facts, the same at graph time (fake tensors, symbolic lengths)
and at run time (real tensors):
- ``cannot(facts)``: why it cannot compute this call exactly here, or None;
- ``slower(facts)``: why it may be slower than SDPA with the mask here, or None (the static
  tables: a measurement on the device answers in its place, ``compile_pass.measure``);
- optionally ``never_faster(facts)``: why no measurement could find it faster than SDPA for
  such a call (it would run what SDPA runs: ``nothing_to_skip``), or None: such a call is not
  measured for it, and no measurement overrides the answer;
then, at run time only:
- ``plan(call)``: what it needs from the tensors' values (a varlen layout), or None where
  their values rule it out (a padding row with a hole): the next kernel in the list runs;
- ``forward(call, plan)`` -> (out, logsumexp) and ``backward(call, plan, grad_out, out,
  logsumexp)`` -> (dq, dk, dv), in the op's layouts (``layout.py``). The logsumexp is each
  row's over the keys it sees (either infinity for a row that sees none): the op applies
  attention sinks from it (``sinks.py``), and calls the backward with a rescaled output.
The forward and the backward of a call ask the same question of the same facts and values
(the op saves what the forward saw), so they always take the same kernel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, statically_known_true

from ..sizes import same_size
from ..window import UNBOUNDED


class CallFacts(NamedTuple):
    """What decides a call's kernel. Sizes may be symbolic at graph time: a kernel reads them
    through ``statically_known_true``-style questions (``same_lengths``), except the one
    question ``short_call`` answers with a guard."""

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    same_lengths: bool = True  # Sq == Sk for every call (not known: False)
    key_padding: bool = False
    segment_ids: bool = False
    blocks: bool = False  # image block ids
    keys: Any = None  # Sk (an int or a SymInt), and the window's sides, where known
    left: int | None = None
    right: int | None = None
    # A value head_dim smaller than head_dim, which the rewrite zero-pads to head_dim (None: the
    # same): the op computes it exactly on every kernel, at more cost than SDPA's narrower call.
    value_head_dim: int | None = None
    # Scores soft-capped before the mask, ``cap * tanh(s / cap)`` (FA2's ``softcap``): a kernel
    # that cannot cap its scores says so in ``cannot``.
    softcap: bool = False
    # The call is attention spelled out in ops (``spelled_attention``: with or without sinks or
    # a cap): what the op replaces is that chain, not an SDPA call.
    spelled: bool = False
    # The call's shape, where known (ints, or SymInts at graph time): what a measurement on the
    # device makes its inputs with (``compile_pass.measure``). None where the asker does not give it.
    batch: Any = None
    heads: int | None = None
    kv_heads: int | None = None
    queries: Any = None
    # SDPA itself computes this call without its mask: ``is_causal`` (a causal mask with no left
    # bound, Sq == Sk) or every key visible, the causal rule's form of such a mask. A kernel is
    # then compared with that, which skips what a band kernel would, not with SDPA with the mask
    # (``nothing_to_skip``). The asker says so: it knows what the op would replace.
    sdpa_unmasked: bool = False
    # The call's result needs gradients (a training step); False for a call traced under
    # ``torch.no_grad`` (an eval loop, a prefill), which runs the forward alone and is measured so.
    grad: bool = True

    @property
    def batch_masks(self) -> bool:
        return self.key_padding or self.segment_ids


def runs_unmasked(left: int, right: int, same_lengths: bool, masked: bool) -> bool:
    """Whether SDPA computes a call with this window and no batch masks or image blocks
    (``masked`` False) without a mask: no left bound, and causal with Sq == Sk (``is_causal``)
    or every key visible."""
    return not masked and left == UNBOUNDED and (right == UNBOUNDED or (right == 0 and same_lengths))


def nothing_to_skip(facts: CallFacts) -> str | None:
    """Why a kernel that runs what SDPA runs for such a call could never be faster than SDPA (its
    ``never_faster``): SDPA computes the call without its mask (``sdpa_unmasked``), one run over
    every key with nothing left for a band kernel to skip. Where the op replaces a chain of ops
    (``spelled``, soft-capped scores), not SDPA, this does not hold."""
    if facts.sdpa_unmasked and not (facts.spelled or facts.softcap):
        return "SDPA computes such a call without its mask (is_causal, or every key visible): nothing left to skip"
    return None


def band_skips_little(facts: CallFacts) -> str | None:
    """Why a call with unequal numbers of queries and keys (a chunk after a cache, a decoding
    step) may be slower on any band kernel: where it may have fewer than 2w - 1 keys (a
    sliding cache's w - 1 and fewer than w queries), the band skips little of what SDPA
    scores and the op's fixed cost per call shows (``benchmarks/bench_op.py --cache``: 0.8x
    for 128 queries after 511 keys, w = 512; 1.15x and more from 512 queries on). None where
    it has that many keys, as many queries as keys, or the sizes are not given."""
    if facts.same_lengths or facts.keys is None or facts.left is None:
        return None
    least = 2 * facts.left + 1
    if statically_known_true(facts.keys >= least):
        return None
    return (
        f"its {facts.keys} keys after a cache may be fewer than 2w - 1 = {least}, where the band skips too little "
        "for the op to be as fast as SDPA"
    )


# COMPILE_PASS_SHORT_KEYS=N sets one crossover for every kernel and dtype, in place of the
# measured ones, for a machine that measures otherwise (0: every length rewritten).
SHORT_KEYS_SETTING = os.environ.get("COMPILE_PASS_SHORT_KEYS")


def measured_or_set(measured: int) -> int:
    """A kernel's crossover for ``short_call``: COMPILE_PASS_SHORT_KEYS where set, else its own."""
    return measured if SHORT_KEYS_SETTING is None else int(SHORT_KEYS_SETTING)


def short_call(facts: CallFacts, most_keys: int) -> str | None:
    """Why a call with at most ``most_keys`` keys may be slower than SDPA: there the op's fixed
    cost per call (Python and dispatch, forward and backward) outweighs the scores the band
    skips. None for longer calls, where the sizes are not given, or with ``most_keys`` 0.

    A symbolic length is answered for the length the graph is traced at, with a guard, as
    inductor guards its own size-dependent choices: the graph then serves only lengths on
    that side, and the first length on the other side compiles a second graph with the other
    answer. So short lengths run SDPA itself, with no call of the op and no run-time test,
    for one more compilation where lengths cross ``most_keys``."""
    if facts.keys is None or most_keys <= 0 or not guard_or_false(facts.keys <= most_keys):
        return None
    why = f"at most {most_keys}, too few for the band to repay the op's fixed cost per call"
    if isinstance(facts.keys, int):
        return f"its {facts.keys} keys are {why}"
    return (
        f"its {facts.keys.node.hint} keys at tracing are {why} "
        "(the graph is guarded to such lengths; a longer one compiles another)"
    )


def padded_value_unmeasured(facts: CallFacts) -> str | None:
    """Why a GPU kernel may be slower on a call whose value the rewrite zero-pads than SDPA on
    the narrower value (up to twice SDPA's work on the value side): nothing is measured on a
    GPU. The chunked kernel's CPU crossovers held for such calls (head_dim 256, value 128,
    windows 512 and 1024: ``benchmarks/bench_op.py --value-head-dim 128``)."""
    if facts.value_head_dim is None:
        return None
    return f"value zero-padded from head_dim {facts.value_head_dim} to {facts.head_dim}: not measured on a GPU"


def unmeasured_or_short(
    crossovers: Mapping[tuple[tuple[int, int], torch.dtype], int],
    capability: tuple[int, int] | None,
    facts: CallFacts,
    not_measured: str,
) -> str | None:
    """Why a kernel routed by crossovers measured on GPUs ((capability, dtype) -> the fewest keys
    at which it wins) may be slower here: nothing measured for this GPU and dtype or for a
    zero-padded value, or a call shorter than the crossover (``short_call``)."""
    if facts.value_head_dim is not None:
        return padded_value_unmeasured(facts)
    if capability is None:
        return f"{not_measured} (not a CUDA device)"
    fewest = crossovers.get((capability, facts.dtype))
    if fewest is None:
        major, minor = capability
        return f"{not_measured} (no crossover for sm{major}{minor} {facts.dtype})"
    return short_call(facts, measured_or_set(fewest - 1))


class AttentionCall(NamedTuple):
    """One call of the op, as its kernels read it: (B, H, S, D) tensors with a contiguous last
    dimension, FA2's window, and the optional (batch, seq) masks."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    left: int
    right: int
    scale: float
    key_padding: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    block_ids: torch.Tensor | None = None
    # The FA2 varlen layout of the padding or segment ids, computed once for several calls
    # (``fa2_varlen.encode_layout``: device pieces, CPU sizes), or None.
    layout: tuple[torch.Tensor, torch.Tensor] | None = None
    # FA2's ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (0: none).
    softcap: float = 0.0

    @property
    def facts(self) -> CallFacts:
        same_lengths = same_size(self.query.shape[2], self.key.shape[2])
        masked = self.key_padding is not None or self.segment_ids is not None or self.block_ids is not None
        return CallFacts(
            self.query.device,
            self.query.dtype,
            self.query.shape[-1],
            same_lengths,
            self.key_padding is not None,
            self.segment_ids is not None,
            self.block_ids is not None,
            self.key.shape[2],
            self.left,
            self.right,
            softcap=self.softcap != 0.0,
            batch=self.query.shape[0],
            heads=self.query.shape[1],
            kv_heads=self.key.shape[1],
            queries=self.query.shape[2],
            # The op's own call: what SDPA would run for it, the sinks step apart.
            sdpa_unmasked=runs_unmasked(self.left, self.right, same_lengths, masked),
        )


_ONLY: list[Any] = []  # the kernel every call of the op runs while ``only_kernel`` holds


@contextlib.contextmanager
def only_kernel(kernel: Any) -> Iterator[None]:
    """Every call of the op, forward and backward, runs ``kernel`` while this holds, routed by
    no policy: what ``measure.run`` times a kernel through, the op itself, as the rewritten graph
    calls it. A module-level stack, not a context variable: the backward of CUDA tensors runs
    on autograd's device threads."""
    _ONLY.append(kernel)
    try:
        yield
    finally:
        _ONLY.pop()


def kernel_only() -> Any:
    """The kernel ``only_kernel`` holds, or None."""
    return _ONLY[-1] if _ONLY else None


class Kernel(Protocol):
    name: str  # the kernel, in words

    def describe(self, facts: CallFacts) -> str: ...  # what runs for such a call, for the report

    def cannot(self, facts: CallFacts) -> str | None: ...

    def slower(self, facts: CallFacts) -> str | None: ...

    def plan(self, call: AttentionCall) -> Any | None: ...

    def forward(self, call: AttentionCall, plan: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, call: AttentionCall, plan: Any, grad_out: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
