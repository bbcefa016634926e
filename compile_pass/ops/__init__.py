"""The sliding-window op (FlashAttention-2 semantics), the op for masks read at run time, their
kernels, and the policy that picks a kernel."""

from . import context_parallel, runtime_mask
from .policy import POLICY, KernelChoice, KernelPolicy
from .window_attention import (
    sliding_window_attention,
    sliding_window_attention_backward,
    sliding_window_attention_forward,
)

__all__ = [
    "context_parallel",
    "KernelChoice",
    "KernelPolicy",
    "POLICY",
    "runtime_mask",
    "sliding_window_attention",
    "sliding_window_attention_backward",
    "sliding_window_attention_forward",
]
