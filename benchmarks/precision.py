"""Half-precision training against fp64: eager, plain inductor and compile_pass side by side.

One training step (forward + backward of the LM loss) of the tests' tiny random Gemma-4
(6 layers: 5 sliding with window 8, 1 global; batch 2 x seq 64) with its weights stored in
bf16, then in fp16, each against the same weights in fp64. One run:

    python benchmarks/precision.py

Columns (tests/helpers/precision.py): grad norm = ||g - g64|| / ||g64|| over all parameters as one
vector; grad max = max |g - g64| over every gradient element; logits max and loss likewise.
A half-precision run is far from fp64 whichever way it is compiled; the question is whether
compile_pass adds error of its own, so compare its row with inductor's and eager's.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from tests.helpers.precision import VARIANTS, training_errors  # noqa: E402

COLUMNS = ("grad norm", "grad max", "logits max", "loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads; tiny Gemma-4, batch {args.batch} x seq "
        f"{args.length}, one training step; errors against the same weights in fp64"
    )
    print(f"{'dtype':>8} {'variant':>13}" + "".join(f" {column:>11}" for column in COLUMNS))
    for dtype in (torch.bfloat16, torch.float16):
        errors = training_errors(dtype, args.length, args.batch)
        name = str(dtype).removeprefix("torch.")
        scale = errors["fp64"]
        print(f"{name:>8} {'fp64 scale':>13} {'':>11}" + "".join(f" {scale[c]:11.4g}" for c in COLUMNS[1:]))
        for variant in VARIANTS:
            print(f"{name:>8} {variant:>13}" + "".join(f" {errors[variant][c]:11.4g}" for c in COLUMNS))


if __name__ == "__main__":
    main()
