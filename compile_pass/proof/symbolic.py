"""Symbolic evaluation of index-arithmetic subgraphs: FX nodes in, exact formulas out.

Each tensor in a mask's construction is evaluated to a ``Formula``: its shape (sympy
expressions, symbolic where the graph's sizes are) and one sympy expression giving the
element at position (p0, p1, ...) in terms of *position symbols* ``POS[k]``, one per
dimension. ``arange(n) + 3`` is ``POS[0] + 3`` with shape ``(n,)``; ``x[None, :]`` moves
``POS[0]`` to ``POS[1]``; ``a <= b`` is a sympy relational; ``&`` is ``sympy.And``.

The invariant, kept by every handler: substituting an in-bounds position into the
formula gives exactly the tensor's element. Handlers therefore accept only what they
can evaluate exactly, and reject the rest with a reason (``Unproven``):

- an allow-list of ops, each read by its signature (``graphs.read_call``);
- integer and boolean dtypes only (no float rounding);
- integer arithmetic proven not to wrap (``ranges.py``); a formula that may wrap is kept
  only as a value modulo 2**bits (``Formula.wraps``), which no comparison, index or cast
  may read;
- indices proven in range (no negative wrap-around, no clamped slice start);
- tensors no op may write, through any alias (``aliasing.py``).

Sizes come from the FakeTensors Dynamo records in ``node.meta["example_value"]``; nothing
here reads tensor data, guards on a size or trusts a size hint.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import sympy
import torch
import torch.fx
from torch._functorch import predispatch
from torch.utils._sympy.functions import Max, Min

from ..graphs import Call, describe, read_call, source_line
from .aliasing import WriteAnalysis
from .ranges import DTYPE_RANGES, SIZE_LIMIT, Interval, drop_decided_extrema, fits, symbol_range, value_range

MAX_DIMS = 8
POS = tuple(sympy.Symbol(f"_p{k}", integer=True, nonnegative=True) for k in range(MAX_DIMS))
INTEGER_DTYPES = tuple(DTYPE_RANGES)
INPUT_PREFIX = "input:"
SEGMENTS_PREFIX = "segments:"
DATA_PREFIX = "data:"


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


class _Reject(Exception):
    """Raised while evaluating; becomes Unproven(reason)."""


class _FromOperand(_Reject):
    """An operand's reason, passed up unchanged."""


class _Unknown(_Reject):
    """An op whose values the proof cannot compute (not understood, or not exactly): its
    tensor still holds definite values, which the formulas above it treat as opaque data."""


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


def _meta(node: torch.fx.Node) -> torch.Tensor:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        raise _Reject(f"{node.name} has no tensor metadata")
    return value


def _shape_env(node: torch.fx.Node):
    """The ShapeEnv behind a node's fake tensor (through vmap's wrappers), or None."""
    value = _meta(node)
    while torch._C._functorch.is_batchedtensor(value):
        value = torch._C._functorch.get_unwrapped(value)
    return getattr(getattr(value, "fake_mode", None), "shape_env", None)


def _shape_of(node: torch.fx.Node) -> tuple[sympy.Expr, ...]:
    return tuple(as_sympy(size) for size in _meta(node).shape)


def _pin_unit_dims(shape, expr):
    """Size-1 dimensions have one position, 0: make the formula say so (broadcasting relies on it)."""
    unit = {POS[k]: sympy.Integer(0) for k, size in enumerate(shape) if size == 1}
    return expr.xreplace(unit) if unit else expr


def _moved(formula: Formula, new_positions: list[int]) -> sympy.Basic:
    """The formula with dimension k read from position symbol new_positions[k]."""
    return formula.expr.xreplace({POS[k]: POS[new] for k, new in enumerate(new_positions)})


def _right_aligned(formula: Formula, ndim: int) -> sympy.Basic:
    shift = ndim - formula.ndim
    return _moved(formula, [k + shift for k in range(formula.ndim)])


def provably(condition) -> bool:
    """True only when sympy proves the condition for every value of the size symbols."""
    return bool(condition is sympy.true or condition is True)


def _nonnegative(expr: sympy.Expr, shape_env=None) -> bool:
    """``expr >= 0`` for every value of its symbols: by sympy's assumptions, or by what the
    graph's ShapeEnv knows of its sizes (value ranges, and the guards and assertions the
    traced program established, e.g. transformers' check that a padding mask is long enough)."""
    return _provably(sympy.Ge(expr, 0), sympy.simplify(expr).is_nonnegative, shape_env)


def _negative(expr: sympy.Expr, shape_env=None) -> bool:
    return _provably(sympy.Lt(expr, 0), sympy.simplify(expr).is_negative, shape_env)


def _provably(relation, by_assumptions, shape_env) -> bool:
    if by_assumptions is True or relation is sympy.true:
        return True
    if shape_env is None or relation is sympy.false or relation.has(sympy.core.function.AppliedUndef):
        return False
    if relation.free_symbols & set(POS):
        return False
    return shape_env._maybe_evaluate_static(relation) is sympy.true


