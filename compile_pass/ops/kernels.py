"""Which kernel the op runs for a call, and whether it is known to be at least as fast as SDPA.

The graph rewrite reads device, dtype and head_dim off the fake tensors of an SDPA call and
asks ``kernel_choice``; where the answer is not fast it keeps SDPA, so the rewrite never
makes a layer slower.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import chunked, flash


class KernelChoice(NamedTuple):
    kernel: str  # what runs, in words
    fast: bool  # known to be at least as fast as SDPA with the explicit band mask
    reason: str  # why it is not, when not; "" when fast


def kernel_choice(
    device: torch.device | str, dtype: torch.dtype, head_dim: int, *, batch_masks: bool = False
) -> KernelChoice:
    """The kernel ``sliding_window_attention_forward`` runs on ``device`` for ``dtype`` and
    ``head_dim``, with (``batch_masks=True``) or without key padding / segment ids.

    Decided from these and process-wide facts only (the GPU's compute capability, ROCm,
    flash-attn's version and backend), as the op decides:
    - flash-attn usable: FA2's kernels, fast. With batch masks, FA2's varlen op; a row whose
      valid tokens are not one contiguous run (never the case for left or right padding or
      transformers' packing) runs the chunked kernel instead;
    - on the CPU: the chunked kernel on aten's fused CPU flash kernel, fast (per score it is
      the kernel SDPA runs, on S * (w + chunk) scores instead of S * S);
    - anywhere else: the chunked kernel on matmul/softmax in fp32, not fast;
    - on the meta device (shapes only, nothing runs): counted as fast, so an offline report
      shows what the proof allows.
    """
    device = torch.device(device)
    if device.type == "meta":
        # A graph traced on the meta device (``python -m compile_pass inspect``) never runs:
        # it shows what the proof allows; the real device decides when the model compiles.
        return KernelChoice("chosen on the device the model runs on", True, "")
    flash_missing = flash.unavailable_reason(device, dtype, head_dim)
    if flash_missing is None:
        return KernelChoice("flash-attn varlen" if batch_masks else "flash-attn", True, "")
    if chunked.backend_for(device) is chunked.FUSED_CPU:
        return KernelChoice("chunked, aten's fused CPU flash kernel per chunk", True, "")
    return KernelChoice(
        "chunked, matmul/softmax per chunk",
        False,
        f"on {device.type} the op would run an unfused matmul/softmax fallback slower than SDPA ({flash_missing})",
    )
