"""Hopper (sm_90) attention forward in Gluon: TMA loads by a producer warp, wgmma on two
consumer warpgroups (64 query rows each), online softmax in registers.

Layout of one program: query block pid_m (2 x 64 rows) of head h of sequence b.
  producer (1 warp): Q once, then K and V blocks through a STAGES-deep ring, each slot
      with its own "K ready" / "V ready" barrier and an "empty" barrier both consumers
      arrive on when their P @ V of the slot has completed.
  consumers (two partitions of one warpgroup each, 64 query rows each): S = Q K^T (wgmma,
      Q and K from shared memory), the next block's S issued before this block's softmax
      so the tensor cores run under it, then O += P V (P from registers).

q, k, v are read through rank-3 descriptors (batch, seq, heads * head_dim), so a block
past the end of a sequence reads zeros (TMA fills out-of-bounds rows), never the next
sequence; keys past seqlen_k are masked to -inf, queries past seqlen_q are not stored.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .pipeline import alloc_barriers, alloc_blocks, warpgroup_acc, warpgroup_operand


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                    b, q_start, kv_col, q_col, n_blocks,
                    ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, q_start, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [b, q_start + ROWS, q_col], q_bar, q_smem.index(1))
    for i in range(n_blocks):
        s = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(kv_empty.index(s), phase ^ 1)
        key = i * BLOCK_N
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, key, kv_col], k_ready.index(s), k_smem.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, key, kv_col], v_ready.index(s), v_smem.index(s))


@gluon.jit
def _qk(
    q2, k_smem, s_layout: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr
):
    """Issue S = Q K^T for one key block (asynchronous; the caller waits)."""
    k2 = k_smem.reshape([BLOCK_N, HEAD_DIM])
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    return warpgroup_mma(q2, k2.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_ptr, lse_ptr,
              b, h, q_start, seqlen_q, seqlen_k, n_blocks, stride_ob, stride_os, stride_lb, stride_lh, qk_scale,
              WG: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    """One warpgroup: query rows q_start + WG * ROWS .. + ROWS against every key block.

    Default schedule: the next block's S is issued before this block's softmax (the tensor
    cores run under this warpgroup's exponentials). PINGPONG: the two warpgroups take turns
    issuing their matrix products (S of the next block and P V of this one, back to back),
    each waiting on `turn[WG]` and handing the turn over after issuing, so one warpgroup's
    softmax runs while the other's products do (FlashAttention-3's schedule)."""
    s_layout: gl.constexpr = warpgroup_acc(BLOCK_N)
    o_layout: gl.constexpr = warpgroup_acc(HEAD_DIM)
    p_layout: gl.constexpr = warpgroup_operand(o_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    row0 = q_start + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, row_layout)
    diag = seqlen_k - seqlen_q  # bottom-right aligned causal: row r sees keys <= r + diag
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([ROWS], 0.0, gl.float32, row_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    q2 = q_smem.index(WG).reshape([ROWS, HEAD_DIM])
    # Block 0's scores are issued before the loop; each step issues the next block's
    # before its softmax, so the tensor cores work while this warpgroup exponentiates.
    mbarrier.wait(k_ready.index(0), 0)
    s_next = _qk(q2, k_smem.index(0), s_layout, ROWS, BLOCK_N, HEAD_DIM)
    for i in range(n_blocks):
        slot = i % STAGES
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
        if not PINGPONG and i + 1 < n_blocks:
            nslot = (i + 1) % STAGES
            mbarrier.wait(k_ready.index(nslot), ((i + 1) // STAGES) & 1)
            s_next = _qk(q2, k_smem.index(nslot), s_layout, ROWS, BLOCK_N, HEAD_DIM)
        key0 = i * BLOCK_N
        s = s * qk_scale
        edge = key0 + BLOCK_N > seqlen_k
        if CAUSAL:
            edge = edge | (key0 + BLOCK_N - 1 > row0 + diag)
        if edge:
            cols = key0 + gl.arange(0, BLOCK_N, col_layout)
            keep = cols[None, :] < seqlen_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + diag)
            s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        # rows with nothing visible yet keep m = -inf: shift by 0 so exp2 gives 0, not NaN
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(k_smem.dtype), p_layout)
        mbarrier.wait(v_ready.index(slot), (i // STAGES) & 1)
        v2 = v_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
        if PINGPONG:
            mbarrier.wait(turn.index(WG), i & 1)
            if i + 1 < n_blocks:
                nslot = (i + 1) % STAGES
                mbarrier.wait(k_ready.index(nslot), ((i + 1) // STAGES) & 1)
                s_next = _qk(q2, k_smem.index(nslot), s_layout, ROWS, BLOCK_N, HEAD_DIM)
        acc = warpgroup_mma(p_op, v2, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)
        # wgmma groups complete in order: this wait covers the next block's S as well.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(slot), count=1)

    # epilogue: O / l, and the LSE (natural log) of the scaled scores
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]
    o_rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, o_layout))
    o_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
    o_offs = (
        b.to(gl.int64) * stride_ob
        + o_rows.to(gl.int64)[:, None] * stride_os
        + (h * HEAD_DIM + o_cols)[None, :]
    )
    gl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=o_rows[:, None] < seqlen_q)
    lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    gl.store(lse_ptr + b.to(gl.int64) * stride_lb + h * stride_lh + rows, lse, mask=rows < seqlen_q)


@gluon.jit
def attn_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr,
                    seqlen_q, seqlen_k, heads, kv_group, stride_ob, stride_os, stride_lb, stride_lh, qk_scale,
                    CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr):  # fmt: skip
    """o, lse of one query block of 2 x 64 rows. Grid (cdiv(seqlen_q, 128), batch * heads);
    heavy causal blocks first. qk_scale = scale * log2(e). Launched with num_warps=4 (the
    first consumer); the second consumer and the producer are worker partitions."""
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    # A consumer holds its slot while it waits for the next block's K: one slot would deadlock.
    gl.static_assert(STAGES >= 2)
    n_m = gl.cdiv(seqlen_q, 2 * ROWS)
    pid_m = n_m - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // heads
    h = bh % heads
    q_start = pid_m * 2 * ROWS
    last_key = seqlen_k
    if CAUSAL:
        last_key = gl.minimum(q_start + 2 * ROWS + (seqlen_k - seqlen_q), seqlen_k)
    n_blocks = gl.cdiv(gl.maximum(last_key, 1), BLOCK_N)

    q_smem = alloc_blocks(q_desc, 2)
    k_smem = alloc_blocks(k_desc, STAGES)
    v_smem = alloc_blocks(v_desc, STAGES)
    q_bar = alloc_barriers(1, 1).index(0)
    k_ready = alloc_barriers(STAGES, 1)
    v_ready = alloc_barriers(STAGES, 1)
    kv_empty = alloc_barriers(STAGES, 2)  # both consumers release a slot
    # PINGPONG: turn[w] completes a phase when warpgroup w may issue its products; warpgroup
    # 0 goes first.
    turn = alloc_barriers(2, 1)
    if PINGPONG:
        mbarrier.arrive(turn.index(0), count=1)

    kv_col = (h // kv_group) * HEAD_DIM
    q_col = h * HEAD_DIM
    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_ptr, lse_ptr, b, h, q_start,
                     seqlen_q, seqlen_k, n_blocks, stride_ob, stride_os, stride_lb, stride_lh, qk_scale,
                     0, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty, turn, o_ptr, lse_ptr, b, h, q_start,
                     seqlen_q, seqlen_k, n_blocks, stride_ob, stride_os, stride_lb, stride_lh, qk_scale,
                     1, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                           b, q_start, kv_col, q_col, n_blocks, ROWS, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])  # fmt: skip
