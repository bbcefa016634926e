"""The proof engine: symbolic evaluation of index-arithmetic subgraphs, FX nodes in, exact
formulas out. What each op computes lives in op tables (``arithmetic.py``, ``logic.py`` and
``views.py`` for torch's ops, ``lemmas.py`` for library idioms proved once); the engine only
dispatches, memoises and checks.

Each tensor in a mask's construction is evaluated to a ``Formula``: its shape (sympy
expressions, symbolic where the graph's sizes are) and one sympy expression giving the
element at position (p0, p1, ...) in terms of *position symbols* ``POS[k]``, one per
dimension. ``arange(n) + 3`` is ``POS[0] + 3`` with shape ``(n,)``; ``x[None, :]`` moves
``POS[0]`` to ``POS[1]``; ``a <= b`` is a sympy relational; ``&`` is ``sympy.And``.

The invariant, kept by every handler: substituting an in-bounds position into the
formula gives exactly the tensor's element. Handlers therefore accept only what they
can evaluate exactly, and reject the rest with a reason (``Unproven``):

- an allow-list of ops, each read by its signature (``calls.CallReader``);
- integer and boolean dtypes only (no float rounding);
- integer arithmetic proven not to wrap (``ranges.py``); a formula that may wrap is kept
  only as a value modulo 2**bits (``Formula.wraps``), which no comparison, index or cast
  may read;
- indices proven in range (no negative wrap-around, no clamped slice start);
- tensors no op may write, through any alias (``aliasing.py``).

Values the proof does not compute (graph inputs, intermediates it cannot evaluate) are
typed atoms (``atoms.py``). Sizes come from the FakeTensors Dynamo records in
``node.meta["example_value"]``; nothing here reads tensor data, guards on a size or trusts a
size hint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx
from torch.utils._sympy.functions import Max, Min

from ..calls import Call, CallReader
from ..graphs import REGISTRY_ENTRY, describe, qualified_name, source_line
from .aliasing import WriteAnalysis
from .atoms import AtomKind, Atoms
from .ranges import (
    DTYPE_RANGES,
    EXACT_FLOAT_RANGES,
    SIZE_LIMIT,
    Interval,
    drop_decided_extrema,
    fits,
    symbol_range,
    value_range,
)

MAX_DIMS = 8
POS = tuple(sympy.Symbol(f"_p{k}", integer=True, nonnegative=True) for k in range(MAX_DIMS))
INTEGER_DTYPES = tuple(DTYPE_RANGES)
# Dtypes whose values the proof computes: integers, bools, and floats holding integers exactly
# (``Formula.wraps`` says where a float may round instead).
EVALUATED_DTYPES = (*INTEGER_DTYPES, torch.bool, *EXACT_FLOAT_RANGES)


@dataclass(frozen=True)
class Formula:
    shape: tuple[sympy.Expr, ...]
    expr: sympy.Basic  # integer expression, or boolean for bool tensors
    dtype: torch.dtype
    # None when ``expr`` is the element's exact value; otherwise why it may have wrapped
    # around (the element is then ``expr`` modulo 2**bits).
    wraps: str | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


@dataclass(frozen=True)
class Unproven:
    reason: str


class Reject(Exception):
    """Raised while evaluating; becomes Unproven(reason)."""


class FromOperand(Reject):
    """An operand's reason, passed up unchanged."""


class Unknown(Reject):
    """An op whose values the proof cannot compute (not understood, or not exactly): its
    tensor still holds definite values, which the formulas above it treat as opaque data.
    ``value_range`` is an interval the handler proved they lie in (a count: [0, n])."""

    def __init__(self, reason: str, value_range: tuple[int, int] | None = None):
        super().__init__(reason)
        self.value_range = value_range


