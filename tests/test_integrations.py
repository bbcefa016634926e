"""Where users already are: the HF Trainer with torch_compile_backend="compile_pass", and a
PEFT LoRA-wrapped Gemma-4 (activation checkpointing is covered in test_sliding_rule_gemma4.py)."""

import logging

import pytest
import torch

from tests.models import Capture, assert_training_matches, tiny_gemma4, token_batch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainer(model, tmp_path, backend):
    from transformers import Trainer, TrainingArguments

    ids = token_batch(32)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        torch_compile=True,
        torch_compile_backend=backend,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    return Trainer(model=model, args=arguments, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def test_trainer_by_backend_name_is_refused_by_accelerate(tmp_path):
    # accelerate's TorchDynamoPlugin accepts only the backends of its DynamoBackend enum.
    with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
        _trainer(tiny_gemma4(), tmp_path, "compile_pass")


def test_trainer_with_the_context_manager(tmp_path, caplog):
    import compile_pass

    no_caches = (  # a cache hit would reuse the artifact without logging decisions
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    trainer = _trainer(tiny_gemma4(), tmp_path, "inductor")
    with no_caches[0], no_caches[1], caplog.at_level(logging.INFO, logger="compile_pass"), compile_pass.enable():
        result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert len([r for r in caplog.records if "rewritten: window (7, 0)" in r.getMessage()]) == 5


def test_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gemma4(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    assert_training_matches(model, compiled, input_ids=ids, labels=ids, use_cache=False)
    assert [d.verdict for d in capture.report.rewritten() if d.rule == "sliding_window"] == [
        "rewritten: window (7, 0)"
    ] * 5
