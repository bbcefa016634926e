"""What one call of an opaque op costs in dispatch alone, by how it is registered.

At short lengths the sliding-window op's fixed cost per call decides whether it is as fast
as SDPA (issue 32). This times a call that does no work (it returns a new one-element
tensor), with gradients off as inside a compiled graph, for:
- a plain Python function (the floor);
- ``torch.library.custom_op`` with a fake and an autograd registration (as the ops were);
- ``torch.library.Library`` with the function as the CPU kernel;
- the same with an ``Autograd``-key kernel in front of it;
- ``registration.define_op``, as the project's ops are registered now (an autograd kernel
  that calls the kernel itself where nothing stands between);
- ``torch.empty_like``, an aten op of the same work.

    python benchmarks/bench_registration.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from compile_pass.ops.registration import define_op


def _new_tensor(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(1)


@torch.library.custom_op("bench_registration::as_custom_op", mutates_args=())
def as_custom_op(x: torch.Tensor) -> torch.Tensor:
    return _new_tensor(x)


@as_custom_op.register_fake
def _as_custom_op_fake(x):
    return torch.empty(1)


as_custom_op.register_autograd(lambda ctx, grad: None, setup_context=lambda ctx, inputs, output: None)

LIBRARY = torch.library.Library("bench_registration", "FRAGMENT")
LIBRARY.define("as_kernel(Tensor x) -> Tensor")
LIBRARY.impl("as_kernel", _new_tensor, "CPU")
LIBRARY.define("behind_autograd(Tensor x) -> Tensor")
LIBRARY.impl("behind_autograd", _new_tensor, "CPU")
LIBRARY.impl("behind_autograd", _new_tensor, "Autograd")  # no graph needed: run the kernel itself

as_defined_op = define_op(
    "bench_registration_define_op(Tensor x) -> Tensor",
    _new_tensor,
    lambda x: torch.empty(1),
    setup_context=lambda ctx, inputs, output: None,
    backward=lambda ctx, grad: None,
)

WAYS = {
    "Python function": _new_tensor,
    "custom_op": torch.ops.bench_registration.as_custom_op.default,
    "Library, CPU kernel": torch.ops.bench_registration.as_kernel.default,
    "Library, Autograd + CPU": torch.ops.bench_registration.behind_autograd.default,
    "define_op (the ops now)": as_defined_op,
    "aten empty_like": torch.empty_like,
}


def per_call_us(call, x: torch.Tensor, calls: int = 20000) -> float:
    for _ in range(1000):
        call(x)
    start = time.perf_counter()
    for _ in range(calls):
        call(x)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    x = torch.randn(4, requires_grad=True)
    load = os.getloadavg()
    print(f"# torch {torch.__version__}; grad off; median of 5 runs of 20000 calls; load average {load[0]:.2f} at start")
    print(f"{'registration':>24} {'us per call':>12}")
    with torch.no_grad():
        for name, call in WAYS.items():
            print(f"{name:>24} {statistics.median(per_call_us(call, x) for _ in range(5)):12.2f}", flush=True)


if __name__ == "__main__":
    main()
