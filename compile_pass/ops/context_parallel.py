"""Context parallelism: causal (sliding or full) attention over a sequence sharded across the
ranks of one process group (the default group, or the context-parallel dimension of a
DeviceMesh), each rank holding one contiguous shard of equal length.

Rank r holds global positions [r * L, (r + 1) * L). A causal window (left, 0) needs, besides the
local keys, the ``left`` keys before the shard (its *halo*), which live on the ranks before it:
- a bounded window takes them point to point: hop h brings rank r the last
  min(L, left - (h - 1) * L) keys and values of rank r - h, for h = 1 .. ceil(left / L) (one
  hop when the shard is at least the window; several when shards are shorter than it);
- an unbounded window (a full-attention layer) all-gathers the keys and values: every earlier
  shard is its halo.
The op then runs the sliding-window op on the local queries against halo + local keys (FA2's
bottom-right alignment puts query i on key i + halo, its own position). The backward sends each
halo key's and value's gradient back to its owner, which adds it to its own.

Ranks here are ranks within the group; the op names its group by ``group_name``, as torch's
functional collectives do, so a compiled graph holds a string and not a process group.

``exchanges()`` records the bytes each call sends, for the benchmark and tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..window import UNBOUNDED
from .layout import accumulation_dtype, check_scale, empty_like_heads_last, new_logsumexp
from .window_attention import sliding_window_attention_backward, sliding_window_attention_forward


@dataclass
class ExchangeLog:
    """Bytes this rank sent, by kind ("halo", "halo gradients", "all-gather", "all-reduce")."""

    sent: dict[str, int] = field(default_factory=dict)
    calls: int = 0

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


def _check_place(group: dist.ProcessGroup, rank: int, world: int, seq: int) -> None:
    """The op was traced for this rank of a group of this size, and every rank holds a shard
    of ``seq`` positions (a collective of two integers): anything else would pair halo
    messages of other lengths, or halos traced for another rank."""
    here = group_place(group)
    if (rank, world) != here:
        raise RuntimeError(f"context parallel: traced for rank {rank} of {world}, running as rank {here[0]} of {here[1]}")
    lengths = torch.tensor([seq, -seq], dtype=torch.int64)
    dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    _record("shard-length check", [lengths])
    if lengths[0] != -lengths[1]:
        raise ValueError(f"context parallel needs shards of equal length; they range from {-int(lengths[1])} to {int(lengths[0])}")


def halo_length(seq, left: int, rank: int):
    """Keys before rank ``rank``'s shard of ``seq`` positions that a causal window (left, 0)
    reaches."""
    before = rank * seq
    return before if left == UNBOUNDED else torch.sym_min(left, before)


def halo_hops(seq: int, left: int, world: int) -> list[tuple[int, int]]:
    """(h, n): at hop h a rank receives the last n positions of the shard h ranks before it;
    no more hops than there are other ranks, however wide the window."""
    if seq == 0:
        return []
    return [(h, min(seq, left - (h - 1) * seq)) for h in range(1, min(math.ceil(left / seq), world - 1) + 1)]


def _point_to_point(group: dist.ProcessGroup, sends: list[tuple[int, int, torch.Tensor]], receives: list[tuple[int, int, torch.Tensor]]) -> None:
    """Every (peer, tag, tensor) send and receive at once, then wait: a message is matched by
    its peer (a rank in ``group``) and tag (hop and tensor), whatever the order."""
    requests = [dist.isend(tensor.contiguous(), group=group, group_dst=peer, tag=tag) for peer, tag, tensor in sends]
    requests += [dist.irecv(tensor, group=group, group_src=peer, tag=tag) for peer, tag, tensor in receives]
    for request in requests:
        request.wait()


def _tag(hop: int, index: int) -> int:
    return hop * 8 + index


def _empty_halo(tensor: torch.Tensor) -> torch.Tensor:
    """No positions before the shard (rank 0): a tensor of its own, not a view of the input."""
    return tensor.new_empty(*tensor.shape[:2], 0, *tensor.shape[3:])


def _halo(group: dist.ProcessGroup, tensors: list[torch.Tensor], left: int) -> list[torch.Tensor]:
    """The halo of each (B, H, L, ...) tensor along dim 2: the positions before this shard that
    the window reaches, oldest first."""
    rank, world = group_place(group)
    seq = tensors[0].shape[2]
    if left == UNBOUNDED:
        halos = []
        for tensor in tensors:
            gathered = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(gathered, tensor.contiguous(), group=group)
            _record("all-gather", [tensor] * (world - 1))
            halos.append(torch.cat(gathered[:rank], dim=2) if rank else _empty_halo(tensor))
        return halos
    sends, receives, pieces = [], [], {}
    for h, n in halo_hops(seq, left, world):
        for index, tensor in enumerate(tensors):
            if rank + h < world:
                sends.append((rank + h, _tag(h, index), tensor[:, :, seq - n :]))
            if rank - h >= 0:
                buffer = tensor.new_empty(*tensor.shape[:2], n, *tensor.shape[3:])
                receives.append((rank - h, _tag(h, index), buffer))
                pieces[h, index] = buffer
    _record("halo", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    hops = sorted({h for h, _ in pieces}, reverse=True)  # the farthest shard first
    return [
        torch.cat([pieces[h, index] for h in hops], dim=2) if hops else _empty_halo(tensor)
        for index, tensor in enumerate(tensors)
    ]


def _return_halo_gradients(
    group: dist.ProcessGroup, halo_grads: list[torch.Tensor], local_grads: list[torch.Tensor], left: int
) -> None:
    """Sends each halo gradient to the rank whose positions it belongs to and adds the
    gradients received for this shard's positions to ``local_grads`` (in place)."""
    rank, world = group_place(group)
    seq = local_grads[0].shape[2]
    if left == UNBOUNDED:
        for halo, local in zip(halo_grads, local_grads):
            full = local.new_zeros(*local.shape[:2], world * seq, *local.shape[3:])
            full[:, :, : halo.shape[2]] = halo
            dist.all_reduce(full, group=group)
            _record("all-reduce", [full])
            local += full[:, :, rank * seq : (rank + 1) * seq]
        return
    hops = halo_hops(seq, left, world)
    offsets, offset = {}, 0
    for h, n in reversed(hops):  # the halo holds the farthest hop's positions first
        if rank - h >= 0:
            offsets[h] = (offset, n)
            offset += n
    sends, receives, targets = [], [], []
    for h, n in hops:
        for index, (halo, local) in enumerate(zip(halo_grads, local_grads)):
            if rank - h >= 0:
                start, count = offsets[h]
                sends.append((rank - h, _tag(h, index), halo[:, :, start : start + count]))
            if rank + h < world:
                buffer = local.new_empty(*local.shape[:2], n, *local.shape[3:])
                receives.append((rank + h, _tag(h, index), buffer))
                targets.append((local, seq - n, buffer))
    _record("halo gradients", [tensor for _, _, tensor in sends])
    _point_to_point(group, sends, receives)
    for local, start, buffer in targets:
        local[:, :, start:] += buffer


