"""From a mask's formula to a band: mask(b, h, i, j) holds exactly when -left <= j - i <= right.

The formula must be a conjunction of bounds on ``j - i`` with integer constants, plus at most
one key padding ``P[b, j + o] != 0`` (o free of positions: a prefill chunk after a cache
reads the padding from the cache's first token on) and up to two segment terms ``S(b, i) == S(b, j)``, each the same
integer expression S of the row and one position on both sides (packed-sequence ids, an
input's or an intermediate's ids, fixed-size chunks ``(j + r(b)) // c``), whose values the op
is then given; sympy has already folded constant terms (a packed-sequence id proven constant
compares equal to itself and becomes True). One
disjunction is read: the upper bounds OR an image block,
``(j - i <= right) | (g[b, i] >= 0 & g[b, i] == g[b, j])`` with g any integer tensor the op is
given (transformers' sliding mask with bidirectional image blocks). Anything else (another
disjunction, a bound on ``i`` or ``j`` alone, a bound that depends on the sequence length, a
batch or head position, or on input data) is unproven.

Bounds on input positions are never read as bounds on ``j - i``: within a packed sequence
consecutive positions differ by 1 only modulo 2**64 (the ids come from wrapping int64
differences), so ``P[b, j] <= P[b, i]`` need not mean ``j <= i`` for arbitrary input data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy
from torch.utils._sympy.functions import FloorDiv

from ..window import UNBOUNDED
from .atoms import Atom, AtomKind, Atoms
from .engine import POS, Formula, Unproven, right_aligned
from .ranges import SIZE_LIMIT

BATCH, HEAD = POS[:2]
# The query and key positions once FA2's alignment is applied: kv here is the key's distance
# past the query's aligned key, negative as often as not, so these symbols carry no sign
# (POS symbols are nonnegative, and sympy would fold kv + 15 > 11 to True with them).
QUERY, KEY = sympy.Symbol("q", integer=True), sympy.Symbol("kv", integer=True)
_READABLE = {BATCH: sympy.Symbol("b"), HEAD: sympy.Symbol("h")}


def _readable(relation: sympy.Basic) -> str:
    return str(relation.xreplace(_READABLE))


@dataclass(frozen=True)
class SegmentIds:
    """The ids of a segment term ``ids(b, q) == ids(b, kv)``: ``expr`` is the id of key
    position KEY in batch row BATCH. ``atom`` when the ids are a tensor's values read at
    (b, kv) or (0, kv) (packed-sequence ids, an input, an intermediate); ``chunk`` c when they
    are ``(kv + r(b)) // c``: equal ids are then less than c apart."""

    expr: sympy.Expr
    atom: Atom | None = None
    chunk: int | None = None

    def at(self, row: sympy.Expr, position: sympy.Expr) -> sympy.Expr:
        """The id of ``position`` in batch row ``row``."""
        return self.expr.xreplace({BATCH: row, KEY: position})

    @property
    def row0(self) -> bool:
        """The atom is read at row 0 for every batch row (a batch-1 tensor's one row)."""
        return self.atom is not None and self.expr.args[0] == 0

    def describe(self) -> str:
        if self.atom is not None and self.atom.kind is AtomKind.SEGMENTS:
            return f"packed sequences from {self.atom.shown}"
        if self.atom is not None:
            return f"segment ids from {self.atom.shown}"
        shown = _readable(self.expr.xreplace(_indexed_atoms(self.expr)))
        return f"chunks of {self.chunk}: ids {shown}" if self.chunk else f"segment ids {shown}"


def _indexed_atoms(expr: sympy.Basic) -> dict:
    """Each atom application ``data:x(b)`` as a symbol ``x[b]``, as a user reads it."""
    shown = {}
    for application in expr.atoms(sympy.core.function.AppliedUndef):
        name = application.func.__name__
        for kind in AtomKind:
            name = name.removeprefix(kind.value)
        indices = ", ".join(str(arg.xreplace(_READABLE)) for arg in application.args)
        shown[application] = sympy.Symbol(f"{name}[{indices}]")
    return shown


