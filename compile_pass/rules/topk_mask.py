"""The top-k rule: top-k masks in the detached scatter form.

Dynamic-mask attention keeps, per query row, the ``k`` largest bias entries and masks the
rest. Written naively it records the top-k in autograd and builds float helper masks.

Match: ``torch.topk(x, k, dim=-1, largest=True)`` whose indices are scattered into a mask.
Check: the top-k outputs reach nothing differentiable (the indices only scatters into a
       zero mask, the values, if used, only comparisons scattered the same way), top-k over
       the last dimension, ``largest=True`` (``sorted`` does not matter to a scatter).
       A top-k kept whose picks reach no attention call (an MoE router's: they become
       routing weights) is no decision in the report, only a DEBUG line.
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
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from ..calls import Call, CallReader
from ..graphs import example_value, fake_result
from ..proof import Formula, MaskEvaluator
from ..report import FILL, TOPK
from ..sizes import same_size
from .attention import SDPA_TARGETS
from .base import Context, Kept, Site

NAME = "topk_mask"
TARGETS = {("call_function", torch.topk): TOPK, ("call_method", "masked_fill"): FILL}
_COMPARISONS = {operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne}


def _method_call(node, name: str, calls: CallReader) -> Call | None:
    """``node`` read by its signature when it is a ``.name(...)`` call, else None."""
    if isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == name:
        return calls.read(node)
    return None


def _operands(node: torch.fx.Node, calls: CallReader) -> list:
    """A Python operator's two operands, by its signature."""
    call = calls.read(node)
    return call.first(2) if call is not None else []


def _is_zero_mask(node, like: torch.Tensor, calls: CallReader) -> bool:
    """``zeros_like(...)`` or ``new_zeros(...)`` with ``like``'s shape and device."""
    zero = isinstance(node, torch.fx.Node) and (
        (node.op == "call_function" and node.target is torch.zeros_like)
        or _method_call(node, "new_zeros", calls) is not None
    )
    mask = example_value(node) if zero else None
    return (
        isinstance(mask, torch.Tensor)
        and mask.device == like.device
        and mask.dim() == like.dim()
        and all(same_size(a, b) for a, b in zip(mask.shape, like.shape, strict=True))
    )


def _is_last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _stored_nonzero(value, dtype: torch.dtype) -> bool:
    """Whether scattering the Python scalar ``value`` into a ``dtype`` tensor stores a nonzero:
    asked of scatter itself, which rounds (1e-50 in fp32 is 0) and truncates (0.5 into int64
    is 0) as it will at run time."""
    try:
        stored = torch.zeros(1, dtype=dtype).scatter(0, torch.zeros(1, dtype=torch.long), value)
    except (RuntimeError, TypeError):
        return False
    return bool(stored[0] != 0)


def _float_active_mask(scatter: torch.fx.Node, call: Call, evaluator: MaskEvaluator):
    """The ``== 0`` node if ``scatter`` fills a non-bool zero mask with a constant that is
    nonzero once stored, and is only compared with 0 (its zeros are then exactly the
    positions outside the top-k), else None."""
    target = example_value(call["input"])
    if target.dtype == torch.bool or "value" not in call.arguments or not _stored_nonzero(call["value"], target.dtype):
        return None
    users = list(scatter.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].target is not operator.eq:
        return None
    equal = users[0]
    operands = _operands(equal, evaluator.calls)
    if len(operands) != 2 or scatter not in operands:
        return None
    other = operands[1] if operands[0] is scatter else operands[0]
    if isinstance(other, bool) or not isinstance(other, (int, float)) or other != 0:
        return None
    return equal if evaluator.writes.writer(scatter) is None else None


@dataclass(frozen=True)
class TopkPlan:
    site: Site
    scatters: dict  # scatter node -> its call
    float_masks: dict  # scatter node -> the ``== 0`` node to replace
    fakes: dict  # scatter node -> fakes of its bool replacement
    fake_detached: torch.Tensor | None  # None when the input is detached already

    @property
    def reason(self) -> str:
        if self.float_masks:
            return "top-k of the detached input; float active mask -> bool scatter"
        return "top-k of the detached input"


