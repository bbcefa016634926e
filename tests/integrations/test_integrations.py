"""Where users already are: the HF Trainer (with enable(), or given a compiled model), and a
PEFT LoRA-wrapped Gemma-4 (activation checkpointing is covered in test_sliding_rule_gemma4.py)."""

import pytest
import torch

import compile_pass
from tests.helpers.models import (
    Capture,
    assert_close_scaled,
    assert_training_matches,
    fp64_reference,
    side_effects_once,
    sliding_layers,
    tiny_gemma4,
    tiny_gpt_oss,
    token_batch,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trainer(model, tmp_path, backend=None, **arguments):
    """Two steps of plain SGD at learning rate 1, so that each parameter moves by the sum of its
    two (clipped) gradients: the update compares gradients, not an optimizer's normalisation."""
    from transformers import Trainer, TrainingArguments

    ids = token_batch(32)
    arguments = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        torch_compile=backend is not None,
        torch_compile_backend=backend,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        **arguments,
    )
    return Trainer(model=model, args=arguments, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def _updates(model, tmp_path, backend=None, **arguments) -> dict[str, torch.Tensor]:
    """How far two Trainer steps move each parameter, in fp64 (a compiled model's parameters
    are named without its "_orig_mod." prefix)."""
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    _trainer(model, tmp_path, backend, **arguments).train()
    return {name.removeprefix("_orig_mod."): p.detach().double() - before[name] for name, p in model.named_parameters()}


def _assert_same_updates(updates, tmp_path):
    """Two Trainer steps moved every parameter as eager fp32 and eager fp64 move it."""
    eager = _updates(tiny_gemma4(), tmp_path / "eager")
    reference = _updates(tiny_gemma4(torch.float64), tmp_path / "fp64")
    assert updates.keys() == reference.keys()
    assert all(update.abs().max() > 0 for update in reference.values())  # every parameter trained
    for name, update in updates.items():
        assert_close_scaled(update, eager[name], f"{name} vs eager")
        assert_close_scaled(update, reference[name], f"{name} vs fp64")


def test_trainer_by_backend_name_is_refused_by_accelerate(tmp_path):
    # accelerate's TorchDynamoPlugin accepts only the backends of its DynamoBackend enum.
    with pytest.raises(ValueError, match="is not a valid DynamoBackend"):
        _trainer(tiny_gemma4(), tmp_path, "compile_pass")


def test_trainer_with_the_context_manager_matches_eager_training(tmp_path):
    """enable() around the Trainer's own compile, with gradient checkpointing as TRL turns it on."""
    no_caches = (  # a cache hit would reuse the artifact without rewriting again
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    with no_caches[0], no_caches[1], compile_pass.enable(), compile_pass.decisions() as report, side_effects_once():
        updates = _updates(tiny_gemma4(), tmp_path / "compiled", "inductor", gradient_checkpointing=True)
    assert [d.verdict for d in report] == ["rewritten: window (7, 0)"] * 2 + [
        "rewritten: plain causal mask -> is_causal=True"
    ]
    # Inside inductor's pre-grad pass the decisions still name the model's modules.
    assert [(d.module, d.layer_type) for d in report] == [
        (f"model.layers.{k}.self_attn", "sliding_attention" if k < 2 else "full_attention") for k in range(3)
    ]
    _assert_same_updates(updates, tmp_path)


def test_trainer_with_a_compiled_model_needs_remove_unused_columns_false(tmp_path):
    # The Trainer keeps the dataset columns that model.forward's signature names; a compiled
    # model's forward is (*args, **kwargs), so by default every column is dropped.
    compiled = torch.compile(tiny_gemma4(), backend="compile_pass")
    with pytest.raises(ValueError, match="The batch received was empty"):
        _trainer(compiled, tmp_path / "dropped").train()

    with compile_pass.decisions() as report, side_effects_once():  # the backend as an object, checkpointed
        updates = _updates(
            torch.compile(tiny_gemma4(), backend=compile_pass.backend),
            tmp_path / "kept",
            remove_unused_columns=False,
            gradient_checkpointing=True,
        )
    assert [d.verdict for d in report] == ["rewritten: window (7, 0)"] * 2 + [
        "rewritten: plain causal mask -> is_causal=True"
    ]
    _assert_same_updates(updates, tmp_path)


def test_trainer_with_a_model_compiled_in_place(tmp_path):
    # nn.Module.compile() keeps the model's class and forward signature: no column is dropped.
    model = tiny_gemma4()
    model.compile(backend="compile_pass")
    with compile_pass.decisions() as report, side_effects_once():
        updates = _updates(model, tmp_path / "compiled", gradient_checkpointing=True)
    assert [d.verdict for d in report] == ["rewritten: window (7, 0)"] * 2 + [
        "rewritten: plain causal mask -> is_causal=True"
    ]
    _assert_same_updates(updates, tmp_path)


def test_peft_lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gemma4(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    capture = Capture()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    ids = token_batch(32)
    assert_training_matches(model, compiled, input_ids=ids, labels=ids, use_cache=False)
    assert [d.verdict for d in capture.report.rewritten() if d.rule == "sliding_window"] == [
        "rewritten: window (7, 0)"
    ] * 2


def _tokenizer():
    """A word-level tokenizer over the tiny model's 128 ids, built here (no downloads)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1")),
        pad_token="t0",
        eos_token="t2",
        bos_token="t3",
    )


def _sft_update(model, tmp_path, bf16: bool, rows=None, **config) -> dict[str, torch.Tensor]:
    """One SFTTrainer step of SGD at learning rate 1 on pre-tokenized rows (two of 32 tokens
    unless given): the (clipped) gradient of every parameter, in fp64."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = rows if rows is not None else [row.tolist() for row in token_batch(32)]
    rows = Dataset.from_list([{"input_ids": row} for row in rows])
    before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    arguments = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=bf16,
        **{"max_length": None, **config},
    )
    SFTTrainer(model=model, args=arguments, train_dataset=rows, processing_class=_tokenizer()).train()
    return {name.removeprefix("_orig_mod."): p.detach().double() - before[name] for name, p in model.named_parameters()}


def test_trl_sft_trainer_with_bf16_mixed_precision(tmp_path):
    """TRL's SFTTrainer with ``bf16=True`` (fp32 weights under bf16 autocast), the model
    compiled in place: every layer is rewritten (the collator's padding mask: the global layer
    on the document kernel), and the step's update is as close to fp64's as eager's under the
    same autocast (bf16 is far from fp64 either way)."""
    capture = Capture()
    model = tiny_gemma4()
    model.compile(backend=capture)
    with side_effects_once():  # TRL checkpoints every layer by default
        ours = _sft_update(model, tmp_path / "ours", bf16=True)
    eager = _sft_update(tiny_gemma4(), tmp_path / "eager", bf16=True)
    reference = _sft_update(tiny_gemma4(torch.float64), tmp_path / "fp64", bf16=False)
    rewritten = [d.verdict for report in capture.reports for d in report if d.rewritten]
    full_layers = len(model.config.layer_types) - sliding_layers(model)  # the document kernel's
    assert (
        rewritten
        == ["rewritten: window (7, 0), key padding from attention_mask"] * sliding_layers(model)
        + ["rewritten: window (-1, 0), key padding from attention_mask"] * full_layers
    )

    def error(update):
        difference = sum(((update[name] - reference[name]) ** 2).sum() for name in reference)
        return (difference / sum((r**2).sum() for r in reference.values())).sqrt().item()

    assert all(r.abs().max() > 0 for r in reference.values())
    assert 1e-3 < error(eager) and error(ours) <= 1.25 * error(eager) + 0.01, (error(ours), error(eager))


@pytest.mark.slow
def test_trl_sft_trainer_trains_gpt_oss_on_the_op_with_bf16_mixed_precision(tmp_path):
    """GPT-OSS (eager attention with sinks) through TRL's SFTTrainer with ``bf16=True``, compiled
    in place: both layers on the op, the step as close to fp64's as eager's."""
    capture = Capture()
    model = tiny_gpt_oss()
    model.compile(backend=capture)
    with side_effects_once():  # TRL checkpoints every layer by default
        ours = _sft_update(model, tmp_path / "ours", bf16=True)
    eager = _sft_update(tiny_gpt_oss(), tmp_path / "eager", bf16=True)
    reference = _sft_update(fp64_reference(tiny_gpt_oss()), tmp_path / "fp64", bf16=False)
    rewritten = [d.reason for report in capture.reports for d in report if d.rewritten]
    assert len(rewritten) == 2 and all(reason.endswith("attention sinks") for reason in rewritten), rewritten

    def error(update):
        difference = sum(((update[name] - reference[name]) ** 2).sum() for name in reference)
        return (difference / sum((r**2).sum() for r in reference.values())).sqrt().item()

    assert all(r.abs().max() > 0 for r in reference.values())
    assert error(ours) <= 1.25 * error(eager) + 0.01, (error(ours), error(eager))


# Rows of several lengths, some shorter than the window (8), packed into rows of at most 48.
PACKABLE = [
    row[:length].tolist() for row, length in zip(token_batch(40, batch=5, seed=3), (5, 11, 19, 26, 40), strict=True)
]


@pytest.mark.parametrize(
    "config",
    [dict(packing=True, max_length=48), dict(padding_free=True)],
    ids=["packing", "padding-free"],
)
def test_trl_packed_batches_rewrite_every_layer_and_train_as_eager(tmp_path, config):
    """TRL's packed and padding-free batches pass ``position_ids`` that restart at each
    sequence and no attention mask: the sliding layers and the global one are rewritten
    (positions checked at run time), and the step moves every parameter as eager and eager
    fp64 move it."""
    capture = Capture()
    model = tiny_gemma4()
    model.compile(backend=capture)
    with side_effects_once():  # TRL checkpoints every layer by default
        ours = _sft_update(model, tmp_path / "ours", False, PACKABLE, **config)
    eager = _sft_update(tiny_gemma4(), tmp_path / "eager", False, PACKABLE, **config)
    reference = _sft_update(tiny_gemma4(torch.float64), tmp_path / "fp64", False, PACKABLE, **config)
    rewritten = {d.verdict for report in capture.reports for d in report if d.rewritten}
    assert rewritten == {
        f"rewritten: window ({window}, 0), packed sequences from position_ids (positions checked at run time)"
        for window in (7, -1)  # the sliding layers and the global one (the document kernel)
    }
    assert all(update.abs().max() > 0 for update in reference.values())
    for name, update in ours.items():
        assert_close_scaled(update, eager[name], f"{name} vs eager")
        assert_close_scaled(update, reference[name], f"{name} vs fp64")


def test_data_collator_with_flattening(tmp_path):
    """transformers' ``DataCollatorWithFlattening`` in the HF Trainer: one flattened row with
    restarting positions; two steps move every parameter as eager and fp64 move it."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    def updates(model, folder):
        before = {name: p.detach().double().clone() for name, p in model.named_parameters()}
        arguments = TrainingArguments(
            output_dir=str(tmp_path / folder),
            per_device_train_batch_size=3,
            max_steps=1,
            optim="sgd",
            learning_rate=1.0,
            lr_scheduler_type="constant",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            remove_unused_columns=False,
        )
        rows = [{"input_ids": row, "labels": row} for row in PACKABLE[:3]]
        Trainer(model=model, args=arguments, train_dataset=rows, data_collator=DataCollatorWithFlattening()).train()
        return {
            name.removeprefix("_orig_mod."): p.detach().double() - before[name] for name, p in model.named_parameters()
        }

    capture = Capture()
    model = tiny_gemma4()
    model.compile(backend=capture)
    ours, eager, reference = (
        updates(model, "ours"),
        updates(tiny_gemma4(), "eager"),
        updates(tiny_gemma4(torch.float64), "fp64"),
    )
    rewritten = {d.verdict for report in capture.reports for d in report if d.rewritten}
    assert rewritten == {
        f"rewritten: window ({window}, 0), packed sequences from position_ids (positions checked at run time)"
        for window in (7, -1)
    }
    for name, update in ours.items():
        assert_close_scaled(update, eager[name], f"{name} vs eager")
        assert_close_scaled(update, reference[name], f"{name} vs fp64")
