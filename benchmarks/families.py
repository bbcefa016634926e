"""Every decoder family in transformers whose config has a sliding window (or chunked
attention), as a tiny random config (no downloads, window w = 8): what the rules do to its
layers, and whether a training step through the rewritten graph is eager's.

Each family's causal LM is built on SDPA, or with eager attention where transformers gives it
no SDPA path, and compiled with the rules (the rewritten graph run as it is, no inductor).
Recorded per family: every attention call's decision, by the kind of its layer (sliding or
chunked, full attention; calls elsewhere apart), and a training step's loss and every
gradient against eager's, fp32, batch 2, unpadded and then right-padded (``attention_mask``),
as the worst error relative to each tensor's scale, max |a - b| / max(1, max |eager|).

    python benchmarks/families.py                   # every family; prints both tables (minutes)
    python benchmarks/families.py --write           # also records them (see below)
    python benchmarks/families.py Gemma-4 Mistral   # some families, printed only
    python benchmarks/families.py --pages           # the pages' tables from the record, not run

It prints (a) the table of every family (docs/rewritten.md, between the ``recall-table``
markers) and (b) README.md's supported-models table, families with one result in one row.
``--write`` stores the run in benchmarks/families.json, with the transformers release it ran
on, and writes both tables into the two pages. tests/integrations/test_recall_table.py keeps them true:
the pages' tables must be what the record makes, a few families run live in the default
suite must give what the record holds, and the slow suite runs every family against it. A
transformers release that brings a new family with a sliding window fails the suite until the
family is in FAMILIES or in EXCLUDED.

Excluded (EXCLUDED, by transformers' model directory): encoders, encoder-decoders and
speech, audio, protein or OCR models (no causal LM people fine-tune for text); multimodal
models whose text model has no causal-LM class of its own (trained with their images, through
the multimodal class); configs whose window the modeling code never reads; and models that
are no decoder LM trained by next-token loss (block diffusion).

The tiny models are short, so every length is rewritten here (COMPILE_PASS_SHORT_KEYS=0 and
COMPILE_PASS_MEASURE=static, as in the tests: nothing is timed); at real lengths the CPU keeps
SDPA below a measured crossover (docs/performance.md).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402

from tests.helpers.models import TOLERANCE, Capture, token_batch  # noqa: E402

WINDOW = 8
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TWO_KINDS = dict(layer_types=["sliding_attention", "full_attention"])
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


class Family(NamedTuple):
    """A family's config and causal-LM classes (by name in transformers) and its tiny
    settings. ``sliding``: its layer types that slide where the name does not say (a type
    named ``*sliding*`` or ``*chunked*`` slides, any other is full attention; a config without
    layer types slides on every layer but those under ``full_modules``)."""

    config: str
    model: str
    settings: dict
    sliding: tuple[str, ...] = ()
    full_modules: tuple[str, ...] = ()  # modules whose layers attend fully, where the config has no layer types


FAMILIES = {
    "Gemma-2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "Gemma-3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **TWO_KINDS)),
    "Gemma-4": Family(
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            global_head_dim=32,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
            **TWO_KINDS,
        ),
    ),
    "Mistral": Family("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "Mixtral": Family(
        "MixtralConfig", "MixtralForCausalLM", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    ),
    "Qwen2": Family(
        "Qwen2Config", "Qwen2ForCausalLM", dict(sliding_window=WINDOW, use_sliding_window=True, **TWO_KINDS)
    ),
    "Qwen3": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(sliding_window=WINDOW, use_sliding_window=True, head_dim=16, **TWO_KINDS),
    ),
    "Cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", dict(sliding_window=WINDOW, **TWO_KINDS)),
    "Phi-3": Family("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0)),
    "GPT-OSS": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, num_local_experts=4, num_experts_per_tok=2, **TWO_KINDS),
    ),
    "Llama-4 (chunked)": Family(
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            attention_chunk_size=WINDOW,
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            no_rope_layers=[1, 0],
            moe_layers=[1],
        ),
    ),
    # Every other family with a window, by transformers' model directory.
    "AFMoE": Family(
        "AfmoeConfig", "AfmoeForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **EXPERTS, **TWO_KINDS)
    ),
    "Beam": Family(
        "BeamConfig",
        "BeamForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, n_group=2, topk_group=1, **EXPERTS, **TWO_KINDS),
    ),
    "BLT": Family(
        "BltConfig",
        "BltForCausalLM",
        dict(
            vocab_size=260,
            max_position_embeddings=256,
            local_attention_window_len=WINDOW,
            patch_in_forward=False,
            encoder_hash_byte_group_vocab=128,
            encoder_hash_byte_group_size=[3, 4],
            patcher_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
            encoder_config=dict(
                hidden_size=32, hidden_size_global=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
            decoder_config=dict(
                hidden_size=32, hidden_size_global=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            ),
            global_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128),
        ),
        full_modules=("global_transformer",),
    ),
    "Cohere2-MoE": Family(
        "Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **EXPERTS, **TWO_KINDS)
    ),
    "Cohere-Compass": Family(
        "CohereCompassTextConfig",
        "CohereCompassForCausalLM",
        dict(
            sliding_window=WINDOW,
            **TWO_KINDS,
            rope_parameters={kind: dict(rope_type="default", rope_theta=10000.0) for kind in TWO_KINDS["layer_types"]},
        ),
    ),
    "CWM": Family("CwmConfig", "CwmForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **TWO_KINDS)),
    "DeepSeek-V4": Family(
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            index_head_dim=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        ),
        sliding=("heavily_compressed_attention", "compressed_sparse_attention"),
    ),
    "Doge": Family("DogeConfig", "DogeForCausalLM", dict(sliding_window=WINDOW, keep_window_size=WINDOW)),
    "Dory": Family("DoryConfig", "DoryForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **TWO_KINDS)),
    "dots.llm1": Family(
        "Dots1Config",
        "Dots1ForCausalLM",
        dict(
            sliding_window=WINDOW,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            **TWO_KINDS,
        ),
    ),
    "Dots3-Note": Family(
        "Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        dict(
            sliding_window=WINDOW,
            num_key_value_heads=4,
            pad_token_id=0,
            head_dim=16,
            index_head_dim=16,
            index_n_heads=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_experts_intermediate_size=32,
            n_group=1,
            topk_group=1,
            layer_types=["sliding_attention", "indexed_attention"],
        ),
    ),
    "EXAONE-4": Family("Exaone4Config", "Exaone4ForCausalLM", dict(sliding_window=WINDOW, **TWO_KINDS)),
    "EXAONE-MoE": Family(
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(sliding_window=WINDOW, n_group=1, topk_group=1, first_k_dense_replace=0, **EXPERTS, **TWO_KINDS),
    ),
    "Flint": Family(
        "FlintConfig",
        "FlintForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, shared_expert_intermediate_size=32, **EXPERTS, **TWO_KINDS),
    ),
    "Gemma-3n": Family(
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=128,
            laurel_rank=8,
            **TWO_KINDS,
        ),
    ),
    "Gemma-4-unified": Family(
        "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **TWO_KINDS)
    ),
    "Granite-SWA": Family("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(sliding_window=WINDOW, **TWO_KINDS)),
    "GraniteMoE-SWA": Family(
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        dict(
            sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32, **TWO_KINDS
        ),
    ),
    "Inkling": Family(
        "InklingTextConfig",
        "InklingForCausalLM",
        dict(
            sliding_window_size=WINDOW,
            head_dim=16,
            swa_head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            layer_types=["hybrid_sliding", "hybrid"],
        ),
    ),
    "Inkling2": Family(
        "Inkling2TextConfig",
        "Inkling2ForCausalLM",
        dict(
            sliding_window_size=WINDOW,
            head_dim=16,
            swa_head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            unpadded_vocab_size=128,
            layer_types=["hybrid_sliding", "hybrid"],
        ),
    ),
    "Inkling2-loop": Family(
        "Inkling2LoopTextConfig",
        "Inkling2LoopForCausalLM",
        dict(
            sliding_window_size=WINDOW,
            head_dim=16,
            swa_head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            unpadded_vocab_size=128,
            layer_types=["hybrid_sliding", "hybrid"],
        ),
    ),
    "Kolibri1": Family(
        "Kolibri1Config",
        "Kolibri1ForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, shared_expert_intermediate_size=32, **EXPERTS, **TWO_KINDS),
    ),
    "Laguna": Family(
        "LagunaConfig",
        "LagunaForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, shared_expert_intermediate_size=32, **EXPERTS, **TWO_KINDS),
    ),
    "Lara-mini": Family(
        "LaraMiniConfig",
        "LaraMiniForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            shared_expert_intermediate_size=32,
            **EXPERTS,
            layer_types=["linear_attention", "sliding_attention", "full_attention"],
            num_hidden_layers=3,
        ),
    ),
    "LFM3": Family(
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            pad_token_id=0,
            layer_types=["conv", "sliding_attention", "full_attention"],
            num_hidden_layers=3,
        ),
    ),
    "Mellum": Family(
        "MellumConfig", "MellumForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **EXPERTS, **TWO_KINDS)
    ),
    "MiMo-V2-Flash": Family(
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            **TWO_KINDS,
        ),
    ),
    # MiniMax slides on its attention layers (the others are linear attention) when given a window.
    "MiniMax": Family(
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
        ),
        sliding=("full_attention",),
    ),
    "Ministral": Family("MinistralConfig", "MinistralForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "Ministral-3": Family("Ministral3Config", "Ministral3ForCausalLM", dict(sliding_window=WINDOW, head_dim=16)),
    "ModernBERT-decoder": Family(
        "ModernBertDecoderConfig",
        "ModernBertDecoderForCausalLM",
        dict(sliding_window=WINDOW, pad_token_id=0, **TWO_KINDS),
    ),
    "OLMo-3": Family("Olmo3Config", "Olmo3ForCausalLM", dict(sliding_window=WINDOW, **TWO_KINDS)),
    "Phi-4-multimodal (text)": Family(
        "Phi4MultimodalConfig",
        "Phi4MultimodalForCausalLM",
        dict(
            sliding_window=WINDOW,
            pad_token_id=0,
            original_max_position_embeddings=256,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
            audio_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_blocks=1,
                num_attention_heads=2,
                ext_pw_out_channel=32,
                depthwise_separable_out_channel=32,
                nemo_conv_channels=32,
            ),
        ),
    ),
    "PhiMoE": Family(
        "PhimoeConfig", "PhimoeForCausalLM", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)
    ),
    "Qwen2-MoE": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            sliding_window=WINDOW, use_sliding_window=True, shared_expert_intermediate_size=32, **EXPERTS, **TWO_KINDS
        ),
    ),
    "Qwen3-MoE": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(sliding_window=WINDOW, use_sliding_window=True, head_dim=16, **EXPERTS),
    ),
    "RecurrentGemma": Family(
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(attention_window_size=WINDOW, lru_width=64, block_types=["recurrent", "attention"]),
    ),
    "SmolLM3": Family(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(sliding_window=WINDOW, use_sliding_window=True, pad_token_id=0, **TWO_KINDS),
    ),
    "StarCoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW)),
    "VaultGemma": Family(
        "VaultGemmaConfig", "VaultGemmaForCausalLM", dict(sliding_window=WINDOW, head_dim=16, **TWO_KINDS)
    ),
    "Zaya": Family(
        "ZayaConfig",
        "ZayaForCausalLM",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            router_hidden_size=16,
            layer_types=["hybrid_sliding", "hybrid"],
        ),
    ),
}
# The families docs/rewritten.md's set-up table tries in every training set-up.
SETUP_FAMILIES = (
    "Gemma-2",
    "Gemma-3",
    "Gemma-4",
    "Mistral",
    "Mixtral",
    "Qwen2",
    "Qwen3",
    "Cohere2",
    "Phi-3",
    "GPT-OSS",
    "Llama-4 (chunked)",
)
# Families the default suite runs live against the record: SDPA with sliding and full layers,
# attention spelled out in ops (sinks), and chunks.
CHECKED_LIVE = ("Gemma-3", "GPT-OSS", "Llama-4 (chunked)")

_NO_TEXT_LM = "no causal LM for text"
_MULTIMODAL = "multimodal: its text model has no causal-LM class; it trains through the multimodal class"
EXCLUDED = {
    "modernbert": f"encoder ({_NO_TEXT_LM})",
    "neomme": f"encoder ({_NO_TEXT_LM})",
    "ultrabert": f"encoder ({_NO_TEXT_LM})",
    "embedding_gemma2": f"text embedding encoder ({_NO_TEXT_LM})",
    "openai_privacy_filter": "token classifier (bidirectional; no causal-LM class)",
    "t5gemma": "encoder-decoder",
    "t5gemma2": "encoder-decoder",
    "esmfold2": "protein structure model",
    "diffusion_gemma": "block diffusion model (not trained by next-token loss)",
    "kyutai_speech_to_text": "speech model",
    "mimi": "audio codec",
    "moonshine_streaming": "speech model",
    "nemotron_asr_streaming": "speech model",
    "pocket_tts_audio_tokenizer": "audio tokenizer",
    "voxtral_realtime": "speech model",
    "qwen2_5_omni": "speech and vision model (its thinker trains through the multimodal class)",
    "qwen3_omni_moe": "speech and vision model (its thinker trains through the multimodal class)",
    "got_ocr2": "OCR model",
    "lighton_ocr": "OCR model",
    "deepseek_ocr2": "OCR model",
    "unlimited_ocr": "OCR model",
    "pp_chart2table": "chart-to-table vision model",
    "mistral3": "multimodal: its text model is Ministral-3's or Mistral's (both above)",
    "qwen2_vl": _MULTIMODAL,
    "qwen2_5_vl": _MULTIMODAL,
    "qwen3_vl_moe": _MULTIMODAL,
    "step3p7": _MULTIMODAL,
    "muse_spark": _MULTIMODAL,
    "muse_glimmer": _MULTIMODAL,
    "muse_glimmer_assistant": "a drafter for speculative decoding that denoises blocks (no causal-LM class)",
    "iquestcoder": "its config refuses use_sliding_window",
    "moshi": "its config's sliding_window is never read: every layer is causal",
    "nemotron_h": "its config's sliding_window is never read: its attention layers are causal",
}

GPU_MEASURED = {"Gemma-4": "H200, 2026-11-26: one sliding layer and a 6-layer step"}
# What kernels.md's policy picks on a GPU; not run here (this machine may have none).
GPU_KERNELS = (
    "On a GPU each layer runs the kernel measured fastest there against SDPA (torch's own FA2 for "
    "sliding layers, sm80 or newer, fp16/bf16, head_dim <= 256, as measured on an H200), else SDPA; "
    "the `w - 1` is the config's window less one, `#` a number of the config or the trace. A "
    "full-attention layer given padding or packed documents goes to the op where it is measured "
    "faster, which computes each document or padded row over its own keys alone (each family's kept "
    "reasons are in docs/rewritten.md)."
)
NO_SDPA_PATH = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
MARKERS = ("<!-- supported-models -->", "<!-- /supported-models -->")
FAMILY_MARKERS = ("<!-- recall-table -->", "<!-- /recall-table -->")
RECORD = ROOT / "benchmarks" / "families.json"
README = ROOT / "README.md"
REWRITTEN = ROOT / "docs" / "rewritten.md"
LENGTH, PADDED = 32, 7  # tokens per row; the right padding of the second row
SETUPS = ("unpadded", "padded")
# A layer's attention module, as the families' layers name it (RecurrentGemma: its temporal block).
ATTENTION_MODULES = {"self_attn", "attn", "temporal_block"}


def transformers_directory(family: str) -> str:
    """The family's model directory in transformers (``gemma3``), from its config's module."""
    return getattr(transformers, FAMILIES[family].config).__module__.split(".")[-2]


def available(family: str) -> bool:
    """Whether the installed transformers has the family (older releases lack some)."""
    return all(hasattr(transformers, name) for name in FAMILIES[family][:2])


def family_config(family: str):
    config_class, _, settings = FAMILIES[family][:3]
    return getattr(transformers, config_class)(**{**COMMON, **settings})


def family_model(family: str):
    """(config, the family's causal LM with random weights, in eval mode): on SDPA, or with eager
    attention (spelled out in ops) where transformers has no SDPA path for the family."""
    config = family_config(family)
    implementation = "sdpa" if has_sdpa_path(family) else "eager"
    torch.manual_seed(0)
    return config, getattr(transformers, FAMILIES[family].model)._from_config(
        config, attn_implementation=implementation
    ).eval()


def has_sdpa_path(family: str) -> bool:
    try:
        getattr(transformers, FAMILIES[family].model)._from_config(family_config(family), attn_implementation="sdpa")
    except ValueError as error:
        if NO_SDPA_PATH in str(error):
            return False
        raise
    return True


def layer_kind(family: str, config, decision) -> str:
    """ "sliding", "full", or the decision's module (its layer index as ``*``) for a call that
    is no layer's attention (a top-k mask, attention over a layer's inputs)."""
    path = decision.module.split(".")
    if decision.kind != "attention call" or decision.layer is None or path[-1] not in ATTENTION_MODULES:
        module = re.sub(r"[.]\d+(?=[.]|$)", ".*", decision.module.removeprefix("args[0].")) or decision.node
        return f"{decision.kind} in {module}"
    types = getattr(config, "layer_types", None)
    if not types:  # a window on every layer (Mistral's configs), or a model's part of them
        return "full" if any(part in path for part in FAMILIES[family].full_modules) else "sliding"
    name = types[decision.layer]
    return "sliding" if name in FAMILIES[family].sliding or "sliding" in name or "chunked" in name else "full"


def normalised(verdict: str, window: int) -> str:
    """A verdict in the config's terms: the window as ``w - 1`` (causal as ``causal``), a graph
    node's count and numbers other than 0 and 1 as ``#`` (``attn_weights_#``), no source line."""
    verdict = re.sub(r" at \S+\.py:\d+$", "", verdict)
    verdict = verdict.replace("window (-1, 0)", "window (causal)").replace(
        f"window ({window - 1}, 0)", "window (w - one, zero)"
    )
    verdict = re.sub(r"(?<=[A-Za-z])_\d+\b", "_#", verdict)
    verdict = re.sub(r"(?<![\w.])(?!(?:0|1)(?![\w.]))\d+(?:\.\d+)?(?![\w.])", "#", verdict)
    return verdict.replace("(w - one, zero)", "(w - 1, 0)")


