"""The ``model`` and ``measure`` sections: a training step of a 6-layer Gemma-4 at the sliding
layer's shapes, compiled with compile_pass against plain inductor; and the kernels measured on
this GPU (``measure_on_device.py``), then that step with measurement on."""

from __future__ import annotations

import copy
import time

from bench_model import CONFIG as CPU_MODEL_CONFIG

from .common import HEAD_DIM, HEADS, KV_HEADS, WINDOW, Printer, interleaved_medians_ms

# The CPU benchmark's model at 26B-A4B's attention shapes; a small vocabulary keeps the
# logits of long sequences in memory.
MODEL_CONFIG = dict(
    CPU_MODEL_CONFIG,
    hidden_size=2048,
    intermediate_size=4096,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    global_head_dim=512,
    sliding_window=WINDOW,
    vocab_size=32768,
    vocab_size_per_layer_input=32768,
)


def time_model(say: Printer, seqs: list[int], repeats: int, padded: bool = False) -> None:
    """The training step, compile_pass against inductor; ``padded``: a batch of 2 whose second
    row is left-padded by a quarter (attention_mask, labels -100 there), as TRL pads."""
    import torch
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    import compile_pass

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**MODEL_CONFIG)).to("cuda", torch.bfloat16).train()
    models = {"inductor": copy.deepcopy(model), "compile_pass": model}
    compiled = {
        "inductor": torch.compile(models["inductor"], fullgraph=True),
        "compile_pass": torch.compile(models["compile_pass"], backend=compile_pass.backend, fullgraph=True),
    }
    c = MODEL_CONFIG
    batch = "batch 2, the second row left-padded by a quarter" if padded else "batch 1"
    say(
        f"# Gemma-4 {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
        f"{c['num_key_value_heads']} kv heads, head_dim {c['head_dim']} (global {c['global_head_dim']}), "
        f"window {c['sliding_window']}, bf16, {batch}, fwd+bwd; interleaved median of {repeats}"
    )
    say(
        f"{'S':>6} {'inductor ms':>12} {'compile_pass ms':>16} {'speedup':>8} {'inductor GiB':>13} "
        f"{'compile_pass GiB':>17}"
    )

    def one_length(seq):
        rows = 2 if padded else 1
        ids = torch.randint(
            0,
            MODEL_CONFIG["vocab_size"],
            (rows, seq),
            device="cuda",
            generator=torch.Generator(device="cuda").manual_seed(seq),
        )
        inputs = {"input_ids": ids, "labels": ids}
        if padded:
            attention_mask = torch.ones_like(ids)
            attention_mask[1, : seq // 4] = 0
            inputs = {
                "input_ids": ids,
                "attention_mask": attention_mask,
                "labels": ids.masked_fill(attention_mask == 0, -100),
            }

        def step_of(name):
            def step():
                models[name].zero_grad(set_to_none=True)
                compiled[name](**inputs, use_cache=False).loss.backward()

            return step

        steps = {name: step_of(name) for name in compiled}
        try:
            first = {}
            with compile_pass.decisions() as report:
                for name, step in steps.items():  # compiles; the timed warm-up below reuses it
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    first[name] = time.perf_counter() - started
            say(
                f"# first step at {seq} (compiles where no graph takes the length): "
                f"inductor {first['inductor']:.1f} s, compile_pass {first['compile_pass']:.1f} s "
                "(its kernel measurements included)"
            )
            if seq == seqs[0]:
                for line in report.table().splitlines():
                    say(f"#   {line}")
            peaks = {}
            for name, step in steps.items():
                step()
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peaks[name] = torch.cuda.max_memory_allocated() / 2**30
            ms = interleaved_medians_ms(steps, repeats)
        except torch.cuda.OutOfMemoryError:
            say(f"{seq:6d} out of memory")
            torch.cuda.empty_cache()
            return
        say(
            f"{seq:6d} {ms['inductor']:12.1f} {ms['compile_pass']:16.1f} {ms['inductor'] / ms['compile_pass']:7.2f}x "
            f"{peaks['inductor']:13.2f} {peaks['compile_pass']:17.2f}"
        )

    for seq in seqs:
        one_length(seq)


def measured_on_this_gpu(say: Printer, seqs: list[int], model_seqs: list[int], repeats: int, skip_model: bool) -> None:
    """Kernel choice measured on this GPU (``measure_on_device.py``): every case measured afresh
    (the cache ignored), the choices, the table; the chain of ops against SDPA with the mask;
    then the training step with measurement on, its first compile's time against inductor's."""
    import measure_on_device

    from compile_pass import measure

    cases = [case for case in measure_on_device.CASES if case != "chain"]
    measure_on_device.measure_cases(say, "cuda", cases, seqs, "bfloat16", again=True)
    measure_on_device.chain_against_sdpa(say, seqs, repeats)
    if not skip_model:
        say(f"# the training step with kernels measured on this GPU (measure={measure.mode()!r})")
        time_model(say, model_seqs, repeats)
