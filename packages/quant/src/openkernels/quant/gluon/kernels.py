"""Hopper (sm_90a) int4_linear in Gluon: the dequantized weight as wgmma's register operand,
issued asynchronously so that the next step's dequantization runs under it.

One program per (BLOCK_N rows of W, BLOCK_M rows of x) tile, computed transposed as the
Triton tiled kernel does (triton/kernels.py, SWAP_AB):

    acc^T (BLOCK_N, BLOCK_M) += W (BLOCK_N, BLOCK_K) @ x^T (BLOCK_K, BLOCK_M)

* A, the weight: codes (BLOCK_N, BLOCK_K // 2) uint8 arrive by TMA in shared memory. The
  A-operand layout (k_width = 2) gives thread t of each lane quad the column pairs 2j, 2j + 1
  with j = 4a + t: byte j of the codes, byte t of 32-bit word a. So every thread reads its
  rows' words whole (the tile reinterpreted as int32, 16-byte ld.shared.v4, the four lanes
  of a quad reading the same words) and one inline-PTX sequence per word builds the 32-bit
  register the wgmma reads: shr (the word >> 4), prmt (byte t of the word and of the shifted
  word into bytes 0 and 2), lop3 (mask the nibbles, OR in the bits of 128 + q in bf16 or
  1024 + q in fp16: the mantissa trick), sub.rn.bf16x2 / f16x2 of base + zero (q - z
  exactly) and mul.rn of the scale (one rounding). Written as tensors of shape (BLOCK_N,
  BLOCK_K // 8, 4) (row, word, t) whose join and reshape to (BLOCK_N, BLOCK_K) is already
  the operand layout (the conversion is register-only: no shared memory, checked in the
  PTX). SASS per K step and thread at 64 x 128 x 128: 8 LDS.128 and about 160 ALU
  instructions for its 64 weights (SHF, PRMT, LOP3, HADD2, HMUL2 per pair), against 32
  LDS.U8 and about 280 when the codes were loaded byte by byte in the operand layout.
* B, x: (BLOCK_M, BLOCK_K) tiles by TMA (rows past M read zeros), the shared-memory view
  permuted to (BLOCK_K, BLOCK_M).
* STAGES-deep ring: one mbarrier per stage, armed with the bytes of both tiles. Step i waits
  its stage, dequantizes, issues wgmma i (is_async), waits until one wgmma is outstanding
  (wgmma i - 1 retired: its x tile is free, and so is the whole stage, whose codes were read
  into registers before wgmma i - 1 was issued), then refills that stage with the TMA of step
  i + STAGES - 1. The dequantization of step i + 1 thus runs while wgmma i does.
* Two K steps per loop trip (`_step` twice, and a tail step for odd K / BLOCK_K), so the two
  steps' A operands sit in different registers: PTX leaves modifying a wgmma's A registers
  before the wait that retires it undefined, and with one loop body ptxas reused the
  in-flight operand's registers for the next step's codes (the SASS check in test_aot.py
  found 452 such writes per three trips; none now). Each wait names the other step's
  operand as a dependence to keep it live up to that wait.
* Epilogue: float32 bias added, rounded once to x's dtype, stored transposed
  (y[m, n] = acc[n, m]) after a conversion to a layout with 8 consecutive n per thread.
  SPLIT_K > 1: the program takes a contiguous share of the K steps and finishes as the Triton
  kernels' split-K does (`_finish_split`).
* NF4: the same pairs built from the 16 levels instead of by the mantissa trick, by one of
  three lookups (NF4_TABLE; the launcher's gluon.NF4_LOOKUP): `_dequantize_nf4` by byte
  permutes of eight constant registers (12 instructions per pair); `_dequantize_nf4_shared`
  from a table in shared memory, either one read per pair from 256 level pairs (a warp's reads
  land on random banks) or, the default, two reads per pair from 16 levels (no bank conflict)
  and a byte permute. The table is a register tensor built once per program by the register
  lookup; gl.gather stores it to shared memory and reads it (one barrier per K step).

Where this differs from the Triton kernel (and why): the scale is applied to the weight
*before* the product (W = (q - z) s rounded to x's dtype), not per group after it: an
asynchronous wgmma accumulates into one register accumulator for the whole K loop, and a
per-group rescale would need a second accumulator and a wait per group. Rounding W to x's
dtype is the error contract's weight term (reference.linear_error_bound,
weight_rounded_to=x.dtype), the same term the dequantize + matmul path uses; with scales in
x's dtype the 16-bit product of the exact q - z and the scale is that single rounding
(SCALE_16), otherwise the product is taken in float32 and rounded once.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.constexpr_function
def acc_layout(warps, block_m):
    """The accumulator (BLOCK_N = 16 * warps, BLOCK_M): wgmma v3, warps along N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_m, 16])