def _scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(1.0, expected.abs().max().item())
    return (actual.double() - expected.double()).abs().max().item() / scale


def _inputs(setup: str) -> dict:
    ids = token_batch(LENGTH)
    inputs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    if setup == "padded":
        mask = torch.ones_like(ids)
        mask[1, LENGTH - PADDED :] = 0
        inputs["labels"][1, LENGTH - PADDED :] = -100
        inputs["attention_mask"] = mask
    return inputs


def _loss_and_gradients(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the gradient of each parameter the step reaches (a layer the forward skips,
    such as a multi-token-prediction head, gets none)."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {
        name.removeprefix("_orig_mod."): parameter.grad.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


def run_family(family: str) -> dict:
    """One family's record: its attention implementation, each set-up's decisions as (layer
    kind, normalised verdict, kernel), and the worst scaled error of the loss and every
    gradient against eager over both set-ups."""
    config, model = family_model(family)
    window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None) or WINDOW
    record = {"attention": "sdpa" if has_sdpa_path(family) else "eager", "decisions": {}, "worst_error": 0.0}
    for setup in SETUPS:
        torch._dynamo.reset()
        capture = Capture()
        inputs = _inputs(setup)
        loss, grads = _loss_and_gradients(torch.compile(model, backend=capture, fullgraph=True), inputs)
        eager_loss, eager_grads = _loss_and_gradients(model, inputs)
        assert grads.keys() == eager_grads.keys(), f"{family}: the rewritten graph trains other parameters"
        errors = [_scaled_error(loss, eager_loss), *(_scaled_error(grads[name], eager_grads[name]) for name in grads)]
        record["worst_error"] = max(record["worst_error"], *errors)
        record["decisions"][setup] = [
            [layer_kind(family, config, decision), normalised(decision.verdict, window), _kernel(decision)]
            for report in capture.reports
            for decision in report
        ]
    torch._dynamo.reset()
    return record


