"""The record of every decision a rule made, logged at compile time and printable as a table
in the model's own terms: the module that made the call, its layer type, the source line.

A decision is made about an attention call (SDPA), a top-k mask or a ``masked_fill``. Where
Dynamo recorded it, each names the module (``model.layers.3.self_attn``, from the node's
``nn_module_stack``), the layer type the model gives that module (``config.layer_types``,
``is_sliding``), and the innermost source line outside torch (from ``stack_trace``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import overload

import torch
import torch.fx

from .graphs import qualified_name, root_value, source_line, split_source

logger = logging.getLogger("compile_pass")
# Reports open in ``decisions()`` blocks; every logged report is added to each.
_open_reports: list[Report] = []

# What a decision is about.
ATTENTION = "attention call"
TOPK = "top-k mask"
FILL = "masked_fill"
MASK_CERTIFICATE = "mask certificate"  # a graph that returns masks it proved (context parallel)
DISABLE_VARIABLE = "COMPILE_PASS_DISABLE"


_SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class Decision:
    """What the rules did to one attention call, top-k mask or ``masked_fill``, and why.

    Attributes:
        rule: the rule that rewrote the call or, where none did, the first that kept it.
        graph: ``""`` for the graph Dynamo traced, else the submodule that holds the call (an
            activation-checkpoint body, ``wrap_body_2``).
        node: the call's node in that graph (``attn_output_5``).
        rewritten: whether a rule rewrote it.
        reason: the first rule's reason, as ``verdict`` shows it after ``rewritten:`` or ``kept:``.
        module: the module that made the call (``model.layers.3.self_attn``), from Dynamo's
            ``nn_module_stack``; ``""`` where unknown.
        layer_type: the layer type the model gives that module (``config.layer_types``, a
            ``layer_type`` or ``is_sliding`` attribute); ``""`` where it says none.
        source: ``file.py:123``, the innermost frame of the call outside torch.
        kind: ``"attention call"``, ``"top-k mask"``, ``"masked_fill"`` or ``"mask certificate"``.
        other_reasons: ``(rule, reason)`` of each other rule that kept the call.
        kernel: what the new op runs (the kernel policy's answer); ``""`` where kept or no op.
        declared_layer: the layer index the module declares (transformers' ``layer_idx``), for a
            module path without one (a graph that starts inside a layer, after a graph break).
    """

    rule: str
    graph: str
    node: str
    rewritten: bool
    reason: str
    module: str = ""
    layer_type: str = ""
    source: str = ""
    kind: str = ATTENTION
    other_reasons: tuple[tuple[str, str], ...] = ()
    kernel: str = ""
    declared_layer: int | None = None

    @property
    def verdict(self) -> str:
        """The first rule's verdict, e.g. ``rewritten: window (7, 0)``."""
        return f"{'rewritten' if self.rewritten else 'kept'}: {self.reason}"

    @property
    def reasons(self) -> tuple[str, ...]:
        """Every rule's reason, each once, in the order the rules ran."""
        found = [self.reason, *(reason for _, reason in self.other_reasons)]
        return tuple(dict.fromkeys(found))

    @property
    def full_verdict(self) -> str:
        """The verdict with every rule's reason: a kept call may fail more than one rule.
        A later reason that opens as the first does is shown from where they part:
        ``kept: mask is window (-1, 0): no sliding window; not plain causal``."""
        first, *others = self.reasons
        shown = [first]
        for reason in others:
            common = len(os.path.commonprefix([first, reason]))
            parted = first[common : common + 2] in _SEPARATORS and reason[common : common + 2] in _SEPARATORS
            shown.append(reason[common + 2 :] if parted else reason)
        return f"{'rewritten' if self.rewritten else 'kept'}: {'; '.join(shown)}"

    @property
    def rules(self) -> str:
        return ", ".join(dict.fromkeys([self.rule, *(rule for rule, _ in self.other_reasons)]))

    @property
    def where(self) -> str:
        """The node in the traced graph: ``attn_output_5``, ``wrap_body_2.attn_output``."""
        return f"{self.graph}.{self.node}" if self.graph else self.node

    @property
    def name(self) -> str:
        """The module path where known (with the layer it declares where the path has no
        index: ``self_attn (layer 3)``), else the graph node."""
        if self.module and _split_layer(self.module)[1] is None and self.declared_layer is not None:
            return f"{self.module} (layer {self.declared_layer})"
        return self.module or self.where

    @property
    def layer(self) -> int | None:
        """The layer index: the last number in the module path (``model.layers.3.self_attn``),
        else the one its module declares."""
        index = _split_layer(self.module)[1]
        return index if index is not None else self.declared_layer


def _split_layer(module: str) -> tuple[str, int | None]:
    """(path with its last numeric part as ``*``, that number), or (path, None)."""
    parts = module.split(".") if module else []
    for position in reversed(range(len(parts))):
        if parts[position].isdigit():
            return ".".join(parts[:position] + ["*"] + parts[position + 1 :]), int(parts[position])
    return module, None


def _ranges(numbers: Iterable[int]) -> str:
    """``0-4, 6-10, 12``."""
    runs: list[list[int]] = []
    for number in sorted(set(numbers)):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


class Report(Sequence[Decision]):
    """The decisions of one or more rewrites, with how many graphs they came from and whether
    the kill switch was on; reads as a sequence of its ``Decision`` objects.

    ``compile_pass.rewrite(gm)`` returns the report of one graph (``one_graph=True``);
    ``compile_pass.decisions()`` yields one that takes in the report of every graph compiled in
    its block (``add``). Only such a report can tell that no graph of a compile attends through
    SDPA: a graph break leaves graphs without attention (the embeddings, the masks) beside the
    layers' graphs, so the report of one graph without attention gives no advice.
    """

    def __init__(
        self,
        decisions: Iterable[Decision] = (),
        *,
        graphs: int = 0,
        disabled: bool = False,
        rules: Iterable[str] = (),
        one_graph: bool = False,
    ):
        self.decisions: list[Decision] = list(decisions)
        self.graphs = graphs  # graphs the rules were asked to rewrite
        self.disabled = disabled  # COMPILE_PASS_DISABLE=1 was set for at least one of them
        self.rules = set(rules)  # the rules that ran on at least one of them
        self.one_graph = one_graph  # the report of one graph, not of a whole compile
        self._attempts: dict = {}  # Dynamo compile id -> (attempt, the reports it added)

    @overload
    def __getitem__(self, index: int) -> Decision: ...

    @overload
    def __getitem__(self, index: slice) -> list[Decision]: ...

    def __getitem__(self, index: int | slice) -> Decision | list[Decision]:
        return self.decisions[index]

    def __len__(self) -> int:
        return len(self.decisions)

    def append(self, decision: Decision) -> None:
        """Add one decision (the rewrite driver does, as the rules decide)."""
        self.decisions.append(decision)

    def rewritten(self) -> list[Decision]:
        """The decisions that rewrote their call."""
        return [decision for decision in self if decision.rewritten]

    def kept(self) -> list[Decision]:
        """The decisions that kept their call as it was."""
        return [decision for decision in self if not decision.rewritten]

    def add(self, other: Report, trace: torch._guards.TraceId | None = None) -> None:
        """Take in the decisions and graph count of another report, made during ``trace`` (a
        Dynamo compilation and its attempt). A later attempt at the same compilation replaces
        the earlier attempt's reports: Dynamo threw that graph away and traced again (with
        ``dynamic=True``, floats such as dropout first traced as run-time values), so what it
        decided never runs."""
        if trace is not None:
            attempt, reports = self._attempts.get(trace.compile_id, (trace.attempt, []))
            if attempt < trace.attempt:
                for report in reports:
                    self._withdraw(report)
                attempt, reports = trace.attempt, []
            self._attempts[trace.compile_id] = (attempt, [*reports, other])
        self.decisions.extend(other)
        self.graphs += other.graphs
        self.disabled |= other.disabled
        self.rules |= other.rules

    def _withdraw(self, other: Report) -> None:
        withdrawn = {id(decision) for decision in other}
        self.decisions = [decision for decision in self.decisions if id(decision) not in withdrawn]
        self.graphs -= other.graphs

    def summary(self) -> str:
        """One line: ``25 of 30 attention calls rewritten, 5 kept; 2 of 2 top-k masks rewritten``.

        Where nothing was decided it says why: the kill switch, no graph compiled, every rule
        off, or no attention call in any graph of the compile (the one advice to load the model
        with ``attn_implementation="sdpa"``, given only by a report of a whole compile).
        """
        if self.disabled:
            return (
                f"compile_pass is off ({DISABLE_VARIABLE}=1): no rule ran, "
                f"{_plural(self.graphs, 'graph')} compiled unchanged"
            )
        if self.graphs == 0 and not self:
            return (
                "no graph was compiled here, so nothing was rewritten (a graph compiled before, or "
                "taken from inductor's caches under enable(), is not rewritten again)"
            )
        parts = []
        for kind in (ATTENTION, TOPK, FILL, MASK_CERTIFICATE):
            found = [decision for decision in self if decision.kind == kind]
            if found:
                rewritten = sum(decision.rewritten for decision in found)
                text = f"{rewritten} of {_plural(len(found), kind)} rewritten"
                if rewritten < len(found):
                    text += f", {len(found) - rewritten} kept"
                parts.append(text)
        if not parts and self.graphs and not self.rules:
            return f"every rule is switched off: {_plural(self.graphs, 'graph')} compiled unchanged"
        if not parts and self.one_graph:  # other graphs of its compile may attend: said by decisions()
            return "no attention call or top-k mask in this graph"
        if not parts:
            return (
                f"no attention call or top-k mask found in {_plural(self.graphs, 'graph')}: a model that attends "
                f"without torch.nn.functional.scaled_dot_product_attention has nothing to rewrite; load it with "
                f'attn_implementation="sdpa"'
            )
        return "; ".join(parts) + (f" (in {self.graphs} graphs)" if self.graphs > 1 else "")

    def table(self, *, by_node: bool = False) -> str:
        """Identical decisions grouped by layer, then the summary line. ``by_node=True``: one
        row per decision with its graph node, for reading the graph itself."""
        if not self:
            return self.summary()
        if by_node:
            with_module = any(d.module for d in self)
            with_kernel = any(d.kernel for d in self)
            header = (
                "node",
                *(["module"] if with_module else []),
                "rule",
                "decision",
                *(["kernel"] if with_kernel else []),
            )
            rows = [
                (
                    d.where,
                    *([d.module] if with_module else []),
                    d.rules,
                    d.full_verdict,
                    *([d.kernel] if with_kernel else []),
                )
                for d in self
            ]
            return _columns([header, *rows]) + "\n" + self.summary()
        groups: dict[tuple, list[Decision]] = {}
        for decision in self:
            pattern, _ = _split_layer(decision.module)
            key = (
                decision.kind,
                decision.rules,
                pattern or decision.where,
                decision.layer_type,
                decision.full_verdict,
                decision.kernel,
                decision.source,
            )
            groups.setdefault(key, []).append(decision)
        sources = {decision.source for decision in self}
        one_source = sources.pop() if len(sources) == 1 else None
        titles = [
            "layers",
            "module" if any(d.module for d in self) else "node",
            "layer type",
            "rule",
            "decision",
            "kernel",
        ]
        cells: list[list[str]] = []
        for (_, rules, pattern, layer_type, verdict, kernel, source), members in groups.items():
            layers = [d.layer for d in members if d.layer is not None]
            module = members[0].name if len(members) == 1 else pattern
            row = [_ranges(layers), module, layer_type, rules, verdict, kernel]
            cells.append(row if one_source is not None else row + [source])
        if one_source is None:
            titles.append("source")
        # Columns nobody fills (no layer numbers, no layer types, no kernel) are left out.
        keep = [column for column in range(len(titles)) if column in (1, 3, 4) or any(row[column] for row in cells)]
        lines = _columns([tuple(row[c] for c in keep) for row in [titles, *cells]])
        if one_source:
            lines += f"\ncalled at {one_source}"
        return lines + "\n" + self.summary()

    def log(self) -> None:
        """Log every decision at INFO and add this report to every open ``decisions()`` block."""
        if self.disabled:
            logger.info("compile_pass is off (%s=1): graph compiled unchanged", DISABLE_VARIABLE)
        for decision in self:
            location = f" ({decision.where})" if decision.module else ""
            kernel = f" (kernel: {decision.kernel})" if decision.kernel else ""
            logger.info("%s %s%s: %s%s", decision.rule, decision.name, location, decision.full_verdict, kernel)
        trace = torch._guards.CompileContext.current_trace_id()
        for report in _open_reports:
            report.add(self, trace)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join([*(f"{cell:<{width}}" for cell, width in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in rows
    )


@contextmanager
def decisions() -> Iterator[Report]:
    """The decisions made for graphs compiled inside the block, by any way in.

    ``with compile_pass.decisions() as report: loss = compiled(**batch).loss``, then
    ``print(report.table())``: the model's first call inside the block compiles it. Where
    Dynamo traces a compilation more than once (it throws an attempt away and traces again),
    the report holds the last attempt's decisions, those of the graph that runs. A graph served
    from inductor's caches under ``enable()`` is not rewritten again, so it adds nothing;
    ``backend`` rewrites every graph Dynamo compiles.

    Yields:
        A ``Report`` that fills as graphs compile, until the block ends.
    """
    report = Report()
    _open_reports.append(report)
    try:
        yield report
    finally:
        _open_reports.remove(report)


# -- where a node came from, in the model's terms --------------------------------------------


@dataclass(frozen=True)
class CallSite:
    module: str = ""
    layer_type: str = ""
    source: str = ""
    layer_index: int | None = None  # as the module declares it (layer_idx)


def call_site(node: torch.fx.Node) -> CallSite:
    """The module, layer type and source line Dynamo recorded for ``node``; empty parts where
    it recorded nothing (a graph traced by other means)."""
    stack = list(node.meta.get("nn_module_stack", {}).values())
    paths = [path for path, _ in stack]
    layer_type, layer_index = _declared_layer(paths)
    return CallSite(qualified_name(paths[-1]) if paths else "", layer_type, source_line(node), layer_index)


def _frame_scopes() -> dict[str, dict] | None:
    """The locals and globals of the frame Dynamo is compiling, where the rules run inside a
    Dynamo compilation (both ways in do); None elsewhere."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        translator = InstructionTranslator.current_tx()
        return {"L": translator.f_locals, "G": translator.f_globals}
    except Exception:  # noqa: BLE001 - no compilation in progress, or Dynamo's internals moved
        return None


def _resolve(source_name: str, scopes: dict[str, dict]) -> torch.nn.Module | None:
    """The module a ``nn_module_stack`` source name points to, or None."""
    parts = split_source(source_name)
    if parts is None:
        return None
    scope, root, rest = parts
    found = root_value(scopes[scope], root)
    for part in filter(None, rest.split(".")):
        found = getattr(found, part, None)  # nn.Module resolves "0" through its _modules
        if found is None:
            return None
    return found if isinstance(found, torch.nn.Module) else None


def _declared_layer(paths: list[str]) -> tuple[str, int | None]:
    """The layer type and index the model gives the innermost module or its layer: a
    ``layer_type`` attribute, ``config.layer_types[layer_idx]``, or ``is_sliding``; and
    ``layer_idx``. transformers' attention modules say it these ways; no model is named. Only
    the modules from the call up to its layer (the path ending in the layer index) are asked."""
    scopes = _frame_scopes() if paths else None
    layer_type, index = "", None
    if scopes is None:
        return layer_type, index
    for path in reversed(paths):
        try:
            module = _resolve(path, scopes)
            found = _declared_layer_type(module) if module is not None else None
            declared_index = getattr(module, "layer_idx", None)
        except Exception:  # noqa: BLE001 - a module attribute that raises tells us nothing
            found = declared_index = None
        layer_type = layer_type or found or ""
        if index is None and isinstance(declared_index, int) and not isinstance(declared_index, bool):
            index = declared_index
        if (layer_type and index is not None) or path.rsplit(".", 1)[-1].isdigit():
            break  # the layer itself: do not ask the whole model
    return layer_type, index


def _declared_layer_type(module: torch.nn.Module) -> str | None:
    declared = getattr(module, "layer_type", None)
    if isinstance(declared, str):
        return declared
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(index, int) and isinstance(types, (list, tuple)) and 0 <= index < len(types):
        return str(types[index])
    sliding = getattr(module, "is_sliding", None)
    if isinstance(sliding, bool):
        return "sliding_attention" if sliding else "full_attention"
    return None
