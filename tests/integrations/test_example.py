"""The README's main example explains itself: what it will do and how long it takes, a line per
step, and at the end the decisions and the speedup; without a C++ compiler it says what to
install before anything slow starts. Both run the script as a user does (slow: a process that
imports transformers, or compiles a 6-layer model twice)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "train_gemma4.py"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env={**os.environ, **env}
    )


@pytest.mark.slow
def test_without_a_compiler_the_example_says_what_to_install():
    run = _run(CXX="no-such-c++-compiler")
    assert run.returncode == 1 and "apt-get install g++" in run.stderr, run.stderr
    assert "This trains" not in run.stdout  # nothing promised that cannot run


@pytest.mark.slow
def test_the_first_run_says_what_it_does_and_ends_with_decisions_and_speedup():
    run = _run("--seq", "1024", "--steps", "2")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("This trains a small random Gemma-4") and "timed steps" in lines[0]
    assert lines[1].startswith("The defaults took about 3 minutes on 2 idle cores")
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    table = lines.index("what compile_pass did to each attention call:")
    assert "rewritten: window (511, 0)" in "\n".join(lines[table:])
    assert lines[-2].startswith("compile_pass speedup: x") and lines[-1].startswith("total ")
