"""Half-precision training errors against fp64, for eager, plain inductor and compile_pass
(benchmarks/precision.py prints them; tests/ops/test_precision.py bounds compile_pass by inductor).

One training step of a tiny random Gemma-4 whose weights are stored in the half dtype. The
reference is the same weights in fp64 on the same tokens. Errors:
- grad norm: ||g - g64|| / ||g64||, over all parameters as one vector;
- grad max: max |g - g64| over every gradient element, with max |g64| for scale;
- logits max: max |logits - logits64|;
- loss: |loss - loss64|.
"""

from __future__ import annotations

import copy
import math

import torch

from tests.helpers.models import tiny_gemma4, token_batch

VARIANTS = ("eager", "inductor", "compile_pass")
# compile_pass's rewrite run without inductor: what the rewrite alone changes against eager.
REWRITE_ONLY = ("eager", "rewritten, eager")


def _step(model, ids, autocast=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        output = model(input_ids=ids, labels=ids, use_cache=False)
    output.loss.backward()
    grads = {name.removeprefix("_orig_mod."): p.grad.detach().double() for name, p in model.named_parameters()}
    return output.loss.detach().double(), output.logits.detach().double(), grads


def training_errors(
    dtype: torch.dtype, length: int = 64, batch: int = 2, variants=VARIANTS, autocast: torch.dtype | None = None
) -> dict[str, dict[str, float]]:
    """Variant -> error name -> value, and "fp64" -> the reference's scales. Variants: "eager",
    "inductor", "compile_pass" (rewrite + inductor) and "rewritten, eager" (the rewritten
    graph run eagerly, no inductor: quick, and what the rewrite alone changes). With
    ``autocast``, weights of ``dtype`` (fp32) run under ``torch.autocast("cpu", autocast)``,
    as ``TrainingArguments(bf16=True)`` runs them; the reference stays fp64 without it.
    ``errors["rewritten"]`` counts the SDPA calls the "rewritten, eager" variant rewrote."""
    from tests.helpers.models import Capture

    torch._dynamo.reset()
    model = tiny_gemma4(dtype)
    ids = token_batch(length, batch=batch)
    ref_loss, ref_logits, ref_grads = _step(copy.deepcopy(model).double(), ids)
    ref_norm = math.sqrt(sum((g**2).sum().item() for g in ref_grads.values()))
    backends = {"inductor": "inductor", "compile_pass": "compile_pass", "rewritten, eager": Capture()}
    runs = {
        name: model if name == "eager" else torch.compile(model, backend=backends[name], fullgraph=True)
        for name in variants
    }
    errors = {
        "fp64": {
            "grad norm": ref_norm,
            "grad max": max(g.abs().max().item() for g in ref_grads.values()),
            "logits max": ref_logits.abs().max().item(),
            "loss": ref_loss.item(),
        }
    }
    for name, run in runs.items():
        loss, logits, grads = _step(run, ids, autocast)
        assert grads.keys() == ref_grads.keys()
        difference = {key: grads[key] - ref_grads[key] for key in grads}
        errors[name] = {
            "grad norm": math.sqrt(sum((d**2).sum().item() for d in difference.values())) / ref_norm,
            "grad max": max(d.abs().max().item() for d in difference.values()),
            "logits max": (logits - ref_logits).abs().max().item(),
            "loss": (loss - ref_loss).abs().item(),
        }
    if "rewritten, eager" in variants:
        errors["rewritten"] = {
            "calls": sum(d.rewritten for report in backends["rewritten, eager"].reports for d in report)
        }
    torch._dynamo.reset()
    return errors
