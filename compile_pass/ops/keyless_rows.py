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
sum_rows q g^T, so E such rows cost O((E + Sk) D^2); with one they cost O(E Sk D), in chunks
of rows. Either way one (batch, kv head) at a time: no (rows, D, D) or (rows, Sk, D) copies.

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
# Rows times keys per chunk of the soft-capped gradient (its (rows, Sk) scores).
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
    d_query, d_key = _query_and_key_gradients(q, g, g_dot_mean, k, v, pair, scale, softcap)
    grad_q.index_put_((batch, head, row), d_query.to(grad_q.dtype), accumulate=True)
    grad_k.add_(d_key.unflatten(0, key.shape[:2]).to(grad_k.dtype))
    grad_v.add_(d_value.unflatten(0, key.shape[:2])[:, :, None, :].to(grad_v.dtype))
    return grad_q, grad_k, grad_v


def _query_and_key_gradients(q, g, g_dot_mean, k, v, pair, scale: float, softcap: float):
    """(dq of the gathered rows, dk of every (batch, kv head)), one (batch, kv head) at a time:
    ``nonzero`` lists the rows by (batch, head, row), so each one's rows are one run."""
    d_query, d_key = torch.empty_like(q), torch.zeros_like(k)
    pairs, counts = pair.unique_consecutive(return_counts=True)
    start = 0
    for index, count in zip(pairs.tolist(), counts.tolist(), strict=True):  # one host sync
        rows = slice(start, start + count)
        start += count
        own = (q[rows], g[rows], g_dot_mean[rows], k[index], v[index])
        d_query[rows], d_key[index] = _capped(*own, scale, softcap) if softcap else _factored(*own)
    return d_query * scale / k.shape[1], d_key * scale / k.shape[1]


def _factored(q, g, g_dot_mean, keys, values) -> tuple[torch.Tensor, torch.Tensor]:
    """Sk / scale times dq and dk without a cap, for one (batch, kv head)'s rows: dS_j =
    (g . v_j - g . v̄) / Sk, so dq ~ g V^T K - (g . v̄) sum_j k_j and dk_j ~ M v_j - c, with
    M = sum q g^T and c = sum (g . v̄) q over the rows: (D, D) products, no (rows, Sk) scores."""
    d_query = g @ (values.T @ keys) - g_dot_mean[:, None] * keys.sum(dim=0)
    d_key = values @ (g.T @ q) - g_dot_mean @ q
    return d_query, d_key


def _capped(q, g, g_dot_mean, keys, values, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sk / scale times dq and dk with a cap, for one (batch, kv head)'s rows, over chunks of
    rows: dS_j times 1 - tanh^2 of the raw score's over the cap."""
    d_query, d_key = torch.empty_like(q), torch.zeros_like(keys)
    step = max(1, _CHUNK_ELEMENTS // max(keys.shape[0], 1))
    for start in range(0, q.shape[0], step):
        part = slice(start, start + step)
        raw = (q[part] @ keys.T) * scale
        slope = 1 - torch.tanh(raw / softcap).square()
        d_scores = (g[part] @ values.T - g_dot_mean[part, None]) * slope
        d_query[part] = d_scores @ keys
        d_key += d_scores.T @ q[part]
    return d_query, d_key
