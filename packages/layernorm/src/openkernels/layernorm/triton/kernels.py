"""Triton kernels of the layernorm family. RMSNorm vs LayerNorm, residual, stored
residual stream and affine weight/bias are compile-time flags of every kernel.

Shapes: x, residual, dy, h, dh_out are (n_rows, n_cols) with unit column stride and a row
stride each; out, res_out, dh are contiguous; mean/rstd are (n_rows,) float32.
`res_out_ptr` always carries the residual stream's dtype (h is rounded to it before it is
normalized, see reference.py), even when STORE_RESIDUAL is off and nothing is written.

Forward, by row length:
  _norm_fwd_kernel         rows in registers, BLOCK_R rows per step; programs stride over
                           the row blocks (a persistent grid when fewer programs than
                           blocks), optionally loading the next block before reducing this one.
  _norm_fwd_split_kernel   long rows split over n_splits programs that each hold a chunk in
                           registers and exchange partial statistics through global memory:
                           one read of x, one write of y.
  _norm_fwd_looped_kernel  any length: one program walks a row twice (statistics, then
                           output), the second walk backwards to start where L2 is warm.
Backward: _norm_bwd_kernel, tile (persistent, optionally prefetching) or looped, or for
long rows _norm_bwd_split_kernel (the split forward's exchange, for the gradient's row sums);
then _sum_parts_kernel for dweight/dbias: the partial rows summed in a fixed order.
"""

import triton
import triton.language as tl


@triton.jit
def _residual_stream(x_ptr, res_ptr, res_out_ptr, x_offs, res_offs, res_out_offs, mask,
                     HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):  # fmt: skip
    """h = round(x + residual) to the residual stream's dtype, in float32; stores h."""
    h = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
    h = h.to(res_out_ptr.dtype.element_ty)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + res_out_offs, h, mask=mask)
    return h.to(tl.float32)


