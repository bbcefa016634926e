"""The chunk backends of the chunked kernel (``chunked.py``) and its one-call form
(``whole_calls.py``).

A chunk backend computes exact attention of a batch of chunks with an additive mask,
returning (out, logsumexp), and its backward from that logsumexp. On the CPU that is aten's
fused flash kernel; elsewhere a matmul/softmax version that works on every device. Soft-capped
scores (FA2's ``softcap``), which aten's kernel does not compute, run the matmul/softmax
version on every device (``softcapped``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..layout import accumulation_dtype


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
    scores = _masked(torch.matmul(qg, kg.transpose(-1, -2)).mul_(scale), mask, causal)
    if logsumexp is None:
        logsumexp = torch.logsumexp(scores, dim=-1)
    else:
        logsumexp = _grouped(logsumexp, kv_heads)
    return scores.sub_(logsumexp.unsqueeze(-1)).exp_(), logsumexp, qg, kg


def _masked(scores: torch.Tensor, mask, causal: bool) -> torch.Tensor:
    """``scores`` (a fresh tensor) with the additive mask added and, where ``causal``, the keys
    after each row's own hidden (the last row aligned with the last key), in place."""
    if mask is not None:
        # A per-batch (B, 1, rows, keys) mask lines up with the grouped (B, Hkv, g, rows, keys).
        scores = scores.add_((mask.unsqueeze(1) if mask.dim() == 4 else mask).to(scores.dtype))
    if causal:
        rows, keys = scores.shape[-2:]
        after_diagonal = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).triu(1 + keys - rows)
        scores = scores.masked_fill_(after_diagonal, float("-inf"))
    return scores


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
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out_g).sum(2)
    # softmax backward: dS = P * (dP - rowsum(dO * O))
    grad_probs = torch.matmul(grad_out_g, vg.transpose(-1, -2))
    grad_scores = probs.mul_(grad_probs.sub_((grad_out_g * out_g).sum(-1, keepdim=True))).mul_(scale)
    grad_q = torch.matmul(grad_scores, kg).flatten(1, 2)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg).sum(2)
    return grad_q.to(q.dtype), grad_k, grad_v


# Soft-capped scores t = cap * tanh(s / cap) lie in [-cap, cap]: up to this cap exp(t) needs no
# shift by the row max (e^60 summed over 10^9 keys and e^-60 are normal fp32 numbers), which
# saves a pass over the scores.
UNSHIFTED_SOFTCAP = 60.0


def _capped_tanh(qg, kg, scale: float, softcap: float) -> torch.Tensor:
    """tanh(scale * q.k / softcap) of grouped q and k (the scale folded into q), a fresh tensor."""
    return torch.matmul(qg * (scale / softcap), kg.transpose(-1, -2)).tanh_()


def _capped_forward_math(q, k, v, mask, scale, causal=False, *, softcap):
    acc = accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg, kg, vg = _grouped(q, kv_heads).to(acc), k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)
    weights = _masked(_capped_tanh(qg, kg, scale, softcap).mul_(softcap), mask, causal)
    shift = None
    if softcap > UNSHIFTED_SOFTCAP:
        shift = weights.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # a row without keys: 0
        weights = weights.sub_(shift)
    total = weights.exp_().sum(-1, keepdim=True)
    out = torch.matmul(weights, vg).div_(total)
    logsumexp = total.log_() if shift is None else total.log_().add_(shift)
    return out.flatten(1, 2).to(q.dtype), logsumexp[..., 0].flatten(1, 2)


def _capped_backward_math(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False, *, softcap):
    acc = accumulation_dtype(q.dtype)
    kv_heads = k.shape[1]
    qg, kg, vg = _grouped(q, kv_heads).to(acc), k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)
    grad_out_g, out_g = _grouped(grad_out, kv_heads).to(acc), _grouped(out, kv_heads).to(acc)
    tanh = _capped_tanh(qg, kg, scale, softcap)
    probs = _masked(tanh * softcap, mask, causal).sub_(_grouped(logsumexp, kv_heads).unsqueeze(-1)).exp_()
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out_g).sum(2)
    # softmax backward, dT = P * (dP - rowsum(dO * O)); through the cap, dS = dT * (1 - tanh^2).
    grad_capped = torch.matmul(grad_out_g, vg.transpose(-1, -2))
    grad_capped = grad_capped.sub_((grad_out_g * out_g).sum(-1, keepdim=True)).mul_(probs)
    grad_scores = torch.ops.aten.tanh_backward(grad_capped, tanh)
    grad_q = torch.matmul(grad_scores, kg).mul_(scale).flatten(1, 2)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), qg).sum(2).mul_(scale)
    return grad_q.to(q.dtype), grad_k, grad_v


FUSED_CPU = ChunkBackend(_fused_cpu_forward, _fused_cpu_backward, holds_scores=False)
MATH = ChunkBackend(_math_forward, _math_backward, holds_scores=True)


# Soft-capped calls of at least this many scores run their math compiled by inductor (once per
# process, dynamic shapes), which fuses the passes over the scores the eager math makes one by
# one: a (8, 768, 1024) chunk's fwd+bwd took 0.21 s compiled, 0.33 s eager, and the whole chain
# compiled 0.18 s for its scores (CPU time, fp32, 2 threads). Smaller calls (the fixed cost
# would show), calls off the CPU, and every call once inductor has failed to compile here,
# run the same math eagerly.
COMPILED_SOFTCAP_SCORES = 1 << 20


