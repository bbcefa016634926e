"""Attention whose mask is a graph input: the band is read at run time from what is known
about that very mask tensor.

Under FSDP2, regional compilation, graph breaks or ``generate()`` with a static cache, the
mask is built in one graph (or in eager code) and reaches the attention layers' graphs as an
input, where no proof can see how it was built. Two sources of facts about a mask tensor:

- **proven where built**: the graph that builds it returns it, compile_pass proves its band
  there (``proof.prove_band`` on the output) and, as the compiled graph returns, attests the
  output tensor (``attest``);
- **checked once**: a mask nobody attested is compared, once, element for element, with the
  band its own entries imply (``check_mask``: an O(S^2) pass and one host sync, cached).

An attestation belongs to one tensor object at one version: it is keyed by the tensor's
identity (held weakly, so a freed tensor's reused address never inherits it) and records
``tensor._version``, so any in-place write since makes it stale and the mask is treated as
unknown again (checked anew). A mask without facts, or whose shape does not line up with the
call, runs SDPA with the mask, exactly as before the rewrite.

``mask_input_attention_forward(q, k, v, mask, scale, enable_gqa)`` decides per call, on the
host, without reading tensor data (the check runs once per mask tensor):
- band with a bounded left side, and a fast kernel here -> the sliding-window op;
- plain causal with Sq == Sk -> SDPA ``is_causal=True``; every key visible -> SDPA, no mask;
- anything else -> SDPA with the mask.
The decision is an output (a small CPU tensor) the backward reads, so both use the same path.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import chunked
from .kernels import kernel_choice
from .layout import check_scale, empty_like_heads_last, new_logsumexp
from .sliding_window import sliding_window_attention_backward, sliding_window_attention_forward
from .window import UNBOUNDED


@dataclass(frozen=True)
class MaskFacts:
    """A (batch, 1, Sq, Sk) bool mask equals FA2's window (left, right) over its own Sq and Sk
    (query i aligned with key i + Sk - Sq), AND ``key_padding[b, kv]`` when given."""

    left: int
    right: int
    key_padding: torch.Tensor | None  # (batch, Sk) bool
    source: str  # "proven" or "checked"


class _Entry(NamedTuple):
    tensor: weakref.ref
    version: int
    facts: MaskFacts | None  # None: checked, not a band


_FACTS: dict[int, _Entry] = {}


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _forget(key: int, dying: weakref.ref) -> None:
    entry = _FACTS.get(key)
    if entry is not None and entry.tensor is dying:
        del _FACTS[key]


def attest(mask: torch.Tensor, facts: MaskFacts | None) -> None:
    """Record ``facts`` for ``mask`` as it is now; a later write or another tensor at the same
    address does not inherit them."""
    version = _version(mask)
    if version is None:
        return
    key = id(mask)
    _FACTS[key] = _Entry(weakref.ref(mask, lambda dying, key=key: _forget(key, dying)), version, facts)


def facts_of(mask: torch.Tensor) -> MaskFacts | None:
    """What is known about ``mask`` now: its attestation if it is this tensor at the attested
    version, else the result of checking it (cached the same way)."""
    entry = _FACTS.get(id(mask))
    version = _version(mask)
    if entry is not None and entry.tensor() is mask and version is not None and entry.version == version:
        return entry.facts
    facts = check_mask(mask)
    attest(mask, facts)
    return facts


def check_mask(mask: torch.Tensor) -> MaskFacts | None:
    """The facts of a (batch, 1, Sq, Sk) bool mask, read off its entries and verified exactly:
    the extreme visible distances give the window, the keys any row sees give the padding, and
    the mask must equal that band AND that padding everywhere. None when it does not, or when
    the window leaves out the aligned diagonal (not an FA2 window)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or 0 in mask.shape:
        return None
    seq_q, seq_k = mask.shape[2:]
    visible = mask[:, 0]
    rows = torch.arange(seq_q, device=mask.device)[:, None] + (seq_k - seq_q)
    distance = torch.arange(seq_k, device=mask.device)[None, :] - rows  # (Sq, Sk)
    far = seq_q + seq_k
    lowest = torch.where(visible, distance, far).amin()
    highest = torch.where(visible, distance, -far).amax()
    lowest, highest = torch.stack([lowest, highest]).tolist()  # the one host sync
    if lowest > 0 or highest < 0:
        return None  # nothing visible, or the aligned diagonal left out
    padding = visible.any(dim=1)  # (batch, Sk)
    band = (distance >= lowest) & (distance <= highest)
    if not torch.equal(visible, band[None] & padding[:, None, :]):
        return None
    # Sides that reach past every key are unbounded (FA2's -1).
    left = UNBOUNDED if lowest <= -(seq_k - 1) else -lowest
    right = UNBOUNDED if highest >= seq_q - 1 else highest
    return MaskFacts(left, right, None if bool(padding.all()) else padding, "checked")


# -- the op ------------------------------------------------------------------------------------

SDPA_WITH_MASK, BAND, CAUSAL, NO_MASK = range(4)
PATH_NAMES = {SDPA_WITH_MASK: "sdpa with the mask", BAND: "band", CAUSAL: "sdpa causal", NO_MASK: "sdpa without a mask"}
# Forward calls by (where the facts came from, path taken): what ran, for tests and users.
calls: collections.Counter = collections.Counter()


def decide(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor) -> tuple[int, int, int, torch.Tensor | None]:
    """(path, left, right, key_padding) for one call, from the facts known about its mask."""
    facts = facts_of(mask)
    path = _path(query, key, mask, facts)
    calls[(facts.source if facts is not None else "unknown", PATH_NAMES[path[0]])] += 1
    return path


