"""FlashAttention-2 window semantics, in one place.

Query row ``i`` of ``Sq`` sees key ``j`` of ``Sk`` exactly when

    -left <= j - (i + Sk - Sq) <= right

where ``left`` or ``right`` equal to ``UNBOUNDED`` (-1) drops that side of the
inequality. ``Sk - Sq`` aligns the last query with the last key (FA2's
bottom-right alignment for Sq != Sk).
"""

from __future__ import annotations

import torch

UNBOUNDED = -1
# Positions a packed mask's proof takes as given, checked at run time: far beyond any context,
# and far from where int32 or int64 arithmetic on them could wrap.
POSITION_RANGE = (0, 2**30)


def normalize_window(window: tuple[int, int], causal: bool) -> tuple[int, int]:
    """Return the ``(left, right)`` pair the kernels use; ``causal`` forces right = 0."""
    if len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair, got {window!r}")
    left, right = (int(side) for side in window)
    for name, side in (("left", left), ("right", right)):
        if side < UNBOUNDED:
            raise ValueError(f"window {name} must be >= 0, or -1 for unbounded; got {side}")
    if causal:
        right = 0
    return left, right


def band_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    left: int,
    right: int,
    key_offset: int,
) -> torch.Tensor:
    """Boolean (len(query_positions), len(key_positions)) mask of visible pairs.

    ``key_offset`` is ``Sk - Sq``: query ``i`` is aligned with key ``i + key_offset``.
    """
    distance = key_positions[None, :] - (query_positions[:, None] + key_offset)
    visible = torch.ones_like(distance, dtype=torch.bool)
    if left != UNBOUNDED:
        visible &= distance >= -left
    if right != UNBOUNDED:
        visible &= distance <= right
    return visible


def window_mask(seq_q: int, seq_k: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """Boolean (Sq, Sk) mask of every visible pair: ``band_mask`` over all positions, in the
    fewest ops (a short call builds it each time it runs)."""
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if right != UNBOUNDED:
        visible = visible.tril(seq_k - seq_q + right)
    if left != UNBOUNDED:
        visible = visible.triu(seq_k - seq_q - left)
    return visible


def key_span(first_query: int, last_query: int, seq_k: int, left: int, right: int, key_offset: int) -> tuple[int, int]:
    """Half-open key range ``[start, stop)`` that query rows first..last can see."""
    start = 0 if left == UNBOUNDED else max(0, first_query + key_offset - left)
    stop = seq_k if right == UNBOUNDED else min(seq_k, last_query + key_offset + right + 1)
    return start, stop


def rows_with_keys(seq_q: int, seq_k: int, right: int) -> tuple[int, int]:
    """Half-open range of query rows that see at least one key.

    Row ``i``'s window ends at key ``i + Sk - Sq + right``, so rows above
    ``Sq - Sk - right`` see nothing (FA2 returns zeros for them). The last row is
    aligned with the last key, so every later row sees at least that key.
    """
    if seq_k == 0:
        return 0, 0
    first = 0 if right == UNBOUNDED else min(seq_q, max(0, seq_q - seq_k - right))
    return first, seq_q