@dataclass(frozen=True)
class FillPlan:
    site: Site

    @property
    def reason(self) -> str:
        return "masked_fill with an all-false mask removed"


def matches(site: Site, context: Context) -> bool:
    """A top-k whose indices build a mask, or a masked_fill whose mask is proven all false."""
    if site.node.target is torch.topk:
        return builds_mask(site.node, context.calls)
    return isinstance(site.call["input"], torch.fx.Node) and _all_false(context.evaluator, site.call["mask"])


def check(site: Site, context: Context) -> TopkPlan | FillPlan | Kept:
    if site.node.target is torch.topk:
        outcome = _check_topk(site, context.evaluator)
        if isinstance(outcome, Kept) and not builds_attention_mask(site.node, context.calls):
            # An MoE router's top-k (expert picks scattered into routing weights): nothing about
            # attention to report. Only the report changes: the graph stays as it is either way.
            return Kept(f"{outcome.reason}; its picks build no attention mask", reported=False)
        return outcome
    return _check_fill(site, context.evaluator)


def replace(plan: TopkPlan | FillPlan, context: Context) -> set[torch.fx.Node]:
    if isinstance(plan, FillPlan):
        node = plan.site.node
        node.replace_all_uses_with(plan.site.call["input"])
        return {node, plan.site.call["mask"]}
    topk, source = plan.site.node, plan.site.call["input"]
    maybe_dead = set()
    for scatter, equal in plan.float_masks.items():
        maybe_dead |= _replace_float_mask(plan.scatters[scatter], equal, source, plan.fakes[scatter])
    if plan.fake_detached is not None:
        _detach_input(topk, source, plan.fake_detached)
    return maybe_dead


def _check_topk(site: Site, evaluator: MaskEvaluator) -> TopkPlan | Kept:
    topk, call, calls = site.node, site.call, evaluator.calls
    source = example_value(call["input"])
    if not isinstance(source, torch.Tensor):
        return Kept("top-k of a non-tensor")
    if not _is_last_dim(call["dim"], source.dim()):
        return Kept(f"top-k over dim {call['dim']}, not the last")
    if call["largest"] is not True:
        return Kept("largest=False")
    outputs = list(topk.users)
    picks = [_operands(u, calls) if u.op == "call_function" and u.target is operator.getitem else [] for u in outputs]
    if not all(len(pick) == 2 and pick[1] in (0, 1) for pick in picks):
        return Kept("top-k result used as a whole")
    indices = [u for u, pick in zip(outputs, picks, strict=True) if pick[1] == 1]
    values = [u for u, pick in zip(outputs, picks, strict=True) if pick[1] == 0]
    scatters = {user: _method_call(user, "scatter", calls) for index in indices for user in index.users}
    if not scatters:
        return Kept("top-k indices are not used")
    for scatter, scatter_call in scatters.items():
        if scatter_call is None:
            return Kept(f"top-k indices feed {scatter.name}, not a scatter")
        if "reduce" in scatter_call.arguments:
            return Kept(f"{scatter.name} scatters with reduce={scatter_call['reduce']!r}")
        if (
            scatter_call["index"] not in indices
            or not _is_last_dim(scatter_call["dim"], source.dim())
            or not _is_zero_mask(scatter_call["input"], source, calls)
        ):
            return Kept(f"{scatter.name} is not a last-dim scatter of the indices into a zero mask")
        writer = evaluator.writes.writer(scatter_call["input"])
        if writer is not None:
            return Kept(f"the zero mask of {scatter.name} may be written: {writer}")
    # Values may only decide which top-k entries count (the validity form): compared, and the
    # result scattered by the same indices.
    for value in values:
        for user in value.users:
            if not (user.op == "call_function" and user.target in _COMPARISONS):
                return Kept(f"top-k values feed {user.name}")
            if any(s not in scatters or scatters[s].arguments.get("src") is not user for s in user.users):
                return Kept(f"top-k value comparison {user.name} is used outside the scatter")
    float_masks = {scatter: _float_active_mask(scatter, c, evaluator) for scatter, c in scatters.items()}
    already_detached = _method_call(call["input"], "detach", calls) is not None
    if already_detached and not any(float_masks.values()):
        return Kept("already in the detached scatter form")
    float_masks = {s: eq for s, eq in float_masks.items() if eq is not None}
    # Every fake value first: a failure leaves the graph as it was.
    fakes = {scatter: _bool_mask_fakes(scatters[scatter], call["input"]) for scatter in float_masks}
    fake_detached = None if already_detached else fake_result(torch.Tensor.detach, call["input"])
    return TopkPlan(site, scatters, float_masks, fakes, fake_detached)


