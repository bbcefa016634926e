"""The structure of Dynamo's torch-level graphs and how rules edit them: the root graph and its
activation-checkpoint bodies, where a node came from in the user's code, fake values for new
nodes, and dead-code removal."""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

from .calls import CallReader

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


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


# How Dynamo spells a module's child, parameter or buffer in a source name: through
# ``__dict__['_modules']`` where a module defines ``__getattr__`` (PEFT's wrappers), or
# through the registries directly.
REGISTRY_ENTRY = re.compile(
    r"""(?:\.__dict__\[['"]_(?:modules|parameters|buffers)['"]\]|\._(?:modules|parameters|buffers))\[['"]([^'"]+)['"]\]"""
)
_SOURCE_ROOT = re.compile(r"""^([LG])\[['"]([^'"]+)['"]\](.*)$""")


def dotted_source(source_name: str) -> str:
    """A Dynamo source name with every registry entry written as an attribute:
    ``L['self'].__dict__['_modules']['base_model']._parameters['weight']`` ->
    ``L['self'].base_model.weight``."""
    return REGISTRY_ENTRY.sub(r".\1", source_name)


# A decorated method's wrapper, ``def wrapper(*args, **kwargs)`` (as transformers wraps its
# models' forwards), is the frame Dynamo compiles: the module is its ``args[0]``, as ``self``.
WRAPPED_SELF = "args[0]"


def split_source(source_name: str) -> tuple[str, str, str] | None:
    """``(scope, root, dotted rest)`` of a source name rooted in a frame's locals (L) or
    globals (G): ``("L", "self", ".model.layers.3")``, ``("L", "args[0]", ".model.layers.3")``
    in a decorated method's wrapper; None for another form."""
    match = _SOURCE_ROOT.match(dotted_source(source_name))
    if match is None:
        return None
    scope, root, rest = match.groups()
    if root == "args" and rest.startswith("[0]"):
        return scope, WRAPPED_SELF, rest.removeprefix("[0]")
    return scope, root, rest


def root_value(scope: dict, root: str):
    """The value ``split_source``'s root names in a frame's locals or globals, or None."""
    if root == WRAPPED_SELF:
        args = scope.get("args")
        return args[0] if isinstance(args, tuple) and args else None
    return scope.get(root)


def qualified_name(source_name: str) -> str:
    """What a user calls the module, parameter or buffer a source name points to:
    ``L['self'].model.layers.3`` -> ``model.layers.3`` (the compiled module's own name for
    it; ``args[0]`` in a decorated method's wrapper likewise); another root keeps its name:
    ``G['model'].layers.3`` -> ``model.layers.3``."""
    parts = split_source(source_name)
    if parts is None:
        return source_name
    _, root, rest = parts
    return rest.removeprefix(".") if root in ("self", WRAPPED_SELF) else root + rest


def describe(node: torch.fx.Node) -> str:
    """The op a node calls, and the node's name where it adds something: ``.to() (to_1)``."""
    bare = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    op = f".{bare}()" if node.op == "call_method" else str(bare)
    return op if node.name == bare else f"{op} ({node.name})"


def example_value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def graph_outputs(graph: torch.fx.Graph) -> tuple:
    """The values a graph returns, in order (Dynamo's graphs return one flat tuple)."""
    (output,) = graph.find_nodes(op="output")
    values = output.args[0]
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