def as_sympy(value: Any) -> sympy.Expr | None:
    """A Python int or SymInt (or an FX node producing one) as a sympy expression."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("example_value")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None


def tensor_meta(node: torch.fx.Node) -> torch.Tensor:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        raise Reject(f"{node.name} has no tensor metadata")
    return value


def shape_env_of(node: torch.fx.Node):
    """The ShapeEnv behind a node's fake tensor (through vmap's wrappers), or None."""
    value = tensor_meta(node)
    while torch._C._functorch.is_batchedtensor(value):
        value = torch._C._functorch.get_unwrapped(value)
    return getattr(getattr(value, "fake_mode", None), "shape_env", None)


def shape_of(node: torch.fx.Node) -> tuple[sympy.Expr, ...]:
    return tuple(as_sympy(size) for size in tensor_meta(node).shape)


def _pin_unit_dims(shape, expr):
    """Size-1 dimensions have one position, 0: make the formula say so (broadcasting relies on it)."""
    unit = {POS[k]: sympy.Integer(0) for k, size in enumerate(shape) if size == 1}
    return expr.xreplace(unit) if unit else expr


def moved(formula: Formula, new_positions: list[int]) -> sympy.Basic:
    """The formula with dimension k read from position symbol new_positions[k]."""
    return formula.expr.xreplace({POS[k]: POS[new] for k, new in enumerate(new_positions)})


def right_aligned(formula: Formula, ndim: int) -> sympy.Basic:
    shift = ndim - formula.ndim
    return moved(formula, [k + shift for k in range(formula.ndim)])


def provably(condition) -> bool:
    """True only when sympy proves the condition for every value of the size symbols."""
    return bool(condition is sympy.true or condition is True)


def nonnegative(expr: sympy.Expr, shape_env=None) -> bool:
    """``expr >= 0`` for every value of its symbols: by sympy's assumptions, or by what the
    graph's ShapeEnv knows of its sizes (value ranges, and the guards and assertions the
    traced program established, e.g. transformers' check that a padding mask is long enough)."""
    return _provably(sympy.Ge(expr, 0), sympy.simplify(expr).is_nonnegative, shape_env)


def negative(expr: sympy.Expr, shape_env=None) -> bool:
    return _provably(sympy.Lt(expr, 0), sympy.simplify(expr).is_negative, shape_env)


def _provably(relation, by_assumptions, shape_env) -> bool:
    if by_assumptions is True or relation is sympy.true:
        return True
    if shape_env is None or relation is sympy.false or relation.has(sympy.core.function.AppliedUndef):
        return False
    if relation.free_symbols & set(POS):
        return False
    return shape_env._maybe_evaluate_static(relation) is sympy.true


def exact(formula: Formula) -> Formula:
    """``formula`` where its exact value is needed (comparisons, indices, casts)."""
    if formula.wraps is not None:
        raise FromOperand(formula.wraps)  # already says where
    return formula


def located(node: torch.fx.Node) -> str:
    """ " at file.py:line" of the user code that made ``node``, from Dynamo's stack trace."""
    line = source_line(node)
    return f" at {line}" if line else ""