def _exact(formula: Formula) -> Formula:
    """``formula`` where its exact value is needed (comparisons, indices, casts)."""
    if formula.wraps is not None:
        raise _FromOperand(formula.wraps)  # already says where
    return formula


def located(node: torch.fx.Node) -> str:
    """" at file.py:line" of the user code that made ``node``, from Dynamo's stack trace."""
    line = source_line(node)
    return f" at {line}" if line else ""


def input_function_name(node: torch.fx.Node) -> str:
    return f"{INPUT_PREFIX}{input_name(node)}"


def input_name(node: torch.fx.Node) -> str:
    """Dynamo names inputs like L_kwargs_attention_mask_; report the user's name."""
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

    def __init__(self, resolve_placeholder: Callable[[torch.fx.Node], torch.fx.Node | None] = lambda n: None):
        self._resolve = resolve_placeholder
        self._memo: dict[torch.fx.Node, Formula | Unproven] = {}
        self._other_visited: dict[torch.fx.Node, None] = {}  # float mask nodes read by additive.py
        # Opaque data (see _data): why each could not be computed, and its node.
        self.data_reasons: dict[str, str] = {}
        self._data_nodes: dict[str, torch.fx.Node] = {}
        # vmap: the symbol standing for each (level, size) batch position, and its size.
        self._levels: dict[tuple[int, sympy.Expr], sympy.Symbol] = {}
        self._level_sizes: dict[sympy.Symbol, sympy.Expr] = {}
        self.writes = WriteAnalysis()
        # Graph inputs met so far, by the name of the sympy function standing for their data,
        # and packed-sequence ids (cumsum nodes) by the name of theirs.
        self.inputs: dict[str, torch.fx.Node] = {}
        self.segments: dict[str, torch.fx.Node] = {}
        # Every uninterpreted function stands for one node's values (see function_name).
        self._function_names: dict[torch.fx.Node, str] = {}
        self._function_nodes: dict[str, torch.fx.Node] = {}

    def function_name(self, node: torch.fx.Node, readable: str) -> str:
        """The name of the uninterpreted function standing for ``node``'s values: ``readable``
        (what reasons and decisions show), with a ``#n`` suffix where another node already has
        it. Two nodes never share a function, or sympy would read x(p) == y(p) as true: node
        names restart in each checkpoint body, and input names drop Dynamo's prefixes."""
        if node not in self._function_names:
            name, count = readable, 1
            while name in self._function_nodes:
                count += 1
                name = f"{readable}#{count}"
            self._function_names[node] = name
            self._function_nodes[name] = node
        return self._function_names[node]

    def evaluate(self, node: torch.fx.Node) -> Formula | Unproven:
        if node not in self._memo:
            try:
                self._memo[node] = self._evaluate(node)
            except _Unknown as unknown:
                self._memo[node] = self._data(node, str(unknown))
            except _Reject as reject:
                self._memo[node] = Unproven(str(reject))
        return self._memo[node]

    def _data(self, node: torch.fx.Node, reason: str) -> Formula | Unproven:
        """An integer or bool tensor the proof cannot compute, as opaque data: a function of
        its positions, like a graph input, so the proof can still read the mask around it
        (and say which term it could not prove). ``data_reasons`` keeps why."""
        meta = node.meta.get("example_value")
        if not (isinstance(meta, torch.Tensor) and meta.dtype in INTEGER_DTYPES + (torch.bool,)):
            return Unproven(reason)
        name = self.function_name(node, f"{DATA_PREFIX}{node.name}")
        self.data_reasons[name] = reason
        self._data_nodes[name] = node
        value = sympy.Function(name)(*POS[: meta.dim()])
        try:
            return self._make(node, sympy.Ne(value, 0) if meta.dtype == torch.bool else value)
        except _Reject as reject:
            return Unproven(str(reject))

    def source_of(self, node: torch.fx.Node) -> torch.fx.Node:
        """The node a checkpoint body's placeholder stands for in the graphs that call it
        (itself for any other node, or for a true graph input)."""
        while node.op == "placeholder" and self._resolve(node) is not None:
            node = self._resolve(node)
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
            return self._arg(parent)
        if node.op == "get_attr":
            raise _Reject(f"depends on stored tensor {node.target}")
        writer = self.writes.writer(node)
        if writer is not None:
            raise _Reject(writer)
        meta = _meta(node)
        if meta.dtype not in INTEGER_DTYPES + (torch.bool,):
            raise _Reject(f"{describe(node)} produces {meta.dtype}; only int64, int32 and bool index arithmetic is proven")
        handler = _HANDLERS.get((node.op, node.target))
        if handler is None:
            raise _Unknown(f"op {describe(node)} not understood{located(node)}")
        call = read_call(node)
        if call is None:
            raise _Unknown(f"arguments of {describe(node)} not understood{located(node)}")
        try:
            return handler(self, node, call)
        except _FromOperand as reject:
            raise _Unknown(str(reject)) from reject  # located where it arose
        except _Reject as reject:
            raise _Unknown(f"{reject}{located(node)}") from reject

    def _input(self, node: torch.fx.Node) -> Formula:
        """A graph input's data is unknown: an uninterpreted function of its positions, so
        sympy can only apply identities that hold whatever the data (x(p) == x(p), ...)."""
        meta = _meta(node)
        if meta.dtype not in INTEGER_DTYPES + (torch.bool,):
            raise _Reject(f"depends on input {input_name(node)} ({meta.dtype})")
        writer = self.writes.writer(node)
        if writer is not None:
            raise _Reject(f"input {input_name(node)}: {writer}")
        name = self.function_name(node, input_function_name(node))
        self.inputs[name] = node
        data = sympy.Function(name)(*POS[: meta.dim()])
        is_bool = meta.dtype == torch.bool
        return self._make(node, sympy.Ne(data, 0) if is_bool else data)

    def _arg(self, value: Any) -> Formula | sympy.Expr:
        """A tensor operand as a Formula, or a scalar operand as a sympy number."""
        if isinstance(value, torch.fx.Node) and isinstance(value.meta.get("example_value"), torch.Tensor):
            result = self.evaluate(value)
            if isinstance(result, Unproven):
                raise _FromOperand(result.reason)
            return result
        scalar = as_sympy(value)
        if scalar is None:
            raise _Reject(f"operand {value!r} is not an integer")
        return scalar

    def _tensor(self, value: Any) -> Formula:
        result = self._arg(value)
        if not isinstance(result, Formula):
            raise _Reject(f"operand {value!r} is not a tensor")
        return result

    # -- formulas ------------------------------------------------------------------

    def _make(self, node: torch.fx.Node, expr, wraps: str | None = None) -> Formula:
        """The node's formula; integer results are checked against the node's dtype."""
        shape = _shape_of(node)
        if len(shape) > MAX_DIMS:
            raise _Reject(f"more than {MAX_DIMS} dimensions")
        dtype = _meta(node).dtype
        expr = self.decide_extrema(sympy.sympify(expr), node)
        formula = Formula(shape, _pin_unit_dims(shape, expr), dtype, wraps)
        if formula.is_bool or formula.wraps is not None:
            return formula
        if not fits(self._range(formula, node), dtype):
            data = sorted(f.func.__name__ for f in formula.expr.atoms(sympy.core.function.AppliedUndef))
            data = [name for name in data if name in self.data_reasons]
            if data:  # arithmetic on values the proof could not compute: say why those were not
                return Formula(formula.shape, formula.expr, dtype, self.data_reasons[data[0]])
            overflow = f"{describe(node)} may overflow {str(dtype).removeprefix('torch.')}"
            inputs = sorted(
                f.func.__name__.removeprefix(INPUT_PREFIX)
                for f in formula.expr.atoms(sympy.core.function.AppliedUndef)
                if f.func.__name__.startswith(INPUT_PREFIX)
            )
            if inputs:
                overflow += f" for some values of input {', '.join(inputs)}"
            return Formula(formula.shape, formula.expr, dtype, overflow + located(node))
        return formula

    def decide_extrema(self, expr: sympy.Basic, node: torch.fx.Node) -> sympy.Basic:
        """``expr`` with the Max/Min of sizes that the graph's value ranges decide resolved
        (a sliding cache's offset ``Max(0, past - w + 1)`` where the graph guarantees past >= w)."""
        if not expr.has(sympy.Max, sympy.Min, Max, Min):
            return expr
        shape_env = _shape_env(node)
        return drop_decided_extrema(expr, lambda symbol: symbol_range(symbol, shape_env))

    def _scalar_range(self, expr: sympy.Expr, node: torch.fx.Node) -> Interval | None:
        """The values a Python or symbolic integer operand of ``node`` may take."""
        shape_env = _shape_env(node)
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

    def level_extents(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Each vmap level symbol and how many positions it has."""
        return dict(self._level_sizes)

    def _range(self, formula: Formula, node: torch.fx.Node) -> Interval | None:
        shape_env = _shape_env(node)

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
            name = application.func.__name__
            if name.startswith(SEGMENTS_PREFIX):
                return 0, SIZE_LIMIT  # a running count of at most SIZE_LIMIT flags
            source = self.inputs.get(name) or self._data_nodes.get(name)
            if source is None:
                return None
            return DTYPE_RANGES.get(_meta(source).dtype)

        def guarded(symbol):
            found = symbols(symbol)
            if found is None:
                raise LookupError
            return found

        try:
            return value_range(formula.expr, guarded, functions)
        except LookupError:
            return None


# -- handlers --------------------------------------------------------------------

_HANDLERS: dict[tuple[str, Any], Callable[[MaskEvaluator, torch.fx.Node, Call], Formula]] = {}


def _handles(op: str, *targets):
    def register(fn):
        for target in targets:
            _HANDLERS[(op, target)] = fn
        return fn

    return register


def _operands(call: Call, count: int) -> list[Any]:
    """The first ``count`` parameters' values, in signature order (operators name them a, b;
    torch functions input, other)."""
    return list(call.arguments.values())[:count]


@_handles("call_function", torch.arange)
def _arange(ev: MaskEvaluator, node: torch.fx.Node, call: Call) -> Formula:
    bounds = {name: as_sympy(call.arguments.get(name, default)) for name, default in (("start", 0), ("step", 1))}
    if any(bound is None for bound in bounds.values()) or as_sympy(call["end"]) is None:
        raise _Reject("arange with non-integer bounds")
    return ev._make(node, bounds["start"] + bounds["step"] * POS[0])


# Each op in its operator, torch function and Tensor method spellings.
_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul}
_COMPARISONS = {"lt": sympy.Lt, "le": sympy.Le, "gt": sympy.Gt, "ge": sympy.Ge, "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"and": sympy.And, "or": sympy.Or, "xor": sympy.Xor}


def _spellings(names, *, functions=(), methods=()):
    """(op, target) keys for ``operator.<name>``, ``.__<name>__()``, ``torch.<prefix><name>`` and
    ``.<prefix><name>()``."""
    keys = []
    for name in names:
        keys.append(("call_function", getattr(operator, f"{name}_" if name in ("and", "or") else name)))
        keys.append(("call_method", f"__{name}__"))
        keys += [("call_function", getattr(torch, prefix + name)) for prefix in functions]
        keys += [("call_method", prefix + name) for prefix in methods]
    return keys


def _op_name(node: torch.fx.Node) -> str:
    """The op's name without its spelling: ``torch.logical_and``, ``.__and__()`` and ``&`` are
    all "and"."""
    name = node.target if node.op == "call_method" else node.target.__name__
    return name.strip("_").removeprefix("logical_").removeprefix("bitwise_")


def _aligned_operands(ev: MaskEvaluator, node: torch.fx.Node, call: Call, *, want_bool: bool):
    """Both operands right-aligned to the result's dimensions, as (expression, formula or None
    for a Python scalar). Scalars must fit the tensor operand's dtype: torch wraps an int32
    operand's scalar and rejects an int64 one's."""
    ndim = len(_shape_of(node))
    operands = []
    for value in _operands(call, 2):
        operand = ev._arg(value)
        if isinstance(operand, Formula):
            if operand.is_bool != want_bool:
                raise _Reject("mixes bool and integer operands")
            operands.append((_right_aligned(operand, ndim), operand))
        elif want_bool:
            raise _Reject("logic with a Python scalar")
        else:
            operands.append((operand, None))
    tensor_dtypes = [formula.dtype for _, formula in operands if formula is not None]
    for expr, formula in operands:
        if formula is None and not all(fits(ev._scalar_range(expr, node), dtype) for dtype in tensor_dtypes):
            raise _Reject(f"constant {expr} may not fit {str(tensor_dtypes[0]).removeprefix('torch.')}")
    return operands


def _register(keys, fn):
    for key in keys:
        _HANDLERS[key] = fn
    return fn


def _arithmetic(ev, node, call):
    if call.arguments.get("alpha", 1) != 1:
        raise _Reject(f"{describe(node)} with alpha")
    (a, fa), (b, fb) = _aligned_operands(ev, node, call, want_bool=False)
    wraps = next((f.wraps for f in (fa, fb) if f is not None and f.wraps), None)
    return ev._make(node, _ARITHMETIC[_op_name(node)](a, b), wraps)


def _compare(ev, node, call):
    (a, fa), (b, fb) = _aligned_operands(ev, node, call, want_bool=False)
    for formula in (fa, fb):
        if formula is not None:
            _exact(formula)
    return ev._make(node, _COMPARISONS[_op_name(node)](a, b))


def _logic(ev, node, call):
    """Logic on bool tensors only: on integers ``&`` is bitwise and ``logical_and`` tests != 0."""
    (a, _), (b, _) = _aligned_operands(ev, node, call, want_bool=True)
    return ev._make(node, _LOGIC[_op_name(node)](a, b))


def _invert(ev, node, call):
    (value,) = _operands(call, 1)
    formula = ev._tensor(value)
    if not formula.is_bool:
        raise _Reject("~ on a non-bool tensor (bitwise not)")
    return ev._make(node, sympy.Not(formula.expr))


_register(_spellings(_ARITHMETIC, functions=("",), methods=("",)), _arithmetic)
_register(_spellings(_COMPARISONS, functions=("",), methods=("",)), _compare)
_register(_spellings(_LOGIC, functions=("logical_",), methods=("logical_",)), _logic)
_register(
    [("call_function", operator.invert), ("call_function", torch.logical_not), ("call_function", torch.bitwise_not),
     ("call_method", "logical_not"), ("call_method", "bitwise_not"), ("call_method", "__invert__")],
    _invert,
)


@_handles("call_function", abs, operator.abs, torch.abs)
@_handles("call_method", "abs")
def _abs(ev, node, call):
    (value,) = _operands(call, 1)
    formula = _exact(ev._tensor(value))
    if formula.is_bool:
        raise _Reject("abs of a non-integer tensor")
    return ev._make(node, sympy.Abs(formula.expr))


@_handles("call_method", "to", "bool", "int", "long")
def _to(ev, node, call):
    """Device moves and same-dtype casts keep values; int32 <-> int64 keep them where they
    fit; integer -> bool is ``value != 0``."""
    formula = ev._tensor(call["input"])
    source, target = formula.dtype, _meta(node).dtype
    if source == target:
        return formula
    if source != torch.bool and target == torch.bool:
        return ev._make(node, sympy.Ne(_exact(formula).expr, 0))
    if source in INTEGER_DTYPES and target in INTEGER_DTYPES:
        return ev._make(node, _exact(formula).expr)  # _make checks the narrower dtype
    raise _Reject(f".to() casts {source} to {target}")


@_handles("call_method", "clone", "contiguous")
@_handles("call_function", torch.clone)
def _copy(ev, node, call):
    """Copies keep every value (a copy is its own memory: writes to either are checked on its own)."""
    return ev._tensor(call["input"])


@_handles("call_method", "new_ones", "new_zeros", "new_full")
@_handles("call_function", torch.ones_like, torch.zeros_like, torch.full_like, torch.ones, torch.zeros, torch.full)
def _filled(ev, node, call):
    """Constant tensors; only their shape comes from the arguments, never a tensor's values."""
    name = node.target if node.op == "call_method" else node.target.__name__
    if "full" in name:
        value = call["fill_value"]
        if isinstance(value, torch.fx.Node) or not isinstance(value, (bool, int)):
            raise _Reject(f"{describe(node)} with a fill value that is not a Python int")
    else:
        value = int("ones" in name)
    if _meta(node).dtype == torch.bool:
        return ev._make(node, sympy.true if value else sympy.false)
    return ev._make(node, sympy.Integer(int(value)))


