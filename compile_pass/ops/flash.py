"""The CUDA path: FlashAttention-2's own registered torch.library ops (flash-attn >= 2.7).

flash-attn is an optional extra. Whether it is used depends only on the
device, dtype and head_dim, never on tensor values, so forward and backward
always take the same path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
MIN_VERSION = (2, 7)
# flash-attn registered its ops under this namespace first, and renamed it later.
_NAMESPACES = ("flash_attn", "flashattn")


class FlashOps(NamedTuple):
    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    varlen_forward: torch._ops.OpOverload
    varlen_backward: torch._ops.OpOverload


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.cache
def flash_ops() -> FlashOps | None:
    """flash-attn's registered forward/backward ops, or None where it is missing or too old."""
    try:
        import flash_attn
        import flash_attn.flash_attn_interface  # noqa: F401  (registers the ops)
    except ImportError:
        return None
    if _version_tuple(flash_attn.__version__) < MIN_VERSION:
        return None
    names = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")
    for namespace in _NAMESPACES:
        ops = getattr(torch.ops, namespace)
        if all(hasattr(ops, name) for name in names):
            return FlashOps(*(getattr(ops, name).default for name in names))
    return None


def flash_supports(device_type: str, dtype: torch.dtype, head_dim: int, available: bool) -> bool:
    """The FA2 kernel's own limits: CUDA, fp16/bf16, head_dim <= 256 and a multiple of 8."""
    return (
        available
        and device_type == "cuda"
        and dtype in FLASH_DTYPES
        and head_dim <= FLASH_MAX_HEAD_DIM
        and head_dim % 8 == 0
    )


def use_flash(query: torch.Tensor) -> bool:
    if query.device.type != "cuda":  # skip the import attempt on CPU-only machines
        return False
    return flash_supports(query.device.type, query.dtype, query.shape[-1], flash_ops() is not None)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def flash_forward(query, key, value, left, right, scale):
    """(B, H, S, D) in and out; FA2 works on the (B, S, H, D) view, no copy for heads-last storage."""
    ops = flash_ops()
    q, k, v = (_last_dim_contiguous(x.transpose(1, 2)) for x in (query, key, value))
    out, logsumexp, _, _ = ops.forward(
        q, k, v, 0.0, scale, right == 0, left, right, 0.0, None, False
    )
    # FA2 returns (B, S, H, D) contiguous and (B, H, Sq) fp32: the layouts of layout.py.
    return out.transpose(1, 2), logsumexp


def flash_backward(grad_out, query, key, value, out, logsumexp, left, right, scale):
    ops = flash_ops()
    dout, q, k, v, o = (
        _last_dim_contiguous(x.transpose(1, 2)) for x in (grad_out, query, key, value, out)
    )
    grad_q, grad_k, grad_v = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    ops.backward(
        dout, q, k, v, o, logsumexp, grad_q, grad_k, grad_v,
        0.0, scale, right == 0, left, right, 0.0, None, False, None,
    )
    return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)


class VarlenLayout(NamedTuple):
    """Where the sequences of a padded or packed batch lie once flattened to (B * S) tokens."""

    tokens: torch.Tensor  # int64 indices into the flattened (B * S) tokens, sequence by sequence
    cu_seqlens: torch.Tensor  # int32 (n_sequences + 1,) cumulative lengths
    max_seqlen: int


def varlen_layout(key_padding: torch.Tensor | None, segment_ids: torch.Tensor | None) -> VarlenLayout | None:
    """The varlen layout of self-attention over a padded (key_padding) or packed (segment_ids)
    batch, or None where FA2's varlen op cannot express the mask: both given, a row whose
    valid tokens are not one contiguous run, or segments that are not contiguous runs.

    Within a contiguous run, distances between tokens are unchanged by unpadding, so the
    window means the same; a padded query row (no visible key) simply has no token.
    """
    if (key_padding is None) == (segment_ids is None):
        return None
    if key_padding is not None:
        batch, seq = key_padding.shape
        counts = key_padding.sum(dim=1)
        positions = torch.arange(seq, device=key_padding.device)
        first = torch.where(key_padding, positions, seq).amin(dim=1)
        last = torch.where(key_padding, positions, -1).amax(dim=1)
        if bool(((last - first + 1) != counts)[counts > 0].any()):
            return None  # a hole inside a row: unpadding would change distances
        lengths = counts[counts > 0]
        tokens = key_padding.reshape(-1).nonzero().squeeze(1)
    else:
        batch, seq = segment_ids.shape
        if bool((segment_ids.diff(dim=1) < 0).any()):
            return None  # a segment id that comes back: not one contiguous run
        starts = torch.ones(batch, seq, dtype=torch.bool, device=segment_ids.device)
        starts[:, 1:] = segment_ids.diff(dim=1) != 0
        sequence = (starts.reshape(-1).cumsum(0) - 1)  # which sequence each token belongs to
        lengths = torch.bincount(sequence)
        tokens = torch.arange(batch * seq, device=segment_ids.device)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return VarlenLayout(tokens, cu_seqlens, int(lengths.max()) if lengths.numel() else 0)


def _tokens(x: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """(B, H, S, D) -> the layout's tokens as (T, H, D)."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch * seq, heads, dim)[layout.tokens]


def _untokens(tokens: torch.Tensor, like: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """(T, H, D) back to a zero-filled (B, H, S, D) view of heads-last storage."""
    batch, heads, seq, dim = like.shape
    full = tokens.new_zeros(batch * seq, heads, dim)
    full[layout.tokens] = tokens
    return full.view(batch, seq, heads, dim).transpose(1, 2)


def flash_varlen_forward(query, key, value, left, right, scale, layout: VarlenLayout):
    """Self-attention over a padded or packed batch with FA2's varlen op; rows without a token get
    zeros and an lse of +inf."""
    ops = flash_ops()
    q, k, v = (_tokens(x, layout) for x in (query, key, value))
    cu, longest = layout.cu_seqlens, layout.max_seqlen
    out, logsumexp, _, _ = ops.varlen_forward(
        q, k, v, cu, cu, longest, longest, 0.0, scale, right == 0, left, right, 0.0, None, False, None, None, None
    )
    batch, heads, seq, _ = query.shape
    full_lse = logsumexp.new_full((batch * seq, heads), float("inf"))
    full_lse[layout.tokens] = logsumexp.t()
    return _untokens(out, query, layout), full_lse.view(batch, seq, heads).permute(0, 2, 1).contiguous()


def flash_varlen_backward(grad_out, query, key, value, out, logsumexp, left, right, scale, layout: VarlenLayout):
    ops = flash_ops()
    dout, q, k, v, o = (_tokens(x, layout) for x in (grad_out, query, key, value, out))
    lse = logsumexp.permute(0, 2, 1).reshape(-1, logsumexp.shape[1])[layout.tokens].t().contiguous()
    grad_q, grad_k, grad_v = (torch.empty_like(x) for x in (q, k, v))
    cu, longest = layout.cu_seqlens, layout.max_seqlen
    ops.varlen_backward(
        dout, q, k, v, o, lse, grad_q, grad_k, grad_v, cu, cu, longest, longest,
        0.0, scale, right == 0, left, right, 0.0, None, False, None,
    )
    return tuple(_untokens(g, like, layout) for g, like in zip((grad_q, grad_k, grad_v), (query, key, value)))
