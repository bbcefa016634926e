"""The CUDA path: flash-attn's own registered torch.library ops (flash-attn >= 2.7).

flash-attn is an optional extra. Whether it runs (``unavailable_reason``) depends on the
device, dtype and head_dim and on process-wide facts (the GPU's compute capability, ROCm,
flash-attn's version and backend), never on tensor values, so the forward and the backward
of a call agree. Two more fallbacks to the chunked kernel depend on what both also see:
windows flash-attn would clamp differently (sizes and window, ``window_is_exact``) and
padding its varlen op cannot express (the padding tensor, ``varlen_layout``). Every kernel
returns the same layouts, so the fake implementations need none of this.

Layout: FA2 allocates its output like q (``empty_like``). It always gets q as a
(B, S, H, D)-contiguous tensor, so its output is heads-last, the layout the fake promises,
whatever the input strides. Models hand over transposed views of exactly that storage, so
this copies nothing for them; the other choice, a fake that follows q's strides, would tie
every kernel's output layout to q's and make the usual
``out.transpose(1, 2).reshape(b, s, h * d)`` copy for (B, H, S, D)-contiguous inputs.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .window import UNBOUNDED

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
MIN_VERSION = (2, 7, 0)  # the first release that registers its kernels as torch.library ops
# 2.7.0-2.7.2 check for sm8x or sm90 exactly; later releases accept any sm80 or newer.
ANY_SM80_OR_NEWER_FROM = (2, 7, 3)
_OP_NAMES = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


class FlashOps(NamedTuple):
    forward: torch._ops.OpOverload
    backward: torch._ops.OpOverload
    varlen_forward: torch._ops.OpOverload
    varlen_backward: torch._ops.OpOverload


@functools.cache
def release(version: str) -> tuple[int, int, int]:
    """``"2.7.4.post1"`` -> ``(2, 7, 4)``."""
    parts = (version.split(".") + ["0", "0"])[:3]
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in parts)


@functools.cache
def _interface():
    """flash-attn's interface module, or None where flash-attn is missing or its compiled
    extension does not load (OSError: a library it links against is missing)."""
    try:
        import flash_attn.flash_attn_interface as interface
    except (ImportError, OSError):
        return None
    return interface


def flash_attn_version() -> tuple[int, int, int] | None:
    if _interface() is None:
        return None
    import flash_attn

    return release(flash_attn.__version__)


@functools.cache
def loaded_flash_attn() -> FlashOps | None:
    """flash-attn's registered forward/backward ops (namespace ``flash_attn`` in every release
    since 2.7.0), or None where flash-attn is missing or older."""
    if _interface() is None:
        return None
    namespace = torch.ops.flash_attn
    try:
        return FlashOps(*(getattr(namespace, name).default for name in _OP_NAMES))
    except AttributeError:  # before 2.7 the interface registers no ops
        return None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for every other device.

    The one seam of the flash path: the contract test (tests/flash_contract_cases.py)
    replaces it to run this path on CPU tensors over an emulated extension."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _runs_on(capability: tuple[int, int], version: tuple[int, int, int]) -> bool:
    major, minor = capability
    if version < ANY_SM80_OR_NEWER_FROM:
        return major == 8 or (major, minor) == (9, 0)
    return major >= 8


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why flash-attn cannot run this call, or None when it can."""
    if dtype not in FLASH_DTYPES:
        return f"flash-attn takes fp16 or bf16, not {dtype}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8 != 0:
        return f"flash-attn takes head_dim <= {FLASH_MAX_HEAD_DIM} and a multiple of 8, not {head_dim}"
    capability = device_capability(device)
    if capability is None:
        return "no CUDA GPU is available" if device.type == "cuda" else f"flash-attn runs only on CUDA, not {device.type}"
    if torch.version.hip is not None:
        # flash-attn's Triton AMD backend ignores window_size; no ROCm backend is trusted here.
        return "flash-attn is not used on ROCm"
    version = flash_attn_version()
    if version is None or version < MIN_VERSION or loaded_flash_attn() is None:
        return "flash-attn >= 2.7 is not installed"
    if getattr(_interface(), "USE_TRITON_ROCM", False):
        return "flash-attn runs its Triton AMD backend (FLASH_ATTENTION_TRITON_AMD_ENABLE), which ignores window_size"
    if not _runs_on(capability, version):
        major, minor = capability
        return f"flash-attn {'.'.join(map(str, version))} does not run on sm{major}{minor}"
    return None