@_handles("call_method", "view", "reshape")
@_handles("call_function", torch.reshape)
def _reshape(ev, node, call):
    """Reshapes that only add or drop size-1 dimensions: every element keeps its position
    along the other dimensions. Anything else would reorder elements: rejected."""
    if "dtype" in call.arguments:
        raise _Reject(f"{describe(node)} reinterprets the dtype")
    formula = ev._tensor(call["input"])
    out_shape = _shape_of(node)
    kept_in = [k for k, size in enumerate(formula.shape) if size != 1]
    kept_out = [k for k, size in enumerate(out_shape) if size != 1]
    if len(kept_in) != len(kept_out) or any(
        sympy.simplify(formula.shape[a] - out_shape[b]) != 0 for a, b in zip(kept_in, kept_out)
    ):
        raise _Reject(f"{describe(node)} reshapes {formula.shape} to {out_shape}: more than adding or dropping size-1 dimensions")
    expr = formula.expr.xreplace({POS[a]: POS[b] for a, b in zip(kept_in, kept_out)})
    return ev._make(node, expr, formula.wraps)


@_handles("call_method", "transpose", "swapaxes", "permute", "t")
@_handles("call_function", torch.transpose, torch.swapaxes, torch.permute, torch.t, getattr)
def _permute(ev, node, call):
    """Dimension permutations: output dimension k reads input dimension ``order[k]``."""
    formula = ev._tensor(_operands(call, 1)[0])
    ndim = formula.ndim
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.target is getattr:
        name = call["name"]
    order = list(range(ndim))
    if name in ("transpose", "swapaxes"):
        first, second = (call[key] for key in (("dim0", "dim1") if "dim0" in call.arguments else ("axis0", "axis1")))
        first, second = (d + ndim if isinstance(d, int) and d < 0 else d for d in (first, second))
        if not (isinstance(first, int) and isinstance(second, int)):
            raise _Reject(f"{describe(node)} of symbolic dimensions")
        order[first], order[second] = order[second], order[first]
    elif name == "permute":
        order = [d + ndim if d < 0 else d for d in call["dims"]]
    elif name in ("t", "T"):
        order = order[::-1]
    elif name == "mT" and ndim >= 2:
        order[-2], order[-1] = order[-1], order[-2]
    else:
        raise _Reject(f"{describe(node)} not understood")
    if sorted(order) != list(range(ndim)):
        raise _Reject(f"{describe(node)} is not a permutation")
    return ev._make(node, formula.expr.xreplace({POS[order[k]]: POS[k] for k in range(ndim)}), formula.wraps)


