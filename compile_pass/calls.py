"""Reading a call node by its operator's signature: every parameter by name, defaults filled in,
and which parameters the call may write (``Tensor(a!)``), as ``torch.fx.operator_schemas``
normalises calls. ``CallReader`` reads each node once per rewrite, for the proof and the rules
alike."""

from __future__ import annotations

import builtins
import functools
import inspect
import numbers
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._functorch import predispatch
from torch.fx.operator_schemas import _torchscript_schema_to_signature, get_signature_for_torch_op


@dataclass(frozen=True)
class Call:
    """A call read by its operator's signature: every parameter by name (``self`` is called
    ``input``, as torch's Python functions call it), defaults filled in, and the parameters
    the matched schemas may write into (``Tensor(a!)``)."""

    arguments: dict[str, Any]
    writes: frozenset[str]

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def first(self, count: int) -> list[Any]:
        """The first ``count`` parameters' values, in signature order (Python operators name
        them a, b; torch functions input, other)."""
        return list(self.arguments.values())[:count]


# Python operators Dynamo records on tensors: those that return a new value, and those that
# write into their first operand.
_PURE_OPERATORS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.matmul,
    operator.neg,
    operator.pos,
    operator.abs,
    operator.invert,
    operator.and_,
    operator.or_,
    operator.xor,
    operator.lshift,
    operator.rshift,
    operator.not_,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
    operator.getitem,
    operator.truth,
    operator.is_,
    operator.is_not,
    operator.contains,
    builtins.getattr,
    builtins.abs,
    builtins.len,
    builtins.isinstance,
}
_WRITING_OPERATORS = {
    operator.setitem,
    operator.delitem,
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
}
# Python functions Dynamo records that only wrap or unwrap a tensor: vmap's batch dimensions
# (transformers builds masks under vmap when given custom mask functions).
_PURE_FUNCTIONS = {predispatch._add_batch_dim, predispatch._remove_batch_dim}
# Tensor methods that only exist in Python (no aten op of that name): dtype conversions.
_CONVERSION_METHODS = {"bool", "byte", "char", "short", "int", "long", "half", "float", "double", "bfloat16"}


@functools.cache
def _python_signature(target: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        # Builtins without text signatures: name the operands as the operator module does.
        count = (
            1
            if target
            in (
                operator.neg,
                operator.pos,
                operator.abs,
                operator.invert,
                operator.not_,
                operator.truth,
                builtins.abs,
                builtins.len,
            )
            else 2
        )
        names = ("a", "b", "c")[:count] if target is not builtins.getattr else ("object", "name")
        return inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in names])


@functools.cache
def _aten_schemas(name: str) -> tuple[torch._C.FunctionSchema, ...]:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return ()
    return tuple(getattr(packet, overload)._schema for overload in packet.overloads())