def _bool_mask_fakes(call: Call, like: torch.fx.Node) -> tuple:
    """Fake values of ``zeros_like(like, bool)``, its scatter of True and the inverse."""
    zeros = fake_result(lambda t: torch.zeros_like(t, dtype=torch.bool), like)
    keep = fake_result(lambda z, i: z.scatter(call["dim"], i, True), zeros, call["index"])
    return zeros, keep, fake_result(operator.invert, keep)


def _replace_float_mask(call: Call, equal: torch.fx.Node, like: torch.fx.Node, fakes: tuple) -> set[torch.fx.Node]:
    """``zeros(float).scatter(-1, i, c) == 0`` -> ``~zeros_like(like, bool).scatter(-1, i, True)``;
    ``like`` (the top-k input) has the zero mask's shape, so the float mask is no longer needed."""
    graph = equal.graph
    with graph.inserting_before(equal):
        zeros = graph.call_function(torch.zeros_like, (like,), {"dtype": torch.bool})
        keep = graph.call_method("scatter", (zeros, call["dim"], call["index"], True))
        drop = graph.call_function(operator.invert, (keep,))
    for node, fake in zip((zeros, keep, drop), fakes, strict=True):
        node.meta["example_value"] = fake
    equal.replace_all_uses_with(drop)
    return {equal, *equal.all_input_nodes, call["input"]}


def _detach_input(topk: torch.fx.Node, source: torch.fx.Node, fake: torch.Tensor) -> None:
    with topk.graph.inserting_before(topk):
        detached = topk.graph.call_method("detach", (source,))
    detached.meta["example_value"] = fake
    topk.replace_input_with(source, detached)


