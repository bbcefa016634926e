"""FlashAttention-2's semantics, for every implementation of its kernels: torch's own
(``aten::_flash_attention_forward/_backward``, ``torch_flash``) and the flash-attn
package's (``flash_attn``). Both run the same ``mha_fwd``/``mha_varlen_fwd`` entry points of
FA2's C++ API, so the window clamp, the bottom-right alignment, the layouts and what a row
without keys gets are the same; an implementation only says how to call them (``FA2Calls``).

Here: which windows FA2 computes exactly (``window_is_exact``), and the kernel object
(``FA2Kernel``) that runs a call through an implementation, dense or as the varlen calls of
a padded, packed or image batch (``fa2.varlen``).

Layout: FA2 allocates its output like q (``empty_like``). It always gets q as a
(B, S, H, D)-contiguous tensor, so its output is heads-last, the layout the fake promises,
whatever the input strides. Models hand over transposed views of exactly that storage, so
this copies nothing for them; the other choice, a fake that follows q's strides, would tie
every kernel's output layout to q's and make the usual
``out.transpose(1, 2).reshape(b, s, h * d)`` copy for (B, H, S, D)-contiguous inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from ...window import UNBOUNDED
from ..contract import (
    AttentionCall,
    CallFacts,
    band_skips_little,
    measured_or_set,
    nothing_to_skip,
    padded_value_unmeasured,
    short_call,
)
from ..layout import empty_like_heads_last
from . import varlen as fa2_varlen
from .varlen import NOT_GIVEN, VarlenLayout, VarlenPass, image_pass, shared_layout

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# Calls with at most this many keys keep SDPA on a GPU (``kernel.short_call``): plain calls,
# and calls with key padding, segment ids or image blocks (varlen calls). Measured on an H200
# (``benchmarks/gpu_check.py``: bf16, 16/8 heads, head_dim 256, w = 512 and 1024). One layer,
# batch 4, calls queued: plain calls ran at 0.68-0.78x of SDPA with the mask up to 512 keys,
# 1.11x at 768. Padded: the 6-layer training step (batch 2, a row left-padded by a quarter,
# the layout's host sync once per step) ran at 0.84x with 1024 tokens, 1.05x with 1536,
# 1.12x with 2048. fp16 is taken to be bf16's.
SHORT_KEYS = 512
SHORT_KEYS_VARLEN = 1024


def short_keys(facts: CallFacts) -> int:
    """The most keys such a call keeps SDPA with on a GPU."""
    return measured_or_set(SHORT_KEYS_VARLEN if facts.batch_masks or facts.blocks else SHORT_KEYS)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None for every other device.

    The one seam of the FA2 kernels: the contract tests (tests/kernels/flash_contract_cases.py,
    tests/test_torch_flash_contract.py) replace it to run them on CPU tensors over emulated
    kernels."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def common_reason(device: torch.device, dtype: torch.dtype, head_dim: int, who: str) -> str | None:
    """Why no FA2 implementation runs this call: FA2's dtype and head_dim limits, forward and
    backward, a device with no CUDA GPU, ROCm (where neither runs FA2's own kernels with
    windows as tested here). None where an implementation may; it checks the rest."""
    if dtype not in DTYPES:
        return f"{who} takes fp16 or bf16, not {dtype}"
    if head_dim > MAX_HEAD_DIM or head_dim % 8 != 0:
        return f"{who} takes head_dim <= {MAX_HEAD_DIM} and a multiple of 8, not {head_dim}"
    if device_capability(device) is None:
        return "no CUDA GPU is available" if device.type == "cuda" else f"{who} runs only on CUDA, not {device.type}"
    if torch.version.hip is not None:
        # flash-attn's Triton AMD backend ignores window_size; aten's ROCm kernels are others.
        return f"{who} is not used on ROCm"
    return None


class FA2Calls(Protocol):
    """How one implementation calls FA2's four entry points. Inputs: (B, S, H, D) or (T, H, D),
    last dimension contiguous; K/V with their own (fewer) heads. Dense logsumexp (B, H, Sq),
    varlen (H, T), fp32, contiguous as the kernel reads it. ``softcap``: FA2's (0: none), given
    only to an implementation that ``takes_softcap`` (``FA2Kernel.cannot``)."""

    name: str
    takes_softcap: bool

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None: ...

    def dense_forward(
        self, q, k, v, left: int, right: int, scale: float, softcap: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dense_backward(
        self, dout, q, k, v, out, lse, left: int, right: int, scale: float, softcap: float = 0.0
    ) -> tuple[torch.Tensor, ...]: ...

    def varlen_forward(
        self, q, k, v, part: VarlenPass, scale: float, softcap: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def varlen_backward(
        self, dout, q, k, v, out, lse, part: VarlenPass, scale: float, softcap: float = 0.0
    ) -> tuple[torch.Tensor, ...]: ...


def no_softcap(name: str, softcap: float) -> None:
    """An implementation without FA2's softcap is never given one (``FA2Kernel.cannot``)."""
    if softcap:
        raise ValueError(f"{name} takes no softcap (got {softcap})")