@_handles("call_function", torch.where)
def _where(ev, node, call):
    """``where(c, a, b)``: a where c holds, else b; operands broadcast right-aligned."""
    if "condition" not in call.arguments or "input" not in call.arguments:
        raise _Reject("where with one argument (nonzero)")
    ndim = len(_shape_of(node))
    condition = ev._tensor(call["condition"])
    if not condition.is_bool:
        raise _Reject("where with a non-bool condition")
    want_bool = _meta(node).dtype == torch.bool
    branches = []
    for value in (call["input"], call["other"]):
        if isinstance(value, bool) and want_bool:
            branches.append(sympy.true if value else sympy.false)
            continue
        operand = ev._arg(value)
        if isinstance(operand, Formula):
            if operand.is_bool != want_bool:
                raise _Reject("where mixes bool and integer values")
            branches.append(_right_aligned(_exact(operand), ndim))
        elif want_bool:
            raise _Reject("where with an integer value for a bool result")
        else:
            branches.append(operand)
    chosen, other = branches
    when = _right_aligned(condition, ndim)
    if want_bool:
        return ev._make(node, sympy.Or(sympy.And(when, chosen), sympy.And(sympy.Not(when), other)))
    return ev._make(node, sympy.Piecewise((chosen, when), (other, True)))


