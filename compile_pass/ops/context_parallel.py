"""Context parallelism: causal (sliding or full) attention over a sequence sharded across the
ranks of one process group (the default group, or the context-parallel dimension of a
DeviceMesh), each rank holding a shard of L positions, the same L on every rank.

The sequence is cut into equal chunks, and each rank holds some of them, in a layout:
- ``contiguous``: P chunks, rank r holds chunk r (global positions [r L, (r + 1) L));
- ``head-tail``: 2P chunks of L / 2, rank r holds chunks r and 2P - 1 - r, in that order
  (torch's load balancing for causal attention: every rank has the same causal work, where
  contiguous shards give the last rank P times the first's).
A causal window (left, 0) needs, besides a chunk's own keys, the ``left`` keys before it (its
*halo*), which lie in the chunks before it:
- a bounded window takes them point to point: hop h brings chunk m the last
  min(c, left - (h - 1) c) keys and values of chunk m - h (chunks of c positions), for
  h = 1 .. min(ceil(left / c), m), from whichever rank holds that chunk (itself included);
- an unbounded window (a full-attention layer) all-gathers the keys and values: every earlier
  chunk is its halo.
The op then runs the sliding-window op on each chunk's queries against halo + the chunk's keys
(FA2's bottom-right alignment puts query i on key i + halo, its own position). The backward
sends each halo key's and value's gradient back to the rank holding it, which adds it to its own.

Ranks here are ranks within the group; the op names its group by ``group_name``, as torch's
functional collectives do, so a compiled graph holds a string and not a process group.

``exchanges()`` records the bytes each call sends, for the benchmark and tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from ..window import POSITION_RANGE, UNBOUNDED
from .layout import accumulation_dtype, check_scale, check_sinks, empty_like_heads_last, new_logsumexp
from .registration import define_op
from .sinks import apply_sinks, sink_gradients
from .window_attention import sliding_window_attention_backward, sliding_window_attention_forward


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


def _record(kind: str, tensors) -> None:
    log = _LOG.get()
    if log is not None:
        log.add(kind, sum(t.numel() * t.element_size() for t in tensors))


@contextlib.contextmanager
def _attention_time():
    log = _LOG.get()
    started = time.thread_time() if log is not None else 0.0
    yield
    if log is not None:
        log.attention_seconds += time.thread_time() - started


def group_name(setting) -> str | bool:
    """The ``context_parallel`` setting as the op names its group: False (off), True (the
    default group, resolved once torch.distributed is initialised), or the name of the group
    given as a ``ProcessGroup`` or a one-dimensional ``DeviceMesh`` (``mesh["cp"]``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(setting, (bool, str)):  # a string: a group's name already
        return setting
    if isinstance(setting, DeviceMesh):
        if setting.ndim != 1:
            names = setting.mesh_dim_names or ()
            example = f'mesh["{names[-1]}"]' if names else "mesh[name]"
            raise ValueError(
                f"context_parallel takes one dimension of a DeviceMesh (e.g. {example}), got a mesh of {setting.ndim} "
                f"dimensions {names}"
            )
        setting = setting.get_group()
    if isinstance(setting, dist.ProcessGroup):
        return setting.group_name
    raise ValueError(
        f"context_parallel takes True or False, a ProcessGroup or one dimension of a DeviceMesh, got {setting!r}"
    )


def process_group(name: str | bool) -> dist.ProcessGroup:
    """The group a ``group_name`` value names (True: the default group)."""
    if name is True:
        return dist.group.WORLD
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_place(group: dist.ProcessGroup) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _check_place(
    group: dist.ProcessGroup, rank: int, world: int, seq: int, layout: "Layout", problem: str | None = None,
    agreed: tuple[int, ...] = (),
) -> None:
    """The op was traced for this rank of a group of this size, and every rank holds a shard
    of ``seq`` positions (one collective of a few integers) that splits into its layout's
    chunks, no rank has a ``problem`` with its call, and every rank has the same ``agreed``
    values (what it read at run time that decides the messages): anything else would pair halo
    messages of other lengths, or halos traced for another rank. Where one rank cannot go on,
    every rank raises."""
    here = group_place(group)
    if (rank, world) != here:
        raise RuntimeError(f"context parallel: traced for rank {rank} of {world}, running as rank {here[0]} of {here[1]}")
    values = (seq, *agreed)
    checks = torch.tensor([problem is not None, *values, *(-value for value in values)], dtype=torch.int64)
    dist.all_reduce(checks, op=dist.ReduceOp.MAX, group=group)
    _record("shard-length check", [checks])
    if checks[0]:
        raise ValueError(f"context parallel: {problem or 'another rank of the group cannot run this call (its error says why)'}")
    highest, lowest = checks[1 : 1 + len(values)].tolist(), [-value for value in checks[1 + len(values) :].tolist()]
    if highest[0] != lowest[0]:
        raise ValueError(f"context parallel needs shards of equal length; they range from {lowest[0]} to {highest[0]}")
    if highest != lowest:
        raise ValueError(
            "context parallel: the ranks' masks were certified with different windows, padding or packed documents"
        )
    held = len(layout.held(rank))
    if seq % held:  # the same on every rank: each raises
        raise ValueError(f"context parallel in the {layout.name} layout needs shards of a multiple of {held} positions, got {seq}")


CONTIGUOUS, HEAD_TAIL = "contiguous", "head-tail"
LAYOUTS = (CONTIGUOUS, HEAD_TAIL)


@dataclass(frozen=True)
class Layout:
    """Which chunks of the sequence each of ``world`` ranks holds (see the module's docstring)."""

    name: str
    world: int

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"context parallel layout {self.name!r}: one of {', '.join(LAYOUTS)}")

    @property
    def chunks(self) -> int:
        return self.world if self.name == CONTIGUOUS else 2 * self.world

    def held(self, rank: int) -> tuple[int, ...]:
        """The chunks ``rank`` holds, in its shard's order."""
        return (rank,) if self.name == CONTIGUOUS else (rank, 2 * self.world - 1 - rank)

    def holder(self, chunk: int) -> tuple[int, int]:
        """(the rank holding ``chunk``, its place among that rank's chunks)."""
        if self.name == CONTIGUOUS or chunk < self.world:
            return chunk, 0
        return 2 * self.world - 1 - chunk, 1

    def chunk_length(self, seq):
        """Positions a chunk has on a shard of ``seq``."""
        return seq // len(self.held(0))

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """``rank``'s shard of a whole-sequence ``tensor`` along ``dim``, as the op expects it."""
        pieces = tensor.chunk(self.chunks, dim)
        if tensor.shape[dim] % self.chunks:
            raise ValueError(f"a sequence of {tensor.shape[dim]} does not split into {self.chunks} equal chunks")
        return torch.cat([pieces[chunk] for chunk in self.held(rank)], dim)


