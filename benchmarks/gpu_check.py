"""Check and measure the op on a CUDA GPU, at Gemma-4 26B-A4B's sliding-layer shapes.

One command for whoever has a GPU (stock CUDA torch; flash-attn too, if installed, is timed
beside it and checked by its contract tests):

    python benchmarks/gpu_check.py                    # everything but the profile
    python benchmarks/gpu_check.py --seqs 4096 8192 --model-seqs 4096 --repeats 5
    python benchmarks/gpu_check.py --skip-tests --no-record --sections padded profile short
    python benchmarks/gpu_check.py --skip-tests --sections model --model-padded --model-seqs 1024 2048
    python benchmarks/gpu_check.py --skip-tests --no-record --sections global     # the global layer alone
    python benchmarks/gpu_check.py --skip-tests --no-record --sections packed     # packed full-attention layers
    python benchmarks/gpu_check.py --cpu-dry-run --seqs 64 100 --repeats 1          # no GPU: its code runs

1. tests: pytest on tests/ops/test_op_cuda.py (each FA2 kernel, its varlen path and the chunked
   kernel on the GPU against the fp64 reference), tests/kernels/test_flash_contract.py,
   tests/kernels/test_torch_flash.py and tests/kernels/test_wide_head.py (the Triton kernel on the GPU);
then the ``--sections`` asked for (all but ``profile`` by default):
2. ``layer``: one sliding layer, forward + backward, bf16, batch 1, 16 query / 8 KV heads,
   head_dim 256, window 1024 (w - 1 = 1023 keys back plus the query's own): the op; what
   transformers runs under sdpa (K/V repeated, SDPA with the boolean band mask); torch's FA2
   called directly (``aten::_flash_attention_forward/_backward``, window (1023, 0)); and,
   where it is installed, flash-attn's ``flash_attn_func`` with the same window. Repeats are
   interleaved (op, sdpa, torch FA2, ..., op, ...) and timed with CUDA events; medians. The
   op should be within 5% of torch's FA2 (``op / torch FA2 <= 1.05``), the kernel it runs,
   at least with calls queued back to back as in a training step (the 'queued' columns);
   ``global``: a global layer (head_dim 512, 16/8 heads, causal; plain, padded, packed) at
   ``--seqs``: the wide-head Triton kernel against SDPA with K/V repeated (as transformers
   calls it: the memory-efficient kernel) and FlexAttention with 32 x 32 tiles, and ffpa-attn's
   kernel (``kernels/ffpa.py``) where ffpa-attn loads (else the line says why not): time, TFLOP/s,
   peak memory; the data for ``wide_head.CROSSOVERS`` and ``ffpa.CROSSOVERS``. Then a soft-capped
   causal layer (Gemma-2's cap 50) at head_dim 128 and 256: the wide-head kernel against
   transformers' eager attention and FlexAttention with the cap, beside SDPA without the cap.
   Under each shape, the tiles the wide-head kernels measured and picked on this GPU (first
   launch per shape). ``--cpu-dry-run`` runs this section on the CPU at tiny sizes (Triton
   interpreted) to prove its code, measuring nothing;
   ``packed``: a full-attention layer (head_dim 128 and 256, 16/8 heads, causal) over 1, 4, 8
   and 16 packed documents and over a padded row, at ``--packed-seqs`` (8k-32k): the op (torch's
   FA2 varlen, a sequence per document) against SDPA with the block-diagonal mask and against
   SDPA's ``is_causal``: the data for a GPU crossover of packed and padded full layers, which
   keep SDPA on a GPU until measured (``--cpu-dry-run --sections packed`` runs its code on the CPU);
3. ``padded``: a padded batch: the op on left- and right-padded batches (1/8 and 1/2 of each
   row padding) against no padding, with the sequences' varlen pass in its two forms
   (gathered, in place): the data for ``fa2_varlen.IN_PLACE_MOST_PADDING``; ``profile``: where one
   left-padded call's time goes, per form;
   ``short``: short lengths (``--short-seqs``): the op against SDPA with the mask, head_dim
   256 and batch 4 unless ``--short-head-dims`` and ``--short-batches`` ask for others,
   plain and left-padded (a layout per call, and one shared), w = 512 and 1024, calls
   queued: the data for the CUDA crossovers (``fa2.SHORT_KEYS``);
4. ``model``: a training step of a 6-layer Gemma-4 (5 sliding layers, 1 global with
   head_dim 512) at the same head shapes, bf16, compiled with ``backend=compile_pass.backend``
   against plain inductor: interleaved medians and peak memory; ``--model-padded`` takes a
   batch of 2 with a row left-padded by a quarter. Lengths at or below the crossovers keep
   SDPA (COMPILE_PASS_SHORT_KEYS=0 rewrites them, to measure there);
   ``measure``: kernel choice measured on this GPU (``measure_on_device.py``, the cache ignored):
   Gemma-4's global layer (causal; plain, padded, packed) and sliding layer (plain, padded,
   packed, images), GPT-OSS's sliding and full layers, a narrower value, at ``--seqs``: each
   kernel against SDPA, checked first, the choice and the table; GPT-OSS's attention spelled
   out in ops and compiled against SDPA with the mask; then the ``model`` step with
   measurement on (its first compile's time against inductor's);
5. the printed lines, headed by the GPU's name and the date, are appended to
   benchmarks/RESULTS.md (``--no-record`` skips that).

Without a CUDA GPU it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

from gpu_sections.common import HEAD_DIM, Printer, cpu_stand_ins
from gpu_sections.global_layer import global_layers, softcap_layers
from gpu_sections.model_step import measured_on_this_gpu, time_model
from gpu_sections.packed_layer import packed_full_layers
from gpu_sections.padded_rows import profile_padded_call, time_padded_rows
from gpu_sections.sliding_layer import time_layer, time_short_lengths

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SECTIONS = ("layer", "global", "packed", "padded", "profile", "short", "model", "measure")


def run_tests(say: Printer) -> bool:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "tests/ops/test_op_cuda.py",
        "tests/kernels/test_flash_contract.py",
        "tests/kernels/test_torch_flash.py",
        "tests/kernels/test_wide_head.py",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    say(f"$ {' '.join(command[2:])}")
    for line in done.stdout.strip().splitlines()[-12:]:
        say(f"  {line}")
    if "SKIPPED" in done.stdout:
        say("  note: skipped tests above did not run on this machine")
    return done.returncode == 0


def record(say: Printer, argv: list[str]) -> None:
    import torch

    name = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    block = "\n".join([f"$ python benchmarks/gpu_check.py {' '.join(argv)}".rstrip(), *say.lines])
    with open(RESULTS, "a") as results:
        results.write(f"\n## gpu_check.py on {name}, {date}\n\n```\n{block}\n```\n")
    print(f"appended to {RESULTS.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--model-seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--model-padded", action="store_true", help="the training step on a padded batch of 2")
    parser.add_argument("--no-record", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=[name for name in SECTIONS if name != "profile"],
        help="what to measure (default: all but the profile)",
    )
    parser.add_argument(
        "--short-seqs",
        type=int,
        nargs="*",
        default=[128, 256, 512, 1024, 2048],
        help="lengths of the short-length table (none: skip it)",
    )
    parser.add_argument(
        "--short-head-dims", type=int, nargs="+", default=[HEAD_DIM], help="head_dims of the short-length table"
    )
    parser.add_argument("--short-batches", type=int, nargs="+", default=[4], help="batches of the short-length table")
    parser.add_argument(
        "--packed-seqs", type=int, nargs="+", default=[8192, 16384, 32768], help="lengths of the packed section"
    )
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run the global and packed sections asked for on the CPU at --seqs with 2 heads / 1 KV head "
        "(Triton interpreted, wall-clock times, memory 0; the op's CPU kernels in the packed one): proves "
        "their code runs; measures nothing",
    )
    args = parser.parse_args()

    if args.cpu_dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the wide-head kernels are created
        say = Printer()
        say("# CPU dry run: nothing below is a GPU measurement")
        with cpu_stand_ins():
            if "global" in args.sections:
                global_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1)
                softcap_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1)
            if "packed" in args.sections:
                packed_full_layers(say, args.seqs, args.repeats, device="cpu", heads=2, kv_heads=1, head_dims=(16,))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: gpu_check.py measures the CUDA path and needs one", file=sys.stderr)
        return 1
    from compile_pass.kernels.fa2 import flash_attn as flash
    from compile_pass.kernels.policy import facts_of
    from compile_pass.ops import POLICY

    say = Printer()
    major, minor = torch.cuda.get_device_capability()
    version = flash.flash_attn_version()
    say(
        f"# {torch.cuda.get_device_name()} (sm{major}{minor}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"flash-attn {'.'.join(map(str, version)) if version else 'not installed'}"
    )
    choice = POLICY.choose(facts_of("cuda", torch.bfloat16, HEAD_DIM))
    say(f"# kernel at these shapes: {choice.name}, fast: {choice.fast}{f' ({choice.reason})' if choice.reason else ''}")
    choice = POLICY.choose(facts_of("cuda", torch.bfloat16, 512, keys=max(args.seqs)))
    say(
        f"# kernel of a global layer (head_dim 512, {max(args.seqs)} keys): {choice.name}, fast: {choice.fast}"
        f"{f' ({choice.reason})' if choice.reason else ''}"
    )
    tests_passed = True
    if not args.skip_tests:
        tests_passed = run_tests(say)
    sections = set(args.sections)
    if "layer" in sections:
        time_layer(say, args.seqs, args.repeats)
    if "global" in sections:
        global_layers(say, args.seqs, args.repeats)
        softcap_layers(say, args.seqs, args.repeats)
    if "packed" in sections:
        packed_full_layers(say, args.packed_seqs, args.repeats)
    if "padded" in sections:
        time_padded_rows(say, args.seqs[:2], args.repeats)
    if "profile" in sections:
        profile_padded_call(say, args.seqs[0])
    if "short" in sections and args.short_seqs:
        time_short_lengths(say, args.short_seqs, args.repeats, args.short_head_dims, args.short_batches)
    if "model" in sections and not args.skip_model:
        time_model(say, args.model_seqs, args.repeats, args.model_padded)
    if "measure" in sections:
        measured_on_this_gpu(say, args.seqs, args.model_seqs, args.repeats, args.skip_model)
    if not args.no_record:
        record(say, sys.argv[1:])
    return 0 if tests_passed else 1


if __name__ == "__main__":
    sys.exit(main())
