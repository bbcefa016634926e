"""The top-k rule: top-k masks in the detached scatter form.

Dynamic-mask attention keeps, per query row, the ``k`` largest bias entries and masks the
rest. Written naively it records the top-k in autograd and builds float helper masks.

Match: ``torch.topk(x, k, dim=-1, largest=True)`` whose indices are scattered into a mask.
Check: the top-k outputs reach nothing differentiable (the indices only scatters into a
       zero mask, the values, if used, only comparisons scattered the same way), top-k over
       the last dimension, ``largest=True`` (``sorted`` does not matter to a scatter).
Replace:
- ``topk(x)`` -> ``topk(x.detach())``: same indices and values, nothing saved for backward;
- the float active mask ``zeros_like(x, float).scatter(-1, i, 1.0) == 0.0`` feeding
  ``masked_fill`` -> ``~zeros_like(x, bool).scatter(-1, i, True)``: same positions, a bool
  (1 byte) mask instead of a float (4 bytes) one and no ``== 0.0`` pass.
Rows with fewer than k allowed keys keep their masked keys masked: the fill applies to the
bias, which already holds the fill value there. Shapes are unchanged, so a 3-D bias stays
3-D for whatever consumes it.

Also: ``masked_fill(x, m, v)`` whose ``m`` the proof shows is all false (``~ones_like(x,
dtype=bool)``, what code allocates when no mask is given) is ``x``: removed with its
allocation.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

from ..graphs import example_value, set_fake_result
from ..proof import Formula, MaskEvaluator
from ..proof.symbolic import mutated_in_place

NAME = "topk_mask"
_TOPK_PARAMETERS = ("input", "k", "dim", "largest", "sorted")
_COMPARISONS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne}


def _topk_arguments(node: torch.fx.Node) -> dict:
    arguments = {"dim": -1, "largest": True, "sorted": True}
    arguments.update(zip(_TOPK_PARAMETERS, node.args))
    arguments.update(node.kwargs)
    return arguments


def _is_method(node, name: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name


def _scatter_arguments(node: torch.fx.Node):
    """(target, dim, index, src) of ``target.scatter(dim, index, src)``."""
    target, dim, index, src = node.args[:4]
    return target, dim, index, src


def _is_zero_mask(node, like: torch.Tensor) -> bool:
    """``zeros_like(...)`` or ``new_zeros(...)`` with ``like``'s shape."""
    zero = isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target is torch.zeros_like) or _is_method(node, "new_zeros")
    )
    return zero and example_value(node).shape == like.shape


