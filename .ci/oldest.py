"""Print pip requirements that pin each tested third-party package to the lower bound pyproject
states for it: the oldest supported releases, which .ci/run tests after the newest ones."""

import re
import sys
from pathlib import Path

import tomllib

TESTED = ("torch", "transformers", "trl", "accelerate", "peft")

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
bounds = {}
for requirement in requirements:
    found = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", requirement.strip())
    if found and found.group(1) in TESTED:
        bounds[found.group(1)] = found.group(2)
missing = sorted(set(TESTED) - set(bounds))
if missing:
    sys.exit(f"pyproject states no '>=' lower bound for {', '.join(missing)}")
print(" ".join(f"{name}=={bounds[name]}" for name in TESTED))
