"""Context parallelism: causal (sliding or full) attention over a sequence sharded across the
ranks of one process group (the default group, or the context-parallel dimension of a
DeviceMesh), each rank holding a shard of L positions, the same L on every rank.

The sequence is cut into equal chunks, each rank holding some of them in a layout
(``parallel.shard_layout``: contiguous, or head-tail for causal balance). A causal window (left, 0)
needs, besides a chunk's own keys, the ``left`` keys before it (its *halo*), which the ranks
holding them send (``parallel.halo_exchange``): point to point for a bounded window, all-gathered
for an unbounded one (a full-attention layer).
The op then runs the sliding-window op on each chunk's queries against halo + the chunk's keys
(FA2's bottom-right alignment puts query i on key i + halo, its own position). The backward
sends each halo key's and value's gradient back to the rank holding it, which adds it to its own.
A mask built by another graph is taken where that graph certified it (``ops.mask_certificate``).

Ranks here are ranks within the group; the op names its group by ``group_name``, as torch's
functional collectives do, so a compiled graph holds a string and not a process group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..kernels.layout import accumulation_dtype, check_scale, check_sinks, empty_like_heads_last, new_logsumexp
from ..ops.mask_certificate import Certificate, certificate_of
from ..ops.sinks import apply_sinks, sink_gradients
from ..ops.window_attention import backward_fake, sliding_window_attention_backward, sliding_window_attention_forward
from ..registration import define_op
from .halo_exchange import attention_time, exchange, record, return_halo_gradients
from .shard_layout import (
    CONTIGUOUS,
    Layout,
    group_name,
    group_place,
    halo_length,
    halo_lengths,
    held_chunk,
    process_group,
)


def _check_place(
    group: dist.ProcessGroup,
    rank: int,
    world: int,
    seq: int,
    layout: Layout,
    problem: str | None = None,
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
        raise RuntimeError(
            f"context parallel: traced for rank {rank} of {world}, running as rank {here[0]} of {here[1]}"
        )
    values = (seq, *agreed)
    checks = torch.tensor([problem is not None, *values, *(-value for value in values)], dtype=torch.int64)
    dist.all_reduce(checks, op=dist.ReduceOp.MAX, group=group)
    record("shard-length check", [checks])
    if checks[0]:
        raise ValueError(
            f"context parallel: {problem or 'another rank of the group cannot run this call (its error says why)'}"
        )
    highest, lowest = checks[1 : 1 + len(values)].tolist(), [-value for value in checks[1 + len(values) :].tolist()]
    if highest[0] != lowest[0]:
        raise ValueError(f"context parallel needs shards of equal length; they range from {lowest[0]} to {highest[0]}")
    if highest != lowest:
        raise ValueError(
            "context parallel: the ranks' masks were certified with different windows, padding or packed documents"
        )
    held = len(layout.held(rank))
    if seq % held:  # the same on every rank: each raises
        raise ValueError(
            f"context parallel in the {layout.name} layout needs shards of a multiple of {held} positions, got {seq}"
        )


def shard_sequence(tensor: torch.Tensor, dim: int, group=True, layout: str = CONTIGUOUS) -> torch.Tensor:
    """This process's shard of a whole-sequence ``tensor`` (input_ids, labels, positions, the
    attention mask) along ``dim``, for the ranks of ``group`` in ``layout``, as the op under
    ``context_parallel`` expects it.

    Args:
        tensor: the whole sequence's tensor, the same on every rank.
        dim: its sequence dimension.
        group: ``True`` for the default process group, a ``ProcessGroup``, or one dimension of
            a ``DeviceMesh``, as the setting ``context_parallel`` takes it.
        layout: ``"contiguous"`` or ``"head-tail"``, as the setting ``context_parallel_layout``.

    Returns:
        A contiguous copy of this rank's positions.
    """
    resolved = process_group(group_name(group))
    rank, world = group_place(resolved)
    return Layout(layout, world).shard(tensor, dim, rank).contiguous()


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
    ids (``global_segment_ids``) the window stays inside. The halos are the rank's chunks'
    halos one after the other; the segment ids are the halos' ids, then the shard's ((B, 0)
    without positions). ``rank`` and ``world`` are where the call was traced (the halo's length
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
    halos, halo_padding, halo_ids, ids = exchange(group, chunks, key, value, window_left, key_padding, positions)
    with attention_time():
        outs = [
            _chunk_forward(query, key, value, halo[0], halo[1], place, chunks, window_left, scale, *masks)
            for place, (halo, masks) in enumerate(
                zip(halos, _chunk_masks(chunks, key_padding, ids, halo_padding, halo_ids), strict=True)
            )
        ]
    out, logsumexp = _joined(query, outs)
    return (apply_sinks(out, logsumexp, sinks), logsumexp, *_saved_halos(key, halos, halo_padding, halo_ids, ids))


def _saved_halos(
    key, halos, halo_padding, halo_ids, ids
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(halo keys, halo values, halo padding, segment ids), the chunks' one after the other, as
    the backward takes them."""
    all_ids = key.new_empty(key.shape[0], 0, dtype=torch.int64) if ids is None else torch.cat([*halo_ids, ids], dim=1)
    halo_keys, halo_values = (torch.cat([halo[index] for halo in halos], dim=2) for index in range(2))
    return halo_keys, halo_values, torch.cat(halo_padding, dim=1), all_ids