@dataclass(frozen=True)
class Band:
    """FA2 window over positions with Sq == Sk; UNBOUNDED (-1) drops a side. ``key_padding``
    is a graph input P (batch, Sk) when the mask is the band AND P[b, kv] != 0."""

    left: int
    right: int
    key_padding: Atom | None = None
    # The mask reads P[0, kv] for every batch row instead of P[b, kv]: the same padding only
    # when P and the call have batch 1, which the rule checks.
    key_padding_row0: bool = False
    # Key j's padding is P[b, j + key_padding_offset]: an expression of sizes (a prefill
    # chunk's cache length, say); P may hold more columns than the call has keys.
    key_padding_offset: sympy.Expr = sympy.Integer(0)
    # Segment ids: the band holds only within segments, AND ids(b, q) == ids(b, kv) for each
    # set (at most two: a packed batch's sequences and chunks).
    segments: tuple[SegmentIds, ...] = ()
    # Image block ids g: a row whose id is >= 0 also sees every key of its id that the left
    # side allows, (kv - q <= right) OR (g(b, q) >= 0 AND g(b, q) == g(b, kv)).
    blocks: Atom | None = None
    blocks_row0: bool = False
    # Inputs whose values were taken to lie in a range (``Atom.assumed_range``): the band is
    # the mask only where they do, which the rewrite must check at run time.
    assumes: tuple[Atom, ...] = ()
    # Read off a float mask (0 on the band, -inf or the dtype minimum elsewhere): equal to the
    # boolean band only on rows that keep a visible key, which the rules check.
    additive: bool = False

    @property
    def window_only(self) -> bool:
        """Whether the mask is the window alone: every other field at its default (no batch
        term, nothing assumed), so a term added to Band later is never ignored."""
        return self == Band(self.left, self.right, additive=self.additive)

    def describe(self) -> str:
        text = f"window ({self.left}, {self.right})"
        if self.additive:
            text += " (additive mask)"
        if self.key_padding:
            text += f", key padding from {self.key_padding.shown}"
            if self.key_padding_offset != 0:
                text += f" shifted by {self.key_padding_offset}"
        for segments in self.segments:
            text += f", {segments.describe()}"
        if self.blocks:
            text += f", image blocks from {self.blocks.shown}"
        if self.assumes:
            text += " (positions checked at run time)"
        return text


def _segment_ids(term: sympy.Basic, atoms: Atoms) -> SegmentIds | None:
    """The ids of a term ``S(b, q) == S(b, kv)``: one integer expression of the batch row
    and a position on both sides, read at the query and at the key, else None."""
    if not isinstance(term, sympy.Eq) or not isinstance(_bound(term), str):
        return None  # kv == q + c is a window, (c, -c)
    for side, other in ((term.lhs, term.rhs), (term.rhs, term.lhs)):
        if (
            isinstance(side, sympy.logic.boolalg.Boolean)
            or not side.free_symbols <= {BATCH, KEY}
            or KEY not in side.free_symbols
        ):
            continue
        if side.xreplace({KEY: QUERY}) != other:
            continue
        atom = atoms.of(side) if isinstance(side, sympy.core.function.AppliedUndef) else None
        if atom is not None and side.args in ((BATCH, KEY), (0, KEY)):
            return SegmentIds(side, atom)
        return SegmentIds(side, chunk=_chunk(side))
    return None


def _chunk(ids: sympy.Expr) -> int | None:
    """c where ``ids`` is ``(kv + r) // c`` plus terms without kv, r free of kv: two keys
    with equal ids then lie in one run [m * c - r, m * c - r + c - 1]."""
    parts = sympy.Add.make_args(ids)
    divisions = [part for part in parts if KEY in part.free_symbols]
    if len(divisions) != 1 or not isinstance(divisions[0], FloorDiv):
        return None
    dividend, divisor = divisions[0].args
    if not (isinstance(divisor, sympy.Integer) and divisor > 0):
        return None
    rest = sympy.expand(dividend - KEY)
    return int(divisor) if KEY not in rest.free_symbols else None