class _CompiledMath:
    """One math function of soft-capped chunks, run compiled where that pays (above)."""

    broken = False  # inductor failed once in this process: the eager math from then on

    def __init__(self, math):
        self.math = math
        self.compiled = None

    def __call__(self, *args, softcap: float, scores: int):
        device = args[0].device
        if scores >= COMPILED_SOFTCAP_SCORES and device.type == "cpu" and not _CompiledMath.broken:
            if self.compiled is None:
                self.compiled = torch.compile(self.math, dynamic=True, fullgraph=True)
            try:
                return self.compiled(*args, softcap=softcap)
            except Exception as error:  # noqa: BLE001 - the eager math computes the same thing
                _CompiledMath.broken = True
                warnings.warn(
                    f"compile_pass: soft-capped chunks run eagerly, inductor failed on them: {error}", stacklevel=2
                )
        return self.math(*args, softcap=softcap)


_CAPPED_FORWARD = _CompiledMath(_capped_forward_math)
_CAPPED_BACKWARD = _CompiledMath(_capped_backward_math)


def _scores(q: torch.Tensor, k: torch.Tensor) -> int:
    return q.numel() // q.shape[-1] * k.shape[-2]


# A causal call (rows aligned with keys from the first) runs in blocks of this many rows, each
# over the keys up to its last row: the matmul/softmax math scores every key it is given, so
# one call would score the whole square where the causal band holds half of it. Causal
# soft-capped calls, fp32 and bf16, 8 heads of 64, fwd+bwd: 128 rows took 0.10 s at S = 1024
# and 0.38 s at 2048, 256 rows 0.11 and 0.40 s, 512 rows 0.14 and 0.48 s (CPU time, one thread).
CAUSAL_BLOCK_ROWS = 128


def _causal_blocks(rows: int, causal: bool) -> list[tuple[int, int]]:
    """[first, stop) of each block of rows a call runs in: the whole call where not causal."""
    if not causal:
        return [(0, rows)]
    return [(first, min(rows, first + CAUSAL_BLOCK_ROWS)) for first in range(0, rows, CAUSAL_BLOCK_ROWS)]


def _block_mask(mask, first: int, stop: int):
    """A (..., rows, keys) additive mask's part for rows [first, stop) and keys [0, stop)."""
    return None if mask is None else mask[..., first:stop, :stop]


def _capped_forward(q, k, v, mask, scale, causal=False, *, softcap):
    blocks = _causal_blocks(q.shape[-2], causal)
    if len(blocks) == 1:
        return _CAPPED_FORWARD(q, k, v, mask, scale, causal, softcap=softcap, scores=_scores(q, k))
    results = []
    for first, stop in blocks:
        q_b, k_b, v_b = q[..., first:stop, :], k[..., :stop, :], v[..., :stop, :]
        mask_b = _block_mask(mask, first, stop)
        results.append(_CAPPED_FORWARD(q_b, k_b, v_b, mask_b, scale, causal, softcap=softcap, scores=_scores(q_b, k_b)))
    return torch.cat([out for out, _ in results], dim=-2), torch.cat([lse for _, lse in results], dim=-1)


def _capped_backward(grad_out, q, k, v, out, logsumexp, mask, scale, causal=False, *, softcap):
    blocks = _causal_blocks(q.shape[-2], causal)
    if len(blocks) == 1:
        scores = _scores(q, k)
        return _CAPPED_BACKWARD(grad_out, q, k, v, out, logsumexp, mask, scale, causal, softcap=softcap, scores=scores)
    grad_qs = []
    grad_k = grad_v = None
    for first, stop in blocks:
        rows = slice(first, stop)
        inputs = (grad_out[..., rows, :], q[..., rows, :], k[..., :stop, :], v[..., :stop, :], out[..., rows, :])
        mask_b = _block_mask(mask, first, stop)
        grads = _CAPPED_BACKWARD(
            *inputs, logsumexp[..., rows], mask_b, scale, causal, softcap=softcap, scores=_scores(inputs[1], inputs[2])
        )
        grad_qs.append(grads[0])
        if grad_k is None:  # sums over every key, in the blocks' dtype
            grad_k = grads[1].new_zeros(grads[1].shape[:-2] + k.shape[-2:])
            grad_v = grads[2].new_zeros(grads[2].shape[:-2] + v.shape[-2:])
        grad_k[..., :stop, :] += grads[1]
        grad_v[..., :stop, :] += grads[2]
    return torch.cat(grad_qs, dim=-2), grad_k, grad_v


@functools.lru_cache(maxsize=8)
def softcapped(softcap: float) -> ChunkBackend:
    """The matmul/softmax backend with scores soft-capped by ``softcap`` (> 0), on any device."""
    return ChunkBackend(
        functools.partial(_capped_forward, softcap=softcap),
        functools.partial(_capped_backward, softcap=softcap),
        holds_scores=True,
    )


def backend_for(device: torch.device) -> ChunkBackend:
    """The backend of a device. Its callers look it up on this module, so that a test that
    swaps it swaps it for all of them."""
    return FUSED_CPU if device.type == "cpu" else MATH