@_handles("call_function", predispatch._add_batch_dim)
def _add_batch_dim(ev, node, call):
    """vmap hides dimension ``batch_dim`` behind a level: the formula reads that dimension from
    the level's symbol, and the dimensions after it move down one."""
    formula = ev._tensor(_operands(call, 1)[0])
    batch_dim, level = call["batch_dim"], call["level"]
    if not (isinstance(batch_dim, int) and isinstance(level, int)):
        raise _Reject("vmap with a symbolic batch dimension or level")
    batch_dim = batch_dim + formula.ndim if batch_dim < 0 else batch_dim
    symbol = ev.level_symbol(level, formula.shape[batch_dim])
    moves = {POS[batch_dim]: symbol, **{POS[k]: POS[k - 1] for k in range(batch_dim + 1, formula.ndim)}}
    return ev._make(node, formula.expr.xreplace(moves), formula.wraps)


@_handles("call_function", predispatch._remove_batch_dim)
def _remove_batch_dim(ev, node, call):
    """vmap's result: the level becomes dimension ``out_dim`` again, the dimensions from there
    on move up one. A formula that does not read the level is the same for every entry."""
    formula = ev._tensor(_operands(call, 1)[0])
    level, size, out_dim = call["level"], as_sympy(call["batch_size"]), call["out_dim"]
    if not (isinstance(level, int) and isinstance(out_dim, int)) or size is None:
        raise _Reject("vmap with a symbolic level or output dimension")
    out_dim = out_dim + formula.ndim + 1 if out_dim < 0 else out_dim
    symbol = ev.level_symbol(level, size)
    moves = {symbol: POS[out_dim], **{POS[k]: POS[k + 1] for k in range(out_dim, formula.ndim)}}
    expr = formula.expr.xreplace(moves)
    if expr.free_symbols & {other for (at, _), other in ev._levels.items() if at == level}:
        raise _Reject("vmap level of an unexpected size")
    return ev._make(node, expr, formula.wraps)


