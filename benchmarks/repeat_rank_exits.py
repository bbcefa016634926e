"""Run the two-rank FSDP2 context-parallel test's ranks (``_per_block_worker``) again and again
and count the runs where a rank did not exit cleanly. A rank that aborts at exit fails the test
whatever its results; this happened rarely enough (about 1 run in 30) that one pass of the
suite cannot show it is gone.

    python benchmarks/repeat_rank_exits.py --runs 60
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")  # the suite's settings (tests/conftest.py)
os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=60)
    runs = parser.parse_args().runs
    from tests.parallel import test_context_parallel as test

    failed = []
    for run in range(runs):
        try:
            test._spawn(test._per_block_worker, 2, Path(tempfile.mkdtemp()))
        except Exception as error:  # a rank that aborted is what is counted
            failed.append(f"run {run}: {error}")
        print(f"run {run + 1} of {runs}: {len(failed)} failed so far", flush=True)
    print("\n".join(failed))
    print(f"{runs - len(failed)} of {runs} runs ended with every rank's exit status 0")


if __name__ == "__main__":
    main()
