"""One family's run for benchmarks/families.py: its tiny causal LM built (on SDPA, or eager
attention where transformers gives it no SDPA path), compiled with the rules, and a training
step, unpadded and right-padded, against eager: every attention call's decision by the kind
of its layer, and the worst error of the loss and every gradient.

The tiny models are short, so every length is rewritten here (COMPILE_PASS_SHORT_KEYS=0 and
COMPILE_PASS_MEASURE=static, as in the tests: nothing is timed), set before compile_pass is
imported."""

from __future__ import annotations

import os
import re

os.environ.setdefault("COMPILE_PASS_SHORT_KEYS", "0")
os.environ.setdefault("COMPILE_PASS_MEASURE", "static")

import torch  # noqa: E402
import transformers  # noqa: E402

from benchmarks.family_configs import COMMON, FAMILIES, WINDOW  # noqa: E402
from tests.helpers.models import Capture, token_batch  # noqa: E402

NO_SDPA_PATH = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"
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
    if FAMILIES[family].task == "seq2seq":  # the encoder's and decoder's own settings
        return getattr(transformers, config_class)(**settings)
    return getattr(transformers, config_class)(**{**COMMON, **settings})


def family_model(family: str):
    """(config, the family's causal LM with random weights, in eval mode): on SDPA, or with eager
    attention (spelled out in ops) where transformers has no SDPA path for the family."""
    config = family_config(family)
    implementation = "sdpa" if has_sdpa_path(family) else "eager"
    torch.manual_seed(0)
    experts = {"experts_implementation": FAMILIES[family].experts} if FAMILIES[family].experts else {}
    return config, getattr(transformers, FAMILIES[family].model)._from_config(
        config, attn_implementation=implementation, **experts
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
    # An encoder-decoder's layers are typed by their part's config (``model.encoder.layers.3``).
    part = next((getattr(config, name) for name in ("encoder", "decoder") if name in path), config)
    types = getattr(part, "layer_types", None)
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


def _inputs(setup: str, task: str = "causal") -> dict:
    ids = token_batch(LENGTH)
    if task == "seq2seq":  # no pad (0) or start token (1) among the ids: the decoder's padding is the labels'
        ids = ids.clamp(min=3)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if task != "encoder":
        inputs["use_cache"] = False
    if setup == "padded":
        mask = torch.ones_like(ids)
        mask[1, LENGTH - PADDED :] = 0
        inputs["labels"][1, LENGTH - PADDED :] = -100
        inputs["attention_mask"] = mask
    return inputs


def _loss_and_gradients(model, inputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and the gradient of each parameter the step reaches (a layer the forward skips,
    such as a multi-token-prediction head, gets none). A model with no head (an embedding
    encoder) is given no labels and trained by the mean square of its hidden states; a token
    classifier by its own labels (the ids modulo its labels' count)."""
    model.zero_grad(set_to_none=True)
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        labels = inputs["labels"]
        if "TokenClassification" in type(getattr(model, "_orig_mod", model)).__name__:  # compiled or not
            inputs = {**inputs, "labels": labels.clamp(min=0) % model.config.num_labels}
        else:
            inputs = {name: value for name, value in inputs.items() if name != "labels"}
    outputs = model(**inputs)
    loss = outputs.loss if getattr(outputs, "loss", None) is not None else outputs.last_hidden_state.square().mean()
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
    window = WINDOW
    for name in ("sliding_window", "attention_chunk_size"):
        try:  # a config with per-layer windows refuses to give one for all (NeoMME's: RuntimeError)
            window = getattr(config, name, None) or window
        except RuntimeError:
            continue
        if window != WINDOW:
            break
    record = {"attention": "sdpa" if has_sdpa_path(family) else "eager", "decisions": {}, "worst_error": 0.0}
    for setup in SETUPS:
        torch._dynamo.reset()
        capture = Capture()
        inputs = _inputs(setup, FAMILIES[family].task)
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
