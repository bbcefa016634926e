"""The README's supported-models table: every transformers family with sliding (or chunked)
layers, as a tiny random config (no downloads), compiled through the rules; its logits must
equal eager's. Prints the table as markdown; tests/test_recall_table.py checks that README.md's
table (between the ``supported-models`` markers) is what this prints, so it cannot drift.

    python benchmarks/families.py          # about a minute on 2 cores

The tiny models are short, so every length is rewritten here (COMPILE_PASS_SHORT_KEYS=0, as in
the tests); at real lengths the CPU keeps SDPA below a measured crossover (docs/performance.md).
"""

import os
import re
import sys
from typing import NamedTuple

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import transformers  # noqa: E402

from tests.models import Capture, token_batch  # noqa: E402

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)
TWO_KINDS = dict(layer_types=["sliding_attention", "full_attention"])
# family: (config class, model class, settings); window 8 everywhere.
FAMILIES = {
    "Gemma-2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=8, head_dim=16)),
    "Gemma-3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=8, head_dim=16, **TWO_KINDS)),
    "Gemma-4": (
        "Gemma4TextConfig", "Gemma4ForCausalLM",
        dict(sliding_window=8, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=16,
             vocab_size_per_layer_input=128, **TWO_KINDS),
    ),
    "Mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "Mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(sliding_window=8, use_sliding_window=True, **TWO_KINDS)),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(sliding_window=8, use_sliding_window=True, head_dim=16, **TWO_KINDS)),
    "Cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=8, **TWO_KINDS)),
    "Phi-3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=8, pad_token_id=0)),
    "GPT-OSS": (
        "GptOssConfig", "GptOssForCausalLM",
        dict(sliding_window=8, head_dim=16, num_local_experts=4, num_experts_per_tok=2, **TWO_KINDS),
    ),
    "Llama-4 (chunked)": (
        "Llama4TextConfig", "Llama4ForCausalLM",
        dict(attention_chunk_size=8, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
             intermediate_size_mlp=128, no_rope_layers=[1, 0], moe_layers=[1]),
    ),
}
# Measured on a GPU: a fact of benchmarks/RESULTS.md, not of this run (gpu_check.py times Gemma-4 only).
MEASURED_ON_GPU = {"Gemma-4": "H200, 2026-11-26: one sliding layer and a 6-layer step"}
# What kernels.md's policy picks on a GPU; not run here (this machine may have none).
GPU_KERNELS = (
    "On a GPU the sliding layers run torch's own FA2 (sm80 or newer, fp16/bf16, head_dim <= 256) and "
    "keep SDPA elsewhere; the `w - 1` is the config's window less one, `#` a number of the config."
)
NO_SDPA_PATH = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
MARKERS = ("<!-- supported-models -->", "<!-- /supported-models -->")


def family_model(family: str):
    """(config, the family's causal LM with random weights, in eval mode): on SDPA, or with eager
    attention (spelled out in ops) where transformers has no SDPA path for the family."""
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **settings)
    implementation = "sdpa" if has_sdpa_path(family) else "eager"
    return config, getattr(transformers, model_class)._from_config(config, attn_implementation=implementation).eval()


def has_sdpa_path(family: str) -> bool:
    config_class, model_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **settings)
    try:
        getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa")
    except ValueError as error:
        if NO_SDPA_PATH in str(error):
            return False
        raise
    return True


class FamilyResult(NamedTuple):
    """What the rules did to one family's layers: per layer kind, its decisions (numbers written
    as #, the window as (w - 1, 0)) and the kernels the rewritten calls run."""

    sliding: str
    full: str
    kernels: str


def family_result(family: str) -> FamilyResult:
    config, model = family_model(family)
    torch._dynamo.reset()
    capture = Capture()
    ids = token_batch(32)
    with torch.no_grad():
        logits = torch.compile(model, backend=capture, fullgraph=True)(input_ids=ids, use_cache=False).logits
        reference = model(input_ids=ids, use_cache=False).logits
    assert (logits - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item()), family
    # One SDPA call per layer, in layer order; top-k router decisions are not attention layers.
    attention = [d for d in capture.report if d.rule != "topk_mask"]
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * len(attention)
    by_kind, kernels = {}, {}
    for kind, decision in zip(kinds, attention):
        verdict = decision.verdict.replace("window (-1, 0)", "window (causal)")  # no number of the config
        by_kind.setdefault(kind, set()).add(re.sub(r"\b\d+\b", "#", verdict).replace("(#, #)", "(w - 1, 0)"))
        if decision.rewritten:  # the kernel's name, before its description; the causal rule keeps SDPA's own kernel
            kind = "full" if kind == "full_attention" else "sliding"
            kernels.setdefault(kind, set()).add(decision.kernel.split(",")[0] if decision.kernel else "SDPA")
    sliding = "; ".join(sorted(by_kind.get("sliding_attention", by_kind.get("chunked_attention", {"—"}))))
    full = "; ".join(sorted(by_kind.get("full_attention", {"—"})))
    return FamilyResult(sliding, full, "; ".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in sorted(kernels.items(), reverse=True)))


def family_name(family: str) -> str:
    """The family as the tables name it: with how it attends where that is not SDPA."""
    return family if has_sdpa_path(family) else f"{family} (eager attention: transformers has no SDPA path for it)"


def recall_row(family: str, result: FamilyResult) -> str:
    """A row of docs/rewritten.md's table of what the rules do to each family."""
    return f"| {family_name(family)} | {result.sliding} | {result.full} |"


def supported_models_table(results: dict[str, FamilyResult]) -> str:
    """README.md's table: each family, which layers are rewritten and how, on which kernel (on the
    CPU, where this runs), and whether it was measured on a GPU."""
    rows = ["| family | sliding (or chunked) layers | full-attention layers | kernel on the CPU | measured on a GPU |",
            "| --- | --- | --- | --- | --- |"]
    for family, result in results.items():
        rows.append(
            f"| {family_name(family)} | {result.sliding} | {result.full} | {result.kernels or '—'} | "
            f"{MEASURED_ON_GPU.get(family, 'no')} |"
        )
    return "\n".join([*rows, "", GPU_KERNELS])


def all_results() -> dict[str, FamilyResult]:
    return {family: family_result(family) for family in FAMILIES}


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(supported_models_table(all_results()))
