"""The sliding-window attention op (FlashAttention-2 semantics) and its kernels."""

from .kernels import KernelChoice, kernel_choice
from .sliding_window import (
    sliding_window_attention,
    sliding_window_attention_backward,
    sliding_window_attention_forward,
)

__all__ = [
    "KernelChoice",
    "kernel_choice",
    "sliding_window_attention",
    "sliding_window_attention_backward",
    "sliding_window_attention_forward",
]
