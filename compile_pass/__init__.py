"""compile_pass: torch.compile graph rewrites for sliding-window and top-k attention."""

from ._version import __version__
from .backend import backend, enable, rewrite
from .ops import sliding_window_attention
from .report import Decision, Report, decisions

__all__ = [
    "Decision",
    "Report",
    "__version__",
    "backend",
    "decisions",
    "enable",
    "rewrite",
    "sliding_window_attention",
]
