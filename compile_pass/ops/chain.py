"""Attention spelled out in ops, as the checked op (``runtime_mask.py``) computes it for a chain
(``rules/spelled_attention.py``) where the band path does not run: the positions failed their
check, so the mask may be anything, rows that see no key included.

SDPA is no stand-in there: it has no soft cap, and a row whose keys are all hidden gets from
it zeros, NaN or a mean whose gradient its backends disagree on, where the chain gives that
row what its own mask and fill make of it. So this computes the chain's steps:
``softmax(cap * tanh(scale q k^T / cap) + mask) @ v`` for a float mask added to the scores, or
with the scores replaced by ``fill`` (None: -inf) where a bool mask hides a key (``where`` / ``masked_fill``:
no gradient reaches a replaced score); the softmax and its sums in the accumulation dtype
(float32, float64 for float64), the result in the query's. K/V of fewer heads serve their query
heads in groups. The backward runs the same steps again under autograd on the saved inputs.
"""

from __future__ import annotations

import torch

from ..kernels.layout import accumulation_dtype, heads_last
from ..registration import autograd_recorded


def _attend(query, key, value, mask, scale: float, softcap: float, fill: float | None) -> torch.Tensor:
    acc = accumulation_dtype(query.dtype)
    fill = float("-inf") if fill is None else fill
    group = query.shape[1] // key.shape[1]
    key, value = (x.to(acc).repeat_interleave(group, dim=1) for x in (key, value))
    scores = (query.to(acc) @ key.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + mask.to(acc) if mask.is_floating_point() else scores.masked_fill(~mask, fill)
    return (torch.softmax(scores, dim=-1) @ value).to(query.dtype)


def forward(query, key, value, mask, scale: float, softcap: float, fill: float | None) -> torch.Tensor:
    """The chain's result, stored heads-last."""
    return heads_last(_attend(query, key, value, mask, scale, softcap, fill))


def backward(grad_out, query, key, value, mask, scale: float, softcap: float, fill: float | None):
    """(dq, dk, dv) of ``forward``, each stored heads-last."""
    inputs = [x.detach().requires_grad_() for x in (query, key, value)]
    with autograd_recorded():
        result = _attend(inputs[0], inputs[1], inputs[2], mask, scale, softcap, fill)
        grads = torch.autograd.grad(result, inputs, grad_out)
    return tuple(heads_last(grad) for grad in grads)