def _all_false(evaluator: MaskEvaluator, mask) -> bool:
    formula = evaluator.evaluate(mask) if isinstance(mask, torch.fx.Node) else None
    return isinstance(formula, Formula) and formula.expr is sympy.false


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides, storage offset and storage size: only identity tells the two apart."""
    return (
        all(same_size(x, y) for x, y in zip(a.stride(), b.stride(), strict=True))
        and same_size(a.storage_offset(), b.storage_offset())
        and same_size(a.untyped_storage().nbytes(), b.untyped_storage().nbytes())
    )


def _check_fill(site: Site, evaluator: MaskEvaluator) -> FillPlan | Kept:
    """``x.masked_fill(all-false, v)`` is ``x``, where handing out ``x`` itself is safe."""
    node, call = site.node, site.call
    source = call["input"]
    result, original = example_value(node), example_value(source)
    if (
        result.dtype != original.dtype
        or result.dim() != original.dim()
        or not all(same_size(a, b) for a, b in zip(result.shape, original.shape, strict=True))
    ):
        return Kept("masked_fill with an all-false mask broadcasts its input")
    if isinstance(call["value"], torch.fx.Node):
        # A tensor value is an input of the result's autograd graph (its gradient is 0).
        return Kept("masked_fill with an all-false mask, but its fill value is a tensor")
    if not _same_layout(result, original):
        # masked_fill returns a contiguous tensor for a non-dense input: views, strides and
        # as_strided of the result would read the input differently.
        return Kept("masked_fill with an all-false mask, but its input's strides are not the result's")
    # The fill returned a new tensor; handing out x itself is only safe if neither is written
    # and the result is not returned (the caller would get x's memory).
    writer = evaluator.writes.writer(node) or evaluator.writes.writer(source)
    if writer is not None:
        return Kept(f"masked_fill with an all-false mask, but {writer}")
    if evaluator.writes.escapes(node):
        return Kept("masked_fill with an all-false mask, but its result is returned from the graph")
    return FillPlan(site)


# Ops that carry top-k indices on unchanged (a view, a dtype, a selection) on their way to a
# scatter, the one way a mask is built from them.
_CARRIERS = {
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "expand",
    "flatten",
    "contiguous",
    "clone",
    "long",
    "int",
    "to",
    "type",
    "detach",
}


def builds_mask(topk: torch.fx.Node, calls: CallReader) -> bool:
    """Whether the top-k's indices reach a scatter, directly or through view and dtype
    changes: a mask built from them. A router's indices (expert ids: sorted, gathered,
    one-hot) build none, and the rule has nothing to say about them. The whole result used
    as a value counts as a mask, to be safe."""
    pending = []
    for user in topk.users:
        picked = _operands(user, calls) if user.op == "call_function" and user.target is operator.getitem else []
        if len(picked) != 2:
            return True
        if picked[1] == 1:
            pending.append(user)
    seen = set()
    while pending:
        node = pending.pop()
        for user in node.users:
            name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
            if isinstance(name, str) and name.startswith("scatter"):
                return True
            carries = (user.op == "call_method" and user.target in _CARRIERS) or (
                user.op == "call_function" and user.target is operator.getitem and _operands(user, calls)[:1] == [node]
            )
            if carries and user not in seen:
                seen.add(user)
                pending.append(user)
    return False


# Ops through which a mask built from top-k picks is still a mask on its way to attention:
# views and dtype changes, selections, comparisons and logic, fills, concatenation, and the
# sums that combine additive masks (with the scores too, where attention is spelled out).
_MASK_CARRIERS = _CARRIERS | {
    "getitem",
    "bool",
    "float",
    "half",
    "bfloat16",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "invert",
    "and_",
    "or_",
    "xor",
    "logical_not",
    "logical_and",
    "logical_or",
    "logical_xor",
    "bitwise_not",
    "bitwise_and",
    "bitwise_or",
    "masked_fill",
    "masked_fill_",
    "where",
    "add",
    "add_",
    "sub",
    "sub_",
    "cat",
    "transpose",
    "permute",
    "expand_as",
    "view_as",
    "reshape_as",
    "repeat",
    "repeat_interleave",
    "narrow",
    "select",
}
_SOFTMAXES = {"softmax", "_softmax"}


def _op_name(node: torch.fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name if isinstance(name, str) else ""


def _attention_or_unknown(node: torch.fx.Node) -> bool:
    """SDPA, a softmax (attention spelled out in ops normalises its scores with one), or where
    this graph cannot follow a value: its output, a call into another graph or module."""
    return (
        node.op in ("output", "call_module")
        or (node.op, node.target) in SDPA_TARGETS
        or _op_name(node) in _SOFTMAXES
        or isinstance(node.target, torch._ops.HigherOrderOperator)
    )


def builds_attention_mask(topk: torch.fx.Node, calls: CallReader) -> bool:
    """Whether the top-k's picks may reach an attention call's mask: from its indices (or the
    whole result, used as a value) through scatters and the ops that keep a mask a mask
    (``_MASK_CARRIERS``; an in-place op's input holds its result too) to SDPA, a softmax, or
    where the graph cannot follow. An MoE router's picks become routing weights, which an
    expert's output multiplies: they reach none. Errs towards True, as it decides only
    whether a kept top-k is reported."""
    picks = [
        _operands(user, calls) if user.op == "call_function" and user.target is operator.getitem else []
        for user in topk.users
    ]
    if all(len(pick) == 2 for pick in picks):
        holding = [user for user, pick in zip(topk.users, picks, strict=True) if pick[1] == 1]
    else:
        holding = [topk]  # the whole result used as a value
    seen = set(holding)
    while holding:
        node = holding.pop()
        for user in node.users:
            if _attention_or_unknown(user):
                return True
            name = _op_name(user)
            following = [user] if name.startswith("scatter") or name in _MASK_CARRIERS else []
            if user.op == "call_method" and name.endswith("_") and isinstance(user.args[0], torch.fx.Node):
                following.append(user.args[0])
            for held in following:
                if held not in seen:
                    seen.add(held)
                    holding.append(held)
    return False