def shard_sequence(tensor: torch.Tensor, dim: int, group=True, layout: str = CONTIGUOUS) -> torch.Tensor:
    """This process's shard of a whole-sequence ``tensor`` (input_ids, labels, positions, the
    attention mask) along ``dim``, for the ranks of ``group`` in ``layout``."""
    resolved = process_group(group_name(group))
    rank, world = group_place(resolved)
    return Layout(layout, world).shard(tensor, dim, rank).contiguous()


def halo_length(seq, left: int, rank: int, layout: Layout):
    """Keys before rank ``rank``'s chunks, on shards of ``seq`` positions, that a causal window
    (left, 0) reaches: the length of its halo, the chunks' halos one after the other."""
    chunk = layout.chunk_length(seq)
    before = [index * chunk for index in layout.held(rank)]
    return sum(length if left == UNBOUNDED else torch.sym_min(left, length) for length in before)


def halo_hops(chunk: int, left: int, chunks: int) -> list[tuple[int, int]]:
    """(h, n): hop h brings a chunk the last n positions of the chunk h before it, for chunks
    of ``chunk`` positions; no more hops than there are other chunks, however wide the window."""
    if chunk == 0:
        return []
    return [(h, min(chunk, left - (h - 1) * chunk)) for h in range(1, min(math.ceil(left / chunk), chunks - 1) + 1)]


def _pieces(layout: Layout, chunk: int, left: int, target: int) -> list[tuple[int, int]]:
    """(h, n) for the halo of chunk ``target``: the hops that reach a chunk before it."""
    if left == UNBOUNDED:
        return [(h, chunk) for h in range(1, target + 1)]
    return [(h, n) for h, n in halo_hops(chunk, left, layout.chunks) if h <= target]


def _point_to_point(group: dist.ProcessGroup, sends: list[tuple[int, int, torch.Tensor]], receives: list[tuple[int, int, torch.Tensor]]) -> None:
    """Every (peer, tag, tensor) send and receive at once, then wait: a message is matched by
    its peer (a rank in ``group``) and tag (chunk, hop and tensor), whatever the order."""
    requests = [dist.isend(tensor.contiguous(), group=group, group_dst=peer, tag=tag) for peer, tag, tensor in sends]
    requests += [dist.irecv(tensor, group=group, group_src=peer, tag=tag) for peer, tag, tensor in receives]
    for request in requests:
        request.wait()


