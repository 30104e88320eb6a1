"""Triton kernels of the quant family: y = x @ W^T with W in format.py's 4-bit layout.

Codes are unpacked in registers: byte j of a row holds columns 2j (low nibble) and 2j + 1
(high nibble). A code becomes a float without a conversion instruction (int-to-float runs
at a quarter of the ALU rate and bounded the first version): OR-ing it into the mantissa of
a constant gives the constant + code exactly (float32 2^23 + q; bfloat16 128 + q; float16
1024 + q), and one subtraction of (constant + zero) leaves q - zero exactly. Scales are
applied per group *after* the products:
    sum_k (q_k - z) * s * x_k = s * sum_k (q_k - z) x_k        (int4; z = 8 when symmetric)
    sum_k v[q_k] * s * x_k    = s * sum_k v[q_k] x_k           (nf4, v = NF4 levels)
so a scale costs one float32 multiply per group and output, not one per weight.

_int4_linear_gemv_fwd_kernel  M == 1 (decode): CUDA-core dot products on the codes read as
    32-bit words, BLOCK_N rows x BLOCK_K columns of W per step, inside one group.
_int4_linear_fwd_kernel       M >= 2: tensor-core tiles computed transposed,
    out^T (BLOCK_N, BLOCK_M) = W (BLOCK_N, BLOCK_K) @ x^T (BLOCK_K, BLOCK_M), so the weight
    (unpacked in registers) is the left operand and tiny M pads the small side of the MMA;
    one group per K step (BLOCK_K divides GROUP).
Both split K over SPLIT_K programs when N alone gives too few programs, in one launch: each
split stores its float32 partial tile in a workspace (SPLIT_K, M, N) and bumps the tile's
counter; the split that arrives last adds the partials in split order (deterministic), adds
the bias, rounds once, stores the output and resets the counter to 0 for the next call
(_finish_split). A second launch for the reduction cost ~10 us of host time per call, more
than the M=1 kernel itself at 8192 x 8192 (H200). _dequantize_int4_fwd_kernel writes W itself (large M runs dequantize + matmul).

NF4 levels (every kernel): NF4_SHUFFLE (NVIDIA, compiled) reads them from the warp's
registers, as cuda/int4_gemv.cu's dot_nf4_word does: each thread holds NF4[laneid & 15] in one
register (_lane_level, once per program) and a code q becomes NF4[q] by one
shfl.sync.idx (_nf4_level), in place of a gather from the table in global memory per code
(`tl.load(lut_ptr + q)`, the fallback on ROCm and under the interpreter, where inline PTX
does not run). Same float32 levels, same arithmetic: the same bits are expected (checked on a
GPU by benchmarks/studies/quant_nf4_shuffle.py). In the compiled GEMV (sm_90, group 64) the
gather also cost layout conversions through shared memory (21 barriers vs 3 with the shuffle).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lane_level(lut_ptr, NF4_SHUFFLE: tl.constexpr):
    """NF4[laneid & 15] (float32) in each thread, for _nf4_level; 0.0 (unused) without the
    shuffle. A scalar, not a tensor of the codes' shape: splatting it into any layout keeps
    the thread's own value in every element, where a layout conversion of a tensor could move
    one lane's level into another lane's registers. Every thread loads (Triton 3.6 emits the
    scalar load unpredicated in each thread): one L1 hit per thread and program."""
    if NF4_SHUFFLE:
        lane = tl.inline_asm_elementwise(
            "mov.u32 $0, %laneid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1
        )
        return tl.load(lut_ptr + (lane & 15))
    return 0.0


@triton.jit
def _nf4_level(level, code):
    """NF4[code & 15] (float32, code's shape) for 32-bit integer codes: lane (code & 31) of the
    warp holds NF4[code & 15] in `level` (_lane_level). shfl.sync.idx reads the source lane
    from the index's bits 0-4 alone (PTX ISA: bval = b[4:0]) and lanes 16-31 hold the same
    levels as 0-15, so the bits above 3 need no mask: word >> 4p is the index of nibble p.
    Full mask: Triton runs elementwise code on all 32 lanes of a warp, masked-out elements
    included (their codes are the loads' 0 fill)."""
    return tl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r", [level, code], dtype=tl.float32,
        is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _unpack_pairs(packed, NF4: tl.constexpr, lut_ptr, level, NF4_SHUFFLE: tl.constexpr):
    """(R, C) uint8 -> low and high codes (float32 or NF4 levels), each (R, C). NF4 levels by
    the warp shuffle (NF4_SHUFFLE, `level` from _lane_level) or the table gather."""
    if NF4:
        if NF4_SHUFFLE:
            codes = packed.to(tl.int32)  # low nibble in bits 0-3: no mask (_nf4_level)
            return _nf4_level(level, codes), _nf4_level(level, codes >> 4)
        return tl.load(lut_ptr + (packed & 0xF)), tl.load(lut_ptr + (packed >> 4))
    return (packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32)


@triton.jit
def _codes_minus_zero_16bit(packed, zero, DTYPE: tl.constexpr, BITCAST: tl.constexpr):
    """(R, C) uint8 and zeros (R,) float32 -> (R, 2C) codes - zero in DTYPE (bf16 / fp16), in
    column order, exact: mantissa OR trick (128 + q for bf16, 1024 + q for fp16), then one
    16-bit subtraction. BITCAST=False converts instead (the interpreter has no bfloat16 bits)."""
    rows: tl.constexpr = packed.shape[0]
    cols: tl.constexpr = 2 * packed.shape[1]
    if not BITCAST:
        low, high = (packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32)
        return (tl.reshape(tl.join(low, high), (rows, cols)) - zero[:, None]).to(DTYPE)
    if DTYPE == tl.bfloat16:  # noqa: SIM300 - DTYPE is a constexpr argument
        bias: tl.constexpr = 0x4300
        base: tl.constexpr = 128.0
    else:
        bias: tl.constexpr = 0x6400
        base: tl.constexpr = 1024.0
    low = (packed & 0xF).to(tl.uint16) | bias
    high = (packed >> 4).to(tl.uint16) | bias
    w = tl.reshape(tl.join(low, high), (rows, cols)).to(DTYPE, bitcast=True)
    return w - (zero + base).to(DTYPE)[:, None]


@triton.jit
def _finish_split(acc, bias, ws_ptr, split_stride, counter_ptr, tile, split, offs, mask, out_ptrs,
                  SPLIT_K: tl.constexpr):  # fmt: skip
    """Split-K epilogue: store this split's float32 partial `acc` at ws_ptr + split * split_stride
    + offs; the last split of the tile to arrive adds all partials and `bias` into out_ptrs."""
    tl.store(ws_ptr + split * split_stride + offs, acc, mask=mask)
    # acq_rel: the partial above is visible before the count; the last split sees every partial.
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = bias
        for s in tl.static_range(SPLIT_K):
            total += tl.load(ws_ptr + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr + tile, 0)


@triton.jit
def _word_columns(x_ptrs, in_k, EVEN_K: tl.constexpr):
    """x at x_ptrs + p for p = 0..7 (the column nibble p of each word holds), each (1, WORDS)
    float32; columns of words past K (in_k False) read 0."""
    if EVEN_K:
        return (tl.load(x_ptrs).to(tl.float32)[None, :], tl.load(x_ptrs + 1).to(tl.float32)[None, :],
                tl.load(x_ptrs + 2).to(tl.float32)[None, :], tl.load(x_ptrs + 3).to(tl.float32)[None, :],
                tl.load(x_ptrs + 4).to(tl.float32)[None, :], tl.load(x_ptrs + 5).to(tl.float32)[None, :],
                tl.load(x_ptrs + 6).to(tl.float32)[None, :], tl.load(x_ptrs + 7).to(tl.float32)[None, :])  # fmt: skip
    return (tl.load(x_ptrs, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 1, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 2, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 3, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 4, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 5, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 6, mask=in_k, other=0.0).to(tl.float32)[None, :],
            tl.load(x_ptrs + 7, mask=in_k, other=0.0).to(tl.float32)[None, :])  # fmt: skip


@triton.jit
def _int4_linear_gemv_fwd_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    N, K, k_per_split, stride_qn, stride_sg, magic,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, NF4: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, NF4_SHUFFLE: tl.constexpr,
):  # fmt: skip
    """One output row: out[n] = sum_k W[n, k] x[k] (+ bias[n]); x (K,), out (N,). Program
    (pid_n, split) covers rows pid_n*BLOCK_N.. and K range [split * k_per_split, + k_per_split)
    in steps of BLOCK_K columns inside one group (BLOCK_K divides GROUP); with SPLIT_K > 1, ws
    (SPLIT_K, N) float32 and counter (tiles,) int32 (zeros) finish it.

    The codes are read as 32-bit words (K % 8 == 0, stride_qn % 4 == 0, a 4-byte aligned
    qweight): word j of a row holds columns 8j..8j+7, nibble p at bits 4p..4p+3, so nibble p of
    every word pairs with x[8j + p]. A (BLOCK_N, BLOCK_K // 8) tile of words is one 16-byte load
    per thread and row. `magic` is 0x43000000 (the bits of 128.0) passed at run time, so that
    (word & mask) | magic is one LOP3 with the magic in a register (two ops with two
    immediates); the products stay in float32 in a (BLOCK_N, WORDS) accumulator that is
    reduced across threads once, after the loop."""
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_w = tl.arange(0, WORDS)
    row_ptrs = qw_ptr.to(tl.pointer_type(tl.uint32)) + offs_n[:, None] * (stride_qn // 4) + offs_w[None, :]
    # Nibble e (bits 4e..4e+3, e <= 4) OR'd into the bits of 2^(23 - 4e) reads 2^(23 - 4e) + q
    # exactly (the nibble is the low mantissa bits of that float); nibbles 5-7 are read from
    # word >> 12 at e = 2, 3, 4. One float32 subtraction of 2^(23 - 4e) + zero leaves q - zero.
    m4 = tl.cast(magic, tl.uint32)  # 128.0 (a constexpr where JAX launches: every integer is one)
    m3 = m4 + 0x02000000  # 2048.0
    m2 = m4 + 0x04000000  # 32768.0
    m1 = m4 + 0x06000000  # 524288.0
    m0 = m4 + 0x08000000  # 8388608.0
    level = _lane_level(lut_ptr, NF4_SHUFFLE)
    acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        # (k // BLOCK_K) * WORDS, not k // 8: keeps the offset's divisibility visible (16-byte loads)
        word0 = (k // BLOCK_K) * WORDS
        if EVEN_K:
            in_k = offs_w >= 0
            words = tl.load(row_ptrs + word0, mask=mask_n[:, None], other=0)
        else:
            in_k = k + offs_w * 8 < k_end
            words = tl.load(row_ptrs + word0, mask=mask_n[:, None] & in_k[None, :], other=0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _word_columns(x_ptr + k + offs_w * 8, in_k, EVEN_K)
        g = k // GROUP
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if NF4 and NF4_SHUFFLE:  # one SHF, one SHFL and the FMA per code
            part = _nf4_level(level, words) * x0
            part += _nf4_level(level, words >> 4) * x1
            part += _nf4_level(level, words >> 8) * x2
            part += _nf4_level(level, words >> 12) * x3
            part += _nf4_level(level, words >> 16) * x4
            part += _nf4_level(level, words >> 20) * x5
            part += _nf4_level(level, words >> 24) * x6
            part += _nf4_level(level, words >> 28) * x7
        elif NF4:
            part = tl.load(lut_ptr + (words & 0xF)) * x0
            part += tl.load(lut_ptr + ((words >> 4) & 0xF)) * x1
            part += tl.load(lut_ptr + ((words >> 8) & 0xF)) * x2
            part += tl.load(lut_ptr + ((words >> 12) & 0xF)) * x3
            part += tl.load(lut_ptr + ((words >> 16) & 0xF)) * x4
            part += tl.load(lut_ptr + ((words >> 20) & 0xF)) * x5
            part += tl.load(lut_ptr + ((words >> 24) & 0xF)) * x6
            part += tl.load(lut_ptr + (words >> 28)) * x7
        else:
            if HAS_ZEROS:
                zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            else:
                zero = tl.full((BLOCK_N, 1), 8.0, tl.float32)
            high = words >> 12
            o2, o3, o4 = zero + 32768.0, zero + 2048.0, zero + 128.0
            part = (((words & 0xF) | m0).to(tl.float32, bitcast=True) - (zero + 8388608.0)) * x0
            part += (((words & 0xF0) | m1).to(tl.float32, bitcast=True) - (zero + 524288.0)) * x1
            part += (((words & 0xF00) | m2).to(tl.float32, bitcast=True) - o2) * x2
            part += (((words & 0xF000) | m3).to(tl.float32, bitcast=True) - o3) * x3
            part += (((words & 0xF0000) | m4).to(tl.float32, bitcast=True) - o4) * x4
            part += (((high & 0xF00) | m2).to(tl.float32, bitcast=True) - o2) * x5
            part += (((high & 0xF000) | m3).to(tl.float32, bitcast=True) - o3) * x6
            part += (((high & 0xF0000) | m4).to(tl.float32, bitcast=True) - o4) * x7
        acc += scale * part
    total = tl.sum(acc, axis=1)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_n, (total + bias).to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        _finish_split(
            total, bias, ws_ptr, N, counter_ptr, pid_n, split, offs_n, mask_n, out_ptr + offs_n, SPLIT_K
        )


@triton.jit
def _int4_linear_fwd_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, k_per_split, stride_xm, stride_qn, stride_sg, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr, HAS_ZEROS: tl.constexpr, NF4: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, BITCAST: tl.constexpr, SWAP_AB: tl.constexpr,
    UNROLL: tl.constexpr, NF4_SHUFFLE: tl.constexpr,
):  # fmt: skip
    """out (M, N) = x (M, K) @ W^T (+ bias); BLOCK_K // UNROLL divides GROUP; with SPLIT_K > 1, ws
    (SPLIT_K, M, N) float32 and counter (tiles,) int32 (zeros) finish it.
    SWAP_AB: the tile is computed as out^T = W @ x^T (the unpacked weight is the MMA's left,
    register operand, and a small M pads the MMA's narrow side); else out = x @ W^T (the weight
    goes through shared memory as the right operand).
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
    KSTEP: tl.constexpr = BLOCK_K // UNROLL
    offs_j = tl.arange(0, KSTEP // 2)
    offs_k = tl.arange(0, KSTEP)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    level = _lane_level(lut_ptr, NF4_SHUFFLE)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        # UNROLL sub-steps of KSTEP columns, each inside one group; more loads in flight per
        # pipeline stage than one KSTEP step (+6% at 28672 x 8192, M=16, on H200).
        for u in tl.static_range(UNROLL):
            k = k0 + u * KSTEP
            in_k = (k + offs_k) < k_end
            w_mask = mask_n[:, None] if EVEN_K else mask_n[:, None] & ((k + 2 * offs_j) < k_end)[None, :]
            packed = tl.load(
                qw_ptr + offs_n[:, None] * stride_qn + (k // 2 + offs_j)[None, :], mask=w_mask, other=0
            )
            if SWAP_AB:
                x_mask = mask_m[None, :] if EVEN_K else mask_m[None, :] & in_k[:, None]
                x = tl.load(
                    x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None], mask=x_mask, other=0.0
                )
            else:
                x_mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & in_k[None, :]
                x = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=x_mask, other=0.0
                )
            g = k // GROUP
            # A sub-step past K (uneven K) must not read the scale row after the last group.
            s_mask = mask_n if EVEN_K else mask_n & (k < k_end)
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=s_mask, other=0.0).to(tl.float32)
            if NF4:
                low, high = _unpack_pairs(packed, NF4, lut_ptr, level, NF4_SHUFFLE)
                w = tl.reshape(tl.join(low, high), (BLOCK_N, KSTEP)).to(x_ptr.dtype.element_ty)
            else:
                if HAS_ZEROS:
                    zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=s_mask, other=0.0).to(tl.float32)
                else:
                    zero = tl.full((BLOCK_N,), 8.0, tl.float32)
                w = _codes_minus_zero_16bit(packed, zero, x_ptr.dtype.element_ty, BITCAST)
            # Integers |q - zero| <= 16 are exact in 16 bits: exact products, float32 sums.
            if SWAP_AB:
                acc += scale[:, None] * tl.dot(w, x)
            else:
                acc += scale[None, :] * tl.dot(x, tl.trans(w))
    if SWAP_AB:
        out_mask = mask_n[:, None] & mask_m[None, :]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        offs = offs_m[None, :] * N + offs_n[:, None]
        bias = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    else:
        out_mask = mask_m[:, None] & mask_n[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        offs = offs_m[:, None] * N + offs_n[None, :]
        bias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:
            bias += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, (acc + bias).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        _finish_split(acc, bias, ws_ptr, M * N, counter_ptr, pid, split, offs, out_mask, out_ptrs, SPLIT_K)


@triton.jit
def _dequantize_int4_fwd_kernel(
    qw_ptr, s_ptr, z_ptr, lut_ptr, out_ptr, N, K, stride_qn, stride_sg, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, NF4: tl.constexpr, NF4_SHUFFLE: tl.constexpr,
):  # fmt: skip
    """out (N, K) = W in out's dtype; a (BLOCK_N, BLOCK_K) tile per program, BLOCK_K divides GROUP
    or GROUP divides BLOCK_K."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask_n = offs_n < N
    packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + offs_j[None, :],
                     mask=mask_n[:, None] & (2 * offs_j < K)[None, :], other=0)  # fmt: skip
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    s_off = (offs_k // GROUP)[None, :] * stride_sg + offs_n[:, None]
    scale = tl.load(s_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    if NF4:
        low, high = _unpack_pairs(packed, NF4, lut_ptr, _lane_level(lut_ptr, NF4_SHUFFLE), NF4_SHUFFLE)
        w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)) * scale
    else:
        if HAS_ZEROS:
            zero = tl.load(z_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = 8.0
        # 2^23 + code from the mantissa (no int-to-float conversion), minus (2^23 + zero).
        low = ((packed & 0xF).to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True)
        high = ((packed >> 4).to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True)
        w = (tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)) - (zero + 8388608.0)) * scale
    tl.store(
        out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask
    )
