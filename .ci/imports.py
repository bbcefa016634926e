"""The package's imports point down its layers, and no module imports in a circle.

Reads every ``compile_pass`` module's imports (``import`` and ``from ... import`` anywhere in
the file, those inside functions too: a lazy import is still a dependency) and checks two
things:
- no circle: the graph of module -> module it imports has no cycle;
- layers: each module belongs to the first layer in ``LAYERS`` whose prefix names it, and may
  import only modules of its own layer or of the layers below it.

A package's ``__init__`` counts as the package's module; importing ``a.b.c`` depends on
``a.b.c`` only (Python runs ``a`` and ``a.b`` first, but those are above it or its own).
Run as ``python .ci/imports.py``: prints each violation and exits 1, or prints the layers.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The package's own reader of imports (stdlib only), loaded by path: nothing of torch runs.
_spec = importlib.util.spec_from_file_location("compile_pass_sources", ROOT / "compile_pass" / "sources.py")
sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sources)

# Top to bottom. A module imports only its own layer and those below; within a layer the
# graph must still have no cycle.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ways in", ("compile_pass", "compile_pass.__main__", "compile_pass.inspect", "compile_pass.backend")),
    ("rules", ("compile_pass.rules",)),
    ("context parallelism", ("compile_pass.parallel",)),
    ("the measurement", ("compile_pass.measure",)),
    ("the op", ("compile_pass.ops",)),
    ("kernels", ("compile_pass.kernels",)),
    ("proof", ("compile_pass.proof",)),
    ("the report", ("compile_pass.report",)),
    (
        "foundations",
        (
            "compile_pass.graphs",
            "compile_pass.calls",
            "compile_pass.subclasses",
            "compile_pass.registration",
            "compile_pass.sources",
            "compile_pass.sizes",
            "compile_pass.window",
            "compile_pass._version",
        ),
    ),
)


def modules() -> dict[str, Path]:
    return sources.modules()


def layer_of(name: str) -> int:
    """The first layer that names the module, or one of the packages it is in (the package
    itself, ``compile_pass``, names only its ``__init__``: a new module at the root must be
    placed in a layer by name)."""
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or (prefix != sources.PACKAGE and name.startswith(prefix + ".")):
                return index
    raise SystemExit(f"{name}: in no layer of .ci/imports.py's LAYERS")


def graph() -> dict[str, set[str]]:
    return {name: sources.imports_of(name) for name in sources.modules()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]}), a layer above it"
        for name in sorted(edges)
        for target in sorted(edges[name])
        if layer_of(target) < layer_of(name)
    ]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def problems(edges: dict[str, set[str]]) -> list[str]:
    return upward(edges) + [f"a circle: {' <-> '.join(component)}" for component in circles(edges)]


def main() -> int:
    edges = graph()
    found = problems(edges)
    for line in found:
        print(line)
    if found:
        return 1
    for name, prefixes in LAYERS:
        print(f"{name}: {', '.join(prefixes)}")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports: none up a layer, no circle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
