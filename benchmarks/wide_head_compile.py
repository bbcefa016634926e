"""Compile the wide-head Triton kernels (compile_pass/kernels/wide_head/forward.py, wide_head_backward.py) at every tile
config of ``wide_head_tiles.CONFIGS`` for CUDA targets, on a machine without a GPU, with the
ptxas that ships in triton's wheel, and print what each kernel uses: registers a thread, spill
stack bytes, shared memory, beside ``wide_head_tiles.shared_memory_estimate`` (which must not
be below what Triton allocates: the pruning by a device's shared memory relies on it). Nothing
runs or is timed: this is the check that every config of the list compiles for sm80, sm90 and
sm100, which the list in ``wide_head_tiles.py`` is pruned to.

    python benchmarks/wide_head_compile.py        # the list; sm80, sm90, sm100; each at its widest head_dim
    python benchmarks/wide_head_compile.py --archs 90 --head-dims 512 --forms masked --jobs 2
    python benchmarks/wide_head_compile.py --candidates         # the wider set the list was chosen from

Forms: ``plain`` (causal, no masks: the block flags are not read, so the key loop can be
pipelined and stages matter) and ``masked`` (causal with key padding, segment ids and a soft
cap: the most registers).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POINTERS = dict(
    LSE="*fp32",
    DELTA="*fp32",
    PAD="*i8",
    SEG="*i64",
    LIVE="*i8",
    KEY_FIRST="*i32",
    KEY_LAST="*i32",
    QUERY_FIRST="*i32",
    QUERY_LAST="*i32",
)
TENSORS = ("Q", "K", "V", "OUT", "GRAD_OUT", "GRAD")
FLOATS = ("scale", "cap")  # float arguments start with these
KERNELS = ("forward", "dV", "dK", "dQ")
FORMS = dict(
    plain=dict(HAS_PAD=False, HAS_SEG=False, READ_LIVE=False, SOFTCAP=False),
    masked=dict(HAS_PAD=True, HAS_SEG=True, READ_LIVE=True, SOFTCAP=True),
)


def compile_kernel(kernel, dtype: str, constants: dict, arch: int, warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    parameters = inspect.signature(kernel.fn).parameters
    signature = {}
    for name in parameters:
        if name in constants:
            signature[name] = "constexpr"
        elif name in TENSORS:
            signature[name] = f"*{dtype}"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        else:
            signature[name] = "fp32" if name.startswith(FLOATS) else "i32"
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={k: v for k, v in constants.items() if k in parameters}
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> tuple[int, int, int]:
    """(registers a thread, spill stack bytes, shared memory bytes)."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as file:
        file.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([str(cuobjdump), "-res-usage", file.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(file.name)
    line = next(line for line in usage.splitlines() if "REG:" in line)
    registers, stack = re.search("REG:([0-9]+)", line).group(1), re.search("STACK:([0-9]+)", line).group(1)
    return int(registers), int(stack), compiled.metadata.shared


def compile_config(job: tuple) -> tuple[tuple, list]:
    """One (arch, form, dtype, head_dim, tiles): each kernel's resources, or its error."""
    arch, form, dtype, head_dim, tiles = job
    os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
    from compile_pass.kernels.wide_head import backward
    from compile_pass.kernels.wide_head import forward as kernels
    from compile_pass.kernels.wide_head.tiles import padded_head_dim

    common = dict(
        HEAD_DIM=head_dim,
        D_PAD=padded_head_dim(head_dim),
        D_CHUNK=tiles.d_chunk,
        PRECISION="tf32",
        UPCAST=False,
        HAS_LEFT=False,
        HAS_RIGHT=True,
        **FORMS[form],
    )
    by_query = dict(common, BLOCK_M=tiles.stationary, BLOCK_N=tiles.streamed)
    by_key = dict(common, BLOCK_M=tiles.streamed, BLOCK_N=tiles.stationary)
    results = []
    for _name, kernel, constants in (
        ("forward", kernels.forward, by_query),
        ("dV", backward.key_grad, dict(by_key, VALUE=True)),
        ("dK", backward.key_grad, dict(by_key, VALUE=False)),
        ("dQ", backward.query_grad, by_query),
    ):
        try:
            results.append(resources(compile_kernel(kernel, dtype, constants, arch, tiles.warps, tiles.stages)))
        except Exception as error:  # what fails to compile is reported, and pruned from the list
            results.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:100]}")
    return job, results


