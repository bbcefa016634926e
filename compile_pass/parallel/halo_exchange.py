"""What the ranks of a context-parallel group send each other (``context_parallel.py``):
each chunk's halo of keys and values (and of per-position padding and document ids), point to
point for a bounded window and all-gathered for an unbounded one, the halo gradients sent back
to the ranks holding those positions, and the packed-sequence ids of the whole sequence.

``exchanges()`` records the bytes each call sends, for the benchmark and tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..window import POSITION_RANGE, UNBOUNDED
from .shard_layout import Layout, group_place, halo_hops, halo_pieces, held_chunk


@dataclass
class ExchangeLog:
    """Bytes this rank sent, by kind ("halo", "halo gradients", "all-gather", "all-reduce"),
    and the CPU seconds its thread spent in the attention of its chunks, forward and backward
    (the work the layout balances; CPU time, so ranks sharing cores are measured alike)."""

    sent: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    attention_seconds: float = 0.0

    def add(self, kind: str, count: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + count


_LOG: contextvars.ContextVar[ExchangeLog | None] = contextvars.ContextVar("compile_pass_exchange_log", default=None)


@contextlib.contextmanager
def exchanges():
    """Record the bytes the context-parallel ops of this block send: ``with exchanges() as log``."""
    log = ExchangeLog()
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def record(kind: str, tensors) -> None:
    """Counts the bytes of ``tensors`` as sent, under ``kind``, inside ``exchanges()``."""
    log = _LOG.get()
    if log is not None:
        log.add(kind, sum(t.numel() * t.element_size() for t in tensors))


@contextlib.contextmanager
def attention_time():
    """Counts the block's CPU seconds as attention, inside ``exchanges()``."""
    log = _LOG.get()
    started = time.thread_time() if log is not None else 0.0
    yield
    if log is not None:
        log.attention_seconds += time.thread_time() - started


def _point_to_point(
    group: dist.ProcessGroup, sends: list[tuple[int, int, torch.Tensor]], receives: list[tuple[int, int, torch.Tensor]]
) -> None:
    """Every (peer, tag, tensor) send and receive at once, then wait: a message is matched by
    its peer (a rank in ``group``) and tag (chunk, hop and tensor), whatever the order."""
    requests = [dist.isend(tensor.contiguous(), group=group, group_dst=peer, tag=tag) for peer, tag, tensor in sends]
    requests += [dist.irecv(tensor, group=group, group_src=peer, tag=tag) for peer, tag, tensor in receives]
    for request in requests:
        if request is None:  # what isend/irecv give a rank outside the group
            raise RuntimeError("context parallel: this rank is not in the process group")
        request.wait()


def _tag(layout: Layout, target: int, hop: int, index: int) -> int:
    """A message's tag: the chunk it goes to, the hop it makes and which tensor it carries."""
    return (target * layout.chunks + hop) * 8 + index