def _is_last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _float_active_mask(scatter: torch.fx.Node):
    """The ``== 0`` node if ``scatter`` fills a float zero mask with a nonzero constant and
    is only compared with 0 (its zeros are the positions outside the top-k), else None."""
    target, _, _, src = _scatter_arguments(scatter)
    if example_value(target).dtype == torch.bool or isinstance(src, torch.fx.Node) or not src:
        return None
    users = list(scatter.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target is not operator.eq:
        return None
    equal = users[0]
    other = equal.args[1] if equal.args[0] is scatter else equal.args[0]
    return equal if isinstance(other, (int, float)) and other == 0 else None


def check(topk: torch.fx.Node):
    """(scatters, float_masks) to rewrite, or the reason to keep the top-k as it is."""
    args = _topk_arguments(topk)
    source = example_value(args["input"])
    if not _is_last_dim(args["dim"], source.dim()):
        return f"top-k over dim {args['dim']}, not the last"
    if args["largest"] is not True:
        return "largest=False"
    outputs = list(topk.users)
    if not all(u.op == "call_function" and u.target is operator.getitem for u in outputs):
        return "top-k result used as a whole"
    indices = [u for u in outputs if u.args[1] == 1]
    values = [u for u in outputs if u.args[1] == 0]
    scatters = [user for index in indices for user in index.users]
    if not scatters:
        return "top-k indices are not used"
    for scatter in scatters:
        if not _is_method(scatter, "scatter"):
            return f"top-k indices feed {scatter.name}, not a scatter"
        target, dim, index, src = _scatter_arguments(scatter)
        if index not in indices or not _is_last_dim(dim, source.dim()) or not _is_zero_mask(target, source):
            return f"{scatter.name} is not a last-dim scatter of the indices into a zero mask"
    # Values may only decide which top-k entries count (the validity form): compared, and the
    # result scattered by the same indices.
    for value in values:
        for user in value.users:
            if not (user.op == "call_function" and user.target in _COMPARISONS):
                return f"top-k values feed {user.name}"
            if any(s not in scatters or _scatter_arguments(s)[3] is not user for s in user.users):
                return f"top-k value comparison {user.name} is used outside the scatter"
    float_masks = {scatter: _float_active_mask(scatter) for scatter in scatters}
    already_detached = _is_method(args["input"], "detach")
    if already_detached and not any(float_masks.values()):
        return "already in the detached scatter form"
    return scatters, {s: eq for s, eq in float_masks.items() if eq is not None}


def _replace_float_mask(scatter: torch.fx.Node, equal: torch.fx.Node, like: torch.fx.Node) -> set[torch.fx.Node]:
    """``zeros(float).scatter(-1, i, c) == 0`` -> ``~zeros_like(like, bool).scatter(-1, i, True)``;
    ``like`` (the top-k input) has the zero mask's shape, so the float mask is no longer needed."""
    graph = scatter.graph
    target, dim, index, _ = _scatter_arguments(scatter)
    with graph.inserting_before(equal):
        zeros = graph.call_function(torch.zeros_like, (like,), {"dtype": torch.bool})
        keep = graph.call_method("scatter", (zeros, dim, index, True))
        drop = graph.call_function(operator.invert, (keep,))
    set_fake_result(zeros, lambda t: torch.zeros_like(t, dtype=torch.bool), like)
    set_fake_result(keep, lambda z, i: z.scatter(dim, i, True), zeros, index)
    set_fake_result(drop, operator.invert, keep)
    equal.replace_all_uses_with(drop)
    return {equal, scatter, target}


def _detach_input(topk: torch.fx.Node) -> None:
    source = topk.args[0]
    if _is_method(source, "detach"):
        return
    with topk.graph.inserting_before(topk):
        detached = topk.graph.call_method("detach", (source,))
    set_fake_result(detached, torch.Tensor.detach, source)
    topk.replace_input_with(source, detached)


def _all_false(evaluator: MaskEvaluator, mask) -> bool:
    formula = evaluator.evaluate(mask) if isinstance(mask, torch.fx.Node) else None
    return isinstance(formula, Formula) and formula.expr is sympy.false


def _remove_noop_fill(node: torch.fx.Node, evaluator: MaskEvaluator):
    """``x.masked_fill(all-false, v)`` is ``x``; None where that is not proven."""
    source, mask = node.args[0], node.args[1]
    if not isinstance(source, torch.fx.Node) or not _all_false(evaluator, mask):
        return None
    # The fill returned a copy; handing out x itself is only safe if neither is written later.
    if mutated_in_place(node) or mutated_in_place(source):
        return False, "masked_fill with an all-false mask, but a tensor involved is modified in place", set()
    node.replace_all_uses_with(source)
    return True, "masked_fill with an all-false mask removed", {node, mask}


def apply(node: torch.fx.Node, evaluator: MaskEvaluator):
    """(rewritten, reason, maybe-dead nodes) for top-k calls and proven no-op fills, else None."""
    if _is_method(node, "masked_fill"):
        return _remove_noop_fill(node, evaluator)
    if node.op != "call_function" or node.target is not torch.topk:
        return None
    plan = check(node)
    if isinstance(plan, str):
        return False, plan, set()
    _, float_masks = plan
    maybe_dead = set()
    for scatter, equal in float_masks.items():
        maybe_dead |= _replace_float_mask(scatter, equal, node.args[0])
    _detach_input(node)
    if float_masks:
        return True, "top-k of the detached input; float active mask -> bool scatter", maybe_dead
    return True, "top-k of the detached input", maybe_dead