class Snapshot:
    """A graph as it was, to put back whole. A deep copy keeps each node's ``meta`` but not the
    attributes set on the node itself, which Dynamo uses for what AOTAutograd reads (each
    placeholder's ``_dynamo_source``): the copy's nodes get them back by name."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = copy.deepcopy(graph)
        self.attributes = {node.name: dict(vars(node)) for node in graph.nodes if vars(node)}

    def restored(self) -> torch.fx.Graph:
        for node in self.graph.nodes:
            for name, value in self.attributes.get(node.name, {}).items():
                setattr(node, name, value)
        return self.graph


# -- activation-checkpoint bodies ----------------------------------------------------------


def marked_dynamic_symbols(root: torch.fx.GraphModule) -> frozenset:
    """The symbols of the sizes the user marked dynamic (``torch._dynamo.mark_dynamic``) among
    the graph's inputs: Dynamo fails a compile whose guards pin such a size to one value, so a
    choice made by the length must not guard them. Read from the tensors the caller passed
    (Dynamo's ``grapharg``), which carry the marks, and their fake values' sizes."""
    symbols: set = set()
    for placeholder in root.graph.find_nodes(op="placeholder"):
        grapharg = placeholder.meta.get("grapharg")
        passed = grapharg.example if grapharg is not None else None
        fake = example_value(placeholder)
        marked = getattr(passed, "_dynamo_dynamic_indices", None) if isinstance(passed, torch.Tensor) else None
        if not marked or not isinstance(fake, torch.Tensor):
            continue
        for dim in marked:
            if dim < fake.dim() and isinstance(fake.shape[dim], torch.SymInt):
                symbols |= fake.shape[dim].node.expr.free_symbols
    return frozenset(symbols)


def checkpoint_body(caller: torch.fx.Node) -> torch.fx.GraphModule:
    """The subgraph module a ``tag_activation_checkpoint(body, *operands)`` call runs."""
    return getattr(caller.graph.owning_module, caller.args[0].target)


def checkpoint_calls(graph: torch.fx.Graph, body: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes of ``graph`` that run ``body`` through activation checkpointing, in graph order."""
    return sorted(
        node for node in graph.find_nodes(op="call_function", target=CHECKPOINT) if checkpoint_body(node).graph is body
    )


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
    available inside ``body``: the placeholder every call already passes it to, else one more
    operand on every call and one more placeholder at the end, under a name of its own. None
    when ``body`` is not called from ``value``'s graph."""
    callers = checkpoint_calls(value.graph, body)
    if not callers:
        return None
    placeholders = body.find_nodes(op="placeholder")
    for position, placeholder in enumerate(placeholders):
        if all(checkpoint_operands(caller)[position] is value for caller in callers):
            return placeholder
    for caller in callers:
        caller.args = (*caller.args, value)
    taken = {placeholder.target for placeholder in placeholders}
    name = next(
        f"{value.name}_input{suffix}"
        for suffix in ("", *range(2, len(taken) + 3))
        if f"{value.name}_input{suffix}" not in taken
    )
    with body.inserting_after(placeholders[-1]) if placeholders else body.inserting_before():
        inside = body.placeholder(name)
    inside.meta["example_value"] = example_value(value)
    return inside


class EditLog:
    """The graphs as they were before one rule's ``replace``, to put back exactly if it fails
    midway. Rules only add nodes and change the arguments of existing ones (the driver erases
    what they leave dead), so undoing needs no copy: the arguments are restored and the added
    nodes erased, and every other node keeps its identity, which later rules, the proof's memo
    and the report hold on to."""

    def __init__(self, graph_list: list[torch.fx.Graph]):
        self._before = [
            (graph, list(graph.nodes), {node: (node.args, node.kwargs) for node in graph.nodes}) for graph in graph_list
        ]

    def undo(self) -> None:
        """Restore every graph; raises where an edit did what the contract forbids (erased or
        moved a node), which the driver answers by restoring from its copies."""
        for graph, nodes, calls in self._before:
            present = set(graph.nodes)
            for node in nodes:
                if node not in present:
                    raise RuntimeError(f"the edit erased {node.name}; it cannot be undone in place")
                args, kwargs = calls[node]
                if node.args is not args:
                    node.args = args
                if node.kwargs is not kwargs:
                    node.kwargs = kwargs
        for graph, nodes, _ in self._before:
            before = set(nodes)
            for node in reversed(list(graph.nodes)):
                if node not in before:
                    graph.erase_node(node)
            if list(graph.nodes) != nodes:
                raise RuntimeError("the edit moved nodes; it cannot be undone in place")


def fake_result(fn, *args) -> Any:
    """``fn(*example values of args)`` computed in the fake mode of its inputs, as Dynamo does
    for the nodes it creates (SymInt arithmetic as it is); None when no argument carries a
    fake tensor or a SymInt. Rules call this
    before they change the graph, so a failure leaves the graph as it was."""
    examples = [example_value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = next((getattr(e, "fake_mode", None) for e in examples if isinstance(e, torch.Tensor)), None)
    if fake_mode is None:
        # Arithmetic on sizes (SymInts) needs no fake mode.
        return fn(*examples) if any(isinstance(e, torch.SymInt) for e in examples) else None
    with fake_mode, torch.no_grad():
        result = fn(*examples)
    # A size only known at run time (a custom op's data-dependent output) is a new unbacked
    # symbol, pending until a node binds it. AOTAutograd traces the rewritten graph again and
    # binds its own; this one must not stay pending, or the compile fails.
    compute_unbacked_bindings(fake_mode.shape_env, result)
    return result


def erase_if_dead(graph: torch.fx.Graph, candidates: set[torch.fx.Node], calls: CallReader) -> None:
    """Erase candidate nodes left without users, latest first so chains go in one sweep. Only
    calls known to have no effect besides their result go: an in-place write or an assertion
    stays even when nothing reads its result."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users and _has_no_effect(node, calls):
            graph.erase_node(node)


def _has_no_effect(node: torch.fx.Node, calls: CallReader) -> bool:
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    call = calls.read(node)
    return call is not None and not call.writes