@_handles("call_method", "tril", "triu")
@_handles("call_function", torch.tril, torch.triu)
def _triangle(ev, node, call):
    """``tril(d)`` keeps elements with column - row <= d, ``triu(d)`` those with column - row >= d."""
    formula = ev._tensor(call["input"])
    diagonal = call["diagonal"]
    if not formula.is_bool or formula.ndim < 2 or not isinstance(diagonal, int) or isinstance(diagonal, bool):
        raise _Reject(f"{describe(node)} of a non-bool tensor or with a symbolic diagonal")
    row, column = POS[formula.ndim - 2], POS[formula.ndim - 1]
    name = node.target if node.op == "call_method" else node.target.__name__
    keep = sympy.Le(column - row, diagonal) if name == "tril" else sympy.Ge(column - row, diagonal)
    return ev._make(node, sympy.And(formula.expr, keep))


@_handles("call_method", "unsqueeze")
def _unsqueeze(ev, node, call):
    formula = ev._tensor(call["input"])
    dim = call["dim"]
    if not isinstance(dim, int):
        raise _Reject("unsqueeze at a symbolic dimension")
    dim = dim + formula.ndim + 1 if dim < 0 else dim
    positions = [k if k < dim else k + 1 for k in range(formula.ndim)]
    return ev._make(node, _moved(formula, positions), formula.wraps)


@_handles("call_method", "expand")
def _expand(ev, node, call):
    """Expanded dimensions had size 1, so the formula never read them; new ones lead."""
    formula = ev._tensor(call["input"])
    return ev._make(node, _right_aligned(formula, len(_shape_of(node))), formula.wraps)


