"""The README's commands and CI stay in step."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- setup -->\s*```bash\n(.*?)```", readme, re.S)
    assert block, "README.md lost its set-up block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    example, tests = _readme_commands()
    assert "examples/" in example
    assert "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
    # then the oldest releases pyproject supports
    oldest = ci_lines.index("pip install $(python .ci/oldest.py)")
    assert oldest > ci_lines.index(tests) and "pytest" in ci_lines[-1]


def test_the_oldest_supported_releases_are_the_lower_bounds():
    import subprocess
    import sys

    pins = subprocess.run([sys.executable, str(ROOT / ".ci" / "oldest.py")], check=True, capture_output=True, text=True)
    assert pins.stdout.split() == ["transformers==5.23.0", "trl==1.16.0", "accelerate==1.15.0", "peft==0.21.0"]


def test_readme_example_exists():
    example, _ = _readme_commands()
    script = re.search(r"python (examples/\S+\.py)", example).group(1)
    assert (ROOT / script).is_file()