def _image_block(term: sympy.Basic, atoms: Atoms) -> tuple[Atom, bool] | None:
    """(ids atom, reads row 0) of a term ``g(b, q) >= 0 & g(b, q) == g(b, kv)`` (or with the
    sign test on g(b, kv), equal under the equality; ``> -1`` alike, g being integer), for g
    a graph input or an intermediate the op is given, else None."""
    if not isinstance(term, sympy.And) or len(term.args) != 2:
        return None
    same = next((arg for arg in term.args if isinstance(arg, sympy.Eq)), None)
    sign = next((arg for arg in term.args if arg is not same), None)
    if same is None or not isinstance(sign, (sympy.Ge, sympy.Gt)):
        return None
    sides = {same.lhs, same.rhs}
    for side in sides:
        atom = atoms.of(side)
        if atom is None or atom.kind not in (AtomKind.INPUT, AtomKind.OPAQUE):
            continue
        for row in (BATCH, 0):
            if {side.func(row, QUERY), side.func(row, KEY)} == sides:
                threshold = {sympy.Ge: 0, sympy.Gt: -1}[type(sign)]
                if sign.lhs in sides and sign.rhs == threshold:
                    return atom, row == 0
    return None


def _beyond_right(term: sympy.Basic, atoms: Atoms):
    """(upper bound on kv - q, (ids atom, row 0)) of a term ``upper | image block``, a
    reason when it is such a term the op does not compute, else None."""
    if not isinstance(term, sympy.Or):
        return None
    blocks = [found for arg in term.args if (found := _image_block(arg, atoms)) is not None]
    if len(blocks) != 1 or len(term.args) != 2:
        return None
    (bounded,) = [arg for arg in term.args if _image_block(arg, atoms) is None]
    if atoms.in_expr(bounded):
        return None
    uppers = []
    for relation in _conjuncts(bounded):
        bound = _bound(relation)
        if isinstance(bound, str) or bound[0] is not None:
            return f"is a window OR an image block where the window's side is {_readable(relation)}: not the op's form"
        uppers.append(bound[1])
    return min(uppers), blocks[0]


def _within_segment(term: sympy.Basic, positions: Atom, row) -> sympy.Basic:
    """``term`` read inside one packed sequence, where positions are consecutive: the ids
    change wherever a position is not its predecessor + 1 (``lemmas.packed_sequence_ids``),
    exactly so for positions in the assumed range (no difference wraps), so
    P(row, kv) = P(row, q) + (kv - q) whenever the ids of q and kv at that row are equal.
    Only the row the ids are read at: equal ids say nothing of another row's positions. A
    relation is then moved to one side, where P(row, q) cancels from a bound on the distance."""
    function = positions.function
    replaced = term.xreplace({function(row, KEY): function(row, QUERY) + KEY - QUERY})
    if replaced is term or not isinstance(replaced, (sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge, sympy.Eq, sympy.Ne)):
        return replaced
    return type(replaced)(sympy.expand(replaced.lhs - replaced.rhs), 0)


def _key_padding(term: sympy.Basic, atoms: Atoms, shift: sympy.Expr) -> tuple[Atom, bool, sympy.Expr] | None:
    """(input, reads row 0, offset o) for a term ``P(b, kv + s) != 0`` or ``P(0, kv + s) !=
    0``, s free of every position, else None; P a graph input or an intermediate the op is
    given (data the proof did not compute: the op reads the same tensor). The formula's kv is key j less ``shift``
    (FA2's alignment), so key j's padding is P(b, j + o) with o = s - shift.

    Row 0 is what a batch-1 input gives: its one batch position is pinned to 0.
    """
    if not (isinstance(term, sympy.Ne) and term.rhs == 0):
        return None
    atom = atoms.of(term.lhs)
    if atom is None or atom.kind not in (AtomKind.INPUT, AtomKind.OPAQUE) or len(term.lhs.args) != 2:
        return None
    row, position = term.lhs.args
    offset = sympy.expand(position - KEY - shift)
    if row not in (BATCH, 0) or offset.free_symbols & {BATCH, HEAD, QUERY, KEY}:
        return None
    return atom, row == 0, offset


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


