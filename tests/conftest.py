"""Suite-wide set-up.

The suite runs in parallel processes (pytest-xdist, ``-n 2`` in pyproject's pytest options):
each worker gets an equal share of the machine's cores for torch's intra-op threads, so that
two workers on 2 cores do not both spin two OpenMP threads on them.
"""

import os
import tempfile

# The suite's models are tiny (tens of tokens): under the CPU's measured crossover every one of
# their sliding calls would keep SDPA (kernels/chunked/__init__.py, SHORT_KEYS). The suite rewrites every
# length; tests/ops/test_short_calls.py sets the crossover back. Set before compile_pass is
# imported, and inherited by the processes tests start.
os.environ["COMPILE_PASS_SHORT_KEYS"] = "0"
# Kernel choices measured on this machine would make the suite's rewrites depend on its timings:
# the suite decides by the static tables (the crossover above), and the tests of the measurement
# (tests/measure/test_measure.py) turn it on where they test it. Its cache goes to a directory of the
# run's own, never a user's.
os.environ["COMPILE_PASS_MEASURE"] = "static"
os.environ["COMPILE_PASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_pass_measurements_")

import torch  # noqa: E402

# Without a CUDA GPU, Triton kernels (kernels/wide_head/forward.py) run in Triton's CPU interpreter.
# Triton reads the variable when a ``@triton.jit`` function is created, which compile_pass does
# only when a wide-head call first runs (after this); inductor's CPU code is C++ and ignores it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(workers)))


# Files whose tests take a minute or more in all (inductor compiles, process groups, many
# traces), longest first, from ``--durations``. With ``--dist loadfile`` a worker takes the
# next file when it is free, so running these first lets the short files fill in at the end
# and both workers finish together, instead of one running a long file while the other idles.
LONG_FILES = (
    "test_context_parallel.py",
    "test_integrations.py",
    "test_recall_table.py",
    "test_generate.py",
    "test_packed.py",
    "test_topk_rule.py",
    "test_sliding_rule_gemma4.py",
    "test_flash_contract.py",
    "test_distributed.py",
    "test_short_calls.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: a file's tests keep their order
