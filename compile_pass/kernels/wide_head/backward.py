"""The backward kernels of the wide-head kernel (``key_grad``: dK and dV, key-stationary, the GQA
group looped inside; ``query_grad``: dQ), on the layout and the helpers of ``forward.py``,
whose docstring says what they compute. Imported with it, only when a call runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import (
    LOG2E,
    accumulate_dot,
    block_live,
    block_rows,
    block_scores,
    chunked_dot,
    load_rows,
    program_rows,
    store_rows,
)


@triton.jit
def _probabilities(scores, seen, lse_row, rows, row_ok):
    """The forward's P of a block, recomputed from its scores (``block_scores``) and the rows'
    logsumexps: 0 where a key is not seen and in rows of logsumexp +inf (no key seen)."""
    lse = tl.load(lse_row + rows, mask=row_ok, other=float("inf"))
    return tl.where(seen, tl.exp2(scores - (lse * LOG2E)[:, None]), 0.0)


@triton.jit
def _score_grads(probs, capped, grad_probs, delta, SOFTCAP: tl.constexpr):
    """dS = P * (dP - delta), times the cap's slope 1 - tanh^2 where scores are capped
    (``capped``: ``block_scores``' tanh)."""
    grad_scores = probs * (grad_probs - delta[:, None])
    if SOFTCAP:
        grad_scores = grad_scores * (1.0 - capped * capped)
    return grad_scores


@triton.jit
def key_grad(
    Q,
    K,
    V,
    GRAD_OUT,
    LSE,
    DELTA,
    GRAD,
    PAD,
    SEG,
    LIVE,
    QUERY_FIRST,
    QUERY_LAST,
    q_sb,
    q_sh,
    q_sm,
    k_sb,
    k_sh,
    k_sn,
    v_sb,
    v_sh,
    v_sn,
    g_sb,
    g_sh,
    g_sm,
    d_sb,
    d_sh,
    d_sn,
    pad_sb,
    seg_sb,
    heads,
    kv_heads,
    group,
    seq_q,
    seq_k,
    left,
    right,
    scale,
    scale_log2,
    cap_inner,
    cap_log2,
    q_blocks,
    k_blocks,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    D_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    VALUE: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
    READ_LIVE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One (key block, batch * KV head): dV (``VALUE``: sum of P^T dO) or dK (sum of
    scale * dS^T Q, dS = P * (dO V^T - delta)) over the query heads of its GQA group."""
    k_block, b, kv, keys, key_ok, keys64 = program_rows(kv_heads, seq_k, BLOCK_N)
    k_base = K + b * k_sb + kv * k_sh
    v_base = V + b * v_sb + kv * v_sh
    pad_row = PAD + b * pad_sb
    seg_row = SEG + b * seg_sb
    ranges = b * k_blocks + k_block
    first = tl.load(QUERY_FIRST + ranges)
    last = tl.load(QUERY_LAST + ranges)
    acc = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    for member in range(0, group):
        h = kv * group + member
        q_base = Q + b * q_sb + h * q_sh
        g_base = GRAD_OUT + b * g_sb + h * g_sh
        lse_row = LSE + (b * heads + h) * seq_q
        for q_block in range(first, last + 1):
            if block_live(LIVE, (b * q_blocks + q_block) * k_blocks + k_block, READ_LIVE):
                rows, row_ok, rows64 = block_rows(q_block, seq_q, BLOCK_M)
                scores, capped, seen = block_scores(
                    q_base,
                    k_base,
                    q_sm,
                    k_sn,
                    rows,
                    keys,
                    pad_row,
                    seg_row,
                    seq_q,
                    seq_k,
                    left,
                    right,
                    scale_log2,
                    cap_inner,
                    cap_log2,
                    HEAD_DIM,
                    D_CHUNK,
                    PRECISION,
                    UPCAST,
                    HAS_LEFT,
                    HAS_RIGHT,
                    HAS_PAD,
                    HAS_SEG,
                    SOFTCAP,
                )
                probs = _probabilities(scores, seen, lse_row, rows, row_ok)
                if VALUE:
                    grad_out = load_rows(g_base, rows64, row_ok, g_sm, HEAD_DIM, D_PAD)
                    acc = accumulate_dot(tl.trans(probs.to(grad_out.dtype)), grad_out, acc, PRECISION, UPCAST)
                else:
                    grad_probs = chunked_dot(
                        g_base, v_base, rows64, keys64, row_ok, key_ok, g_sm, v_sn, HEAD_DIM, D_CHUNK, PRECISION, UPCAST
                    )
                    delta = tl.load(DELTA + (b * heads + h) * seq_q + rows, mask=row_ok, other=0.0)
                    grad_scores = _score_grads(probs, capped, grad_probs, delta, SOFTCAP)
                    query = load_rows(q_base, rows64, row_ok, q_sm, HEAD_DIM, D_PAD)
                    acc = accumulate_dot(tl.trans(grad_scores.to(query.dtype)), query, acc, PRECISION, UPCAST)
    if not VALUE:
        acc = acc * scale
    store_rows(GRAD + b * d_sb + kv * d_sh, keys64, key_ok, d_sn, acc, HEAD_DIM, D_PAD)


@triton.jit
def query_grad(
    Q,
    K,
    V,
    GRAD_OUT,
    LSE,
    DELTA,
    GRAD,
    PAD,
    SEG,
    LIVE,
    KEY_FIRST,
    KEY_LAST,
    q_sb,
    q_sh,
    q_sm,
    k_sb,
    k_sh,
    k_sn,
    v_sb,
    v_sh,
    v_sn,
    g_sb,
    g_sh,
    g_sm,
    d_sb,
    d_sh,
    d_sm,
    pad_sb,
    seg_sb,
    heads,
    group,
    seq_q,
    seq_k,
    left,
    right,
    scale,
    scale_log2,
    cap_inner,
    cap_log2,
    q_blocks,
    k_blocks,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    D_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
    READ_LIVE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One (query block, batch * head): dQ = scale * sum over key blocks of dS K."""
    q_block, b, h, rows, row_ok, rows64 = program_rows(heads, seq_q, BLOCK_M)
    kv = h // group
    q_base = Q + b * q_sb + h * q_sh
    g_base = GRAD_OUT + b * g_sb + h * g_sh
    k_base = K + b * k_sb + kv * k_sh
    v_base = V + b * v_sb + kv * v_sh
    lse_row = LSE + (b * heads + h) * seq_q
    delta = tl.load(DELTA + (b * heads + h) * seq_q + rows, mask=row_ok, other=0.0)
    table = b * q_blocks + q_block
    first = tl.load(KEY_FIRST + table)
    last = tl.load(KEY_LAST + table)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for k_block in range(first, last + 1):
        if block_live(LIVE, table * k_blocks + k_block, READ_LIVE):
            keys, key_ok, keys64 = block_rows(k_block, seq_k, BLOCK_N)
            scores, capped, seen = block_scores(
                q_base,
                k_base,
                q_sm,
                k_sn,
                rows,
                keys,
                PAD + b * pad_sb,
                SEG + b * seg_sb,
                seq_q,
                seq_k,
                left,
                right,
                scale_log2,
                cap_inner,
                cap_log2,
                HEAD_DIM,
                D_CHUNK,
                PRECISION,
                UPCAST,
                HAS_LEFT,
                HAS_RIGHT,
                HAS_PAD,
                HAS_SEG,
                SOFTCAP,
            )
            probs = _probabilities(scores, seen, lse_row, rows, row_ok)
            grad_probs = chunked_dot(
                g_base, v_base, rows64, keys64, row_ok, key_ok, g_sm, v_sn, HEAD_DIM, D_CHUNK, PRECISION, UPCAST
            )
            grad_scores = _score_grads(probs, capped, grad_probs, delta, SOFTCAP)
            key = load_rows(k_base, keys64, key_ok, k_sn, HEAD_DIM, D_PAD)
            acc = accumulate_dot(grad_scores.to(key.dtype), key, acc, PRECISION, UPCAST)
    store_rows(GRAD + b * d_sb + h * d_sh, rows64, row_ok, d_sm, acc * scale, HEAD_DIM, D_PAD)
