"""Attention for head_dim 257-512 (Gemma-4's global layers) in Triton, forward and backward:
the kernels are ``wide_head_kernels.py``, this is their ``kernel.Kernel`` object.

No FA2 kernel takes head_dim above 256, so SDPA runs such calls on its memory-efficient
kernel with K/V repeated (shared/REFERENCE.md, section 10). This kernel takes K/V at their own
head count (dK/dV summed over the GQA group inside the kernel), FA2's window (causal is
(-1, 0)), key padding and segment ids (any integer ids, not only runs), and skips whole key
blocks that no row of a query block sees (``block_table``), so a row packed with several
documents costs about the sum of their causal triangles, not the row's.

triton is optional: it is imported only when a call runs, and ``cannot`` says so where it is
missing. fp32 is computed exactly (IEEE dots) so that tests can compare tightly; fp16/bf16 are
what the policy would route.

Nothing here has run on a GPU yet: the kernels compile for sm90 and sm80 (``TILES``), and the
crossover table (``CROSSOVERS``) is empty, so the policy keeps SDPA for every call until
``benchmarks/gpu_check.py --sections global`` measures one. Grids are (blocks, batch * heads):
batch * heads must stay within CUDA's 65535 on a grid's second axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from . import fa2
from .kernel import AttentionCall, CallFacts, band_skips_little, unmeasured_or_short
from .layout import empty_like_heads_last, new_logsumexp

NAME = "the wide-head Triton kernel"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 257, 512
LOG2E = 1.4426950408889634


class Tiles(NamedTuple):
    """Each kernel holds ``stationary`` rows (forward, dQ: query rows; dK, dV: keys) and
    streams blocks of ``streamed`` of the other side past them."""

    stationary: int
    streamed: int
    d_chunk: int  # head_dim columns per step of the scores' accumulation
    warps: int
    stages: int


# (least opt-in shared memory per block, in bytes; tiles), first match. Compiled, NOT RUN OR
# TIMED, on a GPU: benchmarks/wide_head_compile.py compiles every kernel for sm90 and sm80 with
# the ptxas in triton's wheel (3.9), no GPU needed. At the first row, bf16, head_dim 512 with
# padding and segment ids, each kernel takes 68 KiB of shared memory and 255 registers a thread
# and spills 104-256 bytes (sm90) or 232-352 (sm80); 64-row stationary tiles (a 64 x 512 fp32
# accumulator over 8 warps) spilled 0.5-3 KiB, 16 warps or 2 stages no better. Every sm80+ GPU
# opts in to 99 KiB or more (H100/H200 227, A100 163); the second row (more spills) is for
# anything smaller. The interpreter (no limits) takes the first row, as a GPU would.
TILES = (
    (72 * 1024, Tiles(32, 64, 64, 8, 1)),
    (0, Tiles(32, 32, 64, 4, 1)),
)

# (CUDA capability, dtype) -> the fewest keys at which the kernel's fwd+bwd was measured at
# least as fast as SDPA's (benchmarks/gpu_check.py --sections global). Empty: nothing has been
# measured on a GPU, so no call is routed here by the default policy.
CROSSOVERS: Mapping[tuple[tuple[int, int], torch.dtype], int] = MappingProxyType({})
NOT_MEASURED = "not measured on a GPU: benchmarks/gpu_check.py --sections global"


@functools.cache
def triton_missing() -> str | None:
    """Why triton cannot be imported here, or None."""
    try:
        import triton  # noqa: F401 - imported to see whether it loads
    except ImportError as error:
        return f"triton is not importable ({error}); it ships with CUDA torch"
    return None


def _kernels():
    from . import wide_head_kernels  # imports triton; its jit functions read TRITON_INTERPRET now

    return wide_head_kernels


def tiles_for(device: torch.device) -> Tiles:
    """The tiles for a device, by its shared memory per block (the interpreter: the first row)."""
    if device.type != "cuda":
        return TILES[0][1]
    properties = torch.cuda.get_device_properties(device)
    shared = getattr(properties, "shared_memory_per_block_optin", 0)
    return next(tiles for least, tiles in TILES if shared >= least)


class BlockTable(NamedTuple):
    """Which (query block, key block) pairs of each batch row any row sees some key of, and
    the masks as the kernels read them."""

    block_m: int  # query rows per block
    block_n: int  # keys per block
    live: torch.Tensor  # (B, query blocks, key blocks) int8
    key_first: torch.Tensor  # (B, query blocks) int32: the first and last live key block
    key_last: torch.Tensor  # (first > last: none)
    query_first: torch.Tensor  # (B, key blocks) int32: the first and last live query block
    query_last: torch.Tensor
    key_padding: torch.Tensor | None  # (B, Sk) int8, 1 where valid
    segment_ids: torch.Tensor | None  # (B, S) int64, equal where the call's ids are equal

    @property
    def query_blocks(self) -> int:
        return self.live.shape[1]

    @property
    def key_blocks(self) -> int:
        return self.live.shape[2]


def _by_block(x: torch.Tensor, size: int, fill: int | None) -> torch.Tensor:
    """(B, S) -> (B, ceil(S / size), size), the last block filled with ``fill`` (None: the
    last value repeated, which leaves each block's least and greatest value as they are)."""
    batch, seq = x.shape
    extra = -seq % size
    if extra:
        tail = x[:, -1:].expand(batch, extra) if fill is None else x.new_full((batch, extra), fill)
        x = torch.cat([x, tail], dim=1)
    return x.view(batch, -1, size)


def block_table(call: AttentionCall, block_m: int, block_n: int) -> BlockTable:
    """The block table of a call. A pair is dead only where no (row, key) in it can be seen:
    the window's distances j - i - (Sk - Sq) over the pair lie in [k_start - q_end, k_end -
    q_start] shifted, outside [-left, right]; or the key block holds no valid key; or the
    query block's segment ids and the key block's span disjoint ranges (equal ids lie in
    both). Dead pairs are skipped; in live ones the kernels mask element by element."""
    batch, _, seq_q, _ = call.query.shape
    seq_k = call.key.shape[2]
    device = call.query.device
    q_start = torch.arange(0, seq_q, block_m, device=device)
    k_start = torch.arange(0, seq_k, block_n, device=device)
    q_end = (q_start + block_m).clamp(max=seq_q) - 1
    k_end = (k_start + block_n).clamp(max=seq_k) - 1
    offset = seq_k - seq_q
    live = torch.ones(len(q_start), len(k_start), dtype=torch.bool, device=device)
    if call.left >= 0:
        live &= (k_end[None, :] - q_start[:, None] - offset) >= -call.left
    if call.right >= 0:
        live &= (k_start[None, :] - q_end[:, None] - offset) <= call.right
    live = live.expand(batch, -1, -1)
    key_padding = segment_ids = None
    if call.key_padding is not None:
        key_padding = call.key_padding.to(torch.int8).contiguous()
        live = live & (_by_block(key_padding, block_n, 0).amax(dim=-1) != 0)[:, None, :]
    if call.segment_ids is not None:
        # int64 keeps every id's equality (a uint64 id wraps, one to one); no host sync. Equal
        # ids lie in both blocks' [least, greatest] under any order, so the test below is sound.
        segment_ids = call.segment_ids.to(torch.int64).contiguous()
        rows = _by_block(segment_ids, block_m, None)
        keys = _by_block(segment_ids, block_n, None)
        live = live & (
            (rows.amin(dim=-1)[:, :, None] <= keys.amax(dim=-1)[:, None, :])
            & (keys.amin(dim=-1)[:, None, :] <= rows.amax(dim=-1)[:, :, None])
        )
    key_index = torch.arange(live.shape[2], device=device)
    query_index = torch.arange(live.shape[1], device=device)[:, None]
    return BlockTable(
        block_m,
        block_n,
        live.to(torch.int8).contiguous(),
        torch.where(live, key_index, live.shape[2]).amin(dim=2).to(torch.int32),
        torch.where(live, key_index, -1).amax(dim=2).to(torch.int32),
        torch.where(live, query_index, live.shape[1]).amin(dim=1).to(torch.int32),
        torch.where(live, query_index, -1).amax(dim=1).to(torch.int32),
        key_padding,
        segment_ids,
    )


class WidePlan(NamedTuple):
    tiles: Tiles
    by_query: BlockTable  # for the query-stationary kernels (forward, dQ)
    by_key: BlockTable  # for the key-stationary ones (dK, dV)


def wide_plan(call: AttentionCall, tiles: Tiles) -> WidePlan:
    return WidePlan(
        tiles,
        block_table(call, tiles.stationary, tiles.streamed),
        block_table(call, tiles.streamed, tiles.stationary),
    )


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, seq) strides of a (B, H, S, D) tensor whose last dimension is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _masks(table: BlockTable) -> tuple:
    """The padding and segment pointers and their batch strides (the live table stands in for
    an absent one: the kernel never reads it then)."""
    pad = table.key_padding if table.key_padding is not None else table.live
    seg = table.segment_ids if table.segment_ids is not None else table.live
    return (pad, seg), (pad.stride(0), seg.stride(0))


