"""The flash-attn package's FA2 kernels (its registered torch.library ops, flash-attn >= 2.7),
used only where a user asks for them: ``COMPILE_PASS_FLASH_ATTN=1``. torch's own FA2
(``torch_flash.py``) computes the same thing and needs no build.

Whether it runs (``unavailable_reason``) depends on the device, dtype and head_dim and on
process-wide facts (the GPU's compute capability, ROCm, flash-attn's version and backend,
the variable), never on tensor values, so the forward and the backward of a call agree.
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import torch

from .. import fa2
from . import varlen as fa2_varlen

USE_VARIABLE = "COMPILE_PASS_FLASH_ATTN"
MIN_VERSION = (2, 7, 0)  # the first release that registers its kernels as torch.library ops
# 2.7.0-2.7.2 check for sm8x or sm90 exactly; later releases accept any sm80 or newer.
ANY_SM80_OR_NEWER_FROM = (2, 7, 3)
_OP_NAMES = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


class FlashOps(NamedTuple):
    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    varlen_forward: torch._ops.OpOverload
    varlen_backward: torch._ops.OpOverload


@functools.cache
def release(version: str) -> tuple[int, int, int]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``."""
    major, minor, patch = (version.split(".") + ["0", "0"])[:3]
    return _leading_number(major), _leading_number(minor), _leading_number(patch)


def _leading_number(part: str) -> int:
    """``"4post1"`` -> 4; 0 where the part starts with no digit."""
    digits = re.match(r"\d*", part)
    return int(digits.group()) if digits and digits.group() else 0


@functools.cache
def _interface():
    """flash-attn's interface module, or None where flash-attn is missing or its compiled
    extension does not load (OSError: a library it links against is missing)."""
    try:
        import flash_attn.flash_attn_interface as interface
    except (ImportError, OSError):
        return None
    return interface


def _flash_ops() -> FlashOps:
    """flash-attn's ops for a call the policy routed here (``cannot`` found them loaded)."""
    ops = loaded_flash_attn()
    if ops is None:
        raise RuntimeError("flash-attn's ops are not loaded")
    return ops


def flash_attn_version() -> tuple[int, int, int] | None:
    if _interface() is None:
        return None
    import flash_attn

    return release(flash_attn.__version__)


@functools.cache
def loaded_flash_attn() -> FlashOps | None:
    """flash-attn's registered forward/backward ops (namespace ``flash_attn`` in every release
    since 2.7.0), or None where flash-attn is missing or older."""
    if _interface() is None:
        return None
    namespace = torch.ops.flash_attn
    try:
        return FlashOps(*(getattr(namespace, name).default for name in _OP_NAMES))
    except AttributeError:  # before 2.7 the interface registers no ops
        return None


def _runs_on(capability: tuple[int, int], version: tuple[int, int, int]) -> bool:
    major, minor = capability
    if version < ANY_SM80_OR_NEWER_FROM:
        return major == 8 or (major, minor) == (9, 0)
    return major >= 8


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why flash-attn cannot run this call, or None when it can."""
    if os.environ.get(USE_VARIABLE, "") != "1":
        return f"flash-attn is used only when asked for ({USE_VARIABLE}=1)"
    common = fa2.common_reason(device, dtype, head_dim, "flash-attn")
    if common is not None:
        return common
    version = flash_attn_version()
    if version is None or version < MIN_VERSION or loaded_flash_attn() is None:
        return "flash-attn >= 2.7 is not installed"
    if getattr(_interface(), "USE_TRITON_ROCM", False):
        return "flash-attn runs its Triton AMD backend (FLASH_ATTENTION_TRITON_AMD_ENABLE), which ignores window_size"
    capability = fa2.device_capability(device)
    if capability is None:  # common_reason turned away every other device
        return "flash-attn runs only on CUDA"
    if not _runs_on(capability, version):
        major, minor = capability
        return f"flash-attn {'.'.join(map(str, version))} does not run on sm{major}{minor}"
    return None


class FlashAttnCalls:
    """FA2's entry points through flash-attn's ops: its backward writes into buffers we pass."""

    name = "flash-attn"
    takes_softcap = True  # its ``softcap`` argument: FA2's soft-capped scores, forward and backward
    unavailable_reason = staticmethod(unavailable_reason)

    def dense_forward(self, q, k, v, left, right, scale, softcap=0.0):
        out, logsumexp, _, _ = _flash_ops().forward(q, k, v, 0.0, scale, False, left, right, softcap, None, False)
        return out, logsumexp

    def dense_backward(self, dout, q, k, v, out, lse, left, right, scale, softcap=0.0):
        # (B, S, H, D)-contiguous buffers FA2 writes into.
        grads = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)]
        _flash_ops().backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            *grads,
            0.0,
            scale,
            False,
            left,
            right,
            softcap,
            None,
            torch.are_deterministic_algorithms_enabled(),
            None,
        )
        return tuple(grads)

    def varlen_forward(self, q, k, v, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        out, logsumexp, _, _ = _flash_ops().varlen_forward(
            q,
            k,
            v,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            0.0,
            scale,
            False,
            part.left,
            part.right,
            softcap,
            None,
            False,
            None,
            None,
            None,
        )
        return out, logsumexp

    def varlen_backward(self, dout, q, k, v, out, lse, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        grads = [torch.empty_like(x) for x in (q, k, v)]
        _flash_ops().varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            *grads,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            0.0,
            scale,
            False,
            part.left,
            part.right,
            softcap,
            None,
            torch.are_deterministic_algorithms_enabled(),
            None,
        )
        return tuple(grads)


FLASH_ATTN = fa2.FA2Kernel(FlashAttnCalls())
