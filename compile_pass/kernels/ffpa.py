"""ffpa-attn's kernels for head_dim 320-512 (PyPI ``ffpa-attn``, Apache-2.0; CuTe-DSL, forward
and backward), used only where a user asks for them: ``COMPILE_PASS_FFPA=1``.

What its public interface computes (read from ffpa-attn 0.2.4, ``ffpa_attn_interface.py`` and
``cute/__init__.py``): ``ffpa_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, *, softmax_scale, causal, enable_gqa, return_lse)`` takes packed (tokens, heads,
head_dim) fp16/bf16 tensors, int32 cumulative lengths and int maxima; K/V keep their own head
count (``enable_gqa``); each sequence is attended fully or causally with the mask aligned to
its keys' end; no window, mask, dropout or sinks (those raise). It returns the output and, with
``return_lse``, the row logsumexp, (heads, tokens) fp32, and autograd runs through both (its
backward reads D = rowsum(out * dout) - dlse). head_dim 320-512 runs on sm80 or newer (off
sm90's own path only multiples of 32, which every head_dim taken here is). The dense ``ffpa_attn_func`` returns
no logsumexp, which the op needs (for sinks, and as the backward's input), so every call is a
varlen call: a dense batch is B sequences of S tokens.

``FFPA_ATTN`` is an FA2 kernel (``fa2.FA2Kernel``) on these calls: the same varlen layouts of
padded and packed batches, restricted to what ffpa computes: window (-1, 0) with Sq == Sk (its
kernels align causal masks differently for other lengths), or (-1, -1); no image blocks.

The interface has no backward that takes the caller's output and logsumexp, as FA2's does
(the op passes a rescaled output with sinks, and a logsumexp of +inf at rows a layout drops).
So the backward computes the call again under autograd and differentiates the output and the
logsumexp together: with c = exp(lse again - lse given) per row (0 where the given one is
infinite), the output's gradient c * dout and the logsumexp's c * rowsum(dout * (out again -
out given)), FA2's backward exactly: P given = c * P, and D = c * rowsum(dout * out given).
One more forward per backward.

Speed: asked for, it is taken only where ``CROSSOVERS`` (measured by ``benchmarks/gpu_check.py
--sections global``) says it beats what SDPA runs for the call, as the wide-head kernel is;
where nothing is measured for the GPU and dtype (nowhere yet), SDPA stays and the report says
so. Not asked for, SDPA (or another kernel) runs as before.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..registration import autograd_recorded
from ..window import UNBOUNDED
from . import fa2
from .contract import CallFacts, unmeasured_or_short
from .fa2 import varlen as fa2_varlen
from .fa2.flash_attn import release

NAME = "ffpa-attn"
USE_VARIABLE = "COMPILE_PASS_FFPA"
MIN_VERSION = (0, 2, 4)  # the release read: varlen calls returning a differentiable logsumexp
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 320, 512, 32
# (CUDA capability, dtype) -> the fewest keys at which ffpa's fwd+bwd was measured at least as
# fast as SDPA's. Empty: no GPU here has run it.
CROSSOVERS: Mapping[tuple[tuple[int, int], torch.dtype], int] = MappingProxyType({})
NOT_MEASURED = f"{NAME} is not measured on a GPU yet (benchmarks/gpu_check.py --sections global fills ffpa.CROSSOVERS)"


@functools.cache
def _loaded():
    """(the ffpa_attn package, None), or (None, why) where it is missing or its CuTe-DSL
    backend does not load: ffpa_attn imports without it (and its varlen function then fails
    when called), so the backend is imported too. Any exception: its dependencies (cutlass-dsl,
    quack, CUDA libraries) fail in their own ways."""
    try:
        import ffpa_attn
        import ffpa_attn.cute  # noqa: F401 - imported to see whether it loads
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    return ffpa_attn, None


def _interface():
    return _loaded()[0]


def unavailable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ffpa-attn is not used for this call, or None when it is: process-wide facts only."""
    if os.environ.get(USE_VARIABLE, "") != "1":
        return f"{NAME} is used only when asked for ({USE_VARIABLE}=1)"
    return cannot_run(device, dtype, head_dim)


def cannot_run(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why ffpa-attn cannot run such a call here, asked for or not (the benchmark's question)."""
    if dtype not in fa2.DTYPES:
        return f"{NAME} takes fp16 or bf16, not {dtype}"
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM or head_dim % HEAD_DIM_STEP:
        return f"{NAME} takes head_dim {MIN_HEAD_DIM}-{MAX_HEAD_DIM} in steps of {HEAD_DIM_STEP}, not {head_dim}"
    capability = fa2.device_capability(device)
    if capability is None:
        return "no CUDA GPU is available" if device.type == "cuda" else f"{NAME} runs only on CUDA, not {device.type}"
    if torch.version.hip is not None:
        return f"{NAME}'s CuTe-DSL kernels do not run on ROCm"
    if capability < (8, 0):
        return f"{NAME} needs sm80 or newer"
    interface, why = _loaded()
    least = ".".join(map(str, MIN_VERSION))
    if interface is None:
        return f"{NAME} >= {least} is not installed or does not load ({why})"
    if release(interface.__version__) < MIN_VERSION:
        return f"{NAME} {interface.__version__} is installed; {least} or newer is needed"
    return None


def _causal(left: int, right: int) -> bool:
    if (left, right) == (UNBOUNDED, 0):
        return True
    if (left, right) == (UNBOUNDED, UNBOUNDED):
        return False
    raise ValueError(f"{NAME} computes no window ({left}, {right})")  # the kernel's cannot refuses such calls


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale):
    return _interface().ffpa_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=scale,
        causal=causal,
        enable_gqa=True,
        return_lse=True,
    )