def candidates():
    """The wider set the list was chosen from (at head_dim 512): every stationary and streamed
    size, 4 and 8 warps, 64-column chunks, one stage; and around 32 x 64, other chunks and two
    stages. (At 256 and 128 the list's larger tiles were compiled the same way, one by one.)"""
    from compile_pass.kernels.wide_head.tiles import Config, Tiles

    wide = [Tiles(m, n, 64, w, 1) for m in (16, 32, 64) for n in (32, 64, 128) for w in (4, 8)]
    around = [Tiles(32, 64, 32, 8, 1), Tiles(32, 64, 128, 8, 1), Tiles(32, 64, 64, 8, 2), Tiles(64, 64, 64, 8, 2)]
    return tuple(Config(tiles, 512) for tiles in wide + around)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=[80, 90, 100])
    parser.add_argument(
        "--head-dims", type=int, nargs="+", help="head_dims to compile at (default: each config at its widest)"
    )
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--candidates", action="store_true", help="the wider set the list was chosen from")
    parser.add_argument("--jobs", type=int, default=1, help="configs compiled at once (processes)")
    parser.add_argument(
        "--tiles",
        type=int,
        nargs=5,
        action="append",
        metavar=("M", "N", "CHUNK", "WARPS", "STAGES"),
        help="only these configs of the list (repeatable)",
    )
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    from compile_pass.kernels.wide_head import tiles as wide_head_tiles

    configs = candidates() if args.candidates else wide_head_tiles.CONFIGS
    if args.tiles:
        configs = tuple(config for config in configs if list(config.tiles) in args.tiles)
    dtypes = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
    jobs = [
        (arch, form, dtype, head_dim, config.tiles)
        for arch in args.archs
        for form in args.forms
        for dtype in args.dtypes
        for config in configs
        for head_dim in args.head_dims or [config.widest]
        if config.tiles in wide_head_tiles.fitting((config,), None, head_dim, dtypes[dtype], form == "masked")
    ]
    print(
        f"# triton {triton.__version__}: {len(jobs)} configs compiled, not run; causal; per kernel: registers a "
        "thread / spill stack bytes / shared KiB; est: wide_head_tiles.shared_memory_estimate, KiB"
    )
    print(
        f"{'arch':5} {'form':6} {'dtype':5} {'D':>4} {'tiles (m, n, chunk, warps, stages)':36} {'est':>4} | "
        + " | ".join(f"{name:>14}" for name in KERNELS)
    )
    failed = under = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for (arch, form, dtype, head_dim, tiles), results in pool.map(compile_config, jobs):
            estimate = wide_head_tiles.shared_memory_estimate(tiles, head_dim, dtypes[dtype], form == "masked")
            cells = []
            for result in results:
                if isinstance(result, str):
                    failed += 1
                    cells.append(result)
                    continue
                registers, stack, shared = result
                flag = "!" if shared > estimate else " "
                under += shared > estimate
                cells.append(f"{registers:3d} {stack:5d} {shared // 1024:3d}{flag}")
            print(
                f"sm{arch:<3} {form:6} {dtype:5} {head_dim:4d} {str(tuple(tiles)):36} {estimate // 1024:4d} | "
                + " | ".join(f"{cell:>14}" for cell in cells),
                flush=True,
            )
    print(f"# {failed} kernels failed to compile; {under} took more shared memory than estimated ('!')")
    return 1 if failed or under else 0


if __name__ == "__main__":
    sys.exit(main())
