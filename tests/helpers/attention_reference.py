"""fp64 reference for windowed attention, written from FA2's definition independently of the package."""

import torch
import torch.nn.functional as F


def fa2_window_mask(seq_q: int, seq_k: int, left: int, right: int) -> torch.Tensor:
    """Query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right; -1 is unbounded."""
    i = torch.arange(seq_q).view(-1, 1)
    j = torch.arange(seq_k).view(1, -1)
    aligned = i + (seq_k - seq_q)
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if left >= 0:
        visible &= j >= aligned - left
    if right >= 0:
        visible &= j <= aligned + right
    return visible


def reference_attention(
    query,
    key,
    value,
    left,
    right,
    scale=None,
    key_padding=None,
    segment_ids=None,
    block_ids=None,
    sinks=None,
    mask=None,
    softcap=0.0,
    fill=None,
):
    """SDPA in fp64 with the explicit mask, AND key_padding[b, j] and segment_ids[b, i] ==
    segment_ids[b, j] when given; K/V repeated for GQA. A query row whose own token is padding
    is computed like any other, over the keys it sees. With block_ids (Sq == Sk) the right
    side is widened: j - i >= -left AND (j - i <= right OR block_ids[b, i] == block_ids[b, j]
    >= 0). ``mask``: any (batch, 1, Sq, Sk) bool mask, ANDed in. With sinks (one logit per
    query head (heads,), or per row (batch, heads, Sq)), the spelled-out form transformers'
    eager attention runs: scores, the sink column concatenated, softmax, the column dropped, @ v.
    ``softcap`` (FA2's; 0: none): the scores become ``softcap * tanh(scores / softcap)`` before
    the mask. ``fill``: the chain with an additive mask of this finite fill (0 where a key is
    visible), whose rows that see no key are uniform over every key."""
    groups = query.shape[1] // key.shape[1]
    seq_q, seq_k = query.shape[2], key.shape[2]
    extra, mask = mask, fa2_window_mask(seq_q, seq_k, left, right).to(query.device)
    if block_ids is not None:
        same_block = (block_ids[:, :, None] == block_ids[:, None, :]) & (block_ids[:, :, None] >= 0)
        upper = fa2_window_mask(seq_q, seq_k, -1, right).to(query.device)[None] | same_block
        mask = (fa2_window_mask(seq_q, seq_k, left, -1).to(query.device)[None] & upper)[:, None]
    if key_padding is not None:
        mask = (mask if mask.dim() == 4 else mask[None, None]) & key_padding[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    if extra is not None:
        mask = mask & extra
    query, key, value = (
        query.double(),
        key.double().repeat_interleave(groups, 1),
        value.double().repeat_interleave(groups, 1),
    )
    if sinks is not None or softcap or fill is not None:
        scores = (query @ key.mT) * (scale or query.shape[-1] ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if fill is not None:
            additive = torch.zeros((), dtype=scores.dtype).masked_fill(~mask, fill)
            return torch.softmax(scores + additive, dim=-1) @ value
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:  # a row that sees no key: zeros (its scores made finite first, for the gradient)
            seen = mask.expand_as(scores).any(dim=-1, keepdim=True)
            return (torch.softmax(torch.where(seen, scores, 0.0), dim=-1) * seen) @ value
        sinks = sinks.double()
        sink_column = (sinks[None, :, None] if sinks.dim() == 1 else sinks)[..., None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        return probs @ value
    # fp64 SDPA returns zeros for rows with no visible key, like FA2.
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def random_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, *, heads_last=True, seed=0):
    """Random inputs; heads_last gives the transposed (B, S, H, D)-storage views models produce."""
    gen = torch.Generator().manual_seed(seed)

    def make(h, s):
        if heads_last:
            x = torch.randn(batch, s, h, head_dim, generator=gen, dtype=torch.float64).transpose(1, 2)
        else:
            x = torch.randn(batch, h, s, head_dim, generator=gen, dtype=torch.float64)
        return x.to(dtype).requires_grad_()

    return make(heads, seq_q), make(kv_heads, seq_k), make(kv_heads, seq_k)


def forward_and_grads(fn, inputs, grad_out):
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return out, grads


def reference_logsumexp(query, key, left, right, scale, key_padding=None, segment_ids=None):
    """fp64 (B, H, Sq) logsumexp of ``scale * q k^T`` over the keys each row sees (the mask of
    ``reference_attention`` without block ids), +inf where a row sees none (FA2's convention)."""
    groups = query.shape[1] // key.shape[1]
    mask = fa2_window_mask(query.shape[2], key.shape[2], left, right).to(query.device)[None, None]
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    scores = scale * query.double() @ key.double().repeat_interleave(groups, dim=1).transpose(-1, -2)
    lse = scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
    return lse.masked_fill(lse == float("-inf"), float("inf"))
