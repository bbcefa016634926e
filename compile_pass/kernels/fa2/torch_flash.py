"""torch's own FlashAttention-2 kernels with windows (``aten::_flash_attention_forward`` and
``_flash_attention_backward``), compiled into torch's CUDA wheels: the default kernel on a
GPU, with nothing to build.

The contract, read from torch 2.13's sources (shared/REFERENCE.md, section 9): dense
(B, S, H, D) inputs when ``cum_seq_q``/``cum_seq_k`` are None (logsumexp (B, H, Sq)), varlen
(T, H, D) inputs with int32 cumulative lengths otherwise (logsumexp (H, T)); fp16/bf16,
head_dim a multiple of 8 up to 256, sm80 or newer; K/V with fewer heads (GQA) as they are;
the window clamped and aligned as flash-attn 2.x does it (the same ``set_params_fprop``), so
``fa2.window_is_exact`` holds for it. Without dropout the backward reads no random state.

``torch.nn.attention.activate_flash_attention_impl("FA3")`` puts FA3 under these same ops;
FA3 clamps a window's right side differently, so an activated implementation other than
FA2 makes this kernel step aside (the next kernel in the policy runs the call).
"""

from __future__ import annotations

import torch

from .. import fa2
from . import varlen as fa2_varlen

NAME = "torch's FA2"


def _activated_impl() -> str | None:
    """The flash implementation activated under aten's flash ops in this process (None: FA2)."""
    return torch.nn.attention.current_flash_attention_impl()


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why torch's FA2 cannot run this call, or None when it can."""
    common = fa2.common_reason(device, dtype, head_dim, NAME)
    if common is not None:
        return common
    capability = fa2.device_capability(device)
    # Asked only where CUDA runs: a build with CUDA says whether it compiled FA2 in.
    if torch.cuda.is_available() and not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no FlashAttention kernels"
    if capability is None:  # common_reason turned away every other device
        return f"{NAME} runs only on CUDA"
    if capability[0] < 8:
        return f"{NAME} needs sm80 or newer, not sm{capability[0]}{capability[1]}"
    impl = _activated_impl()
    if impl is not None:
        return (
            f"aten's flash ops run {impl} in this process (activate_flash_attention_impl), "
            "which clamps windows otherwise"
        )
    return None


def _no_random_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (rng_state, unused) pair the backward takes; without dropout it reads neither."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, dtype=torch.uint64, device=device)


class TorchFlashCalls:
    """FA2's entry points through aten's ops. The backward allocates its gradients like its
    inputs; they are returned (B, S, H, D)- or (T, H, D)-contiguous, as the op's layouts need."""

    name = NAME
    takes_softcap = False
    unavailable_reason = staticmethod(unavailable_reason)

    def dense_forward(self, q, k, v, left, right, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        out, logsumexp, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            False,
            False,
            scale=scale,
            window_size_left=left,
            window_size_right=right,
        )
        return out, logsumexp

    def dense_backward(self, dout, q, k, v, out, lse, left, right, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        grads = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            None,
            None,
            q.shape[1],
            k.shape[1],
            0.0,
            False,
            *_no_random_state(q.device),
            scale=scale,
            window_size_left=left,
            window_size_right=right,
        )
        return tuple(grad.contiguous() for grad in grads)

    def varlen_forward(self, q, k, v, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        out, logsumexp, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            0.0,
            False,
            False,
            scale=scale,
            window_size_left=part.left,
            window_size_right=part.right,
        )
        return out, logsumexp

    def varlen_backward(self, dout, q, k, v, out, lse, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        grads = torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            part.cu_seqlens_q,
            part.cu_seqlens_k,
            part.max_seqlen_q,
            part.max_seqlen_k,
            0.0,
            False,
            *_no_random_state(q.device),
            scale=scale,
            window_size_left=part.left,
            window_size_right=part.right,
        )
        return tuple(grad.contiguous() for grad in grads)


# SHORT_KEYS (fa2.py) were measured with these kernels on an H200 (benchmarks/RESULTS.md, 2026-11-26).
TORCH_FA2 = fa2.FA2Kernel(TorchFlashCalls(), measured_on=("NVIDIA H200",))
