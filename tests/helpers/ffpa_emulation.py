"""A CPU stand-in for ffpa-attn's public Python interface, the ``ffpa_attn`` package.

Written from its documented call contract (ffpa-attn 0.2.4: the docstring of
``ffpa_attn_varlen_func`` in ``ffpa_attn_interface.py`` and the checks its CuTe-DSL entry runs,
``cute/__init__.py``): packed (tokens, heads, head_dim) q/k/v of one dtype, fp16 or bf16; int32
cumulative lengths from 0 to the tokens, one list for queries and one for keys; int maxima at
least every length; query heads a multiple of K/V heads, fewer K/V heads only with
``enable_gqa``; head_dim 320-1024 with the same head_dim for q, k and v (a multiple of 32 off
sm90's path, which takes 320-512), on sm80 or newer; each sequence attended fully or, with
``causal``, with the mask aligned to its keys' end (query i of Sq sees keys j <= i + Sk - Sq);
``softmax_scale`` 1 / sqrt(head_dim) when None; no dropout and no other option. It returns the
output (tokens, heads, head_dim) in the inputs' dtype and, with ``return_lse``, the row
logsumexp (heads, tokens) fp32, autograd running through both.

The arithmetic is fp64 attention under torch's autograd, rounded once to the output's dtype:
only the contract matters. Rows that would see no key (a causal sequence with more queries
than keys, or keys of none) are not modelled and raise NotImplementedError, as any option the
real interface takes and compile_pass does not use. ``calls`` counts the calls, those that
record a graph (the backward's recomputation) apart; ``device_capability`` is the GPU it plays.
"""

from __future__ import annotations

import collections
import itertools
import math
import sys
import types

import torch

VERSION = "0.2.4"
calls: collections.Counter = collections.Counter()
# The GPU this stand-in plays, (major, minor); tests set it.
device_capability = (9, 0)


def _not_emulated(condition: bool, what: str) -> None:
    if not condition:
        raise NotImplementedError(f"ffpa_attn emulation: {what} is not emulated")


def _check_head_dim(head_dim: int, v_head_dim: int) -> None:
    """``_require_cute_supported``: sm80 or newer; sm90 takes 320-512 on its own path, every other
    case (other GPUs, head_dim above 512) the Split-D path: 320-1024 in multiples of 32."""
    major, _ = device_capability
    if major < 8:
        raise NotImplementedError(f"cutedsl backend requires compute capability >= 8.0; got {major}.x")
    if not 320 <= head_dim <= 1024:
        raise NotImplementedError(f"ffpa_attn_varlen_func cutedsl supports head_dim in [320, 1024]; got {head_dim}")
    if not (major == 9 and head_dim <= 512) and head_dim % 32:
        raise NotImplementedError(f"cutedsl SM80 Split-D fallback requires head_dim divisible by 32; got {head_dim}")
    if v_head_dim != head_dim:
        raise NotImplementedError("cutedsl backend requires q/k/v to share head_dim")


def _bounds(cu_seqlens: torch.Tensor, tokens: int, max_seqlen, name: str) -> list[int]:
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen for {name} must be an int, got {type(max_seqlen).__name__}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"{name} must rise from 0 to the {tokens} tokens, got {bounds}")
    if max(b - a for a, b in itertools.pairwise(bounds)) > max_seqlen:
        raise RuntimeError(f"max_seqlen ({max_seqlen}) must be >= the max sequence length in {name}")
    return bounds


def _attend(q, k, v, scale: float, causal: bool):
    """One sequence, fp64 under autograd: q (Sq, H, D), k/v (Sk, Hk, D) -> out (Sq, H, D),
    lse (H, Sq)."""
    seq_q, seq_k = q.shape[0], k.shape[0]
    _not_emulated(seq_k > 0 and not (causal and seq_q > seq_k), "a row that sees no key")
    groups = q.shape[1] // k.shape[1]
    keys, values = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    if causal:
        sees = torch.arange(seq_k)[None, :] <= torch.arange(seq_q)[:, None] + (seq_k - seq_q)
        scores = scores.masked_fill(~sees, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), values)
    return out, lse


def ffpa_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    enable_gqa=False,
    return_lse=False,
    **kwargs,
):
    calls["varlen"] += 1
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        calls["varlen recording a graph"] += 1
    _not_emulated(not kwargs, f"the options {sorted(kwargs)}")
    if dropout_p != 0.0:
        raise NotImplementedError("ffpa_attn_varlen_func only supports dropout_p=0.0")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("ffpa_attn_varlen_func: q/k/v must be 3-D packed [T, H, D]")
    if k.shape != v.shape:
        raise ValueError("ffpa_attn_varlen_func: k/v must share shape")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"ffpa_attn_varlen_func: q/k/v must share one dtype, fp16 or bf16, got {q.dtype} {k.dtype} {v.dtype}"
        )
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise TypeError("ffpa_attn_varlen_func: cu_seqlens_q/cu_seqlens_k must be int32")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 2:
        raise ValueError("ffpa_attn_varlen_func: cu_seqlens_q and cu_seqlens_k must share length >= 2")
    heads, kv_heads = q.shape[1], k.shape[1]
    if (not enable_gqa and heads != kv_heads) or heads % kv_heads:
        raise ValueError(f"ffpa_attn_varlen_func: {heads} query heads against {kv_heads} key/value heads")
    _check_head_dim(q.shape[-1], v.shape[-1])
    bounds_q = _bounds(cu_seqlens_q, q.shape[0], max_seqlen_q, "cu_seqlens_q")
    bounds_k = _bounds(cu_seqlens_k, k.shape[0], max_seqlen_k, "cu_seqlens_k")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    outs, lses = [], []
    for sequence in range(len(bounds_q) - 1):
        rows, keys = (
            slice(bounds_q[sequence], bounds_q[sequence + 1]),
            slice(bounds_k[sequence], bounds_k[sequence + 1]),
        )
        if rows.start == rows.stop:  # an empty sequence: no work
            continue
        out, lse = _attend(q[rows], k[keys], v[keys], scale, causal)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype) if outs else q.new_empty(0, heads, q.shape[-1])
    lse = torch.cat(lses, dim=1).float() if lses else torch.empty(heads, 0, device=q.device)
    return (out, lse) if return_lse else out


def install(monkeypatch, version: str = VERSION) -> None:
    """This stand-in as ``ffpa_attn`` (its version and the varlen function) for one test, with
    the CuTe-DSL backend's module ``ffpa_attn.cute`` (empty: the function here needs none)."""
    package = types.ModuleType("ffpa_attn")
    package.__version__ = version
    package.ffpa_attn_varlen_func = ffpa_attn_varlen_func
    package.cute = types.ModuleType("ffpa_attn.cute")
    monkeypatch.setitem(sys.modules, "ffpa_attn", package)
    monkeypatch.setitem(sys.modules, "ffpa_attn.cute", package.cute)
