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
    for namespace in _NAMESPACES:
        ops = getattr(torch.ops, namespace)
        if hasattr(ops, "_flash_attn_forward") and hasattr(ops, "_flash_attn_backward"):
            return FlashOps(ops._flash_attn_forward.default, ops._flash_attn_backward.default)
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
