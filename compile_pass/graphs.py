"""Finding attention calls in Dynamo's torch-level graphs, including activation-checkpoint bodies,
and reading every call by its operator's signature."""

from __future__ import annotations

import builtins
import functools
import inspect
import math
import numbers
import operator
import os
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx
from torch._functorch import predispatch
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings, guard_int, guard_or_false, statically_known_true
from torch.fx.operator_schemas import _torchscript_schema_to_signature, get_signature_for_torch_op

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


# -- reading calls by signature ----------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A call read by its operator's signature: every parameter by name (``self`` is called
    ``input``, as torch's Python functions call it), defaults filled in, and the parameters
    the matched schemas may write into (``Tensor(a!)``)."""

    arguments: dict[str, Any]
    writes: frozenset[str]

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]


# Python operators Dynamo records on tensors: those that return a new value, and those that
# write into their first operand.
_PURE_OPERATORS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
    operator.pow, operator.matmul, operator.neg, operator.pos, operator.abs, operator.invert,
    operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift, operator.not_,
    operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne,
    operator.getitem, operator.truth, operator.is_, operator.is_not, operator.contains,
    builtins.getattr, builtins.abs, builtins.len, builtins.isinstance,
}
_WRITING_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
}
# Python functions Dynamo records that only wrap or unwrap a tensor: vmap's batch dimensions
# (transformers builds masks under vmap when given custom mask functions).
_PURE_FUNCTIONS = {predispatch._add_batch_dim, predispatch._remove_batch_dim}
# Tensor methods that only exist in Python (no aten op of that name): dtype conversions.
_CONVERSION_METHODS = {"bool", "byte", "char", "short", "int", "long", "half", "float", "double", "bfloat16"}


@functools.cache
def _python_signature(target) -> inspect.Signature | None:
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        # Builtins without text signatures: name the operands as the operator module does.
        count = 1 if target in (operator.neg, operator.pos, operator.abs, operator.invert, operator.not_,
                                operator.truth, builtins.abs, builtins.len) else 2
        names = ("a", "b", "c")[:count] if target is not builtins.getattr else ("object", "name")
        return inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY) for name in names]
        )


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
            signature = inspect.Signature([
                inspect.Parameter("input", inspect.Parameter.POSITIONAL_ONLY),
                inspect.Parameter("memory_format", inspect.Parameter.KEYWORD_ONLY, default=None),
            ])
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


def read_call(node: torch.fx.Node) -> Call | None:
    """``node``'s arguments by its operator's signature, or None where no overload fits (or
    the target is unknown). Overloads that fit equally give the arguments of the first and
    the union of their writes."""
    if node.op not in ("call_function", "call_method"):
        return None
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


def sdpa_arguments(node: torch.fx.Node) -> Call | None:
    """SDPA's arguments by name (query, key, value, attn_mask, dropout_p, is_causal, scale,
    enable_gqa), or None where the call does not fit the signature."""
    return read_call(node) if is_sdpa(node) else None


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep


def source_line(node: torch.fx.Node) -> str:
    """``path:line`` of the innermost frame of the node's stack trace outside torch itself (the
    user's code or the model's, not ``Tensor.__floordiv__``); "" where Dynamo recorded none."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    for path, line in reversed(frames):
        if not path.startswith(_TORCH_ROOT):
            return f"{_short_path(path)}:{line}"
    return ""


def _short_path(path: str) -> str:
    """Relative to the longest ``sys.path`` entry (site-packages, the script's folder) or the
    working directory that holds it, else as given."""
    roots = [os.path.abspath(entry or os.curdir) for entry in sys.path] + [os.getcwd()]
    holders = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(holders, key=len)) if holders else path


def describe(node: torch.fx.Node) -> str:
    """The op a node calls, and the node's name where it adds something: ``.to() (to_1)``."""
    bare = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    op = f".{bare}()" if node.op == "call_method" else str(bare)
    return op if node.name == bare else f"{op} ({node.name})"


def same_size(a, b) -> bool:
    """Two sizes (ints or SymInts) are equal for every value of their symbols; adds no guard."""
    return statically_known_true(a == b)


