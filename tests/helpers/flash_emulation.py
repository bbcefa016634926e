"""A CPU stand-in for ``flash_attn_2_cuda``, flash-attn's compiled extension.

Written from the contract that flash-attn's Python interface relies on, as stated in
``csrc/flash_attn/flash_api.cpp`` (v2.7.0 to v2.8.3): the argument checks, the window
clamping, the layouts of the tensors it allocates, the buffers it writes, and what rows
without keys get. The arithmetic is plain fp64 attention; only the contract matters.

Where the extension leaves memory unwritten (tokens outside every sequence of a varlen
call), this stand-in writes NaN, so a caller that reads it fails loudly. The softmax
logsumexp is read as the kernel reads it, as raw contiguous memory from its data pointer,
so a caller passing it in another layout gets garbage here too.

``install(source_dir)`` puts this module in ``sys.modules`` as ``flash_attn_2_cuda``,
imports flash-attn's real ``flash_attn`` package from ``source_dir`` (its own
``torch.library`` registrations run) and registers the interface's functions as the ops'
CPU kernels. ``calls`` counts the entry points that ran; ``deterministic_flags`` records
the ``deterministic`` argument of each backward; ``device_capability`` is the GPU it plays.
"""

from __future__ import annotations

import collections
import importlib
import re
import sys
from pathlib import Path

import torch

calls: collections.Counter = collections.Counter()
deterministic_flags: list[bool] = []
# The GPU this stand-in plays, (major, minor); tests set it.
device_capability = (9, 0)

OP_NAMES = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward")


def reset_records() -> None:
    calls.clear()
    deterministic_flags.clear()


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)


def _emulated(condition: bool, what: str) -> None:
    """Features the real extension has and this stand-in does not model; compile_pass uses none."""
    if not condition:
        raise NotImplementedError(f"flash_attn_2_cuda emulation: {what} is not emulated")


def _release(version: str) -> tuple[int, int, int]:
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in (version.split(".") + ["0", "0"])[:3])


def _check_gpu() -> None:
    """Every entry point checks the current GPU; flash-attn 2.7.0-2.7.2 accept only sm8x and
    sm90 (torch's copy of the API, with no flash_attn package loaded, any sm80 or newer)."""
    major, minor = device_capability
    flash_attn = sys.modules.get("flash_attn")
    if flash_attn is not None and _release(flash_attn.__version__) < (2, 7, 3):
        supported = major == 8 or (major, minor) == (9, 0)
    else:
        supported = major >= 8
    _check(supported, "FlashAttention only supports Ampere GPUs or newer.")


def _check_dtypes(q: torch.Tensor, *others: torch.Tensor) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    for other in others:
        _check(other.dtype == q.dtype, "query and key/value/out/dout must have the same dtype")


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        _check(tensor.stride(-1) == 1, "Input tensor must have contiguous last dimension")


def _check_sizes(batch_size: int, head_size: int, num_heads: int, num_heads_k: int) -> None:
    _check(batch_size > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention only supports head dimension at most 256")
    _check(head_size % 8 == 0, "head_size should be a multiple of 8")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")


def _check_shape(tensor: torch.Tensor, *shape: int, name: str) -> None:
    _check(tuple(tensor.shape) == shape, f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _clamp_window(left: int, right: int, seqlen_k: int) -> tuple[int, int]:
    """mha_*: a window side that reaches past every key becomes unbounded (-1)."""
    return (-1 if left >= seqlen_k else left), (-1 if right >= seqlen_k else right)


def _kernel_window(left: int, right: int, seqlen_k: int) -> tuple[int, int]:
    """set_params_fprop / set_params_dgrad: with one side bounded, the unbounded side becomes
    seqlen_k (the max seqlen_k for varlen). Both unbounded stays (-1, -1): no mask."""
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _visible(seqlen_q: int, seqlen_k: int, left: int, right: int) -> torch.Tensor:
    """The kernel's mask for one sequence: query i is aligned with key i + seqlen_k - seqlen_q
    and sees keys [aligned - left, aligned + right]; (-1, -1) masks nothing."""
    aligned = torch.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    keys = torch.arange(seqlen_k)[None, :]
    if left < 0 and right < 0:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    return (keys >= aligned - left) & (keys <= aligned + right)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor, softcap: float = 0.0):
    """(heads, seqlen_q, seqlen_k) fp64 scaled scores, -inf where masked; K repeated for GQA;
    and the derivative of the soft-capping at each score (1 without one). set_params_fprop:
    a softcap > 0 makes each score ``softcap * tanh(q.k * softmax_scale / softcap)``; one <= 0
    none."""
    groups = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(groups, dim=1)) * scale
    slope = torch.ones_like(scores)
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores, slope = softcap * tanh, 1 - tanh**2
    return scores.masked_fill(~visible, float("-inf")), slope


