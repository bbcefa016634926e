"""FlashAttention-2's semantics, for every implementation of its kernels: torch's own
(``aten::_flash_attention_forward/_backward``, ``torch_flash.py``) and the flash-attn
package's (``flash.py``). Both run the same ``mha_fwd``/``mha_varlen_fwd`` entry points of
FA2's C++ API, so the window clamp, the bottom-right alignment, the layouts and what a row
without keys gets are the same; an implementation only says how to call them (``FA2Calls``).

Here: which windows FA2 computes exactly (``window_is_exact``), how a padded, packed or
image batch becomes varlen calls (``varlen_layout``, ``image_pass``), and the kernel object
(``FA2Kernel``) that runs a call through an implementation, dense or varlen.

Layout: FA2 allocates its output like q (``empty_like``). It always gets q as a
(B, S, H, D)-contiguous tensor, so its output is heads-last, the layout the fake promises,
whatever the input strides. Models hand over transposed views of exactly that storage, so
this copies nothing for them; the other choice, a fake that follows q's strides, would tie
every kernel's output layout to q's and make the usual
``out.transpose(1, 2).reshape(b, s, h * d)`` copy for (B, H, S, D)-contiguous inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ..window import UNBOUNDED
from .kernel import AttentionCall, CallFacts, band_skips_little, measured_or_set, short_call
from .layout import block_extents, empty_like_heads_last

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Calls with at most this many keys keep SDPA on a GPU (``kernel.short_call``): plain calls,
# and calls with key padding, segment ids or image blocks (varlen calls). Measured on an H200
# (``benchmarks/gpu_check.py``: bf16, 16/8 heads, head_dim 256, w = 512 and 1024). One layer,
# batch 4, calls queued: plain calls ran at 0.68-0.78x of SDPA with the mask up to 512 keys,
# 1.11x at 768. Padded: the 6-layer training step (batch 2, a row left-padded by a quarter,
# the layout's host sync once per step) ran at 0.84x with 1024 tokens, 1.05x with 1536,
# 1.12x with 2048. fp16 is taken to be bf16's.
SHORT_KEYS = 512
SHORT_KEYS_VARLEN = 1024


def short_keys(facts: CallFacts) -> int:
    """The most keys such a call keeps SDPA with on a GPU."""
    return measured_or_set(SHORT_KEYS_VARLEN if facts.batch_masks or facts.blocks else SHORT_KEYS)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for every other device.

    The one seam of the FA2 kernels: the contract tests (tests/flash_contract_cases.py,
    tests/test_torch_flash_contract.py) replace it to run them on CPU tensors over emulated
    kernels."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def common_reason(device: torch.device, dtype: torch.dtype, head_dim: int, who: str) -> str | None:
    """Why no FA2 implementation runs this call: FA2's dtype and head_dim limits, forward and
    backward, a device with no CUDA GPU, ROCm (where neither runs FA2's own kernels with
    windows as tested here). None where an implementation may; it checks the rest."""
    if dtype not in DTYPES:
        return f"{who} takes fp16 or bf16, not {dtype}"
    if head_dim > MAX_HEAD_DIM or head_dim % 8 != 0:
        return f"{who} takes head_dim <= {MAX_HEAD_DIM} and a multiple of 8, not {head_dim}"
    if device_capability(device) is None:
        return "no CUDA GPU is available" if device.type == "cuda" else f"{who} runs only on CUDA, not {device.type}"
    if torch.version.hip is not None:
        # flash-attn's Triton AMD backend ignores window_size; aten's ROCm kernels are others.
        return f"{who} is not used on ROCm"
    return None


class FA2Calls(Protocol):
    """How one implementation calls FA2's four entry points. Inputs: (B, S, H, D) or (T, H, D),
    last dimension contiguous; K/V with their own (fewer) heads. Dense logsumexp (B, H, Sq),
    varlen (H, T), fp32, contiguous as the kernel reads it."""

    name: str

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None: ...

    def dense_forward(self, q, k, v, left: int, right: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dense_backward(self, dout, q, k, v, out, lse, left: int, right: int, scale: float) -> tuple[torch.Tensor, ...]: ...

    def varlen_forward(self, q, k, v, part: VarlenPass, scale: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def varlen_backward(self, dout, q, k, v, out, lse, part: VarlenPass, scale: float) -> tuple[torch.Tensor, ...]: ...


def window_is_exact(seq_q: int, seq_k: int, left: int, right: int) -> bool:
    """Whether FA2 computes window (left, right) exactly for these lengths.

    Its C++ API turns a side >= seq_k into -1, then an unbounded side into seq_k when the
    other side is bounded (no mask at all when both are unbounded). On the left this never
    changes which keys a row sees. On the right it does when seq_q > seq_k + 1: rows aligned
    before key -1 reach the last key only through a right side wider than seq_k."""
    if seq_q <= seq_k + 1 or 0 <= right < seq_k:
        return True
    if left == UNBOUNDED or left >= seq_k:
        # No mask at all: exact when the first row sees every key anyway.
        return right == UNBOUNDED or right >= seq_q - 1
    return right == seq_k  # clamped to -1, then back to seq_k


class VarlenPass(NamedTuple):
    """One call of FA2's varlen op over gathered tokens of the flattened (B * S) batch.

    Sequence ``j`` is queries ``query_tokens[cu_seqlens_q[j]:cu_seqlens_q[j + 1]]`` against keys
    ``key_tokens[cu_seqlens_k[j]:cu_seqlens_k[j + 1]]``, in that order, under window
    ``(left, right)``. ``kept_rows`` indexes the query rows whose results are kept (the
    others are stand-ins: results dropped, no gradient), None when every row is kept.

    A pass "in place" (both token lists None) runs on the whole flattened batch as it lies,
    with no gather or scatter: its sequences cover every token in order. In a padded batch
    the padding runs are sequences of their own, computed and dropped: only the valid
    tokens' rows are kept (``_varlen_forward``)."""

    query_tokens: torch.Tensor | None  # int64; None: every token, in place
    kept_rows: torch.Tensor | None  # int64 indices into query_tokens
    key_tokens: torch.Tensor | None  # int64; None with query_tokens
    cu_seqlens_q: torch.Tensor  # int32 (sequences + 1,)
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    left: int
    right: int


