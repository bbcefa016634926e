"""The package's own modules and the modules of it each one imports, read from the source
files (nothing is imported): the fingerprint of what a measurement ran (``measure.store``) and
CI's check of the layers (``.ci/imports.py``) read the same imports."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
PACKAGE = PACKAGE_ROOT.name


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(PACKAGE_ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its file, inside
    functions too (a lazy import is a dependency all the same). ``from package import module``
    names the module; ``from module import name`` the module."""
    known = modules()
    path = known[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def imported_closure(names: set[str]) -> set[str]:
    """``names`` and every module of the package they import, directly or not."""
    seen: set[str] = set()
    waiting = list(names)
    while waiting:
        name = waiting.pop()
        if name not in seen:
            seen.add(name)
            waiting.extend(imports_of(name) - seen)
    return seen
