"""Rows that see no key, computed as an additive mask's finite fill computes them, around any
kernel (as ``sinks.py`` applies sinks).

A kernel gives a row that sees no key zeros and an infinite logsumexp (``kernels/contract.py``).
Attention whose mask adds a finite fill (transformers' ``torch.finfo(dtype).min``) gives such a
row something else: every score plus the fill rounds to the fill itself, so its softmax is
uniform, p = 1/Sk over all Sk keys, and the row is the mean of the values. Its gradient is the
softmax's at p = 1/Sk: with g the row's output gradient and v̄ the mean value,
- dV_j += g / Sk;
- dS_j = (g . v_j - g . v̄) / Sk, times 1 - tanh^2(s_j / cap) where the scores are soft-capped
  (the cap's derivative at the raw score s_j = scale q . k_j);
- dq = scale * sum_j dS_j k_j and dk_j += scale * dS_j q.
Without a cap the sums over pairs factor through (D, D) matrices, V^T K per kv head and
sum_rows q g^T, so E such rows cost O((E + Sk) D^2); with one they cost O(E Sk D), in chunks.

The rule proves from the mask that its fill hides every score up to a bound (``bound``: the
fill's spacing in each dtype the sum may be computed in, ``proof/additive.py``); the forward
checks that the scores of such rows are below it (Cauchy-Schwarz: |s| <= scale |q| max|k|, or
the cap), raising where they are not, as the sinks' check does: the fill would no longer hide
them all alike. Checked in fp64 against autograd of the spelled-out chain
(``tests/ops/test_keyless_rows.py``).
"""

from __future__ import annotations

import torch

from ..kernels.layout import accumulation_dtype

KEYLESS_CHECK = (
    "compile_pass: a row that sees no key has scores the attention mask's fill may not hide all alike "
    "(or not finite): the result would differ from eager; compile with spelled_attention=False"
)
# Gathered rows times keys per chunk of the soft-capped gradient (its (rows, Sk) scores).
_CHUNK_ELEMENTS = 1 << 22


def keyless(logsumexp: torch.Tensor) -> torch.Tensor:
    """(B, H, Sq) bool: the rows a kernel found no key for (either infinity: the contract)."""
    return logsumexp.isinf()


def _kv_heads(query: torch.Tensor, key: torch.Tensor) -> int:
    return query.shape[1] // key.shape[1]


def _per_query_head(x: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Hk, ...) -> (B, H, ...): each kv head's for the query heads it serves."""
    return x.repeat_interleave(group, dim=1)


def fill_mean(
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float,
    bound: float,
) -> torch.Tensor:
    """``out`` with every row that sees no key set to the mean of all values (computed in the
    accumulation dtype, rounded once), after checking its scores are below ``bound``; written
    in place (``out`` keeps its layout)."""
    if key.shape[2] == 0:  # no key at all: no mean, the kernels' zeros stand
        return out
    acc = accumulation_dtype(query.dtype)
    rows = keyless(logsumexp)
    _check_scores(rows, query, key, scale, softcap, bound, acc)
    mean = _per_query_head(value.to(acc).mean(dim=2), _kv_heads(query, key))  # (B, H, D)
    filled = torch.where(rows[..., None], mean[:, :, None, :].to(out.dtype), out)
    return out.copy_(filled)


def _check_scores(
    rows: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float,
    softcap: float,
    bound: float,
    acc: torch.dtype,
) -> None:
    """Every score of a row in ``rows`` below ``bound`` by a factor of 2 (the chain's own
    rounding of its scores), raising otherwise; a NaN in q or k fails it too."""
    query_norms = torch.where(rows, query.to(acc).norm(dim=-1), 0).amax(dim=(1, 2))  # (B,)
    key_norms = key.to(acc).norm(dim=-1).amax(dim=(1, 2))
    largest = torch.where(rows.any(dim=(1, 2)), scale * query_norms * key_norms, 0).amax()
    if softcap:  # a capped score is at most the cap (NaN stays NaN)
        largest = torch.minimum(largest, largest.new_tensor(softcap))
    torch._assert_async(2 * largest < bound, KEYLESS_CHECK)


