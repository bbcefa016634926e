"""Pure analysis: FX nodes in, facts about attention masks out. Nothing here rewrites."""

import sympy
import torch

from .band import Band, band_of
from .symbolic import Formula, MaskEvaluator, Unproven


def prove_band(evaluator: MaskEvaluator, mask_node, key_offset=0) -> Band | Unproven:
    """The band that ``mask_node`` computes with FA2's alignment for ``key_offset`` = Sk - Sq,
    or the reason it is not proven one."""
    mask = mask_node.meta.get("example_value") if hasattr(mask_node, "meta") else None
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        return Unproven(f"is {mask.dtype} (additive), not boolean")
    formula = evaluator.evaluate(mask_node)
    if isinstance(formula, Unproven):
        return formula
    return band_of(formula, sympy.sympify(key_offset))


__all__ = ["Band", "Formula", "MaskEvaluator", "Unproven", "band_of", "prove_band"]
