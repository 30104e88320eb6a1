"""Triton kernels of the attention family (FlashAttention-2 style, exp2 online softmax).

Layout: q, o, do, dq (B, Sq, Hq, D), k, v, dk, dv (B, Sk, Hkv, D) as strided views with a
unit head_dim stride; varlen calls pass batch strides of 0 and per-sequence starts from
cu_seqlens. lse, delta: (B, Hq, Sq) float32, natural-log lse. Every kernel lists its input
pointers before its output pointers (JAX passes them in that order, openkernels.shared.jax);
the launchers pass everything by name (triton/plan.py).

Scores are carried in log2 units (s * log2(e)) so every exponential is one exp2. Each
program visits only key (or query) blocks that some of its rows can see, in up to three
segments: blocks partly masked on the left (sliding window), blocks every row sees in
full (no mask arithmetic at all), and blocks partly masked on the right (causal diagonal,
right window, the sequence end).

Dropout (HAS_DROPOUT) draws its mask from Philox-4x32-7 on counters of (key // 4, query,
b * heads_q + h, 0) under the call's seed (reference.py defines it bit for bit), so the
forward and both backward kernels regenerate the same mask without storing it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1): one exp2, saturates to +-1 without NaN on both vendors.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _tanh_mufu(x):
    # NVIDIA's one-instruction tanh (MUFU.TANH): the formula above costs two multi-function
    # unit operations (exp2, reciprocal) per score on the unit the softmax's exp2 already
    # saturates. Measured on an H100 over every float32 in [-20, 20]: within 8.0e-6 of tanh
    # (softcap 30: 2.4e-4 in a score); benchmarks/studies/attention_softcap_tanh.py.
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)  # fmt: skip


@triton.jit
def _philox(k0, k1, c0, c1, c2, c3, ROUNDS: tl.constexpr):
    """Philox-4x32 on uint32 tiles c0..c3 under the uniform key (k0, k1): reference.philox4x32."""
    for _ in tl.static_range(ROUNDS):
        hi0 = tl.math.umulhi(c0, 0xD2511F53)
        hi1 = tl.math.umulhi(c2, 0xCD9E8D57)
        lo0 = tl.mul(c0, 0xD2511F53, sanitize_overflow=False)
        lo1 = tl.mul(c2, 0xCD9E8D57, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _dropout_seed(seed_ptr):
    """The Philox key: the two int32 words at seed_ptr, as uint32."""
    return tl.load(seed_ptr).to(tl.uint32, bitcast=True), tl.load(seed_ptr + 1).to(tl.uint32, bitcast=True)


@triton.jit
def _dropout_keep(k0, k1, head, rows, start, drop_below, BLOCK: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """Which probabilities of query rows `rows` (indices within the sequence) and keys start ..
    start + BLOCK - 1 (start a multiple of 4) of counter head `head` dropout keeps: (rows,
    keys), or (keys, rows) when KEYS_FIRST. Key j takes word j % 4 of Philox at (j // 4, row,
    head, 0), kept when that word, read signed after subtracting 2**31, is at least
    drop_below (the threshold less 2**31): one Philox call per 4 keys, interleaved back."""
    groups = start // 4 + tl.arange(0, BLOCK // 4)
    if KEYS_FIRST:
        c0 = groups[:, None] + rows[None, :] * 0
        c1 = rows[None, :] + groups[:, None] * 0
    else:
        c0 = groups[None, :] + rows[:, None] * 0
        c1 = rows[:, None] + groups[None, :] * 0
    zero = (c0 * 0).to(tl.uint32)
    r0, r1, r2, r3 = _philox(k0, k1, c0.to(tl.uint32), c1.to(tl.uint32), zero + head, zero, 7)
    # join(join(w0, w2), join(w1, w3))[..., a, b] is word 2a + b: flattened, key 4g + w.
    keep = tl.join(tl.join(_kept(r0, drop_below), _kept(r2, drop_below)),
                   tl.join(_kept(r1, drop_below), _kept(r3, drop_below)))  # fmt: skip
    if KEYS_FIRST:
        keep = tl.reshape(tl.permute(keep, (0, 2, 3, 1)), (BLOCK, rows.shape[0]))
    else:
        keep = tl.reshape(keep, (rows.shape[0], BLOCK))
    return keep != 0


@triton.jit
def _kept(word, drop_below):
    """1 where a Philox word keeps its probability (see _dropout_keep), else 0, as int8."""
    return ((word ^ 0x80000000).to(tl.int32, bitcast=True) >= drop_below).to(tl.int8)


@triton.jit
def _load_rows(ptrs, row_ok, cols, MASK_ROWS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Tile at ptrs (rows, BLOCK_W) whose columns are `cols`: zeros where row_ok (rows, 1) is
    false (when MASK_ROWS) and past WIDTH; no mask at all for full blocks of power-of-two
    widths. Shared by the attention tiles and the KV-cache kernels' code tiles, so both
    keep the same mask-free fast path."""
    if MASK_ROWS:
        if BLOCK_W == WIDTH:
            tile = tl.load(ptrs, mask=row_ok, other=0)
        else:
            tile = tl.load(ptrs, mask=row_ok & (cols[None, :] < WIDTH), other=0)
    else:
        if BLOCK_W == WIDTH:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0)
    return tile


