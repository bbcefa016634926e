"""Attention for head_dim 64-512 in Triton, forward and backward, with FA2's soft-capping: the
kernels are ``forward.py`` and ``backward.py``, their tiles ``tiles.py``, this is their
``kernel.Kernel`` object.

No FA2 kernel takes head_dim above 256, so SDPA runs such calls (Gemma-4's global layers) on
its memory-efficient kernel with K/V repeated (shared/REFERENCE.md, section 10); and no FA2 in
torch caps scores (Gemma-2's ``softcap``), so such calls have no fused kernel in torch at any
head_dim. This kernel takes K/V at their own head count (dK/dV summed over the GQA group
inside the kernel), FA2's window (causal is (-1, 0)), key padding and segment ids (any integer
ids, not only runs), a soft cap, and skips whole key blocks that no row of a query block sees
(``block_table``), so a row packed with several documents costs about the sum of their causal
triangles, not the row's.

triton is optional: it is imported only when a call runs, and ``cannot`` says so where it is
missing. fp32 is computed exactly (IEEE dots) so that tests can compare tightly; fp16/bf16 are
what the policy would route.

Nothing here has run on a GPU yet: each kernel's tiles are measured on the device at its first
launch (``wide_head_tiles.launch``), among the configs that compile for sm80, sm90 and sm100
(``benchmarks/wide_head_compile.py``); the crossover table (``CROSSOVERS``) is empty, so the
policy keeps SDPA for every call until ``benchmarks/gpu_check.py --sections global`` measures
one. Grids are (blocks, batch * heads): batch * heads must stay within CUDA's 65535 on a
grid's second axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch

from .. import fa2
from ..contract import AttentionCall, CallFacts, band_skips_little, unmeasured_or_short
from ..layout import empty_like_heads_last, new_logsumexp
from . import tiles as wide_head_tiles
from .tiles import CONFIGS, Config, Tiles, TuneKey, fitting, padded_head_dim, shared_memory_of, size_bucket

NAME = "the wide-head Triton kernel"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 64, 512
LOG2E = 1.4426950408889634


# (CUDA capability, dtype) -> the fewest keys at which the kernel's fwd+bwd was measured at
# least as fast as SDPA's (benchmarks/gpu_check.py --sections global). Empty: nothing has been
# measured on a GPU, so no call is routed here by the default policy.
CROSSOVERS: Mapping[tuple[tuple[int, int], torch.dtype], int] = MappingProxyType({})
NOT_MEASURED = "not measured on a GPU: benchmarks/gpu_check.py --sections global"
# Rows of dO and O that row_dot reads per program: this many elements of each.
ROW_DOT_ELEMENTS = 8192


@functools.cache
def triton_missing() -> str | None:
    """Why triton cannot be imported here, or None."""
    try:
        import triton  # noqa: F401 - imported to see whether it loads
    except ImportError as error:
        return f"triton is not importable ({error}); it ships with CUDA torch"
    return None


def _kernels():
    """(forward kernels, backward kernels): the modules, imported now (they import triton, and
    their jit functions read TRITON_INTERPRET then)."""
    from . import backward as wide_head_backward
    from . import forward as wide_head_kernels

    return wide_head_kernels, wide_head_backward


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


class WidePlan:
    """A call's tile candidates on its device, and its block tables, each computed when a kernel
    first asks for its (query rows, keys) block sizes: the kernels' tiles are measured apart."""

    def __init__(self, call: AttentionCall, candidates: tuple[Tiles, ...]):
        self.call = call
        self.candidates = candidates
        self._tables: dict[tuple[int, int], BlockTable] = {}

    def table(self, block_m: int, block_n: int) -> BlockTable:
        if (block_m, block_n) not in self._tables:
            self._tables[(block_m, block_n)] = block_table(self.call, block_m, block_n)
        return self._tables[(block_m, block_n)]

    def by_query(self, tiles: Tiles) -> BlockTable:
        """The table of the query-stationary kernels (forward, dQ)."""
        return self.table(tiles.stationary, tiles.streamed)

    def by_key(self, tiles: Tiles) -> BlockTable:
        """The table of the key-stationary ones (dK, dV): query blocks streamed past key blocks."""
        return self.table(tiles.streamed, tiles.stationary)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, seq) strides of a (B, H, S, D) tensor whose last dimension is contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _constants(call: AttentionCall, table: BlockTable, tiles: Tiles) -> dict:
    dim = call.query.shape[-1]
    return dict(
        HEAD_DIM=dim,
        D_PAD=padded_head_dim(dim),
        D_CHUNK=tiles.d_chunk,
        BLOCK_M=table.block_m,
        BLOCK_N=table.block_n,
        PRECISION="ieee" if call.query.dtype == torch.float32 else "tf32",
        # Off a GPU the kernels run in Triton's interpreter, whose bf16 dot is wrong (accumulate_dot).
        UPCAST=call.query.dtype == torch.bfloat16 and call.query.device.type != "cuda",
        HAS_LEFT=call.left >= 0,
        HAS_RIGHT=call.right >= 0,
        HAS_PAD=table.key_padding is not None,
        HAS_SEG=table.segment_ids is not None,
        # Masks from data may leave dead blocks between a block's first and last live one; a
        # window never does, and there the key loop reads no flag, so the compiler may hoist
        # the stationary rows' loads out of it (more shared memory: wide_head_tiles.fitting).
        READ_LIVE=table.key_padding is not None or table.segment_ids is not None,
        SOFTCAP=call.softcap != 0.0,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )


