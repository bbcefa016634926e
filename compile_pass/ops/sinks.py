"""Attention sinks (GPT-OSS, MiMo-V2-Flash, Granite-SWA; per row: Inkling2) on any kernel that
returns the row logsumexp.

A sink is one learned logit per query head, (heads,), or per (batch, head, query row),
(batch, heads, seq_q), a column added to its row's softmax and dropped after it:
``softmax(cat([scores, sink]))[..., :-1] @ v``. With L the row's logsumexp over its
keys and O plain attention, that is ``c * O`` with ``c = sigmoid(L - sink)``. The backward is
the kernel's own, called with the output and its gradient rescaled: FA2's backward reads
``D = rowsum(dout * out)``, and with ``dout = c * G`` and ``out = c * O`` it computes exactly the
gradients of the sink's softmax (the plain lse is what it needs); the sink's gradient is
``-(G . c O) (1 - c)`` per row, summed over the batch and rows for per-head sinks. A row that
sees no key has O = 0, so its result and its share of every gradient are 0 whatever the
kernel's convention for its lse (+inf or -inf).
Checked in fp64 against autograd of the spelled-out form (``tests/ops/test_sinks.py``).

The statistics are computed in the kernels' accumulation dtype (fp32, fp64 for fp64 inputs),
whatever the sinks' dtype; the sinks' gradient is returned in their dtype.
"""

from __future__ import annotations

import torch


def per_row(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sinks in ``dtype`` as they line up with a (B, H, Sq) logsumexp: (1, H, 1) per head."""
    sinks = sinks.to(dtype)
    return sinks[None, :, None] if sinks.dim() == 1 else sinks


def _kept(logsumexp: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """c = sigmoid(lse - sink): the share of each row's softmax its keys keep, (B, H, Sq)."""
    return torch.sigmoid(logsumexp - per_row(sinks, logsumexp.dtype))


def apply_sinks(out: torch.Tensor, logsumexp: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Scales a kernel's fresh (out, plain logsumexp) result by c in place (computed in the
    logsumexp's dtype, rounded once to out's) and returns it; ``out`` as it is without sinks."""
    return out if sinks is None else out.mul_(_kept(logsumexp, sinks).unsqueeze(-1))


def sink_gradients(
    grad_out: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the gradient to hand the kernel's backward, the sinks' gradient), from the gradient of
    the sink-scaled ``out`` and the plain ``logsumexp`` the forward returned; (grad_out, None)
    without sinks. The kernel's backward takes the sink-scaled ``out`` as it is."""
    if sinks is None:
        return grad_out, None
    acc = logsumexp.dtype
    kernel_grad_out = (grad_out * _kept(logsumexp, sinks).unsqueeze(-1)).to(grad_out.dtype)  # rounded once
    # 1 - c as sigmoid(sink - lse): no cancellation where c is close to 1.
    dropped = torch.sigmoid(per_row(sinks, acc) - logsumexp)
    row_dot = (grad_out.to(acc) * out.to(acc)).sum(-1)
    grad_sinks = -(row_dot * dropped)
    if sinks.dim() == 1:
        grad_sinks = grad_sinks.sum(dim=(0, 2))
    return kernel_grad_out, grad_sinks.to(sinks.dtype)
