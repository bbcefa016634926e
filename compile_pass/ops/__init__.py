"""The sliding-window attention op (FlashAttention-2 semantics) and its kernels."""

from . import mask_input
from .kernels import KernelChoice, kernel_choice
from .sliding_window import (
    sliding_window_attention,
    sliding_window_attention_backward,
    sliding_window_attention_forward,
)

__all__ = [
    "KernelChoice",
    "mask_input",
    "kernel_choice",
    "sliding_window_attention",
    "sliding_window_attention_backward",
    "sliding_window_attention_forward",
]
