"""Kernel choice measured on the device at hand (compile_pass/measure/__init__.py), for the calls the
project's users run: what each kernel measured against SDPA, checked first, and what the
policy then chooses. ``gpu_check.py --sections measure`` runs it on a GPU; on the CPU it gives
the table of the machine at hand.

Cases, each at every ``--seqs`` length (batch 1; the batch forms are SDPA's boolean mask for
SDPA and the kernels' own masks, ``measure_run.py``):
- ``global``: Gemma-4's global layer (head_dim 512, 16 / 8 heads, causal): dense (as the causal
  rule leaves it: SDPA ``is_causal``), padded and packed (SDPA with the mask);
- ``sliding``: Gemma-4's sliding layer (head_dim 256, 16 / 8 heads, window 1024): dense, padded,
  packed, and with image blocks;
- ``gpt-oss``: GPT-OSS's layers (head_dim 64, 64 / 8 heads): sliding (window 128) and full,
  dense, spelled out in ops with sinks as the spelled-out rule asks (the sinks are applied
  of a key, but SDPA alone does not compute such a call, so a full layer is measured);
- ``narrow-value``: a value head_dim narrower than the query's (256, value 128, window 1024),
  zero-padded for the op as the rewrite does;
- ``chain`` (a GPU only): SDPA with the mask against GPT-OSS's attention spelled out in ops and
  compiled by inductor, fwd+bwd: the rewrite of a spelled-out chain compares the op with SDPA
  with the mask, which this shows to be at least as fast as the chain.
Then ``--model-seqs``: the 6-layer Gemma-4 training step (gpu_check's ``model`` section) with
measurement on, its first compile's seconds against plain inductor's.

``--first-step S`` (any device): what measuring adds to a first compile. The example's Gemma-4
(``examples/train_gemma4.py``: 6 layers, window 512, fp32) compiles from nothing and runs one
training step of S tokens, each variant in a fresh process with empty inductor and measurement
caches: plain inductor, compile_pass with its static tables, compile_pass measuring, and
compile_pass again with its measurements cached (inductor's cache still empty).

    python benchmarks/measure_on_device.py --device cpu --cases sliding --seqs 512 1024 2048
    python benchmarks/measure_on_device.py --device cpu --first-step 4096
    python benchmarks/gpu_check.py --skip-tests --no-record --sections measure --seqs 4096 8192 16384 32768
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = ("global", "sliding", "gpt-oss", "narrow-value", "chain")


def case_facts(case: str, seq: int, device: str, dtype):
    """(label, facts) of each call of a case at ``seq`` keys, as the rules ask: a dense global
    layer is one SDPA computes without its mask (``sdpa_unmasked``)."""
    import torch

    from compile_pass.kernels.contract import CallFacts
    from compile_pass.window import UNBOUNDED

    def facts(head_dim, heads, kv_heads, left, right, value_head_dim=None, **masks):
        return CallFacts(
            torch.device(device),
            dtype,
            head_dim,
            True,
            keys=seq,
            left=left,
            right=right,
            value_head_dim=value_head_dim,
            batch=1,
            heads=heads,
            kv_heads=kv_heads,
            queries=seq,
            **masks,
        )

    forms = {"dense": {}, "padded": {"key_padding": True}, "packed": {"segment_ids": True}}
    if case == "global":
        return [
            (f"global {form}", facts(512, 16, 8, UNBOUNDED, 0, sdpa_unmasked=form == "dense", **masks))
            for form, masks in forms.items()
        ]
    if case == "sliding":
        forms = {**forms, "images": {"blocks": True}}
        return [(f"sliding {form}", facts(256, 16, 8, 1023, 0, **masks)) for form, masks in forms.items()]
    if case == "gpt-oss":
        return [
            ("gpt-oss sliding", facts(64, 64, 8, 127, 0, spelled=True)),
            ("gpt-oss full", facts(64, 64, 8, UNBOUNDED, 0, spelled=True)),
        ]
    if case == "narrow-value":
        return [("narrower value", facts(256, 16, 8, 1023, 0, value_head_dim=128))]
    return []


def measure_cases(say, device: str, cases: list[str], seqs: list[int], dtype_name: str, again: bool) -> None:
    """Each case's calls measured on ``device`` (``again``: ignoring the cache), the policy's
    choice for each, then the measurement table."""
    import torch

    from compile_pass import measure
    from compile_pass.kernels import policy
    from compile_pass.measure import table as measured
    from compile_pass.measure.store import cache_root, device_name

    dtype = getattr(torch, dtype_name)
    mode = measure.REMEASURE if again else measure.MEASURE
    say(f"# measured on {device_name(torch.device(device))}, {dtype_name}, batch 1; cache {cache_root()}")
    say(
        f"# a kernel is chosen where its fwd+bwd median beats SDPA's by {measured.MARGIN:.0%} "
        f"({measured.FEW_ROUNDS_MARGIN:.0%} with fewer than {measured.MANY_ROUNDS} rounds)"
    )
    asked = set(measured.TABLE.asked)
    for case in cases:
        for seq in seqs:
            for label, facts in case_facts(case, seq, device, dtype):
                started = time.perf_counter()
                with measure.measuring_on(device, mode):
                    choice = policy.POLICY.choose(facts)
                seconds = time.perf_counter() - started
                said = choice.name if choice.fast else f"SDPA stays ({choice.reason})"
                say(f"{label:>18} {seq:6d}  {seconds:6.1f} s  {said}")
    say("")
    for line in measured.table_text(measured.TABLE.entries(measured.TABLE.asked - asked)).splitlines():
        say(line)


def chain_against_sdpa(say, seqs: list[int], repeats: int) -> None:
    """GPT-OSS's attention spelled out in ops (compiled by inductor, as a model with eager
    attention runs it) against SDPA with the same mask, fwd+bwd, bf16: the chain's time over
    SDPA's, which the spelled-out rule takes to be at least 1."""
    import torch
    import torch.nn.functional as F

    def chain(q, k, v, mask, sinks):
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
        column = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        joined = torch.cat([scores, column], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values
        probabilities = F.softmax(joined, dim=-1, dtype=joined.dtype)[..., :-1]
        return torch.matmul(probabilities, v)

    def sdpa(q, k, v, mask, sinks):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled = torch.compile(chain)
    say("# GPT-OSS attention (64 heads, head_dim 64, window 128) spelled out, compiled, against SDPA with the mask")
    say(f"{'S':>6} {'chain ms':>9} {'SDPA ms':>8} {'chain / SDPA':>13}")
    for seq in seqs:
        try:
            times = _chain_and_sdpa_ms(seq, repeats, {"chain": compiled, "sdpa": sdpa})
        except torch.cuda.OutOfMemoryError:
            say(f"{seq:6d} out of memory")
            torch.cuda.empty_cache()
            continue
        say(f"{seq:6d} {times['chain']:9.2f} {times['sdpa']:8.2f} {times['chain'] / times['sdpa']:12.2f}x")


def _chain_and_sdpa_ms(seq: int, repeats: int, functions: dict) -> dict[str, float]:
    """Median fwd+bwd milliseconds of each function on one length's bf16 inputs (a first run
    not counted)."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seq)

    def make(*shape):
        x = torch.randn(*shape, device="cuda", generator=generator, dtype=torch.float32)
        return x.to(torch.bfloat16).requires_grad_()

    q, k, v = (make(1, 64, seq, 64) for _ in range(3))
    sinks = make(64)
    positions = torch.arange(seq, device="cuda")
    distance = positions[None, :] - positions[:, None]
    visible = (distance <= 0) & (distance > -128)
    mask = torch.zeros(seq, seq, device="cuda", dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))[None, None]
    grad = torch.randn(1, 64, seq, 64, device="cuda", generator=generator).to(torch.bfloat16)
    times = {}
    for name, function in functions.items():
        runs = []
        for repeat in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            function(q, k, v, mask, sinks).backward(grad)
            torch.cuda.synchronize()
            if repeat:
                runs.append(time.perf_counter() - start)
        times[name] = 1e3 * sorted(runs)[len(runs) // 2]
    return times


FIRST_STEP_VARIANTS = ("inductor", "static", "measure", "measured before")


def first_steps(say, device: str, seq: int) -> None:
    """The seconds of a first training step (compile included) per variant, side by side."""
    import os
    import subprocess
    import tempfile

    measurements = tempfile.mkdtemp(prefix="first_step_measurements_")
    seconds = {}
    for variant in FIRST_STEP_VARIANTS:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="first_step_inductor_"))
        env["COMPILE_PASS_CACHE_DIR"] = measurements  # "measured before" reads what "measure" wrote
        env["COMPILE_PASS_MEASURE"] = "static" if variant == "static" else "measure"
        command = [sys.executable, __file__, "--first-step-child", variant, "--device", device, str(seq)]
        printed = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        seconds[variant] = float(printed.split("SECONDS")[-1].split()[0])
        say(f"{variant:>16}: first step {seconds[variant]:7.1f} s")
    say(
        f"measuring added {seconds['measure'] - seconds['static']:+.1f} s to compile_pass's first step "
        f"({seconds['measure'] / seconds['inductor']:.2f}x plain inductor's, "
        f"{seconds['static'] / seconds['inductor']:.2f}x with the static tables); with the measurements cached "
        f"{seconds['measured before'] - seconds['static']:+.1f} s"
    )


def first_step_child(variant: str, device: str, seq: int) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from train_gemma4 import build_model

    torch.manual_seed(0)
    model = build_model(None).to(device)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    backend = "inductor" if variant == "inductor" else "compile_pass"
    compiled = torch.compile(model, backend=backend)
    started = time.perf_counter()
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"SECONDS {time.perf_counter() - started:.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=[c for c in CASES if c != "chain"])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--dtype", default=None, help="bfloat16 (the GPU's default) or float32 (the CPU's)")
    parser.add_argument("--again", action="store_true", help="measure again, ignoring the cache")
    parser.add_argument("--first-step", type=int, metavar="S", help="what measuring adds to a first compile (S tokens)")
    parser.add_argument("--first-step-child", choices=FIRST_STEP_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("child_seq", type=int, nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if args.first_step_child:
        first_step_child(args.first_step_child, args.device or "cpu", args.child_seq)
        return 0
    if args.first_step:
        first_steps(print, args.device or ("cuda" if torch.cuda.is_available() else "cpu"), args.first_step)
        return 0

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    measure_cases(print, device, [c for c in args.cases if c != "chain"], args.seqs, dtype, args.again)
    if "chain" in args.cases and device == "cuda":
        chain_against_sdpa(print, args.seqs, 5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
