"""Triton kernels of the quant family: y = x @ W^T with W in format.py's 4-bit layout.

Codes are unpacked in registers: byte j of a row holds columns 2j (low nibble) and 2j + 1
(high nibble), so tl.join(low, high).reshape(...) puts a row's codes back in column order.
Scales and zeros are applied per group *after* the products, never to the weight:
    sum_k (q_k - z) * s * x_k = s * (sum_k q_k x_k - z * sum_k x_k)       (int4)
    sum_k v[q_k] * s * x_k    = s * sum_k v[q_k] x_k                       (nf4, v = NF4 levels)
so the integer codes (exact in fp16/bf16) go to the products untouched, and the scale is one
float32 multiply per group and output instead of one per weight.

_int4_linear_gemv_fwd_kernel  M == 1 (decode): CUDA-core dot products, BLOCK_N rows x
    BLOCK_K columns of W per step; a block may span several groups (SUB = min(GROUP, BLOCK_K)).
_int4_linear_fwd_kernel       M >= 2: tensor-core tiles computed transposed,
    out^T (BLOCK_N, BLOCK_M) = W (BLOCK_N, BLOCK_K) @ x^T (BLOCK_K, BLOCK_M), so the weight
    (unpacked in registers) is the left operand and tiny M pads the small side of the MMA;
    one group per K step (BLOCK_K divides GROUP).
Both split K over SPLIT_K programs when N alone gives too few programs; the partial sums
(float32, (SPLIT_K, M, N)) are added by _int4_linear_reduce_kernel, which also adds the bias
and rounds. _dequantize_int4_fwd_kernel writes W itself (large M runs dequantize + matmul).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _unpack_pairs(packed, NF4: tl.constexpr, lut_ptr):
    """(R, C) uint8 -> low and high codes (float32 or NF4 levels), each (R, C)."""
    low = packed & 0xF
    high = packed >> 4
    if NF4:
        return tl.load(lut_ptr + low), tl.load(lut_ptr + high)
    return low.to(tl.float32), high.to(tl.float32)


@triton.jit
def _int4_linear_gemv_fwd_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr,
    N, K, k_per_split, stride_qn, stride_sg,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, NF4: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):  # fmt: skip
    """One output row: out[n] = sum_k W[n, k] x[k]. x (K,), out (N,) or float32 partials
    (SPLIT_K, N). Program (pid_n, split) covers rows pid_n*BLOCK_N.. and K range
    [split * k_per_split, (split + 1) * k_per_split)."""
    SUB: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    GROUPS: tl.constexpr = BLOCK_K // SUB
    HALF: tl.constexpr = BLOCK_K // 2
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_j = tl.arange(0, HALF)
    offs_x = tl.arange(0, BLOCK_K)
    offs_g = tl.arange(0, GROUPS)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        cols = k // 2 + offs_j
        if EVEN_K:
            mask_w = mask_n[:, None]
            x = tl.load(x_ptr + k + offs_x)
        else:
            mask_w = mask_n[:, None] & (2 * cols < k_end)[None, :]
            x = tl.load(x_ptr + k + offs_x, mask=k + offs_x < k_end, other=0.0)
        # Contiguous (vectorized) load of x, split into the columns the low / high nibbles hold.
        x_even, x_odd = tl.split(tl.reshape(x.to(tl.float32), (HALF, 2)))
        packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + cols[None, :], mask=mask_w, other=0)
        low, high = _unpack_pairs(packed, NF4, lut_ptr)
        prod = low * x_even[None, :] + high * x_odd[None, :]  # (BLOCK_N, HALF)
        part = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, SUB // 2)), axis=2)  # per group
        g = (k + offs_g * SUB) // GROUP
        s_off = g[None, :] * stride_sg + offs_n[:, None]
        scale = tl.load(s_ptr + s_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
        if NF4:
            acc += tl.sum(scale * part, axis=1)
        else:
            x_sum = tl.sum(tl.reshape(x_even + x_odd, (GROUPS, SUB // 2)), axis=1)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + s_off, mask=mask_n[:, None], other=0.0).to(tl.float32)
            else:
                zero = 8.0
            acc += tl.sum(scale * (part - zero * x_sum[None, :]), axis=1)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(out_ptr + split * N + offs_n, acc, mask=mask_n)


@triton.jit
def _int4_linear_fwd_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_qn, stride_sg, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr, HAS_ZEROS: tl.constexpr, NF4: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """out (M, N) (or float32 partials (SPLIT_K, M, N)) = x (M, K) @ W^T; BLOCK_K divides GROUP.
    Programs are ordered GROUP_N weight tiles at a time per band of M, so consecutive programs
    reuse x from L2 while W streams once per band."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_band = GROUP_N * tiles_m
    band = pid // per_band
    first_n = band * GROUP_N
    width = tl.minimum(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_band) % width
    pid_m = (pid % per_band) // width
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    offs_j = tl.arange(0, BLOCK_K // 2)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k // 2 + offs_j)[None, :],
                             mask=mask_n[:, None], other=0)  # fmt: skip
            x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None],
                          mask=mask_m[None, :], other=0.0)  # fmt: skip
        else:
            in_k = (k + offs_k) < k_end
            packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + (k // 2 + offs_j)[None, :],
                             mask=mask_n[:, None] & ((k + 2 * offs_j) < k_end)[None, :], other=0)  # fmt: skip
            x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None],
                          mask=mask_m[None, :] & in_k[:, None], other=0.0)  # fmt: skip
        low, high = _unpack_pairs(packed, NF4, lut_ptr)
        w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
        part = tl.dot(w, x_t)  # (BLOCK_N, BLOCK_M), exact products, float32 sums
        g = k // GROUP
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if NF4:
            acc += scale[:, None] * part
        else:
            x_sum = tl.sum(x_t.to(tl.float32), axis=0)
            if HAS_ZEROS:
                zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            else:
                zero = tl.full((BLOCK_N,), 8.0, tl.float32)
            acc += scale[:, None] * (part - zero[:, None] * x_sum[None, :])
    out_mask = mask_n[:, None] & mask_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)  # fmt: skip
    else:
        tl.store(out_ptr + split * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=out_mask)


@triton.jit
def _int4_linear_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_om,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """out[m, n] = sum over splits of partials (SPLIT_K, M, N) float32, + bias, rounded once."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_int4_fwd_kernel(
    qw_ptr, s_ptr, z_ptr, lut_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, NF4: tl.constexpr,
):  # fmt: skip
    """out (N, K) = W in out's dtype; a (BLOCK_N, BLOCK_K) tile per program, BLOCK_K divides GROUP
    or GROUP divides BLOCK_K."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask_n = offs_n < N
    packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_j[None, :],
                     mask=mask_n[:, None] & (2 * offs_j < K)[None, :], other=0)  # fmt: skip
    low, high = _unpack_pairs(packed, NF4, lut_ptr)
    w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    s_off = (offs_k // GROUP)[None, :] * stride_sg + offs_n[:, None]
    scale = tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    if NF4:
        w = w * scale
    else:
        if HAS_ZEROS:
            zero = tl.load(z_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = 8.0
        w = (w - zero) * scale
    tl.store(
        out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask
    )
