"""Which positions of a sharded sequence each rank of a context-parallel group holds
(``context_parallel.py``), and what a causal window needs of the others: the group a setting
names, the layouts, and the halos' lengths and hops.

The sequence is cut into equal chunks, and each rank holds some of them, in a layout:
- ``contiguous``: P chunks, rank r holds chunk r (global positions [r L, (r + 1) L));
- ``head-tail``: 2P chunks of L / 2, rank r holds chunks r and 2P - 1 - r, in that order
  (torch's load balancing for causal attention: every rank has the same causal work, where
  contiguous shards give the last rank P times the first's).
A causal window (left, 0) needs, besides a chunk's own keys, the ``left`` keys before it (its
*halo*), which lie in the chunks before it: hop h brings chunk m the last
min(c, left - (h - 1) c) keys of chunk m - h (chunks of c positions), for
h = 1 .. min(ceil(left / c), m); an unbounded window's halo is every earlier chunk.

Ranks here are ranks within the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..window import UNBOUNDED


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
    if name is False:
        raise ValueError("context_parallel is off: no process group is named")
    if name is True:
        world = dist.group.WORLD
        if world is None:
            raise RuntimeError("context_parallel=True needs torch.distributed's default group (init_process_group)")
        return world
    from torch.distributed.distributed_c10d import GroupName, _resolve_process_group

    return _resolve_process_group(GroupName(name))


def group_place(group: dist.ProcessGroup) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


CONTIGUOUS, HEAD_TAIL = "contiguous", "head-tail"
LAYOUTS = (CONTIGUOUS, HEAD_TAIL)


@dataclass(frozen=True)
class Layout:
    """Which chunks of the sequence each of ``world`` ranks holds (see this module's docstring)."""

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


def halo_pieces(layout: Layout, chunk: int, left: int, target: int) -> list[tuple[int, int]]:
    """(h, n) for the halo of chunk ``target``: the hops that reach a chunk before it."""
    if left == UNBOUNDED:
        return [(h, chunk) for h in range(1, target + 1)]
    return [(h, n) for h, n in halo_hops(chunk, left, layout.chunks) if h <= target]


def halo_lengths(layout: Layout, seq: int, left: int, rank: int) -> list[int]:
    """The halo length of each of ``rank``'s chunks, in its shard's order."""
    chunk = layout.chunk_length(seq)
    return [sum(n for _, n in halo_pieces(layout, chunk, left, target)) for target in layout.held(rank)]


def held_chunk(tensor: torch.Tensor, place: int, chunk: int) -> torch.Tensor:
    """The ``place``-th chunk a rank holds, of ``chunk`` positions, of its (B, H, L, ...) shard."""
    return tensor[:, :, place * chunk : (place + 1) * chunk]
