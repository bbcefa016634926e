"""The chunk backends of the chunked kernel (``chunked.py``) and its one-call form
(``whole_calls.py``).

A chunk backend computes exact attention of a batch of chunks with an additive mask,
returning (out, logsumexp), and its backward from that logsumexp. On the CPU that is aten's
fused flash kernel; elsewhere a matmul/softmax version that works on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .layout import accumulation_dtype


class ChunkBackend(NamedTuple):
    # (q, k, v, mask, scale, causal=False) -> (out, logsumexp); causal: row t sees keys <= t
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (grad_out, q, k, v, out, logsumexp, mask, scale, causal=False) -> (dq, dk, dv)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # Whether a call holds all scores of its chunks in memory at once (matmul/softmax).
    holds_scores: bool


def _fused_cpu_forward(q, k, v, mask, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _fused_cpu_backward(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, q, k, v, out, logsumexp, 0.0, causal, attn_mask=mask, scale=scale
    )


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, ...) -> (B, Hkv, Hq // Hkv, S, ...): query heads sharing one KV head."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def _math_probabilities(q, k, mask, scale, logsumexp=None, causal=False):
    """Scores in the accumulation dtype, grouped per KV head; returns (probs, logsumexp, q, k)."""
    acc = accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg = _grouped(q, kv_heads).to(acc)
    kg = k.unsqueeze(2).to(acc)
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale
    if mask is not None:
        # A per-batch (B, 1, rows, keys) mask lines up with the grouped (B, Hkv, g, rows, keys).
        scores = scores + (mask.unsqueeze(1) if mask.dim() == 4 else mask).to(acc)
    if causal:
        after_diagonal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(after_diagonal, float("-inf"))
    if logsumexp is None:
        logsumexp = torch.logsumexp(scores, dim=-1)
    else:
        logsumexp = _grouped(logsumexp, kv_heads)
    return torch.exp(scores - logsumexp.unsqueeze(-1)), logsumexp, qg, kg


def _math_forward(q, k, v, mask, scale, causal=False):
    probs, logsumexp, _, _ = _math_probabilities(q, k, mask, scale, causal=causal)
    out = torch.matmul(probs, v.unsqueeze(2).to(probs.dtype))
    return out.flatten(1, 2).to(q.dtype), logsumexp.flatten(1, 2)


def _math_backward(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False):
    probs, _, qg, kg = _math_probabilities(q, k, mask, scale, logsumexp, causal)
    kv_heads = k.shape[1]
    acc = probs.dtype
    grad_out_g = _grouped(grad_out, kv_heads).to(acc)
    out_g = _grouped(out, kv_heads).to(acc)
    vg = v.unsqueeze(2).to(acc)
    grad_probs = torch.matmul(grad_out_g, vg.transpose(-1, -2))
    # softmax backward: dS = P * (dP - rowsum(dO * O))
    grad_scores = probs * (grad_probs - (grad_out_g * out_g).sum(-1, keepdim=True)) * scale
    grad_q = torch.matmul(grad_scores, kg).flatten(1, 2)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg).sum(2)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out_g).sum(2)
    return grad_q.to(q.dtype), grad_k, grad_v


FUSED_CPU = ChunkBackend(_fused_cpu_forward, _fused_cpu_backward, holds_scores=False)
MATH = ChunkBackend(_math_forward, _math_backward, holds_scores=True)


def backend_for(device: torch.device) -> ChunkBackend:
    """The backend of a device. Its callers look it up on this module, so that a test that
    swaps it swaps it for all of them."""
    return FUSED_CPU if device.type == "cpu" else MATH