def _attend(q, k, v, scale, visible, softcap=0.0):
    """One sequence: q (Sq, H, D), k/v (Sk, Hk, D) -> out (Sq, H, D), lse (H, Sq), in fp64.
    A row without a visible key gets zeros and lse +inf, as the kernel writes them."""
    scores, _ = _scores(q, k, scale, visible, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    probs = torch.exp(scores - lse[..., None])
    groups = q.shape[1] // k.shape[1]
    out = torch.einsum("hqk,khd->qhd", probs, v.double().repeat_interleave(groups, dim=1))
    return out, lse


def _attend_backward(dout, q, k, v, out, lse, scale, visible, softcap=0.0):
    """One sequence's dq, dk, dv and softmax_d (rowsum(dout * out), (H, Sq)), probabilities
    recomputed from the logsumexp the caller passed, as the kernel does; with a softcap, dS
    times the soft-capping's derivative 1 - tanh^2."""
    groups = q.shape[1] // k.shape[1]
    kv_heads = k.shape[1]
    scores, slope = _scores(q, k, scale, visible, softcap)
    probs = torch.exp(scores - lse.double()[..., None])
    softmax_d = (dout.double() * out.double()).sum(-1).t()
    grad_probs = torch.einsum("qhd,khd->hqk", dout.double(), v.double().repeat_interleave(groups, dim=1))
    grad_scores = probs * (grad_probs - softmax_d[..., None]) * slope
    dq = torch.einsum("hqk,khd->qhd", grad_scores, k.double().repeat_interleave(groups, dim=1)) * scale
    dk = torch.einsum("hqk,qhd->khd", grad_scores, q.double()).unflatten(1, (kv_heads, groups)).sum(2) * scale
    dv = torch.einsum("hqk,qhd->khd", probs, dout.double()).unflatten(1, (kv_heads, groups)).sum(2)
    return dq, dk, dv, softmax_d


def _raw_lse(softmax_lse: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The logsumexp as the kernel reads it: fp32 memory from the data pointer, contiguous."""
    _check(softmax_lse.dtype == torch.float32, f"softmax_lse must be fp32, got {softmax_lse.dtype}")
    needed = softmax_lse.storage_offset() + int(torch.Size(shape).numel())
    _check(softmax_lse.untyped_storage().nbytes() >= 4 * needed, "softmax_lse is smaller than the kernel reads")
    strides = torch.empty(shape).stride()
    return torch.as_strided(softmax_lse, shape, strides, softmax_lse.storage_offset())


def _gradient_buffer(given, like, shape, name):
    if given is None:
        return torch.empty_like(like)
    _check(given.dtype == like.dtype, f"{name} must have the same dtype as q")
    _check(given.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _check_shape(given, *shape, name=name)
    return given


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def fwd(
    q,
    k,
    v,
    out_,
    alibi_slopes,
    p_dropout,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    return_softmax,
    gen,
):
    calls["fwd"] += 1
    _check_gpu()
    _emulated(out_ is None, "a preallocated out")
    _emulated(alibi_slopes is None and p_dropout == 0.0 and not return_softmax, "alibi, dropout or return_softmax")
    _check_dtypes(q, k, v)
    _check_last_dim_contiguous(q, k, v)
    batch_size, seqlen_q, num_heads, head_size = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    _check_sizes(batch_size, head_size, num_heads, num_heads_k)
    left, right = _clamp_window(window_size_left, window_size_right, seqlen_k)
    if seqlen_q == 1:
        is_causal = False  # the extension: causal means nothing for one query
    if is_causal:
        right = 0
    # One query and GQA without a window: the extension runs the query heads of a KV head
    # as rows of one sequence, allocating out like that reshaped q.
    swapped = seqlen_q == 1 and num_heads > num_heads_k and left < 0 and right < 0
    groups = num_heads // num_heads_k
    _check_shape(k, batch_size, seqlen_k, num_heads_k, head_size, name="k")
    _check_shape(v, batch_size, seqlen_k, num_heads_k, head_size, name="v")
    q_as_run = q.reshape(batch_size, num_heads_k, groups, head_size).transpose(1, 2) if swapped else q
    out = torch.empty_like(q_as_run)
    softmax_lse = torch.empty((batch_size, num_heads, seqlen_q), dtype=torch.float32)
    left, right = _kernel_window(left, right, seqlen_k)
    if seqlen_k > 0:
        visible = _visible(seqlen_q, seqlen_k, left, right)
        results = [_attend(q[b], k[b], v[b], softmax_scale, visible, softcap) for b in range(batch_size)]
        full_out = torch.stack([o for o, _ in results])  # (B, Sq, H, D)
        softmax_lse.copy_(torch.stack([lse for _, lse in results]))
        if swapped:
            full_out = full_out.reshape(batch_size, num_heads_k, groups, head_size).transpose(1, 2)
        out.copy_(full_out)
    else:
        out.zero_()
        softmax_lse.fill_(float("inf"))
    if swapped:
        out = out.transpose(1, 2).reshape(batch_size, 1, num_heads, head_size)
    return [out, softmax_lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)]


def _sequences(cu_seqlens_q, cu_seqlens_k):
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [
        (slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])) for b in range(len(bounds_q) - 1)
    ]


def _check_cu_seqlens(*cu_seqlens: torch.Tensor) -> None:
    for cu in cu_seqlens:
        _check(cu.dtype == torch.int32, "cu_seqlens must have dtype int32")
        _check(cu.is_contiguous(), "cu_seqlens must be contiguous")


def varlen_fwd(
    q,
    k,
    v,
    out_,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_k,
    leftpad_k,
    block_table,
    alibi_slopes,
    max_seqlen_q,
    max_seqlen_k,
    p_dropout,
    softmax_scale,
    zero_tensors,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    return_softmax,
    gen,
):
    calls["varlen_fwd"] += 1
    _check_gpu()
    _emulated(
        out_ is None and seqused_k is None and leftpad_k is None and block_table is None,
        "out, seqused_k, leftpad_k or a paged KV cache",
    )
    _emulated(alibi_slopes is None and p_dropout == 0.0 and not return_softmax, "alibi, dropout or return_softmax")
    _check_dtypes(q, k, v)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _check_last_dim_contiguous(q, k, v)
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, head_size = q.shape
    total_k, num_heads_k = k.shape[0], k.shape[1]
    left, right = window_size_left, window_size_right
    if max_seqlen_q == 1:
        is_causal = False
    if is_causal:
        right = 0
    # The extension decides this before clamping the window, and its reshape needs exactly
    # one query per sequence.
    swapped = max_seqlen_q == 1 and num_heads > num_heads_k and left < 0 and right < 0
    groups = num_heads // num_heads_k
    q_as_run = q
    if swapped:
        q_as_run = q.reshape(batch_size, num_heads_k, groups, head_size).transpose(1, 2)
        q_as_run = q_as_run.reshape(batch_size * groups, num_heads_k, head_size)
    _check_sizes(batch_size, head_size, num_heads, num_heads_k)
    left, right = _clamp_window(left, right, max_seqlen_k)
    _check_shape(k, total_k, num_heads_k, head_size, name="k")
    _check_shape(v, total_k, num_heads_k, head_size, name="v")
    _check_shape(cu_seqlens_q, batch_size + 1, name="cu_seqlens_q")
    _check_shape(cu_seqlens_k, batch_size + 1, name="cu_seqlens_k")
    out = torch.empty_like(q_as_run)
    softmax_lse = torch.empty((num_heads, total_q), dtype=torch.float32)
    # Rows outside every sequence are never written by the kernel.
    full_out = torch.full((total_q, num_heads, head_size), float("nan"), dtype=torch.float64)
    softmax_lse.fill_(float("nan"))
    if zero_tensors:
        full_out.zero_()
        softmax_lse.fill_(float("-inf"))
    left, right = _kernel_window(left, right, max_seqlen_k)
    if max_seqlen_k > 0:
        for rows, keys in _sequences(cu_seqlens_q, cu_seqlens_k):
            visible = _visible(rows.stop - rows.start, keys.stop - keys.start, left, right)
            full_out[rows], softmax_lse[:, rows] = _attend(q[rows], k[keys], v[keys], softmax_scale, visible, softcap)
    else:
        full_out.zero_()
        softmax_lse.fill_(float("inf"))
    if swapped:
        out.copy_(full_out.reshape(batch_size, num_heads_k, groups, head_size).transpose(1, 2).reshape(out.shape))
        out = out.reshape(batch_size, groups, num_heads_k, head_size).transpose(1, 2)
        out = out.reshape(batch_size, num_heads, head_size)
    else:
        out.copy_(full_out)
    return [out, softmax_lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)]


def bwd(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq_,
    dk_,
    dv_,
    alibi_slopes,
    p_dropout,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    deterministic,
    gen,
    rng_state,
):
    calls["bwd"] += 1
    _check_gpu()
    deterministic_flags.append(deterministic)
    left, right = window_size_left, window_size_right
    if is_causal:
        right = 0
    _emulated(alibi_slopes is None and p_dropout == 0.0, "alibi or dropout")
    _check_dtypes(q, k, v, out, dout)
    _check_last_dim_contiguous(q, k, v, out, dout)
    batch_size, seqlen_q, num_heads, head_size = q.shape
    seqlen_k, num_heads_k = k.shape[1], k.shape[2]
    _check_sizes(batch_size, head_size, num_heads, num_heads_k)
    left, right = _clamp_window(left, right, seqlen_k)
    _check_shape(k, batch_size, seqlen_k, num_heads_k, head_size, name="k")
    _check_shape(v, batch_size, seqlen_k, num_heads_k, head_size, name="v")
    _check_shape(out, batch_size, seqlen_q, num_heads, head_size, name="out")
    _check_shape(dout, batch_size, seqlen_q, num_heads, head_size, name="dout")
    dq = _gradient_buffer(dq_, q, (batch_size, seqlen_q, num_heads, head_size), "dq")
    dk = _gradient_buffer(dk_, k, (batch_size, seqlen_k, num_heads_k, head_size), "dk")
    dv = _gradient_buffer(dv_, v, (batch_size, seqlen_k, num_heads_k, head_size), "dv")
    lse = _raw_lse(softmax_lse, (batch_size, num_heads, seqlen_q))
    left, right = _kernel_window(left, right, seqlen_k)
    softmax_d = torch.zeros((batch_size, num_heads, _round_up(seqlen_q, 128)), dtype=torch.float32)
    if seqlen_q > 0:
        visible = _visible(seqlen_q, seqlen_k, left, right)
        for b in range(batch_size):
            grads = _attend_backward(dout[b], q[b], k[b], v[b], out[b], lse[b], softmax_scale, visible, softcap)
            dq[b], dk[b], dv[b] = grads[:3]
            softmax_d[b, :, :seqlen_q] = grads[3]
    else:
        dk.zero_()
        dv.zero_()
    return [dq, dk, dv, softmax_d]


def varlen_bwd(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq_,
    dk_,
    dv_,
    cu_seqlens_q,
    cu_seqlens_k,
    alibi_slopes,
    max_seqlen_q,
    max_seqlen_k,
    p_dropout,
    softmax_scale,
    zero_tensors,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    deterministic,
    gen,
    rng_state,
):
    calls["varlen_bwd"] += 1
    _check_gpu()
    deterministic_flags.append(deterministic)
    left, right = window_size_left, window_size_right
    if is_causal:
        right = 0
    _emulated(alibi_slopes is None and p_dropout == 0.0, "alibi or dropout")
    _check_dtypes(q, k, v, out, dout)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
    _check_last_dim_contiguous(q, k, v, out, dout)
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, head_size = q.shape
    total_k, num_heads_k = k.shape[0], k.shape[1]
    _check_sizes(batch_size, head_size, num_heads, num_heads_k)
    left, right = _clamp_window(left, right, max_seqlen_k)
    _check_shape(k, total_k, num_heads_k, head_size, name="k")
    _check_shape(v, total_k, num_heads_k, head_size, name="v")
    _check_shape(out, total_q, num_heads, head_size, name="out")
    _check_shape(dout, total_q, num_heads, head_size, name="dout")
    _check_shape(cu_seqlens_q, batch_size + 1, name="cu_seqlens_q")
    _check_shape(cu_seqlens_k, batch_size + 1, name="cu_seqlens_k")
    dq = _gradient_buffer(dq_, q, (total_q, num_heads, head_size), "dq")
    dk = _gradient_buffer(dk_, k, (total_k, num_heads_k, head_size), "dk")
    dv = _gradient_buffer(dv_, v, (total_k, num_heads_k, head_size), "dv")
    lse = _raw_lse(softmax_lse, (num_heads, total_q))
    # Tokens outside every sequence are never written by the kernel.
    for grad in (dq, dk, dv):
        grad.fill_(0.0 if zero_tensors else float("nan"))
    left, right = _kernel_window(left, right, max_seqlen_k)
    softmax_d = torch.zeros((num_heads, total_q + 128 * batch_size), dtype=torch.float32)
    if max_seqlen_q > 0:
        for index, (rows, keys) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
            visible = _visible(rows.stop - rows.start, keys.stop - keys.start, left, right)
            grads = _attend_backward(
                dout[rows], q[rows], k[keys], v[keys], out[rows], lse[:, rows], softmax_scale, visible, softcap
            )
            dq[rows], dk[keys], dv[keys] = grads[:3]
            offset = 128 * index
            softmax_d[:, rows.start + offset : rows.stop + offset] = grads[3]
    else:
        dk.zero_()
        dv.zero_()
    return [dq, dk, dv, softmax_d]


def install(source_dir: str | Path):
    """Import flash-attn's real Python package from ``source_dir`` on top of this emulation,
    and register CPU kernels for its four ops. Once per process: the ops are process-wide."""
    if "flash_attn" in sys.modules:
        raise RuntimeError("flash_attn is already imported in this process; load one version per process")
    sys.modules["flash_attn_2_cuda"] = sys.modules[__name__]
    sys.path.insert(0, str(source_dir))
    flash_attn = importlib.import_module("flash_attn")
    interface = importlib.import_module("flash_attn.flash_attn_interface")
    if not Path(interface.__file__).resolve().is_relative_to(Path(source_dir).resolve()):
        raise RuntimeError(f"imported {interface.__file__}, not the interface under {source_dir}")
    for name in OP_NAMES:
        # The interface declares its ops with device_types="cuda"; the same Python body
        # (maybe_contiguous, then the extension) becomes their CPU kernel.
        custom_op = getattr(interface, name)
        torch.library.register_kernel(f"flash_attn::{name}", "cpu", custom_op._init_fn)
    return flash_attn
