"""SDPA as the checked op (``runtime_mask.py``) runs it where the band kernels do not take a
call: with the mask, causal, or without a mask. The policy's answer when no kernel is exact
and as fast is this one (``policy.SDPA_NAME``): in a rewritten graph the checked op, and in
a kept one SDPA itself.

Its backward is SDPA's own fused backward, never a matmul/softmax over (Sq, Sk) fp32 scores:
- where SDPA would run aten's fused CPU flash kernel, the forward calls that kernel as SDPA
  calls it (a bool mask as SDPA turns it into an additive one, K/V not repeated) and keeps its
  logsumexp, and the backward calls the kernel's backward: SDPA's result and gradients, bit
  for bit;
- elsewhere the backward runs SDPA again under autograd on the saved inputs and takes its
  gradients (one more forward: SDPA's own fused kernels, whichever SDPA picks there), with
  autograd recorded again inside the backward op's kernel (``registration.autograd_recorded``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ..kernels.chunked.plan import additive_mask
from ..kernels.layout import heads_last, new_logsumexp
from ..registration import autograd_recorded


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as SDPA hands it to its kernels: 0 where visible, -inf elsewhere."""
    return None if mask is None else additive_mask(mask, dtype)


def _fused_cpu(query, key, value, mask, is_causal, scale, enable_gqa) -> bool:
    """Whether SDPA would run aten's fused CPU flash kernel for this call."""
    if query.device.type != "cpu":
        return False
    choice = torch._fused_sdp_choice(query, key, value, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice == SDPBackend.FLASH_ATTENTION.value


def forward(query, key, value, mask, is_causal: bool, scale: float, enable_gqa: bool):
    """(out stored heads-last, logsumexp (B, H, Sq), whether aten's fused CPU kernel ran). The
    logsumexp is zeros where it did not (the backward does not read it then); the caller
    hands the flag to ``backward``, so both directions take the same way."""
    logsumexp = new_logsumexp(query)
    if _fused_cpu(query, key, value, mask, is_causal, scale, enable_gqa):
        result, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
            query, key, value, 0.0, is_causal, attn_mask=_additive(mask, query.dtype), scale=scale
        )
        return heads_last(result), logsumexp.copy_(lse), True
    result = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return heads_last(result), logsumexp.zero_(), False


def backward(
    grad_out, query, key, value, mask, is_causal: bool, out, logsumexp, scale: float, enable_gqa: bool, fused: bool
):
    """(dq, dk, dv) of ``forward``, each stored heads-last; ``fused`` as ``forward`` said."""
    if fused:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            0.0,
            is_causal,
            attn_mask=_additive(mask, query.dtype),
            scale=scale,
        )
    else:
        inputs = [x.detach().requires_grad_() for x in (query, key, value)]
        with autograd_recorded():
            result = F.scaled_dot_product_attention(
                inputs[0], inputs[1], inputs[2], attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
            )
            grads = torch.autograd.grad(result, inputs, grad_out)
    return tuple(heads_last(grad) for grad in grads)
