"""The Triton kernels of ``wide_head.py``: attention for head_dim 64-512, the forward and what
the backward kernels (``backward.py``) share with it.

Imported only when a call runs (``wide_head._kernels``): importing this module imports
triton and creates the ``@triton.jit`` functions, which read ``TRITON_INTERPRET`` then.

Layout of every kernel (shared/REFERENCE.md, section 10): a 64 x 512 fp32 tile is 128 KiB,
so a kernel holds one wide accumulator and nothing else that wide.
- Scores ``Q K^T`` (and ``dO V^T``) are accumulated over head_dim chunks of ``D_CHUNK``
  columns: only (rows, D_CHUNK) slices of Q, K, dO, V are live at a time.
- The one wide accumulator is (rows, D_PAD) fp32; D_PAD is head_dim rounded up to a power
  of two (``tl.arange`` needs one), the columns past head_dim loaded as zeros and never
  stored. Triton has no indexing of register slices, so the accumulator is one tensor that
  the compiler spreads over the warps' registers; P is computed once per key block and
  multiplies the whole (BLOCK_N, D_PAD) V tile in one ``tl.dot``.
- Backward: ``row_dot`` (rowsum(dO * O)), then (``backward.py``) ``key_grad``
  twice, key-stationary, the GQA group's query heads looped inside (dV: P^T dO; dK: dS^T Q),
  and ``query_grad``, query-stationary (dQ: dS K). No atomics: each program owns its output
  rows.
The tile sizes (BLOCK_M, BLOCK_N, D_CHUNK, warps, stages) are each launch's own, measured on
the device (``tiles.py``).

Visibility of key ``j`` from query ``i`` (the op's semantics, FA2's window bottom-right
aligned): ``-left <= j - i - (Sk - Sq) <= right`` (a side of -1 unbounded), the key valid
(``PAD[b, j]``), the same segment (``SEG[b, i] == SEG[b, j]``). A row that sees no key gets
zeros and a logsumexp of +inf, so it passes no gradient. Only the key blocks between the
first and the last that some row of a query block sees are visited (per-block ranges from
``wide_head.block_table``); with padding or segment ids, whose live blocks may have holes
between those, each block's flag (``LIVE``) is read too (``READ_LIVE``). The element mask
keeps every visited block exact.

Soft-capping (``SOFTCAP``, FA2's ``softcap``): the scores are ``cap * tanh(scale * q.k / cap)``
before the mask; the backward multiplies dS by the slope ``1 - tanh^2``.

Offsets are computed in int64: a (batch, head) base times a stride can pass 2**31.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Below this |x|, tanh's odd series (to x^5; error under 1e-9 relative) replaces the exp form,
# whose 1 - exp(-2|x|) cancels near 0.
TANH_SERIES_BELOW: tl.constexpr = tl.constexpr(0.0625)


@triton.jit
def accumulate_dot(a, b, total, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """total + a @ b. ``UPCAST``: the operands in fp32 first, for Triton's CPU interpreter,
    which multiplies bf16 operands as their raw bits (3.9); a product of two bf16 values is
    exact in fp32, so this matches a GPU's bf16 MMA with fp32 accumulation up to the order
    of the sums."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), total, input_precision="ieee")
    return tl.dot(a, b, total, input_precision=PRECISION)


