"""compile_pass: torch.compile graph rewrites for sliding-window and top-k attention."""

from .ops import sliding_window_attention

__all__ = ["sliding_window_attention"]
