"""The kernel policy: which kernel the op runs for a call, and whether that is known to be at
least as fast as SDPA.

One object answers both times the question is asked: the rules at graph time (from an SDPA
call's fake tensors: device, dtype, head_dim; where the answer is not fast they keep SDPA, so
a rewrite never makes a layer slower), and the op's router at run time (``route``: the same
choice, then what only real tensors tell, such as the padding's layout). The rules and the op
read ``POLICY``, the one instance, when they ask, so they cannot disagree; tests that tune the
chunked kernel or pretend to be on a GPU replace it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import chunked, flash
from .chunked import ChunkTuning


class KernelChoice(NamedTuple):
    kernel: str  # what runs, in words
    fast: bool  # known to be at least as fast as SDPA with the explicit band mask
    reason: str  # why it is not, when not; "" when fast
    uses_flash: bool = False  # flash-attn's kernels, where they compute the call exactly


class Route(NamedTuple):
    """The kernel of one call at run time, the same in its forward and its backward."""

    kernel: str  # "empty", "flash", "flash_varlen" or "chunked"
    layout: flash.VarlenLayout | None = None
    images: flash.VarlenPass | None = None  # the image rows' varlen call, on a flash route


@dataclass(frozen=True)
class KernelPolicy:
    chunking: ChunkTuning = ChunkTuning()  # passed to every chunked call

    def choose(
        self, device: torch.device | str, dtype: torch.dtype, head_dim: int, *, batch_masks: bool = False, blocks: bool = False,
        padding_and_segments: bool = False, same_lengths: bool = True,
    ) -> KernelChoice:
        """The kernel for ``device``, ``dtype`` and ``head_dim``, with (``batch_masks=True``) or
        without key padding / segment ids (``padding_and_segments``: both), with or without
        image blocks (``blocks``). Decided from these and process-wide facts only (the GPU's
        compute capability, ROCm, flash-attn's version and backend):
        - flash-attn usable: FA2's kernels, fast. With batch masks, FA2's varlen op; a row
          whose valid tokens are not one contiguous run (never the case for left or right
          padding or transformers' packing) runs the chunked kernel instead. Padding and
          segment ids together (a padded chunked layer) have no varlen form, nor has key
          padding with Sq != Sk (``same_lengths=False``: a decoding step, halo keys): not
          fast, since the chunked kernel there is the matmul/softmax fallback. Image blocks:
          their rows by one more varlen call (``flash.image_pass``), where the window is
          causal, each image one run of tokens and its keys clear of padding; else the
          chunked kernel;
        - on the CPU: the chunked kernel on aten's fused CPU flash kernel, fast (per score it
          is the kernel SDPA runs, on S * (w + chunk) scores instead of S * S);
        - anywhere else: the chunked kernel on matmul/softmax in fp32, not fast;
        - on the meta device (shapes only, nothing runs): counted as fast, so an offline
          report shows what the proof allows."""
        device = torch.device(device)
        if device.type == "meta":
            # A graph traced on the meta device (``python -m compile_pass inspect``) never runs:
            # it shows what the proof allows; the real device decides when the model compiles.
            return KernelChoice("chosen on the device the model runs on", True, "")
        flash_missing = flash.unavailable_reason(device, dtype, head_dim)
        if flash_missing is None and padding_and_segments:
            return KernelChoice(
                "chunked, matmul/softmax per chunk", False,
                "flash-attn's varlen op takes key padding or segment ids, not both, and the op's fallback there is slower than SDPA",
            )
        if flash_missing is None and batch_masks and not same_lengths:
            return KernelChoice(
                "chunked, matmul/softmax per chunk", False,
                "the op runs flash-attn's varlen op for Sq == Sk only, and its fallback for key padding with Sq != Sk is slower than SDPA",
            )
        if flash_missing is None:
            kernel = "flash-attn varlen" if batch_masks else "flash-attn"
            return KernelChoice(kernel + (", image rows by flash-attn varlen" if blocks else ""), True, "", uses_flash=True)
        if chunked.backend_for(device) is chunked.FUSED_CPU:
            return KernelChoice("chunked, aten's fused CPU flash kernel per chunk", True, "")
        return KernelChoice(
            "chunked, matmul/softmax per chunk",
            False,
            f"on {device.type} the op would run an unfused matmul/softmax fallback slower than SDPA ({flash_missing})",
        )

    def route(self, query, key, left: int, right: int, key_padding, segment_ids, block_ids=None) -> Route:
        """The kernel of one call of the op: ``choose``'s, unless FA2 would not compute this
        call exactly. Both directions see the same sizes, window and padding (saved by the
        forward; autograd refuses one written in between). The varlen layout is read from the
        padding at each call, never cached: a write torch's version counter does not see
        cannot leave a stale one."""
        batch, heads, seq_q, head_dim = query.shape
        seq_k = key.shape[2]
        if 0 in (batch, heads, seq_q, seq_k):
            return Route("empty")  # nothing to attend; FA2 would reject batch 0
        batch_masks = key_padding is not None or segment_ids is not None
        choice = self.choose(query.device, query.dtype, head_dim, batch_masks=batch_masks, blocks=block_ids is not None)
        if choice.uses_flash:
            images = None
            if block_ids is not None:
                images = flash.image_pass(block_ids, key_padding, left, right)
                if images is None:
                    return Route("chunked")
            if not batch_masks:
                if flash.window_is_exact(seq_q, seq_k, left, right):
                    return Route("flash", images=images)
            elif seq_q == seq_k:
                layout = flash.varlen_layout(key_padding, segment_ids, left, right)
                if layout is not None:
                    return Route("flash_varlen", layout, images)
        return Route("chunked")


POLICY = KernelPolicy()