@triton.jit
def _load_tile(base, idx, stride, offs_d, limit, MASK_IDX: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr):  # fmt: skip
    """Rows `idx` of a (seq, head_dim) slice as (len(idx), BLOCK_D), zeros past `limit` (when
    MASK_IDX) and past HEAD_DIM; no mask at all for full blocks of power-of-two head dims."""
    return _load_rows(base + idx[:, None] * stride + offs_d[None, :], idx[:, None] < limit, offs_d, MASK_IDX,
                      HEAD_DIM, BLOCK_D)  # fmt: skip


@triton.jit
def _kv_source(base, seqlen, stride, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               USE_TMA: tl.constexpr):  # fmt: skip
    """What the key/value loop loads from: a TMA descriptor over this sequence's (seqlen,
    head_dim) slice (Hopper; rows past the end and the head_dim pad read as zeros), else the
    slice's base pointer."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride, 1],
                                        block_shape=[BLOCK, BLOCK_D])  # fmt: skip
    else:
        src = base
    return src


@triton.jit
def _load_kv(src, start, idx, stride, offs_d, limit, MASK_IDX: tl.constexpr, HEAD_DIM: tl.constexpr,
             BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):  # fmt: skip
    """Rows start..start + len(idx) (idx = start + arange) through the copy engine or as
    _load_tile does."""
    if USE_TMA:
        tile = src.load([start, 0])
    else:
        tile = _load_tile(src, idx, stride, offs_d, limit, MASK_IDX, HEAD_DIM, BLOCK_D)
    return tile


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of sequence b: from cu_seqlens when varlen,
    else 0 and the dense lengths (starts as tensors either way, for .to(int64))."""
    if IS_VARLEN:
        q_start = tl.load(cu_q_ptr + b)
        sq = tl.load(cu_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_k_ptr + b)
        sk = tl.load(cu_k_ptr + b + 1) - k_start
    else:
        q_start = b * 0
        sq = seqlen_q
        k_start = q_start
        sk = seqlen_k
    return q_start, sq, k_start, sk