@triton.jit
def _affine(xhat, w_ptr, b_ptr, cols, col_mask, weight_offset,
            HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """y = xhat * (w + weight_offset) + b; cols and col_mask broadcast against xhat."""
    y = xhat
    if HAS_WEIGHT:
        y = y * (tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def _sum_pair(a, b, axis: tl.constexpr):
    """(sum a, sum b) along axis. Two tl.sum: a paired tl.reduce with a custom combine
    function runs ~50x slower under the Triton interpreter (CI)."""
    return tl.sum(a, axis=axis), tl.sum(b, axis=axis)


@triton.jit
def _round_h(x, r, res_out_ptr, HAS_RESIDUAL: tl.constexpr):
    """h = x + r rounded to the residual stream's dtype, returned in float32."""
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += r.to(tl.float32)
    return h.to(res_out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _tile_stats(h, mask, n_cols, eps, IS_RMS: tl.constexpr):
    """(mean, rstd, xhat) of each row of a [R, C] float32 tile (masked entries 0).

    LayerNorm, tiles of 32-8192 columns: sum h and sum h^2 in one pass (two independent
    reductions, where sum h first and then the sums about it took three in a row). The
    variance from sums about 0 loses about mean^2 / var of its digits, so when a row's mean
    lies more than 4 standard deviations from 0 (or its sums are not finite) the tile is
    summed again about its means: rows with a large mean and a small spread keep their
    variance (no E[h^2] - E[h]^2 cancellation)."""
    if IS_RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
        return tl.zeros_like(rstd), rstd, h * rstd[:, None]
    if h.shape[1] < 32 or h.shape[1] > 8192:
        # The 16384-column tile (and degenerate ones) would spill with the branch below on
        # sm_80: the mean first, then the sums about it (three reductions in a row).
        mean = tl.sum(h, axis=1) / n_cols
        d = tl.where(mask, h - mean[:, None], 0.0)
        s1, s2 = _sum_pair(d, d * d, 1)
        shift = s1 / n_cols
        rstd = tl.rsqrt(tl.maximum(s2 / n_cols - shift * shift, 0.0, propagate_nan=tl.PropagateNan.ALL) + eps)
        return mean + shift, rstd, (d - shift[:, None]) * rstd[:, None]
    s1, s2 = _sum_pair(h, h * h, 1)
    mean = s1 / n_cols
    var = s2 / n_cols - mean * mean
    far = (mean * mean <= 16.0 * var).to(tl.int32)  # 0 where far, or NaN
    if tl.min(far, axis=0) == 0:
        d = tl.where(mask, h - mean[:, None], 0.0)
        d1, d2 = _sum_pair(d, d * d, 1)
        shift = d1 / n_cols
        mean += shift
        var = d2 / n_cols - shift * shift
    rstd = tl.rsqrt(tl.maximum(var, 0.0, propagate_nan=tl.PropagateNan.ALL) + eps)
    return mean, rstd, (h - mean[:, None]) * rstd[:, None]


@triton.jit
def _load_rows(
    x_ptr, res_ptr, rows, cols, col_mask, n_rows, stride_x, stride_res, HAS_RESIDUAL: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Raw x and residual tiles of a row block (x twice without a residual).

    They are read once, yet an evict-first hint made the forward 1-4% slower on H200
    (16384x4096 rms_norm 3652 vs 3796 GB/s; every grid shape, both norms): no hint, except
    on the 16384-column tile (where it cost under 1%), whose LayerNorm variant with every
    flag spilled 8 B per thread on sm_90 without it."""
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    if BLOCK_C >= 16384:
        x = tl.load(
            x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
        )
    else:
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    r = x
    if HAS_RESIDUAL:
        if BLOCK_C >= 16384:
            r = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        else:
            r = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0)
    return x, r


@triton.jit
def _fwd_block(x, r, rows, cols, col_mask, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr,
               n_rows, n_cols, stride_out, stride_res_out, eps, weight_offset,
               IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
               HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Normalize one loaded row block and store y, h and the statistics."""
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    h = _round_h(x, r, res_out_ptr, HAS_RESIDUAL)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + r64 * stride_res_out + cols[None, :], h.to(res_out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    mean, rstd, xhat = _tile_stats(h, mask, n_cols, eps, IS_RMS)
    if not IS_RMS:
        tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = _affine(xhat, w_ptr, b_ptr, cols[None, :], col_mask[None, :], weight_offset, HAS_WEIGHT, HAS_BIAS)
    tl.store(out_ptr + r64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_out, stride_res_out,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_C: tl.constexpr,
    PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Rows held in registers. One row block per program, or (PERSISTENT) blocks p,
    p + programs, ...; with PREFETCH a persistent program issues the next block's loads
    before it reduces the current one. EVEN_C: n_cols == BLOCK_C, no column mask."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    col_mask = cols < (BLOCK_C if EVEN_C else n_cols)
    if not PERSISTENT:
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        x, r = _load_rows(
            x_ptr, res_ptr, rows, cols, col_mask, n_rows, stride_x, stride_res, HAS_RESIDUAL, BLOCK_C
        )
        _fwd_block(x, r, rows, cols, col_mask, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr, n_rows,
                       n_cols, stride_out, stride_res_out, eps, weight_offset, IS_RMS, HAS_RESIDUAL,
                       STORE_RESIDUAL, HAS_WEIGHT, HAS_BIAS)  # fmt: skip
    else:
        step = tl.num_programs(0)
        n_blocks = tl.cdiv(n_rows, BLOCK_R)
        if PREFETCH:
            # Its own names: a variable set before the loop and again inside would be loop-
            # carried, and its type differ (int32 here, int64 in the loop with int64 sizes).
            first = pid * BLOCK_R + tl.arange(0, BLOCK_R)
            x_next, r_next = _load_rows(x_ptr, res_ptr, first, cols, col_mask, n_rows, stride_x, stride_res,
                                        HAS_RESIDUAL, BLOCK_C)  # fmt: skip
        for block in range(pid, n_blocks, step):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            if PREFETCH:
                x, r = x_next, r_next
                x_next, r_next = _load_rows(x_ptr, res_ptr, rows + step * BLOCK_R, cols, col_mask, n_rows,
                                            stride_x, stride_res, HAS_RESIDUAL, BLOCK_C)  # fmt: skip
            else:
                x, r = _load_rows(x_ptr, res_ptr, rows, cols, col_mask, n_rows, stride_x, stride_res,
                                  HAS_RESIDUAL, BLOCK_C)  # fmt: skip
            _fwd_block(x, r, rows, cols, col_mask, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr, n_rows,
                       n_cols, stride_out, stride_res_out, eps, weight_offset, IS_RMS, HAS_RESIDUAL,
                       STORE_RESIDUAL, HAS_WEIGHT, HAS_BIAS)  # fmt: skip


@triton.jit
def _leave_row(counter_ptr, n_splits):
    """Counted once more after the wait: the row's last program to leave (the count reaching
    2 * n_splits) sets the counter back to 0. Every program of the row has passed its wait by
    then (each leaves after its own wait, and waits end at >= n_splits), and the next launch
    on the stream starts after this one ends: the launcher keeps one zeroed counter buffer
    per (device, stream) for good, which replayed launches can name (no fill per call)."""
    left = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    if left == 2 * n_splits - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


@triton.jit
def _norm_fwd_split_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr, part_ptr, arrived_ptr,
    n_rows, n_cols, n_splits, stride_x, stride_res, stride_out, stride_res_out,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr, MAX_SPLITS: tl.constexpr, NARROW: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    """Program pid holds chunk pid % n_splits of row pid // n_splits. It publishes its
    chunk's (mean, M2) to part_ptr, counts itself in arrived_ptr[row] (0 before the call
    and after it: _leave_row), waits until the row's n_splits chunks have arrived, merges
    them (Chan et al.) and normalizes its chunk from registers.

    The wait needs the row's programs resident together. Programs start in index order and
    a row's programs are consecutive, so whenever every resident program waits, the lowest
    waiting row has all its programs started (or there is room to start more): progress
    holds while a GPU fits n_splits programs at once (MAX_SPLITS <= 64 does, on any GPU).

    NARROW (CUDA): hold h in the residual stream's dtype across the wait, not in float32.
    The chunk lives in registers while the program waits, so its width sets how many
    programs an SM holds, and with them the bytes in flight (bf16, 262144 columns on the
    H200: 0.74 of copy against 0.67). An opaque register copy (PTX) keeps the compiler from
    reusing the float32 values it converted for the statistics.

    ONE_PASS (LayerNorm): the chunk's (mean, M2) in one pass (two independent sums about a
    shift) instead of two reductions in a row; see _chunk_stats_one_pass for its accuracy."""
    pid = tl.program_id(0)
    row = (pid // n_splits).to(tl.int64)
    split = pid % n_splits
    cols = split * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = x
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    h = _round_h(x, r, res_out_ptr, HAS_RESIDUAL)
    if STORE_RESIDUAL:
        tl.store(res_out_ptr + row * stride_res_out + cols, h.to(res_out_ptr.dtype.element_ty), mask=mask)
    count = tl.minimum(n_cols - split * BLOCK_C, BLOCK_C).to(tl.float32)
    h_narrow = h.to(res_out_ptr.dtype.element_ty)  # exact: _round_h rounded h to this dtype
    if IS_RMS:
        chunk_mean = 0.0
        chunk_m2 = tl.sum(h * h, axis=0)
    elif ONE_PASS:
        first = split * BLOCK_C  # < n_cols: every program's chunk has a first element
        x0 = tl.load(x_ptr + row * stride_x + first)
        r0 = x0
        if HAS_RESIDUAL:
            r0 = tl.load(res_ptr + row * stride_res + first)
        shift = _round_h(x0, r0, res_out_ptr, HAS_RESIDUAL)  # h's first element, bit for bit
        chunk_mean, chunk_m2 = _chunk_stats_one_pass(h, h_narrow, mask, count, shift, NARROW)
    else:  # M2 about the chunk's own mean: no cancellation on rows with a large mean
        chunk_mean = tl.sum(h, axis=0) / count
        d = tl.where(mask, h - chunk_mean, 0.0)
        chunk_m2 = tl.sum(d * d, axis=0)
    slot = part_ptr + (row * n_splits + split) * 2
    tl.store(slot, chunk_mean)
    tl.store(slot + 1, chunk_m2)
    tl.debug_barrier()
    tl.atomic_add(arrived_ptr + row, 1, sem="release")
    seen = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
    while seen < n_splits:
        seen = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
    _leave_row(arrived_ptr + row, n_splits)
    tl.debug_barrier()
    index = tl.arange(0, MAX_SPLITS)
    valid = index < n_splits
    parts = part_ptr + (row * n_splits + index) * 2
    means = tl.load(parts, mask=valid, other=0.0, cache_modifier=".cg")
    m2s = tl.load(parts + 1, mask=valid, other=0.0, cache_modifier=".cg")
    counts = tl.where(valid, tl.minimum(n_cols - index * BLOCK_C, BLOCK_C), 0).to(tl.float32)
    if IS_RMS:
        mean = 0.0
        var = tl.sum(m2s, axis=0) / n_cols
    else:
        mean = tl.sum(counts * means, axis=0) / n_cols
        spread = means - mean
        var = tl.sum(m2s + counts * spread * spread, axis=0) / n_cols
    rstd = tl.rsqrt(tl.maximum(var, 0.0, propagate_nan=tl.PropagateNan.ALL) + eps)
    if split == 0:
        tl.store(rstd_ptr + row, rstd)
        if not IS_RMS:
            tl.store(mean_ptr + row, mean)
    if NARROW and res_out_ptr.dtype.element_ty.primitive_bitwidth == 16:
        h = _opaque_copy(h_narrow).to(tl.float32)
    y = _affine((h - mean) * rstd, w_ptr, b_ptr, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_stats_one_pass(h, h_narrow, mask, count, shift, NARROW: tl.constexpr):
    """(mean, M2 about the mean) of a float32 chunk h ([C], `count` entries under mask) in
    one pass: with d = h - K for a shift K (the chunk's first entry), s1 = sum d and
    s2 = sum d^2 (two independent sums, not a mean and then the sum about it),
    mean = K + s1 / count and M2 = s2 - s1^2 / count.

    The programs of a row need not agree on K: each publishes its own chunk's (mean, M2)
    and Chan's merge takes them as they are. d is exact where h and K lie within a factor
    of 2 of each other (Sterbenz), so a large common offset (1000 + N(0, 1e-2)) costs
    nothing; what the shift leaves is the cancellation in s2 - s1^2 / count, of
    count * (var + (mean - K)^2) against count * (mean - K)^2: M2's relative error is about
    (1 + (mean - K)^2 / var) times the float32 sums' (a few ulps, growing with the
    reduction tree). As K is an entry of the chunk, (mean - K)^2 / var is its squared
    z-score: about 1 for most data, but up to count - 1 (Samuelson) when K is an outlier,
    such as a massive-activation channel at the chunk's start (8192 columns, 1e4 first
    over N(0, 1): ~1e-3 of M2 lost, tests/test_split_stats.py). So when the estimate says
    (mean - K)^2 > 16 var (the tile kernel's test; also whenever M2 has cancelled to <= 0
    with mean != K) the chunk is summed again about the first pass's mean, whose error is a
    few ulps of |mean - K|: the second pass's cancellation is negligible, and M2's relative
    error stays within ~17 times the sums' in every case. The branch is uniform over the
    program. With NARROW (16-bit h) it converts h again from the 16-bit copy (exact)
    through an opaque register copy, so the float32 h need not stay live across the first
    reduction for it (sm_90, bf16, 8192 x 4 warps, every flag: 118 registers per thread;
    166 holding h).

    Masked entries contribute 0 (d is zeroed before it is squared). NaN and inf propagate:
    either makes s1 or s2 NaN or inf and M2 NaN (inf - inf; NaN fails the branch's test),
    and the clamp at 0 keeps NaN."""
    d = tl.where(mask, h - shift, 0.0)
    s1, s2 = _sum_pair(d, d * d, 0)
    delta = s1 / count  # mean - K; s1 * delta = s1^2 / count without overflowing first
    mean = shift + delta
    m2 = s2 - s1 * delta
    if delta * delta * count > 16.0 * m2:
        if NARROW and h_narrow.dtype.primitive_bitwidth == 16:
            h = _opaque_copy(h_narrow).to(tl.float32)
        d = tl.where(mask, h - mean, 0.0)
        t1, t2 = _sum_pair(d, d * d, 0)
        delta = t1 / count
        mean += delta
        m2 = t2 - t1 * delta
    return mean, tl.maximum(m2, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _opaque_copy(x):
    """x (16-bit) through a register move the compiler cannot see through (PTX: CUDA only)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def _norm_fwd_looped_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_out, stride_res_out,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One row per program in BLOCK_C chunks, walked twice."""
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_C)[None, :]
    x_row, res_row = row * stride_x, row * stride_res
    res_out_row, out_row = row * stride_res_out, row * stride_out
    n_chunks = tl.cdiv(n_cols, BLOCK_C)
    # Walk 1: h and its statistics. LayerNorm merges per-chunk (mean, M2) pairs (Chan et
    # al.): no E[h^2] - E[h]^2 cancellation on rows with a large mean.
    total = tl.zeros([1], dtype=tl.float32)
    mean = tl.zeros([1], dtype=tl.float32)
    m2 = tl.zeros([1], dtype=tl.float32)
    for i in range(0, n_chunks):
        cols = i * BLOCK_C + cols0
        mask = cols < n_cols
        h = _residual_stream(
            x_ptr, res_ptr, res_out_ptr, x_row + cols, res_row + cols, res_out_row + cols, mask,
            HAS_RESIDUAL, STORE_RESIDUAL,
        )  # fmt: skip
        if IS_RMS:
            m2 += tl.sum(h * h, axis=1)
        else:
            count = tl.minimum(n_cols - i * BLOCK_C, BLOCK_C).to(tl.float32)
            first_mean = tl.sum(h, axis=1) / count
            d = tl.where(mask, h - first_mean[:, None], 0.0)
            s1, s2 = _sum_pair(d, d * d, 1)
            chunk_mean = first_mean + s1 / count
            chunk_m2 = s2 - s1 * s1 / count
            new_total = total + count
            delta = chunk_mean - mean
            mean += delta * (count / new_total)
            m2 += chunk_m2 + delta * delta * (total * count / new_total)
            total = new_total
    rstd = tl.rsqrt(m2 / n_cols + eps)
    tl.store(rstd_ptr + row + tl.arange(0, 1), rstd)
    if not IS_RMS:
        tl.store(mean_ptr + row + tl.arange(0, 1), mean)
    # Walk 2, last chunk first: those are still in L2.
    for j in range(0, n_chunks):
        i = n_chunks - 1 - j
        cols = i * BLOCK_C + cols0
        mask = cols < n_cols
        if STORE_RESIDUAL:
            h = tl.load(res_out_ptr + res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            h = _residual_stream(
                x_ptr, res_ptr, res_out_ptr, x_row + cols, res_row + cols, res_out_row + cols, mask,
                HAS_RESIDUAL, False,
            )  # fmt: skip
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            xhat = (h - mean[:, None]) * rstd[:, None]
        y = _affine(xhat, w_ptr, b_ptr, cols, mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
        tl.store(out_ptr + out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_grad_rows(dy, h, w, mean, rstd, mask, n_cols, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(dh without dh_out, xhat) for a [R, C] tile of full rows, in float32."""
    xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * w[None, :]
    if IS_RMS:
        c1 = tl.sum(g * xhat, axis=1) / n_cols
        dh = (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        s1, s2 = _sum_pair(g * xhat, g, 1)
        dh = (g - xhat * (s1 / n_cols)[:, None] - (s2 / n_cols)[:, None]) * rstd[:, None]
    return dh, xhat


@triton.jit
def _load_grad_rows(dy_ptr, h_ptr, first_row, local, cols, col_mask, rows_per_program, n_rows, stride_dy,
                    stride_h):  # fmt: skip
    """Raw dy and h tiles of rows first_row + local (those of this program's run); read
    once, so marked evict-first."""
    rows = first_row + local
    mask = ((local < rows_per_program) & (rows < n_rows))[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dy = tl.load(
        dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
    )
    h = tl.load(h_ptr + r64 * stride_h + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return dy, h


@triton.jit
def _grad_chunk(
    dy_row_ptr, h_row_ptr, w_ptr, cols, mask, mean, rstd, weight_offset, HAS_WEIGHT: tl.constexpr
):
    """(dy, xhat, g = dy * (w + weight_offset)) of one [1, C] chunk of a row, in float32."""
    dy = tl.load(dy_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(h_row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * (tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
    return dy, xhat, g


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dh_out_ptr, dh_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, stride_dy, stride_h, stride_dh_out, stride_dh, rows_per_program,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH_OUT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, LOOPED: tl.constexpr, EVEN_C: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Each program takes `rows_per_program` consecutive rows and writes its own row of the
    dweight/dbias partials ((programs, n_cols) float32), summed afterwards: no atomics,
    the same result on every run. With PREFETCH (tile path) the next row block's dy and h
    loads are issued before this block is reduced."""
    pid = tl.program_id(0)
    first_row = pid * rows_per_program
    part_row = pid.to(tl.int64) * n_cols
    if not LOOPED:
        cols = tl.arange(0, BLOCK_C)
        col_mask = cols < (BLOCK_C if EVEN_C else n_cols)
        dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if PREFETCH:
            # Own names: set before the loop and again inside, a variable would be loop-
            # carried, its type int32 here and int64 in the loop with int64 sizes.
            dy_next, h_next = _load_grad_rows(dy_ptr, h_ptr, first_row, tl.arange(0, BLOCK_R), cols, col_mask,
                                              rows_per_program, n_rows, stride_dy, stride_h)  # fmt: skip
        for start in range(0, rows_per_program, BLOCK_R):
            local = start + tl.arange(0, BLOCK_R)
            rows = first_row + local
            row_mask = (local < rows_per_program) & (rows < n_rows)
            mask = row_mask[:, None] & col_mask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            if PREFETCH:
                dy, h = dy_next, h_next
                dy_next, h_next = _load_grad_rows(dy_ptr, h_ptr, first_row, local + BLOCK_R, cols, col_mask,
                                                  rows_per_program, n_rows, stride_dy, stride_h)  # fmt: skip
            else:
                dy, h = _load_grad_rows(dy_ptr, h_ptr, first_row, local, cols, col_mask, rows_per_program, n_rows,
                                        stride_dy, stride_h)  # fmt: skip
            dy, h = dy.to(tl.float32), h.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                mean = tl.zeros([BLOCK_R], dtype=tl.float32)
            else:
                mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            # w is read again per row block (from L1/L2) rather than held across the loop:
            # the registers go to the dweight/dbias accumulators (no spills at 8192 columns).
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
            else:
                w = tl.zeros([BLOCK_C], dtype=tl.float32)
            dh, xhat = _norm_grad_rows(dy, h, w, mean, rstd, mask, n_cols, IS_RMS, HAS_WEIGHT)
            if HAS_DH_OUT:
                dh += tl.load(dh_out_ptr + r64 * stride_dh_out + cols[None, :], mask=mask, other=0.0).to(
                    tl.float32
                )
            tl.store(dh_ptr + r64 * stride_dh + cols[None, :], dh.to(dh_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if BIAS_GRAD:
                db_acc += tl.sum(dy, axis=0)
        if WEIGHT_GRAD:
            tl.store(dw_part_ptr + part_row + cols, dw_acc, mask=col_mask)
        if BIAS_GRAD:
            tl.store(db_part_ptr + part_row + cols, db_acc, mask=col_mask)
    else:
        cols0 = tl.arange(0, BLOCK_C)[None, :]
        n_chunks = tl.cdiv(n_cols, BLOCK_C)
        for local in range(0, rows_per_program):
            row = first_row.to(tl.int64) + local
            row_ok = row < n_rows
            dy_row, h_row = row * stride_dy, row * stride_h
            rstd = tl.load(rstd_ptr + row + tl.arange(0, 1), mask=row_ok, other=0.0)
            if IS_RMS:
                mean = tl.zeros([1], dtype=tl.float32)
            else:
                mean = tl.load(mean_ptr + row + tl.arange(0, 1), mask=row_ok, other=0.0)
            # Walk 1: the row sums c1 = mean(g * xhat) and c2 = mean(g).
            c1 = tl.zeros([1], dtype=tl.float32)
            c2 = tl.zeros([1], dtype=tl.float32)
            for i in range(0, n_chunks):
                cols = i * BLOCK_C + cols0
                mask = (cols < n_cols) & row_ok
                dy, xhat, g = _grad_chunk(dy_ptr + dy_row, h_ptr + h_row, w_ptr, cols, mask, mean, rstd,
                                          weight_offset, HAS_WEIGHT)  # fmt: skip
                c1 += tl.sum(g * xhat, axis=1)
                c2 += tl.sum(g, axis=1)
            c1 = c1 / n_cols
            c2 = c2 / n_cols
            # Walk 2, last chunk first (still in L2): dh, and this program's partials.
            for j in range(0, n_chunks):
                i = n_chunks - 1 - j
                cols = i * BLOCK_C + cols0
                mask = (cols < n_cols) & row_ok
                dy, xhat, g = _grad_chunk(dy_ptr + dy_row, h_ptr + h_row, w_ptr, cols, mask, mean, rstd,
                                          weight_offset, HAS_WEIGHT)  # fmt: skip
                if IS_RMS:
                    dh = (g - xhat * c1[:, None]) * rstd[:, None]
                else:
                    dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
                if HAS_DH_OUT:
                    dh += tl.load(dh_out_ptr + row * stride_dh_out + cols, mask=mask, other=0.0).to(
                        tl.float32
                    )
                tl.store(dh_ptr + row * stride_dh + cols, dh.to(dh_ptr.dtype.element_ty), mask=mask)
                # The partial row is this program's own: read-modify-write needs no atomics;
                # its first row writes without reading.
                not_first = local > 0
                if WEIGHT_GRAD:
                    dw = tl.load(dw_part_ptr + part_row + cols, mask=mask & not_first, other=0.0)
                    tl.store(dw_part_ptr + part_row + cols, dw + dy * xhat, mask=mask)
                if BIAS_GRAD:
                    db = tl.load(db_part_ptr + part_row + cols, mask=mask & not_first, other=0.0)
                    tl.store(db_part_ptr + part_row + cols, db + dy, mask=mask)


@triton.jit
def _norm_bwd_split_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dh_out_ptr, dh_ptr, dw_part_ptr, db_part_ptr, part_ptr,
    arrived_ptr, n_rows, n_cols, n_splits, stride_dy, stride_h, stride_dh_out, stride_dh, rows_per_program,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH_OUT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_C: tl.constexpr, MAX_SPLITS: tl.constexpr, NARROW: tl.constexpr,
):  # fmt: skip
    """Long rows split over n_splits programs, as the split forward: program pid holds
    chunk pid % n_splits of rows_per_program consecutive rows (row block pid // n_splits),
    one row at a time. Per row it publishes its chunk's sums of g * xhat and g to part_ptr,
    counts itself in arrived_ptr[row] (0 before and after: _leave_row), waits for the row's
    other chunks, and writes its chunk of dh from registers: one read of dy and h, one write of
    dh. Its chunk of the dweight/dbias partials (row block x n_cols, float32) accumulates in
    registers over its rows and is stored once: no atomics, the same result on every run.

    Progress: a row block's programs are consecutive and start in index order, so the
    argument of the split forward holds while a GPU fits n_splits programs at once (the
    launch plan keeps n_splits within the SM count). NARROW (CUDA, 16-bit dy and h): they are
    held across the wait in their own dtype (see _norm_fwd_split_kernel). Loading the next
    row before the wait measured slower: more registers, fewer programs per SM."""
    pid = tl.program_id(0)
    block = pid // n_splits
    split = pid % n_splits
    cols = split * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < n_cols
    first_row = block.to(tl.int64) * rows_per_program
    n_local = tl.minimum(rows_per_program, n_rows - first_row)
    index = tl.arange(0, MAX_SPLITS)
    valid = index < n_splits
    dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for local in range(0, n_local):
        row = first_row + local
        dy_raw = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        h_raw = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0, eviction_policy="evict_first")
        rstd = tl.load(rstd_ptr + row)
        mean = 0.0
        if not IS_RMS:
            mean = tl.load(mean_ptr + row)
        dy, xhat, g = _split_grad_terms(dy_raw, h_raw, w_ptr, cols, mask, mean, rstd, weight_offset,
                                        HAS_WEIGHT)  # fmt: skip
        slot = part_ptr + (row * n_splits + split) * 2
        tl.store(slot, tl.sum(g * xhat, axis=0))
        if not IS_RMS:
            tl.store(slot + 1, tl.sum(g, axis=0))
        tl.debug_barrier()
        tl.atomic_add(arrived_ptr + row, 1, sem="release")
        seen = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
        while seen < n_splits:
            seen = tl.atomic_add(arrived_ptr + row, 0, sem="acquire")
        _leave_row(arrived_ptr + row, n_splits)
        tl.debug_barrier()
        parts = part_ptr + (row * n_splits + index) * 2
        c1 = tl.sum(tl.load(parts, mask=valid, other=0.0, cache_modifier=".cg"), axis=0) / n_cols
        c2 = 0.0
        if not IS_RMS:
            c2 = tl.sum(tl.load(parts + 1, mask=valid, other=0.0, cache_modifier=".cg"), axis=0) / n_cols
        if NARROW and dy_raw.dtype.primitive_bitwidth == 16 and h_raw.dtype.primitive_bitwidth == 16:
            # From the 16-bit registers again, so the float32 terms are not held over the wait.
            dy, xhat, g = _split_grad_terms(_opaque_copy(dy_raw), _opaque_copy(h_raw), w_ptr, cols, mask, mean,
                                            rstd, weight_offset, HAS_WEIGHT)  # fmt: skip
        dh = (g - xhat * c1 - c2) * rstd
        if HAS_DH_OUT:
            dh += tl.load(dh_out_ptr + row * stride_dh_out + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dh_ptr + row * stride_dh + cols, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dw_acc += dy * xhat
        if BIAS_GRAD:
            db_acc += dy
    part_row = block.to(tl.int64) * n_cols
    if WEIGHT_GRAD:
        tl.store(dw_part_ptr + part_row + cols, dw_acc, mask=mask)
    if BIAS_GRAD:
        tl.store(db_part_ptr + part_row + cols, db_acc, mask=mask)


@triton.jit
def _split_grad_terms(dy_raw, h_raw, w_ptr, cols, mask, mean, rstd, weight_offset, HAS_WEIGHT: tl.constexpr):
    """(dy, xhat, g = dy * (w + weight_offset)) of one chunk, in float32 (masked entries 0)."""
    dy = dy_raw.to(tl.float32)
    xhat = tl.where(mask, (h_raw.to(tl.float32) - mean) * rstd, 0.0)
    g = dy
    if HAS_WEIGHT:
        g = dy * (tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
    return dy, xhat, g


@triton.jit
def _sum_parts_kernel(
    part_ptr, out_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_P: tl.constexpr
):
    """out[c] = sum over p of part[p, c] for a (n_parts, n_cols) float32 buffer, summed in
    float32 in a fixed order (deterministic) and rounded once to out's dtype."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for first in range(0, n_parts, BLOCK_P):
        parts = first + tl.arange(0, BLOCK_P)
        mask = col_mask[None, :] if EVEN_P else (parts[:, None] < n_parts) & col_mask[None, :]
        offs = parts.to(tl.int64)[:, None] * n_cols + cols[None, :]
        acc += tl.load(part_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)
