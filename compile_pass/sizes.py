"""Symbolic sizes: what the rules may conclude about a size, and when that costs a guard."""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true
from torch.utils._sympy.numbers import int_oo


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


def known_number(value) -> int | float | None:
    """A Python number, or a symbolic one whose expression the traced program's guards have
    already pinned to a constant (``torch.compile(dynamic=True)`` passes a module's float
    attributes, such as an attention dropout or scale, as inputs that SDPA's checks then
    specialise); None for anything else. Adds no guard."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    expr = getattr(getattr(value, "node", None), "expr", None)
    if isinstance(expr, sympy.Number):
        return float(expr) if isinstance(value, torch.SymFloat) else int(expr)
    return None


def traced_value(size) -> int | None:
    """The value a size was traced with, without a guard; None where there is none."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


def branches_on(size) -> list[str] | None:
    """What the traced program assumed of a symbolic size, besides how it relates to other
    inputs' sizes: the guards that name its symbols, except homogeneous linear relations
    (``Eq(2*s0, 2*s1)``, which hold alike when every size is scaled by the same factor), and a
    value range narrower than Dynamo's default [2, oo). None for a size that is not symbolic
    (static: every branch on it taken)."""
    node = getattr(size, "node", None)
    symbols: set[Any] = getattr(getattr(node, "expr", None), "free_symbols", set())
    if node is None or not symbols:
        return None
    return _assumed(node.shape_env, symbols)


def branches_on_any_size(size) -> list[str] | None:
    """``branches_on`` for every size the traced program has (every symbol of ``size``'s
    ShapeEnv, inputs the graph no longer takes included); None for a static ``size``."""
    node = getattr(size, "node", None)
    if node is None or not getattr(getattr(node, "expr", None), "free_symbols", set()):
        return None
    shape_env = node.shape_env
    return _assumed(shape_env, set(shape_env.var_to_range))


def _assumed(shape_env, symbols) -> list[str]:
    found = []
    for guard in shape_env.guards:
        expr = guard.expr
        if not expr.free_symbols & symbols:
            continue
        if _homogeneous_linear(expr):
            continue
        found.append(str(expr))
    for symbol in symbols:
        bounds = shape_env.var_to_range.get(symbol)
        if bounds is not None and (bounds.lower > 2 or bounds.upper not in (int_oo, sympy.oo)):
            found.append(f"{symbol} in [{bounds.lower}, {bounds.upper}]")
    return found


def _homogeneous_linear(relation) -> bool:
    """A relation between sizes with no constant: a x + b y ... <op> 0 for numbers a, b."""
    if not isinstance(relation, sympy.Rel):
        return False
    difference = sympy.expand(relation.lhs - relation.rhs)
    terms = sympy.Add.make_args(difference)
    return all(
        len(term.free_symbols) == 1 and sympy.diff(term, *term.free_symbols).is_number and not term.is_number
        for term in terms
    )
