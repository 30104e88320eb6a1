"""Triton kernels of the layernorm family: one forward and one backward kernel, with RMSNorm
vs LayerNorm, residual, stored residual stream, affine weight/bias and the looped path for
rows wider than one tile as compile-time flags.

Shapes: x, residual, dy, h, dh_out are (n_rows, n_cols) with unit column stride and a row
stride each; out, res_out, dh are contiguous; mean/rstd are (n_rows,) float32.
`res_out_ptr` always carries the residual stream's dtype (h is rounded to it before it is
normalized, see reference.py), even when STORE_RESIDUAL is off and nothing is written.

Single-tile path (LOOPED off): a program holds BLOCK_R full rows in registers.
Looped path: a program walks one row in BLOCK_C chunks twice (statistics, then output); the
second walk goes backwards so it starts on the chunks the first walk left in L2.
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
def _corrected_mean(h, mask, count):
    """Row means of a [R, C] tile: the plain mean plus the mean of what it leaves over,
    which removes most of the float32 rounding of a sum of large values (rows with a
    large mean and a small spread)."""
    mean = tl.sum(h, axis=1) / count
    return mean + tl.sum(tl.where(mask, h - mean[:, None], 0.0), axis=1) / count


@triton.jit
def _norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, mean_ptr, rstd_ptr,
    n_rows, n_cols, stride_x, stride_res, stride_out, stride_res_out,
    eps, weight_offset,
    IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, LOOPED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if not LOOPED:
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        h = _residual_stream(
            x_ptr, res_ptr, res_out_ptr, r64 * stride_x + cols[None, :], r64 * stride_res + cols[None, :],
            r64 * stride_res_out + cols[None, :], mask, HAS_RESIDUAL, STORE_RESIDUAL,
        )  # fmt: skip
        if IS_RMS:
            rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
            xhat = h * rstd[:, None]
        else:
            mean = _corrected_mean(h, mask, n_cols)
            centered = tl.where(mask, h - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
            xhat = centered * rstd[:, None]
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = _affine(xhat, w_ptr, b_ptr, cols[None, :], col_mask[None, :], weight_offset, HAS_WEIGHT, HAS_BIAS)
        tl.store(out_ptr + r64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = pid.to(tl.int64)
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
                chunk_mean = _corrected_mean(h, mask, count)
                centered = tl.where(mask, h - chunk_mean[:, None], 0.0)
                chunk_m2 = tl.sum(centered * centered, axis=1)
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
    c1 = tl.sum(g * xhat, axis=1) / n_cols
    if IS_RMS:
        dh = (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        c2 = tl.sum(g, axis=1) / n_cols
        dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    return dh, xhat


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, h_ptr, w_ptr, mean_ptr, rstd_ptr, dh_out_ptr, dh_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, stride_dy, stride_h, stride_dh_out, stride_dh, rows_per_program,
    weight_offset,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH_OUT: tl.constexpr,
    WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr, LOOPED: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Each program takes `rows_per_program` consecutive rows and writes its own row of the
    dweight/dbias partials ((programs, n_cols) float32), summed afterwards: no atomics,
    the same result on every run."""
    pid = tl.program_id(0)
    first_row = pid * rows_per_program
    part_row = pid.to(tl.int64) * n_cols
    if not LOOPED:
        cols = tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for start in range(0, rows_per_program, BLOCK_R):
            local = start + tl.arange(0, BLOCK_R)
            rows = first_row + local
            row_mask = (local < rows_per_program) & (rows < n_rows)
            mask = row_mask[:, None] & col_mask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = tl.load(h_ptr + r64 * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
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
                dy = tl.load(dy_ptr + dy_row + cols, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(h_ptr + h_row + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
                g = dy
                if HAS_WEIGHT:
                    g = dy * (tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
                c1 += tl.sum(g * xhat, axis=1)
                c2 += tl.sum(g, axis=1)
            c1 = c1 / n_cols
            c2 = c2 / n_cols
            # Walk 2, last chunk first (still in L2): dh, and this program's partials.
            for j in range(0, n_chunks):
                i = n_chunks - 1 - j
                cols = i * BLOCK_C + cols0
                mask = (cols < n_cols) & row_ok
                dy = tl.load(dy_ptr + dy_row + cols, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(h_ptr + h_row + cols, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
                g = dy
                if HAS_WEIGHT:
                    g = dy * (tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset)
                if IS_RMS:
                    dh = (g - xhat * c1[:, None]) * rstd[:, None]
                else:
                    dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
                if HAS_DH_OUT:
                    dh += tl.load(dh_out_ptr + row * stride_dh_out + cols, mask=mask, other=0.0).to(tl.float32)
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