def _scores_scalars(call: AttentionCall) -> tuple[float, float, float]:
    """(scale * log2(e), scale / cap, cap * log2(e)): the kernels' scores in log2 units are
    ``dot * scale * log2(e)``, or capped, ``cap * log2(e) * tanh(dot * scale / cap)``."""
    if call.softcap == 0.0:
        return call.scale * LOG2E, 0.0, 0.0
    return call.scale * LOG2E, call.scale / call.softcap, call.softcap * LOG2E


def _shape(call: AttentionCall) -> tuple[int, int, int, int, int, int]:
    batch, heads, seq_q, _ = call.query.shape
    kv_heads, seq_k = call.key.shape[1], call.key.shape[2]
    return batch, heads, kv_heads, heads // kv_heads, seq_q, seq_k


def tune_key(kernel: str, call: AttentionCall) -> TuneKey:
    batch, heads, _, group, seq_q, seq_k = _shape(call)
    return TuneKey(
        kernel,
        wide_head_tiles.device_name(call.query.device),
        call.query.dtype,
        call.query.shape[-1],
        call.left >= 0,
        call.right >= 0,
        call.key_padding is not None,
        call.segment_ids is not None,
        call.softcap != 0.0,
        group,
        size_bucket(seq_q),
        size_bucket(seq_k),
        size_bucket(batch * heads),
    )


def _launch(
    kernel, plan: WidePlan, tiles: Tiles, tensors: tuple, strides: tuple, scalars: tuple, *, by_key=False, **constants
) -> None:
    """Launches ``kernel`` at ``tiles``: one program per stationary block (keys where ``by_key``,
    else query rows) and batch * (KV) head, with the arguments in the order every kernel takes
    them (the tensors, the masks, the block table, the strides, the scalars, the table's sizes,
    the constants). An absent mask is passed as the live table: the kernel never reads it then."""
    call = plan.call
    batch, heads, kv_heads, *_ = _shape(call)
    if by_key:
        table = plan.by_key(tiles)
        grid = (table.key_blocks, batch * kv_heads)
        ranges = (table.query_first, table.query_last)
    else:
        table = plan.by_query(tiles)
        grid = (table.query_blocks, batch * heads)
        ranges = (table.key_first, table.key_last)
    pad = table.key_padding if table.key_padding is not None else table.live
    seg = table.segment_ids if table.segment_ids is not None else table.live
    kernel[grid](
        *tensors,
        pad,
        seg,
        table.live,
        *ranges,
        *strides,
        pad.stride(0),
        seg.stride(0),
        *scalars,
        table.query_blocks,
        table.key_blocks,
        **constants,
        **_constants(call, table, tiles),
    )


