"""Which transformers families' attention layers the rules rewrite: every family compiles a
tiny random config (no downloads), its logits must equal eager's, and the table the decisions
make must be the README's (between the ``recall-table`` markers), so the README stays true.

On a mismatch the test prints the table to paste."""

import re
from pathlib import Path

import torch
import transformers

from tests.models import Capture, token_batch

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
README = Path(__file__).resolve().parent.parent / "README.md"
MARKERS = ("<!-- recall-table -->", "<!-- /recall-table -->")


def _model(family: str):
    """(config, the family's causal LM with random weights on SDPA, in eval mode)."""
    config_class, model_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**COMMON, **settings)
    return config, getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa").eval()


def _row(family: str) -> str:
    try:
        config, model = _model(family)
    except ValueError as error:
        if "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention" not in str(error):
            raise
        return f"| {family} | transformers has no SDPA path for it (it needs eager attention) | |"
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
    by_kind = {}
    for kind, decision in zip(kinds, attention):
        by_kind.setdefault(kind, set()).add(re.sub(r"\b\d+\b", "#", decision.verdict).replace("(#, #)", "(w - 1, 0)"))
    sliding = "; ".join(sorted(by_kind.get("sliding_attention", by_kind.get("chunked_attention", {"—"}))))
    full = "; ".join(sorted(by_kind.get("full_attention", {"—"})))
    return f"| {family} | {sliding} | {full} |"


def _assert_readme_table(markers: tuple[str, str], header: str, rows: list[str]) -> None:
    """The README's table between ``markers`` is ``header`` and ``rows``; else prints the table."""
    table = "\n".join([header, "| --- | --- | --- |", *rows])
    text = README.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    assert text[start:end].strip() == table, f"README's table is out of date; it should read:\n{table}"


def test_recall_table_is_the_readme_table():
    rows = [_row(family) for family in FAMILIES]
    _assert_readme_table(MARKERS, "| family | sliding (or chunked) layers | full-attention layers |", rows)


# -- training set-ups on Gemma-4 ---------------------------------------------------------------

SETUP_MARKERS = ("<!-- setup-table -->", "<!-- /setup-table -->")
LENGTH = 32


def _padding() -> torch.Tensor:
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    padding[0, :5] = 0
    padding[1, LENGTH - 7 :] = 0
    return padding


def _packed_positions() -> torch.Tensor:
    return torch.cat([torch.arange(12), torch.arange(LENGTH - 12)]).repeat(2, 1)


# set-up: (weights dtype, autocast dtype or None, extra inputs, logits tolerance relative to eager's scale)
SETUPS = {
    "fp32": (torch.float32, None, {}, 1e-4),
    "fp32 weights, bf16 autocast (`bf16=True`)": (torch.float32, torch.bfloat16, {}, 5e-2),
    "bf16 weights": (torch.bfloat16, None, {}, 5e-2),
    "padded batch (`attention_mask`)": (torch.float32, None, {"attention_mask": _padding()}, 1e-4),
    "packed sequences (`position_ids`, no mask)": (torch.float32, None, {"position_ids": _packed_positions()}, 1e-4),
    "padding-free (one flattened row, `DataCollatorWithFlattening`)": (
        torch.float32, None, {"position_ids": _packed_positions()[:1], "input_ids": token_batch(LENGTH, batch=1)}, 1e-4,
    ),
}


def _setup_row(setup: str) -> str:
    dtype, autocast, extra, tolerance = SETUPS[setup]
    config, model = _model("Gemma-4")
    model = model.to(dtype)
    torch._dynamo.reset()
    capture = Capture()
    inputs = {"input_ids": token_batch(LENGTH), "use_cache": False, **extra}
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = torch.compile(model, backend=capture, fullgraph=True)(**inputs).logits
        reference = model(**inputs).logits
    scale = max(1.0, reference.abs().max().item())
    assert (logits.double() - reference.double()).abs().max().item() <= tolerance * scale, setup
    window = config.sliding_window
    sliding, full = (
        re.sub(r" at \S+\.py:\d+$", "", decision.verdict.replace(f"({window - 1}, 0)", "(w - 1, 0)"))
        for decision in capture.report
    )
    return f"| {setup} | {sliding} | {full} |"


def test_setup_table_is_the_readme_table():
    rows = [_setup_row(setup) for setup in SETUPS]
    _assert_readme_table(SETUP_MARKERS, "| set-up (Gemma-4) | sliding layers | full-attention layers |", rows)