class VarlenLayout(NamedTuple):
    """The varlen calls that compute a padded or packed batch, every query row once: the
    sequences themselves, then (padding only) the padded rows whose window reaches a sequence."""

    passes: tuple[VarlenPass, ...]


def _to_host(*scalars: torch.Tensor) -> list[int]:
    """Several device scalars in one device-to-host copy: the layout's only host sync."""
    return torch.stack([scalar.to(torch.int64) for scalar in scalars]).tolist()


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return cu_seqlens


# The most padding, as a share of a batch's tokens, for which the sequences' pass runs in place
# (its padding runs computed and dropped) rather than on the valid tokens gathered. Measured on
# an H200 (``benchmarks/gpu_check.py``, padded rows, batch 4, w = 1024, two runs): in place took
# 0.79-0.93 of the gathered time with 1/8 of each row padding, 1.04-1.25 with 1/2. A benchmark
# sets -1 to gather always, 1 for in place always.
IN_PLACE_MOST_PADDING = 0.25


def _self_pass(tokens: torch.Tensor | None, lengths: torch.Tensor, longest: int, left: int, right: int) -> VarlenPass:
    cu_seqlens = _cumulative(lengths)
    return VarlenPass(tokens, None, tokens, cu_seqlens, cu_seqlens, longest, longest, left, right)


class _Beyond(NamedTuple):
    """Padded rows past one end of each row's run of valid tokens that still see some of it,
    on one side: ``rows[b]`` of them, seeing the last ``keys[b]`` valid tokens before them."""

    edge: torch.Tensor  # (B,) the run's last valid position on that side
    rows: torch.Tensor  # (B,)
    keys: torch.Tensor  # (B,)
    direction: int  # +1: rows after the run (right padding); -1: rows before it
    reach: int  # the window side that reaches back to the run: left after it, right before it