def _tag(layout: Layout, target: int, hop: int, index: int) -> int:
    """A message's tag: the chunk it goes to, the hop it makes and which tensor it carries."""
    return (target * layout.chunks + hop) * 8 + index


def _chunk(tensor: torch.Tensor, place: int, chunk: int) -> torch.Tensor:
    return tensor[:, :, place * chunk : (place + 1) * chunk]


def _all_chunks(group: dist.ProcessGroup, layout: Layout, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every chunk of the sequence, in the sequence's order, from an all-gather of the shards."""
    rank, world = group_place(group)
    gathered = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    _record("all-gather", [tensor] * (world - 1))
    chunk = layout.chunk_length(tensor.shape[2])
    return [_chunk(gathered[holder], place, chunk) for holder, place in map(layout.holder, range(layout.chunks))]


def _halos(group: dist.ProcessGroup, layout: Layout, tensors: list[torch.Tensor], left: int) -> list[list[torch.Tensor]]:
    """For each of this rank's chunks, the halo of each (B, H, L, ...) tensor along dim 2: the
    positions before the chunk that the window reaches, oldest first."""
    rank, _ = group_place(group)
    chunk = layout.chunk_length(tensors[0].shape[2])
    held = layout.held(rank)
    if left == UNBOUNDED:
        every = [_all_chunks(group, layout, tensor) for tensor in tensors]
        return [[_joined_along_sequence(chunks[:target], tensor) for chunks, tensor in zip(every, tensors)] for target in held]
    sends, receives, pieces = [], [], {}
    for place, source in enumerate(held):  # what this rank's chunks give the chunks after them
        for h, n in halo_hops(chunk, left, layout.chunks):
            target = source + h
            if target >= layout.chunks or layout.holder(target)[0] == rank:
                continue
            for index, tensor in enumerate(tensors):
                sends.append((layout.holder(target)[0], _tag(layout, target, h, index), _chunk(tensor, place, chunk)[:, :, chunk - n :]))
    for target in held:  # what they take from the chunks before them
        for h, n in _pieces(layout, chunk, left, target):
            holder, place = layout.holder(target - h)
            for index, tensor in enumerate(tensors):
                if holder == rank:
                    pieces[target, h, index] = _chunk(tensor, place, chunk)[:, :, chunk - n :]
                else:
                    buffer = tensor.new_empty(*tensor.shape[:2], n, *tensor.shape[3:])
                    receives.append((holder, _tag(layout, target, h, index), buffer))
                    pieces[target, h, index] = buffer
    _record("halo", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    return [
        [
            _joined_along_sequence([pieces[target, h, index] for h, _ in reversed(_pieces(layout, chunk, left, target))], tensor)
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


def _return_halo_gradients(
    group: dist.ProcessGroup, layout: Layout, halo_grads: list[list[torch.Tensor]], local_grads: list[torch.Tensor],
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
            for target, grads in zip(held, halo_grads):
                whole[:, :, : target * chunk] += grads[index]
            dist.all_reduce(whole, group=group)
            _record("all-reduce", [whole])
            for place, source in enumerate(held):
                _chunk(local, place, chunk).add_(_chunk(whole, source, chunk))
        return
    sends, receives, targets = [], [], []
    for target, grads in zip(held, halo_grads):  # gradients of the halos this rank took
        offset = 0
        for h, n in reversed(_pieces(layout, chunk, left, target)):  # the halo holds the farthest hop first
            holder, place = layout.holder(target - h)
            for index, grad in enumerate(grads):
                piece = grad[:, :, offset : offset + n]
                if holder == rank:
                    _chunk(local_grads[index], place, chunk)[:, :, chunk - n :] += piece
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
                targets.append((_chunk(local, place, chunk)[:, :, chunk - n :], buffer))
    _record("halo gradients", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    for target, buffer in targets:
        target += buffer


def _halo_lengths(layout: Layout, seq: int, left: int, rank: int) -> list[int]:
    chunk = layout.chunk_length(seq)
    return [sum(n for _, n in _pieces(layout, chunk, left, target)) for target in layout.held(rank)]


def _segment_ids(group: dist.ProcessGroup, layout: Layout, positions: torch.Tensor) -> torch.Tensor:
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
    summary = torch.stack([torch.stack([p[:, 0], p[:, -1], s.sum(1)]) for p, s in zip(pieces, starts)])  # (held, 3, B)
    summary = torch.cat([summary.flatten(), inside.to(torch.int64)[None]])
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary, group=group)
    _record("packed-sequence summary", [summary] * (world - 1))
    if not all(bool(each[-1]) for each in gathered):
        raise ValueError(
            f"context parallel with packed sequences: position ids outside [{low}, {high}) on some rank, where the "
            "mask's proof does not hold"
        )
    first, last, count = (
        torch.stack([gathered[holder][:-1].view(-1, 3, positions.shape[0])[place, field] for holder, place in map(layout.holder, range(layout.chunks))])
        for field in range(3)
    )  # (chunks, B) each, in the sequence's order
    boundary = torch.zeros_like(first)
    boundary[1:] = (first[1:] != last[:-1] + 1).to(torch.int64)
    before = torch.cumsum(boundary + count, 0) - count  # starts up to each chunk's first position
    return torch.cat(
        [
            before[target][:, None] + torch.nn.functional.pad(torch.cumsum(s.to(torch.int64), 1), (1, 0))
            for target, s in zip(layout.held(rank), starts)
        ],
        dim=1,
    )


def _as_keys(rows: torch.Tensor) -> torch.Tensor:
    """A (B, L) tensor of per-position values, shaped (B, 1, L, 1) like the keys to travel with
    them (as bytes or int64: gloo has no bool)."""
    return (rows.to(torch.uint8) if rows.dtype == torch.bool else rows)[:, None, :, None]


def _context_parallel_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_left: int,
    scale: float,
    group_name: str,
    rank: int,
    world: int,
    layout: str = CONTIGUOUS,
    key_padding: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, logsumexp, halo keys, halo values, halo padding, segment ids) of this rank's
    queries under the causal window (window_left, 0) over the global sequence sharded across
    the group ``group_name`` in ``layout``; ``key_padding`` (B, L) bool, the halo padding all
    True without one; ``positions`` (B or 1, L) the position ids of packed sequences, whose
    ids (``_segment_ids``) the window stays inside. The halos are the rank's chunks' halos one
    after the other; the segment ids are the halos' ids, then the shard's ((B, 0) without
    positions). ``rank`` and ``world`` are where the call was traced (the halo's length
    depends on them, so a compiled graph holds them and is one rank's). ``sinks``: one logit
    per query head (``sinks.py``), applied to each row once its chunk's halo is joined (every
    key of its window is then in the call), with the plain logsumexp returned; the sinks'
    gradient is this shard's rows' share, summed over the ranks like any replicated weight's."""
    check_scale(scale)
    check_sinks(query, sinks)
    group = process_group(group_name)
    chunks = Layout(layout, world)
    _check_place(group, rank, world, key.shape[2], chunks)
    return _sharded_forward(group, chunks, query, key, value, window_left, scale, key_padding, positions, sinks)


def _sharded_forward(
    group, chunks: Layout, query, key, value, window_left: int, scale: float, key_padding, positions, sinks=None
):
    """``_context_parallel_attention_forward`` once the shards are checked."""
    halos, halo_padding, halo_ids, ids = _exchange(group, chunks, key, value, window_left, key_padding, positions)
    with _attention_time():
        outs = [
            _chunk_forward(query, key, value, halo[0], halo[1], place, chunks, window_left, scale, *masks)
            for place, (halo, masks) in enumerate(
                zip(halos, _chunk_masks(chunks, key_padding, ids, halo_padding, halo_ids))
            )
        ]
    out, logsumexp = _joined(query, outs)
    return (apply_sinks(out, logsumexp, sinks), logsumexp, *_saved_halos(key, halos, halo_padding, halo_ids, ids))


def _exchange(group, chunks: Layout, key, value, window_left: int, key_padding, positions):
    """(each chunk's halo [keys, values, ...], each chunk's halo padding, each chunk's halo
    segment ids or None, the shard's segment ids or None): what the other ranks send."""
    batch = key.shape[0]
    ids = None if positions is None else _segment_ids(group, chunks, positions.expand(batch, -1))
    extra = [_as_keys(rows) for rows in (key_padding, ids) if rows is not None]
    halos = _halos(group, chunks, [key, value, *extra], window_left)
    halo_padding = [
        halo[2][:, 0, :, 0].bool() if key_padding is not None
        else torch.ones(batch, halo[0].shape[2], dtype=torch.bool, device=key.device)
        for halo in halos
    ]
    halo_ids = [halo[-1][:, 0, :, 0] for halo in halos] if ids is not None else [None] * len(halos)
    return halos, halo_padding, halo_ids, ids


def _saved_halos(key, halos, halo_padding, halo_ids, ids) -> tuple[torch.Tensor, ...]:
    """(halo keys, halo values, halo padding, segment ids), the chunks' one after the other, as
    the backward takes them."""
    all_ids = key.new_empty(key.shape[0], 0, dtype=torch.int64) if ids is None else torch.cat([*halo_ids, ids], dim=1)
    return (*(torch.cat([halo[index] for halo in halos], dim=2) for index in range(2)), torch.cat(halo_padding, dim=1), all_ids)


def _keys_of(place: int, layout: Layout, halo: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A chunk's keys (or values, or per-position rows along dim 1 as (B, L)): its halo, then
    its own."""
    if local.dim() == 2:
        chunk = layout.chunk_length(local.shape[1])
        return torch.cat([halo, local[:, place * chunk : (place + 1) * chunk]], dim=1)
    return torch.cat([halo, _chunk(local, place, layout.chunk_length(local.shape[2]))], dim=2)


def _chunk_masks(layout, key_padding, ids, halo_padding: list, halo_ids: list):
    """For each of the rank's chunks, (key padding, segment ids) over its halo and own keys,
    each None where the call has none."""
    for place, (padding, chunk_ids) in enumerate(zip(halo_padding, halo_ids)):
        yield (
            None if key_padding is None else _keys_of(place, layout, padding, key_padding),
            None if ids is None else _keys_of(place, layout, chunk_ids, ids),
        )


def _chunk_forward(query, key, value, halo_key, halo_value, place, layout, left, scale, padding, ids):
    """One chunk's queries against its halo and its own keys. With padding or segment ids the
    halo's positions are queried too (zero queries, their rows dropped), so that the call is
    self-attention (Sq == Sk), the form FA2's varlen kernels and segment ids take; a query's
    result does not depend on the other queries."""
    chunk = layout.chunk_length(query.shape[2])
    queries = _chunk(query, place, chunk)
    keys, values = _keys_of(place, layout, halo_key, key), _keys_of(place, layout, halo_value, value)
    if padding is None and ids is None:
        return sliding_window_attention_forward(queries, keys, values, left, 0, scale)
    halo = keys.shape[2] - chunk
    queries = torch.cat([queries.new_zeros(*queries.shape[:2], halo, queries.shape[3]), queries], dim=2)
    out, logsumexp = sliding_window_attention_forward(queries, keys, values, left, 0, scale, padding, ids)
    return empty_like_heads_last(out[:, :, halo:]).copy_(out[:, :, halo:]), logsumexp[:, :, halo:].contiguous()


def _chunk_backward(grad_out, query, keys, values, out, logsumexp, left, scale, padding, ids):
    """The gradients of ``_chunk_forward``'s call: (dq of the chunk's rows, dkeys, dvalues);
    the halo's zero queries, where there are some, take a zero gradient, output 0 and
    logsumexp +inf (a row that sees nothing), so they add nothing to dK and dV."""
    if padding is None and ids is None:
        return sliding_window_attention_backward(grad_out, query, keys, values, out, logsumexp, left, 0, scale)
    halo = keys.shape[2] - query.shape[2]

    def extended(rows, fill=0.0):
        return torch.cat([rows.new_full((*rows.shape[:2], halo, *rows.shape[3:]), fill), rows], dim=2)

    grad_q, grad_keys, grad_values = sliding_window_attention_backward(
        extended(grad_out), extended(query), keys, values, extended(out), extended(logsumexp, math.inf), left, 0, scale,
        padding, ids,
    )
    return grad_q[:, :, halo:], grad_keys, grad_values


def _joined(query: torch.Tensor, parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The chunks' results (each heads-last, or (B, H, c) rows) as the shard's, in its order."""
    if len(parts) == 1:
        return parts[0]
    joined = [empty_like_heads_last(query, parts[0][0].dtype)]
    joined += [part.new_empty(*part.shape[:2], query.shape[2], *part.shape[3:]) for part in parts[0][1:]]
    chunk = parts[0][0].shape[2]
    for place, part in enumerate(parts):
        for whole, piece in zip(joined, part):
            whole[:, :, place * chunk : (place + 1) * chunk].copy_(piece)
    return tuple(joined)


def _forward_fake(
    query, key, value, window_left, scale, group_name, rank, world, layout=CONTIGUOUS, key_padding=None, positions=None,
    sinks=None,
):
    check_scale(scale)
    check_sinks(query, sinks)
    halo = halo_length(key.shape[2], window_left, rank, Layout(layout, world))
    batch, kv_heads, seq, dim = key.shape
    return (
        empty_like_heads_last(query),
        new_logsumexp(query),
        key.new_empty(batch, kv_heads, halo, dim),
        value.new_empty(batch, kv_heads, halo, dim),
        key.new_empty(batch, halo, dtype=torch.bool),
        key.new_empty(batch, 0 if positions is None else halo + seq, dtype=torch.int64),
    )


def _context_parallel_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    halo_key: torch.Tensor,
    halo_value: torch.Tensor,
    halo_padding: torch.Tensor,
    segment_ids: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    window_left: int,
    scale: float,
    group_name: str,
    world: int,
    layout: str = CONTIGUOUS,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = process_group(group_name)
    chunks = Layout(layout, world)
    rank, _ = group_place(group)
    seq = key.shape[2]
    chunk = chunks.chunk_length(seq)
    halo_total = halo_key.shape[2]
    packed = segment_ids.shape[1] > 0
    halo_ids, ids = (segment_ids[:, :halo_total], segment_ids[:, halo_total:]) if packed else (None, None)
    acc = accumulation_dtype(key.dtype)
    # Summed where they meet in the accumulation dtype (fp32 for half precision), rounded once.
    local = [key.new_zeros(key.shape, dtype=acc), value.new_zeros(value.shape, dtype=acc)]
    grad_q, halo_grads, offset = empty_like_heads_last(query), [], 0
    for place, length in enumerate(_halo_lengths(chunks, seq, window_left, rank)):
        halo = slice(offset, offset + length)
        keys = _keys_of(place, chunks, halo_key[:, :, halo], key)
        values = _keys_of(place, chunks, halo_value[:, :, halo], value)
        padding = None if key_padding is None else _keys_of(place, chunks, halo_padding[:, halo], key_padding)
        chunk_ids = None if not packed else _keys_of(place, chunks, halo_ids[:, halo], ids)
        rows = slice(place * chunk, (place + 1) * chunk)
        with _attention_time():
            grad_q_chunk, grad_keys, grad_values = _chunk_backward(
                grad_out[:, :, rows], query[:, :, rows], keys, values, out[:, :, rows], logsumexp[:, :, rows],
                window_left, scale, padding, chunk_ids,
            )
        grad_q[:, :, rows].copy_(grad_q_chunk)
        for target, grad in zip(local, (grad_keys, grad_values)):
            target[:, :, rows] += grad[:, :, length:]
        halo_grads.append([grad_keys[:, :, :length].to(acc), grad_values[:, :, :length].to(acc)])
        offset += length
    _return_halo_gradients(group, chunks, halo_grads, local, window_left)
    grad_k, grad_v = empty_like_heads_last(key), empty_like_heads_last(value)
    grad_k.copy_(local[0])
    grad_v.copy_(local[1])
    return grad_q, grad_k, grad_v


def _backward_fake(grad_out, query, key, value, *_):
    """(dq, dk, dv) of both backward ops."""
    return empty_like_heads_last(query), empty_like_heads_last(key), empty_like_heads_last(value)


def _setup_context(ctx, inputs, output):
    query, key, value, window_left, scale, group_name, _, world, layout, key_padding, _, sinks = inputs
    out, logsumexp, halo_key, halo_value, halo_padding, segment_ids = output
    ctx.save_for_backward(
        query, key, value, halo_key, halo_value, halo_padding, segment_ids, out, logsumexp, key_padding, sinks
    )
    ctx.window_left, ctx.scale, ctx.group_name, ctx.world, ctx.layout = window_left, scale, group_name, world, layout
    ctx.mark_non_differentiable(logsumexp, halo_key, halo_value, halo_padding, segment_ids)


def _backward(ctx, grad_out, *_):
    query, key, value, halo_key, halo_value, halo_padding, segment_ids, out, logsumexp, key_padding, sinks = ctx.saved_tensors
    grad_out, grad_sinks = sink_gradients(grad_out, out, logsumexp, sinks)
    grads = context_parallel_attention_backward(
        grad_out, query, key, value, halo_key, halo_value, halo_padding, segment_ids, out, logsumexp, ctx.window_left,
        ctx.scale, ctx.group_name, ctx.world, ctx.layout, key_padding,
    )
    return (*grads, None, None, None, None, None, None, None, None, grad_sinks)


context_parallel_attention_backward = define_op(
    "context_parallel_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor halo_key, "
    "Tensor halo_value, Tensor halo_padding, Tensor segment_ids, Tensor out, Tensor logsumexp, SymInt window_left, "
    f"float scale, str group_name, SymInt world, str layout=\"{CONTIGUOUS}\", Tensor? key_padding=None) "
    "-> (Tensor, Tensor, Tensor)",
    _context_parallel_attention_backward,
    _backward_fake,
)
context_parallel_attention_forward = define_op(
    "context_parallel_attention_forward(Tensor query, Tensor key, Tensor value, SymInt window_left, float scale, "
    f"str group_name, SymInt rank, SymInt world, str layout=\"{CONTIGUOUS}\", Tensor? key_padding=None, "
    "Tensor? positions=None, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _context_parallel_attention_forward,
    _forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


# -- masks certified by the graph that built them ---------------------------------------------
#
# Compiled per block (FSDP2 around each block with the root compiled, or any graph break
# between the mask and the blocks), the graph that builds a mask is not the graph that attends
# with it, and a shard's mask cannot show the whole sequence's (a window at least as long as
# the shard looks like full attention). The graph that builds it proves it (the sharded rule's
# proof) and returns a copy that ``certify_mask`` files with what the proof found; a block's op
# takes a mask only where it is that very tensor (its storage, alive, and its geometry), unwritten
# (its version counter as filed) and with its contents as filed (a write through ``.data`` or
# dlpack misses the version counter); the ranks agree on the window, padding and documents.


@dataclass(frozen=True)
class Certificate:
    """What the graph that built a mask proved of it, and the tensor it holds for."""

    storage: StorageWeakRef
    geometry: tuple  # (storage offset, size, stride)
    version: int  # the version counter's, as filed (a write through .data or dlpack does not count)
    contents: torch.Tensor  # a copy, as filed
    window_left: int
    key_padding: torch.Tensor | None  # (B, L) bool, a copy
    positions: torch.Tensor | None  # (B or 1, L), a copy

    def holds_for(self, mask: torch.Tensor) -> bool:
        return (
            not self.storage.expired() and self.storage.cdata == mask.untyped_storage()._cdata
            and self.geometry == _geometry(mask) and self.version == mask._version
        )


_CERTIFICATES: list[Certificate] = []


def _geometry(tensor: torch.Tensor) -> tuple:
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _certify_mask(
    mask: torch.Tensor, window_left: int, key_padding: torch.Tensor | None = None, positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of ``mask``, filed as proven the shard of a causal window (window_left, 0) AND
    ``key_padding`` AND the packed sequences of ``positions`` over the whole sequence, with
    query i on key i: filed only where there are as many queries as keys, and the padding is
    (batch, keys) and the positions (batch or 1, keys), as the proof took them."""
    certified = mask.clone()
    _CERTIFICATES[:] = [c for c in _CERTIFICATES if not c.storage.expired()]
    batch, keys = mask.shape[0], mask.shape[-1]
    if mask.shape[-2] != keys or key_padding is not None and tuple(key_padding.shape) != (batch, keys) or (
        positions is not None and (positions.shape[0] not in (1, batch) or positions.shape[1] != keys)
    ):
        return certified
    _CERTIFICATES.append(
        Certificate(
            StorageWeakRef(certified.untyped_storage()), _geometry(certified), certified._version, mask.clone(), window_left,
            None if key_padding is None else key_padding.clone(), None if positions is None else positions.clone(),
        )
    )
    return certified


def certificate_of(mask: torch.Tensor, key: torch.Tensor) -> Certificate | str:
    """The certificate ``mask`` carries for attention with ``key`` (B, H, L, D) on this shard,
    or why it has none."""
    found = next((c for c in reversed(_CERTIFICATES) if c.holds_for(mask)), None)
    if found is None:
        return (
            "the mask is not one a compiled graph proved and returned (it was built eagerly, or copied or changed "
            "since): compile the module that builds the masks too (torch.compile on the model, not only its blocks)"
        )
    if not torch.equal(mask, found.contents):
        return "the mask was written after the graph that built it proved it"
    batch, seq = key.shape[0], key.shape[2]
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (seq, seq):
        return f"the mask's shape {tuple(mask.shape)} is not (batch, 1, {seq}, {seq})"
    if found.key_padding is not None and found.key_padding.shape[0] != batch:
        return f"the mask's key padding has batch {found.key_padding.shape[0]}, the keys {batch}"
    return found


certify_mask = define_op(
    "certify_mask(Tensor mask, SymInt window_left, Tensor? key_padding=None, Tensor? positions=None) -> Tensor",
    _certify_mask,
    lambda mask, window_left, key_padding=None, positions=None: torch.empty_like(mask),
)


def _certified(key: torch.Tensor, mask: torch.Tensor, rank: int, world: int, group_name: str, layout: str):
    """(group, layout, certificate) of a certified call, checked on every rank together."""
    group = process_group(group_name)
    chunks = Layout(layout, world)
    found = certificate_of(mask, key)
    problem = found if isinstance(found, str) else None
    agreed = (0, 0, 0) if problem else (found.window_left, found.key_padding is not None, found.positions is not None)
    _check_place(group, rank, world, key.shape[2], chunks, problem, agreed)
    return group, chunks, found


def _certified_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float, group_name: str,
    rank: int, world: int, layout: str = CONTIGUOUS, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) as ``context_parallel_attention_forward`` computes them under what
    ``mask``'s certificate says; the halo is not saved (its length is the certificate's, known
    at run time only): the backward exchanges it again."""
    check_scale(scale)
    check_sinks(query, sinks)
    group, chunks, found = _certified(key, mask, rank, world, group_name, layout)
    out, logsumexp, *_ = _sharded_forward(
        group, chunks, query, key, value, found.window_left, scale, found.key_padding, found.positions, sinks
    )
    return out, logsumexp


def _certified_attention_backward(
    grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    logsumexp: torch.Tensor, mask: torch.Tensor, scale: float, group_name: str, world: int, layout: str = CONTIGUOUS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rank, _ = group_place(process_group(group_name))
    group, chunks, found = _certified(key, mask, rank, world, group_name, layout)
    halos = _saved_halos(key, *_exchange(group, chunks, key, value, found.window_left, found.key_padding, found.positions))
    return _context_parallel_attention_backward(
        grad_out, query, key, value, *halos, out, logsumexp, found.window_left, scale, group_name, world, layout,
        found.key_padding,
    )


def _certified_forward_fake(query, key, value, mask, scale, group_name, rank, world, layout=CONTIGUOUS, sinks=None):
    check_scale(scale)
    check_sinks(query, sinks)
    return empty_like_heads_last(query), new_logsumexp(query)


def _setup_certified(ctx, inputs, output):
    query, key, value, mask, scale, group_name, _, world, layout, sinks = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, mask, sinks)
    ctx.scale, ctx.group_name, ctx.world, ctx.layout = scale, group_name, world, layout
    ctx.mark_non_differentiable(logsumexp)


def _certified_backward(ctx, grad_out, _):
    query, key, value, out, logsumexp, mask, sinks = ctx.saved_tensors
    grad_out, grad_sinks = sink_gradients(grad_out, out, logsumexp, sinks)
    grads = certified_attention_backward(
        grad_out, query, key, value, out, logsumexp, mask, ctx.scale, ctx.group_name, ctx.world, ctx.layout
    )
    return (*grads, None, None, None, None, None, None, grad_sinks)


certified_attention_backward = define_op(
    "certified_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    f"Tensor logsumexp, Tensor mask, float scale, str group_name, SymInt world, str layout=\"{CONTIGUOUS}\") "
    "-> (Tensor, Tensor, Tensor)",
    _certified_attention_backward,
    _backward_fake,
)
certified_attention_forward = define_op(
    "certified_attention_forward(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, str group_name, "
    f"SymInt rank, SymInt world, str layout=\"{CONTIGUOUS}\", Tensor? sinks=None) -> (Tensor, Tensor)",
    _certified_attention_forward,
    _certified_forward_fake,
    setup_context=_setup_certified,
    backward=_certified_backward,
)


def context_parallel_attention(
    query, key, value, *, window_left: int, scale: float | None = None, key_padding=None, positions=None, group=True,
    layout: str = CONTIGUOUS, sinks=None,
):
    """Causal attention under window (window_left, 0) over the sequence sharded across
    ``group`` (True: the default group; a ProcessGroup or a one-dimensional DeviceMesh) in
    ``layout``, inside the packed sequences that ``positions`` (this shard's position ids)
    start, as the module's docstring says; (B, H, L, D) in, heads-last out; ``sinks`` as the
    window op takes them (each rank's gradient its rows' share)."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    name = group_name(group)
    if name is False:
        raise ValueError("context_parallel_attention needs a group: True (the default group), a ProcessGroup or a DeviceMesh dimension")
    resolved = process_group(name)
    return context_parallel_attention_forward(
        query, key, value, window_left, float(scale), resolved.group_name, *group_place(resolved), layout, key_padding,
        positions, sinks,
    )[0]
