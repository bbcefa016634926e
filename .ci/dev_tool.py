"""Print the dev extra's requirement for each tool named (`python .ci/dev_tool.py ruff`): the one
place the tools' versions are stated is pyproject.toml."""

import re
import sys
from pathlib import Path

import tomllib

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
dev = {re.match(r"[A-Za-z0-9_.-]+", each).group(0): each for each in project["optional-dependencies"]["dev"]}
missing = [name for name in sys.argv[1:] if name not in dev]
if missing:
    sys.exit(f"pyproject's dev extra names no {', '.join(missing)}")
print(" ".join(dev[name] for name in sys.argv[1:]))