def model_constant(size) -> int | None:
    """A size that is a model constant (head_dim, heads) as a Python int: its value when the
    graph pins it, else the value it was traced with, with a guard, so the compiled graph
    serves only that value (a model's head_dim never changes, so this never recompiles).
    None for a size with no traced value."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    if not isinstance(hint, int):
        return None
    if not statically_known_true(size == hint):
        guard_int(size)
    return hint


def sdpa_requires_equal(a, b) -> bool:
    """Two sizes SDPA itself requires equal (key and value lengths, query and key head_dim):
    equal for this graph, with a guard where the symbols do not say so already. A call where
    they differ fails in SDPA, so the guard only rules out calls that could not run."""
    return guard_or_false(a == b)


def sdpa_mask_problem(args: Call) -> str | None:
    """Why no rule may compute SDPA's mask another way, or None: the mask must be a tensor on
    the query's device that broadcasts to (batch, query heads, Sq, Sk) without widening any of
    them (a wider mask would widen SDPA's result), and the scale a positive finite number
    known when the graph is traced (SDPA's ``is_causal`` path and the band kernels compute
    other scales differently from SDPA with the mask: NaN where it gives numbers, or numbers
    where it gives NaN)."""
    scale = args["scale"]
    if scale is not None:
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            return "scale computed at run time"
        if not (math.isfinite(scale) and scale > 0):
            return f"scale {scale!r} is not a positive finite number"
    query, key, mask = (example_value(args[name]) for name in ("query", "key", "attn_mask"))
    if not (isinstance(mask, torch.Tensor) and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)):
        return "mask, query or key is not a tensor"
    if mask.dim() > 4 or query.dim() != 4 or key.dim() != 4 or mask.device != query.device:
        return "mask is not a tensor of at most 4 dimensions on the query's device"
    attention_shape = (*query.shape[:3], key.shape[2])
    if not all(same_size(size, 1) or same_size(size, full) for size, full in zip(reversed(mask.shape), reversed(attention_shape))):
        return f"mask shape {tuple(mask.shape)} does not broadcast to {tuple(attention_shape)} without widening it"
    return None


def example_value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def graph_outputs(graph: torch.fx.Graph) -> tuple:
    """The values a graph returns, in order (Dynamo's graphs return one flat tuple)."""
    (output,) = graph.find_nodes(op="output")
    values = output.args[0]
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


# -- activation-checkpoint bodies ----------------------------------------------------------


def checkpoint_body(caller: torch.fx.Node) -> torch.fx.GraphModule:
    """The subgraph module a ``tag_activation_checkpoint(body, *operands)`` call runs."""
    return getattr(caller.graph.owning_module, caller.args[0].target)


def checkpoint_operands(caller: torch.fx.Node) -> tuple:
    """The operands a checkpoint call passes to its body's placeholders, in order."""
    return tuple(caller.args[1:])


@dataclass
class Scope:
    """One graph to rewrite: the root module's, or a checkpoint body's."""

    name: str  # "" for the root graph
    module: torch.fx.GraphModule
    callers: list[torch.fx.Node]  # HOP nodes calling this body (empty for the root)


def scopes(root: torch.fx.GraphModule) -> Iterator[Scope]:
    """The root graph, then every activation-checkpoint body reachable from it."""
    yield Scope("", root, [])
    pending = [root]
    seen: dict[str, Scope] = {}
    while pending:
        module = pending.pop()
        for node in module.graph.find_nodes(op="call_function", target=CHECKPOINT):
            name = node.args[0].target
            if name not in seen:
                seen[name] = Scope(name, checkpoint_body(node), [])
                pending.append(seen[name].module)
            seen[name].callers.append(node)
    yield from seen.values()


def placeholder_operands(scope_list: list[Scope]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Body placeholder -> the parent graph's operand, where every caller passes the same one."""
    resolved = {}
    for scope in scope_list:
        if not scope.callers:
            continue
        placeholders = scope.module.graph.find_nodes(op="placeholder")
        for position, placeholder in enumerate(placeholders):
            operands = {checkpoint_operands(caller)[position] for caller in scope.callers}
            if len(operands) == 1:
                operand = operands.pop()
                if isinstance(operand, torch.fx.Node):
                    resolved[placeholder] = operand
    return resolved


def drop_unused_placeholders(scope: Scope) -> None:
    """Remove body inputs nothing reads any more, from the body and from every call."""
    placeholders = scope.module.graph.find_nodes(op="placeholder")
    unused = [position for position, node in enumerate(placeholders) if not node.users]
    if not unused or not scope.callers:
        return
    for caller in scope.callers:
        operands = [arg for position, arg in enumerate(checkpoint_operands(caller)) if position not in unused]
        caller.args = (caller.args[0], *operands)
    for position in unused:
        scope.module.graph.erase_node(placeholders[position])


def pass_into_body(value: torch.fx.Node, body: torch.fx.Graph) -> torch.fx.Node | None:
    """Make ``value`` (a node of the graph that calls ``body`` through activation checkpointing)
    available inside ``body``: one more operand on every call, one more placeholder at the end.
    None when ``body`` is not called from ``value``'s graph."""
    callers = [
        node
        for node in value.graph.find_nodes(op="call_function", target=CHECKPOINT)
        if checkpoint_body(node).graph is body
    ]
    if not callers:
        return None
    for caller in callers:
        caller.args = (*caller.args, value)
    placeholders = body.find_nodes(op="placeholder")
    with body.inserting_after(placeholders[-1]) if placeholders else body.inserting_before():
        inside = body.placeholder(f"{value.name}_input")
    inside.meta["example_value"] = example_value(value)
    return inside


def fake_result(fn, *args) -> Any:
    """``fn(*example values of args)`` computed in the fake mode of its inputs, as Dynamo does
    for the nodes it creates; None when no argument carries a fake tensor. Rules call this
    before they change the graph, so a failure leaves the graph as it was."""
    examples = [example_value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = next((getattr(e, "fake_mode", None) for e in examples if isinstance(e, torch.Tensor)), None)
    if fake_mode is None:
        return None
    with fake_mode, torch.no_grad():
        result = fn(*examples)
    # A size only known at run time (a custom op's data-dependent output) is a new unbacked
    # symbol, pending until a node binds it. AOTAutograd traces the rewritten graph again and
    # binds its own; this one must not stay pending, or the compile fails.
    compute_unbacked_bindings(fake_mode.shape_env, result)
    return result


def erase_if_dead(graph: torch.fx.Graph, candidates: set[torch.fx.Node]) -> None:
    """Erase candidate nodes left without users, latest first so chains go in one sweep. Only
    calls known to have no effect besides their result go: an in-place write or an assertion
    stays even when nothing reads its result."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users and _has_no_effect(node):
            graph.erase_node(node)


def _has_no_effect(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    call = read_call(node)
    return call is not None and not call.writes


__all__ = [
    "CHECKPOINT",
    "Call",
    "Scope",
    "checkpoint_body",
    "checkpoint_operands",
    "describe",
    "drop_unused_placeholders",
    "erase_if_dead",
    "example_value",
    "fake_result",
    "graph_outputs",
    "is_sdpa",
    "pass_into_body",
    "placeholder_operands",
    "read_call",
    "same_size",
    "scopes",
    "source_line",
    "sdpa_arguments",
    "sdpa_mask_problem",
    "sdpa_requires_equal",
    "model_constant",
]