@triton.jit
def _row_block(
    cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, heads_q, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr
):
    """Where a program of the forward or dQ kernel works: (b, h, q_start, seqlen_q, k_start,
    seqlen_k, m0) for BLOCK_M query rows from m0 of (sequence b, query head h) = program axis
    1. Causal work grows with the row block, so program 0 takes the last one: the heaviest
    blocks start first. The caller returns when m0 >= seqlen_q."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    q_start, sq, k_start, sk = _sequence(cu_q_ptr, cu_k_ptr, b, seqlen_q, seqlen_k, IS_VARLEN)
    return b, h, q_start, sq, k_start, sk, pid_m * BLOCK_M


@triton.jit
def _alibi_distance(i, j, diag):
    # |i + diag - j| as float32 (ALiBi's distance; a helper so that
    # benchmarks/studies/attention_alibi_distance.py can time other forms in its place).
    return tl.abs(i + diag - j).to(tl.float32)


@triton.jit
def _log2_scores(
    qk, i, j, seqlen_k, diag, key_term, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out,
    MASK: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Scores in log2 units from raw dot products qk; i (query rows) and j (key columns)
    broadcast against qk. Returns (s, th): th = tanh of the capped score (for the
    backward's chain rule) when HAS_SOFTCAP, else qk itself (unused). HAS_SOFTCAP: 0/False
    none, 1/True the portable tanh, 2 NVIDIA's tanh instruction (plan.softcap_flag).

    HAS_ALIBI: 0/False none; 1/True the bias -slope |i + diag - j| per score; 2 (causal
    calls, plan.alibi_flag: every visible key has j <= i + diag, so the distance is
    i + diag - j) the bias split into a key term slope (j - anchor), key_term (broadcast
    against qk, alibi_key_term: added here, folded into the scale's multiply), and a row term
    slope (i + diag - anchor) that the callers move into the row's log-sum-exp
    (alibi_row_shift): the row max and sum, and so the probabilities, do not see a per-row
    constant. anchor: the program's first row + diag (forward, dQ) or first key (dK/dV), so
    both terms stay small (precise in float32) for the keys that carry weight."""
    th = qk
    if HAS_SOFTCAP:
        if HAS_SOFTCAP == 2:
            th = _tanh_mufu(qk * cap_scale)
        else:
            th = _tanh(qk * cap_scale)
        s = th * cap_out
    else:
        s = qk * qk_scale
    if HAS_ALIBI == 2:
        s += key_term
    elif HAS_ALIBI:
        s -= slope_log2 * _alibi_distance(i, j, diag)
    if MASK:
        visible = tl.broadcast_to(j < seqlen_k, s.shape)
        if HAS_WINDOW_LEFT:
            visible &= j >= i + diag - window_left
        if HAS_WINDOW_RIGHT:
            visible &= j <= i + diag + window_right
        s = tl.where(visible, s, float("-inf"))
    return s, th


@triton.jit
def alibi_key_term(key_base, start_n, anchor, slope_log2):
    """slope (j - anchor) for the keys start_n + offs_n of a block, from key_base = slope
    offs_n (float32, loop-invariant): one conversion per block instead of one per key (the
    conversion runs on the quarter-rate pipe the softmax's exp2 uses)."""
    return key_base + (start_n - anchor).to(tl.float32) * slope_log2


@triton.jit
def alibi_row_shift(rows, diag, anchor, slope_log2):
    """The row term of the split ALiBi bias (HAS_ALIBI 2, _log2_scores), log2 units: the
    true score is the kernel's minus this, and so is the true log-sum-exp."""
    return slope_log2 * (rows + diag - anchor).to(tl.float32)


