"""Pure analysis: FX nodes in, facts about attention masks out. Nothing here rewrites."""

import dataclasses

import sympy
import torch

from .additive import AdditiveMasks
from .band import Band, band_of
from .symbolic import Formula, MaskEvaluator, Unproven


def prove_band(evaluator: MaskEvaluator, mask_node, key_offset=0, single_query: bool = False) -> Band | Unproven:
    """The band that ``mask_node`` computes with FA2's alignment for ``key_offset`` = Sk - Sq,
    or the reason it is not proven one; ``single_query`` when Sq == 1. A float mask counts
    when it is 0 on the band and one fill value (-inf or the dtype's minimum) elsewhere
    (``Band.additive``)."""
    mask = mask_node.meta.get("example_value") if hasattr(mask_node, "meta") else None
    additive = isinstance(mask, torch.Tensor) and mask.is_floating_point()
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool and not additive:
        return Unproven(f"is {mask.dtype}, neither boolean nor a float mask")
    formula = AdditiveMasks(evaluator).visible(mask_node) if additive else evaluator.evaluate(mask_node)
    if isinstance(formula, Unproven):
        return Unproven(f"(additive) {formula.reason}") if additive else formula
    band = band_of(formula, sympy.sympify(key_offset), single_query)
    return dataclasses.replace(band, additive=True) if additive and isinstance(band, Band) else band


__all__ = ["AdditiveMasks", "Band", "Formula", "MaskEvaluator", "Unproven", "band_of", "prove_band"]
