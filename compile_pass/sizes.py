"""Symbolic sizes: what the rules may conclude about a size, and when that costs a guard."""

from __future__ import annotations

from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true


def same_size(a, b) -> bool:
    """Two sizes (ints or SymInts) are equal for every value of their symbols; adds no guard."""
    return statically_known_true(a == b)


def model_constant(size) -> int | None:
    """A size that is a model constant (head_dim, heads) as a Python int: its value when the
    graph pins it, else the value it was traced with, with a guard, so the compiled graph
    serves only that value (a model's head_dim never changes, so this never recompiles).
    None for a size with no traced value."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    if not isinstance(hint, int):
        return None
    if not statically_known_true(size == hint):
        guard_int(size)
    return hint
