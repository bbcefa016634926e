"""QLoRA as users set it up: a tiny Gemma-4 saved and loaded again with bitsandbytes' 4-bit (nf4
with double quantization, fp4) or 8-bit weights, or with torchao's NF4 weights, then PEFT LoRA on
the attention projections. The quantized weights are tensor subclasses (bitsandbytes'
``Params4bit`` and ``Int8Params``, torchao's ``NF4Tensor``); the projections return plain
tensors, so the sliding layers are rewritten (compile_pass/subclasses.py says why that is
sound). Loss and every LoRA gradient match the same quantized model run eagerly, and, where
the quantized model computes with its dequantized weights (4-bit: dequantized, then an fp32
matmul), a dequantized fp64 copy."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import compile_pass
from tests.helpers.models import (
    Capture,
    assert_close_scaled,
    checkpointed,
    loss_and_grads,
    side_effects_once,
    sliding_layers,
    tiny_gemma4,
    token_batch,
)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
QUANTIZED = {
    "nf4, double quantization": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    ),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}
SLIDING = "rewritten: window (7, 0)"
GLOBAL = "rewritten: plain causal mask -> is_causal=True"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma4")
    tiny_gemma4().save_pretrained(folder)
    return folder


def _lora(model):
    torch.manual_seed(1)  # random A and B: every LoRA weight gets a gradient
    model = get_peft_model(model, LoraConfig(r=4, target_modules=PROJECTIONS, init_lora_weights=False))
    return model.train()


def quantized(saved, kind):
    config = BitsAndBytesConfig(**QUANTIZED[kind])
    return _lora(AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, dtype=torch.float32))


def dequantized_fp64(saved, kind, like):
    """The same model with its weights dequantized, in fp64, with ``like``'s LoRA weights."""
    config = BitsAndBytesConfig(**QUANTIZED[kind])
    base = AutoModelForCausalLM.from_pretrained(saved, quantization_config=config, dtype=torch.float32).dequantize()
    model = _lora(base.double())
    model.load_state_dict(
        {name: value.double() for name, value in like.state_dict().items() if "lora_" in name}, strict=False
    )
    return model


def assert_lora_training_matches(compiled, model, reference=None, **inputs):
    loss, grads = loss_and_grads(compiled, **inputs)
    eager_loss, eager_grads = loss_and_grads(model, **inputs)
    assert grads.keys() == eager_grads.keys() and all("lora_" in name for name in grads)
    assert len(grads) == 2 * len(PROJECTIONS) * model.config.num_hidden_layers
    assert_close_scaled(loss, eager_loss, "loss vs eager")
    for name in grads:
        assert grads[name].abs().max() > 0, name
        assert_close_scaled(grads[name], eager_grads[name], f"{name} vs eager")
    if reference is not None:
        ref_loss, ref_grads = loss_and_grads(reference, **inputs)
        assert_close_scaled(loss, ref_loss, "loss vs fp64")
        for name in grads:
            assert_close_scaled(grads[name], ref_grads[name], f"{name} vs fp64")


def verdicts(capture):
    return [d.verdict for report in capture.reports for d in report]


@pytest.mark.parametrize("kind", ["nf4, double quantization", pytest.param("fp4", marks=pytest.mark.slow), "int8"])
def test_quantized_lora_rewrites_every_sliding_layer_exactly(saved, kind):
    model = quantized(saved, kind)
    capture = Capture()
    ids = token_batch(24)
    # 8-bit multiplies int8 activations: no dequantized model computes the same
    reference = dequantized_fp64(saved, kind, model) if "4" in kind else None
    assert_lora_training_matches(
        torch.compile(model, backend=capture), model, reference, input_ids=ids, labels=ids, use_cache=False
    )
    assert verdicts(capture) == [SLIDING] * sliding_layers(model) + [GLOBAL]
    # PEFT's wrappers reach Dynamo through __dict__['_modules']: the report names the layers as users do
    assert [d.module for d in capture.report] == [f"base_model.model.model.layers.{i}.self_attn" for i in range(3)]


