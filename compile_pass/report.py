"""The record of every decision a rule made, logged at compile time and printable as a table."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger("compile_pass")
# Reports open in ``decisions()`` blocks; every logged decision is appended to each.
_open_reports: list[Report] = []


@dataclass(frozen=True)
class Decision:
    rule: str
    graph: str  # "" for the top-level graph, else the submodule (activation-checkpoint body)
    node: str
    rewritten: bool
    reason: str

    @property
    def verdict(self) -> str:
        return f"{'rewritten' if self.rewritten else 'kept'}: {self.reason}"

    @property
    def where(self) -> str:
        return f"{self.graph}.{self.node}" if self.graph else self.node


class Report(list):
    """A list of Decisions."""

    def rewritten(self) -> list[Decision]:
        return [decision for decision in self if decision.rewritten]

    def kept(self) -> list[Decision]:
        return [decision for decision in self if not decision.rewritten]

    def table(self) -> str:
        if not self:
            return "(no attention nodes)"
        rows = [("rule", "node", "decision")] + [(d.rule, d.where, d.verdict) for d in self]
        widths = [max(len(row[column]) for row in rows) for column in range(2)]
        lines = [f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}" for row in rows]
        return "\n".join(lines)

    def log(self) -> None:
        for decision in self:
            logger.info("%s %s: %s", decision.rule, decision.where, decision.verdict)
            for report in _open_reports:
                report.append(decision)


@contextmanager
def decisions() -> Iterator[Report]:
    """The decisions made for graphs compiled inside the block, by any way in.

    A graph served from inductor's caches under ``enable()`` is not rewritten again, so it
    adds nothing; ``backend`` rewrites every graph Dynamo compiles.
    """
    report = Report()
    _open_reports.append(report)
    try:
        yield report
    finally:
        _open_reports.remove(report)