@triton.jit
def _segments(
    first, last, length, diag_sign, window_left, window_right,
    BLOCK: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
):  # fmt: skip
    """Blocks of the other axis that rows/cols first..last can see: returns (a, b, c, end)
    such that [a, b) and [c, end) need masks and [b, c) are seen in full.

    diag_sign = +diag when iterating keys for query rows (key j visible from row i when
    i + diag - wl <= j <= i + diag + wr), -diag when iterating query rows for key columns
    (row i sees column j when j - diag - wr <= i <= j - diag + wl): the two cases swap the
    roles of the windows, handled by the caller passing (wl, wr) or (wr, wl)."""
    lo = 0
    hi = length
    full_lo = 0
    full_hi = length
    if HAS_WINDOW_RIGHT:
        hi = tl.minimum(hi, last + diag_sign + window_right + 1)
        full_hi = tl.minimum(full_hi, first + diag_sign + window_right + 1)
    if HAS_WINDOW_LEFT:
        lo = tl.maximum(lo, first + diag_sign - window_left)
        full_lo = tl.maximum(full_lo, last + diag_sign - window_left)
    hi = tl.maximum(hi, 0)
    full_hi = tl.maximum(full_hi, 0)
    lo = tl.minimum(lo, length)
    a = lo // BLOCK * BLOCK
    b = tl.maximum((full_lo + BLOCK - 1) // BLOCK * BLOCK, a)
    c = tl.maximum(full_hi // BLOCK * BLOCK, b)
    end = tl.maximum(hi, c)
    return a, b, c, end


@triton.jit
def _key_sweep(
    m0, rows, sq, sk, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_n, offs_d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
):  # fmt: skip
    """How the BLOCK_M query rows from m0 (rows) of the forward and dQ kernels go over the sk
    keys of a sequence with sq queries: _segments' (a, b, c, end), and the arguments their
    block loops (_fwd_blocks, _dq_blocks) take after start and stop, from the row index to
    offs_d."""
    diag = sk - sq
    a, b_full, c_full, end = _segments(
        m0, m0 + BLOCK_M - 1, sk, diag, window_left, window_right, BLOCK_N, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT
    )
    opts = (
        rows,
        sk,
        diag,
        m0 + diag,  # the split ALiBi's anchor (_log2_scores)
        window_left,
        window_right,
        slope_log2,
        qk_scale,
        cap_scale,
        cap_out,
        offs_n,
        offs_d,
    )
    return a, b_full, c_full, end, opts


@triton.jit
def _softmax_step(s, m_i, l_i, MASK: tl.constexpr):
    """One block of the online softmax over log2-unit scores s (rows, keys): returns the
    block's probabilities relative to the new row max, the factor that rescales what was
    accumulated before, the new row sums and the new row max."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK:  # a row that has seen no key yet keeps max -inf: shift by 0 instead
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, start, stop, rows, seqlen_k, diag, anchor,
    window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_n, offs_d, drop,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """drop: (k0, k1, head, drop_below) of dropout (read under HAS_DROPOUT): the row sums
    take every probability, the output only the kept ones (scaled at the end)."""
    key_base = offs_n.to(tl.float32) * slope_log2
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_kv(k_base, start_n, cols, stride_ks, offs_d, seqlen_k, MASK, HEAD_DIM, BLOCK_D, USE_TMA)
        qk = tl.dot(q, tl.trans(k))
        if HAS_ALIBI == 2:
            key_term = alibi_key_term(key_base, start_n, anchor, slope_log2)[None, :]
        else:
            key_term = 0.0
        s, _ = _log2_scores(
            qk, rows[:, None], cols[None, :], seqlen_k, diag, key_term, window_left, window_right, slope_log2,
            qk_scale, cap_scale, cap_out, MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
        )  # fmt: skip
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASK)
        if HAS_DROPOUT:
            p = tl.where(
                _dropout_keep(drop[0], drop[1], drop[2], rows, start_n, drop[3], BLOCK_N, False), p, 0.0
            )
        v = _load_kv(v_base, start_n, cols, stride_vs, offs_d, seqlen_k, MASK, HEAD_DIM, BLOCK_D, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, slopes_ptr, seed_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_q, group, qk_scale, cap_scale, cap_out, window_left, window_right, drop_below,
    drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
    USE_TMA: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (sequence, query head)."""
    b, h, q_start, sq, k_start, sk, m0 = _row_block(cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, heads_q, BLOCK_M,
                                                    IS_VARLEN)  # fmt: skip
    if m0 >= sq:
        return
    hk = h // group
    q_base = q_ptr + b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    k_base = k_ptr + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + offs_m
    q_mask = (rows[:, None] < sq) & (offs_d[None, :] < HEAD_DIM)
    q = _load_tile(q_base, rows, stride_qs, offs_d, sq, True, HEAD_DIM, BLOCK_D)
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(slopes_ptr + b * heads_q + h) * 1.4426950408889634
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    a, b_full, c_full, end, opts = _key_sweep(
        m0, rows, sq, sk, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_n, offs_d,
        BLOCK_M, BLOCK_N, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
    )  # fmt: skip
    k_src = _kv_source(k_base, sk, stride_ks, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
    v_src = _kv_source(v_base, sk, stride_vs, BLOCK_N, HEAD_DIM, BLOCK_D, USE_TMA)
    args = (k_src, v_src, stride_ks, stride_vs)
    drop = (0, 0, 0, 0)
    if HAS_DROPOUT:
        k0, k1 = _dropout_seed(seed_ptr)
        drop = (k0, k1, tl.program_id(1), drop_below)
    # A sliding window runs one masked loop: three loops' scalars spilled on AMD and the
    # window is narrow. Otherwise the blocks every row sees in full skip the mask.
    if HAS_WINDOW_LEFT:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, *args, a, end, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                                    HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, USE_TMA,
                                    HAS_DROPOUT)  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, *args, b_full, c_full, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D,
                                    False, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
                                    USE_TMA, HAS_DROPOUT)  # fmt: skip
        acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, *args, c_full, end, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                                    HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, USE_TMA,
                                    HAS_DROPOUT)  # fmt: skip
    # Rows that saw no key: output 0, lse -inf.
    empty = l_i == 0.0
    norm = tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        norm = norm / drop_scale  # kept probabilities are scaled by 1 / (1 - dropout_p)
    out = acc / norm[:, None]
    lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    if HAS_ALIBI == 2:
        lse2 -= alibi_row_shift(rows, sk - sq, m0 + sk - sq, slope_log2)
    lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
    o_base = o_ptr + b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
    tl.store(
        o_base + rows[:, None] * stride_os + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=q_mask
    )
    lse_base = lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + q_start
    tl.store(lse_base + rows, lse, mask=rows < sq)