def _beyond(edge, counts, seq: int, direction: int, reach: int) -> _Beyond:
    room = (seq - 1 - edge) if direction == 1 else edge
    rows = room if reach == UNBOUNDED else room.clamp(max=reach)
    keys = counts if reach == UNBOUNDED else counts.clamp(max=reach)
    return _Beyond(edge, torch.where(counts > 0, rows, 0), keys, direction, reach)


def _beyond_pass(side: _Beyond, seq: int, rows: int, kept: int, sequences: int, keys_total: int, keys_longest: int):
    """The varlen call for one side's padded rows, or None where no padded row sees a key.
    The sizes come from the layout's one host sync: the most rows a sequence has (``rows``),
    all of them (``kept``), the sequences with any, and their keys (total and most).

    Seen from the run, the padded rows on either side are a sequence's continuation: rows
    after the run in position order, rows before it in reverse order (a window (left, right)
    read backwards is (right, left)). Row ``t`` of the continuation (t = 0 next to the run)
    sees the run's tokens from ``t + 1 - reach`` back. Every sequence gets the same ``rows``
    query rows, stand-ins past its real ones, so that FA2's bottom-right alignment is one
    shift for all: row ``t`` aligned with key ``t + K - rows`` of its ``K`` keys, window
    ``(reach - rows, rows - 1)`` is exactly the row's keys. ``max_seqlen_k`` is at least
    ``rows``, so that FA2's clamp of the right side (to max_seqlen_k) never cuts it."""
    if rows == 0:
        return None
    device = side.edge.device
    chosen = torch.nonzero_static(side.rows > 0, size=sequences).squeeze(1)
    edge, real_rows, keys = side.edge[chosen], side.rows[chosen], side.keys[chosen]
    step = torch.arange(rows, device=device)
    positions = edge[:, None] + side.direction * (1 + step)  # (sequences, rows)
    kept_rows = torch.nonzero_static((step[None, :] < real_rows[:, None]).reshape(-1), size=kept).squeeze(1)
    query_tokens = (chosen[:, None] * seq + positions.clamp(0, seq - 1)).reshape(-1)
    sequence_of_key = torch.repeat_interleave(torch.arange(sequences, device=device), keys, output_size=keys_total)
    cu_seqlens_k = _cumulative(keys)
    offset = torch.arange(keys_total, device=device) - cu_seqlens_k[sequence_of_key].to(torch.int64)
    key_positions = edge[sequence_of_key] - side.direction * (keys[sequence_of_key] - 1 - offset)
    key_tokens = chosen[sequence_of_key] * seq + key_positions
    cu_seqlens_q = torch.arange(sequences + 1, dtype=torch.int32, device=device) * rows
    window = (UNBOUNDED, UNBOUNDED) if side.reach == UNBOUNDED else (side.reach - rows, rows - 1)
    return VarlenPass(
        query_tokens, kept_rows, key_tokens, cu_seqlens_q, cu_seqlens_k, rows, max(keys_longest, rows), *window
    )


