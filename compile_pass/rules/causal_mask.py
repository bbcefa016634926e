"""The causal rule: SDPA whose mask is proven plain causal -> SDPA with ``is_causal=True``.

Full-attention layers of sliding-window models get an explicit (batch, 1, S, S) causal
mask. When the proof shows it is exactly ``kv <= q`` with Sq == Sk, SDPA's own causal mode
computes the same attention without reading (or keeping) an S*S mask.

Match: SDPA with a mask and ``is_causal=False``.
Check: Sq == Sk proven; the mask proven to be the band (unbounded, 0).
Replace: the same SDPA call with ``attn_mask=None, is_causal=True``; dropout, scale and
         GQA arguments are untouched. The mask's construction is erased if nothing else reads it.
"""

from __future__ import annotations

import torch
import torch.fx

from ..graphs import example_value, is_sdpa, same_size, sdpa_arguments, sdpa_mask_problem
from ..ops.window import UNBOUNDED
from ..proof import MaskEvaluator, Unproven, prove_band

NAME = "causal_mask"


def check(node: torch.fx.Node, evaluator: MaskEvaluator) -> str | None:
    """None when the mask is proven plain causal, else why the call stays as it is."""
    args = sdpa_arguments(node)
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    problem = sdpa_mask_problem(args)
    if problem is not None:
        return problem
    query, key = example_value(args["query"]), example_value(args["key"])
    # SDPA's is_causal aligns the first query with the first key: the mask must do so too.
    if not same_size(query.shape[-2], key.shape[-2]):
        return "query and key lengths not provably equal"
    band = prove_band(evaluator, args["attn_mask"])
    if isinstance(band, Unproven):
        return f"mask {band.reason}"
    if (band.left, band.right, band.key_padding, band.segments) != (UNBOUNDED, 0, None, None):
        return f"mask is {band.describe()}, not plain causal"
    return None


def apply(node: torch.fx.Node, evaluator: MaskEvaluator):
    args = sdpa_arguments(node) if is_sdpa(node) else None
    if args is None or args["attn_mask"] is None:
        return None
    reason = check(node, evaluator)
    if reason is not None:
        return False, reason, set()
    node.args = (args["query"], args["key"], args["value"])
    node.kwargs = {
        **{name: value for name, value in args.arguments.items() if name not in ("query", "key", "value")},
        "attn_mask": None,
        "is_causal": True,
    }
    return True, "plain causal mask -> is_causal=True", {args["attn_mask"]}