def _kernel(decision) -> str:
    """The rewritten call's kernel by name (the causal rule keeps SDPA's own), else ""."""
    if not decision.rewritten or decision.kind != "attention call":
        return ""
    return decision.kernel.split(",")[0] if decision.kernel else "SDPA"


# -- the tables, from a record --------------------------------------------------------------


def _verdicts(record: dict, kind: str, setup: str) -> list[str]:
    """A layer kind's distinct verdicts in the set-up, the rewritten ones first."""
    found = {verdict for kind_found, verdict, _ in record["decisions"][setup] if kind_found == kind}
    return sorted(found, key=lambda verdict: (not verdict.startswith("rewritten"), verdict))


def _status(record: dict, kind: str, setup: str) -> str:
    """ "rewritten", "kept", "partly kept" (some calls of the kind each), or "—" (none)."""
    rewritten = frozenset(verdict.startswith("rewritten") for verdict in _verdicts(record, kind, setup))
    return {frozenset(): "—", frozenset({True}): "rewritten", frozenset({False}): "kept"}.get(rewritten, "partly kept")


def _summary(record: dict, kind: str) -> str:
    """A layer kind's status, or each set-up's where they differ."""
    by_setup = {setup: _status(record, kind, setup) for setup in SETUPS}
    if len(set(by_setup.values())) == 1:
        return by_setup[SETUPS[0]]
    return ", ".join(f"{status} {setup}" for setup, status in by_setup.items())