@functools.cache
def _candidates(kind: str, target) -> tuple[tuple[inspect.Signature, frozenset[str]], ...] | None:
    """(signature, written parameters) for every overload of a call target, or None if unknown."""
    if kind == "call_method":
        if target in _CONVERSION_METHODS:
            signature = inspect.Signature(
                [
                    inspect.Parameter("input", inspect.Parameter.POSITIONAL_ONLY),
                    inspect.Parameter("memory_format", inspect.Parameter.KEYWORD_ONLY, default=None),
                ]
            )
            return ((signature, frozenset()),)
        # x.__eq__(y) is x.eq(y): dunder methods fall back to the op of their plain name.
        schemas = _aten_schemas(target) + (_aten_schemas(target.strip("_")) if target.startswith("__") else ())
    elif target in _PURE_OPERATORS or target in _WRITING_OPERATORS:
        signature = _python_signature(target)
        first = next(iter(signature.parameters))
        return ((signature, frozenset({first} if target in _WRITING_OPERATORS else ())),)
    elif target in _PURE_FUNCTIONS:
        return ((inspect.signature(target, eval_str=True), frozenset()),)
    elif isinstance(target, torch._ops.OpOverload):
        schemas = (target._schema,)
    elif isinstance(target, torch._ops.OpOverloadPacket):
        schemas = tuple(getattr(target, name)._schema for name in target.overloads())
    elif getattr(target, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        schemas = _aten_schemas(target.__name__)  # a Tensor method called as a function
    else:
        try:
            _, found = get_signature_for_torch_op(target, return_schemas=True)
        except Exception:  # noqa: BLE001 - targets torch cannot look up are simply unknown
            found = None
        schemas = tuple(found or ())
    if not schemas:
        return None
    return tuple(
        (
            _torchscript_schema_to_signature(schema),
            frozenset(
                "input" if argument.name == "self" else argument.name
                for argument in schema.arguments
                if argument.alias_info is not None and argument.alias_info.is_write
            ),
        )
        for schema in schemas
    )


def _value_kind(value: Any) -> type | None:
    """The Python type a schema would see for ``value``; None when it cannot be told."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("example_value")
        if value is None or isinstance(value, (list, tuple)):
            return None  # a node's container result: not told apart here
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    for symbolic, plain in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
        if isinstance(value, symbolic):
            return plain
    if isinstance(value, (list, tuple)):
        return list
    return type(value)


def _fits(annotation: Any, value: Any) -> bool:
    """Whether ``value`` can be passed where the schema says ``annotation`` (types that the
    overloads of one op are told apart by: tensors, numbers, lists, dtypes and devices)."""
    kind = _value_kind(value)
    if kind is None or annotation is inspect.Parameter.empty or annotation is typing.Any:
        return True
    options = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else (annotation,)
    for option in options:
        if option is type(None):
            if value is None:
                return True
            continue
        origin = typing.get_origin(option)
        if origin in (list, tuple):
            if kind is list:
                (element,) = typing.get_args(option)[:1] or (typing.Any,)
                if all(_fits(element, item) for item in value):
                    return True
            elif kind is int and typing.get_args(option)[:1] == (int,):
                return True  # one int where the schema takes int[]
            continue
        if option is torch.Tensor:
            if kind is torch.Tensor:
                return True
        elif option is numbers.Number:
            if kind in (int, float, bool, complex):
                return True
        elif option is int:  # ints, and enums schemas store as ints
            if kind in (int, bool, torch.dtype, torch.memory_format, torch.layout):
                return True
        elif option is float:
            if kind in (int, float, bool):
                return True
        elif option is torch.device:
            if kind in (torch.device, str, int):
                return True
        elif inspect.isclass(option) and inspect.isclass(kind) and issubclass(kind, option):
            return True
    return False


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        # x.view(2, 3) for view(Tensor self, SymInt[] size), torch.zeros(2, 3) for
        # zeros(SymInt[] size): Python packs the trailing ints into the first list parameter.
        parameters = list(signature.parameters.values())
        first_list = next(
            (k for k, p in enumerate(parameters) if typing.get_origin(p.annotation) in (list, tuple)), None
        )
        if first_list is not None and len(args) > first_list + 1 and not isinstance(args[first_list], (list, tuple)):
            return _bind(signature, (*args[:first_list], tuple(args[first_list:])), kwargs)
        return None
    if not all(_fits(signature.parameters[name].annotation, value) for name, value in bound.arguments.items()):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


# torch.nn.functional's Python wrappers Dynamo records as they are (no schema of their own),
# each with the arguments it writes, from its bound arguments: dropout its input unless
# ``inplace`` is the constant False; embedding its weight (renormalised) where ``max_norm`` is
# given, never its indices.
_FUNCTIONAL_WRITES: dict[Any, Callable[[dict], frozenset[str]]] = {
    torch.nn.functional.softmax: lambda arguments: frozenset(),
    torch.nn.functional.dropout: lambda arguments: frozenset(() if arguments["inplace"] is False else ("input",)),
    torch.nn.functional.embedding: lambda arguments: frozenset(() if arguments["max_norm"] is None else ("weight",)),
}


def _read_functional(node: torch.fx.Node, writes: Callable[[dict], frozenset[str]]) -> Call | None:
    """A torch.nn.functional wrapper's call by its Python signature."""
    if not callable(node.target):
        return None
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    return Call(arguments, writes(arguments))


def read_call(node: torch.fx.Node) -> Call | None:
    """``node``'s arguments by its operator's signature, or None where no overload fits (or
    the target is unknown). Overloads that fit equally give the arguments of the first and
    the union of their writes."""
    if node.op == "output":  # output(result): what the graph returns
        (result,) = node.args
        return Call({"result": result}, frozenset())
    if node.op not in ("call_function", "call_method"):
        return None
    functional = _FUNCTIONAL_WRITES.get(node.target) if node.op == "call_function" else None
    if functional is not None:
        return _read_functional(node, functional)
    candidates = _candidates(node.op, node.target)
    if candidates is None:
        return None
    matches = [
        (arguments, writes)
        for signature, writes in candidates
        if (arguments := _bind(signature, node.args, dict(node.kwargs))) is not None
    ]
    if not matches:
        return None
    return Call(matches[0][0], frozenset().union(*(writes for _, writes in matches)))


class CallReader:
    """``read_call`` memoised per node for one rewrite: the proof, the write analysis and the
    rules read a node's arguments through one reader, so each call is bound once. A node whose
    arguments a rule has since changed (the causal rule edits SDPA's) is read again: the memo
    holds the very argument tuple and dict it was read from."""

    def __init__(self):
        self._memo: dict[torch.fx.Node, tuple[tuple, dict, Call | None]] = {}

    def read(self, node: torch.fx.Node) -> Call | None:
        entry = self._memo.get(node)
        if entry is None or entry[0] is not node.args or entry[1] is not node.kwargs:
            entry = (node.args, node.kwargs, read_call(node))
            self._memo[node] = entry
        return entry[2]