def window_is_exact(seq_q: int, seq_k: int, left: int, right: int) -> bool:
    """Whether flash-attn computes window (left, right) exactly for these lengths.

    Its extension turns a side >= seq_k into -1, then an unbounded side into seq_k when the
    other side is bounded (no mask at all when both are unbounded). On the left this never
    changes which keys a row sees. On the right it does when seq_q > seq_k + 1: rows aligned
    before key -1 reach the last key only through a right side wider than seq_k."""
    if seq_q <= seq_k + 1 or 0 <= right < seq_k:
        return True
    if left == UNBOUNDED or left >= seq_k:
        # No mask at all: exact when the first row sees every key anyway.
        return right == UNBOUNDED or right >= seq_q - 1
    return right == seq_k  # clamped to -1, then back to seq_k


def flash_forward(query, key, value, left, right, scale):
    """(B, H, S, D) in (last dimension contiguous); heads-last out and (B, H, Sq) fp32 logsumexp."""
    ops = loaded_flash_attn()
    q = query.transpose(1, 2).contiguous()  # FA2's out is empty_like(q): heads-last
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    out, logsumexp, _, _ = ops.forward(q, k, v, 0.0, scale, False, left, right, 0.0, None, False)
    return out.transpose(1, 2), logsumexp


def flash_backward(grad_out, query, key, value, out, logsumexp, left, right, scale):
    ops = loaded_flash_attn()
    dout, q, k, v, o = (x.transpose(1, 2) for x in (grad_out, query, key, value, out))
    # (B, S, H, D)-contiguous buffers FA2 writes into: heads-last once transposed back.
    grad_q, grad_k, grad_v = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    ops.backward(
        dout, q, k, v, o,
        logsumexp.contiguous(),  # read from its data pointer as (B, H, Sq)
        grad_q, grad_k, grad_v,
        0.0, scale, False, left, right, 0.0, None, torch.are_deterministic_algorithms_enabled(), None,
    )
    return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)


class VarlenLayout(NamedTuple):
    """Where the sequences of a padded or packed batch lie once flattened to (B * S) tokens."""

    tokens: torch.Tensor  # int64 indices into the flattened (B * S) tokens, sequence by sequence
    cu_seqlens: torch.Tensor  # int32 (sequences + 1,) cumulative lengths; empty sequences left out
    max_seqlen: int


def _to_host(*scalars: torch.Tensor) -> list[int]:
    """Several device scalars in one device-to-host copy: the layout's only host sync."""
    return torch.stack([scalar.to(torch.int64) for scalar in scalars]).tolist()


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return cu_seqlens