@gluon.constexpr_function
def _halve_columns(linear, shape):
    """`linear` (the A-operand layout as a linear layout) with column bit 0 (the register pair
    of adjacent columns, k_width = 2) dropped and every other column index halved: the layout
    of the packed codes, one byte per column pair, shape (rows, cols // 2)."""
    regs = [[r, c // 2] for r, c in linear.reg_bases if [r, c] != [0, 1]]
    assert len(regs) == len(linear.reg_bases) - 1, "expected column bit 0 in the registers"
    lanes = [[r, c // 2] for r, c in linear.lane_bases]
    warps = [[r, c // 2] for r, c in linear.warp_bases]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [shape[0], shape[1] // 2])


@gluon.constexpr_function
def _words_layout(codes):
    """The layout of (rows, cols // 4, 4) for `codes` (rows, cols) whose lane bits 0-1 are
    column bits 0-1: element [n, a, t] is in the thread that holds code byte 4a + t of row n
    in `codes`, and lane t holds all of row n's 32-bit words a (their bytes 4a..4a+3) in
    registers, the words first (16-byte shared-memory loads)."""
    regs = [[0, c // 4, 0] for r, c in codes.reg_bases if r == 0]
    regs += [[r, 0, 0] for r, c in codes.reg_bases if c == 0]
    assert len(regs) == len(codes.reg_bases), codes
    assert [b for b in codes.lane_bases if b[0] == 0] == [[0, 1], [0, 2]], codes
    lanes = [[0, 0, c] if r == 0 else [r, 0, 0] for r, c in codes.lane_bases]
    warps = [[r, 0, 0] for r, c in codes.warp_bases]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [codes.shape[0], codes.shape[1] // 4, 4])


@gluon.constexpr_function
def _code_rows(shape):
    """Rows of W in a code tile: (BLOCK_N, BLOCK_K // 2), or tiled (BLOCK_N // 16, 1, 16,
    BLOCK_K // 2), whose blocks of 16 rows land one after another: the same bytes in shared
    memory as the rows' tile (TMA's swizzle follows the shared address)."""
    return shape[0] if len(shape) == 2 else shape[0] * shape[2]


@gluon.constexpr_function
def _words_smem_layout(codes_smem):
    """The code tile's NVMMA shared layout read as 32-bit words (the same bytes: the swizzle
    permutes 16-byte chunks)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=codes_smem.swizzle_byte_width, element_bitwidth=32, rank=2)


@gluon.constexpr_function
def _table_layout(entries, warps):
    """nf4_shared_table's (entries,) layout: spread over the program's threads."""
    return gl.BlockedLayout([max(1, entries // (32 * warps))], [32], [warps], [0])


@gluon.constexpr_function
def _store_layout(block_n, block_m, warps):
    """8 consecutive output columns (n) per thread: 16-byte stores of y rows."""
    tn = min(32, block_n // 8)
    return gl.BlockedLayout([8, 1], [tn, 32 // tn], [1, warps], [0, 1])


@gluon.jit
def _issue(x_desc, qw_desc, x_smem, qw_smem, ready, step, base, k0, off_m, off_n, BLOCK_K: gl.constexpr,
           STAGES: gl.constexpr):  # fmt: skip
    """The TMA of the tile's step `step` (K step k0 + step)'s x and code tiles into stage
    (base + step) % STAGES: base counts the steps of the program's earlier tiles (persistent
    programs run several; the ring and its phases run on across them)."""
    s = (base + step) % STAGES
    bar = ready.index(s)
    col = (k0 + step) * BLOCK_K
    mbarrier.expect(bar, x_desc.block_type.nbytes + qw_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, col], bar, x_smem.index(s))
    if len(qw_desc.block_type.shape) == 4:  # tiled codes (N // 16, K // 128, 16, 64): tile_codes' blocks
        tma.async_copy_global_to_shared(qw_desc, [off_n // 16, col // 128, 0, (col % 128) // 2], bar,
                                        qw_smem.index(s))  # fmt: skip
    else:
        tma.async_copy_global_to_shared(qw_desc, [off_n, col // 2], bar, qw_smem.index(s))


@gluon.jit
def _row_params(s_ptr, z_ptr, g, stride_sg, offs_n, mask_n, HAS_ZEROS: gl.constexpr):
    """(scale, zero) of group g for the tile's rows, float32 (zero 8 when symmetric)."""
    scale = gl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(gl.float32)
    if HAS_ZEROS:
        zero = gl.load(z_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0).to(gl.float32)
    else:
        zero = gl.full(offs_n.shape, 8.0, gl.float32, offs_n.type.layout)
    return scale, zero


@gluon.constexpr_function
def _scale_product(dtype, operand):
    """PTX: the packed pair in register u times the scale pair `operand`, rounded once in x's dtype."""
    return f"mul.rn.{'bf16x2' if str(dtype) in ('bf16', 'bfloat16') else 'f16x2'} u, u, {operand}; "


@gluon.jit
def _splat_pair(v):
    """16-bit values -> 32-bit words holding the value in both halves (a packed pair operand)."""
    bits = v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    return bits | (bits << 16)


@gluon.constexpr_function
def nf4_table_words(dtype):
    """The 16 NF4 levels rounded to `dtype` (bf16 / fp16) as eight 32-bit words: four of their
    low bytes (levels 4j .. 4j + 3 in word j), then four of their high bytes: the tables
    _dequantize_nf4's byte permutes read (a register lookup, no memory)."""
    import torch

    from ..format import NF4_VALUES

    torch_dtype = torch.bfloat16 if str(dtype) in ("bf16", "bfloat16") else torch.float16
    bits = [int(v) & 0xFFFF for v in torch.tensor(NF4_VALUES).to(torch_dtype).view(torch.int16).tolist()]
    words = []
    for shift in (0, 8):
        for j in range(4):
            word = sum(((bits[4 * j + i] >> shift) & 0xFF) << (8 * i) for i in range(4))
            words.append(word - (1 << 32) if word >= 1 << 31 else word)  # as int32
    return words


@gluon.jit
def _dequantize_nf4(words, scale, words3: gl.constexpr, a_layout: gl.constexpr, DTYPE: gl.constexpr,
                    SCALE_16: gl.constexpr):  # fmt: skip
    """NF4 as _dequantize does int4: thread t of a lane quad takes byte t of each word, whose
    low nibble a and high nibble b are the codes of its column pair, and builds the register
    (level[a], level[b]) by byte permutes from eight table registers (nf4_table_words):
    prmt puts byte t twice in the low half, an and leaves the selector (a & 7, b & 7, a & 7,
    b & 7), four prmts read the low and high bytes of levels 0-7 and 8-15, a shift and a
    sign-replicating prmt make the byte masks of bit 3 (a's in bytes 0 and 2, b's in 1 and 3),
    two lop3s pick between the halves of the table and one prmt interleaves low and high bytes:
    12 instructions per pair with the scale's product (int4: 5). W = level rounded to x's
    dtype, then its product with the scale rounded: two roundings (docs/ops/quant.md)."""
    t = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, words3)))
    select = (t | (t << 4))[None, None, :]  # bytes 0 and 1 <- word byte t
    table: gl.constexpr = nf4_table_words(DTYPE)
    zero3 = select * 0
    lo0, lo1, lo2, lo3 = zero3 + table[0], zero3 + table[1], zero3 + table[2], zero3 + table[3]
    hi0, hi1, hi2, hi3 = zero3 + table[4], zero3 + table[5], zero3 + table[6], zero3 + table[7]
    lookup: gl.constexpr = (
        "{ .reg .b32 x, y, s, m, pl, ph, ql, qh, u; "
        "prmt.b32 x, $2, $2, $3; and.b32 s, x, 0x7777; shl.b32 y, x, 4; prmt.b32 m, y, x, 0xD8D8; "
        "prmt.b32 pl, $4, $5, s; prmt.b32 ph, $6, $7, s; prmt.b32 ql, $8, $9, s; prmt.b32 qh, $10, $11, s; "
        "lop3.b32 pl, pl, ph, m, 0xD8; lop3.b32 ql, ql, qh, m, 0xD8; prmt.b32 u, pl, ql, 0x5140; "
    )
    tables = [words[:, :, None], select, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3]
    if SCALE_16:
        mul: gl.constexpr = _scale_product(DTYPE, "$12")
        s2 = _splat_pair(scale.to(DTYPE))[:, None, None]
        low, high = gl.inline_asm_elementwise(
            lookup + mul + "mov.b32 {$0, $1}, u; }", "=h,=h" + ",r" * 11, tables + [s2],  # noqa: RUF005
            dtype=(DTYPE.value, DTYPE.value), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        low, high = gl.inline_asm_elementwise(
            lookup + "mov.b32 {$0, $1}, u; }", "=h,=h" + ",r" * 10, tables, dtype=(DTYPE.value, DTYPE.value),
            is_pure=True, pack=1,
        )  # fmt: skip
    return _nf4_operand(low, high, scale, a_layout, DTYPE, SCALE_16)


_NF4_LOOKUP_ASM = gl.constexpr(
    "prmt.b32 x, $2, $2, $3; and.b32 s, x, 0x7777; shl.b32 y, x, 4; prmt.b32 m, y, x, 0xD8D8; "
    "prmt.b32 pl, $4, $5, s; prmt.b32 ph, $6, $7, s; prmt.b32 ql, $8, $9, s; prmt.b32 qh, $10, $11, s; "
    "lop3.b32 pl, pl, ph, m, 0xD8; lop3.b32 ql, ql, qh, m, 0xD8; prmt.b32 u, pl, ql, 0x5140; "
)


@gluon.jit
def nf4_shared_table(DTYPE: gl.constexpr, TABLE: gl.constexpr, layout: gl.constexpr):
    """The table _dequantize_nf4_shared reads, int32, built by the register lookup once per
    program: TABLE 1, (256,): entry b = the levels of byte b's two codes in DTYPE, level[b &
    15] in the low half and level[b >> 4] in the high one; TABLE 2, (16,): entry q = level[q]
    in both halves."""
    if TABLE == 1:
        b = gl.arange(0, 256, layout)
    else:
        q = gl.arange(0, 16, layout)
        b = q | (q << 4)
    table: gl.constexpr = nf4_table_words(DTYPE)
    zero = b * 0
    # The register lookup's sequence on byte b (selector 0x0000 puts it in bytes 0 and 1).
    return gl.inline_asm_elementwise(
        "{ .reg .b32 x, y, s, m, pl, ph, ql, qh, u; " + _NF4_LOOKUP_ASM + "mov.b32 $0, u; }",
        # $1 unused: the sequence reads the byte at $2 and the selector at $3, as in _dequantize_nf4.
        "=r" + ",r" * 11, [zero, b, zero, zero + table[0], zero + table[1], zero + table[2], zero + table[3],
                           zero + table[4], zero + table[5], zero + table[6], zero + table[7]],
        dtype=gl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _dequantize_nf4_shared(words, scale, table, words3: gl.constexpr, a_layout: gl.constexpr,
                           DTYPE: gl.constexpr, SCALE_16: gl.constexpr, TABLE: gl.constexpr):  # fmt: skip
    """NF4 as _dequantize_nf4, the levels read from a table in shared memory (gl.gather from
    `table`, nf4_shared_table, which stores it there) instead of the register lookup's 11
    instructions per pair. TABLE 1: one read per pair, the byte of codes indexing 256 level
    pairs (a warp's 32 reads land on random banks: ~3-4 wavefronts). TABLE 2: two reads per
    pair, each code indexing 16 words (never a bank conflict) and a byte permute joining the
    low half of the first to the high half of the second."""
    t = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, words3)))
    byte = (words[:, :, None] >> (8 * t)[None, None, :]) & 0xFF
    if TABLE == 1:
        flat = gl.reshape(byte, [byte.shape[0] * byte.shape[1] * 4])
        pair = gl.reshape(gl.gather(table, flat, 0), [byte.shape[0], byte.shape[1], 4])
        first = pair
        second = pair
        join: gl.constexpr = "mov.b32 u, $2; "  # $3 (the same pair) unused
    else:
        codes = gl.join(byte & 0xF, byte >> 4)  # (BLOCK_N, BLOCK_K // 8, 4, 2)
        flat = gl.reshape(codes, [byte.shape[0] * byte.shape[1] * 8])
        levels = gl.reshape(gl.gather(table, flat, 0), [byte.shape[0], byte.shape[1], 4, 2])
        first, second = gl.split(levels)
        first = gl.convert_layout(first, words3)  # the same registers: a relabelling
        second = gl.convert_layout(second, words3)
        join: gl.constexpr = "prmt.b32 u, $2, $3, 0x7610; "  # low half of the first, high of the second
    if SCALE_16:
        mul: gl.constexpr = _scale_product(DTYPE, "$4")
        s2 = _splat_pair(scale.to(DTYPE))[:, None, None]
        low, high = gl.inline_asm_elementwise(
            "{ .reg .b32 u; " + join + mul + "mov.b32 {$0, $1}, u; }", "=h,=h,r,r,r", [first, second, s2],
            dtype=(DTYPE.value, DTYPE.value), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        low, high = gl.inline_asm_elementwise(
            "{ .reg .b32 u; " + join + "mov.b32 {$0, $1}, u; }", "=h,=h,r,r", [first, second],
            dtype=(DTYPE.value, DTYPE.value), is_pure=True, pack=1,
        )  # fmt: skip
    return _nf4_operand(low, high, scale, a_layout, DTYPE, SCALE_16)


@gluon.jit
def _nf4_operand(low, high, scale, a_layout: gl.constexpr, DTYPE: gl.constexpr, SCALED: gl.constexpr):
    """The NF4 lookups' (BLOCK_N, BLOCK_K // 8, 4) low and high halves of each pair -> the
    (BLOCK_N, BLOCK_K) A operand; the scale applied here in float32 (one more rounding) unless
    the lookup's packed product took it (SCALED)."""
    if not SCALED:
        low = (low.to(gl.float32) * scale[:, None, None]).to(DTYPE)
        high = (high.to(gl.float32) * scale[:, None, None]).to(DTYPE)
    w = gl.join(low, high)  # (BLOCK_N, BLOCK_K // 8, 4, 2): column 8a + 2t + e
    w = w.reshape([low.shape[0], 8 * low.shape[1]])
    return gl.convert_layout(w, a_layout)


@gluon.jit
def _dequantize(words, scale, zero, words3: gl.constexpr, a_layout: gl.constexpr, DTYPE: gl.constexpr,
                SCALE_16: gl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_K // 8) 32-bit words of codes (in SliceLayout(2, words3): every thread
    holds its rows' words) -> (BLOCK_N, BLOCK_K) (q - z) * s in DTYPE, in the A-operand layout.

    Thread t of a lane quad takes byte t of each word (the pair of columns 2(4a + t),
    2(4a + t) + 1 the A operand gives it): one PRMT puts the byte's low nibble in bits 0-3 and
    its high nibble (from the word shifted right by 4) in bits 16-19, one LOP3 masks them and
    ORs in the 16-bit pattern of base + q (128 + q for bf16, 1024 + q for fp16: the mantissa
    trick), so one register holds the pair exactly. Then q - z exactly in 16 bits (minus base
    + zero) and one rounding of the product with the scale."""
    t = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, words3)))
    select = (t | ((t + 4) << 8))[None, None, :]  # PRMT: byte 0 <- word byte t, byte 2 <- (word >> 4) byte t
    pair: gl.constexpr = "{ .reg .b32 t, u; shr.u32 t, $2, 4; prmt.b32 u, $2, t, $3; "
    if DTYPE == gl.bfloat16:  # noqa: SIM300 - DTYPE is a constexpr argument
        base: gl.constexpr = 128.0
        magic: gl.constexpr = "lop3.b32 u, u, 0x000F000F, 0x43004300, 0xEA; "
        ops: gl.constexpr = "sub.rn.bf16x2 u, u, $4; mul.rn.bf16x2 u, u, $5; "
    else:
        base: gl.constexpr = 1024.0
        magic: gl.constexpr = "lop3.b32 u, u, 0x000F000F, 0x64006400, 0xEA; "
        ops: gl.constexpr = "sub.rn.f16x2 u, u, $4; mul.rn.f16x2 u, u, $5; "
    offset = (zero + base).to(DTYPE)
    if SCALE_16:
        # Both 16-bit operations on the pair in the register the wgmma reads: (base + q) - (base
        # + z) exactly, then the product with the scale (the scales' own dtype) rounded once.
        off2 = _splat_pair(offset)[:, None, None]
        s2 = _splat_pair(scale.to(DTYPE))[:, None, None]
        low, high = gl.inline_asm_elementwise(
            pair + magic + ops + "mov.b32 {$0, $1}, u; }",
            "=h,=h,r,r,r,r", [words[:, :, None], select, off2, s2], dtype=(DTYPE.value, DTYPE.value), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        low, high = gl.inline_asm_elementwise(
            pair + magic + "mov.b32 {$0, $1}, u; }", "=h,=h,r,r", [words[:, :, None], select], dtype=(DTYPE.value, DTYPE.value),
            is_pure=True, pack=1,
        )  # fmt: skip
        low = ((low - offset[:, None, None]).to(gl.float32) * scale[:, None, None]).to(DTYPE)
        high = ((high - offset[:, None, None]).to(gl.float32) * scale[:, None, None]).to(DTYPE)
    w = gl.join(low, high)  # (BLOCK_N, BLOCK_K // 8, 4, 2): column 8a + 2t + e
    w = w.reshape([words.shape[0], 8 * words.shape[1]])
    return gl.convert_layout(w, a_layout)


@gluon.jit
def _step(i, acc, w_other, scale, zero, scale_next, zero_next, x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr, z_ptr,
          offs_n, mask_n, stride_sg, n_k, base, k0, off_m, off_n, words3: gl.constexpr, a_layout: gl.constexpr,
          DTYPE: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_ZEROS: gl.constexpr,
          SCALE_16: gl.constexpr, SCALES_AHEAD: gl.constexpr, NF4: gl.constexpr, table=0,
          NF4_TABLE: gl.constexpr = 0):  # fmt: skip
    """The program's K step i (of n_k, K step k0 + i of the row): wait for its stage, dequantize its codes (scale, zero: its group's), issue its
    wgmma, load the scales SCALES_AHEAD steps on, wait until one wgmma is outstanding (step
    i - 1's, whose operand is w_other, has retired), refill the freed stage with step
    i + STAGES - 1. (scale_next, zero_next): step i + 1's when SCALES_AHEAD is 2 (unused at 1).
    Returns (acc, this step's operand, step i + 1's scale and zero, step i + 2's or the
    unused pair)."""
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    slot = (base + i) % STAGES
    mbarrier.wait(ready.index(slot), ((base + i) // STAGES) & 1)
    codes = qw_smem.index(slot)
    rows: gl.constexpr = _code_rows(codes.shape)
    words = codes._reinterpret(gl.int32, [rows, codes.shape[-1] // 4], _words_smem_layout(codes.layout))
    if NF4 and NF4_TABLE > 0:
        w = _dequantize_nf4_shared(words.load(gl.SliceLayout(2, words3)), scale, table, words3, a_layout, DTYPE,
                                   SCALE_16, NF4_TABLE)  # fmt: skip
    elif NF4:
        w = _dequantize_nf4(words.load(gl.SliceLayout(2, words3)), scale, words3, a_layout, DTYPE, SCALE_16)
    else:
        w = _dequantize(words.load(gl.SliceLayout(2, words3)), scale, zero, words3, a_layout, DTYPE, SCALE_16)
    acc = warpgroup_mma(w, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    # Later steps' scales (and zeros) while the product runs. One step ahead, their loads'
    # latency (an L2 round trip) lands right after the wait below, on the next step's
    # dequantization; two steps ahead it has a whole step to hide under.
    g_load = ((k0 + gl.minimum(i + SCALES_AHEAD, n_k - 1)) * BLOCK_K) // GROUP
    scale_load, zero_load = _row_params(s_ptr, z_ptr, g_load, stride_sg, offs_n, mask_n, HAS_ZEROS)
    # wgmma i - 1 has retired: its stage (i - 1) % STAGES is free for step i + STAGES - 1.
    acc, w_other = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w_other))
    nxt = i + STAGES - 1
    if nxt < n_k:
        _issue(x_desc, qw_desc, x_smem, qw_smem, ready, nxt, base, k0, off_m, off_n, BLOCK_K, STAGES)
    if SCALES_AHEAD == 2:
        return acc, w, scale_next, zero_next, scale_load, zero_load
    else:
        return acc, w, scale_load, zero_load, scale_next, zero_next


@gluon.jit
def int4_linear_wgmma_kernel(
    x_desc, qw_desc, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_sg, stride_om, steps_per_split,
    GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    SCALE_16: gl.constexpr, SCALES_AHEAD: gl.constexpr = 1, SPLIT_K: gl.constexpr = 1, NF4: gl.constexpr = False,
    PERSISTENT: gl.constexpr = False, NF4_TABLE: gl.constexpr = 0,
):  # fmt: skip
    """out (M, N) = x (M, K) @ W^T (+ bias). x_desc: (M, K) blocks (BLOCK_M, BLOCK_K); qw_desc:
    codes (N, K // 2) blocks (BLOCK_N, BLOCK_K // 2), or tiled codes (format.tile_codes) viewed
    as (N // 16, K // 128, 16, 64) in blocks (BLOCK_N // 16, 1, 16, BLOCK_K // 2), BLOCK_K <= 128. K % BLOCK_K == 0 and BLOCK_K divides
    GROUP (the launcher checks). Launched with num_warps = BLOCK_N // 16 (4 or 8). Grid:
    cdiv(N, BLOCK_N) * SPLIT_K * cdiv(M, BLOCK_M), the M tiles of one weight tile and split
    consecutive. SPLIT_K > 1: split s takes K steps [s * steps_per_split, + steps_per_split)
    and finishes as the Triton kernels' split-K does (`_finish_split`): ws_ptr (SPLIT_K, M, N)
    float32 partials, counter_ptr int32 per (weight tile, x band), zeros, left at zero.
    PERSISTENT (SPLIT_K 1): any grid; program p takes tiles p, p + grid, ... in the order above,
    and the TMA of a tile's first STAGES - 1 steps is issued before the previous tile's
    epilogue, so that the loads run under it."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = _code_rows(qw_desc.block_type.shape)
    WARPS: gl.constexpr = BLOCK_N // 16
    gl.static_assert(qw_desc.block_type.shape[-1] * 2 == BLOCK_K)
    gl.static_assert(STAGES >= 2)
    gl.static_assert(GROUP % BLOCK_K == 0)
    gl.static_assert(SCALES_AHEAD == 1 or SCALES_AHEAD == 2)
    gl.static_assert(not (NF4 and HAS_ZEROS))  # NF4: W = level * scale
    gl.static_assert(not (PERSISTENT and SPLIT_K > 1))

    mma_layout: gl.constexpr = acc_layout(WARPS, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    codes_layout: gl.constexpr = _halve_columns(
        gl.to_linear_layout(a_layout, [BLOCK_N, BLOCK_K]), [BLOCK_N, BLOCK_K]
    )
    words3: gl.constexpr = _words_layout(codes_layout)
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, words3))

    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)  # noqa: RUF005
    qw_smem = gl.allocate_shared_memory(qw_desc.dtype, [STAGES] + qw_desc.block_type.shape, qw_desc.layout)  # noqa: RUF005
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)

    tiles_m = gl.cdiv(M, BLOCK_M)
    pid = gl.program_id(0)
    if PERSISTENT:
        n_k = K // BLOCK_K
        tiles = tiles_m * gl.cdiv(N, BLOCK_N)
        grid = gl.num_programs(0)
        off_m = (pid % tiles_m) * BLOCK_M
        off_n = (pid // tiles_m) * BLOCK_N
        for j in gl.static_range(STAGES - 1):
            if j < n_k:
                _issue(x_desc, qw_desc, x_smem, qw_smem, ready, j, 0, 0, off_m, off_n, BLOCK_K, STAGES)
        base = 0
        for tile in range(pid, tiles, grid):
            off_m = (tile % tiles_m) * BLOCK_M
            off_n = (tile // tiles_m) * BLOCK_N
            acc = _tile_product(x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr, z_ptr, stride_sg, N, n_k, base, 0,
                                off_m, off_n, mma_layout, a_layout, words3, rows_layout, GROUP, STAGES, HAS_ZEROS,
                                SCALE_16, SCALES_AHEAD, NF4, NF4_TABLE)  # fmt: skip
            base += n_k
            # Every stage is free (the last steps' loads were waited for): the next tile's
            # first loads go out now and run under this tile's epilogue.
            nxt = tile + grid
            if nxt < tiles:
                for j in gl.static_range(STAGES - 1):
                    if j < n_k:
                        _issue(x_desc, qw_desc, x_smem, qw_smem, ready, j, base, 0, (nxt % tiles_m) * BLOCK_M,
                               (nxt // tiles_m) * BLOCK_N, BLOCK_K, STAGES)  # fmt: skip
            _store(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, stride_om, off_m, off_n, 0, 0, mma_layout,
                   HAS_BIAS, 1)  # fmt: skip
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(j))
    else:
        tile_m = pid % tiles_m
        split = (pid // tiles_m) % SPLIT_K
        tile_n = pid // (tiles_m * SPLIT_K)
        off_n = tile_n * BLOCK_N
        off_m = tile_m * BLOCK_M
        if SPLIT_K == 1:
            k0 = 0
            n_k = K // BLOCK_K
        else:
            k0 = split * steps_per_split
            n_k = gl.minimum(steps_per_split, K // BLOCK_K - k0)
        for j in gl.static_range(STAGES - 1):
            if j < n_k:
                _issue(x_desc, qw_desc, x_smem, qw_smem, ready, j, 0, k0, off_m, off_n, BLOCK_K, STAGES)
        acc = _tile_product(x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr, z_ptr, stride_sg, N, n_k, 0, k0, off_m,
                            off_n, mma_layout, a_layout, words3, rows_layout, GROUP, STAGES, HAS_ZEROS, SCALE_16,
                            SCALES_AHEAD, NF4, NF4_TABLE)  # fmt: skip
        for j in gl.static_range(STAGES):  # the ring is dead: the epilogue's conversion may reuse it
            mbarrier.invalidate(ready.index(j))
        _store(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, stride_om, off_m, off_n,
               tile_n * tiles_m + tile_m, split, mma_layout, HAS_BIAS, SPLIT_K)  # fmt: skip


@gluon.jit
def _tile_product(x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr, z_ptr, stride_sg, N, n_k, base, k0, off_m, off_n,
                  mma_layout: gl.constexpr, a_layout: gl.constexpr, words3: gl.constexpr, rows_layout: gl.constexpr,
                  GROUP: gl.constexpr, STAGES: gl.constexpr, HAS_ZEROS: gl.constexpr, SCALE_16: gl.constexpr,
                  SCALES_AHEAD: gl.constexpr, NF4: gl.constexpr, NF4_TABLE: gl.constexpr = 0):  # fmt: skip
    """acc^T (BLOCK_N, BLOCK_M) float32 of one tile over its n_k K steps from k0, whose first
    STAGES - 1 loads the caller issued; every wgmma retired and every load consumed on return."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = _code_rows(qw_desc.block_type.shape)
    DTYPE: gl.constexpr = x_desc.dtype
    offs_n = off_n + gl.arange(0, BLOCK_N, rows_layout)
    mask_n = offs_n < N
    scale, zero = _row_params(s_ptr, z_ptr, (k0 * BLOCK_K) // GROUP, stride_sg, offs_n, mask_n, HAS_ZEROS)
    g1 = ((k0 + gl.minimum(1, n_k - 1)) * BLOCK_K) // GROUP
    scale_next, zero_next = _row_params(s_ptr, z_ptr, g1, stride_sg, offs_n, mask_n, HAS_ZEROS)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
    if NF4 and NF4_TABLE > 0:
        table = nf4_shared_table(
            DTYPE, NF4_TABLE, _table_layout(256 if NF4_TABLE == 1 else 16, BLOCK_N // 16)
        )
    else:
        table = 0
    # Two steps per trip, each with its own A-operand registers: the wgmma of one step is in
    # flight while the other step's weight is dequantized, and a step's registers are
    # written again only after the wait that retired the wgmma reading them (PTX: modifying
    # A's registers before that wait is undefined). Each wait names the other step's operand
    # as a dependence, which keeps it live (in its own registers) up to that wait.
    w_odd = gl.zeros([BLOCK_N, BLOCK_K], DTYPE, a_layout)
    for i in range(0, n_k - 1, 2):
        acc, w_even, scale, zero, scale_next, zero_next = _step(
            i, acc, w_odd, scale, zero, scale_next, zero_next, x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr,
            z_ptr, offs_n, mask_n, stride_sg, n_k, base, k0, off_m, off_n, words3, a_layout, DTYPE, GROUP, STAGES,
            HAS_ZEROS, SCALE_16, SCALES_AHEAD, NF4, table, NF4_TABLE,
        )  # fmt: skip
        acc, w_odd, scale, zero, scale_next, zero_next = _step(
            i + 1, acc, w_even, scale, zero, scale_next, zero_next, x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr,
            z_ptr, offs_n, mask_n, stride_sg, n_k, base, k0, off_m, off_n, words3, a_layout, DTYPE, GROUP, STAGES,
            HAS_ZEROS, SCALE_16, SCALES_AHEAD, NF4, table, NF4_TABLE,
        )  # fmt: skip
    if n_k % 2 == 1:
        acc, w_even, scale, zero, scale_next, zero_next = _step(
            n_k - 1, acc, w_odd, scale, zero, scale_next, zero_next, x_desc, qw_desc, x_smem, qw_smem, ready, s_ptr,
            z_ptr, offs_n, mask_n, stride_sg, n_k, base, k0, off_m, off_n, words3, a_layout, DTYPE, GROUP, STAGES,
            HAS_ZEROS, SCALE_16, SCALES_AHEAD, NF4, table, NF4_TABLE,
        )  # fmt: skip
        w_odd = w_even
    acc, w_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_odd))
    return acc


@gluon.jit
def _store(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, stride_om, off_m, off_n, tile, split,
           mma_layout: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr):  # fmt: skip
    """The tile's epilogue: bias added in float32, rounded once, stored transposed; or the
    split-K finish."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    WARPS: gl.constexpr = BLOCK_N // 16
    out_layout: gl.constexpr = _store_layout(BLOCK_N, BLOCK_M, WARPS)
    rows = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, out_layout))
    cols = off_m + gl.arange(0, BLOCK_M, gl.SliceLayout(0, out_layout))
    ptrs = out_ptr + cols.to(gl.int64)[None, :] * stride_om + rows[:, None]
    mask = (rows[:, None] < N) & (cols[None, :] < M)
    if SPLIT_K == 1:
        if HAS_BIAS:
            offs_b = off_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, mma_layout))
            acc = acc + gl.load(bias_ptr + offs_b, mask=offs_b < N, other=0.0).to(gl.float32)[:, None]
        y = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), out_layout)
        gl.store(ptrs, y, mask=mask)
    else:
        _finish_split(gl.convert_layout(acc, out_layout), bias_ptr, ws_ptr, counter_ptr, ptrs, mask, rows, cols,
                      tile, split, M, N, HAS_BIAS, SPLIT_K)  # fmt: skip


@gluon.jit
def _finish_split(partial, bias_ptr, ws_ptr, counter_ptr, ptrs, mask, rows, cols, tile, split, M, N,
                  HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr):  # fmt: skip
    """Split-K epilogue (the Triton kernels' protocol, triton/kernels.py): this split's float32
    partial into ws (SPLIT_K, M, N); every thread's stores before one acq_rel count of the
    tile's arrivals; the split that arrives last adds the partials in split order after the
    bias (the same bits whichever split is last), rounds once, stores, and resets the counter
    for the next call (CUDA-graph replays included)."""
    offs = cols.to(gl.int64)[None, :] * N + rows[:, None]
    gl.store(ws_ptr + (split * M).to(gl.int64) * N + offs, partial, mask=mask)
    gl.thread_barrier()  # every thread's partial before the release below
    arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        gl.thread_barrier()
        if HAS_BIAS:
            total = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[
                :, None
            ] + gl.zeros_like(partial)
        else:
            total = gl.zeros_like(partial)
        for s in gl.static_range(SPLIT_K):
            total += gl.load(
                ws_ptr + (s * M).to(gl.int64) * N + offs, mask=mask, other=0.0, cache_modifier=".cg"
            )
        gl.store(ptrs, total.to(ptrs.dtype.element_ty), mask=mask)
        gl.atomic_xchg(counter_ptr + tile, 0)
