"""The op against SDPA with the mask at every length, as a compiled model runs them
(``python benchmarks/bench_op.py --sweep``).

One attention layer, written as a model writes it: the band (and the padding or the packed
documents) built as a boolean mask, K/V repeated to the query heads, SDPA. It is compiled
twice with the length dynamic (``maybe_mark_dynamic``: one graph for every length, as a
fine-tuning run with varying lengths gets after its first recompile): by inductor as it is (SDPA with the mask), and
with ``backend="compile_pass"`` (the sliding rule rewrites it to the op). Every cell is
forward + backward, timed side by side in one process: each repeat times SDPA's step and
then each window's op step in turn, so drift on the machine meets every variant alike; the
median of the repeats counts. SDPA scores every pair whatever the window, so its time is
measured once per length (with the first window's mask) and shared by the windows.

Each configuration (dtype, head_dim, batch, form) runs in a fresh process; rows print as
they are measured, with the load average. ``--results`` appends JSON lines and resumes.

    python benchmarks/bench_op.py --sweep                      # the whole grid (hours on 2 cores)
    python benchmarks/bench_op.py --sweep --seqs 16 64 256 1024 --dtypes fp32 --forms plain
    python benchmarks/bench_op.py --sweep --results sweep.jsonl --plot docs/sweep.png
    python benchmarks/bench_op.py --sweep --most-gflop 550      # the grid's cells 2 cores can afford

``--no-grad`` times the forward alone under ``torch.no_grad`` (an eval loop, a prefill): the
graphs are compiled and decided under no_grad, as an eval step's graph is (Dynamo traces one of
its own), while the measurement that decides is the training one (forward and backward).

    python benchmarks/bench_op.py --sweep --no-grad --seqs 64 256 1024 2048 --dtypes fp32 bf16

``--most-gflop`` leaves out the cells whose SDPA forward costs more (4 * B * H * S^2 * D flop: the
full score matrix and its product with V); the table lists them as not measured and the summary
counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import Results, processor  # noqa: E402

HEADS, KV_HEADS = 8, 4
# How a decision says SDPA stayed for the length: kernel.short_call's verdict (static tables), a
# measurement on this machine that found SDPA faster, or a call too short to measure (measure.py).
SDPA_STAYED = (
    "too few for the band to repay the op's fixed cost per call",
    "measured on this device",
    "SDPA stays where a call is too short to measure",
)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
FORMS = ("plain", "padded", "packed")


def sdpa_gflop(seq: int, batch: int, head_dim: int) -> float:
    """SDPA's forward with the mask: Q K^T and P V over every pair, whatever the window."""
    return 4 * batch * HEADS * seq * seq * head_dim / 1e9


def _layer(window: int, form: str):
    """The layer as a module holding its window, as a model's config does (one code object for
    every window, with the window a constant of each compiled graph)."""
    import torch
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.window, self.form = window, form

        def forward(self, q, k, v, padding, documents):
            seq = q.shape[2]
            positions = torch.arange(seq, device=q.device)
            distance = positions[None, :] - positions[:, None]
            mask = ((distance <= 0) & (distance > -self.window))[None, None]
            if self.form == "padded":
                mask = mask & padding[:, None, None, :]
            if self.form == "packed":
                mask = mask & (documents[:, None, :, None] == documents[:, None, None, :])
            batch, kv_heads, _, head_dim = k.shape
            groups = q.shape[1] // kv_heads

            def repeat(x):
                return (
                    x[:, :, None]
                    .expand(batch, kv_heads, groups, seq, head_dim)
                    .reshape(batch, kv_heads * groups, seq, head_dim)
                )

            return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)

    return Attention()