def zero_rows(grad_out: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    """``grad_out`` with the rows that see no key zeroed: the kernel's backward then gives them
    no share whatever it reads of their (filled) output."""
    return torch.where(keyless(logsumexp)[..., None], 0, grad_out)


def add_gradients(
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    logsumexp: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (dq, dk, dv) plus the gradients of the rows that see no key (in place)."""
    grad_q, grad_k, grad_v = grads
    sk = key.shape[2]
    index = keyless(logsumexp).nonzero()  # (E, 3): batch, head, row (one host sync)
    if sk == 0 or index.shape[0] == 0:
        return grads
    acc = accumulation_dtype(query.dtype)
    group = _kv_heads(query, key)
    batch, head, row = index.unbind(1)
    pair = batch * key.shape[1] + head // group  # each row's (batch, kv head), flattened
    q = query[batch, head, row].to(acc)  # (E, D)
    g = grad_out[batch, head, row].to(acc)
    k = key.to(acc).flatten(0, 1)  # (B * Hk, Sk, D)
    v = value.to(acc).flatten(0, 1)
    mean = v.mean(dim=1)  # (B * Hk, D)
    g_dot_mean = (g * mean[pair]).sum(-1)  # (E,)
    d_value = torch.zeros_like(mean).index_add_(0, pair, g) / sk
    if softcap:
        d_query, d_key = _capped_pairs(q, g, g_dot_mean, k, v, pair, scale, softcap)
    else:
        d_query, d_key = _factored(q, g, g_dot_mean, k, v, pair, scale)
    grad_q.index_put_((batch, head, row), d_query.to(grad_q.dtype), accumulate=True)
    grad_k.add_(d_key.unflatten(0, key.shape[:2]).to(grad_k.dtype))
    grad_v.add_(d_value.unflatten(0, key.shape[:2])[:, :, None, :].to(grad_v.dtype))
    return grad_q, grad_k, grad_v


def _factored(q, g, g_dot_mean, k, v, pair, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dq and dk without a cap: dS_j = (g . v_j - g . v̄) / Sk, so dq = scale / Sk (g V^T K -
    (g . v̄) sum_j k_j) and dk_j = scale / Sk (M v_j - c), M = sum q g^T, c = sum (g . v̄) q
    over the rows of each (batch, kv head)."""
    sk = k.shape[1]
    pairs, inverse = pair.unique(return_inverse=True)
    values_by_keys = v[pairs].transpose(1, 2) @ k[pairs]  # (P, D, D): sum_j v_j k_j^T
    key_sum = k[pairs].sum(dim=1)  # (P, D)
    d_query = (g[:, None, :] @ values_by_keys[inverse]).squeeze(1) - g_dot_mean[:, None] * key_sum[inverse]
    outer = torch.zeros(len(pairs), q.shape[1], q.shape[1], dtype=q.dtype, device=q.device)
    outer.index_add_(0, inverse, q[:, :, None] * g[:, None, :])  # M = sum q g^T
    shift = torch.zeros(len(pairs), q.shape[1], dtype=q.dtype, device=q.device)
    shift.index_add_(0, inverse, g_dot_mean[:, None] * q)
    d_key = torch.zeros_like(k)
    d_key[pairs] = v[pairs] @ outer.transpose(1, 2) - shift[:, None, :]
    return d_query * (scale / sk), d_key * (scale / sk)


def _capped_pairs(q, g, g_dot_mean, k, v, pair, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dq and dk with a cap, pair by pair over chunks of rows: dS_j times 1 - tanh^2."""
    sk = k.shape[1]
    d_query = torch.empty_like(q)
    d_key = torch.zeros_like(k)
    step = max(1, _CHUNK_ELEMENTS // max(sk * q.shape[1], 1))
    for start in range(0, q.shape[0], step):
        part = slice(start, start + step)
        keys, values = k[pair[part]], v[pair[part]]  # (n, Sk, D)
        raw = scale * (keys @ q[part, :, None]).squeeze(-1)  # (n, Sk)
        slope = 1 - torch.tanh(raw / softcap).square()
        d_scores = ((values @ g[part, :, None]).squeeze(-1) - g_dot_mean[part, None]) * slope / sk
        d_query[part] = scale * (d_scores[:, None, :] @ keys).squeeze(1)
        d_key.index_add_(0, pair[part], scale * d_scores[:, :, None] * q[part, None, :])
    return d_query, d_key
