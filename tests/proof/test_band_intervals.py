"""A boolean combination of bounds on d = kv - q is read as the set of distances it accepts
(``proof.band._interval``): checked against evaluating the formula at every distance around
its thresholds, for random formulas of OR, AND, XOR and NOT over random bounds."""

import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_pass.proof.band import KEY, QUERY, _interval

DISTANCE = KEY - QUERY
RELATIONS = (sympy.Le, sympy.Lt, sympy.Ge, sympy.Gt, sympy.Eq)
# Every threshold lies in [-6, 6]: the distances below decide every piece.
SPAN = range(-12, 13)


def _bound():
    return st.builds(
        lambda relation, constant, flip: relation(-DISTANCE, -constant) if flip else relation(DISTANCE, constant),
        st.sampled_from(RELATIONS),
        st.integers(-6, 6),
        st.booleans(),
    )


formulas = st.recursive(
    _bound(),
    lambda inner: st.one_of(
        st.builds(sympy.Or, inner, inner),
        st.builds(sympy.And, inner, inner),
        st.builds(sympy.Xor, inner, inner),
        st.builds(sympy.Not, inner),
    ),
    max_leaves=6,
)


def _accepts(formula, d) -> bool:
    return bool(formula.xreplace({QUERY: sympy.Integer(0), KEY: sympy.Integer(d)}))


@settings(max_examples=300, deadline=None)
@given(formulas)
def test_interval_is_exactly_the_distances_the_formula_accepts(formula):
    if not isinstance(formula, sympy.logic.boolalg.Boolean) or formula in (sympy.true, sympy.false):
        return  # sympy decided it on construction: nothing for the reader to read
    accepted = [d for d in SPAN if _accepts(formula, d)]
    found = _interval(formula)
    assert found is not None, formula
    if found == "is all false":
        assert not accepted, (formula, accepted)
    elif isinstance(found, str):  # not one interval
        assert accepted and accepted != list(range(accepted[0], accepted[-1] + 1)), (formula, accepted)
    else:
        lower, upper = found
        expected = [d for d in SPAN if (lower is None or lower <= d) and (upper is None or d <= upper)]
        assert accepted == expected, (formula, found, accepted)
        # An open side is open: the formula accepts beyond every threshold on that side.
        assert (lower is None) == _accepts(formula, -(10**6)) and (upper is None) == _accepts(formula, 10**6), (
            formula,
            found,
        )
