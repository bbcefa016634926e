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

One written tensor is still read (``filled_before_read``): a buffer the graph itself creates
(``zeros``, ``empty``, ``full``, ``ones``, their ``new_*`` and ``*_like`` forms: memory no
input shares) and fills in place before anything reads it, such as a decoder's input ids
shifted right (``shifted = ids.new_zeros(...)``, ``shifted[..., 1:] = ids[..., :-1]``,
``shifted[..., 0] = start``, ``shifted.masked_fill_(shifted == -100, pad)``). Graph order is
execution order, so every read after its last write sees the same values, the ones the graph
left there; the proof reads it then as opaque data (never as the factory's values), and the op
reads it later still. Safe only while nothing else can see it between writes: every user of
every alias is a call the project reads (no checkpoint body, which could read it again in the
backward; not an output, which later code could write); each reader not itself a view comes
after the last write, or feeds nothing but those writes (``shifted == -100`` above).
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


_FRESH = {
    "zeros",
    "empty",
    "full",
    "ones",
    "new_zeros",
    "new_empty",
    "new_full",
    "new_ones",
    "zeros_like",
    "empty_like",
    "full_like",
    "ones_like",
}


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


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

    def filled_before_read(self, node: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
        """Where ``node``'s memory is a buffer the graph creates and fills before any read (the
        module's docstring): (the buffer's node, what filled it, for the proof's reasons); else
        None. ``node`` is the buffer or a view of it."""
        storages = _storages(example_value(node))
        if storages is None or len(storages) != 1:
            return None
        aliases = self._aliases_in(node.graph)[next(iter(storages))]  # in graph order
        buffer = aliases[0]
        if buffer.op not in ("call_function", "call_method") or _name(buffer) not in _FRESH:
            return None
        writes: list[torch.fx.Node] = []
        reads: list[torch.fx.Node] = []
        for alias in aliases:
            for user in alias.users:
                call = self.calls.read(user) if user.op in ("call_function", "call_method") else None
                if call is None or user.target is CHECKPOINT:
                    return None
                written = [call.arguments.get(name) for name in call.writes]
                if any(value is alias or (isinstance(value, (list, tuple)) and alias in value) for value in written):
                    writes.append(user)
                elif user not in aliases:  # a view is no read: its own users are looked at
                    reads.append(user)
        if not writes:
            return None
        last = max(writes)
        for read in reads:
            if not (read > last or (read.users and all(user in writes for user in read.users))):
                return None
        return buffer, f"{buffer.name}, filled in place before it is read (last by {describe(last)})"

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
