"""The long run of the adversarial differential fuzzer (tests/helpers/fuzz_masks.py).

    python benchmarks/fuzz_soundness.py --count 10000          # seeds 0..9999
    python benchmarks/fuzz_soundness.py --start 20000 --count 500
    python benchmarks/fuzz_soundness.py --show 1234            # one program, its source and outcome
    python benchmarks/fuzz_soundness.py --form shifted_padding --count 5000   # those seeds' programs that use a form
    python benchmarks/fuzz_soundness.py --measure --count 300   # decided by measuring, a fresh cache, short budgets

Each program is compiled through compile_pass's rewrite, run at three sequence lengths
with dynamic shapes and compared with eager (forward; the gradient for every third seed).
Prints every failure with its source, progress every 500 programs, and at the end the
counts by status and the decisions by rule. Exits 1 if any program failed. Every length is
rewritten (COMPILE_PASS_SHORT_KEYS=0 unless set), as in the suite: runs before 2026-11-26's
fix kept the short-call crossover and so rewrote few sliding calls.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# The programs are short: at the measured crossovers (ops/kernel.short_call) nearly every sliding
# call would keep SDPA and the run would test few rewrites. As in the suite (tests/conftest.py),
# every length is rewritten, by the static tables (nothing timed); settings made outside win.
os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")
if "--measure" in sys.argv[1:]:  # the default mode, with a fresh cache and short budgets
    import tempfile

    os.environ["COMPILE_PASS_MEASURE"] = "measure"
    os.environ["COMPILE_PASS_MEASURE_SECONDS"] = "0.05,0.3"
    os.environ["COMPILE_PASS_CACHE_DIR"] = tempfile.mkdtemp(prefix="fuzz_measurements_")

import torch  # noqa: E402

from tests.helpers import fuzz_masks  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--show", type=int, help="print one seed's program and outcome")
    parser.add_argument(
        "--images", action="store_true", help="only the seeds that draw image-block masks (seed % 9 == 4)"
    )
    parser.add_argument("--chunks", action="store_true", help="only the seeds that draw chunk-id masks (seed % 9 == 7)")
    parser.add_argument(
        "--prefill", action="store_true", help="only the seeds that draw prefill-chunk masks (seed % 9 == 1)"
    )
    parser.add_argument(
        "--spelled", action="store_true", help="only the seeds that draw spelled-out attention (seed % 9 == 2)"
    )
    parser.add_argument(
        "--form", help="only the seeds whose program uses this form of the grammar (shifted_padding, say)"
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="decide in measure mode (a fresh cache, budgets of 0.05 s a key and 0.3 s a compile), at lengths "
        f"the measurement takes {fuzz_masks.MEASURED_LENGTHS}: whatever each call is routed to, eager's results",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # small tensors; leave the other core to the rest of the machine
    lengths = fuzz_masks.MEASURED_LENGTHS if args.measure else fuzz_masks.LENGTHS
    if args.show is not None:
        print(fuzz_masks.generate(args.show))
        outcome = fuzz_masks.check(args.show, lengths=lengths)
        print(outcome.status, *outcome.decisions, outcome.detail, sep="\n")
        return int(outcome.failed)
    outcomes, started = [], time.time()
    seeds = range(args.start, args.start + args.count)
    kinds = {4} if args.images else set()
    kinds |= {7} if args.chunks else set()
    kinds |= {1} if args.prefill else set()
    kinds |= {2} if args.spelled else set()
    seeds = [s for s in seeds if s % 9 in kinds] if kinds else seeds
    if args.form:  # the forms are the first line of a program's source
        seeds = [s for s in seeds if args.form in fuzz_masks.generate(s).splitlines()[0].split()]
    for seed in seeds:
        outcome = fuzz_masks.check(seed, lengths=lengths)
        outcomes.append(outcome)
        if outcome.failed:
            print(
                f"FAILED seed {seed}: "
                f"{outcome.status}\n{fuzz_masks.generate(seed)}{outcome.decisions}\n{outcome.detail}\n",
                flush=True,
            )
        if len(outcomes) % 500 == 0:
            print(f"... {len(outcomes)} programs, {time.time() - started:.0f} s", flush=True)
    print(f"seeds {args.start}..{args.start + args.count - 1}, {time.time() - started:.0f} s")
    print(fuzz_masks.summarize(outcomes))
    return int(any(outcome.failed for outcome in outcomes))


if __name__ == "__main__":
    sys.exit(main())
