"""Finding attention calls in Dynamo's torch-level graphs, including activation-checkpoint bodies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def sdpa_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """SDPA's arguments by name, positional or keyword, defaults filled in."""
    arguments = dict(SDPA_DEFAULTS)
    arguments.update(zip(SDPA_PARAMETERS, node.args))
    arguments.update(node.kwargs)
    return arguments


def example_value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


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
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is CHECKPOINT:
                name = node.args[0].target
                if name not in seen:
                    seen[name] = Scope(name, getattr(module, name), [])
                    pending.append(seen[name].module)
                seen[name].callers.append(node)
    yield from seen.values()


def placeholder_operands(scope_list: list[Scope]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Body placeholder -> the parent graph's operand, where every caller passes the same one."""
    resolved = {}
    for scope in scope_list:
        if not scope.callers:
            continue
        placeholders = [node for node in scope.module.graph.nodes if node.op == "placeholder"]
        for position, placeholder in enumerate(placeholders):
            operands = {caller.args[1 + position] for caller in scope.callers}
            if len(operands) == 1:
                operand = operands.pop()
                if isinstance(operand, torch.fx.Node):
                    resolved[placeholder] = operand
    return resolved


def drop_unused_placeholders(scope: Scope) -> None:
    """Remove body inputs nothing reads any more, from the body and from every call."""
    placeholders = [node for node in scope.module.graph.nodes if node.op == "placeholder"]
    unused = [position for position, node in enumerate(placeholders) if not node.users]
    if not unused or not scope.callers:
        return
    for caller in scope.callers:
        operands = [arg for position, arg in enumerate(caller.args[1:]) if position not in unused]
        caller.args = (caller.args[0], *operands)
    for position in unused:
        scope.module.graph.erase_node(placeholders[position])


def pass_into_body(value: torch.fx.Node, body: torch.fx.Graph) -> torch.fx.Node | None:
    """Make ``value`` (a node of the graph that calls ``body`` through activation checkpointing)
    available inside ``body``: one more operand on every call, one more placeholder at the end.
    None when ``body`` is not called from ``value``'s graph."""
    parent = value.graph.owning_module
    callers = [
        node
        for node in value.graph.find_nodes(op="call_function", target=CHECKPOINT)
        if getattr(parent, node.args[0].target).graph is body
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


def set_fake_result(node: torch.fx.Node, fn, *args) -> None:
    """Record ``fn(*example values of args)`` as the new node's example value, computed in
    the fake mode of its inputs, as Dynamo does for the nodes it creates."""
    examples = [example_value(a) if isinstance(a, torch.fx.Node) else a for a in args]
    # A None argument stays None (optional inputs).
    fake_mode = next((getattr(e, "fake_mode", None) for e in examples if isinstance(e, torch.Tensor)), None)
    if fake_mode is None:
        return
    with fake_mode, torch.no_grad():
        node.meta["example_value"] = fn(*examples)


def erase_if_dead(graph: torch.fx.Graph, candidates: set[torch.fx.Node]) -> None:
    """Erase candidate nodes left without users, latest first so chains go in one sweep."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)


__all__ = [
    "CHECKPOINT",
    "Scope",
    "drop_unused_placeholders",
    "erase_if_dead",
    "example_value",
    "is_sdpa",
    "pass_into_body",
    "placeholder_operands",
    "scopes",
    "sdpa_arguments",
    "set_fake_result",
]