@_handles("call_function", torch.diff)
def _diff(ev, node, call):
    """d[k] = c[k + 1] - c[k] along ``dim`` where c = cat(prepend, x); only prepend of size 1."""
    if call["append"] is not None or call["n"] != 1:
        raise _Reject("diff with n != 1 or append")
    formula = ev._tensor(call["input"])
    if call["prepend"] is None or formula.is_bool:
        raise _Reject("diff without prepend")
    first = ev._tensor(call["prepend"])
    dim = call["dim"]
    dim = dim + formula.ndim if dim < 0 else dim
    if first.ndim != formula.ndim or first.shape[dim] != 1:
        raise _Reject("diff with a prepend wider than one element")
    at = POS[dim]
    previous = formula.expr.xreplace({at: at - 1})
    expr = sympy.Piecewise((formula.expr - first.expr, sympy.Eq(at, 0)), (formula.expr - previous, True))
    wraps = formula.wraps or first.wraps
    return ev._make(node, sympy.piecewise_fold(sympy.simplify(expr)), wraps)


def _segment_source(ev: MaskEvaluator, summand: torch.fx.Node, dim: int) -> str | None:
    """The input P when ``summand`` is ``diff(P, prepend=P[..., :1] - 1) != 1`` along ``dim`` =
    P's last dimension: cumsum of it gives packed-sequence ids, which start a new segment
    wherever a position does not follow its predecessor (transformers'
    find_packed_sequence_indices). The ids are handed to the op as they are, so only their
    equality matters: wrapped differences are fine here."""
    # The pattern's nodes are read by their calls, not evaluated: each must be unwritten.
    starts = read_call(summand) if summand.op == "call_function" and summand.target is operator.ne else None
    if starts is None or _operands(starts, 2)[1] != 1 or ev.writes.writer(summand) is not None:
        return None
    difference = _operands(starts, 2)[0]
    if not (isinstance(difference, torch.fx.Node) and difference.target is torch.diff):
        return None
    if ev.writes.writer(difference) is not None:
        return None
    call = read_call(difference)
    if call is None or call["n"] != 1 or call["append"] is not None or call["prepend"] is None:
        return None
    values, before = ev._tensor(call["input"]), ev._tensor(call["prepend"])
    if call["dim"] not in (-1, dim) or not isinstance(values.expr, sympy.core.function.AppliedUndef):
        return None
    if values.ndim != dim + 1 or values.expr.args != POS[: values.ndim]:
        return None
    # prepend must be P at position 0 of dim, minus 1 (modulo 2**bits: the first token never
    # starts a new segment).
    if sympy.simplify(before.expr - (values.expr.xreplace({POS[dim]: sympy.Integer(0)}) - 1)) != 0:
        return None
    return values.expr.func.__name__


@_handles("call_method", "cumsum")
@_handles("call_function", torch.cumsum)
def _cumsum(ev, node, call):
    """Packed-sequence ids become a function ``segments:P`` of their positions (band.py knows
    what they imply); any other cumsum is proven only for summands constant along ``dim``,
    where element k is (k + 1) * summand."""
    summand_node, dim = call["input"], call["dim"]
    ndim = len(_shape_of(node))
    dim = dim + ndim if dim < 0 else dim
    # Before evaluating the summand: a difference of input positions may wrap, which the ids'
    # equality does not mind but a comparison of its exact value would.
    source = _segment_source(ev, summand_node, dim) if isinstance(summand_node, torch.fx.Node) else None
    if source is not None and source.startswith(INPUT_PREFIX):
        name = ev.function_name(node, SEGMENTS_PREFIX + source)
        ev.segments[name] = node
        return ev._make(node, sympy.Function(name)(*POS[:ndim]))
    at = POS[dim]
    summand = _exact(ev._tensor(summand_node))
    expr = summand.expr
    if summand.is_bool:
        expr = sympy.Integer(int(expr is sympy.true)) if expr in (sympy.true, sympy.false) else sympy.Piecewise((1, expr), (0, True))
    if at in expr.free_symbols:
        raise _Reject("cumsum of values that vary along the summed dimension")
    return ev._make(node, sympy.simplify((at + 1) * expr))


@_handles("call_function", torch.ops.aten.index, torch.ops.aten.index.Tensor)
def _aten_index(ev, node, call):
    """``aten.index(x, [i, j, ...])``: what ``x[i, j, ...]`` runs (transformers' vmap path
    turns indexing into it); None entries keep a dimension whole."""
    base = ev._tensor(call["input"])
    indices = tuple(slice(None) if entry is None else entry for entry in call["indices"])
    return _index(ev, node, base, indices)


@_handles("call_function", operator.getitem)
def _getitem(ev, node, call):
    base_node, index = _operands(call, 2)
    base = ev._tensor(base_node)
    return _index(ev, node, base, index if isinstance(index, tuple) else (index,))