def varlen_layout(key_padding: torch.Tensor | None, segment_ids: torch.Tensor | None) -> VarlenLayout | None:
    """The varlen layout of self-attention over a padded (key_padding) or packed (segment_ids)
    batch, or None where FA2's varlen op cannot express the mask: both given, a row whose
    valid tokens are not one contiguous run, or segments that are not contiguous runs.

    Within a contiguous run, distances between tokens are unchanged by unpadding, so the
    window means the same; a padded token is in no sequence, so it gets zeros and no gradient.
    Reads three or four numbers back to the host in one copy (a sync on CUDA)."""
    if (key_padding is None) == (segment_ids is None):
        return None
    some = key_padding if key_padding is not None else segment_ids
    if some.numel() == 0:
        no_tokens = torch.zeros(0, dtype=torch.int64, device=some.device)
        return VarlenLayout(no_tokens, _cumulative(no_tokens), 0)
    if key_padding is not None:
        seq = key_padding.shape[1]
        counts = key_padding.sum(dim=1)
        positions = torch.arange(seq, device=key_padding.device)
        first = torch.where(key_padding, positions, seq).amin(dim=1)
        last = torch.where(key_padding, positions, -1).amax(dim=1)
        has_hole = ((last - first + 1) != counts) & (counts > 0)
        hole, total, longest, sequences = _to_host(has_hole.any(), counts.sum(), counts.max(), (counts > 0).sum())
        if hole:
            return None
        tokens = torch.nonzero_static(key_padding.reshape(-1), size=total).squeeze(1)
        lengths = counts[torch.nonzero_static(counts > 0, size=sequences).squeeze(1)]
        return VarlenLayout(tokens, _cumulative(lengths), longest)
    batch, seq = segment_ids.shape
    steps = segment_ids.diff(dim=1)
    starts = torch.ones(batch, seq, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = steps != 0
    sequence_of_token = starts.reshape(-1).cumsum(0) - 1
    lengths = torch.zeros(batch * seq, dtype=torch.int64, device=segment_ids.device)
    lengths.scatter_add_(0, sequence_of_token, torch.ones_like(sequence_of_token))
    # A segment id that comes back is not one contiguous run.
    comes_back, sequences, longest = _to_host((steps < 0).any(), starts.sum(), lengths.max())
    if comes_back:
        return None
    tokens = torch.arange(batch * seq, device=segment_ids.device)
    return VarlenLayout(tokens, _cumulative(lengths[:sequences]), longest)


# Layouts by padding (or segment) tensor: every layer of a step passes the same tensor, in
# the forward and again in the backward. A hit needs the same object (weakly held, so a
# freed tensor's entry goes with it) with the same version counter, data pointer, shape
# and strides, so an in-place write or reused memory never reuses a stale layout.
_layouts = WeakIdKeyDictionary()


def cached_varlen_layout(key_padding: torch.Tensor | None, segment_ids: torch.Tensor | None) -> VarlenLayout | None:
    """``varlen_layout``, computed once per padding tensor while that tensor is unchanged."""
    if (key_padding is None) == (segment_ids is None):
        return None
    source = key_padding if key_padding is not None else segment_ids
    if torch.is_inference(source):  # no version counter to see in-place writes by
        return varlen_layout(key_padding, segment_ids)
    stamp = (source._version, source.data_ptr(), source.shape, source.stride(), source.device)
    cached = _layouts.get(source)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    layout = varlen_layout(key_padding, segment_ids)
    _layouts[source] = (stamp, layout)
    return layout


def _tokens(x: torch.Tensor, layout: VarlenLayout) -> torch.Tensor:
    """(B, H, S, D) -> the layout's tokens as (T, H, D), contiguous."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch * seq, heads, dim)[layout.tokens]


def flash_varlen_forward(query, key, value, left, right, scale, layout: VarlenLayout):
    """Self-attention over a padded or packed batch with FA2's varlen op. Tokens in no
    sequence (padding) get zeros and a logsumexp of +inf; with none left, FA2 is not called
    (it rejects a batch of zero sequences)."""
    batch, heads, seq, dim = query.shape
    out = query.new_zeros(batch, seq, heads, dim)
    logsumexp = torch.full((batch, seq, heads), float("inf"), dtype=torch.float32, device=query.device)
    if layout.tokens.numel():
        q, k, v = (_tokens(x, layout) for x in (query, key, value))
        cu, longest = layout.cu_seqlens, layout.max_seqlen
        token_out, token_lse, _, _ = loaded_flash_attn().varlen_forward(
            q, k, v, cu, cu, longest, longest, 0.0, scale, False, left, right, 0.0, None, False, None, None, None
        )
        out.view(batch * seq, heads, dim)[layout.tokens] = token_out
        logsumexp.view(batch * seq, heads)[layout.tokens] = token_lse.t()
    return out.transpose(1, 2), logsumexp.permute(0, 2, 1).contiguous()


def flash_varlen_backward(grad_out, query, key, value, out, logsumexp, left, right, scale, layout: VarlenLayout):
    batch, heads, seq, dim = query.shape
    grads = [x.new_zeros(batch, seq, x.shape[1], dim) for x in (query, key, value)]  # heads-last
    if layout.tokens.numel():
        dout, q, k, v, o = (_tokens(x, layout) for x in (grad_out, query, key, value, out))
        # (H, T) contiguous, as FA2 reads it from its data pointer.
        lse = logsumexp.transpose(1, 2).reshape(batch * seq, heads)[layout.tokens].t().contiguous()
        token_grads = [torch.empty_like(x) for x in (q, k, v)]
        cu, longest = layout.cu_seqlens, layout.max_seqlen
        loaded_flash_attn().varlen_backward(
            dout, q, k, v, o, lse, *token_grads, cu, cu, longest, longest,
            0.0, scale, False, left, right, 0.0, None, torch.are_deterministic_algorithms_enabled(), None,
        )
        for full, tokens in zip(grads, token_grads):
            full.view(batch * seq, -1, dim)[layout.tokens] = tokens
    return tuple(grad.transpose(1, 2) for grad in grads)
