"""The record of benchmarks/families.py's run (benchmarks/families.json) and the tables made from
it: docs/rewritten.md's table of every family and README.md's supported-models table, written
between their markers in the two pages."""

from __future__ import annotations

import json
import re
from pathlib import Path

import transformers

from benchmarks.family_sweep import SETUPS
from tests.helpers.models import TOLERANCE

ROOT = Path(__file__).resolve().parent.parent
GPU_MEASURED = {"Gemma-4": "H200, 2026-11-26: one sliding layer and a 6-layer step"}
# What kernels.md's policy picks on a GPU; not run here (this machine may have none).
GPU_KERNELS = (
    "On a GPU each layer runs the kernel measured fastest there against SDPA (torch's own FA2 for "
    "sliding layers, sm80 or newer, fp16/bf16, head_dim <= 256, as measured on an H200), else SDPA; "
    "the `w - 1` is the config's window less one, `#` a number of the config or the trace. A "
    "full-attention layer given padding or packed documents goes to the op where it is measured "
    "faster, which computes each document or padded row over its own keys alone (each family's kept "
    "reasons are in docs/rewritten.md)."
)
MARKERS = ("<!-- supported-models -->", "<!-- /supported-models -->")
FAMILY_MARKERS = ("<!-- recall-table -->", "<!-- /recall-table -->")
RECORD = ROOT / "benchmarks" / "families.json"
README = ROOT / "README.md"
REWRITTEN = ROOT / "docs" / "rewritten.md"


def _verdicts(record: dict, kind: str, setup: str) -> list[str]:
    """A layer kind's distinct verdicts in the set-up, the rewritten ones first."""
    found = {verdict for kind_found, verdict, _ in record["decisions"][setup] if kind_found == kind}
    return sorted(found, key=lambda verdict: (not verdict.startswith("rewritten"), verdict))


def _status(record: dict, kind: str, setup: str) -> str:
    """ "rewritten", "kept", "partly kept" (some calls of the kind each), or "—" (none)."""
    rewritten = frozenset(verdict.startswith("rewritten") for verdict in _verdicts(record, kind, setup))
    return {frozenset(): "—", frozenset({True}): "rewritten", frozenset({False}): "kept"}.get(rewritten, "partly kept")


def summary(record: dict, kind: str) -> str:
    """A layer kind's status, or each set-up's where they differ."""
    by_setup = {setup: _status(record, kind, setup) for setup in SETUPS}
    if len(set(by_setup.values())) == 1:
        return by_setup[SETUPS[0]]
    return ", ".join(f"{status} {setup}" for setup, status in by_setup.items())


def _kept_reasons(record: dict) -> str:
    """Every kept call's reason, once, with its layer kind (and set-up where only one keeps it)."""
    found: dict[tuple[str, str], list[str]] = {}
    for setup in SETUPS:
        for kind, verdict, _ in record["decisions"][setup]:
            if not verdict.startswith("rewritten"):
                found.setdefault((kind, verdict.removeprefix("kept: ")), []).append(setup)
    parts = []
    for (kind, reason), setups in found.items():
        where = kind if len(set(setups)) == len(SETUPS) else f"{kind}, {setups[0]}"
        parts.append(f"{where}: {reason}")
    return "; ".join(parts) or "—"


def _cell(text: str) -> str:
    """Text as a markdown table cell: a ``|`` of a reason would end the cell."""
    return text.replace("|", "\\|")


def error_text(value: float) -> str:
    return "0" if value == 0 else f"{value:.0e}"


def family_table(records: dict[str, dict]) -> str:
    """docs/rewritten.md's table: every family, each layer kind's verdict, the worst error of
    a training step against eager, and why calls are kept."""
    rows = [
        "| family | attention | sliding (or chunked) layers | full-attention layers | worst error | kept, because |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family, record in records.items():
        rows.append(
            f"| {family} | {record['attention']} | {summary(record, 'sliding')} | {summary(record, 'full')} | "
            f"{error_text(record['worst_error'])} | {_cell(_kept_reasons(record))} |"
        )
    return "\n".join(rows)


def _how(record: dict, kind: str) -> str:
    """A layer kind's verdicts unpadded, and whether padded ones are rewritten where that
    differs (their reasons are docs/rewritten.md's)."""
    text = "; ".join(_verdicts(record, kind, SETUPS[0])) or "—"
    unpadded, padded = (_status(record, kind, setup) for setup in SETUPS)
    return text if padded == unpadded else f"{text} (padded: {padded})"


def _kernels(record: dict) -> str:
    kernels: dict[str, set[str]] = {}
    for kind, _, kernel in record["decisions"][SETUPS[0]]:
        if kernel and kind in ("sliding", "full"):
            kernels.setdefault(kind, set()).add(kernel)
    return (
        "; ".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in sorted(kernels.items(), reverse=True)) or "—"
    )


def supported_models_table(records: dict[str, dict]) -> str:
    """README.md's table: families whose layers the rules treat alike in one row, how, on
    which kernel (on the CPU, where this runs), whether a training step equals eager's, and
    whether it was measured on a GPU."""
    rows: dict[tuple, list[str]] = {}
    for family, record in records.items():
        exact = "yes" if record["worst_error"] <= TOLERANCE else f"no ({error_text(record['worst_error'])})"
        key = (
            record["attention"],
            _how(record, "sliding"),
            _how(record, "full"),
            _kernels(record),
            exact,
            GPU_MEASURED.get(family, "no"),
        )
        rows.setdefault(key, []).append(family)
    lines = [
        "| families | sliding (or chunked) layers | full-attention layers | kernel on the CPU | training step exact "
        "| measured on a GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (attention, sliding, full, kernels, exact, gpu), families in rows.items():
        names = ", ".join(families) + (
            "" if attention == "sdpa" else " (eager attention: no SDPA path in transformers)"
        )
        lines.append(f"| {names} | {_cell(sliding)} | {_cell(full)} | {kernels} | {exact} | {gpu} |")
    return "\n".join([*lines, "", GPU_KERNELS])


# -- the record -----------------------------------------------------------------------------


def _record_text(record: dict) -> str:
    """The record as JSON, a decision to a line."""

    def on_one_line(match: re.Match) -> str:
        return "[" + re.sub(r",\n\s+", ", ", match.group(1)) + "]"

    return re.sub(r"\[\n\s+(\"[^\[\]]*?\")\n\s+\]", on_one_line, json.dumps(record, indent=1)) + "\n"


def write_record(records: dict[str, dict]) -> None:
    """Stores the run, with the transformers release it ran on."""
    RECORD.write_text(_record_text({"transformers": transformers.__version__, "families": records}))


def load_record() -> dict:
    return json.loads(RECORD.read_text())


def replace_block(page: Path, markers: tuple[str, str], table: str) -> None:
    text = page.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    page.write_text(f"{text[:start]}\n{table}\n{text[end:]}")


def block(page: Path, markers: tuple[str, str]) -> str:
    text = page.read_text()
    return text[text.index(markers[0]) + len(markers[0]) : text.index(markers[1])].strip()


def write_pages(records: dict[str, dict]) -> None:
    replace_block(REWRITTEN, FAMILY_MARKERS, family_table(records))
    replace_block(README, MARKERS, supported_models_table(records))