@triton.jit
def tanh(x):
    """tanh in fp32 from exp2 (Triton's interpreter has no tanh, and one formula on both keeps
    the tests on the GPU's arithmetic): sign(x) (1 - e) / (1 + e) with e = exp(-2|x|), which
    never overflows; near 0 the series x - x^3/3 + 2x^5/15."""
    size = tl.abs(x)
    e = tl.exp2(size * (-2.0 * LOG2E))
    square = x * x
    near_zero = size * (1.0 - square * (1.0 / 3.0 - square * (2.0 / 15.0)))
    t = tl.where(size < TANH_SERIES_BELOW, near_zero, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def log2_scores(dot, scale_log2, cap_inner, cap_log2, SOFTCAP: tl.constexpr):
    """(scores in log2 units, tanh of the capped argument) from the raw dot products q.k:
    ``scale * q.k`` or, soft-capped, ``cap * tanh(q.k * scale / cap)``, times log2(e). The
    second value is the dots again where nothing is capped (unused then)."""
    if SOFTCAP:
        t = tanh(dot * cap_inner)
        return t * cap_log2, t
    return dot * scale_log2, dot


@triton.jit
def chunked_dot(
    a_base,
    b_base,
    a_rows,
    b_rows,
    a_ok,
    b_ok,
    a_stride,
    b_stride,
    HEAD_DIM: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """(A rows, B rows) fp32 = A B^T over head_dim, ``D_CHUNK`` columns at a time (the last
    chunk masked past head_dim)."""
    total = tl.zeros([a_rows.shape[0], b_rows.shape[0]], dtype=tl.float32)
    offsets = tl.arange(0, D_CHUNK)
    a_chunk = a_base + a_rows[:, None] * a_stride + offsets[None, :]
    b_chunk = b_base + b_rows[None, :] * b_stride + offsets[:, None]
    for start in tl.static_range(0, HEAD_DIM, D_CHUNK):
        if start + D_CHUNK <= HEAD_DIM:
            a = tl.load(a_chunk + start, mask=a_ok[:, None], other=0.0)
            b = tl.load(b_chunk + start, mask=b_ok[None, :], other=0.0)
        else:
            dim_ok = start + offsets < HEAD_DIM
            a = tl.load(a_chunk + start, mask=a_ok[:, None] & dim_ok[None, :], other=0.0)
            b = tl.load(b_chunk + start, mask=b_ok[None, :] & dim_ok[:, None], other=0.0)
        total = accumulate_dot(a, b, total, PRECISION, UPCAST)
    return total


@triton.jit
def visible(
    rows,
    keys,
    row_ok,
    key_ok,
    pad_row,
    seg_row,
    seq_q,
    seq_k,
    left,
    right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
):
    """(rows, keys) bool: which keys each row sees."""
    seen = row_ok[:, None] & key_ok[None, :]
    distance = keys[None, :] - rows[:, None] - (seq_k - seq_q)
    if HAS_LEFT:
        seen = seen & (distance >= -left)
    if HAS_RIGHT:
        seen = seen & (distance <= right)
    if HAS_PAD:
        valid = tl.load(pad_row + keys, mask=key_ok, other=0)
        seen = seen & (valid != 0)[None, :]
    if HAS_SEG:
        row_ids = tl.load(seg_row + rows, mask=row_ok, other=-1)
        key_ids = tl.load(seg_row + keys, mask=key_ok, other=-2)
        seen = seen & (row_ids[:, None] == key_ids[None, :])
    return seen


@triton.jit
def block_scores(
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
    HEAD_DIM: tl.constexpr,
    D_CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_SEG: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """(scores in log2 units, ``log2_scores``' tanh, which keys each row sees) of the (rows,
    keys) block of one query head: what the forward and every backward kernel compute first."""
    row_ok = rows < seq_q
    key_ok = keys < seq_k
    rows64, keys64 = rows.to(tl.int64), keys.to(tl.int64)
    dots = chunked_dot(q_base, k_base, rows64, keys64, row_ok, key_ok, q_sm, k_sn, HEAD_DIM, D_CHUNK, PRECISION, UPCAST)
    scores, capped = log2_scores(dots, scale_log2, cap_inner, cap_log2, SOFTCAP)
    seen = visible(
        rows, keys, row_ok, key_ok, pad_row, seg_row, seq_q, seq_k, left, right, HAS_LEFT, HAS_RIGHT, HAS_PAD, HAS_SEG
    )
    return scores, capped, seen


@triton.jit
def block_rows(block, seq, BLOCK: tl.constexpr):
    """(indices, which lie in the sequence, the indices in int64 for offsets) of a block of
    query rows or keys."""
    rows = block * BLOCK + tl.arange(0, BLOCK)
    return rows, rows < seq, rows.to(tl.int64)


@triton.jit
def program_rows(heads, seq, BLOCK: tl.constexpr):
    """(block, batch, head, and ``block_rows``) of this program: its block of stationary rows
    (the grid's first axis) and its batch * heads (the second)."""
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch = (batch_head // heads).to(tl.int64)
    head = (batch_head % heads).to(tl.int64)
    rows, ok, rows64 = block_rows(block, seq, BLOCK)
    return block, batch, head, rows, ok, rows64


@triton.jit
def load_rows(base, rows64, ok, stride, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """The (rows, D_PAD) tile of these rows of a (seq, head_dim) matrix, zeros past head_dim and
    in rows out of range."""
    dims = tl.arange(0, D_PAD)
    return tl.load(
        base + rows64[:, None] * stride + dims[None, :], mask=ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0
    )


@triton.jit
def store_rows(base, rows64, ok, stride, tile, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Stores a (rows, D_PAD) tile into these rows of a (seq, head_dim) matrix, in the matrix's
    dtype, its columns up to head_dim and its rows in range."""
    dims = tl.arange(0, D_PAD)
    tl.store(
        base + rows64[:, None] * stride + dims[None, :],
        tile.to(base.dtype.element_ty),
        mask=ok[:, None] & (dims < HEAD_DIM)[None, :],
    )


@triton.jit
def block_live(LIVE, index, READ_LIVE: tl.constexpr):
    """Whether the pair of blocks at ``index`` of the live table is visited: its flag where
    ``READ_LIVE``, else always (the test folds away, and no flag is loaded)."""
    return not READ_LIVE or tl.load(LIVE + index) != 0


# Written out in each kernel: its parameters, which are its launch's (``_launch`` in __init__.py
# passes them in this order, benchmarks/wide_head_compile.py types them by name), and its loop
# over the streamed blocks, whose body is the kernel's own (a jit function takes no loop body).
@triton.jit
def forward(
    Q,
    K,
    V,
    OUT,
    LSE,
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
    o_sb,
    o_sh,
    o_sm,
    pad_sb,
    seg_sb,
    heads,
    group,
    seq_q,
    seq_k,
    left,
    right,
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
    """One (query block, batch * head): out and logsumexp (natural log) of its rows."""
    q_block, b, h, rows, row_ok, rows64 = program_rows(heads, seq_q, BLOCK_M)
    kv = h // group
    q_base = Q + b * q_sb + h * q_sh
    k_base = K + b * k_sb + kv * k_sh
    v_base = V + b * v_sb + kv * v_sh
    table = b * q_blocks + q_block
    first = tl.load(KEY_FIRST + table)
    last = tl.load(KEY_LAST + table)
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for k_block in range(first, last + 1):
        if block_live(LIVE, table * k_blocks + k_block, READ_LIVE):
            keys, key_ok, keys64 = block_rows(k_block, seq_k, BLOCK_N)
            scores, _, seen = block_scores(
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
            scores = tl.where(seen, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            # A row that has seen no key yet keeps -inf: subtract 0 there, not -inf (NaN).
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            decay = tl.exp2(best - shift)
            probs = tl.exp2(scores - shift[:, None])
            total = total * decay + tl.sum(probs, 1)
            values = load_rows(v_base, keys64, key_ok, v_sn, HEAD_DIM, D_PAD)
            acc = accumulate_dot(probs.to(values.dtype), values, acc * decay[:, None], PRECISION, UPCAST)
            best = new_best
    seen_any = total > 0
    out = acc / tl.where(seen_any, total, 1.0)[:, None]
    store_rows(OUT + b * o_sb + h * o_sh, rows64, row_ok, o_sm, out, HEAD_DIM, D_PAD)
    lse = tl.where(seen_any, (best + tl.log2(tl.where(seen_any, total, 1.0))) * LN2, float("inf"))
    tl.store(LSE + (b * heads + h) * seq_q + rows, lse, mask=row_ok)


@triton.jit
def row_dot(
    GRAD_OUT,
    OUT,
    DELTA,
    g_sb,
    g_sh,
    g_sm,
    o_sb,
    o_sh,
    o_sm,
    heads,
    seq_q,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32, (batch, heads, seq_q) contiguous."""
    _, b, h, rows, row_ok, rows64 = program_rows(heads, seq_q, BLOCK_M)
    grad = load_rows(GRAD_OUT + b * g_sb + h * g_sh, rows64, row_ok, g_sm, HEAD_DIM, D_PAD)
    out = load_rows(OUT + b * o_sb + h * o_sh, rows64, row_ok, o_sm, HEAD_DIM, D_PAD)
    tl.store(DELTA + (b * heads + h) * seq_q + rows, tl.sum(grad.to(tl.float32) * out.to(tl.float32), 1), mask=row_ok)