def varlen_layout(
    key_padding: torch.Tensor | None, segment_ids: torch.Tensor | None, left: int, right: int
) -> VarlenLayout | None:
    """The varlen calls of self-attention over a padded (key_padding) or packed (segment_ids)
    batch under window (left, right), or None where FA2's varlen op cannot express the mask:
    both given, a row whose valid tokens are not one contiguous run, or segments that are not
    contiguous runs.

    Within a contiguous run, distances between tokens are unchanged by unpadding, so the
    window means the same. A padded query row is computed as SDPA computes it, over the valid
    tokens its window reaches (``_beyond_pass``); one that reaches none is left at zeros.
    Reads the sizes back to the host in one copy (a sync on CUDA)."""
    if (key_padding is None) == (segment_ids is None):
        return None
    some = key_padding if key_padding is not None else segment_ids
    if some.numel() == 0:
        return VarlenLayout(())
    if key_padding is not None:
        seq = key_padding.shape[1]
        counts = key_padding.sum(dim=1)
        positions = torch.arange(seq, device=key_padding.device)
        first = torch.where(key_padding, positions, seq).amin(dim=1)
        last = torch.where(key_padding, positions, -1).amax(dim=1)
        has_hole = ((last - first + 1) != counts) & (counts > 0)
        after = _beyond(last, counts, seq, 1, left)
        before = _beyond(first, counts, seq, -1, right)
        # Each row's runs in place: the padding before its valid run, the run, the padding after.
        runs = torch.stack(
            [torch.where(counts > 0, first, seq), counts, torch.where(counts > 0, seq - 1 - last, 0)], dim=1
        ).reshape(-1)
        sizes = [has_hole.any(), counts.sum(), counts.max(), (counts > 0).sum(), (runs > 0).sum(), runs.max()]
        for side in (after, before):
            reaching = side.rows > 0
            reaching_keys = torch.where(reaching, side.keys, 0)
            sizes += [side.rows.max(), side.rows.sum(), reaching.sum(), reaching_keys.sum(), reaching_keys.max()]
        hole, total, longest, sequences, run_count, longest_run, *beyond_sizes = _to_host(*sizes)
        if hole:
            return None
        if key_padding.numel() - total <= IN_PLACE_MOST_PADDING * key_padding.numel():
            lengths = runs[torch.nonzero_static(runs > 0, size=run_count).squeeze(1)]
            passes = [_self_pass(None, lengths, longest_run, left, right)]
        else:
            tokens = torch.nonzero_static(key_padding.reshape(-1), size=total).squeeze(1)
            lengths = counts[torch.nonzero_static(counts > 0, size=sequences).squeeze(1)]
            passes = [_self_pass(tokens, lengths, longest, left, right)]
        for index, side in enumerate((after, before)):
            extra = _beyond_pass(side, seq, *beyond_sizes[5 * index : 5 * index + 5])
            if extra is not None:
                passes.append(extra)
        return VarlenLayout(tuple(passes))
    batch, seq = segment_ids.shape
    steps = segment_ids.diff(dim=1)
    starts = torch.ones(batch, seq, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = steps != 0
    sequence_of_token = starts.reshape(-1).cumsum(0) - 1
    lengths = torch.zeros(batch * seq, dtype=torch.int64, device=segment_ids.device)
    lengths.scatter_add_(0, sequence_of_token, torch.ones_like(sequence_of_token))
    # A segment id that comes back is not one contiguous run.
    comes_back, sequences, longest = _to_host((steps < 0).any(), starts.sum(), lengths.max())
    if comes_back:
        return None
    return VarlenLayout((_self_pass(None, lengths[:sequences], longest, left, right),))


def image_pass(block_ids: torch.Tensor, key_padding: torch.Tensor | None, left: int, right: int) -> VarlenPass | None:
    """The varlen call computing the rows of image blocks (ids >= 0) under a causal window
    (left, 0), or None where it cannot: a bidirectional window, an id that is not one run of
    tokens, or an image whose keys reach padding other than a row's leading padding.

    Each image [first, last] of a row is one sequence: its rows, against the keys
    [max(first - left, the row's first valid token), last]. FA2 aligns row t (position
    first + t) with key t + K - rows, which is position first + t: window (left, -1) gives it
    the keys [q - left, last], exactly the window OR its image. One host sync."""
    if right != 0:
        return None
    batch, seq = block_ids.shape
    device = block_ids.device
    row, first, last, count = block_extents(block_ids)
    images = len(row)
    if images == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        return VarlenPass(empty, None, empty, zero, zero, 0, 0, left, UNBOUNDED)
    key_start = (first - left).clamp(min=0) if left != UNBOUNDED else torch.zeros_like(first)
    problems = [(count != last - first + 1).any()]
    if key_padding is not None:
        valid = torch.arange(seq, device=device)[None, :].expand(batch, seq)
        run_first = torch.where(key_padding, valid, seq).amin(dim=1)[row]
        run_last = torch.where(key_padding, valid, -1).amax(dim=1)[row]
        holes = (key_padding.sum(dim=1)[row] != run_last - run_first + 1)
        problems += [(holes | (first < run_first) | (last > run_last)).any()]
        key_start = torch.maximum(key_start, run_first)
    query_lengths, key_lengths = last - first + 1, last - key_start + 1
    *problems, tokens, keys, longest_query, longest_key = _to_host(
        *problems, query_lengths.sum(), key_lengths.sum(), query_lengths.max(), key_lengths.max()
    )
    if any(problems):
        return None

    def ranges(starts, lengths, total):
        owner = torch.repeat_interleave(torch.arange(images, device=device), lengths, output_size=total)
        offset = torch.arange(total, device=device) - _cumulative(lengths)[owner].to(torch.int64)
        return row[owner] * seq + starts[owner] + offset

    return VarlenPass(
        ranges(first, query_lengths, tokens), None, ranges(key_start, key_lengths, keys),
        _cumulative(query_lengths), _cumulative(key_lengths), longest_query, longest_key, left, UNBOUNDED,
    )


def with_image_rows(band, images, block_ids, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of the band, with the image rows (``block_ids >= 0``) taken from the
    image pass's; the output written into ``out`` (the layout the op returns)."""
    image_rows = (block_ids >= 0)[:, None, :]
    torch.where(image_rows[..., None], images[0], band[0], out=out)
    return out, torch.where(image_rows, images[1], band[1])


def without_image_rows(logsumexp: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The logsumexp with image rows at +inf: a backward over the band then gives them no
    probability, so no gradient (the image pass gives theirs)."""
    return logsumexp.masked_fill((block_ids >= 0)[:, None, :], float("inf"))


def summed_heads_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, summed in fp32 and rounded once, stored heads-last as every gradient is."""
    batch, heads, seq, dim = a.shape
    total = a.new_empty(batch, seq, heads, dim).transpose(1, 2)
    return total.copy_(a.float() + b.float())


def _gather(x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """(B, H, S, D) -> the given tokens of the flattened batch as (T, H, D), contiguous; every
    token in order for None (a view where x is stored heads-last)."""
    batch, heads, seq, dim = x.shape
    flat = x.transpose(1, 2).reshape(batch * seq, heads, dim)
    return flat if tokens is None else flat[tokens]


def _dropped_rows(key_padding: torch.Tensor | None) -> torch.Tensor | None:
    """(B * S, 1) True at the padding rows of a pass in place, whose results it drops (a
    padding run is a sequence of its own there); None where it keeps every row."""
    return None if key_padding is None else ~key_padding.reshape(-1, 1)


# -- a varlen layout computed once per graph call, shared by the layers ------------------------
#
# The layout (``varlen_layout``) costs a host sync. Where several layers read the same padding
# (or segment ids) under the same window, the rewritten graph computes it once per graph call
# (``compile_pass::varlen_layout``) from the op's own copy of the padding, which nothing
# writes, and hands it to each layer's forward and backward. It travels as two tensors of
# static sizes: the pieces of each pass, zero-filled rows of B * S + 1 entries on the device
# (no pass piece is longer), and a CPU int64 vector of their lengths and scalars, read without
# a sync. A layout made for another batch, length or window is not used.

PIECES = 5  # query tokens, kept rows, key tokens, cu_seqlens_q, cu_seqlens_k
MAX_PASSES = 3  # the sequences, the padded rows after them, those before them
PASS_SIZES = PIECES + 4  # each piece's length (-1: None), then max_seqlen_q, max_seqlen_k, left, right
SKIPPED, NOT_EXPRESSIBLE, COMPUTED = range(3)  # whether the layout was computed, and could be
HEADER = ("status", "batch", "seq", "left", "right", "passes")
NOT_GIVEN = object()


def layout_shapes(batch: int, seq: int) -> tuple[tuple[int, int], tuple[int]]:
    """The (device pieces, CPU sizes) shapes of an encoded layout."""
    return (MAX_PASSES * PIECES, batch * seq + 1), (len(HEADER) + MAX_PASSES * PASS_SIZES,)


def encode_layout(layout: VarlenLayout | None, status: int, device, batch: int, seq: int, left: int, right: int):
    """(pieces, sizes) of a layout, or of none (``status`` SKIPPED or NOT_EXPRESSIBLE)."""
    pieces_shape, sizes_shape = layout_shapes(batch, seq)
    pieces = torch.zeros(pieces_shape, dtype=torch.int64, device=device)
    passes = layout.passes if layout is not None else ()
    fits = all(field is None or field.numel() <= pieces_shape[1] for part in passes for field in part[:PIECES])
    if len(passes) > MAX_PASSES or not fits:  # not so by construction; then each call computes its own
        status, passes = SKIPPED, ()
    sizes = [status, batch, seq, left, right, len(passes)]
    for index, part in enumerate(passes):
        fields = (part.query_tokens, part.kept_rows, part.key_tokens, part.cu_seqlens_q, part.cu_seqlens_k)
        for row, field in enumerate(fields):
            if field is not None:
                pieces[index * PIECES + row, : field.numel()] = field
        sizes += [-1 if field is None else field.numel() for field in fields]
        sizes += [part.max_seqlen_q, part.max_seqlen_k, part.left, part.right]
    sizes += [0] * (sizes_shape[0] - len(sizes))
    return pieces, torch.tensor(sizes, dtype=torch.int64)


def shared_layout(call: AttentionCall) -> VarlenLayout | None | object:
    """The layout handed to this call, decoded: a VarlenLayout, None where its padding has no
    varlen form, or NOT_GIVEN where it was not computed for this call's batch, length and
    window (the call computes its own)."""
    pieces, sizes = call.layout
    some = call.key_padding if call.key_padding is not None else call.segment_ids
    values = sizes.tolist()  # a CPU tensor: no sync
    status, batch, seq, left, right, count = values[: len(HEADER)]
    if status == SKIPPED or (batch, seq, left, right) != (*some.shape, call.left, call.right):
        return NOT_GIVEN
    if status == NOT_EXPRESSIBLE:
        return None
    passes = []
    for index in range(count):
        lengths = values[len(HEADER) + index * PASS_SIZES :][:PASS_SIZES]
        fields = [
            None if length < 0 else pieces[index * PIECES + row, :length]
            for row, length in enumerate(lengths[:PIECES])
        ]
        cu_seqlens = [field.to(torch.int32) for field in fields[3:]]
        passes.append(VarlenPass(*fields[:3], *cu_seqlens, *lengths[PIECES:]))
    return VarlenLayout(tuple(passes))


class FA2Plan(NamedTuple):
    """How FA2 computes one call: dense (``layout`` None) or the layout's varlen calls, then,
    with image blocks, their rows by one more varlen call (``images``)."""

    layout: VarlenLayout | None
    images: VarlenPass | None


class FA2Kernel:
    """The sliding-window op on one FA2 implementation. Exact for every window FA2's clamp
    leaves unchanged, key padding whose valid tokens are one run per row (left or right
    padding, transformers' packing), segments that are runs, and image blocks of one run each
    under a causal window; ``plan`` returns None for the rest, which the next kernel runs."""

    def __init__(self, calls: FA2Calls):
        self.calls = calls
        self.name = calls.name

    def __repr__(self) -> str:
        return f"FA2Kernel({self.name})"

    def describe(self, facts: CallFacts) -> str:
        kernel = self.name + (" varlen" if facts.batch_masks else "")
        return kernel + (f", image rows by {self.name} varlen" if facts.blocks else "")

    def cannot(self, facts: CallFacts) -> str | None:
        missing = self.calls.unavailable_reason(facts.device, facts.dtype, facts.head_dim)
        if missing is not None:
            return missing
        if facts.key_padding and facts.segment_ids:
            return f"{self.name}'s varlen op takes key padding or segment ids, not both"
        if facts.batch_masks and not facts.same_lengths:
            return f"{self.name} runs key padding or segment ids as varlen calls for Sq == Sk only"
        return None

    def slower(self, facts: CallFacts) -> str | None:
        return band_skips_little(facts) or short_call(facts, short_keys(facts))

    def plan(self, call: AttentionCall) -> FA2Plan | None:
        query, key = call.query, call.key
        seq_q, seq_k = query.shape[2], key.shape[2]
        images = None
        if call.block_ids is not None:
            images = image_pass(call.block_ids, call.key_padding, call.left, call.right)
            if images is None:
                return None
        if call.key_padding is None and call.segment_ids is None:
            return FA2Plan(None, images) if window_is_exact(seq_q, seq_k, call.left, call.right) else None
        if seq_q != seq_k:
            return None
        layout = shared_layout(call) if call.layout is not None else NOT_GIVEN
        if layout is NOT_GIVEN:
            layout = varlen_layout(call.key_padding, call.segment_ids, call.left, call.right)
        return None if layout is None else FA2Plan(layout, images)

    def forward(self, call: AttentionCall, plan: FA2Plan):
        query, key, value = call.query, call.key, call.value
        if plan.layout is None:
            band = _dense_forward(self.calls, query, key, value, call.left, call.right, call.scale)
        else:
            band = _varlen_forward(self.calls, query, key, value, call.scale, plan.layout, call.key_padding)
        if plan.images is None:
            return band
        images = _varlen_forward(self.calls, query, key, value, call.scale, VarlenLayout((plan.images,)))
        return with_image_rows(band, images, call.block_ids, empty_like_heads_last(query))

    def backward(self, call: AttentionCall, plan: FA2Plan, grad_out, out, logsumexp):
        query, key, value = call.query, call.key, call.value
        # Image rows get their gradients from the image pass alone: none from the band's.
        band_lse = logsumexp if plan.images is None else without_image_rows(logsumexp, call.block_ids)
        if plan.layout is None:
            grads = _dense_backward(self.calls, grad_out, query, key, value, out, band_lse, call.left, call.right, call.scale)
        else:
            grads = _varlen_backward(
                self.calls, grad_out, query, key, value, out, band_lse, call.scale, plan.layout, call.key_padding
            )
        if plan.images is None:
            return grads
        layout = VarlenLayout((plan.images,))
        image_grads = _varlen_backward(self.calls, grad_out, query, key, value, out, logsumexp, call.scale, layout)
        return tuple(summed_heads_last(a, b) for a, b in zip(grads, image_grads))


def _dense_forward(calls: FA2Calls, query, key, value, left, right, scale):
    """(B, H, S, D) in (last dimension contiguous); heads-last out and (B, H, Sq) fp32 logsumexp."""
    q = query.transpose(1, 2).contiguous()  # FA2's out is empty_like(q): heads-last
    out, logsumexp = calls.dense_forward(q, key.transpose(1, 2), value.transpose(1, 2), left, right, scale)
    return out.transpose(1, 2), logsumexp


def _dense_backward(calls: FA2Calls, grad_out, query, key, value, out, logsumexp, left, right, scale):
    dout, q, k, v, o = (x.transpose(1, 2) for x in (grad_out, query, key, value, out))
    grads = calls.dense_backward(dout, q, k, v, o, logsumexp.contiguous(), left, right, scale)
    return tuple(grad.transpose(1, 2) for grad in grads)  # (B, S, H, D) buffers: heads-last


def _no_rows_computed(query) -> tuple[torch.Tensor, torch.Tensor]:
    """(B * S, H, D) zeros and a (B * S, H) logsumexp of +inf: what a row no pass computes gets."""
    batch, heads, seq, dim = query.shape
    out = query.new_zeros(batch * seq, heads, dim)
    return out, torch.full((batch * seq, heads), float("inf"), dtype=torch.float32, device=query.device)


def _varlen_forward(calls: FA2Calls, query, key, value, scale, layout: VarlenLayout, key_padding=None):
    """Self-attention over a padded or packed batch with an FA2 implementation's varlen op, one
    call per pass of the layout. Rows no pass computes (padding that sees no key) get zeros and
    a logsumexp of +inf; a pass with no tokens is not called (FA2 rejects a batch of zero
    sequences). A pass in place comes first: its output is the buffer the others write into."""
    batch, heads, seq, dim = query.shape
    out = logsumexp = None  # (B * S, H, D) and (B * S, H)
    for part in layout.passes:
        if part.query_tokens is None:
            q = _gather(query, None).contiguous()  # FA2's out is empty_like(q): contiguous
            out, token_lse = calls.varlen_forward(q, _gather(key, None), _gather(value, None), part, scale)
            logsumexp = token_lse.t()
            dropped = _dropped_rows(key_padding)
            if dropped is not None:
                out.masked_fill_(dropped[..., None], 0)
                logsumexp = logsumexp.masked_fill(dropped, float("inf"))
            continue
        if out is None:
            out, logsumexp = _no_rows_computed(query)
        if not part.query_tokens.numel():
            continue
        q = _gather(query, part.query_tokens)
        k, v = (_gather(x, part.key_tokens) for x in (key, value))
        token_out, token_lse = calls.varlen_forward(q, k, v, part, scale)
        rows, token_lse = part.query_tokens, token_lse.t()
        if part.kept_rows is not None:
            rows, token_out, token_lse = (x[part.kept_rows] for x in (rows, token_out, token_lse))
        out[rows] = token_out
        logsumexp[rows] = token_lse
    if out is None:  # no passes: an empty batch
        out, logsumexp = _no_rows_computed(query)
    return out.view(batch, seq, heads, dim).transpose(1, 2), logsumexp.reshape(batch, seq, heads).permute(0, 2, 1).contiguous()


def _varlen_backward(calls: FA2Calls, grad_out, query, key, value, out, logsumexp, scale, layout: VarlenLayout, key_padding=None):
    """Gradients of ``_varlen_forward``: each pass's FA2 backward, query gradients written
    at its kept rows, key/value gradients of several passes summed in fp32 (the padded rows'
    passes read keys the sequences' pass reads too). Dropped rows get a logsumexp of +inf:
    no probability, so exactly no gradient from them."""
    batch, heads, seq, dim = query.shape
    grad_q = None  # (B * S, H, D)
    grad_kv = None  # in place: in the inputs' dtype; summed over passes: fp32
    lse_by_token = logsumexp.transpose(1, 2).reshape(batch * seq, heads)
    for part in layout.passes:
        if part.query_tokens is None:
            dropped = _dropped_rows(key_padding)
            lse = lse_by_token if dropped is None else lse_by_token.masked_fill(dropped, float("inf"))
            dout, q, o, k, v = (_gather(x, None) for x in (grad_out, query, out, key, value))
            grad_q, *grad_kv = calls.varlen_backward(dout, q, k, v, o, lse.t().contiguous(), part, scale)
            continue
        if grad_q is None:
            grad_q = query.new_zeros(batch * seq, heads, dim)
        if grad_kv is None:
            grad_kv = [x.new_zeros(batch * seq, x.shape[1], dim, dtype=torch.float32) for x in (key, value)]
        elif grad_kv[0].dtype != torch.float32:  # the pass in place's, from here summed in fp32
            grad_kv = [grad.float() for grad in grad_kv]
        if not part.query_tokens.numel():
            continue
        dout, q, o = (_gather(x, part.query_tokens) for x in (grad_out, query, out))
        k, v = (_gather(x, part.key_tokens) for x in (key, value))
        lse = lse_by_token[part.query_tokens]
        if part.kept_rows is not None:  # stand-in rows: no probability, no gradient
            dout = torch.zeros_like(dout).index_copy_(0, part.kept_rows, dout[part.kept_rows])
            lse = torch.full_like(lse, float("inf")).index_copy_(0, part.kept_rows, lse[part.kept_rows])
        token_grads = calls.varlen_backward(dout, q, k, v, o, lse.t().contiguous(), part, scale)  # (H, T), as FA2 reads it
        rows, token_dq = part.query_tokens, token_grads[0]
        if part.kept_rows is not None:
            rows, token_dq = rows[part.kept_rows], token_dq[part.kept_rows]
        grad_q[rows] = token_dq
        for full, tokens in zip(grad_kv, token_grads[1:]):
            full.index_add_(0, part.key_tokens, tokens.float())
    if grad_q is None:  # no passes: an empty batch
        grad_q = query.new_zeros(batch * seq, heads, dim)
        grad_kv = [x.new_zeros(batch * seq, x.shape[1], dim) for x in (key, value)]
    grad_k, grad_v = (
        full.to(x.dtype).reshape(batch, seq, x.shape[1], dim).transpose(1, 2) for full, x in zip(grad_kv, (key, value))
    )
    return grad_q.reshape(batch, seq, heads, dim).transpose(1, 2), grad_k, grad_v