def _interval(term: sympy.Basic):
    """(lower, upper) integer bounds on j - i equivalent to ``term``, a boolean combination (OR,
    NOT, XOR) of bounds on j - i and nothing else, or a reason; None where ``term`` reads
    anything else. nanoGPT's ``(tril(ones) - tril(ones, -w)).bool()`` is
    ``(d <= 0 | d <= -w) & ~(d <= 0 & d <= -w)``: its conjuncts are intervals of d. Exact: each
    bound's truth changes only at its threshold, so one d from each piece between thresholds
    tells which integers the term accepts; a band is one run of pieces."""
    term = term.replace(lambda e: isinstance(e, sympy.Rel) and e.has(sympy.Abs), _without_abs)
    relations = term.atoms(sympy.Rel)
    bounds, stand_ins = {}, {}  # a symbol per relation, and its bounds (an Ne: NOT its Eq's)
    for relation in relations:
        negated = isinstance(relation, sympy.Ne)
        bound = _bound(sympy.Eq(relation.lhs, relation.rhs, evaluate=False) if negated else relation)
        if isinstance(bound, str):
            return None
        symbol = sympy.Dummy()
        bounds[symbol], stand_ins[relation] = bound, sympy.Not(symbol) if negated else symbol
    skeleton = term.xreplace(stand_ins)
    if not relations or not skeleton.free_symbols <= set(bounds):
        return None
    cuts = sorted(
        {
            cut
            for lower, upper in bounds.values()
            for cut in (lower, None if upper is None else upper + 1)
            if cut is not None
        }
    )
    pieces = [cuts[0] - 1, *cuts]  # piece k holds d in [pieces[k], pieces[k + 1])
    truths = [
        skeleton.xreplace(
            {
                symbol: sympy.true if (lower is None or lower <= d) and (upper is None or d <= upper) else sympy.false
                for symbol, (lower, upper) in bounds.items()
            }
        )
        for d in pieces
    ]
    if any(truth not in (sympy.true, sympy.false) for truth in truths):
        return None
    accepted = [index for index, truth in enumerate(truths) if truth is sympy.true]
    if not accepted:
        return "is all false"
    if accepted != list(range(accepted[0], accepted[-1] + 1)):
        return f"term {_readable(term)} is not one interval of kv - q"
    lower = None if accepted[0] == 0 else pieces[accepted[0]]
    upper = None if accepted[-1] == len(pieces) - 1 else pieces[accepted[-1] + 1] - 1
    return lower, upper


def _without_abs(relation: sympy.Basic) -> sympy.Basic:
    """A relation between ``|e|`` and a ``c`` free of ``Abs`` as the same relation on ``e``,
    exact for every integer e: ``|e| <= c`` is ``-c <= e AND e <= c``, ``|e| >= c`` is
    ``e >= c OR e <= -c`` (likewise the strict ones; either side may hold the Abs). Any other
    relation is returned as it is, for ``_bound`` to say why it is not a bound."""
    if not isinstance(relation, (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt)):
        return relation
    if isinstance(relation.rhs, sympy.Abs) and not isinstance(relation.lhs, sympy.Abs):
        relation = relation.reversed  # c >= |e|  ->  |e| <= c
    if not isinstance(relation.lhs, sympy.Abs) or relation.rhs.has(sympy.Abs):
        return relation
    inner, bound = relation.lhs.args[0], relation.rhs
    if isinstance(relation, (sympy.Le, sympy.Lt)):
        return sympy.And(type(relation)(inner, bound), type(relation)(-bound, inner), evaluate=False)
    return sympy.Or(type(relation)(inner, bound), type(relation)(-bound, inner), evaluate=False)


