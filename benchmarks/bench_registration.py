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
- ``torch.empty_like``, an aten op of the same work;
each with one tensor argument and with the attention forward's 11 arguments.

    python benchmarks/bench_registration.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from compile_pass.registration import define_op


def _new_tensor(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty(1)


def _new_tensor_fake(x, *args):
    return torch.empty(1)


def _no_context(ctx, inputs, output):
    return None


# Each way twice: with one tensor argument, and with the attention forward's 11 arguments
# (per-argument conversions and wrappers add to the cost per call).
ONE = "(Tensor x) -> Tensor"
ELEVEN = (
    "(Tensor query, Tensor key, Tensor value, SymInt window_left, SymInt window_right, float scale, "
    "Tensor? key_padding=None, Tensor? segment_ids=None, Tensor? block_ids=None, Tensor? layout=None, "
    "Tensor? layout_sizes=None) -> Tensor"
)
LIBRARY = torch.library.Library("bench_registration", "FRAGMENT")


def _custom_op(name: str, schema: str):
    op = torch.library.custom_op(f"bench_registration::{name}", _new_tensor, mutates_args=(), schema=schema)
    op.register_fake(_new_tensor_fake)
    op.register_autograd(lambda ctx, grad: None, setup_context=_no_context)
    return getattr(torch.ops.bench_registration, name).default


def _library(name: str, schema: str, with_autograd: bool):
    LIBRARY.define(name + schema)
    LIBRARY.impl(name, _new_tensor, "CPU")
    if with_autograd:
        LIBRARY.impl(name, _new_tensor, "Autograd")  # no graph needed: run the kernel itself
    return getattr(torch.ops.bench_registration, name).default


def _define_op(name: str, schema: str):
    return define_op(
        f"bench_registration_{name}{schema}",
        _new_tensor,
        _new_tensor_fake,
        setup_context=_no_context,
        backward=lambda ctx, grad: None,
    )


WAYS = {
    "Python function": (_new_tensor, _new_tensor),
    "custom_op": (_custom_op("custom_op_one", ONE), _custom_op("custom_op_eleven", ELEVEN)),
    "Library, CPU kernel": (_library("kernel_one", ONE, False), _library("kernel_eleven", ELEVEN, False)),
    "Library, Autograd + CPU": (_library("autograd_one", ONE, True), _library("autograd_eleven", ELEVEN, True)),
    "define_op (the ops now)": (_define_op("one", ONE), _define_op("eleven", ELEVEN)),
    "aten empty_like": (torch.empty_like, None),
}


def per_call_us(call, args: tuple, calls: int = 20000) -> float:
    for _ in range(1000):
        call(*args)
    start = time.perf_counter()
    for _ in range(calls):
        call(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    x = torch.randn(4, requires_grad=True)
    load = os.getloadavg()
    print(
        f"# torch {torch.__version__}; grad off; median of 5 runs of 20000 calls; load average {load[0]:.2f} at start"
    )
    print(f"{'registration':>24} {'us, 1 argument':>15} {'us, 11 arguments':>17}")
    eleven = (x, x, x, 511, 0, 0.125, None, None, None, None, None)
    with torch.no_grad():
        for name, (one_call, eleven_call) in WAYS.items():
            one = statistics.median(per_call_us(one_call, (x,)) for _ in range(5))
            many = (
                "-"
                if eleven_call is None
                else f"{statistics.median(per_call_us(eleven_call, eleven) for _ in range(5)):.2f}"
            )
            print(f"{name:>24} {one:15.2f} {many:>17}", flush=True)


if __name__ == "__main__":
    main()