def _keys_of(place: int, layout: Layout, halo: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A chunk's keys (or values, or per-position rows along dim 1 as (B, L)): its halo, then
    its own."""
    if local.dim() == 2:
        chunk = layout.chunk_length(local.shape[1])
        return torch.cat([halo, local[:, place * chunk : (place + 1) * chunk]], dim=1)
    return torch.cat([halo, held_chunk(local, place, layout.chunk_length(local.shape[2]))], dim=2)


def _chunk_masks(layout, key_padding, ids, halo_padding: list, halo_ids: list):
    """For each of the rank's chunks, (key padding, segment ids) over its halo and own keys,
    each None where the call has none."""
    for place, (padding, chunk_ids) in enumerate(zip(halo_padding, halo_ids, strict=True)):
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
    queries = held_chunk(query, place, chunk)
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
        extended(grad_out),
        extended(query),
        keys,
        values,
        extended(out),
        extended(logsumexp, math.inf),
        left,
        0,
        scale,
        padding,
        ids,
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
        for whole, piece in zip(joined, part, strict=True):
            whole[:, :, place * chunk : (place + 1) * chunk].copy_(piece)
    return tuple(joined)


def _forward_fake(
    query,
    key,
    value,
    window_left,
    scale,
    group_name,
    rank,
    world,
    layout=CONTIGUOUS,
    key_padding=None,
    positions=None,
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
    for place, length in enumerate(halo_lengths(chunks, seq, window_left, rank)):
        halo = slice(offset, offset + length)
        keys = _keys_of(place, chunks, halo_key[:, :, halo], key)
        values = _keys_of(place, chunks, halo_value[:, :, halo], value)
        padding = None if key_padding is None else _keys_of(place, chunks, halo_padding[:, halo], key_padding)
        chunk_ids = None if halo_ids is None or ids is None else _keys_of(place, chunks, halo_ids[:, halo], ids)
        rows = slice(place * chunk, (place + 1) * chunk)
        with attention_time():
            grad_q_chunk, grad_keys, grad_values = _chunk_backward(
                grad_out[:, :, rows],
                query[:, :, rows],
                keys,
                values,
                out[:, :, rows],
                logsumexp[:, :, rows],
                window_left,
                scale,
                padding,
                chunk_ids,
            )
        grad_q[:, :, rows].copy_(grad_q_chunk)
        for target, grad in zip(local, (grad_keys, grad_values), strict=True):
            target[:, :, rows] += grad[:, :, length:]
        halo_grads.append([grad_keys[:, :, :length].to(acc), grad_values[:, :, :length].to(acc)])
        offset += length
    return_halo_gradients(group, chunks, halo_grads, local, window_left)
    grad_k, grad_v = empty_like_heads_last(key), empty_like_heads_last(value)
    grad_k.copy_(local[0])
    grad_v.copy_(local[1])
    return grad_q, grad_k, grad_v


def _setup_context(ctx, inputs, output):
    query, key, value, window_left, scale, group_name, _, world, layout, key_padding, _, sinks = inputs
    out, logsumexp, halo_key, halo_value, halo_padding, segment_ids = output
    ctx.save_for_backward(
        query, key, value, halo_key, halo_value, halo_padding, segment_ids, out, logsumexp, key_padding, sinks
    )
    ctx.window_left, ctx.scale, ctx.group_name, ctx.world, ctx.layout = window_left, scale, group_name, world, layout
    ctx.mark_non_differentiable(logsumexp, halo_key, halo_value, halo_padding, segment_ids)


def _backward(ctx, grad_out, *_):
    query, key, value, halo_key, halo_value, halo_padding, segment_ids, out, logsumexp, key_padding, sinks = (
        ctx.saved_tensors
    )
    grad_out, grad_sinks = sink_gradients(grad_out, out, logsumexp, sinks)
    grads = context_parallel_attention_backward(
        grad_out,
        query,
        key,
        value,
        halo_key,
        halo_value,
        halo_padding,
        segment_ids,
        out,
        logsumexp,
        ctx.window_left,
        ctx.scale,
        ctx.group_name,
        ctx.world,
        ctx.layout,
        key_padding,
    )
    return (*grads, None, None, None, None, None, None, None, None, grad_sinks)


context_parallel_attention_backward = define_op(
    "context_parallel_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor halo_key, "
    "Tensor halo_value, Tensor halo_padding, Tensor segment_ids, Tensor out, Tensor logsumexp, SymInt window_left, "
    f'float scale, str group_name, SymInt world, str layout="{CONTIGUOUS}", Tensor? key_padding=None) '
    "-> (Tensor, Tensor, Tensor)",
    _context_parallel_attention_backward,
    backward_fake,
)
context_parallel_attention_forward = define_op(
    "context_parallel_attention_forward(Tensor query, Tensor key, Tensor value, SymInt window_left, float scale, "
    f'str group_name, SymInt rank, SymInt world, str layout="{CONTIGUOUS}", Tensor? key_padding=None, '
    "Tensor? positions=None, Tensor? sinks=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _context_parallel_attention_forward,
    _forward_fake,
    setup_context=_setup_context,
    backward=_backward,
)


def _certified(
    key: torch.Tensor, mask: torch.Tensor, rank: int, world: int, group_name: str, layout: str
) -> tuple[dist.ProcessGroup, Layout, Certificate]:
    """(group, layout, certificate) of a certified call, checked on every rank together."""
    group = process_group(group_name)
    chunks = Layout(layout, world)
    found = certificate_of(mask, key)
    if isinstance(found, str):
        problem, agreed = found, (0, 0, 0)
    else:
        problem, agreed = None, (found.window_left, found.key_padding is not None, found.positions is not None)
    _check_place(group, rank, world, key.shape[2], chunks, problem, agreed)
    assert not isinstance(found, str)  # _check_place raised on every rank
    return group, chunks, found


def _certified_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    group_name: str,
    rank: int,
    world: int,
    layout: str = CONTIGUOUS,
    sinks: torch.Tensor | None = None,
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
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    group_name: str,
    world: int,
    layout: str = CONTIGUOUS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rank, _ = group_place(process_group(group_name))
    group, chunks, found = _certified(key, mask, rank, world, group_name, layout)
    halos = _saved_halos(
        key, *exchange(group, chunks, key, value, found.window_left, found.key_padding, found.positions)
    )
    return _context_parallel_attention_backward(
        grad_out,
        query,
        key,
        value,
        *halos,
        out,
        logsumexp,
        found.window_left,
        scale,
        group_name,
        world,
        layout,
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
    f'Tensor logsumexp, Tensor mask, float scale, str group_name, SymInt world, str layout="{CONTIGUOUS}") '
    "-> (Tensor, Tensor, Tensor)",
    _certified_attention_backward,
    backward_fake,
)
certified_attention_forward = define_op(
    "certified_attention_forward(Tensor query, Tensor key, Tensor value, Tensor mask, float scale, str group_name, "
    f'SymInt rank, SymInt world, str layout="{CONTIGUOUS}", Tensor? sinks=None) -> (Tensor, Tensor)',
    _certified_attention_forward,
    _certified_forward_fake,
    setup_context=_setup_certified,
    backward=_certified_backward,
)


def context_parallel_attention(
    query,
    key,
    value,
    *,
    window_left: int,
    scale: float | None = None,
    key_padding=None,
    positions=None,
    group=True,
    layout: str = CONTIGUOUS,
    sinks=None,
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
        raise ValueError(
            "context_parallel_attention needs a group: True (the default group), a ProcessGroup or a DeviceMesh "
            "dimension"
        )
    resolved = process_group(name)
    return context_parallel_attention_forward(
        query,
        key,
        value,
        window_left,
        float(scale),
        resolved.group_name,
        *group_place(resolved),
        layout,
        key_padding,
        positions,
        sinks,
    )[0]
