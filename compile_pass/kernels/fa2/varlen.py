"""FA2's varlen calls of a batch, for every implementation of its kernels (``fa2.py``): how a
padded, packed or image batch becomes calls of FA2's varlen op over the flattened batch's
tokens (``varlen_layout``, ``image_pass``), and such a layout encoded so that a graph call
computes it once for every layer that reads the same masks (``compile_pass::varlen_layout``,
``encode_layout``, ``shared_layout``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...window import UNBOUNDED
from ..contract import AttentionCall
from ..layout import block_extents


class VarlenPass(NamedTuple):
    """One call of FA2's varlen op over gathered tokens of the flattened (B * S) batch.

    Sequence ``j`` is queries ``query_tokens[cu_seqlens_q[j]:cu_seqlens_q[j + 1]]`` against keys
    ``key_tokens[cu_seqlens_k[j]:cu_seqlens_k[j + 1]]``, in that order, under window
    ``(left, right)``. ``kept_rows`` indexes the query rows whose results are kept (the
    others are stand-ins: results dropped, no gradient), None when every row is kept.

    A pass "in place" (both token lists None) runs on the whole flattened batch as it lies,
    with no gather or scatter: its sequences cover every token in order. In a padded batch
    the padding runs are sequences of their own, computed and dropped: only the valid
    tokens' rows are kept (``fa2._varlen_forward``)."""

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


def padding_runs(key_padding: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(first, last, counts, has_hole), each (B,), of a (B, S) bool padding: each row's first and
    last valid position (S and -1 where it has none), how many valid tokens it has, and whether
    they are not one contiguous run. On the padding's device, no host sync."""
    seq = key_padding.shape[1]
    counts = key_padding.sum(dim=1)
    positions = torch.arange(seq, device=key_padding.device)
    first = torch.where(key_padding, positions, seq).amin(dim=1)
    last = torch.where(key_padding, positions, -1).amax(dim=1)
    return first, last, counts, ((last - first + 1) != counts) & (counts > 0)


def segment_runs(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
    """(lengths, sequences, longest) of the runs of equal ids of a (B, S) tensor, every row's
    runs in order over the flattened batch (a run never crosses rows): ``lengths[:sequences]``
    are the runs' lengths. None where an id comes back after another (not one run per id).
    One host sync."""
    batch, seq = segment_ids.shape
    # Compared, not subtracted: ids are data, and their differences can wrap.
    before, after = segment_ids[:, :-1], segment_ids[:, 1:]
    starts = torch.ones(batch, seq, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = after != before
    sequence_of_token = starts.reshape(-1).cumsum(0) - 1
    lengths = torch.zeros(batch * seq, dtype=torch.int64, device=segment_ids.device)
    lengths.scatter_add_(0, sequence_of_token, torch.ones_like(sequence_of_token))
    # Ids that never decrease along a row are runs: one that decreases may come back.
    comes_back, sequences, longest = _to_host((after < before).any(), starts.sum(), lengths.max())
    return None if comes_back else (lengths, sequences, longest)


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
        first, last, counts, has_hole = padding_runs(key_padding)
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
    runs = segment_runs(segment_ids)
    if runs is None:
        return None
    lengths, sequences, longest = runs
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
        holes = key_padding.sum(dim=1)[row] != run_last - run_first + 1
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
        ranges(first, query_lengths, tokens),
        None,
        ranges(key_start, key_lengths, keys),
        _cumulative(query_lengths),
        _cumulative(key_lengths),
        longest_query,
        longest_key,
        left,
        UNBOUNDED,
    )


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


def encode_layout(
    layout: VarlenLayout | None, status: int, device: torch.device, batch: int, seq: int, left: int, right: int
) -> tuple[torch.Tensor, torch.Tensor]:
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
            None if length < 0 else pieces[index * PIECES + row, :length] for row, length in enumerate(lengths[:PIECES])
        ]
        cu_seqlens = [field.to(torch.int32) for field in fields[3:]]
        passes.append(VarlenPass(*fields[:3], *cu_seqlens, *lengths[PIECES:]))
    return VarlenLayout(tuple(passes))