def _constants(call: AttentionCall, table: BlockTable, tiles: Tiles) -> dict:
    dim = call.query.shape[-1]
    return dict(
        HEAD_DIM=dim,
        D_PAD=1 << (dim - 1).bit_length(),
        D_CHUNK=tiles.d_chunk,
        BLOCK_M=table.block_m,
        BLOCK_N=table.block_n,
        PRECISION="ieee" if call.query.dtype == torch.float32 else "tf32",
        # Off a GPU the kernels run in Triton's interpreter, whose bf16 dot is wrong (_dot).
        UPCAST=call.query.dtype == torch.bfloat16 and call.query.device.type != "cuda",
        HAS_LEFT=call.left >= 0,
        HAS_RIGHT=call.right >= 0,
        HAS_PAD=table.key_padding is not None,
        HAS_SEG=table.segment_ids is not None,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )


def _shape(call: AttentionCall) -> tuple[int, int, int, int, int, int]:
    batch, heads, seq_q, _ = call.query.shape
    kv_heads, seq_k = call.key.shape[1], call.key.shape[2]
    return batch, heads, kv_heads, heads // kv_heads, seq_q, seq_k


def wide_forward(call: AttentionCall, plan: WidePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out heads-last, logsumexp (B, H, Sq) fp32; +inf where a row sees no key)."""
    kernels = _kernels()
    query, key, value = call.query, call.key, call.value
    batch, heads, _, group, seq_q, seq_k = _shape(call)
    out, logsumexp = empty_like_heads_last(query), new_logsumexp(query)
    table = plan.by_query
    (pad, seg), mask_strides = _masks(table)
    kernels.forward[(table.query_blocks, batch * heads)](
        query,
        key,
        value,
        out,
        logsumexp,
        pad,
        seg,
        table.live,
        table.key_first,
        table.key_last,
        *_strides(query),
        *_strides(key),
        *_strides(value),
        *_strides(out),
        *mask_strides,
        heads,
        group,
        seq_q,
        seq_k,
        call.left,
        call.right,
        call.scale * LOG2E,
        table.query_blocks,
        table.key_blocks,
        **_constants(call, table, plan.tiles),
    )
    return out, logsumexp


def wide_backward(call: AttentionCall, plan: WidePlan, grad_out, out, logsumexp):
    """(dq, dk, dv), heads-last: rowsum(dO * O), then dV and dK key-stationary (the GQA group
    looped inside), then dQ query-stationary."""
    kernels = _kernels()
    query, key, value = call.query, call.key, call.value
    batch, heads, kv_heads, group, seq_q, seq_k = _shape(call)
    logsumexp = logsumexp.contiguous()
    delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=query.device)
    rows = plan.tiles.stationary
    dim = query.shape[-1]
    kernels.row_dot[(-(-seq_q // rows), batch * heads)](
        grad_out,
        out,
        delta,
        *_strides(grad_out),
        *_strides(out),
        heads,
        seq_q,
        HEAD_DIM=dim,
        D_PAD=1 << (dim - 1).bit_length(),
        BLOCK_M=rows,
    )
    inputs = (query, key, value, grad_out, logsumexp, delta)
    strides = (*_strides(query), *_strides(key), *_strides(value), *_strides(grad_out))
    by_key, by_query = plan.by_key, plan.by_query
    grad_key, grad_value = empty_like_heads_last(key), empty_like_heads_last(value)
    (pad, seg), mask_strides = _masks(by_key)
    for grad, is_value in ((grad_value, True), (grad_key, False)):
        kernels.key_grad[(by_key.key_blocks, batch * kv_heads)](
            *inputs,
            grad,
            pad,
            seg,
            by_key.live,
            by_key.query_first,
            by_key.query_last,
            *strides,
            *_strides(grad),
            *mask_strides,
            heads,
            kv_heads,
            group,
            *_sizes(call, by_key),
            VALUE=is_value,
            **_constants(call, by_key, plan.tiles),
        )
    grad_query = empty_like_heads_last(query)
    (pad, seg), mask_strides = _masks(by_query)
    kernels.query_grad[(by_query.query_blocks, batch * heads)](
        *inputs,
        grad_query,
        pad,
        seg,
        by_query.live,
        by_query.key_first,
        by_query.key_last,
        *strides,
        *_strides(grad_query),
        *mask_strides,
        heads,
        group,
        *_sizes(call, by_query),
        **_constants(call, by_query, plan.tiles),
    )
    return grad_query, grad_key, grad_value


def _sizes(call: AttentionCall, table: BlockTable) -> tuple:
    seq_q, seq_k = call.query.shape[2], call.key.shape[2]
    return seq_q, seq_k, call.left, call.right, call.scale, call.scale * LOG2E, table.query_blocks, table.key_blocks


class WideHeadKernel:
    """The kernel object (``kernel.Kernel``). ``crossovers`` maps (capability, dtype) to the
    fewest keys at which it was measured as fast as SDPA; a policy given another table
    (``KernelPolicy.with_wide_head_crossovers``) routes by that one."""

    name = NAME

    def __init__(self, crossovers: Mapping[tuple[tuple[int, int], torch.dtype], int] = CROSSOVERS):
        self.crossovers = MappingProxyType(dict(crossovers))

    def __repr__(self) -> str:
        return f"WideHeadKernel({dict(self.crossovers)})"

    def describe(self, facts: CallFacts) -> str:
        return "Triton wide-head attention (head_dim 257-512, block-skipping)"

    def cannot(self, facts: CallFacts) -> str | None:
        if facts.dtype not in DTYPES:
            return f"{NAME} takes fp16, bf16 or fp32, not {facts.dtype}"
        if not MIN_HEAD_DIM <= facts.head_dim <= MAX_HEAD_DIM:
            return f"{NAME} takes head_dim {MIN_HEAD_DIM}-{MAX_HEAD_DIM}, not {facts.head_dim}"
        if facts.blocks:
            return f"{NAME} takes no image blocks"
        if facts.softcap:
            return f"{NAME} takes no soft-capped scores"
        capability = fa2.device_capability(facts.device)
        if capability is None:
            return (
                "no CUDA GPU is available"
                if facts.device.type == "cuda"
                else f"{NAME} runs only on CUDA, not {facts.device.type}"
            )
        if torch.version.hip is not None:
            return f"{NAME} is not used on ROCm (not tested there)"
        if capability < (8, 0):
            return f"{NAME} needs sm80 or newer (bf16 dots)"
        return triton_missing()

    def slower(self, facts: CallFacts) -> str | None:
        capability = fa2.device_capability(facts.device)
        return unmeasured_or_short(self.crossovers, capability, facts, NOT_MEASURED) or band_skips_little(facts)

    def plan(self, call: AttentionCall) -> WidePlan:
        return wide_plan(call, tiles_for(call.query.device))

    def forward(self, call: AttentionCall, plan: WidePlan):
        return wide_forward(call, plan)

    def backward(self, call: AttentionCall, plan: WidePlan, grad_out, out, logsumexp):
        return wide_backward(call, plan, grad_out, out, logsumexp)


WIDE_HEAD = WideHeadKernel()
