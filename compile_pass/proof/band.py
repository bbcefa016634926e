"""From a mask's formula to a band: mask(b, h, i, j) holds exactly when -left <= j - i <= right.

The formula must be a conjunction of bounds on ``j - i`` with integer constants, plus at most
one key padding ``P[b, j] != 0`` and one packed-sequence term ``seg[b, i] == seg[b, j]``, both
read from graph inputs the op is then given; sympy has already folded constant terms (a
packed-sequence id proven constant compares equal to itself and becomes True). Anything
else (a disjunction, a bound on ``i`` or ``j`` alone, a bound that depends on the sequence
length, a batch or head position, or on input data) is unproven.

Bounds on input positions are never read as bounds on ``j - i``: within a packed sequence
consecutive positions differ by 1 only modulo 2**64 (the ids come from wrapping int64
differences), so ``P[b, j] <= P[b, i]`` need not mean ``j <= i`` for arbitrary input data.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ops.window import UNBOUNDED
from .ranges import SIZE_LIMIT
from .symbolic import DATA_PREFIX, INPUT_PREFIX, POS, SEGMENTS_PREFIX, Formula, Unproven, _right_aligned

BATCH, HEAD = POS[:2]
# The query and key positions once FA2's alignment is applied: kv here is the key's distance
# past the query's aligned key, negative as often as not, so these symbols carry no sign
# (POS symbols are nonnegative, and sympy would fold kv + 15 > 11 to True with them).
QUERY, KEY = sympy.Symbol("q", integer=True), sympy.Symbol("kv", integer=True)
_READABLE = {BATCH: sympy.Symbol("b"), HEAD: sympy.Symbol("h")}


def _readable(relation: sympy.Basic) -> str:
    return str(relation.xreplace(_READABLE))


@dataclass(frozen=True)
class Band:
    """FA2 window over positions with Sq == Sk; UNBOUNDED (-1) drops a side. ``key_padding``
    names a graph input P (batch, Sk) when the mask is the band AND P[b, kv] != 0."""

    left: int
    right: int
    key_padding: str | None = None
    # The mask reads P[0, kv] for every batch row instead of P[b, kv]: the same padding only
    # when P and the call have batch 1, which the rule checks.
    key_padding_row0: bool = False
    # A packed-sequence id function (symbolic.SEGMENTS_PREFIX + input): the band holds only
    # within segments, AND segments(b, q) == segments(b, kv).
    segments: str | None = None
    # Read off a float mask (0 on the band, -inf or the dtype minimum elsewhere): equal to the
    # boolean band only on rows that keep a visible key, which the rules check.
    additive: bool = False

    def describe(self) -> str:
        text = f"window ({self.left}, {self.right})"
        if self.additive:
            text += " (additive mask)"
        if self.key_padding:
            text += f", key padding from {self.key_padding.removeprefix(INPUT_PREFIX)}"
        if self.segments:
            text += f", packed sequences from {self.segments.removeprefix(SEGMENTS_PREFIX + INPUT_PREFIX)}"
        return text


def _input_functions(expr: sympy.Basic) -> set[str]:
    return {f.func.__name__ for f in expr.atoms(sympy.core.function.AppliedUndef)}


def _same_segment(term: sympy.Basic) -> str | None:
    """The segment function of a term ``segments(b, q) == segments(b, kv)``, else None."""
    if not isinstance(term, sympy.Eq):
        return None
    sides = {term.lhs, term.rhs}
    for side in sides:
        if isinstance(side, sympy.core.function.AppliedUndef) and side.func.__name__.startswith(SEGMENTS_PREFIX):
            if {side.func(BATCH, QUERY), side.func(BATCH, KEY)} == sides:
                return side.func.__name__
    return None


def _key_padding(term: sympy.Basic) -> tuple[str, bool] | None:
    """(input, reads row 0) for a term ``P(b, kv) != 0`` or ``P(0, kv) != 0``, else None.

    Row 0 is what a batch-1 input gives: its one batch position is pinned to 0.
    """
    if isinstance(term, sympy.Ne) and term.rhs == 0 and isinstance(term.lhs, sympy.core.function.AppliedUndef):
        if term.lhs.func.__name__.startswith(INPUT_PREFIX) and term.lhs.args in ((BATCH, KEY), (0, KEY)):
            return term.lhs.func.__name__, term.lhs.args[0] == 0
    return None


def _bound(relation: sympy.Basic):
    """(lower, upper) integer bounds on j - i that ``relation`` states exactly, or a reason."""
    if not isinstance(relation, (sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge, sympy.Eq)):
        return f"term {_readable(relation)} is not a bound on kv - q"
    difference = sympy.expand(relation.lhs - relation.rhs)
    if difference.free_symbols & {BATCH, HEAD}:
        return f"term {_readable(relation)} depends on the batch or head position"
    coef_q, coef_k = sympy.diff(difference, QUERY), sympy.diff(difference, KEY)
    rest = sympy.expand(difference - coef_q * QUERY - coef_k * KEY)
    if not (coef_q.is_number and coef_k.is_number) or coef_k == 0 or coef_q != -coef_k:
        return f"term {_readable(relation)} is not a bound on kv - q"
    if rest.free_symbols:
        return f"term {_readable(relation)} depends on sizes ({', '.join(sorted(map(str, rest.free_symbols)))})"
    # relation is: coef_k * (j - i) + rest  <op>  0, i.e. (j - i) <op'> limit
    limit = -rest / coef_k
    op = type(relation)
    if coef_k < 0:
        op = {sympy.Lt: sympy.Gt, sympy.Le: sympy.Ge, sympy.Gt: sympy.Lt, sympy.Ge: sympy.Le}.get(op, op)
    if op is sympy.Eq:
        if not limit.is_integer:
            return "is all false"
        return int(limit), int(limit)
    # Integer positions: d < c is d <= ceil(c) - 1, d > c is d >= floor(c) + 1.
    if op is sympy.Lt:
        return None, int(sympy.ceiling(limit)) - 1
    if op is sympy.Le:
        return None, int(sympy.floor(limit))
    if op is sympy.Gt:
        return int(sympy.floor(limit)) + 1, None
    return int(sympy.ceiling(limit)), None


def _unfold_abs(relation: sympy.Basic) -> list[sympy.Basic]:
    """``|e| <= c`` is ``-c <= e <= c`` (likewise ``<``); other relations stay as they are."""
    if isinstance(relation, (sympy.Ge, sympy.Gt)):
        relation = relation.reversed  # c >= |e|  ->  |e| <= c
    if isinstance(relation, (sympy.Le, sympy.Lt)) and isinstance(relation.lhs, sympy.Abs):
        inner, bound = relation.lhs.args[0], relation.rhs
        return [type(relation)(inner, bound), type(relation)(-bound, inner)]
    return [relation]  # |e| >= c and the like are not bands: _bound says why


def _conjuncts(expr: sympy.Basic) -> list[sympy.Basic]:
    if isinstance(expr, sympy.And):
        return [term for arg in expr.args for term in _conjuncts(arg)]
    if isinstance(expr, sympy.Rel) and expr.has(sympy.Abs):
        return _unfold_abs(expr)
    return [expr]


def _data_reason(term: sympy.Basic, reasons: list[str]) -> str:
    """Why a term over values the proof could not compute is not proven, in the terms of the
    first of them; a window joined by OR with such a term (a bidirectional image block, say)
    is named as such."""
    why = reasons[0]
    if isinstance(term, sympy.Or):
        return f"is a window OR a term over values it cannot read as positions ({why}): not one FA2 window"
    return why


def band_of(
    mask: Formula,
    key_offset: sympy.Expr = sympy.Integer(0),
    single_query: bool = False,
    data_reasons: dict[str, str] | None = None,
) -> Band | Unproven:
    """The FA2 band of a boolean mask broadcast to (batch, heads, Sq, Sk).

    ``key_offset`` is Sk - Sq: FA2 aligns query i with key i + Sk - Sq, so the bounds are
    read off mask(i, j + key_offset) and must come out constant; a mask aligned any other
    way leaves the sizes in them and stays unproven. ``single_query`` says the attention has
    exactly one query row (the caller checks Sq == 1), whose position is 0. ``data_reasons``
    says why each opaque value (``symbolic.DATA_PREFIX``) could not be computed.
    """
    data_reasons = data_reasons or {}
    if not mask.is_bool:
        return Unproven("is not boolean")
    if mask.ndim > 4:
        return Unproven("has more than 4 dimensions")
    expr = _right_aligned(mask, 4).xreplace({POS[2]: QUERY, POS[3]: KEY + key_offset})
    if single_query:
        # One query row (a decoding step): its position is 0, so kv is kv - q there, and a
        # bound on the key alone is a bound on kv - q.
        expr = expr.xreplace({KEY: KEY - QUERY})
    if expr is sympy.false:
        return Unproven("is all false")
    terms = _conjuncts(expr)
    segments = {name for name in map(_same_segment, terms) if name is not None}
    if len(segments) > 1:
        return Unproven("has several packed-sequence ids")
    if segments:
        if key_offset != 0:
            return Unproven("has packed sequences with Sq != Sk")
        terms = [t for t in terms if _same_segment(t) is None]
    lowers, uppers, paddings = [], [], set()
    for term in terms:
        if term is sympy.true:
            continue
        padding = _key_padding(term)
        if padding is not None:
            paddings.add(padding)
            continue
        inputs = _input_functions(term)
        data = sorted(name for name in inputs if name.startswith(DATA_PREFIX))
        if data:
            return Unproven(_data_reason(term, [data_reasons.get(name, name) for name in data]))
        if inputs:
            names = ", ".join(sorted(name.removeprefix(INPUT_PREFIX).removeprefix(SEGMENTS_PREFIX + INPUT_PREFIX) for name in inputs))
            return Unproven(f"depends on input {names}")
        bound = _bound(term)
        if isinstance(bound, str):
            return Unproven(bound)
        lower, upper = bound
        if lower is not None:
            lowers.append(lower)
        if upper is not None:
            uppers.append(upper)
    lower = max(lowers) if lowers else None
    upper = min(uppers) if uppers else None
    if lower is not None and upper is not None and lower > upper:
        return Unproven("is all false")
    if (lower is not None and lower > 0) or (upper is not None and upper < 0):
        return Unproven("excludes the aligned diagonal (kv == q + Sk - Sq): not an FA2 window")
    # No two positions are SIZE_LIMIT apart: a bound that far out bounds nothing (and would
    # not fit the op's int64 window arguments).
    lower = None if lower is not None and lower <= -SIZE_LIMIT else lower
    upper = None if upper is not None and upper >= SIZE_LIMIT else upper
    if paddings and key_offset != 0:
        return Unproven("has key padding with Sq != Sk")
    if len(paddings) > 1:
        names = sorted({name.removeprefix(INPUT_PREFIX) for name, _ in paddings})
        return Unproven(f"depends on inputs {', '.join(names)} (several key paddings)")
    padding, row0 = paddings.pop() if paddings else (None, False)
    return Band(
        UNBOUNDED if lower is None else -lower,
        UNBOUNDED if upper is None else upper,
        key_padding=padding,
        key_padding_row0=row0,
        segments=segments.pop() if segments else None,
    )
