"""One Gemma-4 training step, compiled with plain inductor and with compile_pass, on the CPU.

Model: transformers' Gemma4ForCausalLM with random weights and a CPU-sized config:
hidden 512, 6 layers (5 sliding with window w and head_dim 64, 1 global with head_dim 128),
8 query heads, 4 KV heads, MLP 2048, vocab 4096, fp32, batch 1. A step is forward + backward of
the language-model loss. Each (variant, window) runs in a fresh process with the same seeded
weights and tokens, in one run of this script, with inductor's caches off so both compile
from scratch:
- compile: seconds for the first call at each length (compile + one step) minus one step;
- rewrite: seconds compile_pass spends in its rewrite, included in compile;
- step: median seconds of the following steps;
- split: one more step under torch.profiler, its wall time divided into the attention of the
  sliding layers (SDPA calls with the sliding head_dim under inductor; the op's forward and
  backward under compile_pass), the global layer's attention (SDPA calls with the global
  head_dim, in both), and everything else (projections, MLPs, norms, embeddings, LM head,
  loss, the mask construction inductor keeps). The profiler slows a step a little; the split
  is its own step's.

Each line prints as soon as its process finishes, with the 1-minute load average then.

    python benchmarks/bench_model.py                  # windows 256 and 512, S = 4096 and 8192
    python benchmarks/bench_model.py --windows 512 --seqs 2048 4096 8192
    python benchmarks/bench_model.py --plot docs/model_speedup.png --windows 512   # also draw the speedups
    python benchmarks/bench_model.py --autocast --windows 512 --seqs 4096   # fp32 weights, bf16 autocast
    python benchmarks/bench_model.py --packed 4 --windows 512 --seqs 8192   # 4 packed documents a row

``--packed D`` cuts each row into D documents of equal length, as a padding-free batch passes
them: ``position_ids`` restarting at each document and no attention mask (TRL's
``padding_free=True``, transformers' ``DataCollatorWithFlattening``).

``--padded`` runs batches of two as TRL's default collator pads them: the second sequence 3/4
as long as the first, padded on the right, with the attention mask. Lengths given in one run
are the steps of one training run: each length compiles where the graphs compiled before do
not take it (the first for its length, later ones with the length dynamic, as far as the
model's own guards on the length allow), so each row is what a run over batches of varying
length spends at that length. The ``all`` row
sums one step at every length (each length equally often).

    python benchmarks/bench_model.py --padded --windows 512 --seqs 128 256 512 1024 2048   # TRL-like lengths

``--eval`` times an evaluation step instead: the loss's forward alone under ``torch.no_grad``
(the model in eval mode), as the HF Trainer's evaluation loop runs it; Dynamo compiles such a
step as a graph of its own, which the rules decide by the same measurements.

    python benchmarks/bench_model.py --eval --interleaved --windows 512 --seqs 1024 2048 4096

``--qlora`` runs the model as QLoRA fine-tunes it: saved and loaded again with bitsandbytes'
4-bit nf4 weights (double quantization, fp32 compute), then PEFT LoRA (r = 16) on the
attention projections; only the LoRA weights train.

    python benchmarks/bench_model.py --qlora --interleaved --windows 512 --seqs 4096

``--interleaved`` runs both variants in one process, two models with the same weights, and
alternates their timed steps (the order flipped every repeat). Two processes running the
same graphs differ by 10-20% in the step's matrix products; in one process that spread
leaves the ratio. The compile columns then favour the variant compiled second at the first
length (the process is warm by then).

    python benchmarks/bench_model.py --padded --interleaved --windows 512 --seqs 128 256 512 1024 2048 --repeats 6

``--model llama`` runs a CPU-sized Llama (``LLAMA``: hidden 512, 6 full-attention layers, 8 query
heads / 4 KV heads of head_dim 64); ``--documents SHORTEST LONGEST`` packs each row with
documents of random lengths in that range (seeded; the last one what remains), as TRL's
``padding_free=True`` passes them. The window is not read. A packed training step against
plain inductor on the same model and batch, one process:

    python benchmarks/bench_model.py --model llama --documents 512 2048 --interleaved --windows 0 --seqs 8192

``--model gpt-oss`` runs a CPU-sized GPT-OSS instead (``GPT_OSS``: hidden 512, 4 layers alternating
sliding window w and full attention, 16 query heads / 2 KV heads of head_dim 64, attention sinks,
4 experts, 2 a token). transformers has no SDPA path for it, so both variants compile its eager
attention, spelled out in ops; compile_pass reads each layer's chain back as the op with sinks.
Its attention cannot be told apart inside inductor's fused kernels, so no split is printed.

    python benchmarks/bench_model.py --model gpt-oss --interleaved --windows 128 --seqs 2048 4096

``--model gemma2`` runs a CPU-sized Gemma-2 (``GEMMA2``: hidden 512, 2 layers, one sliding with
window w and one global, 4 query heads / 2 KV heads of head_dim 128, scores soft-capped at 50 and
logits at 30 as released). transformers has no SDPA path for it ("sdpa does not support
softcapping"), so plain inductor compiles its eager attention, the tanh chain spelled out in ops;
compile_pass reads each layer's chain back as the op with its softcap. Gemma-2's own window is
4096: at S = 4096 its sliding layer is causal as the global one, at 8192 it skips a quarter.

    python benchmarks/bench_model.py --model gemma2 --interleaved --windows 4096 --seqs 4096 8192

With ``--padded`` its second row is padded (3/4 of the first's length), which leaves the chain
padded rows: the op computes each row that sees no key as the chain does (``keyless_mean``).

``--model modernbert`` runs a CPU-sized ModernBERT (``MODERNBERT``: hidden 512, 6 layers, 8 heads of
64, no GQA), bidirectional: its local layers attend through a two-sided window of w keys (w / 2 each
side), every third layer globally; a step is its masked-LM loss over every token. The window is
``local_attention``.

    python benchmarks/bench_model.py --model modernbert --interleaved --windows 512 --seqs 2048 4096 8192

``--cpu-time`` times each step by the process's CPU time on one thread instead of wall time: on a
machine others load, wall time of the op's many smaller calls suffers from every wait for a
core, and CPU time is what the step costs.
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

# The package next to this script, not whichever checkout an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from measure import processor  # noqa: E402

CONFIG = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    global_head_dim=128,
    sliding_window=512,
    hidden_size_per_layer_input=64,
    vocab_size_per_layer_input=4096,
    max_position_embeddings=32768,
    attn_implementation="sdpa",
)
# GPT-OSS's attention shape (head_dim 64, 8 query heads per KV head, sinks, sliding and full
# layers alternating) at a CPU-sized width.
GPT_OSS = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=64,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=32768,
    attn_implementation="eager",
)
# A Llama-shaped model at a CPU-sized width: every layer full attention.
LLAMA = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=32768,
    attn_implementation="sdpa",
)
# Gemma-2's attention (soft-capped scores, a sliding layer then a global one, its window 4096)
# at a CPU-sized width, with few heads so that the chain's S x S scores fit at 8192.
GEMMA2 = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    query_pre_attn_scalar=128,
    sliding_window=4096,
    attn_logit_softcapping=50.0,
    final_logit_softcapping=30.0,
    max_position_embeddings=32768,
    attn_implementation="eager",
)
# A ModernBERT-shaped encoder (bidirectional: its local layers a two-sided window of w keys, w / 2
# each side; every third layer global) at a CPU-sized width, trained by its masked-LM loss.
MODERNBERT = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=8,
    local_attention=512,
    global_attn_every_n_layers=3,
    max_position_embeddings=32768,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    cls_token_id=1,
    sep_token_id=2,
    attn_implementation="sdpa",
)
CONFIGS = {"gemma4": CONFIG, "gpt-oss": GPT_OSS, "llama": LLAMA, "gemma2": GEMMA2, "modernbert": MODERNBERT}
MODEL_NAMES = {
    "gemma4": "Gemma-4",
    "gpt-oss": "GPT-OSS (16/2 heads of 64, sinks, 4 experts)",
    "llama": "Llama (8/4 heads of 64, full attention)",
    "gemma2": "Gemma-2 (4/2 heads of 128, scores soft-capped at 50)",
    "modernbert": "ModernBERT (8 heads of 64, bidirectional, local windows of w keys, every third layer global)",
}
VARIANTS = ["inductor", "compile_pass"]
SDPA_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)
SLIDING_OPS = (
    "compile_pass::sliding_window_attention_forward",
    "compile_pass::sliding_window_attention_backward",
    "compile_pass::mask_input_attention_forward",  # packed batches: the band behind a run-time check
    "compile_pass::mask_input_attention_backward",
    "compile_pass::position_facts",
)


def attention_split(profile) -> dict:
    """Seconds of a profiled step in sliding-layer and global-layer attention. SDPA's CPU
    kernels are told apart by the query's head_dim; the op's calls of that kernel run inside
    its own ops, which are counted instead."""
    sliding = global_ = 0.0
    for event in profile.events():
        inside_op = any(parent.name in SLIDING_OPS for parent in _parents(event))
        if event.name in SLIDING_OPS and not inside_op:
            sliding += event.cpu_time_total / 1e6
        elif event.name in SDPA_OPS and not inside_op:
            query = event.input_shapes[0 if event.name.endswith("cpu") else 1]
            if query[-1] == CONFIG["global_head_dim"]:
                global_ += event.cpu_time_total / 1e6
            else:
                sliding += event.cpu_time_total / 1e6
    return {"sliding": sliding, "global": global_}


def _parents(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _model(family: str, window: int):
    """The seeded model of ``--model``, in training mode."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**LLAMA)).train()
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        return Gemma2ForCausalLM(Gemma2Config(**{**GEMMA2, "sliding_window": window})).train()
    if family == "modernbert":
        from transformers import ModernBertConfig, ModernBertForMaskedLM

        return ModernBertForMaskedLM(ModernBertConfig(**{**MODERNBERT, "local_attention": window})).train()
    if family == "gpt-oss":
        model = GptOssForCausalLM(GptOssConfig(**{**GPT_OSS, "sliding_window": window}))
        with torch.no_grad():  # sinks start at 0 in a fresh model; trained ones are not
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
        return model.train()
    return Gemma4ForCausalLM(Gemma4TextConfig(**{**CONFIG, "sliding_window": window})).train()