@triton.jit
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, cu_q_ptr, delta_ptr,
    stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    seqlen_q, heads_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(o * do) in float32: the softmax backward's per-row term."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    if IS_VARLEN:
        q_start = tl.load(cu_q_ptr + b)
        sq = tl.load(cu_q_ptr + b + 1) - q_start
    else:
        q_start = tl.program_id(0) * 0
        sq = seqlen_q
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < sq) & (offs_d[None, :] < HEAD_DIM)
    start = q_start.to(tl.int64)
    o = tl.load(o_ptr + b.to(tl.int64) * stride_ob + start * stride_os + h * stride_oh
                + rows[:, None] * stride_os + offs_d[None, :], mask=mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + b.to(tl.int64) * stride_dob + start * stride_dos + h * stride_doh
                 + rows[:, None] * stride_dos + offs_d[None, :], mask=mask, other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + q_start + rows, delta, mask=rows < sq)


@triton.jit
def _attn_bwd_group_sum_kernel(
    part_ptr, grad_ptr, stride_gb, stride_gs, stride_gh, seqlen, heads_kv,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """GQA's dK or dV: grad[b, s, h] = the sum over g of part[b, s, h * GROUP + g], part being
    float32 and contiguous with one head per query head; always in the same order (the
    backward is deterministic), rounded once to grad's dtype. Rows are (s, h) pairs of one
    batch entry (program axis 1; varlen: one batch of every packed token)."""
    b = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = rows // heads_kv
    h = rows % heads_kv
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seqlen * heads_kv) & (offs_d[None, :] < HEAD_DIM)
    first = (b.to(tl.int64) * seqlen * heads_kv + rows) * (GROUP * HEAD_DIM)
    src = part_ptr + first[:, None] + offs_d[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for g in tl.static_range(GROUP):
        acc += tl.load(src + g * HEAD_DIM, mask=mask, other=0.0)
    dst = grad_ptr + b.to(tl.int64) * stride_gb + s.to(tl.int64)[:, None] * stride_gs + h[:, None] * stride_gh
    tl.store(dst + offs_d[None, :], acc.to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, start, stop, cols, seqlen_q,
    seqlen_k, diag, anchor, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_m, offs_d, drop,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key block over query blocks start..stop, in the transposed (key, query)
    orientation: pT = exp2(sT - lse), dV += pT do, dK += (pT * (dpT - delta)) q. With dropout
    (drop: k0, k1, head, drop_below, drop_scale, the block's first key) dV takes the kept pT (scaled by the caller)
    and dpT the kept entries times the scale."""
    if HAS_ALIBI == 2:  # this program's keys: the same for every query block
        key_term = (slope_log2 * (cols - anchor).to(tl.float32))[:, None]
    else:
        key_term = 0.0
    for start_m in range(start, stop, BLOCK_M):
        rows = start_m + offs_m
        q = _load_tile(q_base, rows, stride_qs, offs_d, seqlen_q, MASK, HEAD_DIM, BLOCK_D)
        do = _load_tile(do_base, rows, stride_dos, offs_d, seqlen_q, MASK, HEAD_DIM, BLOCK_D)
        # Rows with no visible key (lse -inf) and rows past the end get probability 0.
        if MASK:
            lse = tl.load(lse_base + rows, mask=rows < seqlen_q, other=float("-inf"))
            delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        if HAS_ALIBI == 2:
            lse2 += alibi_row_shift(rows, diag, anchor, slope_log2)
        qk_t = tl.dot(k, tl.trans(q))
        s_t, th_t = _log2_scores(
            qk_t, rows[None, :], cols[:, None], seqlen_k, diag, key_term, window_left, window_right, slope_log2,
            qk_scale, cap_scale, cap_out, MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
        )  # fmt: skip
        p_t = tl.exp2(s_t - lse2[None, :])
        if HAS_DROPOUT:
            keep_t = _dropout_keep(drop[0], drop[1], drop[2], rows, drop[5], drop[3], cols.shape[0], True)
            dv += tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do)
        else:
            dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        if HAS_DROPOUT:
            dp_t = tl.where(keep_t, dp_t * drop[4], 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if HAS_SOFTCAP:
            ds_t = ds_t * (1.0 - th_t * th_t)
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, slopes_ptr, seed_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_q, group, qk_scale, sm_scale, cap_scale, cap_out, window_left, window_right,
    drop_below, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_N keys of one (sequence, query head). dK and dV of that query
    head's share are written to dk/dv at head h: with GQA the launcher passes float32
    buffers with one head per query head and sums each group in a fixed order afterwards
    (deterministic, no atomics; a loop over the group inside the program kept four more
    tiles live and spilled)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q
    hk = h // group
    q_start, sq, k_start, sk = _sequence(cu_q_ptr, cu_k_ptr, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= sk:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    cols = n0 + tl.arange(0, BLOCK_N)
    kv_mask = (cols[:, None] < sk) & (offs_d[None, :] < HEAD_DIM)
    k_off = b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    v_off = b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    k = _load_tile(k_ptr + k_off, cols, stride_ks, offs_d, sk, True, HEAD_DIM, BLOCK_D)
    v = _load_tile(v_ptr + v_off, cols, stride_vs, offs_d, sk, True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    diag = sk - sq
    # Query rows that see these keys: the key-side view swaps the windows' roles.
    a, b_full, c_full, end = _segments(
        n0, n0 + BLOCK_N - 1, sq, -diag, window_right, window_left, BLOCK_M, HAS_WINDOW_RIGHT, HAS_WINDOW_LEFT
    )
    q_row0 = q_start.to(tl.int64)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + q_row0 * stride_qs + h * stride_qh
    do_base = do_ptr + b.to(tl.int64) * stride_dob + q_row0 * stride_dos + h * stride_doh
    lse_base = lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + q_start
    delta_base = delta_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + q_start
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(slopes_ptr + b * heads_q + h) * 1.4426950408889634
    bases = (q_base, do_base, lse_base, delta_base, stride_qs, stride_dos)
    opts = (cols, sq, sk, diag, n0, window_left, window_right)  # n0: the split ALiBi's anchor
    drop = (0, 0, 0, 0, 0.0, 0)
    if HAS_DROPOUT:
        k0, k1 = _dropout_seed(seed_ptr)
        drop = (k0, k1, bh, drop_below, drop_scale, n0)
    scal = (slope_log2, qk_scale, cap_scale, cap_out, offs_m, offs_d, drop)
    if HAS_WINDOW_LEFT and HAS_WINDOW_RIGHT:  # a sliding window: one masked loop (as the forward)
        dk, dv = _dkdv_blocks(dk, dv, k, v, *bases, a, end, *opts, *scal, BLOCK_M, HEAD_DIM, BLOCK_D, True,
                              HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
    else:
        if HAS_WINDOW_RIGHT:  # rows before the full range: the key-side left (the causal diagonal)
            dk, dv = _dkdv_blocks(dk, dv, k, v, *bases, a, b_full, *opts, *scal, BLOCK_M, HEAD_DIM, BLOCK_D, True,
                                  HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
        dk, dv = _dkdv_blocks(dk, dv, k, v, *bases, b_full, c_full, *opts, *scal, BLOCK_M, HEAD_DIM, BLOCK_D,
                              False, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
        dk, dv = _dkdv_blocks(dk, dv, k, v, *bases, c_full, end, *opts, *scal, BLOCK_M, HEAD_DIM, BLOCK_D, True,
                              HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
    if HAS_DROPOUT:
        dv *= drop_scale
    dk *= sm_scale
    dk_off = b.to(tl.int64) * stride_dkb + k_start.to(tl.int64) * stride_dks + h * stride_dkh
    dv_off = b.to(tl.int64) * stride_dvb + k_start.to(tl.int64) * stride_dvs + h * stride_dvh
    tl.store(dk_ptr + dk_off + cols[:, None] * stride_dks + offs_d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=kv_mask)  # fmt: skip
    tl.store(dv_ptr + dv_off + cols[:, None] * stride_dvs + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=kv_mask)  # fmt: skip


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs, start, stop, rows, seqlen_k, diag, anchor,
    window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_n, offs_d, drop,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
    HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):  # fmt: skip
    """dQ of one query block over key blocks start..stop: dQ += (p * (dp - delta)) k; with
    dropout (drop: k0, k1, head, drop_below, drop_scale) dp keeps the kept entries, scaled."""
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(k_base, cols, stride_ks, offs_d, seqlen_k, MASK, HEAD_DIM, BLOCK_D)
        v = _load_tile(v_base, cols, stride_vs, offs_d, seqlen_k, MASK, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if HAS_ALIBI == 2:  # converted per key: a loop-invariant base spilled the D128 dQ tile (sm_90)
            key_term = (slope_log2 * (cols - anchor).to(tl.float32))[None, :]
        else:
            key_term = 0.0
        s, th = _log2_scores(
            qk, rows[:, None], cols[None, :], seqlen_k, diag, key_term, window_left, window_right, slope_log2,
            qk_scale, cap_scale, cap_out, MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
        )  # fmt: skip
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        if HAS_DROPOUT:
            keep = _dropout_keep(drop[0], drop[1], drop[2], rows, start_n, drop[3], BLOCK_N, False)
            dp = tl.where(keep, dp * drop[4], 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, slopes_ptr, seed_ptr, dq_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh,
    seqlen_q, seqlen_k, heads_q, group, qk_scale, sm_scale, cap_scale, cap_out, window_left, window_right,
    drop_below, drop_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_DROPOUT: tl.constexpr = False,
):  # fmt: skip
    """One program: dQ of BLOCK_M query rows of one (sequence, query head)."""
    b, h, q_start, sq, k_start, sk, m0 = _row_block(cu_q_ptr, cu_k_ptr, seqlen_q, seqlen_k, heads_q, BLOCK_M,
                                                    IS_VARLEN)  # fmt: skip
    if m0 >= sq:
        return
    hk = h // group
    q_row0 = q_start.to(tl.int64)
    k_row0 = k_start.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = m0 + offs_m
    q_mask = (rows[:, None] < sq) & (offs_d[None, :] < HEAD_DIM)
    q_base = q_ptr + b.to(tl.int64) * stride_qb + q_row0 * stride_qs + h * stride_qh
    do_base = do_ptr + b.to(tl.int64) * stride_dob + q_row0 * stride_dos + h * stride_doh
    q = _load_tile(q_base, rows, stride_qs, offs_d, sq, True, HEAD_DIM, BLOCK_D)
    do = _load_tile(do_base, rows, stride_dos, offs_d, sq, True, HEAD_DIM, BLOCK_D)
    stat_off = b.to(tl.int64) * stride_lb + h * stride_lh + q_start
    lse = tl.load(lse_ptr + stat_off + rows, mask=rows < sq, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + stat_off + rows, mask=rows < sq, other=0.0)
    slope_log2 = 0.0
    if HAS_ALIBI:
        slope_log2 = tl.load(slopes_ptr + b * heads_q + h) * 1.4426950408889634
    k_base = k_ptr + b.to(tl.int64) * stride_kb + k_row0 * stride_ks + hk * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + k_row0 * stride_vs + hk * stride_vh
    if HAS_ALIBI == 2:
        lse2 += alibi_row_shift(rows, sk - sq, m0 + sk - sq, slope_log2)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    a, b_full, c_full, end, opts = _key_sweep(
        m0, rows, sq, sk, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out, offs_n, offs_d,
        BLOCK_M, BLOCK_N, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT,
    )  # fmt: skip
    args = (q, do, lse2, delta, k_base, v_base, stride_ks, stride_vs)
    drop = (0, 0, 0, 0, 0.0)
    if HAS_DROPOUT:
        k0, k1 = _dropout_seed(seed_ptr)
        drop = (k0, k1, tl.program_id(1), drop_below, drop_scale)
    if HAS_WINDOW_LEFT:  # a sliding window: one masked loop (as the forward)
        dq = _dq_blocks(dq, *args, a, end, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
    else:
        dq = _dq_blocks(dq, *args, b_full, c_full, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D, False,
                            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
        dq = _dq_blocks(dq, *args, c_full, end, *opts, drop, BLOCK_N, HEAD_DIM, BLOCK_D, True,
                            HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT)  # fmt: skip
    dq *= sm_scale
    tl.store(dq_ptr + b.to(tl.int64) * stride_dqb + q_row0 * stride_dqs + h * stride_dqh
             + rows[:, None] * stride_dqs + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=q_mask)  # fmt: skip
