"""Three ways to write the same top-k mask, timed eager and under inductor (forward, no_grad).

One (1, 8, 4096, 4096) fp32 bias, keep 256 per row; each form fills the same positions:
- float:  zeros_like(x).scatter(-1, i, 1.0) == 0.0          (transformers' Doge today)
- bool:   ~zeros_like(x, bool).scatter(-1, i, True)          (what the top-k rule emits)
- uint8:  zeros_like(x, uint8).scatter(-1, i, 1) == 0        (1 byte per element, like bool)
Median of 5 after a warm-up (which compiles), all in one run.

    python benchmarks/bench_topk_forms.py
"""

import statistics
import time

import torch

MIN = torch.finfo(torch.float32).min
KEEP = 256


def top_indices(x):
    return torch.topk(x.detach(), KEEP, dim=-1, largest=True, sorted=False).indices


def float_form(x):
    return x.masked_fill(torch.zeros_like(x).scatter(-1, top_indices(x), 1.0) == 0.0, MIN)


def bool_form(x):
    return x.masked_fill(~torch.zeros_like(x, dtype=torch.bool).scatter(-1, top_indices(x), True), MIN)


def uint8_form(x):
    return x.masked_fill(torch.zeros_like(x, dtype=torch.uint8).scatter(-1, top_indices(x), 1) == 0, MIN)


def median_seconds(fn, x, repeats=5):
    with torch.no_grad():
        fn(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    x = torch.randn(1, 8, 4096, 4096, generator=torch.Generator().manual_seed(0))
    reference = float_form(x)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; bias {tuple(x.shape)}, keep {KEEP}")
    print(f"{'form':>6} {'eager s':>8} {'inductor s':>11} {'same result':>12}")
    for name, form in (("float", float_form), ("bool", bool_form), ("uint8", uint8_form)):
        same = torch.equal(form(x), reference)
        eager, compiled = median_seconds(form, x), median_seconds(torch.compile(form), x)
        print(f"{name:>6} {eager:8.3f} {compiled:11.3f} {str(same):>12}")


if __name__ == "__main__":
    main()
