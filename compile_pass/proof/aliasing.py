"""Which tensors of a graph may be written in place, through any alias.

A proof describes a tensor as the op that made it computed it; a rewrite may read a graph
input or a K/V source at another point than the original call did. Both are sound only if
nothing writes that tensor's memory. Two nodes share memory when their FakeTensors share a
storage: Dynamo's fakes keep the aliasing of views and of graph inputs that are views of one
another, so storage identity finds every alias whatever op made it (``.T``, ``narrow``,
``unfold``, an input passed twice...).

A tensor is trusted only when every user of every alias is a call whose signature says it
writes none of them (``calls.read_call``): an allow-list by schema, so a call the project
cannot read counts as a write. Checkpoint bodies are followed through their placeholders.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..calls import CallReader
from ..graphs import CHECKPOINT, checkpoint_body, checkpoint_operands, describe, example_value


def _storages(value) -> set[StorageWeakRef] | None:
    """The storages a node's value lives in; None for a tensor whose storage cannot be told."""
    if isinstance(value, torch.Tensor):
        while torch._C._functorch.is_batchedtensor(value):  # vmap's wrapper shares its tensor's memory
            value = torch._C._functorch.get_unwrapped(value)
        try:
            return {StorageWeakRef(value.untyped_storage())}
        except (NotImplementedError, RuntimeError):
            return None
    if isinstance(value, (list, tuple)):
        found: set[StorageWeakRef] = set()
        for item in value:
            inner = _storages(item)
            if inner is None:
                return None
            found |= inner
        return found
    return set()


class WriteAnalysis:
    """Answers "may this node's memory be written?" for nodes of one rewrite's graphs; memoised
    per storage. The rules add only readers (the op, comparisons) while they rewrite, so an
    answer stays true for the whole rewrite."""

    def __init__(self, calls: CallReader) -> None:
        self.calls = calls
        self._aliases: dict[torch.fx.Graph, dict[StorageWeakRef, list[torch.fx.Node]]] = {}
        self._answers: dict[tuple[torch.fx.Graph, StorageWeakRef], str | None] = {}

    def writer(self, node: torch.fx.Node) -> str | None:
        """Why ``node``'s memory may be written (naming the writing node), or None when every
        user of every alias provably only reads it."""
        storages = _storages(example_value(node))
        if storages is None:
            return f"the memory of {node.name} cannot be told apart from other tensors'"
        for storage in storages:
            key = (node.graph, storage)
            if key not in self._answers:
                self._answers[key] = None  # a cycle through checkpoint bodies adds nothing new
                self._answers[key] = self._find_writer(node.graph, storage)
            if self._answers[key] is not None:
                return self._answers[key]
        return None

    def escapes(self, node: torch.fx.Node) -> bool:
        """Whether ``node``'s memory may leave the graph: an alias is among its outputs, or its
        memory cannot be told."""
        storages = _storages(example_value(node))
        if storages is None:
            return True
        aliases = self._aliases_in(node.graph)
        return any(
            user.op == "output" for storage in storages for alias in aliases.get(storage, ()) for user in alias.users
        )

    def _aliases_in(self, graph: torch.fx.Graph) -> dict[StorageWeakRef, list[torch.fx.Node]]:
        if graph not in self._aliases:
            aliases: dict[StorageWeakRef, list[torch.fx.Node]] = {}
            for node in graph.nodes:
                for storage in _storages(example_value(node)) or ():
                    aliases.setdefault(storage, []).append(node)
            self._aliases[graph] = aliases
        return self._aliases[graph]

    def _find_writer(self, graph: torch.fx.Graph, storage: StorageWeakRef) -> str | None:
        for alias in self._aliases_in(graph).get(storage, ()):
            for user in alias.users:
                reason = self._writes(user, alias)
                if reason is not None:
                    return reason
        return None

    def _writes(self, user: torch.fx.Node, alias: torch.fx.Node) -> str | None:
        if user.op == "output":
            return None
        if user.op == "call_function" and user.target is CHECKPOINT:
            placeholders = checkpoint_body(user).graph.find_nodes(op="placeholder")
            for placeholder, operand in zip(placeholders, checkpoint_operands(user), strict=True):
                if operand is alias:
                    reason = self.writer(placeholder)
                    if reason is not None:
                        return reason
            return None
        call = self.calls.read(user)
        if call is None:
            return f"{alias.name} is passed to {describe(user)}, which is not known to leave it unwritten"
        for name in call.writes:
            value = call.arguments.get(name)
            if value is alias or (isinstance(value, (list, tuple)) and alias in value):
                return f"{alias.name} is written in place by {describe(user)}"
        return None