def _index(ev: MaskEvaluator, node, base: Formula, index: tuple) -> Formula:
    """Basic indexing (slices, None, Ellipsis, ints), or slices and None around one run
    of adjacent tensor indices (gathers)."""
    consuming = sum(1 for entry in index if entry is not None and entry is not Ellipsis)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (base.ndim - consuming) + index[at + 1 :]
    index = index + (slice(None),) * (base.ndim - sum(1 for entry in index if entry is not None))
    tensor_at = [k for k, entry in enumerate(index) if isinstance(entry, torch.fx.Node) and as_sympy(entry) is None]
    if tensor_at and tensor_at != list(range(tensor_at[0], tensor_at[-1] + 1)):
        raise _Reject("indexing with non-adjacent tensor indices")
    if tensor_at and any(as_sympy(entry) is not None for entry in index):
        raise _Reject("indexing with both ints and tensors")
    out_shape = _shape_of(node)
    shape_env = _shape_env(node)
    # Result dimensions made by the gather: all but those from slices and None.
    gathered_ndim = len(out_shape) - sum(1 for e in index if e is None or isinstance(e, slice))
    replacements: dict[sympy.Symbol, sympy.Basic] = {}
    base_dim = out_dim = 0
    for k, entry in enumerate(index):
        size = base.shape[base_dim] if base_dim < base.ndim else None
        if entry is None:
            out_dim += 1
            continue
        if isinstance(entry, slice):
            start, step = _slice_start_step(entry, size, shape_env)
            replacements[POS[base_dim]] = start + step * POS[out_dim]
            out_dim += 1
        elif k in tensor_at:
            if k == tensor_at[0]:
                gather_start = out_dim
                out_dim += gathered_ndim
            positions = _exact(ev._tensor(entry))
            if positions.is_bool:
                raise _Reject("indexing with a bool mask")
            # Index tensors broadcast right-aligned inside the gathered block.
            offset = gather_start + gathered_ndim - positions.ndim
            expr = _moved(positions, [offset + d for d in range(positions.ndim)])
            _require_in_range(expr, {**ev.level_extents(), **dict(zip(POS, out_shape))}, size, shape_env)
            replacements[POS[base_dim]] = expr
        else:
            replacements[POS[base_dim]] = _int_index(entry, size, shape_env)
        base_dim += 1
    return ev._make(node, base.expr.xreplace(replacements), base.wraps)


def _int_index(entry: Any, size: sympy.Expr, shape_env=None) -> sympy.Expr:
    """An int index as the position it reads: -1 is the last; a sign that cannot be told is
    rejected (the position it reads would depend on it)."""
    position = as_sympy(entry)
    if position is None:
        raise _Reject(f"index {entry!r} not understood")
    if _nonnegative(position, shape_env):
        return position
    if _negative(position, shape_env):
        return position + size
    raise _Reject(f"index {position} may be negative or not")


def _slice_start_step(entry: slice, size: sympy.Expr, shape_env=None):
    """A slice's first position and step. A negative start counts from the end and must stay
    inside the tensor (torch clamps it to 0 otherwise); one of unknown sign is rejected."""
    step = as_sympy(entry.step) if entry.step is not None else sympy.Integer(1)
    start = as_sympy(entry.start) if entry.start is not None else sympy.Integer(0)
    if step is None or start is None or not provably(step > 0):
        raise _Reject("slice with a non-integer or negative step")
    if _nonnegative(start, shape_env):
        return start, step
    if _negative(start, shape_env) and _nonnegative(start + size, shape_env):
        return start + size, step
    raise _Reject(f"slice start {start} may be clamped or counted from the end")


def _require_in_range(expr: sympy.Expr, extents: dict[sympy.Symbol, sympy.Expr], size: sympy.Expr, shape_env=None) -> None:
    """Tensor indices must be provably in [0, size): negative ones would wrap around.
    ``extents`` bounds each position symbol (the result's dimensions, vmap's levels)."""
    low = high = expr
    for symbol, extent in extents.items():
        if symbol in expr.free_symbols:
            coefficient = sympy.diff(expr, symbol)
            if coefficient.free_symbols & set(extents):
                raise _Reject("index arithmetic is not affine")
            if _nonnegative(coefficient):
                smallest, largest = sympy.Integer(0), extent - 1
            elif _nonnegative(-coefficient):
                smallest, largest = extent - 1, sympy.Integer(0)
            else:
                raise _Reject("index slope of unknown sign")
            low = low.xreplace({symbol: smallest})
            high = high.xreplace({symbol: largest})
    if (low.free_symbols | high.free_symbols) & set(extents):
        raise _Reject("index arithmetic is not affine")
    if not (_nonnegative(low, shape_env) and _nonnegative(size - 1 - high, shape_env)):
        raise _Reject("index not provably in range")
