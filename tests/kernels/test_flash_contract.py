"""The op's FA2 kernels against what they call, on the CPU: torch's own
``aten::_flash_attention_forward/_backward`` (over tests/helpers/torch_flash_emulation.py) and
flash-attn's real Python interface (its compiled extension replaced by
tests/helpers/flash_emulation.py).

tests/kernels/flash_contract_cases.py runs in a fresh process per kernel: one for torch's FA2, and
one per flash-attn release below, whose ``flash_attn`` Python package tests/helpers/flash_sdist.py
fetches (once, then from a cache) from the release's sdist; flash-attn registers its ops
process-wide, so each release needs its own process. The processes run side by side, one
thread each, so this file takes about as long as the longest of them.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import flash_sdist

ROOT = Path(__file__).resolve().parent.parent.parent
# The kernels under test, each with the pytest selection it runs: torch's FA2, the last
# flash-attn 2.7 and the newest release. Inductor compiles our opaque op alike whatever runs
# inside it, and a cold inductor compile is most of a run's time, so only torch's run takes
# the inductor cases (aot_eager compiles the op on every kernel).
RUNS = {
    "torch": ["-m", "not flash_attn_package"],
    "2.7.4.post1": ["-m", "not torch_fa2", "-k", "not inductor"],
    "2.8.3": ["-m", "not torch_fa2", "-k", "not inductor"],
}


@pytest.fixture(scope="module")
def contract_runs():
    """Start one process per kernel; each test waits for its own."""
    runs = {}
    for kernel, selection in RUNS.items():
        env = dict(os.environ, OMP_NUM_THREADS="1")  # tiny tensors: threads only wait on each other
        if kernel == "torch":
            env["COMPILE_PASS_FA2_UNDER_TEST"] = "torch"
        else:
            env["COMPILE_PASS_FLASH_ATTN_SOURCE"] = str(flash_sdist.interface_source(kernel))
        # One process each (-n 0): the suite's own workers already share the cores.
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/kernels/flash_contract_cases.py",
            *selection,
        ]
        runs[kernel] = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    yield runs
    for process in runs.values():
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize(
    "kernel", list(RUNS), ids=lambda kernel: "torch-fa2" if kernel == "torch" else f"flash-attn-{kernel}"
)
def test_fa2_kernel_honours_its_contract(contract_runs, kernel):
    output, _ = contract_runs[kernel].communicate(timeout=900)
    assert contract_runs[kernel].returncode == 0, f"{kernel}:\n{output[-20000:]}"
    assert " passed" in output and " skipped" not in output, output[-2000:]
