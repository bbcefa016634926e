"""compile_pass: torch.compile graph rewrites for sliding-window and top-k attention."""

from .backend import backend, enable, rewrite
from .ops import sliding_window_attention
from .report import Decision, Report, decisions

__all__ = ["Decision", "Report", "backend", "decisions", "enable", "rewrite", "sliding_window_attention"]
