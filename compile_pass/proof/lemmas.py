"""Lemmas: library idioms proved once, as a whole, where the op-by-op semantics would lose what
they compute. Each is registered in the engine's op table under the op that ends the idiom
and returns None where its pattern does not match (the op's own handler then runs).

Packed-sequence ids (transformers' ``find_packed_sequence_indices``):

    ids = (diff(P, prepend=P[..., :1] - 1) != 1).cumsum(-1)

Claim: ids[b, i] == ids[b, j] exactly when no position between i and j (after the first)
starts a new sequence, i.e. each P[b, k] there equals P[b, k - 1] + 1 modulo 2**bits. Proof:
the summand is 1 exactly at those starts, and the first element's difference is 1 by the
prepend (modulo 2**bits too), so the running count of starts is equal at i and j exactly when
none lies in (min(i, j), max(i, j)]. Where P has one row expanded over the batch (a (1, S)
``position_ids`` with a larger batch), every row's ids are row 0's, and the claim holds with
P[0, k] for P[b, k]. Only the ids' equality is used (``band.py``), and the op
is handed the ids themselves, so wrapped differences do no harm: the ids are an atom
(``AtomKind.SEGMENTS``) over the input P, read through nothing but that equality.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

from .atoms import AtomKind
from .engine import INTEGER_DTYPES, POS, TABLE, Formula, MaskEvaluator, functions, methods, shape_of, tensor_meta


@TABLE.lemma(*methods("cumsum"), *functions(torch.cumsum))
def packed_sequence_ids(ev: MaskEvaluator, node: torch.fx.Node, call) -> Formula | None:
    """``cumsum`` of the starts of packed sequences in a graph input's positions: the ids as a
    segments atom, else None."""
    summand, dim = call["input"], call["dim"]
    ndim = len(shape_of(node))
    dim = dim + ndim if dim < 0 else dim
    # Read before evaluating the summand: a difference of input positions may wrap, which the
    # ids' equality does not mind but a comparison of its exact value would.
    found = _positions_input(ev, summand, dim) if isinstance(summand, torch.fx.Node) else None
    if found is None:
        return None
    positions, row0 = found
    atom = ev.atoms.new(AtomKind.SEGMENTS, node, positions.function.__name__, source=positions, source_row0=row0)
    return ev.formula(node, atom.function(*POS[:ndim]))


def _positions_input(ev: MaskEvaluator, summand: torch.fx.Node, dim: int):
    """(the input atom P, whether every row is P's row 0) when ``summand`` is ``diff(P,
    prepend=P[..., :1] - 1) != 1`` along ``dim``, P's last dimension, else None. P is read at
    its own positions, or, for (batch, position) positions, at row 0 for every row (a (1, S)
    input expanded over the batch: each row's ids are then row 0's). The pattern's nodes are
    read by their calls, not evaluated: each must be unwritten."""
    starts = ev.calls.read(summand) if summand.op == "call_function" and summand.target is operator.ne else None
    if starts is None or starts.first(2)[1] != 1 or ev.writes.writer(summand) is not None:
        return None
    difference = starts.first(2)[0]
    if not (isinstance(difference, torch.fx.Node) and difference.target is torch.diff):
        return None
    if ev.writes.writer(difference) is not None:
        return None
    call = ev.calls.read(difference)
    if call is None or call["n"] != 1 or call["append"] is not None or call["prepend"] is None:
        return None
    values, before = ev.tensor(call["input"]), ev.tensor(call["prepend"])
    if not all(dtype in INTEGER_DTYPES for dtype in (values.dtype, before.dtype, tensor_meta(difference).dtype)):
        return None  # a float cast of the positions may round: its differences say nothing exact
    if call["dim"] not in (-1, dim) or not isinstance(values.expr, sympy.core.function.AppliedUndef):
        return None
    args = values.expr.args
    row0 = values.ndim == 2 and len(args) == 2 and args[0] == 0 and args[1] == POS[1]
    if (
        values.ndim != dim + 1
        or len(args) != values.ndim
        or not (row0 or all(arg == POS[k] or (arg == 0 and values.shape[k] == 1) for k, arg in enumerate(args)))
    ):
        return None  # P read at its own positions (a size-1 dimension's one position is 0)
    # prepend must be P at position 0 of dim, minus 1 (modulo 2**bits: the first token never
    # starts a new segment).
    if sympy.simplify(before.expr - (values.expr.xreplace({POS[dim]: sympy.Integer(0)}) - 1)) != 0:
        return None
    atom = ev.atoms.of(values.expr)
    return (atom, row0) if atom is not None and atom.kind is AtomKind.INPUT else None
