"""Atoms: the uninterpreted functions that stand for values the proof does not compute.

A formula over a graph input's data, over packed-sequence ids, or over an intermediate the
proof could not evaluate exactly reads that tensor's values as ``f(p0, p1, ...)``, a sympy
function of its positions: sympy then applies only identities that hold whatever the values
(``f(p) == f(p)``). Each function is registered here with what it stands for, so analyses ask
the registry (``Atoms.of``) what a function is instead of parsing its name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import sympy
import torch.fx


class AtomKind(enum.Enum):
    """What an atom stands for; the value is the prefix its function's name shows in reasons."""

    INPUT = "input:"  # a graph input's data: anything its dtype holds
    SEGMENTS = "segments:"  # packed-sequence ids a lemma proved from an input's positions
    OPAQUE = "data:"  # an intermediate the proof could not compute exactly (``why`` says why)


@dataclass(frozen=True, eq=False)
class Atom:
    kind: AtomKind
    node: torch.fx.Node  # the tensor whose values it stands for
    function: sympy.FunctionClass
    why: str = ""  # OPAQUE: why the values were not computed
    source: Atom | None = None  # SEGMENTS: the input whose positions the ids are computed from
    # SEGMENTS: every row of the ids is computed from the source's row 0 (positions of shape
    # (1, S) expanded over the batch), not from the same row.
    source_row0: bool = False
    # INPUT: the range its values are taken to lie in, [low, high), where a rule checks that at
    # run time before it relies on anything proved with it (``MaskEvaluator.assuming``).
    assumed_range: tuple[int, int] | None = None
    # OPAQUE: an interval [low, high] its values were proven to lie in (a count of flags).
    known_range: tuple[int, int] | None = None

    @property
    def shown(self) -> str:
        """The name reasons give it: an input's own name (``attention_mask``), a segment id's
        input's, an intermediate's node."""
        if self.source is not None:
            return self.source.shown
        return self.function.__name__.removeprefix(self.kind.value)


class Atoms:
    """Every atom of one rewrite, one per node. Two nodes never share a function, or sympy
    would read x(p) == y(p) as true: node names restart in each checkpoint body, and input
    names drop Dynamo's prefixes, so a taken name gets a ``#n`` suffix."""

    def __init__(self, assumed_ranges: dict[torch.fx.Node, tuple[int, int]] | None = None):
        self._assumed_ranges = dict(assumed_ranges or {})
        self._by_node: dict[torch.fx.Node, Atom] = {}
        self._by_function: dict[sympy.FunctionClass, Atom] = {}
        self._names: set[str] = set()

    def new(
        self,
        kind: AtomKind,
        node: torch.fx.Node,
        label: str,
        *,
        why: str = "",
        source: Atom | None = None,
        known_range: tuple[int, int] | None = None,
        source_row0: bool = False,
    ) -> Atom:
        """The atom standing for ``node``'s values (made on first use; ``label`` is what
        reasons show after the kind's prefix)."""
        if node in self._by_node:
            return self._by_node[node]
        readable = kind.value + label
        name, count = readable, 1
        while name in self._names:
            count += 1
            name = f"{readable}#{count}"
        self._names.add(name)
        assumed = self._assumed_ranges.get(node) if kind is AtomKind.INPUT else None
        atom = Atom(kind, node, sympy.Function(name), why, source, source_row0, assumed, known_range)
        self._by_node[node] = atom
        self._by_function[atom.function] = atom
        return atom

    def of(self, application: sympy.Basic) -> Atom | None:
        """The atom an application ``f(...)`` (or a function ``f``) stands for, else None."""
        function = application.func if isinstance(application, sympy.core.function.AppliedUndef) else application
        return self._by_function.get(function)

    def of_kind(self, kind: AtomKind) -> list[Atom]:
        return [atom for atom in self._by_node.values() if atom.kind is kind]

    def in_expr(self, expr: sympy.Basic) -> list[Atom]:
        """The atoms ``expr`` reads, by their functions' names."""
        found = {self.of(application) for application in expr.atoms(sympy.core.function.AppliedUndef)}
        return sorted((atom for atom in found if atom is not None), key=lambda atom: atom.function.__name__)
