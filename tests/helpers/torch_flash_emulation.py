"""A CPU stand-in for torch's own FlashAttention-2 kernels: ``aten::_flash_attention_forward``
and ``aten::_flash_attention_backward`` get CPU kernels that keep their CUDA contract.

Written from torch 2.13's sources (aten/src/ATen/native/transformers/cuda/attention.cu and
attention_backward.cu, shared/REFERENCE.md section 9): the forward calls FA2's ``mha_fwd``
(dense: ``cum_seq_q`` None) or ``mha_varlen_fwd`` with no preallocated output, a window side
that is None as -1, the scale as given or 1/sqrt(head_dim); the backward makes ``grad_out``
and ``out`` contiguous, decides ``deterministic`` from torch's global setting (not
``warn_only``), and picks the varlen entry point where ``cum_seq_q`` is defined. Those entry
points are flash-attn 2.x's C++ API, which tests/helpers/flash_emulation.py already emulates (fp64
arithmetic, FA2's argument checks, window clamp, layouts, NaN in memory the kernel leaves
unwritten): this module only adapts aten's signatures onto it.

``install()`` registers the two CPU kernels for as long as the handle it returns lives (or
until its ``uninstall()``). Calls are counted in ``flash_emulation.calls`` (``fwd``, ``varlen_fwd``, ``bwd``,
``varlen_bwd``), and under ``aten_fwd`` / ``aten_bwd``.
"""

from __future__ import annotations

import math

import torch

from tests.helpers import flash_emulation
from tests.helpers.flash_emulation import calls


def _window(side: int | None) -> int:
    return -1 if side is None else side


def _flash_attention_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    calls["aten_fwd"] += 1
    flash_emulation._emulated(num_splits is None, "num_splits")
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    left, right = _window(window_size_left), _window(window_size_right)
    if cum_seq_q is None:
        out, lse, _, _ = flash_emulation.fwd(
            query,
            key,
            value,
            None,
            alibi_slopes,
            dropout_p,
            softmax_scale,
            is_causal,
            left,
            right,
            0.0,
            return_debug_mask,
            None,
        )
    else:
        out, lse, _, _ = flash_emulation.varlen_fwd(
            query,
            key,
            value,
            None,
            cum_seq_q,
            cum_seq_k,
            seqused_k,
            None,
            block_table,
            alibi_slopes,
            max_q,
            max_k,
            dropout_p,
            softmax_scale,
            False,
            is_causal,
            left,
            right,
            0.0,
            return_debug_mask,
            None,
        )
    rng_state = torch.zeros(2, dtype=torch.uint64)
    return out, lse, rng_state, torch.empty(0, dtype=torch.uint64), torch.empty(0, dtype=query.dtype)


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _flash_attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
):
    calls["aten_bwd"] += 1
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    left, right = _window(window_size_left), _window(window_size_right)
    dout, out = grad_out.contiguous(), out.contiguous()
    if cum_seq_q is not None:  # defined: an undefined tensor reaches Python as None
        dq, dk, dv, _ = flash_emulation.varlen_bwd(
            dout,
            query,
            key,
            value,
            out,
            logsumexp,
            None,
            None,
            None,
            cum_seq_q,
            cum_seq_k,
            None,
            max_q,
            max_k,
            dropout_p,
            softmax_scale,
            False,
            is_causal,
            left,
            right,
            0.0,
            _deterministic(),
            None,
            philox_seed,
        )
    else:
        dq, dk, dv, _ = flash_emulation.bwd(
            dout,
            query,
            key,
            value,
            out,
            logsumexp,
            None,
            None,
            None,
            None,
            dropout_p,
            softmax_scale,
            is_causal,
            left,
            right,
            0.0,
            _deterministic(),
            None,
            philox_seed,
        )
    return dq, dk, dv


class Installed:
    def __init__(self, library: torch.library.Library):
        self._library = library

    def uninstall(self) -> None:
        self._library._destroy()


def install() -> Installed:
    """CPU kernels for aten's two flash ops, until ``uninstall()``."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", _flash_attention_forward, "CPU")
    library.impl("_flash_attention_backward", _flash_attention_backward, "CPU")
    return Installed(library)