def _all_chunks(group: dist.ProcessGroup, layout: Layout, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every chunk of the sequence, in the sequence's order, from an all-gather of the shards."""
    rank, world = group_place(group)
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    record("all-gather", [tensor] * (world - 1))
    chunk = layout.chunk_length(tensor.shape[2])
    return [held_chunk(gathered[holder], place, chunk) for holder, place in map(layout.holder, range(layout.chunks))]


def exchange_halos(
    group: dist.ProcessGroup, layout: Layout, tensors: list[torch.Tensor], left: int
) -> list[list[torch.Tensor]]:
    """For each of this rank's chunks, the halo of each (B, H, L, ...) tensor along dim 2: the
    positions before the chunk that the window reaches, oldest first."""
    rank, _ = group_place(group)
    chunk = layout.chunk_length(tensors[0].shape[2])
    held = layout.held(rank)
    if left == UNBOUNDED:
        every = [_all_chunks(group, layout, tensor) for tensor in tensors]
        return [
            [_joined_along_sequence(chunks[:target], tensor) for chunks, tensor in zip(every, tensors, strict=True)]
            for target in held
        ]
    sends, receives, pieces = [], [], {}
    for place, source in enumerate(held):  # what this rank's chunks give the chunks after them
        for h, n in halo_hops(chunk, left, layout.chunks):
            target = source + h
            if target >= layout.chunks or layout.holder(target)[0] == rank:
                continue
            for index, tensor in enumerate(tensors):
                sends.append(
                    (
                        layout.holder(target)[0],
                        _tag(layout, target, h, index),
                        held_chunk(tensor, place, chunk)[:, :, chunk - n :],
                    )
                )
    for target in held:  # what they take from the chunks before them
        for h, n in halo_pieces(layout, chunk, left, target):
            holder, place = layout.holder(target - h)
            for index, tensor in enumerate(tensors):
                if holder == rank:
                    pieces[target, h, index] = held_chunk(tensor, place, chunk)[:, :, chunk - n :]
                else:
                    buffer = tensor.new_empty(*tensor.shape[:2], n, *tensor.shape[3:])
                    receives.append((holder, _tag(layout, target, h, index), buffer))
                    pieces[target, h, index] = buffer
    record("halo", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    return [
        [
            _joined_along_sequence(
                [pieces[target, h, index] for h, _ in reversed(halo_pieces(layout, chunk, left, target))], tensor
            )
            for index, tensor in enumerate(tensors)
        ]
        for target in held
    ]


def _joined_along_sequence(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The pieces one after the other along dim 2; none (the first chunk): a tensor of its
    own with no positions, not a view of an input."""
    if not pieces:
        return like.new_empty(*like.shape[:2], 0, *like.shape[3:])
    return torch.cat(pieces, dim=2)


def return_halo_gradients(
    group: dist.ProcessGroup,
    layout: Layout,
    halo_grads: list[list[torch.Tensor]],
    local_grads: list[torch.Tensor],
    left: int,
) -> None:
    """Sends each chunk's halo gradients (``halo_grads[place][index]``, oldest first) to the
    ranks holding those positions and adds the gradients this rank's positions receive, its
    own included, to ``local_grads`` (in place)."""
    rank, _ = group_place(group)
    chunk = layout.chunk_length(local_grads[0].shape[2])
    held = layout.held(rank)
    if left == UNBOUNDED:
        for index, local in enumerate(local_grads):
            whole = local.new_zeros(*local.shape[:2], layout.chunks * chunk, *local.shape[3:])
            for target, grads in zip(held, halo_grads, strict=True):
                whole[:, :, : target * chunk] += grads[index]
            dist.all_reduce(whole, group=group)
            record("all-reduce", [whole])
            for place, source in enumerate(held):
                held_chunk(local, place, chunk).add_(held_chunk(whole, source, chunk))
        return
    sends, receives, targets = [], [], []
    for target, grads in zip(held, halo_grads, strict=True):  # gradients of the halos this rank took
        offset = 0
        for h, n in reversed(halo_pieces(layout, chunk, left, target)):  # the halo holds the farthest hop first
            holder, place = layout.holder(target - h)
            for index, grad in enumerate(grads):
                piece = grad[:, :, offset : offset + n]
                if holder == rank:
                    held_chunk(local_grads[index], place, chunk)[:, :, chunk - n :] += piece
                else:
                    sends.append((holder, _tag(layout, target, h, index), piece))
            offset += n
    for place, source in enumerate(held):  # gradients of the halos this rank's chunks gave
        for h, n in halo_hops(chunk, left, layout.chunks):
            target = source + h
            if target >= layout.chunks or layout.holder(target)[0] == rank:
                continue
            for index, local in enumerate(local_grads):
                buffer = local.new_empty(*local.shape[:2], n, *local.shape[3:])
                receives.append((layout.holder(target)[0], _tag(layout, target, h, index), buffer))
                targets.append((held_chunk(local, place, chunk)[:, :, chunk - n :], buffer))
    record("halo gradients", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    for destination, buffer in targets:
        destination += buffer


def global_segment_ids(group: dist.ProcessGroup, layout: Layout, positions: torch.Tensor) -> torch.Tensor:
    """The whole sequence's packed-sequence ids at this rank's positions, (B, L) int64: a
    position starts a sequence where its position id is not the one before it plus 1 (the
    sequence's first position never does), and a position's id counts the starts up to it
    (transformers' ``find_packed_sequence_indices`` over the whole sequence). Each rank
    all-gathers every chunk's first and last position id and count of starts inside it, and
    whether its positions lie in POSITION_RANGE, where the rule's proof holds: if any rank's do
    not, every rank raises."""
    rank, world = group_place(group)
    chunk = layout.chunk_length(positions.shape[1])
    if chunk == 0:
        raise ValueError("context parallel with packed sequences needs at least one position in each chunk")
    positions = positions.to(torch.int64)
    low, high = POSITION_RANGE
    inside = ((positions >= low) & (positions < high)).all()
    pieces = [positions[:, place * chunk : (place + 1) * chunk] for place in range(len(layout.held(rank)))]
    starts = [piece[:, 1:] != piece[:, :-1] + 1 for piece in pieces]
    summary = torch.stack(
        [torch.stack([p[:, 0], p[:, -1], s.sum(1)]) for p, s in zip(pieces, starts, strict=True)]
    )  # (held, 3, B)
    summary = torch.cat([summary.flatten(), inside.to(torch.int64)[None]])
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary, group=group)
    record("packed-sequence summary", [summary] * (world - 1))
    if not all(bool(each[-1]) for each in gathered):
        raise ValueError(
            f"context parallel with packed sequences: position ids outside [{low}, {high}) on some rank, where the "
            "mask's proof does not hold"
        )
    first, last, count = (
        torch.stack(
            [
                gathered[holder][:-1].view(-1, 3, positions.shape[0])[place, field]
                for holder, place in map(layout.holder, range(layout.chunks))
            ]
        )
        for field in range(3)
    )  # (chunks, B) each, in the sequence's order
    boundary = torch.zeros_like(first)
    boundary[1:] = (first[1:] != last[:-1] + 1).to(torch.int64)
    before = torch.cumsum(boundary + count, 0) - count  # starts up to each chunk's first position
    return torch.cat(
        [
            before[target][:, None] + torch.nn.functional.pad(torch.cumsum(s.to(torch.int64), 1), (1, 0))
            for target, s in zip(layout.held(rank), starts, strict=True)
        ],
        dim=1,
    )


def _as_keys(rows: torch.Tensor) -> torch.Tensor:
    """A (B, L) tensor of per-position values, shaped (B, 1, L, 1) like the keys to travel with
    them (as bytes or int64: gloo has no bool)."""
    return (rows.to(torch.uint8) if rows.dtype == torch.bool else rows)[:, None, :, None]


def exchange(group, chunks: Layout, key, value, window_left: int, key_padding, positions):
    """(each chunk's halo [keys, values, ...], each chunk's halo padding, each chunk's halo
    segment ids or None, the shard's segment ids or None): what the other ranks send."""
    batch = key.shape[0]
    ids = None if positions is None else global_segment_ids(group, chunks, positions.expand(batch, -1))
    extra = [_as_keys(rows) for rows in (key_padding, ids) if rows is not None]
    halos = exchange_halos(group, chunks, [key, value, *extra], window_left)
    halo_padding = [
        halo[2][:, 0, :, 0].bool()
        if key_padding is not None
        else torch.ones(batch, halo[0].shape[2], dtype=torch.bool, device=key.device)
        for halo in halos
    ]
    halo_ids = [halo[-1][:, 0, :, 0] for halo in halos] if ids is not None else [None] * len(halos)
    return halos, halo_padding, halo_ids, ids
