"""The backward kernels of ``wide_head.py`` (``key_grad``: dK and dV, key-stationary, the GQA
group looped inside; ``query_grad``: dQ), on the layout and the helpers of
``wide_head_kernels.py``, whose docstring says what they compute. Imported with it, only when
a call runs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import LOG2E, accumulate_dot, chunked_dot, log2_scores, visible


@triton.jit
def _probabilities(
    q_base,
    k_base,
    lse_row,
    rows64,
    keys64,
    rows,
    keys,
    row_ok,
    key_ok,
    q_sm,
    k_sn,
    pad_row,
    seg_row,
    seq_q,
    seq_k,
    left,
    right,
    scale_log2,
    cap_inner,
    cap_log2,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """(P, tanh) of a (BLOCK_M, BLOCK_N) block: the forward's P, recomputed from the scores
    and the row logsumexps, 0 where a key is not seen and in rows of logsumexp +inf (no key
    seen); and ``log2_scores``' tanh, whose slope 1 - tanh^2 scales dS where scores are capped."""
    dots = chunked_dot(
        q_base,
        k_base,
        rows64,
        keys64,
        row_ok,
        key_ok,
        q_sm,
        k_sn,
        HEAD_DIM,
        D_CHUNK,
        PRECISION,
        UPCAST,
        BLOCK_M,
        BLOCK_N,
    )
    scores, capped = log2_scores(dots, scale_log2, cap_inner, cap_log2, SOFTCAP)
    lse = tl.load(lse_row + rows, mask=row_ok, other=float("inf"))
    seen = visible(
        rows, keys, row_ok, key_ok, pad_row, seg_row, seq_q, seq_k, left, right, HAS_LEFT, HAS_RIGHT, HAS_PAD, HAS_SEG
    )
    return tl.where(seen, tl.exp2(scores - (lse * LOG2E)[:, None]), 0.0), capped


@triton.jit
def _score_grads(probs, capped, grad_probs, delta, SOFTCAP: tl.constexpr):
    """dS = P * (dP - delta), times the cap's slope 1 - tanh^2 where scores are capped."""
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
    k_block = tl.program_id(0)
    batch_kv = tl.program_id(1)
    b = (batch_kv // kv_heads).to(tl.int64)
    kv = (batch_kv % kv_heads).to(tl.int64)
    keys = k_block * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < seq_k
    keys64 = keys.to(tl.int64)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
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
            if not READ_LIVE or tl.load(LIVE + (b * q_blocks + q_block) * k_blocks + k_block) != 0:
                rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = rows < seq_q
                rows64 = rows.to(tl.int64)
                probs, capped = _probabilities(
                    q_base,
                    k_base,
                    lse_row,
                    rows64,
                    keys64,
                    rows,
                    keys,
                    row_ok,
                    key_ok,
                    q_sm,
                    k_sn,
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
                    D_PAD,
                    D_CHUNK,
                    PRECISION,
                    UPCAST,
                    BLOCK_M,
                    BLOCK_N,
                    HAS_LEFT,
                    HAS_RIGHT,
                    HAS_PAD,
                    HAS_SEG,
                    SOFTCAP,
                )
                if VALUE:
                    grad_out = tl.load(
                        g_base + rows64[:, None] * g_sm + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :],
                        other=0.0,
                    )
                    acc = accumulate_dot(tl.trans(probs.to(grad_out.dtype)), grad_out, acc, PRECISION, UPCAST)
                else:
                    grad_probs = chunked_dot(
                        g_base,
                        v_base,
                        rows64,
                        keys64,
                        row_ok,
                        key_ok,
                        g_sm,
                        v_sn,
                        HEAD_DIM,
                        D_CHUNK,
                        PRECISION,
                        UPCAST,
                        BLOCK_M,
                        BLOCK_N,
                    )
                    delta = tl.load(DELTA + (b * heads + h) * seq_q + rows, mask=row_ok, other=0.0)
                    grad_scores = _score_grads(probs, capped, grad_probs, delta, SOFTCAP)
                    query = tl.load(
                        q_base + rows64[:, None] * q_sm + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :],
                        other=0.0,
                    )
                    acc = accumulate_dot(tl.trans(grad_scores.to(query.dtype)), query, acc, PRECISION, UPCAST)
    if not VALUE:
        acc = acc * scale
    tl.store(
        GRAD + b * d_sb + kv * d_sh + keys64[:, None] * d_sn + dims[None, :],
        acc.to(GRAD.dtype.element_ty),
        mask=key_ok[:, None] & dim_ok[None, :],
    )


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
    q_block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = (batch_head // heads).to(tl.int64)
    h = (batch_head % heads).to(tl.int64)
    kv = h // group
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_q
    rows64 = rows.to(tl.int64)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < HEAD_DIM
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
        if not READ_LIVE or tl.load(LIVE + table * k_blocks + k_block) != 0:
            keys = k_block * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = keys < seq_k
            keys64 = keys.to(tl.int64)
            probs, capped = _probabilities(
                q_base,
                k_base,
                lse_row,
                rows64,
                keys64,
                rows,
                keys,
                row_ok,
                key_ok,
                q_sm,
                k_sn,
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
                D_PAD,
                D_CHUNK,
                PRECISION,
                UPCAST,
                BLOCK_M,
                BLOCK_N,
                HAS_LEFT,
                HAS_RIGHT,
                HAS_PAD,
                HAS_SEG,
                SOFTCAP,
            )
            grad_probs = chunked_dot(
                g_base,
                v_base,
                rows64,
                keys64,
                row_ok,
                key_ok,
                g_sm,
                v_sn,
                HEAD_DIM,
                D_CHUNK,
                PRECISION,
                UPCAST,
                BLOCK_M,
                BLOCK_N,
            )
            grad_scores = _score_grads(probs, capped, grad_probs, delta, SOFTCAP)
            key = tl.load(
                k_base + keys64[:, None] * k_sn + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0
            )
            acc = accumulate_dot(grad_scores.to(key.dtype), key, acc, PRECISION, UPCAST)
    tl.store(
        GRAD + b * d_sb + h * d_sh + rows64[:, None] * d_sm + dims[None, :],
        (acc * scale).to(GRAD.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