def _compiled_model(variant: str, window: int, qlora: bool = False, family: str = "gemma4"):
    """The seeded model compiled by one variant, and the list compile_pass's rewrite times go to."""
    import torch

    import compile_pass.backend  # noqa: F401  (the module; the package exports the function)

    entry_points = sys.modules["compile_pass.backend"]
    rewrite_seconds = []
    if variant == "compile_pass":
        rewrite = entry_points.rewrite

        def timed_rewrite(gm, **switches):
            start = time.perf_counter()
            report = rewrite(gm, **switches)
            rewrite_seconds.append(time.perf_counter() - start)
            return report

        entry_points.rewrite = timed_rewrite  # backend() looks rewrite up at call time
        backend = entry_points.backend
    else:
        backend = "inductor"

    model = _model(family, window)
    if qlora:
        model = _quantized_lora(model)
    return model, torch.compile(model, backend=backend, fullgraph=True), rewrite_seconds


def _quantized_lora(model):
    """``model`` saved and loaded back with 4-bit nf4 weights, LoRA on its attention projections."""
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    four_bit = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=four_bit, dtype=torch.float32)
    torch.manual_seed(1)
    lora = LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
    return get_peft_model(quantized, lora).train()


def document_lengths(seq: int, shortest: int, longest: int) -> list[int]:
    """Lengths of documents drawn uniformly from [shortest, longest] (seeded by ``seq``) that fill
    a row of ``seq`` tokens, the last one what remains."""
    import random

    draw = random.Random(seq)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(min(draw.randint(shortest, longest), seq - sum(lengths)))
    return lengths


