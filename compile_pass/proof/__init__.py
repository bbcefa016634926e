"""Pure analysis: FX nodes in, facts about attention masks out. Nothing here rewrites.

``engine`` evaluates a node to a formula by the op table that torch's ops (``arithmetic``,
``logic``, ``views``) and library idioms (``lemmas``) fill; ``band`` reads a window off a
formula; ``additive`` reads float masks; ``aliasing`` says which tensors a graph may write."""

import dataclasses

import sympy
import torch

from . import arithmetic, lemmas, logic, views  # noqa: F401 - they fill the engine's op table
from .additive import AdditiveMasks, hidden_alike_below
from .atoms import Atom, AtomKind
from .band import Band, SegmentIds, band_of
from .engine import Formula, MaskEvaluator, Unproven, as_sympy, input_name, nonnegative, shape_env_of


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
    band = band_of(formula, evaluator.atoms, sympy.sympify(key_offset), single_query)
    return dataclasses.replace(band, additive=True) if additive and isinstance(band, Band) else band


def unproven_end(evaluator: MaskEvaluator, equal_sizes: list[tuple], mask_node) -> sympy.Expr | None:
    """The first index end ``evaluator`` deferred (``deferring_index_ends``: ``size - 1 -
    largest index``) that is not provably >= 0 once the first size of each pair in
    ``equal_sizes`` is replaced by the second (sizes the caller checks equal at run time), or
    None."""
    equalities = {}
    for size, other in equal_sizes:
        symbol, value = as_sympy(size), as_sympy(other)
        if isinstance(symbol, sympy.Symbol) and value is not None:
            equalities[symbol] = value
    shape_env = shape_env_of(mask_node)
    return next((end for end in evaluator.deferred_ends if not nonnegative(end.xreplace(equalities), shape_env)), None)


__all__ = [
    "AdditiveMasks",
    "hidden_alike_below",
    "Atom",
    "AtomKind",
    "Band",
    "SegmentIds",
    "Formula",
    "MaskEvaluator",
    "Unproven",
    "as_sympy",
    "band_of",
    "input_name",
    "prove_band",
    "unproven_end",
]
