"""Masks certified by the graph that built them, for the context-parallel op
(``parallel.context_parallel``): ``compile_pass::certify_mask`` and what it files.

Compiled per block (FSDP2 around each block with the root compiled, or any graph break
between the mask and the blocks), the graph that builds a mask is not the graph that attends
with it, and a shard's mask cannot show the whole sequence's (a window at least as long as
the shard looks like full attention). The graph that builds it proves it (the sharded rule's
proof) and returns a copy that ``certify_mask`` files with what the proof found; a block's op
takes a mask only where it is that very tensor (its storage, alive, and its geometry), unwritten
(its version counter as filed) and with its contents as filed (a write through ``.data`` or
dlpack misses the version counter); the ranks agree on the window, padding and documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..registration import define_op


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
            not self.storage.expired()
            and self.storage.cdata == mask.untyped_storage()._cdata
            and self.geometry == _geometry(mask)
            and self.version == mask._version
        )


_CERTIFICATES: list[Certificate] = []


def _geometry(tensor: torch.Tensor) -> tuple:
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _certify_mask(
    mask: torch.Tensor,
    window_left: int,
    key_padding: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of ``mask``, filed as proven the shard of a causal window (window_left, 0) AND
    ``key_padding`` AND the packed sequences of ``positions`` over the whole sequence, with
    query i on key i: filed only where there are as many queries as keys, and the padding is
    (batch, keys) and the positions (batch or 1, keys), as the proof took them."""
    certified = mask.clone()
    _CERTIFICATES[:] = [c for c in _CERTIFICATES if not c.storage.expired()]
    batch, keys = mask.shape[0], mask.shape[-1]
    if (
        mask.shape[-2] != keys
        or key_padding is not None
        and tuple(key_padding.shape) != (batch, keys)
        or (positions is not None and (positions.shape[0] not in (1, batch) or positions.shape[1] != keys))
    ):
        return certified
    _CERTIFICATES.append(
        Certificate(
            StorageWeakRef(certified.untyped_storage()),
            _geometry(certified),
            certified._version,
            mask.clone(),
            window_left,
            None if key_padding is None else key_padding.clone(),
            None if positions is None else positions.clone(),
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
