"""Which transformers families' attention layers the rules rewrite: every family compiles a
tiny random config (no downloads), its logits must equal eager's, and the table the decisions
make must be the README's (between the ``recall-table`` markers), so the README stays true.

On a mismatch the test prints the table to paste."""

import copy
import re
from pathlib import Path

import torch
import transformers

from tests.models import CACHE, Capture, cache_of, token_batch

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


def _has_sdpa_path(family: str) -> bool:
    try:
        _model(family)
    except ValueError as error:
        if "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention" in str(error):
            return False
        raise
    return True


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
    _assert_readme_block(markers, "\n".join([header, "| --- | --- | --- |", *rows]))


def _assert_readme_block(markers: tuple[str, str], table: str) -> None:
    """The README's text between ``markers`` is ``table``; else prints what it should be."""
    text = README.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    assert text[start:end].strip() == table, f"README's table is out of date; it should read:\n{table}"


def test_recall_table_is_the_readme_table():
    rows = [_row(family) for family in FAMILIES]
    _assert_readme_table(MARKERS, "| family | sliding (or chunked) layers | full-attention layers |", rows)


# -- training set-ups against each family ------------------------------------------------------

SETUP_MARKERS = ("<!-- setup-table -->", "<!-- /setup-table -->")
LENGTH = 32
IMAGE_TOKEN = 120
# The multimodal classes whose sliding layers see image blocks, with the input naming them.
MULTIMODAL = {
    "Gemma-3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "token_type_ids",
                dict(boi_token_index=121, eoi_token_index=122)),
    "Gemma-4": ("Gemma4Config", "Gemma4ForConditionalGeneration", "mm_token_type_ids",
                dict(boi_token_id=121, eoi_token_id=122, video_token_id=123, audio_token_id=124, boa_token_id=125,
                     eoa_token_index=126, audio_config=None)),
}


def _padding() -> torch.Tensor:
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    padding[0, :5] = 0
    padding[1, LENGTH - 7 :] = 0
    return padding


def _packed_positions() -> torch.Tensor:
    return torch.cat([torch.arange(12), torch.arange(LENGTH - 12)]).repeat(2, 1)


def _image_model(family: str):
    """(the family's multimodal model without a vision tower, inputs with a 10-token image), or
    None for a text-only family: image tokens get the pad embedding, the mask its image block."""
    if family not in MULTIMODAL:
        return None
    config_class, model_class, token_types, extra = MULTIMODAL[family]
    text = dict(COMMON, **FAMILIES[family][2])
    if family == "Gemma-4":
        text["use_bidirectional_attention"] = "vision"
    config = getattr(transformers, config_class)(text_config=text, vision_config=None, image_token_id=IMAGE_TOKEN, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)._from_config(config, attn_implementation="sdpa").eval()
    input_ids = token_batch(LENGTH) % 100
    input_ids[0, 4:14] = IMAGE_TOKEN
    return model, {"input_ids": input_ids, token_types: (input_ids == IMAGE_TOKEN).long()}


# set-up: (weights dtype, autocast dtype or None, extra inputs, logits tolerance relative to eager's scale)
SETUPS = {
    "fp32": (torch.float32, None, {}, 1e-4),
    "bf16 autocast": (torch.float32, torch.bfloat16, {}, 5e-2),
    "bf16 weights": (torch.bfloat16, None, {}, 5e-2),
    "padded": (torch.float32, None, {"attention_mask": _padding()}, 1e-4),
    "packed": (torch.float32, None, {"position_ids": _packed_positions()}, 1e-4),
    "padding-free": (torch.float32, None, {"position_ids": _packed_positions()[:1], "input_ids": token_batch(LENGTH, batch=1)}, 1e-4),
    "images": (torch.float32, None, {}, 1e-4),
    "decode": (torch.float32, None, {}, 1e-4),
}
SETUP_NOTES = {
    "fp32": "fp32 weights, a batch of 2 rows without padding",
    "bf16 autocast": "fp32 weights under `torch.autocast(\"cpu\", torch.bfloat16)`, as `TrainingArguments(bf16=True)` runs them",
    "padded": "`attention_mask` with left and right padding",
    "packed": "two rows of two sequences each, `position_ids` restarting per sequence and no mask (TRL `packing=True`)",
    "padding-free": "one flattened row (`DataCollatorWithFlattening`, TRL `padding_free=True`)",
    "images": "a 10-token image in the batch, the multimodal class of the family (Gemma-3 and Gemma-4 only)",
    "decode": "one `generate()` step of a left-padded batch of 2 with a `DynamicCache`, compiled",
}