def _conjuncts(expr: sympy.Basic) -> list[sympy.Basic]:
    if isinstance(expr, sympy.And):
        return [term for arg in expr.args for term in _conjuncts(arg)]
    if isinstance(expr, sympy.Rel) and expr.has(sympy.Abs):
        unfolded = _without_abs(expr)  # |e| <= c: two conjuncts
        return list(unfolded.args) if isinstance(unfolded, sympy.And) else [unfolded]
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
    atoms: Atoms,
    key_offset: sympy.Expr = sympy.S.Zero,
    single_query: bool = False,
) -> Band | Unproven:
    """The FA2 band of a boolean mask broadcast to (batch, heads, Sq, Sk).

    ``key_offset`` is Sk - Sq: FA2 aligns query i with key i + Sk - Sq, so the bounds are
    read off mask(i, j + key_offset) and must come out constant; a mask aligned any other
    way leaves the sizes in them and stays unproven. ``single_query`` says the attention has
    exactly one query row (the caller checks Sq == 1), whose position is 0. ``atoms`` says
    what each function in the formula stands for.
    """
    if not mask.is_bool:
        return Unproven("is not boolean")
    if mask.ndim > 4:
        return Unproven("has more than 4 dimensions")
    expr = right_aligned(mask, 4).xreplace({POS[2]: QUERY, POS[3]: KEY + key_offset})
    # Key j is KEY + key_offset: a padding read at j reads there.
    shift = key_offset
    if single_query:
        # One query row (a decoding step): its position is 0, so kv is kv - q there, and a
        # bound on the key alone is a bound on kv - q.
        expr = expr.xreplace({KEY: KEY - QUERY})
        shift = key_offset - QUERY
    if expr is sympy.false:
        return Unproven("is all false")
    terms = _conjuncts(expr)
    ids_of = {term: _segment_ids(term, atoms) for term in terms}
    segments = tuple(dict.fromkeys(found for found in ids_of.values() if found is not None))
    if len(segments) > 2:
        return Unproven("has more than two sets of segment ids; the op takes two at most")
    if segments:
        if key_offset != 0:
            return Unproven("has segment ids with Sq != Sk")
        terms = [term for term in terms if ids_of[term] is None]
    for segment in segments:
        if (
            segment.atom is not None
            and segment.atom.kind is AtomKind.SEGMENTS
            and segment.atom.source.assumed_range is not None
        ):
            row = 0 if segment.row0 or segment.atom.source_row0 else BATCH  # the positions' row the ids come from
            terms = [_within_segment(term, segment.atom.source, row) for term in terms]
            # Another set of ids over the same positions (a packed batch's chunks, from
            # position values): inside a packed sequence they are chunks of consecutive keys.
            segments = tuple(
                dataclasses.replace(other, chunk=_chunk(_within_segment(other.expr, segment.atom.source, row)))
                if other is not segment and other.chunk is None
                else other
                for other in segments
            )
    lowers, uppers, paddings, blocks = [], [], set(), []
    for segment in segments:
        if segment.chunk:  # implied by equal ids: the mask is the same with it
            lowers.append(1 - segment.chunk)
            uppers.append(segment.chunk - 1)
    for term in terms:
        if term is sympy.true:
            continue
        beyond = _beyond_right(term, atoms)
        if isinstance(beyond, str):
            return Unproven(beyond)
        if beyond is not None:
            blocks.append(beyond)
            continue
        padding = _key_padding(term, atoms, shift)
        if padding is not None:
            paddings.add(padding)
            continue
        read = atoms.in_expr(term)
        opaque = [atom.why for atom in read if atom.kind is AtomKind.OPAQUE]
        if opaque:
            return Unproven(_data_reason(term, opaque))
        if read:
            return Unproven(f"depends on input {', '.join(sorted({atom.shown for atom in read}))}")
        bound = _bound(term) if isinstance(term, sympy.Rel) else (_interval(term) or _bound(term))
        if isinstance(bound, str):
            return Unproven(bound)
        lower, upper = bound
        if lower is not None:
            lowers.append(lower)
        if upper is not None:
            uppers.append(upper)
    if blocks:
        if len(blocks) > 1 or segments or key_offset != 0:
            return Unproven("has image blocks with several block terms, packed sequences or Sq != Sk")
        if uppers:  # an upper bound outside the OR would cut the image blocks too
            return Unproven("bounds kv - q from above outside its OR with image blocks: not the op's form")
        uppers.append(blocks[0][0])
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
    if len(paddings) > 1:
        names = sorted({atom.shown for atom, _, _ in paddings})
        return Unproven(f"depends on inputs {', '.join(names)} (several key paddings)")
    padding, row0, padding_offset = paddings.pop() if paddings else (None, False, sympy.Integer(0))
    block, blocks_row0 = blocks[0][1] if blocks else (None, False)
    return Band(
        UNBOUNDED if lower is None else -lower,
        UNBOUNDED if upper is None else upper,
        key_padding=padding,
        key_padding_row0=row0,
        key_padding_offset=padding_offset,
        segments=segments,
        blocks=block,
        blocks_row0=blocks_row0,
        assumes=tuple(atom for atom in atoms.of_kind(AtomKind.INPUT) if atom.assumed_range is not None),
    )
