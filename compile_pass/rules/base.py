"""The rule contract, as torch's pattern matcher frames a rewrite: a named pattern, a guard and
a replacement.

A rule is a module with
- ``NAME``: its switch (``rewrite(gm, NAME=False)``) and the report's rule column;
- ``TARGETS``: the ``(node.op, node.target)`` pairs it looks at, each with the kind of decision
  the report files it under; the driver (``backend.rewrite``) offers a rule only those nodes;
- ``matches(site, context) -> bool``: whether the node is the rule's pattern, so it owes a
  decision (an MoE router's top-k builds no mask: no decision; one whose picks reach a scatter
  but no attention call may be kept with ``Kept(reason, reported=False)``: no decision either);
- ``check(site, context) -> Plan | Kept``: the rewrite to make, with everything that can fail
  already computed, or why the node stays as it is;
- ``replace(plan, context) -> set[Node]``: make the rewrite by adding nodes and changing the
  arguments of existing ones, never erasing or moving one; returns nodes it may have left
  dead (the driver erases them, and the rewritten node once unused). If it raises midway the
  driver undoes its edits in place (``graphs.EditLog``).

The driver reads each node's call once (``Site``), tries the rules in order, takes the first
plan, and turns an unexpected exception in any step into a kept decision and a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.fx

from ..calls import Call, CallReader
from ..proof import MaskEvaluator

Target = tuple[str, Any]


@dataclass(frozen=True)
class Site:
    """A node offered to a rule, with its call read by signature (once per rewrite)."""

    node: torch.fx.Node
    call: Call


@dataclass(frozen=True)
class Kept:
    """Why a node stays as it is; ``reported=False`` where the report owes no decision about it
    (an MoE router's top-k, kept: the driver logs it at DEBUG instead)."""

    reason: str
    reported: bool = True


class Plan(Protocol):
    """A rewrite a rule's check has decided on; ``reason`` is what the report says of it."""

    @property
    def reason(self) -> str: ...


@dataclass
class Context:
    """What the rules share in one rewrite: the proof (with its call reader and write
    analysis), the settings given to the way in, the graphs that are activation-checkpoint
    bodies (run again in the backward), and the values that may be tensor subclasses."""

    evaluator: MaskEvaluator
    settings: Mapping[str, bool] = field(default_factory=dict)
    bodies: frozenset = frozenset()
    # node -> the input the caller passed as a tensor subclass that it comes from: for the
    # nodes whose value may be a subclass at run time, and for every node computed from one
    # (compile_pass/subclasses.py)
    subclassed: Mapping[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)
    computed_from_subclass: Mapping[torch.fx.Node, torch.fx.Node] = field(default_factory=dict)

    @property
    def calls(self) -> CallReader:
        return self.evaluator.calls


class Rule(Protocol):
    NAME: str
    TARGETS: Mapping[Target, str]

    def matches(self, site: Site, context: Context) -> bool: ...

    def check(self, site: Site, context: Context) -> Plan | Kept: ...

    def replace(self, plan: Plan, context: Context) -> set[torch.fx.Node]: ...
