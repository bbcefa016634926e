"""Comparisons, logic, selections and casts for the proof engine (see ``engine.py`` for the
invariant): relations become sympy relations (a clamp's as logic over its arguments, a value
defined by cases as logic over the cases), ``&``/``|``/``^``/``~`` on bool tensors, ``where``,
``tril``/``triu`` and dtype casts."""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

from ..graphs import describe
from .arithmetic import aligned_operands, op_name, spellings
from .engine import (
    EVALUATED_DTYPES,
    POS,
    TABLE,
    Formula,
    Reject,
    exact,
    functions,
    methods,
    right_aligned,
    shape_of,
    tensor_meta,
)
from .views import CASTS

# Each in its operator, torch function and Tensor method spellings (``spellings``).
_COMPARISONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"and": sympy.And, "or": sympy.Or, "xor": sympy.Xor}


def _compare(ev, node, call):
    (a, fa), (b, fb) = aligned_operands(ev, node, call, want_bool=False)
    for formula in (fa, fb):
        if formula is not None:
            exact(formula)
    return ev.formula(node, _without_extrema(_truth(_COMPARISONS[op_name(node)](a, b))))


_ORDERS = {sympy.Lt: False, sympy.Le: False, sympy.Gt: True, sympy.Ge: True}  # True: "greater than"


def _without_extrema(relation: sympy.Basic) -> sympy.Basic:
    """An order relation over a Max or Min (a clamp) as logic over its arguments, which
    band.py reads: ``e < c`` is moved to ``e - c < 0``, a sum with one extremum is the extremum
    of the sums (``Max(a, b) + r = Max(a + r, b + r)``, ``-Max(a, b) = Min(-a, -b)``), then
    ``Max(a, b) < 0`` is ``a < 0 & b < 0`` and ``Max(a, b) > 0`` is ``a > 0 | b > 0`` (Min
    the other way round). Anything else is returned as it was."""
    if type(relation) not in _ORDERS or not relation.has(sympy.Max, sympy.Min):
        return relation
    difference = sympy.expand(relation.lhs - relation.rhs)
    extrema = [term for term in sympy.Add.make_args(difference) if term.has(sympy.Max, sympy.Min)]
    if len(extrema) != 1:
        return relation
    (term,) = extrema
    sign, extremum = (1, term) if isinstance(term, (sympy.Max, sympy.Min)) else (-1, -term)
    if not isinstance(extremum, (sympy.Max, sympy.Min)):
        return relation
    rest = difference - term
    greatest = isinstance(extremum, sympy.Max) == (sign == 1)  # sign * extremum is a Max
    parts = [sympy.expand(sign * arg + rest) for arg in extremum.args]
    greater = _ORDERS[type(relation)]
    joined = sympy.Or if greatest == greater else sympy.And
    return joined(*(_without_extrema(type(relation)(part, 0)) for part in parts))


def _truth(relation: sympy.Basic) -> sympy.Basic:
    """A relation between values defined by cases (``tril`` of ones, a cast bool) as logic over
    the cases' conditions: band.py reads conjunctions of bounds, not cases."""
    if not relation.has(sympy.Piecewise):
        return relation
    folded = sympy.piecewise_fold(relation)
    if not isinstance(folded, sympy.Piecewise):
        return folded
    earlier, cases = sympy.false, []
    for value, condition in folded.args:
        cases.append(sympy.And(condition, sympy.Not(earlier), _truth(value)))
        earlier = sympy.Or(earlier, condition)
    return sympy.Or(*cases)


def _logic(ev, node, call):
    """Logic on bool tensors only: on integers ``&`` is bitwise and ``logical_and`` tests != 0."""
    (a, _), (b, _) = aligned_operands(ev, node, call, want_bool=True)
    return ev.formula(node, _LOGIC[op_name(node)](a, b))


def _invert(ev, node, call):
    (value,) = call.first(1)
    formula = ev.tensor(value)
    if not formula.is_bool:
        raise Reject("~ on a non-bool tensor (bitwise not)")
    return ev.formula(node, sympy.Not(formula.expr))


TABLE.handles(*spellings(_COMPARISONS, prefix=""))(_compare)
TABLE.handles(*spellings(_LOGIC, prefix="logical_"))(_logic)
TABLE.handles(
    *functions(operator.invert, torch.logical_not, torch.bitwise_not),
    *methods("logical_not", "bitwise_not", "__invert__"),
)(_invert)


@TABLE.handles(*CASTS)
def _to(ev, node, call):
    """Device moves and same-dtype casts keep values; casts between integer and float dtypes
    keep them where the target holds them exactly (``formula`` checks); a number -> bool is
    ``value != 0``, a bool -> number 1 or 0."""
    formula = ev.tensor(call["input"])
    source, target = formula.dtype, tensor_meta(node).dtype
    if source == target:
        return formula
    if target not in EVALUATED_DTYPES:
        raise Reject(f"{describe(node)} casts {source} to {target}")
    if target == torch.bool:
        return ev.formula(node, _truth(sympy.Ne(exact(formula).expr, 0)))
    if source == torch.bool:
        return ev.formula(node, sympy.Piecewise((1, formula.expr), (0, True)))
    return ev.formula(node, exact(formula).expr)  # formula checks the target holds every value


@TABLE.handles(*functions(torch.where))
def _where(ev, node, call):
    """``where(c, a, b)``: a where c holds, else b; operands broadcast right-aligned."""
    if "condition" not in call.arguments or "input" not in call.arguments:
        raise Reject("where with one argument (nonzero)")
    ndim = len(shape_of(node))
    condition = ev.tensor(call["condition"])
    if not condition.is_bool:
        raise Reject("where with a non-bool condition")
    want_bool = tensor_meta(node).dtype == torch.bool
    branches = []
    for value in (call["input"], call["other"]):
        if isinstance(value, bool) and want_bool:
            branches.append(sympy.true if value else sympy.false)
            continue
        operand = ev.operand(value)
        if isinstance(operand, Formula):
            if operand.is_bool != want_bool:
                raise Reject("where mixes bool and integer values")
            branches.append(right_aligned(exact(operand), ndim))
        elif want_bool:
            raise Reject("where with an integer value for a bool result")
        else:
            branches.append(operand)
    chosen, other = branches
    when = right_aligned(condition, ndim)
    if want_bool:
        return ev.formula(node, sympy.Or(sympy.And(when, chosen), sympy.And(sympy.Not(when), other)))
    return ev.formula(node, sympy.Piecewise((chosen, when), (other, True)))


@TABLE.handles(*methods("tril", "triu"))
@TABLE.handles(*functions(torch.tril, torch.triu))
def _triangle(ev, node, call):
    """``tril(d)`` keeps elements with column - row <= d, ``triu(d)`` those with column - row >= d;
    the others are 0 (False)."""
    formula = ev.tensor(call["input"])
    diagonal = call["diagonal"]
    if formula.ndim < 2 or not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise Reject(f"{describe(node)} of a vector or with a symbolic diagonal")
    row, column = POS[formula.ndim - 2], POS[formula.ndim - 1]
    name = node.target if node.op == "call_method" else node.target.__name__
    keep = sympy.Le(column - row, diagonal) if name == "tril" else sympy.Ge(column - row, diagonal)
    if formula.is_bool:
        return ev.formula(node, sympy.And(formula.expr, keep))
    return ev.formula(node, sympy.Piecewise((formula.expr, keep), (0, True)), formula.wraps)