@torch.library.custom_op("compile_pass::context_parallel_attention_forward", mutates_args=())
def context_parallel_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    window_left: int,
    scale: float,
    group_name: str,
    rank: int,
    world: int,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, logsumexp, halo keys, halo values, halo padding) of this rank's queries under the
    causal window (window_left, 0) over the global sequence sharded across the group
    ``group_name``; ``key_padding`` (B, L) bool, the halo padding all True without one.
    ``rank`` and ``world`` are where the call was traced (the halo's length depends on them,
    so a compiled graph holds them and is one rank's)."""
    check_scale(scale)
    group = process_group(group_name)
    _check_place(group, rank, world, key.shape[2])
    # Padding travels as bytes (gloo has no bool), shaped (B, 1, L, 1) like the keys.
    extra = [] if key_padding is None else [key_padding.to(torch.uint8)[:, None, :, None]]
    halo_key, halo_value, *halo_padding = _halo(group, [key, value, *extra], window_left)
    padding = None
    if key_padding is not None:
        halo_padding = halo_padding[0][:, 0, :, 0].bool()
        padding = torch.cat([halo_padding, key_padding], dim=1)
    else:
        halo_padding = torch.ones(key.shape[0], halo_key.shape[2], dtype=torch.bool, device=key.device)
    keys, values = torch.cat([halo_key, key], dim=2), torch.cat([halo_value, value], dim=2)
    out, logsumexp = sliding_window_attention_forward(query, keys, values, window_left, 0, scale, padding)
    return out, logsumexp, halo_key, halo_value, halo_padding


@context_parallel_attention_forward.register_fake
def _forward_fake(query, key, value, window_left, scale, group_name, rank, world, key_padding=None):
    check_scale(scale)
    halo = halo_length(key.shape[2], window_left, rank)
    batch, kv_heads, _, dim = key.shape
    return (
        empty_like_heads_last(query),
        new_logsumexp(query),
        key.new_empty(batch, kv_heads, halo, dim),
        value.new_empty(batch, kv_heads, halo, dim),
        key.new_empty(batch, halo, dtype=torch.bool),
    )


@torch.library.custom_op("compile_pass::context_parallel_attention_backward", mutates_args=())
def context_parallel_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    halo_key: torch.Tensor,
    halo_value: torch.Tensor,
    halo_padding: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    window_left: int,
    scale: float,
    group_name: str,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    halo = halo_key.shape[2]
    keys, values = torch.cat([halo_key, key], dim=2), torch.cat([halo_value, value], dim=2)
    padding = None if key_padding is None else torch.cat([halo_padding, key_padding], dim=1)
    grad_q, grad_keys, grad_values = sliding_window_attention_backward(
        grad_out, query, keys, values, out, logsumexp, window_left, 0, scale, padding
    )
    # Summed where they meet in the accumulation dtype (fp32 for half precision), rounded once.
    acc = accumulation_dtype(key.dtype)
    local = [empty_like_heads_last(key, acc), empty_like_heads_last(value, acc)]
    for target, grad in zip(local, (grad_keys, grad_values)):
        target.copy_(grad[:, :, halo:])
    _return_halo_gradients(
        process_group(group_name), [grad_keys[:, :, :halo].to(acc), grad_values[:, :, :halo].to(acc)], local, window_left
    )
    grad_k, grad_v = empty_like_heads_last(key), empty_like_heads_last(value)
    grad_k.copy_(local[0])
    grad_v.copy_(local[1])
    return grad_q, grad_k, grad_v


@context_parallel_attention_backward.register_fake
def _backward_fake(
    grad_out, query, key, value, halo_key, halo_value, halo_padding, out, logsumexp, window_left, scale, group_name,
    key_padding=None,
):
    return empty_like_heads_last(query), empty_like_heads_last(key), empty_like_heads_last(value)


def _setup_context(ctx, inputs, output):
    query, key, value, window_left, scale, group_name, _, _, key_padding = inputs
    out, logsumexp, halo_key, halo_value, halo_padding = output
    ctx.save_for_backward(query, key, value, halo_key, halo_value, halo_padding, out, logsumexp, key_padding)
    ctx.window_left, ctx.scale, ctx.group_name = window_left, scale, group_name
    ctx.mark_non_differentiable(logsumexp, halo_key, halo_value, halo_padding)


def _backward(ctx, grad_out, *_):
    query, key, value, halo_key, halo_value, halo_padding, out, logsumexp, key_padding = ctx.saved_tensors
    grads = context_parallel_attention_backward(
        grad_out, query, key, value, halo_key, halo_value, halo_padding, out, logsumexp, ctx.window_left, ctx.scale,
        ctx.group_name, key_padding,
    )
    return (*grads, None, None, None, None, None, None)


context_parallel_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def context_parallel_attention(
    query, key, value, *, window_left: int, scale: float | None = None, key_padding=None, group=True
):
    """Causal attention under window (window_left, 0) over the sequence sharded across
    ``group`` (True: the default group; a ProcessGroup or a one-dimensional DeviceMesh), as the
    module's docstring says; (B, H, L, D) in, heads-last out."""
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    name = group_name(group)
    if name is False:
        raise ValueError("context_parallel_attention needs a group: True (the default group), a ProcessGroup or a DeviceMesh dimension")
    resolved = process_group(name)
    return context_parallel_attention_forward(
        query, key, value, window_left, float(scale), resolved.group_name, *group_place(resolved), key_padding
    )[0]