def _step_of(
    model,
    compiled,
    seq: int,
    autocast: bool,
    packed: int,
    padded: bool,
    vocab: int = CONFIG["vocab_size"],
    document_range: tuple[int, int] | None = None,
    clock=time.perf_counter,
    evaluating: bool = False,
):
    """One training step at length seq as a function returning its seconds (same tokens for
    every variant); with ``evaluating``, the loss's forward alone under ``torch.no_grad``."""
    import torch

    ids = torch.randint(0, vocab, (2 if padded else 1, seq), generator=torch.Generator().manual_seed(seq))
    lengths = document_lengths(seq, *document_range) if document_range else [seq // packed] * packed
    if len(lengths) > 1:
        documents = {"position_ids": torch.cat([torch.arange(length) for length in lengths])[None]}
    else:
        documents = {}
    if padded:  # the second sequence 3/4 as long, padded on the right
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, 3 * seq // 4 :] = 0
        documents["attention_mask"] = mask

    def step():
        model.zero_grad(set_to_none=True)
        start = clock()
        # As TrainingArguments(bf16=True) runs it: the forward under autocast, fp32 weights.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(not evaluating):
            loss = compiled(input_ids=ids, labels=ids, use_cache=False, **documents).loss
        if not evaluating:
            loss.backward()
        return clock() - start

    return step


def _profiled_split(step) -> dict:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        profiled = step()
    split = attention_split(profile)
    split["rest"] = profiled - split["sliding"] - split["global"]
    return split


def run_child(
    variants: list[str],
    window: int,
    seqs: list[int],
    repeats: int,
    autocast=False,
    packed=1,
    padded=False,
    qlora=False,
    family="gemma4",
    documents=None,
    cpu_time=False,
    evaluating=False,
) -> dict:
    """Each variant's steps at each length. With two variants (``--interleaved``) both models live
    in this process and their timed steps alternate, the order flipped every repeat, so that
    drift in the process and on the machine meets both alike."""
    import torch

    import compile_pass

    clock = time.perf_counter
    if cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    # Every variant and length is a cache entry of the same code: keep them all compiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(variants) * len(seqs))
    built = {variant: _compiled_model(variant, window, qlora, family) for variant in variants}
    for model, _, _ in built.values():
        model.train(not evaluating)
    results = {variant: {"by_seq": {}, "rewrite": built[variant][2]} for variant in variants}
    with compile_pass.decisions() as report:  # every rewrite in this process
        for seq in seqs:
            steps = {
                variant: _step_of(
                    model,
                    compiled,
                    seq,
                    autocast,
                    packed,
                    padded,
                    CONFIGS[family]["vocab_size"],
                    documents,
                    clock,
                    evaluating,
                )
                for variant, (model, compiled, _) in built.items()
            }
            first = {variant: step() for variant, step in steps.items()}
            times = {variant: [] for variant in variants}
            for repeat in range(repeats):
                for variant in variants if repeat % 2 == 0 else variants[::-1]:
                    times[variant].append(steps[variant]())
            for variant, step in steps.items():
                median = statistics.median(times[variant])
                results[variant]["by_seq"][seq] = {
                    "step": median,
                    "compile": first[variant] - median,
                    "split": _profiled_split(step) if family == "gemma4" else None,
                    "load": os.getloadavg()[0],
                }
    for variant in variants:
        results[variant]["decisions"] = sorted({d.verdict for d in report}) if variant == "compile_pass" else []
    return results


def _documents_line(args) -> str:
    if not args.documents:
        return ""
    rows = "; ".join(f"S={seq}: {document_lengths(seq, *args.documents)}" for seq in args.seqs)
    return f"packed documents of {args.documents[0]}-{args.documents[1]} tokens ({rows}), "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--windows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", help="write the step speedup against S as a PNG (one window; needs matplotlib)")
    parser.add_argument("--autocast", action="store_true", help="fp32 weights, forward under bf16 autocast")
    parser.add_argument("--packed", type=int, default=1, help="documents packed into each row (padding-free)")
    parser.add_argument(
        "--documents",
        type=int,
        nargs=2,
        metavar=("SHORTEST", "LONGEST"),
        help="pack each row with documents of random lengths in [SHORTEST, LONGEST] instead (padding-free)",
    )
    parser.add_argument("--padded", action="store_true", help="batches of two, the second padded on the right")
    parser.add_argument(
        "--qlora", action="store_true", help="4-bit nf4 weights (bitsandbytes) and LoRA on the attention"
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="both variants in one process, their steps alternating (the ratio without the spread between processes)",
    )
    parser.add_argument("--model", choices=list(CONFIGS), default="gemma4", help="the model trained (see above)")
    parser.add_argument("--cpu-time", action="store_true", help="time steps by CPU time on one thread (see above)")
    parser.add_argument("--eval", action="store_true", help="an evaluation step: the forward under torch.no_grad")
    parser.add_argument("--child", nargs="+", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(
                run_child(
                    args.child,
                    args.windows[0],
                    args.seqs,
                    args.repeats,
                    args.autocast,
                    args.packed,
                    args.padded,
                    args.qlora,
                    args.model,
                    args.documents,
                    args.cpu_time,
                    args.eval,
                )
            )
        )
        return

    import torch

    import compile_pass

    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    load = os.getloadavg()
    print(
        f"# {processor()}, {os.cpu_count()} cores, torch {torch.__version__}; {MODEL_NAMES[args.model]} "
        f"{CONFIGS[args.model]['num_hidden_layers']} layers, hidden {CONFIGS[args.model]['hidden_size']}, "
        f"{'fp32 weights under bf16 autocast' if args.autocast else 'fp32'}, "
        f"{'batch 2, the second row padded to 3/4' if args.padded else 'batch 1'}, "
        f"{'4-bit nf4 weights with LoRA r=16 on q/k/v/o (QLoRA), ' if args.qlora else ''}"
        f"{f'{args.packed} packed documents a row, ' if args.packed > 1 else ''}"
        f"{_documents_line(args)}"
        f"{'the forward under no_grad (an eval step)' if args.eval else 'fwd+bwd'}; median of "
        f"{args.repeats}{', both variants in one process, steps alternating' if args.interleaved else ''}"
        f"{', CPU time on one thread' if args.cpu_time else ''}; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start\n"
        f"# compile_pass from {Path(compile_pass.__file__).parent}",
        flush=True,
    )
    print(
        f"{'w':>4} {'S':>6} {'inductor s':>11} {'compile_pass s':>15} {'speedup':>8} "
        f"{'compile inductor s':>19} {'compile compile_pass s':>23} {'overhead':>9} {'load':>5}",
        flush=True,
    )
    all_results = {}
    for window in args.windows:
        results = {}
        for variants in [VARIANTS] if args.interleaved else [[variant] for variant in VARIANTS]:
            cmd = [sys.executable, __file__, "--child", *variants, "--repeats", str(args.repeats)]
            cmd += ["--autocast"] if args.autocast else []
            cmd += (
                ["--packed", str(args.packed)]
                + (["--padded"] if args.padded else [])
                + (["--qlora"] if args.qlora else [])
                + (["--documents", *map(str, args.documents)] if args.documents else [])
            )
            cmd += ["--windows", str(window), "--seqs", *map(str, args.seqs), "--model", args.model]
            cmd += ["--cpu-time"] if args.cpu_time else []
            cmd += ["--eval"] if args.eval else []
            done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            results.update(json.loads(done.stdout.strip().splitlines()[-1]))
        all_results[window] = results
        base, ours = results["inductor"]["by_seq"], results["compile_pass"]["by_seq"]
        for seq in args.seqs:
            b, o = base[str(seq)], ours[str(seq)]
            print(
                f"{window:4d} {seq:6d} {b['step']:11.2f} {o['step']:15.2f} {b['step'] / o['step']:7.2f}x "
                f"{b['compile']:19.1f} {o['compile']:23.1f} {100 * (o['compile'] / b['compile'] - 1):+8.1f}% "
                f"{max(b['load'], o['load']):5.2f}",
                flush=True,
            )
        if len(args.seqs) > 1:
            total_base, total_ours = (sum(steps[str(seq)]["step"] for seq in args.seqs) for steps in (base, ours))
            print(
                f"{window:4d} {'all':>6} {total_base:11.2f} {total_ours:15.2f} {total_base / total_ours:7.2f}x",
                flush=True,
            )
    rewrites = [seconds for results in all_results.values() for seconds in results["compile_pass"]["rewrite"]]
    decisions = sorted(
        {verdict for results in all_results.values() for verdict in results["compile_pass"]["decisions"]}
    )
    print(f"# compile_pass's decisions: {'; '.join(decisions)}")
    print(f"# compile_pass rewrite: {len(rewrites)} graphs, {sum(rewrites):.3f} s in all")
    if args.model == "gemma4":  # the split needs SDPA's calls, which GPT-OSS's eager attention has none of
        print("# one profiled step, seconds: sliding layers' attention, the global layer's attention, the rest")
        print(f"{'w':>4} {'S':>6} {'variant':>13} {'step':>7} {'sliding attn':>13} {'global attn':>12} {'rest':>7}")
        for window, results in all_results.items():
            for seq in args.seqs:
                for variant in ("inductor", "compile_pass"):
                    split = results[variant]["by_seq"][str(seq)]["split"]
                    total = split["sliding"] + split["global"] + split["rest"]
                    print(
                        f"{window:4d} {seq:6d} {variant:>13} {total:7.2f} {split['sliding']:13.2f} "
                        f"{split['global']:12.2f} {split['rest']:7.2f}"
                    )
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at end")
    if args.plot:
        from measure import plot_speedups

        (window,) = args.windows
        base, ours = all_results[window]["inductor"]["by_seq"], all_results[window]["compile_pass"]["by_seq"]
        speedups = [base[str(s)]["step"] / ours[str(s)]["step"] for s in args.seqs]
        plot_speedups(
            args.plot,
            args.seqs,
            {"compile_pass vs inductor, training step (measured)": speedups},
            f"{MODEL_NAMES[args.model]} ({CONFIGS[args.model]['num_hidden_layers']} layers, window {window}), fp32, "
            "CPU",
        )


if __name__ == "__main__":
    main()