def _kept_reasons(record: dict) -> str:
    """Every kept call's reason, once, with its layer kind (and set-up where only one keeps it)."""
    found: dict[tuple[str, str], list[str]] = {}
    for setup in SETUPS:
        for kind, verdict, _ in record["decisions"][setup]:
            if not verdict.startswith("rewritten"):
                found.setdefault((kind, verdict.removeprefix("kept: ")), []).append(setup)
    parts = []
    for (kind, reason), setups in found.items():
        where = kind if len(set(setups)) == len(SETUPS) else f"{kind}, {setups[0]}"
        parts.append(f"{where}: {reason}")
    return "; ".join(parts) or "—"


def _cell(text: str) -> str:
    """Text as a markdown table cell: a ``|`` of a reason would end the cell."""
    return text.replace("|", "\\|")


def _error(value: float) -> str:
    return "0" if value == 0 else f"{value:.0e}"


def family_table(records: dict[str, dict]) -> str:
    """docs/rewritten.md's table: every family, each layer kind's verdict, the worst error of
    a training step against eager, and why calls are kept."""
    rows = [
        "| family | attention | sliding (or chunked) layers | full-attention layers | worst error | kept, because |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for family, record in records.items():
        rows.append(
            f"| {family} | {record['attention']} | {_summary(record, 'sliding')} | {_summary(record, 'full')} | "
            f"{_error(record['worst_error'])} | {_cell(_kept_reasons(record))} |"
        )
    return "\n".join(rows)


def _how(record: dict, kind: str) -> str:
    """A layer kind's verdicts unpadded, and whether padded ones are rewritten where that
    differs (their reasons are docs/rewritten.md's)."""
    text = "; ".join(_verdicts(record, kind, SETUPS[0])) or "—"
    unpadded, padded = (_status(record, kind, setup) for setup in SETUPS)
    return text if padded == unpadded else f"{text} (padded: {padded})"


def _kernels(record: dict) -> str:
    kernels: dict[str, set[str]] = {}
    for kind, _, kernel in record["decisions"][SETUPS[0]]:
        if kernel and kind in ("sliding", "full"):
            kernels.setdefault(kind, set()).add(kernel)
    return (
        "; ".join(f"{kind}: {', '.join(sorted(names))}" for kind, names in sorted(kernels.items(), reverse=True)) or "—"
    )


def supported_models_table(records: dict[str, dict]) -> str:
    """README.md's table: families whose layers the rules treat alike in one row, how, on
    which kernel (on the CPU, where this runs), whether a training step equals eager's, and
    whether it was measured on a GPU."""
    rows: dict[tuple, list[str]] = {}
    for family, record in records.items():
        exact = "yes" if record["worst_error"] <= TOLERANCE else f"no ({_error(record['worst_error'])})"
        key = (
            record["attention"],
            _how(record, "sliding"),
            _how(record, "full"),
            _kernels(record),
            exact,
            GPU_MEASURED.get(family, "no"),
        )
        rows.setdefault(key, []).append(family)
    lines = [
        "| families | sliding (or chunked) layers | full-attention layers | kernel on the CPU | training step exact "
        "| measured on a GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (attention, sliding, full, kernels, exact, gpu), families in rows.items():
        names = ", ".join(families) + (
            "" if attention == "sdpa" else " (eager attention: no SDPA path in transformers)"
        )
        lines.append(f"| {names} | {_cell(sliding)} | {_cell(full)} | {kernels} | {exact} | {gpu} |")
    return "\n".join([*lines, "", GPU_KERNELS])


# -- the record -----------------------------------------------------------------------------


def _record_text(record: dict) -> str:
    """The record as JSON, a decision to a line."""

    def on_one_line(match: re.Match) -> str:
        return "[" + re.sub(r",\n\s+", ", ", match.group(1)) + "]"

    return re.sub(r"\[\n\s+(\"[^\[\]]*?\")\n\s+\]", on_one_line, json.dumps(record, indent=1)) + "\n"


def load_record() -> dict:
    return json.loads(RECORD.read_text())


def replace_block(page: Path, markers: tuple[str, str], table: str) -> None:
    text = page.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    page.write_text(f"{text[:start]}\n{table}\n{text[end:]}")


def block(page: Path, markers: tuple[str, str]) -> str:
    text = page.read_text()
    return text[text.index(markers[0]) + len(markers[0]) : text.index(markers[1])].strip()


def run_all(families) -> dict[str, dict]:
    records = {}
    for family in families:
        records[family] = run_family(family)
        print(
            f"{family}: {_summary(records[family], 'sliding')} / {_summary(records[family], 'full')}, "
            f"worst error {_error(records[family]['worst_error'])}",
            file=sys.stderr,
            flush=True,
        )
    return records


def write_pages(records: dict[str, dict]) -> None:
    replace_block(REWRITTEN, FAMILY_MARKERS, family_table(records))
    replace_block(README, MARKERS, supported_models_table(records))


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv == ["--pages"]:  # the pages' tables from the record, as after a change to how they read
        write_pages(load_record()["families"])
        return
    write = "--write" in argv
    chosen = [name for name in argv if name != "--write"] or [family for family in FAMILIES if available(family)]
    if write and len(chosen) != len(FAMILIES):
        raise SystemExit("--write records every family: run it on a transformers that has them all")
    records = run_all(chosen)
    print(family_table(records), supported_models_table(records), sep="\n\n")
    if write:
        RECORD.write_text(_record_text({"transformers": transformers.__version__, "families": records}))
        write_pages(records)


if __name__ == "__main__":
    main(sys.argv[1:])