def input_name(node: torch.fx.Node) -> str:
    """Dynamo names inputs like L_kwargs_attention_mask_; report the user's name: a
    parameter or buffer by its qualified name (``model.layers.0.self_attn.q_proj.weight``),
    another input by its argument's name. A node that is no input keeps its own."""
    if node.op != "placeholder":
        return node.name
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    source_name = getattr(source, "name", None)
    if isinstance(source_name, str) and REGISTRY_ENTRY.search(source_name):
        return qualified_name(source_name)
    name = str(node.target)
    for prefix in ("L_kwargs_", "L_", "l_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.rstrip("_") or str(node.target)


class MaskEvaluator:
    """Evaluates nodes to Formula or Unproven, memoised per node.

    ``resolve_placeholder(node)`` maps a placeholder of a subgraph (an
    activation-checkpoint body) to the operand node of the parent graph, or None
    for a true graph input.
    """

    def __init__(
        self,
        resolve_placeholder: Callable[[torch.fx.Node], torch.fx.Node | None] = lambda n: None,
        calls: CallReader | None = None,
        table: OpTable | None = None,
        assumed_ranges: dict[torch.fx.Node, tuple[int, int]] | None = None,
        deferred_ends: list | None = None,
    ):
        self._resolve = resolve_placeholder
        # Where given: the ends of tensor indices left to the caller (``deferring_index_ends``).
        self.deferred_ends = deferred_ends
        self.calls = calls or CallReader()
        self.table = table or TABLE
        self._memo: dict[torch.fx.Node, Formula | Unproven] = {}
        self._other_visited: dict[torch.fx.Node, None] = {}  # float mask nodes read by additive.py
        # vmap: the symbol standing for each (level, size) batch position, and its size.
        self._levels: dict[tuple[int, sympy.Expr], sympy.Symbol] = {}
        self._level_sizes: dict[sympy.Symbol, sympy.Expr] = {}
        self.writes = WriteAnalysis(self.calls)
        self.atoms = Atoms(assumed_ranges)
        self._assumed_ranges = assumed_ranges
        self._assuming: dict[tuple, MaskEvaluator] = {}

    def assuming(self, ranges: dict[torch.fx.Node, tuple[int, int]]) -> MaskEvaluator:
        """A fresh evaluator that takes each of these graph inputs' values to lie in its range
        [low, high). What it proves holds only where that is so: a rule that uses it must check
        the ranges at run time and compute the original otherwise (``Band.assumes`` lists them)."""
        key = tuple(sorted(ranges.items(), key=lambda item: item[0].name))
        if key not in self._assuming:  # every call of one mask asks alike: evaluate it once
            other = MaskEvaluator(self._resolve, self.calls, self.table, ranges, self.deferred_ends)
            other.writes = self.writes
            self._assuming[key] = other
        return self._assuming[key]

    def deferring_index_ends(self) -> MaskEvaluator:
        """A fresh evaluator that does not reject a tensor index it cannot prove below its
        dimension's end: it records ``size - 1 - largest index`` in ``deferred_ends`` (shared
        with the evaluators its ``assuming`` makes) for the caller to prove under what it checks
        at run time. Past a graph break Dynamo may give one size two symbols (a mask's batch and
        its padding's rows), which only the run time can relate."""
        other = MaskEvaluator(self._resolve, self.calls, self.table, self._assumed_ranges, [])
        other.writes = self.writes
        return other

    def evaluate(self, node: torch.fx.Node) -> Formula | Unproven:
        if node not in self._memo:
            try:
                self._memo[node] = self._evaluate(node)
            except Unknown as unknown:
                self._memo[node] = self._data(node, str(unknown), unknown.value_range)
            except Reject as reject:
                self._memo[node] = Unproven(str(reject))
        return self._memo[node]

    def _data(self, node: torch.fx.Node, reason: str, known_range: tuple[int, int] | None = None) -> Formula | Unproven:
        """An integer or bool tensor the proof cannot compute, as opaque data: a function of
        its positions, like a graph input, so the proof can still read the mask around it
        (and say which term it could not prove). Its atom keeps why, and the range its
        values were proven to lie in, if any."""
        meta = node.meta.get("example_value")
        if not (isinstance(meta, torch.Tensor) and meta.dtype in INTEGER_DTYPES + (torch.bool,)):
            return Unproven(reason)
        atom = self.atoms.new(AtomKind.OPAQUE, node, node.name, why=reason, known_range=known_range)
        value = atom.function(*POS[: meta.dim()])
        try:
            return self.formula(node, sympy.Ne(value, 0) if meta.dtype == torch.bool else value)
        except Reject as reject:
            return Unproven(str(reject))

    def source_of(self, node: torch.fx.Node) -> torch.fx.Node:
        """The node a checkpoint body's placeholder stands for in the graphs that call it
        (itself for any other node, or for a true graph input)."""
        while node.op == "placeholder":
            source = self._resolve(node)
            if source is None:
                break
            node = source
        return node

    def visited(self) -> list[torch.fx.Node]:
        """Every node evaluated so far (the mask's construction, for dead-code removal)."""
        return [*self._memo, *self._other_visited]

    def note_visited(self, node: torch.fx.Node) -> None:
        """Record a node a proof read without evaluating it to a formula."""
        self._other_visited[node] = None

    # -- dispatch ----------------------------------------------------------------

    def _evaluate(self, node: torch.fx.Node) -> Formula:
        if node.op == "placeholder":
            parent = self._resolve(node)
            if parent is None:
                return self._input(node)
            return self.operand(parent)
        if node.op == "get_attr":
            raise Reject(f"depends on stored tensor {node.target}")
        writer = self.writes.writer(node)
        if writer is not None:
            filled = self.writes.filled_before_read(node)
            if filled is None:
                raise Reject(writer)
            buffer, why = filled
            if buffer is node:
                raise Unknown(why)  # data: the values its writes left, read after the last one
            # a view of such a buffer: read as any view, of that data
        meta = tensor_meta(node)
        if meta.dtype not in EVALUATED_DTYPES:
            raise Reject(
                f"{describe(node)} produces {meta.dtype}; only integer, bool and integer-valued float index "
                "arithmetic is proven"
            )
        handlers = self.table.handlers(node)
        if not handlers:
            raise Unknown(f"op {describe(node)} not understood{located(node)}")
        call = self.calls.read(node)
        if call is None:
            raise Unknown(f"arguments of {describe(node)} not understood{located(node)}")
        try:
            for handler in handlers:  # lemmas first: None where one does not apply
                formula = handler(self, node, call)
                if formula is not None:
                    return formula
            raise Reject(f"{describe(node)} not understood")
        except FromOperand as reject:
            raise Unknown(str(reject)) from reject  # located where it arose
        except Reject as reject:
            raise Unknown(f"{reject}{located(node)}", getattr(reject, "value_range", None)) from reject

    def _input(self, node: torch.fx.Node) -> Formula:
        """A graph input's data is unknown: an uninterpreted function of its positions, so
        sympy can only apply identities that hold whatever the data (x(p) == x(p), ...)."""
        meta = tensor_meta(node)
        if meta.dtype not in INTEGER_DTYPES + (torch.bool,):
            raise Reject(f"depends on input {input_name(node)} ({meta.dtype})")
        writer = self.writes.writer(node)
        if writer is not None:
            raise Reject(f"input {input_name(node)}: {writer}")
        data = self.atoms.new(AtomKind.INPUT, node, input_name(node)).function(*POS[: meta.dim()])
        is_bool = meta.dtype == torch.bool
        return self.formula(node, sympy.Ne(data, 0) if is_bool else data)

    def operand(self, value: Any) -> Formula | sympy.Expr:
        """A tensor operand as a Formula, or a scalar operand as a sympy number."""
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("example_value"), torch.Tensor):
            result = self.evaluate(value)
            if isinstance(result, Unproven):
                raise FromOperand(result.reason)
            return result
        scalar = as_sympy(value)
        if scalar is None:
            raise Reject(f"operand {value!r} is not an integer")
        return scalar

    def tensor(self, value: Any) -> Formula:
        result = self.operand(value)
        if not isinstance(result, Formula):
            raise Reject(f"operand {value!r} is not a tensor")
        return result

    # -- formulas ------------------------------------------------------------------

    def formula(self, node: torch.fx.Node, expr, wraps: str | None = None) -> Formula:
        """The node's formula; integer results are checked against the node's dtype."""
        shape = shape_of(node)
        if len(shape) > MAX_DIMS:
            raise Reject(f"more than {MAX_DIMS} dimensions")
        dtype = tensor_meta(node).dtype
        expr = self.decide_extrema(sympy.sympify(expr), node)
        formula = Formula(shape, _pin_unit_dims(shape, expr), dtype, wraps)
        if formula.is_bool or formula.wraps is not None:
            return formula
        if not fits(self._range(formula, node), dtype):
            atoms = self.atoms.in_expr(formula.expr)
            opaque = [atom for atom in atoms if atom.kind is AtomKind.OPAQUE]
            if opaque:  # arithmetic on values the proof could not compute: say why those were not
                return Formula(formula.shape, formula.expr, dtype, opaque[0].why)
            change = "round in" if dtype.is_floating_point else "overflow"
            overflow = f"{describe(node)} may {change} {str(dtype).removeprefix('torch.')}"
            inputs = [atom.shown for atom in atoms if atom.kind is AtomKind.INPUT]
            if inputs:
                overflow += f" for some values of input {', '.join(inputs)}"
            return Formula(formula.shape, formula.expr, dtype, overflow + located(node))
        return formula

    def decide_extrema(self, expr: sympy.Basic, node: torch.fx.Node) -> sympy.Basic:
        """``expr`` with the Max/Min of sizes that the graph's value ranges decide resolved
        (a sliding cache's offset ``Max(0, past - w + 1)`` where the graph guarantees past >= w)."""
        if not expr.has(sympy.Max, sympy.Min, Max, Min):
            return expr
        shape_env = shape_env_of(node)
        return drop_decided_extrema(expr, lambda symbol: symbol_range(symbol, shape_env))

    def value_range(self, formula: Formula, node: torch.fx.Node) -> Interval | None:
        """The values ``formula`` (an operand of ``node``) may take, as exact integers."""
        return self._range(formula, node)

    def _scalar_range(self, expr: sympy.Expr, node: torch.fx.Node) -> Interval | None:
        """The values a Python or symbolic integer operand of ``node`` may take."""
        shape_env = shape_env_of(node)
        return value_range(expr, lambda symbol: symbol_range(symbol, shape_env), lambda f: None)

    def level_symbol(self, level: int, size: sympy.Expr) -> sympy.Symbol:
        """The position along vmap level ``level`` of ``size`` entries. Sequential vmaps reuse
        level numbers; the size is part of the symbol, so one with another size is another
        symbol."""
        key = (level, size)
        if key not in self._levels:
            self._levels[key] = sympy.Symbol(f"_v{level}_{len(self._levels)}", integer=True, nonnegative=True)
            self._level_sizes[self._levels[key]] = size
        return self._levels[key]

    def level_symbols(self, level: int) -> set[sympy.Symbol]:
        """Every symbol made for vmap level ``level``, of any size."""
        return {symbol for (at, _), symbol in self._levels.items() if at == level}

    def level_extents(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Each vmap level symbol and how many positions it has."""
        return dict(self._level_sizes)

    def _range(self, formula: Formula, node: torch.fx.Node) -> Interval | None:
        shape_env = shape_env_of(node)

        def size_range(symbol):
            return symbol_range(symbol, shape_env)

        def extent(size):
            found = value_range(size, size_range, lambda f: None)
            return None if found is None else (0, found[1] - 1)

        def symbols(symbol):
            if symbol in POS:
                return extent(formula.shape[POS.index(symbol)])
            if symbol in self._level_sizes:
                return extent(self._level_sizes[symbol])
            return size_range(symbol)

        def functions(application):
            atom = self.atoms.of(application)
            if atom is None:
                return None
            if atom.kind is AtomKind.SEGMENTS:
                return 0, SIZE_LIMIT  # a running count of at most SIZE_LIMIT flags
            if atom.assumed_range is not None:
                return atom.assumed_range[0], atom.assumed_range[1] - 1
            if atom.known_range is not None:
                return atom.known_range
            return DTYPE_RANGES.get(tensor_meta(atom.node).dtype)

        def guarded(symbol):
            found = symbols(symbol)
            if found is None:
                raise LookupError
            return found

        try:
            return value_range(formula.expr, guarded, functions)
        except LookupError:
            return None


# What a handler is: (evaluator, node, its call read by signature) -> the node's Formula, or
# None where a lemma does not apply. Handlers raise Reject with a reason for anything else.
Handler = Callable[["MaskEvaluator", torch.fx.Node, Call], "Formula | None"]
Target = tuple[str, Any]  # (node.op, node.target)


def functions(*targets) -> list[Target]:
    return [("call_function", target) for target in targets]


def methods(*names: str) -> list[Target]:
    return [("call_method", name) for name in names]


class OpTable:
    """What each op computes, by (node.op, node.target). Lemmas (library idioms proved as a
    whole, ``lemmas.py``) are tried before an op's handler and return None where their
    pattern does not match."""

    def __init__(self):
        self._handlers: dict[Target, Handler] = {}
        self._lemmas: dict[Target, list[Handler]] = {}

    def handles(self, *targets: Target):
        """Register a handler for every target: ``@TABLE.handles(*functions(torch.tril), *methods("tril"))``."""

        def register(handler: Handler) -> Handler:
            for target in targets:
                self._handlers[target] = handler
            return handler

        return register

    def lemma(self, *targets: Target):
        """Register a lemma, tried before the targets' handlers."""

        def register(lemma: Handler) -> Handler:
            for target in targets:
                self._lemmas.setdefault(target, []).append(lemma)
            return lemma

        return register

    def handlers(self, node: torch.fx.Node) -> list[Handler]:
        """The lemmas, then the handler, for ``node``'s op; empty when the op is not known."""
        target = (node.op, node.target)
        handler = self._handlers.get(target)
        return [*self._lemmas.get(target, ()), *([handler] if handler is not None else [])]


# The table the proof uses: torch's ops (arithmetic.py, logic.py, views.py) and the lemmas (lemmas.py) register here
# when the package is imported.
TABLE = OpTable()