def window_is_exact(seq_q: int, seq_k: int, left: int, right: int) -> bool:
    """Whether FA2 computes window (left, right) exactly for these lengths.

    Its C++ API turns a side >= seq_k into -1, then an unbounded side into seq_k when the
    other side is bounded (no mask at all when both are unbounded). On the left this never
    changes which keys a row sees. On the right it does when seq_q > seq_k + 1: rows aligned
    before key -1 reach the last key only through a right side wider than seq_k."""
    if seq_q <= seq_k + 1 or 0 <= right < seq_k:
        return True
    if left == UNBOUNDED or left >= seq_k:
        # No mask at all: exact when the first row sees every key anyway.
        return right == UNBOUNDED or right >= seq_q - 1
    return right == seq_k  # clamped to -1, then back to seq_k


def with_image_rows(band, images, block_ids, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, logsumexp) of the band, with the image rows (``block_ids >= 0``) taken from the
    image pass's; the output written into ``out`` (the layout the op returns)."""
    image_rows = (block_ids >= 0)[:, None, :]
    torch.where(image_rows[..., None], images[0], band[0], out=out)
    return out, torch.where(image_rows, images[1], band[1])


def without_image_rows(logsumexp: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The logsumexp with image rows at +inf: a backward over the band then gives them no
    probability, so no gradient (the image pass gives theirs)."""
    return logsumexp.masked_fill((block_ids >= 0)[:, None, :], float("inf"))


def summed_heads_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b, summed in fp32 and rounded once, stored heads-last as every gradient is."""
    batch, heads, seq, dim = a.shape
    total = a.new_empty(batch, seq, heads, dim).transpose(1, 2)
    return total.copy_(a.float() + b.float())


def _gather(x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
    """(B, H, S, D) -> the given tokens of the flattened batch as (T, H, D), contiguous; every
    token in order for None (a view where x is stored heads-last)."""
    batch, heads, seq, dim = x.shape
    flat = x.transpose(1, 2).reshape(batch * seq, heads, dim)
    return flat if tokens is None else flat[tokens]


def _dropped_rows(key_padding: torch.Tensor | None) -> torch.Tensor | None:
    """(B * S, 1) True at the padding rows of a pass in place, whose results it drops (a
    padding run is a sequence of its own there); None where it keeps every row."""
    return None if key_padding is None else ~key_padding.reshape(-1, 1)


def no_left_bound_unmeasured(name: str) -> str:
    """Why an FA2 implementation may be slower than SDPA on a call with no left bound, by the
    static tables: its crossovers are measured for sliding windows only. A packed or padded call
    (varlen) against SDPA with the block-diagonal or padded mask is timed by
    ``benchmarks/gpu_check.py --sections packed``, and measured on the device (``compile_pass.measure``)."""
    return f"with no left bound, {name} against SDPA is not in its measured crossovers (gpu_check.py --sections packed)"


class FA2Plan(NamedTuple):
    """How FA2 computes one call: dense (``layout`` None) or the layout's varlen calls, then,
    with image blocks, their rows by one more varlen call (``images``)."""

    layout: VarlenLayout | None
    images: VarlenPass | None


class FA2Kernel:
    """The sliding-window op on one FA2 implementation. Exact for every window FA2's clamp
    leaves unchanged, key padding whose valid tokens are one run per row (left or right
    padding, transformers' packing), segments that are runs, and image blocks of one run each
    under a causal window; ``plan`` returns None for the rest, which the next kernel runs."""

    def __init__(self, calls: FA2Calls, measured_on: tuple[str, ...] = ()):
        self.calls = calls
        self.name = calls.name
        # The GPUs (as torch names them) whose measurements made SHORT_KEYS: there the table
        # stands in for a measurement on the device (``policy.statically_measured``).
        self.measured_on = measured_on

    def __repr__(self) -> str:
        return f"FA2Kernel({self.name})"

    def describe(self, facts: CallFacts) -> str:
        kernel = self.name + (" varlen" if facts.batch_masks else "")
        return kernel + (f", image rows by {self.name} varlen" if facts.blocks else "")

    def cannot(self, facts: CallFacts) -> str | None:
        missing = self.calls.unavailable_reason(facts.device, facts.dtype, facts.head_dim)
        if missing is not None:
            return missing
        if facts.softcap and not self.calls.takes_softcap:
            return f"{self.name} has no softcap"
        if facts.key_padding and facts.segment_ids:
            return f"{self.name}'s varlen op takes key padding or segment ids, not both"
        if facts.batch_masks and not facts.same_lengths:
            return f"{self.name} runs key padding or segment ids as varlen calls for Sq == Sk only"
        return None

    def never_faster(self, facts: CallFacts) -> str | None:
        """Where SDPA computes the call without its mask, its own flash kernel runs what FA2
        would (``is_causal``), and FA2 would take such a call before a kernel that is faster."""
        return nothing_to_skip(facts)

    def slower(self, facts: CallFacts) -> str | None:
        if facts.left == UNBOUNDED:
            return no_left_bound_unmeasured(self.name)
        return padded_value_unmeasured(facts) or band_skips_little(facts) or short_call(facts, short_keys(facts))

    def plan(self, call: AttentionCall) -> FA2Plan | None:
        query, key = call.query, call.key
        seq_q, seq_k = query.shape[2], key.shape[2]
        images = None
        if call.block_ids is not None:
            images = image_pass(call.block_ids, call.key_padding, call.left, call.right)
            if images is None:
                return None
        if call.key_padding is None and call.segment_ids is None:
            return FA2Plan(None, images) if window_is_exact(seq_q, seq_k, call.left, call.right) else None
        if seq_q != seq_k:
            return None
        layout = shared_layout(call) if call.layout is not None else NOT_GIVEN
        if layout is NOT_GIVEN:
            # Looked up on its module, so that a test that counts the layouts counts these too.
            layout = fa2_varlen.varlen_layout(call.key_padding, call.segment_ids, call.left, call.right)
        return None if layout is None else FA2Plan(layout, images)

    def forward(self, call: AttentionCall, plan: FA2Plan):
        query, key, value = call.query, call.key, call.value
        scale = (call.scale, call.softcap)
        if plan.layout is None:
            band = _dense_forward(self.calls, query, key, value, call.left, call.right, *scale)
        else:
            band = _varlen_forward(self.calls, query, key, value, *scale, plan.layout, call.key_padding)
        if plan.images is None:
            return band
        images = _varlen_forward(self.calls, query, key, value, *scale, VarlenLayout((plan.images,)))
        return with_image_rows(band, images, call.block_ids, empty_like_heads_last(query))

    def backward(self, call: AttentionCall, plan: FA2Plan, grad_out, out, logsumexp):
        query, key, value = call.query, call.key, call.value
        # Image rows get their gradients from the image pass alone: none from the band's.
        band_lse = logsumexp if plan.images is None else without_image_rows(logsumexp, call.block_ids)
        scale = (call.scale, call.softcap)
        if plan.layout is None:
            grads = _dense_backward(
                self.calls, grad_out, query, key, value, out, band_lse, call.left, call.right, *scale
            )
        else:
            grads = _varlen_backward(
                self.calls, grad_out, query, key, value, out, band_lse, *scale, plan.layout, call.key_padding
            )
        if plan.images is None:
            return grads
        layout = VarlenLayout((plan.images,))
        image_grads = _varlen_backward(self.calls, grad_out, query, key, value, out, logsumexp, *scale, layout)
        return tuple(summed_heads_last(a, b) for a, b in zip(grads, image_grads, strict=True))


def _dense_forward(calls: FA2Calls, query, key, value, left, right, scale, softcap):
    """(B, H, S, D) in (last dimension contiguous); heads-last out and (B, H, Sq) fp32 logsumexp."""
    q = query.transpose(1, 2).contiguous()  # FA2's out is empty_like(q): heads-last
    out, logsumexp = calls.dense_forward(q, key.transpose(1, 2), value.transpose(1, 2), left, right, scale, softcap)
    return out.transpose(1, 2), logsumexp


def _dense_backward(calls: FA2Calls, grad_out, query, key, value, out, logsumexp, left, right, scale, softcap):
    dout, q, k, v, o = (x.transpose(1, 2) for x in (grad_out, query, key, value, out))
    grads = calls.dense_backward(dout, q, k, v, o, logsumexp.contiguous(), left, right, scale, softcap)
    return tuple(grad.transpose(1, 2) for grad in grads)  # (B, S, H, D) buffers: heads-last


def _no_rows_computed(query) -> tuple[torch.Tensor, torch.Tensor]:
    """(B * S, H, D) zeros and a (B * S, H) logsumexp of +inf: what a row no pass computes gets."""
    batch, heads, seq, dim = query.shape
    out = query.new_zeros(batch * seq, heads, dim)
    return out, torch.full((batch * seq, heads), float("inf"), dtype=torch.float32, device=query.device)


def _varlen_forward(calls: FA2Calls, query, key, value, scale, softcap, layout: VarlenLayout, key_padding=None):
    """Self-attention over a padded or packed batch with an FA2 implementation's varlen op, one
    call per pass of the layout. Rows no pass computes (padding that sees no key) get zeros and
    a logsumexp of +inf; a pass with no tokens is not called (FA2 rejects a batch of zero
    sequences). A pass in place comes first: its output is the buffer the others write into."""
    batch, heads, seq, dim = query.shape
    out = logsumexp = None  # (B * S, H, D) and (B * S, H)
    for part in layout.passes:
        if part.query_tokens is None:
            q = _gather(query, None).contiguous()  # FA2's out is empty_like(q): contiguous
            out, token_lse = calls.varlen_forward(q, _gather(key, None), _gather(value, None), part, scale, softcap)
            logsumexp = token_lse.t()
            dropped = _dropped_rows(key_padding)
            if dropped is not None:
                out.masked_fill_(dropped[..., None], 0)
                logsumexp = logsumexp.masked_fill(dropped, float("inf"))
            continue
        if out is None:
            out, logsumexp = _no_rows_computed(query)
        if not part.query_tokens.numel():
            continue
        q = _gather(query, part.query_tokens)
        k, v = (_gather(x, part.key_tokens) for x in (key, value))
        token_out, token_lse = calls.varlen_forward(q, k, v, part, scale, softcap)
        rows, token_lse = part.query_tokens, token_lse.t()
        if part.kept_rows is not None:
            rows, token_out, token_lse = (x[part.kept_rows] for x in (rows, token_out, token_lse))
        out[rows] = token_out
        logsumexp[rows] = token_lse
    if out is None:  # no passes: an empty batch
        out, logsumexp = _no_rows_computed(query)
    return out.view(batch, seq, heads, dim).transpose(1, 2), logsumexp.reshape(batch, seq, heads).permute(
        0, 2, 1
    ).contiguous()


def _varlen_backward(
    calls: FA2Calls, grad_out, query, key, value, out, logsumexp, scale, softcap, layout: VarlenLayout, key_padding=None
):
    """Gradients of ``_varlen_forward``: each pass's FA2 backward, query gradients written
    at its kept rows, key/value gradients of several passes summed in fp32 (the padded rows'
    passes read keys the sequences' pass reads too). Dropped rows get a logsumexp of +inf:
    no probability, so exactly no gradient from them."""
    batch, heads, seq, dim = query.shape
    grad_q = None  # (B * S, H, D)
    grad_kv = None  # in place: in the inputs' dtype; summed over passes: fp32
    lse_by_token = logsumexp.transpose(1, 2).reshape(batch * seq, heads)
    for part in layout.passes:
        if part.query_tokens is None:
            dropped = _dropped_rows(key_padding)
            lse = lse_by_token if dropped is None else lse_by_token.masked_fill(dropped, float("inf"))
            dout, q, o, k, v = (_gather(x, None) for x in (grad_out, query, out, key, value))
            grad_q, *grad_kv = calls.varlen_backward(dout, q, k, v, o, lse.t().contiguous(), part, scale, softcap)
            continue
        if grad_q is None:
            grad_q = query.new_zeros(batch * seq, heads, dim)
        if grad_kv is None:
            grad_kv = [x.new_zeros(batch * seq, x.shape[1], dim, dtype=torch.float32) for x in (key, value)]
        elif grad_kv[0].dtype != torch.float32:  # the pass in place's, from here summed in fp32
            grad_kv = [grad.float() for grad in grad_kv]
        if not part.query_tokens.numel():
            continue
        dout, q, o = (_gather(x, part.query_tokens) for x in (grad_out, query, out))
        k, v = (_gather(x, part.key_tokens) for x in (key, value))
        lse = lse_by_token[part.query_tokens]
        if part.kept_rows is not None:  # stand-in rows: no probability, no gradient
            dout = torch.zeros_like(dout).index_copy_(0, part.kept_rows, dout[part.kept_rows])
            lse = torch.full_like(lse, float("inf")).index_copy_(0, part.kept_rows, lse[part.kept_rows])
        token_grads = calls.varlen_backward(
            dout, q, k, v, o, lse.t().contiguous(), part, scale, softcap
        )  # (H, T), as FA2 reads it
        rows, token_dq = part.query_tokens, token_grads[0]
        if part.kept_rows is not None:
            rows, token_dq = rows[part.kept_rows], token_dq[part.kept_rows]
        grad_q[rows] = token_dq
        for full, tokens in zip(grad_kv, token_grads[1:], strict=True):
            full.index_add_(0, part.key_tokens, tokens.float())
    if grad_q is None:  # no passes: an empty batch
        grad_q = query.new_zeros(batch * seq, heads, dim)
        grad_kv = [x.new_zeros(batch * seq, x.shape[1], dim) for x in (key, value)]
    grad_k, grad_v = (
        full.to(x.dtype).reshape(batch, seq, x.shape[1], dim).transpose(1, 2)
        for full, x in zip(grad_kv, (key, value), strict=True)
    )
    return grad_q.reshape(batch, seq, heads, dim).transpose(1, 2), grad_k, grad_v
