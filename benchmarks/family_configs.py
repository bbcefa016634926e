"""The families benchmarks/families.py tries, each as a tiny random config (window w = 8, no
downloads): the config and model classes by name in transformers and the settings that make
them tiny; decoders (their causal LM), then encoders, encoder-decoders and the bidirectional
set-ups of decoders (ENCODERS: two-sided windows); the families the set-up table and the
default suite run; and every other family with a window in transformers, left out with the
reason (EXCLUDED).
tests/integrations/test_recall_table.py fails while a windowed family is in neither."""

from __future__ import annotations

from typing import NamedTuple

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
    # What it trains as: "causal" (next-token loss), "encoder" (its masked-LM or token-classification
    # loss; a loss over its hidden states where it has no head), "seq2seq" (an encoder-decoder's
    # generation loss; ``settings`` are then the encoder's and the decoder's).
    task: str = "causal"
    # The experts' implementation where the family's default loops over the experts in Python
    # (which fullgraph compiles cannot trace): transformers' grouped matmul.
    experts: str | None = None


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
# Encoders, encoder-decoders and the bidirectional set-ups of decoders (two-sided windows).
_T5_MODULE = dict(
    COMMON,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=WINDOW,
    attn_logit_softcapping=5.0,
    bos_token_id=1,
    pad_token_id=0,
    eos_token_id=2,
    **TWO_KINDS,
)
ENCODERS = {
    "Gemma-3 (bidirectional)": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(sliding_window=WINDOW, head_dim=16, use_bidirectional_attention=True, **TWO_KINDS),
    ),
    "ModernBERT": Family(
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        dict(local_attention=WINDOW, global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        task="encoder",
    ),
    "NeoMME": Family(
        "NeoMMEConfig",
        "NeoMMEForMaskedLM",
        # one window (its default alternates a long one), the full layer's none
        dict(sliding_window=WINDOW, head_dim=16, per_layer_config={1: {"sliding_window": None}}, **TWO_KINDS),
        task="encoder",
    ),
    "UltraBERT": Family(
        "UltrabertConfig",
        "UltrabertForMaskedLM",
        dict(sliding_window=WINDOW, head_dim=16, prediction_head_size=64, **TWO_KINDS),
        task="encoder",
    ),
    "EmbeddingGemma2": Family(
        "EmbeddingGemma2TextConfig",
        "EmbeddingGemma2TextModel",
        dict(sliding_window=WINDOW, head_dim=16, hidden_size_per_layer_input=16, **TWO_KINDS),
        task="encoder",
    ),
    "OpenAI privacy filter": Family(
        "OpenAIPrivacyFilterConfig",
        "OpenAIPrivacyFilterForTokenClassification",
        dict(
            sliding_window=WINDOW,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=2,
        ),
        task="encoder",
        experts="grouped_mm",
    ),
    "T5Gemma": Family(
        "T5GemmaConfig",
        "T5GemmaForConditionalGeneration",
        dict(encoder=_T5_MODULE, decoder=_T5_MODULE, vocab_size=COMMON["vocab_size"]),
        task="seq2seq",
    ),
}
FAMILIES.update(ENCODERS)
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
    "t5gemma2": "encoder-decoder of text and images (its encoder reads images; T5Gemma is tried)",
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
