"""``compile_pass.__version__``: the version pyproject.toml states."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

# A checkout (this package beside the pyproject.toml that builds it) reads its own version, so
# that a tree run with PYTHONPATH is not named by an older install elsewhere; an installed
# package reads its distribution's metadata.
_PROJECT = re.compile(r'^\[project\][^\[]*?^name = "compile_pass"[^\[]*?^version = "([^"]+)"', re.M | re.S)


def version_of(package_dir: Path, distribution: str = "compile_pass") -> str:
    """The version of the package in ``package_dir``: its checkout's pyproject.toml where one
    builds it, else ``distribution``'s installed metadata, else "0+unknown"."""
    pyproject = package_dir.parent / "pyproject.toml"
    if pyproject.is_file():
        found = _PROJECT.search(pyproject.read_text(encoding="utf-8"))
        if found:
            return found.group(1)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = version_of(Path(__file__).resolve().parent)
