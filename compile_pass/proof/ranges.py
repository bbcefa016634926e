"""Integer value ranges: when a formula's value provably fits its dtype.

Tensors hold machine integers: int64 and int32 arithmetic wraps around. A formula states
the exact mathematical value, so it describes a tensor only where every intermediate value
provably stays inside its dtype. Ranges are computed by interval arithmetic over the
formula's symbols, each bounded by what the graph guarantees:

- a position along a dimension of size n lies in [0, n - 1];
- a size (a symbol Dynamo made for a tensor's size) lies in [0, SIZE_LIMIT); this bound is
  the one assumption (no tensor dimension reaches 2**31);
- any other symbolic integer (a Python int argument) lies in Dynamo's range for it, within
  int64: being nonnegative does not make it a size;
- graph-input data can be anything its dtype holds.

Interval arithmetic over-approximates, so "fits" is proven and "may overflow" is merely not
excluded: the proof then says so rather than guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PowByNatural, PythonMod

SIZE_LIMIT = 2**31
DTYPE_RANGES = {
    torch.int64: (-(2**63), 2**63 - 1),
    torch.int32: (-(2**31), 2**31 - 1),
}

# A floating dtype holds every integer up to 2**(its mantissa bits + 1) in magnitude exactly,
# and integer arithmetic that stays there rounds nothing: float tensors built from integers
# (``torch.ones(S, S).tril()``, ``arange(S).float()``) are proven only within these ranges.
EXACT_FLOAT_RANGES = {
    torch.float64: (-(2**53), 2**53),
    torch.float32: (-(2**24), 2**24),
    torch.float16: (-(2**11), 2**11),
    torch.bfloat16: (-(2**8), 2**8),
}
Interval = tuple[float, float]  # Python ints, or -inf / inf for an unbounded side


def fits(interval: Interval | None, dtype: torch.dtype) -> bool:
    """Every value in ``interval`` is held by ``dtype`` exactly."""
    limits = DTYPE_RANGES.get(dtype) or EXACT_FLOAT_RANGES.get(dtype)
    if interval is None or limits is None:
        return False
    return limits[0] <= interval[0] and interval[1] <= limits[1]


def is_size(symbol: sympy.Symbol, shape_env) -> bool:
    """Whether Dynamo made ``symbol`` for a tensor's size (not for a Python int argument, nor
    an unbacked value read from data). Without a ShapeEnv, any nonnegative symbol is one."""
    if shape_env is None:
        return bool(symbol.is_nonnegative)
    from torch._dynamo.source import TensorProperty, TensorPropertySource

    sources = getattr(shape_env, "var_to_sources", {}).get(symbol, ())
    return any(isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE for source in sources)


def symbol_range(symbol: sympy.Symbol, shape_env) -> Interval:
    """What the graph guarantees about a symbol: Dynamo's value range, within int64, and
    below SIZE_LIMIT for a size."""
    low, high = -math.inf, math.inf
    known = getattr(shape_env, "var_to_range", {}).get(symbol) if shape_env is not None else None
    if known is not None:
        low = int(known.lower) if isinstance(known.lower, sympy.Integer) else low
        high = int(known.upper) if isinstance(known.upper, sympy.Integer) else high
    elif symbol.is_nonnegative:
        low = 0
    if is_size(symbol, shape_env):
        return max(low, 0), min(high, SIZE_LIMIT - 1)
    return max(low, DTYPE_RANGES[torch.int64][0]), min(high, DTYPE_RANGES[torch.int64][1])


def _mul(a: float, b: float) -> float:
    return 0 if a == 0 or b == 0 else a * b


def _product(x: Interval, y: Interval) -> Interval:
    corners = [_mul(a, b) for a in x for b in y]
    return min(corners), max(corners)


def _power(x: Interval, exponent: int) -> Interval:
    low, high = x[0] ** exponent, x[1] ** exponent
    if exponent % 2 == 1:
        return low, high
    if x[0] <= 0 <= x[1]:
        return 0, max(low, high)
    return min(low, high), max(low, high)


def value_range(
    expr: sympy.Basic,
    symbols: Callable[[sympy.Symbol], Interval],
    functions: Callable[[sympy.Basic], Interval | None],
) -> Interval | None:
    """An interval containing every value of ``expr``; None where no bound can be given.

    ``symbols`` bounds each free symbol, ``functions`` each application of an uninterpreted
    function (graph-input data)."""

    def walk(e: sympy.Basic) -> Interval | None:
        if isinstance(e, sympy.Integer):
            return int(e), int(e)
        if isinstance(e, sympy.Symbol):
            return symbols(e)
        if isinstance(e, sympy.core.function.AppliedUndef):
            return functions(e)
        parts = [walk(arg) for arg in e.args] if not isinstance(e, sympy.Piecewise) else None
        if parts is not None and any(part is None for part in parts):
            return None
        if isinstance(e, sympy.Add):
            return sum(p[0] for p in parts), sum(p[1] for p in parts)
        if isinstance(e, sympy.Mul):
            result = (1, 1)
            for part in parts:
                result = _product(result, part)
            return result
        if isinstance(e, (sympy.Pow, PowByNatural)) and isinstance(e.args[1], sympy.Integer) and e.args[1] >= 0:
            return _power(parts[0], int(e.args[1]))
        if isinstance(e, sympy.Abs):
            low, high = parts[0]
            if low >= 0:
                return low, high
            if high <= 0:
                return -high, -low
            return 0, max(-low, high)
        if isinstance(e, (sympy.Max, sympy.Min, Max, Min)):
            pick = max if isinstance(e, (sympy.Max, Max)) else min
            return pick(p[0] for p in parts), pick(p[1] for p in parts)
        if isinstance(e, sympy.Piecewise):
            branches = [walk(value) for value, _ in e.args]
            if any(branch is None for branch in branches):
                return None
            return min(b[0] for b in branches), max(b[1] for b in branches)
        if isinstance(e, FloorDiv) and isinstance(e.args[1], sympy.Integer) and e.args[1] > 0:
            divisor = int(e.args[1])
            return tuple(side if math.isinf(side) else side // divisor for side in parts[0])
        if isinstance(e, (Mod, PythonMod, sympy.Mod)) and isinstance(e.args[1], sympy.Integer) and e.args[1] > 0:
            return 0, int(e.args[1]) - 1
        return None

    return walk(expr)


def drop_decided_extrema(expr: sympy.Basic, symbols: Callable[[sympy.Symbol], Interval]) -> sympy.Basic:
    """``expr`` with each Max/Min whose winner the symbols' ranges decide replaced by that
    argument: ``Max(0, s - 7)`` is ``s - 7`` where the graph guarantees s >= 8."""

    def decided(e: sympy.Basic) -> sympy.Basic:
        larger = isinstance(e, (sympy.Max, Max))
        winner = e.args[0]
        for challenger in e.args[1:]:
            gap = value_range(sympy.expand(winner - challenger), symbols, lambda f: None)
            if gap is None:
                return e
            winner_at_least, winner_at_most = gap[0] >= 0, gap[1] <= 0
            if winner_at_least == winner_at_most:  # neither always wins (or both equal: keep)
                if not winner_at_least:
                    return e
            elif winner_at_most == larger:
                winner = challenger
        return winner

    return expr.replace(lambda e: isinstance(e, (sympy.Max, sympy.Min, Max, Min)), decided)
