"""The sliding-window attention op (FlashAttention-2 semantics) and its kernels."""

from .sliding_window import (
    sliding_window_attention,
    sliding_window_attention_backward,
    sliding_window_attention_forward,
)

__all__ = [
    "sliding_window_attention",
    "sliding_window_attention_backward",
    "sliding_window_attention_forward",
]