def _decode_step(model, dtype):
    """Prefill eagerly, then one token for each row of a left-padded batch, as generate() does."""
    input_ids = token_batch(LENGTH)
    attention_mask = torch.ones(2, LENGTH + 1, dtype=torch.long)
    attention_mask[0, :5] = 0
    cache = cache_of(model(input_ids=input_ids, attention_mask=attention_mask[:, :-1], use_cache=True))
    return {"input_ids": input_ids[:, -1:], "attention_mask": attention_mask, CACHE: cache, "use_cache": True}


def _sliding_verdicts(family: str, setup: str) -> set[str] | None:
    """The verdicts of the family's sliding (or chunked) layers in the set-up, None where the
    set-up does not apply; the logits must equal eager's."""
    dtype, autocast, extra, tolerance = SETUPS[setup]
    if setup == "images":
        built = _image_model(family)
        if built is None:
            return None
        model, inputs = built
        config = model.config.get_text_config()
    else:
        config, model = _model(family)
        model = model.to(dtype)
        inputs = {"input_ids": token_batch(LENGTH), "use_cache": False, **extra}
    torch._dynamo.reset()
    capture = Capture()
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if setup == "decode":
            inputs = _decode_step(model, dtype)
            eager_inputs = dict(inputs, **{CACHE: copy.deepcopy(inputs[CACHE])})
        else:
            eager_inputs = inputs
        logits = torch.compile(model, backend=capture)(**inputs).logits
        reference = model(**eager_inputs).logits
    scale = max(1.0, reference.abs().max().item())
    assert (logits.double() - reference.double()).abs().max().item() <= tolerance * scale, (family, setup)
    attention = [d for report in capture.reports for d in report if d.rule != "topk_mask"]
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * len(attention)
    sliding = {kind for kind in kinds if kind != "full_attention"}
    return {
        re.sub(r" at \S+\.py:\d+$", "", decision.verdict)
        for kind, decision in zip(kinds, attention)
        if kind in sliding
    }


def _cell(verdicts: set[str] | None, reasons: list[str]) -> str:
    """"rewritten", "—" (does not apply), or "kept [n]" with n the reason's number."""
    if verdicts is None:
        return "—"
    if all(verdict.startswith("rewritten") for verdict in verdicts):
        return "rewritten"
    numbers = []
    for verdict in sorted(v for v in verdicts if not v.startswith("rewritten")):
        reason = re.sub(r"\b\d+\b", "#", verdict.removeprefix("kept: "))
        if reason not in reasons:
            reasons.append(reason)
        numbers.append(f"[{reasons.index(reason) + 1}]")
    return "kept " + " ".join(numbers)


def setup_table() -> str:
    """Every family in every set-up: its sliding layers' decisions, the reasons numbered below."""
    reasons: list[str] = []
    families = [family for family in FAMILIES if _has_sdpa_path(family)]
    rows = []
    for family in families:
        cells = [_cell(_sliding_verdicts(family, setup), reasons) for setup in SETUPS]
        rows.append(f"| {family} | " + " | ".join(cells) + " |")
    header = "| family | " + " | ".join(SETUPS) + " |\n| --- |" + " --- |" * len(SETUPS)
    notes = [f"- {setup}: {note}" for setup, note in SETUP_NOTES.items()]
    legend = [f"- [{number}] {reason}" for number, reason in enumerate(reasons, 1)]
    return "\n".join([header, *rows, "", *notes, "", "Kept, because:", "", *legend])


def test_setup_table_is_the_readme_table():
    _assert_readme_block(SETUP_MARKERS, setup_table())
