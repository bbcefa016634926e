"""Packed training through TRL's SFTTrainer: Llama, Qwen3, Mistral and Gemma-4 as tiny random
configs (no downloads; Llama and Mistral full attention only, Qwen3 and Gemma-4 sliding and
full layers), ``packing=True`` and ``padding_free=True``, the model compiled in
place with the rules (the rewritten graph run as it is, no inductor). For each: what the rules
do to every attention layer, and one SGD step's loss and every gradient against eager fp32 and
eager fp64.

Rows of 140 to 300 tokens: ``packing=True`` packs them into rows of at most 512 tokens (TRL's
best-fit decreasing), ``padding_free=True`` flattens each batch into one row; both pass
``position_ids`` that restart at each document and no attention mask (``use_cache=False``),
which transformers turns into a block-diagonal mask in every layer. One step of plain SGD at
learning rate 1 without gradient clipping: each parameter moves by exactly minus its
gradient, so the update is compared. Errors are the worst over the loss and every parameter,
max |a - b| / max(1, max |reference|).

The models are short, so every length is rewritten here (COMPILE_PASS_SHORT_KEYS=0, as in the
tests); at real lengths the CPU keeps SDPA below each kernel's measured crossover.

    python benchmarks/packed_training.py            # prints the table
    python benchmarks/packed_training.py --write    # and writes it into docs/training.md

tests/integrations/test_packed_training_table.py (slow) checks the page holds what a run prints.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

import compile_pass  # noqa: E402
from benchmarks import families  # noqa: E402
from tests.helpers.models import side_effects_once, token_batch  # noqa: E402

PAGE = ROOT / "docs" / "training.md"
MARKERS = ("<!-- packed-training-table -->", "<!-- /packed-training-table -->")
# Pre-tokenized rows of several lengths, longer than the document kernel groups together
# (``documents.GROUP_TOKENS``), so that each document is one call of its own.
ROWS = [
    row[:length].tolist()
    for row, length in zip(token_batch(300, batch=5, seed=3), (140, 150, 200, 260, 300), strict=True)
]
SETUPS = {"packing": {"packing": True, "max_length": 512}, "padding-free": {"padding_free": True}}
MODELS = ("Llama", "Qwen3", "Mistral", "Gemma-4")


# Full attention only: Llama, and Mistral as its releases since v0.2 configure it (no window).
FULL_ONLY = {"Llama": ("LlamaConfig", "LlamaForCausalLM"), "Mistral": ("MistralConfig", "MistralForCausalLM")}


def model(name: str, dtype: torch.dtype = torch.float32):
    """The tiny model: Llama and Mistral (full attention only) from the families' common sizes;
    Qwen3 and Gemma-4 (sliding and full layers) as benchmarks/families.py builds them."""
    if name in FULL_ONLY:
        config_class, model_class = FULL_ONLY[name]
        config = getattr(transformers, config_class)(**families.COMMON, sliding_window=None)
        torch.manual_seed(0)
        built = getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa")
    else:
        _, built = families.family_model(name)
    return built.to(dtype)


def tokenizer():
    """A word-level tokenizer over the tiny models' 128 ids, built here (no downloads)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
        bos_token="t3",
    )


class Rewrite:
    """A torch.compile backend: the rules' rewrite, the graph run as it is; the reports kept."""

    def __init__(self):
        self.reports = []

    def __call__(self, gm, example_inputs):
        self.reports.append(compile_pass.rewrite(gm))
        return gm.forward


def sft_step(built, setup: str, folder: str, **config) -> tuple[float, dict[str, torch.Tensor]]:
    """One SFTTrainer step: (its loss, each parameter's gradient in fp64, read off the update);
    ``config``: more SFTConfig arguments."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    before = {name: p.detach().double().clone() for name, p in built.named_parameters()}
    arguments = SFTConfig(
        output_dir=folder,
        per_device_train_batch_size=2,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: the update is minus the gradient
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        **{"max_length": None, **SETUPS[setup], **config},
    )
    rows = Dataset.from_list([{"input_ids": row} for row in ROWS])
    trainer = SFTTrainer(model=built, args=arguments, train_dataset=rows, processing_class=tokenizer())
    with side_effects_once():  # TRL checkpoints every layer; Gemma-4's forward writes Python state
        loss = trainer.train().training_loss
    return loss, {
        name.removeprefix("_orig_mod."): before[name] - p.detach().double() for name, p in built.named_parameters()
    }


def _scaled_error(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).abs().max() / max(1.0, expected.abs().max().item())).item()


def worst_error(ours, reference) -> float:
    (loss, grads), (ref_loss, ref_grads) = ours, reference
    assert grads.keys() == ref_grads.keys()
    return max(_scaled_error(loss, ref_loss), *(_scaled_error(grads[name], ref_grads[name]) for name in grads))


def run(name: str, setup: str) -> dict:
    """One row: the layers' decisions, the kernels, and the errors against eager fp32 and fp64."""
    torch._dynamo.reset()
    compiled = model(name)
    backend = Rewrite()
    compiled.compile(backend=backend)
    with tempfile.TemporaryDirectory() as folder:
        ours = sft_step(compiled, setup, folder)
        eager = sft_step(model(name), setup, folder)
        fp64 = sft_step(model(name, torch.float64), setup, folder)
    torch._dynamo.reset()
    calls = [d for report in backend.reports for d in report if d.kind == "attention call"]
    # A checkpointed layer's forward is traced once per graph: count each layer once.
    layers = {}
    for decision in calls:
        layers.setdefault(decision.module, decision)
    return {
        "layers": len(layers),
        "rewritten": sum(d.rewritten for d in layers.values()),
        "windows": sorted({re.match(r"window \([^)]*\)", d.reason).group(0) for d in layers.values() if d.rewritten}),
        "kernels": sorted({d.kernel.split(",")[0].split(":")[0] for d in layers.values() if d.rewritten}),
        "kept": sorted({d.verdict for d in layers.values() if not d.rewritten}),
        "eager": worst_error(ours, eager),
        "fp64": worst_error(ours, fp64),
        "eager_fp64": worst_error(eager, fp64),
    }


def _error(value: float) -> str:
    return "0" if value == 0 else f"{value:.0e}"


def table(results: dict[tuple[str, str], dict]) -> str:
    rows = [
        "| model | setup | attention layers on the op | windows | kernels | worst error vs eager | vs fp64 (eager's) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (name, setup), row in results.items():
        kept = f"; kept: {'; '.join(row['kept'])}" if row["kept"] else ""
        rows.append(
            f"| {name} | {setup} | {row['rewritten']} of {row['layers']}{kept} | {', '.join(row['windows'])} | "
            f"{', '.join(row['kernels'])} | {_error(row['eager'])} | "
            f"{_error(row['fp64'])} ({_error(row['eager_fp64'])}) |"
        )
    return "\n".join(rows)


def run_all() -> str:
    torch.set_num_threads(1)
    results = {}
    for name in MODELS:
        for setup in SETUPS:
            results[name, setup] = run(name, setup)
            print(f"{name} {setup}: {results[name, setup]}", file=sys.stderr, flush=True)
    return table(results)


def main(argv: list[str]) -> None:
    text = run_all()
    print(text)
    if "--write" in argv:
        families.replace_block(PAGE, MARKERS, text)


if __name__ == "__main__":
    main(sys.argv[1:])
