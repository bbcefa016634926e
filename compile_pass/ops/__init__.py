"""The op itself: the sliding-window op (FlashAttention-2 semantics), the op for masks read at
run time and the certificates other graphs file, sinks, and SDPA as the checked op runs it.
Its kernels and the policy that picks one are in ``compile_pass.kernels``; ``POLICY`` is
named here as well, where the op's users have always found it."""

from ..kernels.policy import POLICY, KernelChoice, KernelPolicy
from . import runtime_mask
from .window_attention import (
    sliding_window_attention,
    sliding_window_attention_backward,
    sliding_window_attention_forward,
)

__all__ = [
    "KernelChoice",
    "KernelPolicy",
    "POLICY",
    "runtime_mask",
    "sliding_window_attention",
    "sliding_window_attention_backward",
    "sliding_window_attention_forward",
]