def _path(query, key, mask, facts: MaskFacts | None):
    batch, _, seq_q, _ = query.shape
    seq_k = key.shape[2]
    if facts is None or mask.dim() != 4 or tuple(mask.shape[1:]) != (1, seq_q, seq_k):
        return SDPA_WITH_MASK, 0, 0, None
    padding = facts.key_padding
    if padding is not None and tuple(padding.shape) != (batch, seq_k):
        return SDPA_WITH_MASK, 0, 0, None
    # A side reaching past every key is unbounded.
    left = UNBOUNDED if facts.left >= seq_k - 1 else facts.left
    right = UNBOUNDED if facts.right >= seq_q - 1 else facts.right
    if padding is None and left == UNBOUNDED:
        if right == UNBOUNDED:
            return NO_MASK, 0, 0, None
        if right == 0 and seq_q == seq_k:
            return CAUSAL, 0, 0, None
    if left == UNBOUNDED:
        return SDPA_WITH_MASK, 0, 0, None  # no sliding window: SDPA's fused kernel is as good
    if not kernel_choice(query.device, query.dtype, query.shape[-1], batch_masks=padding is not None).fast:
        return SDPA_WITH_MASK, 0, 0, None
    return BAND, left, right, padding


def _sdpa(path: int, query, key, value, mask, scale, enable_gqa):
    if path == SDPA_WITH_MASK:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(query, key, value, is_causal=path == CAUSAL, scale=scale, enable_gqa=enable_gqa)


def _sdpa_backward(path: int, grad_out, query, key, value, mask, out, scale):
    """SDPA's gradients (autograd does not run inside a custom op): softmax's backward over the
    full scores, as SDPA's math path computes it, with rows that see no key given none."""
    if path == SDPA_WITH_MASK:
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    elif path == CAUSAL:
        visible = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        additive = torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill(~visible, float("-inf"))
    else:
        additive = None
    _, logsumexp, _, _ = chunked._math_probabilities(query, key, additive, scale)
    # +inf for rows without a visible key, so their probabilities are 0 (SDPA returns 0 there).
    logsumexp = logsumexp.masked_fill(logsumexp == float("-inf"), float("inf")).flatten(1, 2)
    grad_q, grad_k, grad_v = chunked.MATH.backward(grad_out, query, key, value, out, logsumexp, additive, scale)
    return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype)


@torch.library.custom_op("compile_pass::mask_input_attention_forward", mutates_args=())
def mask_input_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, logsumexp, decision, key_padding). ``decision`` is a CPU int64 (path, left, right,
    has padding); ``key_padding`` the (batch, Sk) padding the band path used (all True
    otherwise). ``out`` is stored heads-last on every path."""
    check_scale(scale)
    path, left, right, padding = decide(query, key, mask)
    batch, seq_k = query.shape[0], key.shape[2]
    decision = torch.tensor([path, left, right, int(padding is not None)], dtype=torch.int64)
    used_padding = padding.clone() if padding is not None else torch.ones(batch, seq_k, dtype=torch.bool, device=query.device)
    if path == BAND:
        out, logsumexp = sliding_window_attention_forward(query, key, value, left, right, scale, padding)
        return out, logsumexp, decision, used_padding
    result = empty_like_heads_last(query)
    result.copy_(_sdpa(path, query, key, value, mask, scale, enable_gqa))
    return result, new_logsumexp(query).zero_(), decision, used_padding


@mask_input_attention_forward.register_fake
def _forward_fake(query, key, value, mask, scale, enable_gqa):
    check_scale(scale)
    batch, seq_k = query.shape[0], key.shape[2]
    decision = torch.empty(4, dtype=torch.int64, device="cpu")
    padding = query.new_empty((batch, seq_k), dtype=torch.bool)
    return empty_like_heads_last(query), new_logsumexp(query), decision, padding


@torch.library.custom_op("compile_pass::mask_input_attention_backward", mutates_args=())
def mask_input_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    decision: torch.Tensor,
    key_padding: torch.Tensor,
    scale: float,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path, left, right, has_padding = decision.tolist()  # a CPU tensor: no device sync
    if path == BAND:
        padding = key_padding if has_padding else None
        return sliding_window_attention_backward(grad_out, query, key, value, out, logsumexp, left, right, scale, padding)
    grads = _sdpa_backward(path, grad_out, query, key, value, mask, out, scale)
    heads_last = [empty_like_heads_last(x) for x in (query, key, value)]
    for target, grad in zip(heads_last, grads):
        target.copy_(grad)
    return tuple(heads_last)


@mask_input_attention_backward.register_fake
def _backward_fake(grad_out, query, key, value, mask, out, logsumexp, decision, key_padding, scale, enable_gqa):
    return empty_like_heads_last(query), empty_like_heads_last(key), empty_like_heads_last(value)


def _setup_context(ctx, inputs, output):
    query, key, value, mask, scale, enable_gqa = inputs
    out, logsumexp, decision, key_padding = output
    ctx.save_for_backward(query, key, value, mask, out, logsumexp, decision, key_padding)
    ctx.scale, ctx.enable_gqa = scale, enable_gqa
    ctx.mark_non_differentiable(logsumexp, decision, key_padding)


def _backward(ctx, grad_out, _logsumexp, _decision, _key_padding):
    query, key, value, mask, out, logsumexp, decision, key_padding = ctx.saved_tensors
    grads = mask_input_attention_backward(
        grad_out, query, key, value, mask, out, logsumexp, decision, key_padding, ctx.scale, ctx.enable_gqa
    )
    return (*grads, None, None, None)


mask_input_attention_forward.register_autograd(_backward, setup_context=_setup_context)
