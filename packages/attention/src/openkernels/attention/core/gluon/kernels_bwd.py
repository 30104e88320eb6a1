"""Hopper (sm_90) attention backward in Gluon: two warp-specialized kernels, deterministic
(no atomics), each a TMA producer warp and two consumer warpgroups of 64 rows.

  dkdv: a program owns 128 keys of one key/value head (64 per warpgroup, K and V loaded
        once) and walks the query blocks of every query head of its GQA group, so dK and
        dV are summed over the group in registers: no per-query-head buffers and no second
        pass over them. Per 64-query block: S^T = K Q^T and dP^T = V dO^T (wgmma, operands
        from shared memory), P^T = exp(S^T - lse), dS^T = P^T (dP^T - delta), then
        dV += P^T dO and dK += dS^T Q with P^T and dS^T from registers.
  dq:   a program owns 128 queries (64 per warpgroup, Q and dO loaded once) and walks the
        key blocks: S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K.
delta = rowsum(dO * O) per query (float32, (B, Hq, Sq)) comes from the launcher.
Masks as the forward (kernels.py): bottom-right causal; rows past the ends are zero-filled
by TMA, their probabilities forced to 0 and their gradients not stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .pipeline import alloc_barriers, alloc_blocks, warpgroup_acc, warpgroup_operand

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _mma_t(a_smem, b_smem, layout: gl.constexpr, M: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    """Issue A B^T for A [M, D] and B [N, D] in shared memory (asynchronous)."""
    a2 = a_smem.reshape([M, D])
    b2 = b_smem.reshape([N, D])
    return warpgroup_mma(
        a2, b2.permute((1, 0)), gl.zeros([M, N], gl.float32, layout), use_acc=False, is_async=True
    )


@gluon.jit
def _store_rows(ptr, value, b, row0, n_rows, head, stride_b, stride_s,
                ROWS: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """value [ROWS, D] (layout) to rows row0.. of (b, :, head, :), rows < n_rows."""
    rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    offs = b.to(gl.int64) * stride_b + rows.to(gl.int64)[:, None] * stride_s + (head * D + cols)[None, :]
    gl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=rows[:, None] < n_rows)


# ---- dK, dV ------------------------------------------------------------------------------


@gluon.jit
def _dkdv_producer(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready,
                   empty, b, key0, kv_col, kv_head, group, first_qb, n_qb, QROWS: gl.constexpr,
                   KROWS: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, key0 + w * KROWS, kv_col], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, key0 + w * KROWS, kv_col], kv_bar, v_smem.index(w))
    for it in range(group * n_qb):
        s = it % STAGES
        mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
        head = kv_head * group + it // n_qb
        q0 = (first_qb + it % n_qb) * QROWS
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, q0, head * D], q_ready.index(s), q_smem.index(s))
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, q0, head * D], do_ready.index(s), do_smem.index(s))


@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, dk_ptr, dv_ptr, lse_ptr,
                   delta_ptr, b, key0, kv_head, group, first_qb, n_qb, seqlen_q, seqlen_k, stride_kb, stride_ks,
                   stride_lb, stride_lh, qk_scale, sm_scale,
                   WG: gl.constexpr, CAUSAL: gl.constexpr, QROWS: gl.constexpr, KROWS: gl.constexpr,
                   D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup: keys key0 + WG * KROWS .. + KROWS against every query block."""
    st_layout: gl.constexpr = warpgroup_acc(QROWS)
    acc_layout: gl.constexpr = warpgroup_acc(D)
    op_layout: gl.constexpr = warpgroup_operand(acc_layout)
    qcol_layout: gl.constexpr = gl.SliceLayout(0, st_layout)
    krow_layout: gl.constexpr = gl.SliceLayout(1, st_layout)

    k_first = key0 + WG * KROWS
    keys = k_first + gl.arange(0, KROWS, krow_layout)
    diag = seqlen_k - seqlen_q  # query i sees keys <= i + diag
    dk = gl.zeros([KROWS, D], gl.float32, acc_layout)
    dv = gl.zeros([KROWS, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)
    dtype: gl.constexpr = k_smem.dtype
    for it in range(group * n_qb):
        s = it % STAGES
        phase = (it // STAGES) & 1
        head = kv_head * group + it // n_qb
        q0 = (first_qb + it % n_qb) * QROWS
        mbarrier.wait(q_ready.index(s), phase)
        st = _mma_t(k_w, q_smem.index(s), st_layout, KROWS, QROWS, D)
        mbarrier.wait(do_ready.index(s), phase)
        dpt = _mma_t(v_w, do_smem.index(s), st_layout, KROWS, QROWS, D)
        queries = q0 + gl.arange(0, QROWS, qcol_layout)
        row_offs = b.to(gl.int64) * stride_lb + head * stride_lh + queries
        in_q = queries < seqlen_q
        lse = gl.load(lse_ptr + row_offs, mask=in_q, other=0.0) * LOG2E
        delta = gl.load(delta_ptr + row_offs, mask=in_q, other=0.0)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        pt = gl.exp2(st * qk_scale - lse[None, :])
        edge = q0 + QROWS > seqlen_q
        if CAUSAL:
            edge = edge | (q0 + diag < k_first + KROWS - 1)
        if edge:
            keep = in_q[None, :] & (keys[:, None] < seqlen_k)
            if CAUSAL:
                keep = keep & (keys[:, None] <= queries[None, :] + diag)
            pt = gl.where(keep, pt, 0.0)  # after exp: a row with lse = -inf must give 0, not NaN
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        dst = pt * (dpt - delta[None, :])
        pt_op = gl.convert_layout(pt.to(dtype), op_layout)
        dst_op = gl.convert_layout(dst.to(dtype), op_layout)
        dv = warpgroup_mma(pt_op, do_smem.index(s).reshape([QROWS, D]), dv, is_async=True)
        dk = warpgroup_mma(dst_op, q_smem.index(s).reshape([QROWS, D]), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s), count=1)
    _store_rows(
        dk_ptr, dk * sm_scale, b, k_first, seqlen_k, kv_head, stride_kb, stride_ks, KROWS, D, acc_layout
    )
    _store_rows(dv_ptr, dv, b, k_first, seqlen_k, kv_head, stride_kb, stride_ks, KROWS, D, acc_layout)


@gluon.jit
def attn_bwd_dkdv_kernel(k_desc, v_desc, q_desc, do_desc, dk_ptr, dv_ptr, lse_ptr, delta_ptr,
                         seqlen_q, seqlen_k, heads_kv, group, stride_kb, stride_ks, stride_lb, stride_lh,
                         qk_scale, sm_scale,
                         CAUSAL: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr):  # fmt: skip
    """dK, dV (B, Sk, Hkv, D) of 128 keys. Grid (cdiv(Sk, 128), B * Hkv). qk_scale = scale *
    log2(e), sm_scale = scale."""
    QROWS: gl.constexpr = q_desc.block_type.shape[1]
    KROWS: gl.constexpr = k_desc.block_type.shape[1]
    gl.static_assert(STAGES >= 2)
    key0 = gl.program_id(0) * 2 * KROWS
    bh = gl.program_id(1)
    b = bh // heads_kv
    kv_head = bh % heads_kv
    first_qb = 0
    if CAUSAL:
        first_qb = gl.maximum(key0 - (seqlen_k - seqlen_q), 0) // QROWS
    n_qb = gl.maximum(gl.cdiv(seqlen_q, QROWS) - first_qb, 0)

    k_smem = alloc_blocks(k_desc, 2)
    v_smem = alloc_blocks(v_desc, 2)
    q_smem = alloc_blocks(q_desc, STAGES)
    do_smem = alloc_blocks(do_desc, STAGES)
    kv_bar = alloc_barriers(1, 1).index(0)
    q_ready = alloc_barriers(STAGES, 1)
    do_ready = alloc_barriers(STAGES, 1)
    empty = alloc_barriers(STAGES, 2)  # both consumers release a slot
    gl.warp_specialize([
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, dk_ptr, dv_ptr, lse_ptr,
                          delta_ptr, b, key0, kv_head, group, first_qb, n_qb, seqlen_q, seqlen_k, stride_kb,
                          stride_ks, stride_lb, stride_lh, qk_scale, sm_scale, 0, CAUSAL, QROWS, KROWS, D, STAGES)),
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, empty, dk_ptr, dv_ptr, lse_ptr,
                          delta_ptr, b, key0, kv_head, group, first_qb, n_qb, seqlen_q, seqlen_k, stride_kb,
                          stride_ks, stride_lb, stride_lh, qk_scale, sm_scale, 1, CAUSAL, QROWS, KROWS, D, STAGES)),
        (_dkdv_producer, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready,
                          do_ready, empty, b, key0, kv_head * D, kv_head, group, first_qb, n_qb, QROWS, KROWS, D,
                          STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])  # fmt: skip