def _inputs(seq: int, batch: int, head_dim: int, dtype, form: str):
    import torch

    gen = torch.Generator().manual_seed(seq)

    def make(heads):  # (B, S, H, D) storage viewed as (B, H, S, D), as projections give it
        return torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype).transpose(1, 2).requires_grad_()

    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    grad_out = torch.randn(batch, seq, HEADS, head_dim, generator=gen).to(dtype).transpose(1, 2)
    padding = torch.ones(batch, seq, dtype=torch.bool)
    padding[0, : seq // 8] = False  # a left-padded row
    documents = torch.zeros(batch, seq, dtype=torch.int64)
    for start in (seq // 3, 2 * seq // 3 + 1):  # three packed documents a row
        documents[:, start:] += 1
    return q, k, v, grad_out, padding, documents


def _step(function, inputs: tuple, grad_out, no_grad: bool = False):
    """A training step of the layer ``function`` on ``inputs`` (q, k, v first), gradients
    dropped; with ``no_grad``, its forward alone under ``torch.no_grad``."""
    import torch

    def run():
        function(*inputs).backward(grad_out)
        for x in inputs[:3]:
            x.grad = None

    def forward():
        with torch.no_grad():
            function(*inputs)

    return forward if no_grad else run


def child(args) -> None:
    import torch

    import compile_pass

    dtype = getattr(torch, DTYPES[args.dtype])
    head_dim, batch, form = args.head_dim, args.batch, args.form
    compiled = {"sdpa": torch.compile(_layer(args.windows[0], form))}
    for window in args.windows:
        compiled[window] = torch.compile(_layer(window, form), backend="compile_pass")
    kept = {}  # window -> how SDPA stayed in the graph that runs: "mask", "causal", or None (the op)
    for seq in args.seqs:
        q, k, v, grad_out, padding, documents = _inputs(seq, batch, head_dim, dtype, form)
        for x, dim in ((q, 2), (k, 2), (v, 2), (padding, 1), (documents, 1)):
            # One graph for every length, the window a constant; maybe_mark_dynamic, as automatic
            # dynamic shapes make a length after a recompile (mark_dynamic would forbid the
            # guards that decide each length: one answer for every length, compile_pass's
            # answer for a length a user marked so).
            torch._dynamo.maybe_mark_dynamic(x, dim)

        operands = (q, k, v, padding, documents)
        steps = {name: _step(function, operands, grad_out, args.no_grad) for name, function in compiled.items()}
        for name, run in steps.items():
            with compile_pass.decisions() as report:
                run()  # the first length compiles, and the first past the short-call crossover
            decisions = list(report)
            if name == "sdpa" or not decisions:
                continue  # no compilation: lengths ascend, so the graph of the last one runs
            (decision,) = decisions
            # A short call keeps SDPA; where the graph's lengths then all lie inside the
            # window, the causal rule rewrites it to is_causal (its reason replaces the short call's).
            if decision.rule == "sliding_window" and decision.rewritten:
                kept[name] = None
            elif decision.rule == "causal_mask" and decision.rewritten:
                kept[name] = "causal"
            elif any(stayed in reason for reason in decision.reasons for stayed in SDPA_STAYED):
                kept[name] = "mask"
            else:
                raise SystemExit(f"not rewritten: {decision.reasons}")
        once = {}
        for name, run in steps.items():
            start = time.perf_counter()
            run()
            once[name] = time.perf_counter() - start
        repeats = max(3, min(args.max_repeats, int(args.seconds / sum(once.values()))))
        times = {name: [] for name in steps}
        for _ in range(repeats):
            for name, run in steps.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        median = {str(name): statistics.median(values) for name, values in times.items()}
        record = {"seq": seq, "repeats": repeats, "load": os.getloadavg()[0], "seconds": median}
        record["kept"] = [window for window in args.windows if kept.get(window) == "mask"]
        record["causal"] = [window for window in args.windows if kept.get(window) == "causal"]
        print(json.dumps(record), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seqs", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    )
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--seconds", type=float, default=2.0, help="time to spend on a row's repeats (at least 3)")
    parser.add_argument("--max-repeats", type=int, default=50)
    parser.add_argument(
        "--results", help="JSON-lines file: rows are appended, and rows it holds are not measured again"
    )
    parser.add_argument("--most-gflop", type=float, help="leave out cells whose SDPA forward is more GFLOP than this")
    parser.add_argument("--plot", help="write the ratio against S, one line per window, as a PNG (needs matplotlib)")
    parser.add_argument(
        "--measure",
        choices=("measure", "static"),
        default="measure",
        help="how compile_pass chooses a kernel: measured on this machine (the default; a fresh cache for the run) "
        "or by the project's static tables",
    )
    parser.add_argument("--no-grad", action="store_true", help="the forward alone under torch.no_grad (eval)")
    parser.add_argument("--child", nargs=4, metavar=("DTYPE", "HEAD_DIM", "BATCH", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.dtype, args.head_dim, args.batch, args.form = (
            args.child[0],
            int(args.child[1]),
            int(args.child[2]),
            args.child[3],
        )
        return child(args)

    import tempfile

    import torch

    # The children inherit these: each configuration measures on this machine afresh (its own keys).
    os.environ["COMPILE_PASS_MEASURE"] = args.measure
    os.environ.setdefault("COMPILE_PASS_CACHE_DIR", tempfile.mkdtemp(prefix="length_sweep_measurements_"))
    results = Results(args.results)
    held = results.held
    load = os.getloadavg()
    print(
        f"# {processor()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads; load "
        "average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start; {HEADS} heads, {KV_HEADS} kv heads, compiled "
        f"with the length dynamic; {'forward alone under no_grad' if args.no_grad else 'fwd+bwd'}; ratio = SDPA "
        "with the mask (inductor) / the op (compile_pass), median of the "
        "repeats; "
        "'=': compile_pass kept SDPA there (a short call, or measured slower), so both columns time the same graph; "
        "'c': kept "
        "SDPA, with is_causal (the causal rule) in place of the mask"
    )
    windows = " ".join(f"{f'w={w} ms':>10} {'ratio':>6}" for w in args.windows)
    print(
        f"{'dtype':>5} {'D':>4} {'B':>2} {'form':>7} {'S':>6} {'sdpa ms':>10} {windows} {'reps':>4} {'load':>5}",
        flush=True,
    )
    records, left_out = [], []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            for batch in args.batches:
                for form in args.forms:
                    config = f"{dtype} D={head_dim} B={batch} {form} w={args.windows}" + (" no-grad" * args.no_grad)
                    seqs = [
                        seq
                        for seq in args.seqs
                        if args.most_gflop is None or sdpa_gflop(seq, batch, head_dim) <= args.most_gflop
                    ]
                    left_out += [(config, seq) for seq in args.seqs if seq not in seqs]
                    todo = [seq for seq in seqs if f"{config} S={seq}" not in held]
                    if todo:
                        command = [sys.executable, __file__, "--child", dtype, str(head_dim), str(batch), form]
                        command += ["--seqs", *map(str, todo), "--windows", *map(str, args.windows)]
                        command += ["--seconds", str(args.seconds), "--max-repeats", str(args.max_repeats)]
                        command += ["--no-grad"] if args.no_grad else []
                        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
                        for line in process.stdout:
                            record = json.loads(line)
                            record = results.add(f"{config} S={record['seq']}", record)
                            _print_row(dtype, head_dim, batch, form, record, args.windows)
                        if process.wait() != 0:
                            raise SystemExit(f"{config}: the child failed")
                    else:
                        for seq in seqs:
                            _print_row(dtype, head_dim, batch, form, held[f"{config} S={seq}"], args.windows)
                    records += [(config, held[f"{config} S={seq}"]) for seq in seqs]
    ratios = [
        (record["seconds"]["sdpa"] / record["seconds"][str(window)], config, record["seq"], window)
        for config, record in records
        for window in args.windows
    ]
    marks = {}  # (config, seq, window) -> "=" or "c" where compile_pass kept SDPA
    for config, record in records:
        for mark, key in (("=", "kept"), ("c", "causal")):
            marks.update({(config, record["seq"], window): mark for window in record.get(key, ())})
    _print_lengths(ratios, marks)
    worst = min(ratios)
    print(
        f"# worst cell: {worst[0]:.2f}x ({worst[1]}, S={worst[2]}, w={worst[3]}); cells below 1.0x: "
        f"{sum(ratio < 1.0 for ratio, *_ in ratios)} of {len(ratios)}"
    )
    kept = set(marks)
    rewritten = [cell for cell in ratios if cell[1:] not in kept]
    if kept and rewritten:
        worst = min(rewritten)
        print(
            f"# worst cell the op runs: {worst[0]:.2f}x ({worst[1]}, S={worst[2]}, w={worst[3]}); of those below "
            f"1.0x: {sum(ratio < 1.0 for ratio, *_ in rewritten)} of {len(rewritten)}; cells where SDPA stayed: "
            f"{len(kept)}"
        )
    if left_out:
        configs = len(args.dtypes) * len(args.head_dims) * len(args.batches) * len(args.forms)
        per_seq = ", ".join(
            f"{seq}: {sum(s == seq for _, s in left_out)} of {configs}" for seq in sorted({s for _, s in left_out})
        )
        print(
            f"# not measured (SDPA's forward over {args.most_gflop:g} GFLOP): {len(left_out) * len(args.windows)} "
            f"cells; configurations left out per S: {per_seq}"
        )
    if args.plot:
        _plot(args, records)


def _print_lengths(ratios, marks) -> None:
    """Per length: the worst and the best cell, the cells below 1.0x, the cells where SDPA stayed."""

    def cell(ratio, config, seq, window):
        dtype, head_dim, batch, form, _ = config.split(" ", 4)
        return f"{ratio:.2f}{marks.get((config, seq, window), 'x')} ({dtype}, {head_dim}, {batch}, {form}, w={window})"

    print(f"{'S':>6}   {'worst cell':<44}{'best cell':<44}{'below 1.0x':<12}SDPA stayed")
    for seq in sorted({seq for _, _, seq, _ in ratios}):
        cells = [r for r in ratios if r[2] == seq]
        stayed = sum(r[1:] in marks for r in cells)
        below = sum(r[0] < 1.0 for r in cells)
        print(
            f"{seq:>6}   {cell(*min(cells)):<44}{cell(*max(cells)):<44}{f'{below} of {len(cells)}':<12}{stayed} of "
            f"{len(cells)}"
        )


def _print_row(dtype, head_dim, batch, form, record, windows) -> None:
    seconds, kept, causal = record["seconds"], record.get("kept", ()), record.get("causal", ())

    def mark(window):
        return "=" if window in kept else "c" if window in causal else "x"

    cells = " ".join(
        f"{seconds[str(w)] * 1e3:>10.3f} {seconds['sdpa'] / seconds[str(w)]:>5.2f}{mark(w)}" for w in windows
    )
    print(
        f"{dtype:>5} {head_dim:>4} {batch:>2} {form:>7} {record['seq']:>6} {seconds['sdpa'] * 1e3:>10.3f} {cells} "
        f"{record['repeats']:>4} {record['load']:>5.2f}",
        flush=True,
    )


def _plot(args, records) -> None:
    """The ratio against S per window, the least over the configurations where the op runs (the
    worst case; a gap where it runs in none), and the least where SDPA stayed on both sides
    (the same graph twice: the run's noise)."""
    from measure import plot_speedups

    seqs = sorted({record["seq"] for _, record in records})

    def worst(ratios):
        return min(ratios, default=float("nan"))

    def ratio(record, window):
        return record["seconds"]["sdpa"] / record["seconds"][str(window)]

    def stayed(record, window):
        return window in record.get("kept", []) or window in record.get("causal", [])

    series = {}
    for window in args.windows:
        series[f"w={window}, the op"] = [
            worst(ratio(r, window) for _, r in records if r["seq"] == seq and not stayed(r, window)) for seq in seqs
        ]
    series["SDPA stayed (any w)"] = [
        worst(ratio(r, w) for _, r in records if r["seq"] == seq for w in args.windows if stayed(r, w)) for seq in seqs
    ]
    series["limit 1.0x"] = [1.0] * len(seqs)
    plot_speedups(args.plot, seqs, series, f"op vs SDPA with the mask, {'/'.join(args.dtypes)} fwd+bwd: worst cell")


if __name__ == "__main__":
    main()