def _dense_part(batch: int, seq_q: int, seq_k: int, left: int, right: int, device) -> fa2_varlen.VarlenPass:
    """A dense batch as a varlen call: B sequences of seq_q queries and seq_k keys."""
    sequences = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return fa2_varlen.VarlenPass(None, None, None, sequences * seq_q, sequences * seq_k, seq_q, seq_k, left, right)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) -> (B * S, H, D), contiguous."""
    return x.reshape(-1, *x.shape[2:]).contiguous()


class FFPACalls:
    """FA2's four entry points (``fa2.FA2Calls``) through ffpa's varlen function."""

    name = NAME
    takes_softcap = False
    unavailable_reason = staticmethod(unavailable_reason)

    def varlen_forward(self, q, k, v, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        causal = _causal(part.left, part.right)
        q, k, v = (x.contiguous() for x in (q, k, v))
        with torch.no_grad():
            return _varlen(
                q, k, v, part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k, causal, scale
            )

    def varlen_backward(self, dout, q, k, v, out, lse, part: fa2_varlen.VarlenPass, scale, softcap=0.0):
        """FA2's backward for the given output and logsumexp, from the call computed again
        (the module's docstring says how)."""
        fa2.no_softcap(self.name, softcap)
        causal = _causal(part.left, part.right)
        inputs = [x.detach().contiguous().requires_grad_() for x in (q, k, v)]
        sizes = (part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k, causal, scale)
        with autograd_recorded():
            again, again_lse = _varlen(inputs[0], inputs[1], inputs[2], *sizes)
            weight = torch.where(torch.isfinite(lse), torch.exp(again_lse.detach() - lse), 0.0)  # (H, T)
            by_row = weight.t()[..., None]
            grad_out = (dout.float() * by_row).to(dout.dtype)
            grad_lse = weight * (dout.float() * (again.detach().float() - out.float())).sum(-1).t()
            return torch.autograd.grad((again, again_lse), inputs, (grad_out, grad_lse))

    def dense_forward(self, q, k, v, left, right, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        batch, seq_q, heads, dim = q.shape
        part = _dense_part(batch, seq_q, k.shape[1], left, right, q.device)
        out, lse = self.varlen_forward(_tokens(q), _tokens(k), _tokens(v), part, scale)
        return out.view(batch, seq_q, heads, dim), lse.view(heads, batch, seq_q).transpose(0, 1).contiguous()

    def dense_backward(self, dout, q, k, v, out, lse, left, right, scale, softcap=0.0):
        fa2.no_softcap(self.name, softcap)
        batch, seq_q, heads, _ = q.shape
        part = _dense_part(batch, seq_q, k.shape[1], left, right, q.device)
        by_token = lse.transpose(0, 1).reshape(heads, batch * seq_q)
        grads = self.varlen_backward(*(_tokens(x) for x in (dout, q, k, v, out)), by_token, part, scale)
        return tuple(grad.view(x.shape) for grad, x in zip(grads, (q, k, v), strict=True))


class FFPAKernel(fa2.FA2Kernel):
    """The op's kernel on ffpa-attn: FA2's layouts (dense, padded, packed) for the windows ffpa
    computes. ``crossovers`` as ``CROSSOVERS``; a policy given another table
    (``KernelPolicy.replacing``) routes by that one."""

    def __init__(self, crossovers: Mapping[tuple[tuple[int, int], torch.dtype], int] = CROSSOVERS):
        super().__init__(FFPACalls())
        self.crossovers = MappingProxyType(dict(crossovers))

    def __repr__(self) -> str:
        return f"FFPAKernel({dict(self.crossovers)})"

    def cannot(self, facts: CallFacts) -> str | None:
        why = super().cannot(facts)
        if why is not None:
            return why
        if facts.blocks:
            return f"{NAME} takes no image blocks"
        if facts.left is None or facts.right is None:
            return f"{NAME} computes causal or full attention only, and this call's window is not known here"
        if facts.left != UNBOUNDED or facts.right not in (0, UNBOUNDED):
            return f"{NAME} computes causal or full attention only, not window ({facts.left}, {facts.right})"
        if facts.right == 0 and not facts.same_lengths:
            return f"{NAME} is given causal calls with Sq == Sk only (its kernels align other lengths differently)"
        return None

    def never_faster(self, facts: CallFacts) -> str | None:
        """None: at head_dim 320-512 SDPA has no flash kernel of its own, so even a call it runs
        without its mask is one ffpa-attn may beat (its crossovers, against what SDPA runs)."""
        return None

    def slower(self, facts: CallFacts) -> str | None:
        return unmeasured_or_short(self.crossovers, fa2.device_capability(facts.device), facts, NOT_MEASURED)


FFPA_ATTN = FFPAKernel()
