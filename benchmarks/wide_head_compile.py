"""Compile the wide-head Triton kernels (compile_pass/ops/wide_head_kernels.py) for a CUDA target
on a machine without a GPU, with the ptxas that ships in triton's wheel, and print what each
kernel uses: registers a thread, spill stack bytes, shared memory. Nothing runs or is timed:
this checks that the tiles of ``wide_head.TILES`` compile and fit, before a GPU is lent.

    python benchmarks/wide_head_compile.py                       # sm90 and sm80, bf16, head_dim 512 and 320
    python benchmarks/wide_head_compile.py --archs 90 --head-dims 512 --dtypes fp16
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
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
            signature[name] = "fp32" if name.startswith("scale") else "i32"
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={k: v for k, v in constants.items() if k in parameters}
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


def resources(compiled) -> str:
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
    return f"{registers} regs, {stack} B spill stack, {compiled.metadata.shared // 1024} KiB shared"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[512, 320])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
    import triton

    from compile_pass.ops import wide_head
    from compile_pass.ops import wide_head_kernels as kernels

    print(f"# triton {triton.__version__}: compiled for each target, not run; key padding and segment ids on, causal")
    for arch in args.archs:
        for least, tiles in wide_head.TILES:
            for dtype in args.dtypes:
                for head_dim in args.head_dims:
                    common = dict(
                        HEAD_DIM=head_dim,
                        D_PAD=1 << (head_dim - 1).bit_length(),
                        D_CHUNK=tiles.d_chunk,
                        PRECISION="tf32",
                        UPCAST=False,
                        HAS_LEFT=False,
                        HAS_RIGHT=True,
                        HAS_PAD=True,
                        HAS_SEG=True,
                    )
                    by_query = dict(common, BLOCK_M=tiles.stationary, BLOCK_N=tiles.streamed)
                    by_key = dict(common, BLOCK_M=tiles.streamed, BLOCK_N=tiles.stationary)
                    print(f"sm{arch} {dtype} head_dim {head_dim} {tiles} (for >= {least // 1024} KiB shared):")
                    for name, kernel, constants in (
                        ("forward", kernels.forward, by_query),
                        ("dV", kernels.key_grad, dict(by_key, VALUE=True)),
                        ("dK", kernels.key_grad, dict(by_key, VALUE=False)),
                        ("dQ", kernels.query_grad, by_query),
                    ):
                        compiled = compile_kernel(kernel, dtype, constants, arch, tiles.warps, tiles.stages)
                        print(f"  {name:8} {resources(compiled)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