def wide_forward(call: AttentionCall, plan: WidePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out heads-last, logsumexp (B, H, Sq) fp32; +inf where a row sees no key)."""
    kernels, _ = _kernels()
    query, key, value = call.query, call.key, call.value
    _, heads, _, group, seq_q, seq_k = _shape(call)
    out, logsumexp = empty_like_heads_last(query), new_logsumexp(query)
    tensors = (query, key, value, out, logsumexp)
    strides = (*_strides(query), *_strides(key), *_strides(value), *_strides(out))
    scalars = (heads, group, seq_q, seq_k, call.left, call.right, *_scores_scalars(call))

    def run(tiles: Tiles) -> None:
        _launch(kernels.forward, plan, tiles, tensors, strides, scalars)

    wide_head_tiles.launch(tune_key("forward", call), plan.candidates, run)
    return out, logsumexp


def wide_backward(call: AttentionCall, plan: WidePlan, grad_out, out, logsumexp):
    """(dq, dk, dv), heads-last: rowsum(dO * O), then dV and dK key-stationary (the GQA group
    looped inside), then dQ query-stationary."""
    kernels, backward_kernels = _kernels()
    query, key, value = call.query, call.key, call.value
    batch, heads, kv_heads, group, seq_q, seq_k = _shape(call)
    logsumexp = logsumexp.contiguous()
    delta = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=query.device)
    width = padded_head_dim(query.shape[-1])
    rows = ROW_DOT_ELEMENTS // width
    kernels.row_dot[(-(-seq_q // rows), batch * heads)](
        grad_out,
        out,
        delta,
        *_strides(grad_out),
        *_strides(out),
        heads,
        seq_q,
        HEAD_DIM=query.shape[-1],
        D_PAD=width,
        BLOCK_M=rows,
        num_warps=8,
    )
    inputs = (query, key, value, grad_out, logsumexp, delta)
    strides = (*_strides(query), *_strides(key), *_strides(value), *_strides(grad_out))
    sizes = (seq_q, seq_k, call.left, call.right, call.scale, *_scores_scalars(call))
    grad_key, grad_value = empty_like_heads_last(key), empty_like_heads_last(value)
    for grad, is_value in ((grad_value, True), (grad_key, False)):

        def run_key_grad(tiles: Tiles, grad=grad, is_value=is_value) -> None:
            _launch(
                backward_kernels.key_grad,
                plan,
                tiles,
                (*inputs, grad),
                (*strides, *_strides(grad)),
                (heads, kv_heads, group, *sizes),
                by_key=True,
                VALUE=is_value,
            )

        wide_head_tiles.launch(tune_key("dV" if is_value else "dK", call), plan.candidates, run_key_grad)
    grad_query = empty_like_heads_last(query)

    def run_query_grad(tiles: Tiles) -> None:
        _launch(
            backward_kernels.query_grad,
            plan,
            tiles,
            (*inputs, grad_query),
            (*strides, *_strides(grad_query)),
            (heads, group, *sizes),
        )

    wide_head_tiles.launch(tune_key("dQ", call), plan.candidates, run_query_grad)
    return grad_query, grad_key, grad_value


class WideHeadKernel:
    """The kernel object (``kernel.Kernel``). ``crossovers`` maps (capability, dtype) to the
    fewest keys at which it was measured as fast as SDPA; a policy given another table
    (``KernelPolicy.with_wide_head_crossovers``) routes by that one. ``configs``: the tile
    configs its launches measure where they fit (``wide_head_tiles.CONFIGS``; one: it runs)."""

    name = NAME

    def __init__(
        self,
        crossovers: Mapping[tuple[tuple[int, int], torch.dtype], int] = CROSSOVERS,
        configs: tuple[Config, ...] = CONFIGS,
    ):
        self.crossovers = MappingProxyType(dict(crossovers))
        self.configs = tuple(configs)

    def __repr__(self) -> str:
        configs = "" if self.configs == CONFIGS else f", configs={self.configs}"
        return f"WideHeadKernel({dict(self.crossovers)}{configs})"

    def describe(self, facts: CallFacts) -> str:
        return f"Triton wide-head attention (head_dim {MIN_HEAD_DIM}-{MAX_HEAD_DIM}, block-skipping, tiles tuned)"

    def candidates(self, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> tuple[Tiles, ...]:
        """The tiles its launches measure for such calls on this device (``wide_head_tiles.fitting``)."""
        return fitting(self.configs, shared_memory_of(device), head_dim, dtype, masked)

    def cannot(self, facts: CallFacts) -> str | None:
        if facts.dtype not in DTYPES:
            return f"{NAME} takes fp16, bf16 or fp32, not {facts.dtype}"
        if not MIN_HEAD_DIM <= facts.head_dim <= MAX_HEAD_DIM:
            return f"{NAME} takes head_dim {MIN_HEAD_DIM}-{MAX_HEAD_DIM}, not {facts.head_dim}"
        if facts.blocks:
            return f"{NAME} takes no image blocks"
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
        missing = triton_missing()
        if missing is None and not self.candidates(facts.device, facts.dtype, facts.head_dim, facts.batch_masks):
            shared = shared_memory_of(facts.device)
            size = "" if shared is None else f"{shared // 1024} KiB of "
            return (
                f"no tile config of {NAME} fits the GPU's {size}shared memory per block "
                f"at head_dim {facts.head_dim} in {facts.dtype}{' with masks' if facts.batch_masks else ''}"
            )
        return missing

    def slower(self, facts: CallFacts) -> str | None:
        capability = fa2.device_capability(facts.device)
        return unmeasured_or_short(self.crossovers, capability, facts, NOT_MEASURED) or band_skips_little(facts)

    def plan(self, call: AttentionCall) -> WidePlan | None:
        masked = call.key_padding is not None or call.segment_ids is not None
        candidates = self.candidates(call.query.device, call.query.dtype, call.query.shape[-1], masked)
        return WidePlan(call, candidates) if candidates else None

    def forward(self, call: AttentionCall, plan: WidePlan):
        return wide_forward(call, plan)

    def backward(self, call: AttentionCall, plan: WidePlan, grad_out, out, logsumexp):
        return wide_backward(call, plan, grad_out, out, logsumexp)


WIDE_HEAD = WideHeadKernel()
