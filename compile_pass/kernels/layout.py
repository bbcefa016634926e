"""Tensor layouts shared by the kernels and the fake implementations.

Outputs and gradients are (batch, heads, seq, dim) views of (batch, seq, heads, dim)
storage: what FlashAttention-2 and aten's CPU flash kernel produce, and what
``out.transpose(1, 2).reshape(batch, seq, heads * dim)`` in a model reads
without a copy. Real and fake implementations both allocate through here, so
their strides agree.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def new_heads_last(
    batch: int, heads: int, seq: int, dim: int, *, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Uninitialised (batch, heads, seq, dim) tensor stored as (batch, seq, heads, dim)."""
    return torch.empty((batch, seq, heads, dim), dtype=dtype, device=device).transpose(1, 2)


def empty_like_heads_last(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    batch, heads, seq, dim = like.shape
    return new_heads_last(batch, heads, seq, dim, dtype=dtype or like.dtype, device=like.device)


def heads_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` where it is stored heads-last already (as aten's CPU kernel returns results for
    heads-last inputs), else a heads-last copy."""
    return x if x.transpose(1, 2).is_contiguous() else empty_like_heads_last(x).copy_(x)


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied only if its last dimension is strided: aten's CPU flash kernel reads
    it as contiguous whatever its stride, and FA2 rejects it."""
    return x if x.stride(-1) == 1 else x.contiguous()


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and cross-chunk sums are kept at least in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_logsumexp(query: torch.Tensor) -> torch.Tensor:
    """Uninitialised (batch, heads, seq_q) row logsumexp, contiguous."""
    batch, heads, seq_q, _ = query.shape
    return torch.empty((batch, heads, seq_q), dtype=accumulation_dtype(query.dtype), device=query.device)


def check_scale(scale: float) -> None:
    """The scale must be a positive finite number: aten's causal kernel, which runs the rows at
    the start of a causal window, and SDPA's ``is_causal`` path give NaN for 0 and negative
    scales where SDPA with a mask gives numbers (ValueError)."""
    torch._check_value(
        math.isfinite(scale) and scale > 0, lambda: f"scale must be a positive finite number, got {scale!r}"
    )


def check_softcap(softcap: float) -> None:
    """FA2's ``softcap``: a finite number >= 0, 0 for none (ValueError otherwise)."""
    torch._check_value(
        math.isfinite(softcap) and softcap >= 0, lambda: f"softcap must be a finite number >= 0, got {softcap!r}"
    )


def _require(condition, message) -> None:
    """``torch._check``, returning at once for a plain True: the real op checks every call, and
    at short lengths the checks' own cost showed (a symbolic condition is checked without a
    guard, as before). ``message`` is a callable that makes the text only when the check fails,
    before this returns."""
    if condition is not True:
        torch._check(condition, message)


def check_attention_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    scale: float = 1.0,
    block_ids: torch.Tensor | None = None,
) -> None:
    """Shape, dtype, device and scale rules of the op; symbolic sizes are checked without guards."""
    check_scale(scale)
    _require(
        segment_ids is None or block_ids is None,
        lambda: "segment_ids and block_ids together are not supported (image rows would ignore the segments)",
    )
    for name, ids in (("segment_ids", segment_ids), ("block_ids", block_ids)):
        if ids is None:
            continue
        _require(
            ids.dim() == 2 and not ids.is_floating_point(),
            lambda name=name, ids=ids: f"{name} must be a 2-D integer tensor, got {ids.dtype} {tuple(ids.shape)}",
        )
        _require(
            ids.shape[0] == key.shape[0] and ids.shape[1] == key.shape[2] and query.shape[2] == key.shape[2],
            lambda name=name, ids=ids: f"{name} shape {tuple(ids.shape)} is not (batch, seq) with Sq == Sk",
        )
    if key_padding is not None:
        _require(
            key_padding.dtype == torch.bool and key_padding.dim() == 2,
            lambda: f"key_padding must be a 2-D bool tensor, got {key_padding.dtype} {tuple(key_padding.shape)}",
        )
        _require(
            key_padding.shape[0] == key.shape[0] and key_padding.shape[1] == key.shape[2],
            lambda: f"key_padding shape {tuple(key_padding.shape)} is not (batch, seq_k)",
        )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _require(
            tensor.dim() == 4,
            lambda name=name, tensor=tensor: (
                f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(tensor.shape)}"
            ),
        )
    _require(
        query.dtype in SUPPORTED_DTYPES,
        lambda: f"dtype {query.dtype} is not supported; use one of {SUPPORTED_DTYPES}",
    )
    _require(
        query.dtype == key.dtype == value.dtype,
        lambda: f"query, key, value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}",
    )
    _require(
        query.device == key.device == value.device,
        lambda: f"query, key, value devices differ: {query.device}, {key.device}, {value.device}",
    )
    _require(
        key.shape == value.shape,
        lambda: f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}",
    )
    _require(
        query.shape[0] == key.shape[0],
        lambda: f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}",
    )
    _require(
        query.shape[3] == key.shape[3],
        lambda: f"head_dim differs: query {query.shape[3]}, key {key.shape[3]}",
    )
    _require(
        query.shape[1] % key.shape[1] == 0,
        lambda: f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})",
    )


def check_sinks(query: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """Sinks are a floating tensor on the query's device: one logit per query head (heads,), or
    one per (batch, head, query row) (batch, heads, seq_q)."""
    if sinks is None:
        return
    batch, heads, seq_q = query.shape[:3]
    _require(
        sinks.dim() in (1, 3) and sinks.is_floating_point(),
        lambda: (
            "sinks must be a floating tensor of one logit per query head (heads,) or per row (batch, heads, seq_q), "
            f"got {sinks.dtype} {tuple(sinks.shape)}"
        ),
    )
    if sinks.dim() == 1:
        _require(
            sinks.shape[0] == heads,
            lambda: f"sinks has {sinks.shape[0]} logits for {heads} query heads",
        )
    else:
        _require(
            sinks.shape[0] == batch and sinks.shape[1] == heads and sinks.shape[2] == seq_q,
            lambda: f"sinks of shape {tuple(sinks.shape)} are not one per (batch, head, row): {(batch, heads, seq_q)}",
        )
    _require(sinks.device == query.device, lambda: f"sinks are on {sinks.device}, the query on {query.device}")


def block_extents(block_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(row, first, last, count) of each (batch row, id >= 0) of a (B, S) block-id tensor, on
    its device: the batch row, the id's first and last position, and how many positions hold
    it (last - first + 1 when the id is one run). Empty tensors where no id is >= 0."""
    rows, positions = (block_ids >= 0).nonzero(as_tuple=True)
    pairs = torch.stack([rows, block_ids[rows, positions].long()], dim=1)
    unique, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    blocks = len(unique)
    first = positions.new_full((blocks,), block_ids.shape[1]).scatter_reduce(0, inverse, positions, "amin")
    last = positions.new_full((blocks,), -1).scatter_reduce(0, inverse, positions, "amax")
    count = torch.zeros(blocks, dtype=torch.int64, device=block_ids.device).scatter_add_(
        0, inverse, torch.ones_like(inverse)
    )
    return unique[:, 0], first, last, count