def test_quantized_lora_with_activation_checkpointing(saved):
    """Checkpointing recomputes the 4-bit projections in the backward; the layers are rewritten
    inside the checkpointed bodies. PEFT makes the embeddings' output require a gradient (a
    hook Dynamo breaks the graph at), so the layers are compiled in a graph of their own."""
    model = checkpointed(quantized(saved, "nf4, double quantization"))
    capture = Capture()
    ids = token_batch(24)
    with side_effects_once():
        assert_lora_training_matches(
            torch.compile(model, backend=capture), model, input_ids=ids, labels=ids, use_cache=False
        )
    assert verdicts(capture) == [SLIDING] * sliding_layers(model) + [GLOBAL]
    modules = [d.module for report in capture.reports for d in report]
    assert modules == [f"layers.{i}.self_attn" for i in range(3)]


def test_torchao_nf4_weights(saved):
    """torchao's NF4Tensor (torchtune's QLoRA) is a __torch_dispatch__ subclass whose linear
    returns a plain tensor, which Dynamo's fake values show."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model = tiny_gemma4()
    for layer in model.model.layers:
        for name in PROJECTIONS:
            projection = getattr(layer.self_attn, name)
            projection.weight = torch.nn.Parameter(to_nf4(projection.weight.detach(), 32, 32), requires_grad=False)
    model = _lora(model)
    capture = Capture()
    ids = token_batch(24)
    assert_lora_training_matches(
        torch.compile(model, backend=capture), model, input_ids=ids, labels=ids, use_cache=False
    )
    assert verdicts(capture) == [SLIDING] * sliding_layers(model) + [GLOBAL]


@pytest.mark.slow
def test_qlora_through_inductor_in_every_way_in(saved, tmp_path):
    """backend="compile_pass", model.compile(), and enable() around a TRL SFTTrainer with its
    defaults (which checkpoint every layer), fp32 compute: the sliding layers are rewritten and
    the LoRA gradients match eager."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from tests.integrations.test_integrations import _tokenizer

    ids = token_batch(24)
    for way in ("backend", "model.compile"):
        torch._dynamo.reset()
        model = quantized(saved, "nf4, double quantization")
        eager = copy.deepcopy(model)
        with compile_pass.decisions() as report:
            if way == "backend":
                compiled = torch.compile(model, backend="compile_pass")
            else:
                compiled = model
                compiled.compile(backend="compile_pass")
            assert_lora_training_matches(compiled, eager, input_ids=ids, labels=ids, use_cache=False)
        assert [d.verdict for d in report] == [SLIDING] * 2 + [GLOBAL], way

    def sft_step(model, folder, compile_it):
        before = {name: p.detach().double().clone() for name, p in model.named_parameters() if p.requires_grad}
        arguments = SFTConfig(
            output_dir=str(tmp_path / folder),
            per_device_train_batch_size=2,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            lr_scheduler_type="constant",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            max_length=None,
            torch_compile=compile_it,
            bf16=False,
        )
        rows = Dataset.from_list([{"input_ids": row.tolist()} for row in ids])
        SFTTrainer(model=model, args=arguments, train_dataset=rows, processing_class=_tokenizer()).train()
        return {name: p.detach().double() - before[name] for name, p in model.named_parameters() if p.requires_grad}

    torch._dynamo.reset()
    with compile_pass.enable(), compile_pass.decisions() as report, side_effects_once():
        ours = sft_step(quantized(saved, "nf4, double quantization"), "ours", True)
    eager = sft_step(quantized(saved, "nf4, double quantization"), "eager", False)
    # The global layer too: with key padding the op computes each row over its own keys alone.
    assert [d.verdict for d in report if d.rewritten] == [
        "rewritten: window (7, 0), key padding from attention_mask"
    ] * 2 + ["rewritten: window (-1, 0), key padding from attention_mask"]
    assert ours.keys() == eager.keys() and all(update.abs().max() > 0 for update in eager.values())
    # SFTTrainer keeps a quantized model's LoRA weights in bf16 (bf16=False or not): the step's
    # update is compared to eager's at two of bf16's rounding steps
    for name in ours:
        assert_close_scaled(ours[name], eager[name], name, tolerance=2 * torch.finfo(torch.bfloat16).eps)
