"""The causal rule: SDPA whose mask SDPA can do without -> SDPA with ``is_causal=True``, or
with no mask at all.

Full-attention layers of sliding-window models get an explicit (batch, 1, S, S) causal
mask; decoding steps get a mask that, once the cache holds at most a window, shows every
key. When the proof shows the mask is exactly ``kv <= q`` with Sq == Sk, SDPA's own causal
mode computes the same attention without reading (or keeping) an S*S mask; when it shows
every key is visible to every query, the mask is dropped.

Match: SDPA with a mask and ``is_causal=False``.
Check: the mask proven to be the band (unbounded, 0) with Sq == Sk proven, or a band that
       leaves every key visible (unbounded both sides, or unbounded left with one query row,
       which FA2's alignment puts at the last key); no key padding or packed sequences.
Replace: the same SDPA call with ``attn_mask=None`` and ``is_causal=True`` (causal) or
         ``False`` (all visible); dropout, scale and GQA arguments are untouched. The mask's
         construction is erased if nothing else reads it.
"""

from __future__ import annotations

import torch
import torch.fx

from ..graphs import example_value, is_sdpa, same_size, sdpa_arguments, sdpa_mask_problem
from ..ops.window import UNBOUNDED
from ..proof import MaskEvaluator, Unproven, prove_band
from ..proof.symbolic import as_sympy

NAME = "causal_mask"


def check(node: torch.fx.Node, evaluator: MaskEvaluator) -> bool | str:
    """``is_causal`` for the mask-free call (True: causal, False: every key visible), or why
    the call stays as it is."""
    args = sdpa_arguments(node)
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    problem = sdpa_mask_problem(args)
    if problem is not None:
        return problem
    query, key = example_value(args["query"]), example_value(args["key"])
    key_offset = evaluator.decide_extrema(as_sympy(key.shape[-2]) - as_sympy(query.shape[-2]), args["query"])
    single_query = same_size(query.shape[-2], 1)
    band = prove_band(evaluator, args["attn_mask"], key_offset, single_query=single_query)
    if isinstance(band, Unproven):
        return f"mask {band.reason}"
    if band.key_padding is None and band.segments is None and band.left == UNBOUNDED:
        if band.right == UNBOUNDED or single_query:
            return False
        # SDPA's is_causal aligns the first query with the first key: the mask must do so too.
        if band.right == 0 and same_size(query.shape[-2], key.shape[-2]):
            return True
    return f"mask is {band.describe()}, not plain causal"


def apply(node: torch.fx.Node, evaluator: MaskEvaluator):
    args = sdpa_arguments(node) if is_sdpa(node) else None
    if args is None or args["attn_mask"] is None:
        return None
    is_causal = check(node, evaluator)
    if isinstance(is_causal, str):
        return False, is_causal, set()
    node.args = (args["query"], args["key"], args["value"])
    node.kwargs = {
        **{name: value for name, value in args.arguments.items() if name not in ("query", "key", "value")},
        "attn_mask": None,
        "is_causal": is_causal,
    }
    reason = "plain causal mask -> is_causal=True" if is_causal else "mask shows every key -> no mask"
    return True, reason, {args["attn_mask"]}