# ---- dQ ----------------------------------------------------------------------------------


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty,
                 b, q_start, q_col, kv_col, n_blocks, QROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr):  # fmt: skip
    mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, q_start + w * QROWS, q_col], q_bar, q_smem.index(w))
        tma.async_copy_global_to_shared(do_desc, [b, q_start + w * QROWS, q_col], q_bar, do_smem.index(w))
    for i in range(n_blocks):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, i * BLOCK_N, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, i * BLOCK_N, kv_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _dq_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, dq_ptr, lse_ptr, delta_ptr,
                 b, h, q_start, n_blocks, seqlen_q, seqlen_k, stride_qb, stride_qs, stride_lb, stride_lh,
                 qk_scale, sm_scale, WG: gl.constexpr, CAUSAL: gl.constexpr, QROWS: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One warpgroup: queries q_start + WG * QROWS .. + QROWS against every key block."""
    s_layout: gl.constexpr = warpgroup_acc(BLOCK_N)
    acc_layout: gl.constexpr = warpgroup_acc(D)
    op_layout: gl.constexpr = warpgroup_operand(acc_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    row0 = q_start + WG * QROWS
    rows = row0 + gl.arange(0, QROWS, row_layout)
    in_q = rows < seqlen_q
    diag = seqlen_k - seqlen_q
    row_offs = b.to(gl.int64) * stride_lb + h * stride_lh + rows
    lse = gl.load(lse_ptr + row_offs, mask=in_q, other=0.0) * LOG2E
    delta = gl.load(delta_ptr + row_offs, mask=in_q, other=0.0)
    dq = gl.zeros([QROWS, D], gl.float32, acc_layout)
    dtype: gl.constexpr = k_smem.dtype
    mbarrier.wait(q_bar, 0)
    q_w = q_smem.index(WG)
    do_w = do_smem.index(WG)
    for i in range(n_blocks):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        sc = _mma_t(q_w, k_smem.index(slot), s_layout, QROWS, BLOCK_N, D)
        mbarrier.wait(v_ready.index(slot), phase)
        dp = _mma_t(do_w, v_smem.index(slot), s_layout, QROWS, BLOCK_N, D)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=(sc,))
        p = gl.exp2(sc * qk_scale - lse[:, None])
        key0 = i * BLOCK_N
        edge = (key0 + BLOCK_N > seqlen_k) | (row0 + QROWS > seqlen_q)
        if CAUSAL:
            edge = edge | (key0 + BLOCK_N - 1 > row0 + diag)
        if edge:
            cols = key0 + gl.arange(0, BLOCK_N, col_layout)
            keep = (cols[None, :] < seqlen_k) & in_q[:, None]
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + diag)
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = gl.convert_layout((p * (dp - delta[:, None])).to(dtype), op_layout)
        dq = warpgroup_mma(ds, k_smem.index(slot).reshape([BLOCK_N, D]), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(empty.index(slot), count=1)
    _store_rows(dq_ptr, dq * sm_scale, b, row0, seqlen_q, h, stride_qb, stride_qs, QROWS, D, acc_layout)


@gluon.jit
def attn_bwd_dq_kernel(q_desc, do_desc, k_desc, v_desc, dq_ptr, lse_ptr, delta_ptr,
                       seqlen_q, seqlen_k, heads, group, stride_qb, stride_qs, stride_lb, stride_lh,
                       qk_scale, sm_scale,
                       CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr):  # fmt: skip
    """dQ (B, Sq, Hq, D) of 128 queries. Grid (cdiv(Sq, 128), B * Hq), heavy causal blocks
    first."""
    QROWS: gl.constexpr = q_desc.block_type.shape[1]
    gl.static_assert(STAGES >= 2)
    n_m = gl.cdiv(seqlen_q, 2 * QROWS)
    q_start = (n_m - 1 - gl.program_id(0)) * 2 * QROWS
    bh = gl.program_id(1)
    b = bh // heads
    h = bh % heads
    last_key = seqlen_k
    if CAUSAL:
        last_key = gl.minimum(q_start + 2 * QROWS + (seqlen_k - seqlen_q), seqlen_k)
    n_blocks = gl.cdiv(gl.maximum(last_key, 1), BLOCK_N)

    q_smem = alloc_blocks(q_desc, 2)
    do_smem = alloc_blocks(do_desc, 2)
    k_smem = alloc_blocks(k_desc, STAGES)
    v_smem = alloc_blocks(v_desc, STAGES)
    q_bar = alloc_barriers(1, 1).index(0)
    k_ready = alloc_barriers(STAGES, 1)
    v_ready = alloc_barriers(STAGES, 1)
    empty = alloc_barriers(STAGES, 2)  # both consumers release a slot
    kv_col = (h // group) * D
    gl.warp_specialize([
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, dq_ptr, lse_ptr, delta_ptr,
                        b, h, q_start, n_blocks, seqlen_q, seqlen_k, stride_qb, stride_qs, stride_lb, stride_lh,
                        qk_scale, sm_scale, 0, CAUSAL, QROWS, BLOCK_N, D, STAGES)),
        (_dq_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready, empty, dq_ptr, lse_ptr, delta_ptr,
                        b, h, q_start, n_blocks, seqlen_q, seqlen_k, stride_qb, stride_qs, stride_lb, stride_lh,
                        qk_scale, sm_scale, 1, CAUSAL, QROWS, BLOCK_N, D, STAGES)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                        empty, b, q_start, h * D, kv_col, n_blocks, QROWS, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])  # fmt: skip
