"""The op's flash-attn path against flash-attn's real Python interface, on the CPU.

For each flash-attn release below, tests/flash_sdist.py fetches (once, then from a cache)
the release's ``flash_attn`` Python package from its sdist, and tests/flash_contract_cases.py
runs in a fresh process on it: flash-attn registers its ops process-wide, so each release
needs its own process. There the compiled extension is the CPU emulation of
tests/flash_emulation.py, and the op's flash path runs on CPU tensors. The two processes
run side by side, one thread each, so this file takes about as long as one of them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import flash_sdist

ROOT = Path(__file__).resolve().parent.parent
# The last 2.7 and the newest release, each with the pytest selection it runs. Inductor
# compiles our opaque op alike whatever runs inside it, and a cold inductor compile is
# most of a run's time, so it is checked on the newest release only.
RELEASES = {"2.7.4.post1": ["-k", "not inductor"], "2.8.3": []}


@pytest.fixture(scope="module")
def contract_runs():
    """Start one process per release; each test waits for its own."""
    runs = {}
    for release, selection in RELEASES.items():
        env = dict(
            os.environ,
            COMPILE_PASS_FLASH_ATTN_SOURCE=str(flash_sdist.interface_source(release)),
            OMP_NUM_THREADS="1",  # tiny tensors: threads only wait on each other
        )
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/flash_contract_cases.py", *selection]
        runs[release] = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    yield runs
    for process in runs.values():
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("release", list(RELEASES))
def test_flash_path_honours_flash_attn_contract(contract_runs, release):
    output, _ = contract_runs[release].communicate(timeout=900)
    assert contract_runs[release].returncode == 0, f"flash-attn {release}:\n{output[-20000:]}"
    assert " passed" in output and " skipped" not in output, output[-2000:]
