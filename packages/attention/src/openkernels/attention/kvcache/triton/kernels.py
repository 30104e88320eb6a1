"""Triton kernels of attention against a KV cache (decode and chunked prefill).

Cache formats (16-bit, int8, int4 with float16 per-group scale and zero, fp8 e4m3 with a
float32 scale per head) are in ../format.py; the kernels take fp8 data as its bytes (uint8);
the semantics (append positions, bottom-right alignment, rotary) in ../reference.py.

- `_kvcache_append_fwd_kernel`: rotary on the new keys, quantization (per token, head and
  group) and the write into contiguous or paged storage, K and V in one launch.
- `_attention_kvcache_fwd_kernel`: split-KV (flash-decoding) attention. One program takes
  BLOCK_M rows of one (sequence, KV head): the query heads of a GQA group are packed along
  the rows (row r is query r // group of head hk * group + r % group), so K and V tiles are
  read once per group and a decode step (one query) still fills a matrix-unit tile. The key
  axis is cut into splits so that one long sequence spreads over the GPU; each split writes
  a float32 partial output and lse, merged by `_attention_kvcache_combine_kernel` (with one
  split the kernel writes the final output directly). Quantized tiles are dequantized in
  registers right after their load (K and V never exist in 16-bit memory); with one scale
  per token the scales act on the scores and on P instead (see _kv_blocks). int4 keeps the
  two nibbles of each byte apart (even and odd elements of head_dim) and takes two
  half-width dot products instead of interleaving them in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.triton.kernels import _load_rows, _log2_scores, _segments, _softmax_step

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_rotated(row_ptrs, row_mask, offs, pos, cos_ptr, sin_ptr, stride_ro, rot_half,
                  HEAD_DIM: tl.constexpr, HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Elements `offs` of rows `row_ptrs` as float32 (len(rows), len(offs)), with the rotary
    embedding at positions `pos` applied to the first 2 * rot_half elements."""
    mask = row_mask[:, None] & (offs[None, :] < HEAD_DIM)
    x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ROTARY:
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            partner = offs ^ 1
            freq = offs // 2
            sign = tl.where(offs % 2 == 0, -1.0, 1.0)
        else:  # halves (j, j + rot_half)
            first = offs < rot_half
            partner = tl.where(first, offs + rot_half, offs - rot_half)
            freq = tl.where(first, offs, offs - rot_half)
            sign = tl.where(first, -1.0, 1.0)
        rot = mask & (offs[None, :] < 2 * rot_half)
        xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        trig = pos[:, None].to(tl.int64) * stride_ro + freq[None, :]
        c = tl.load(cos_ptr + trig, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + trig, mask=rot, other=0.0).to(tl.float32)
        x = tl.where(rot, x * c + sign[None, :] * xp * s, x)
    return x


@triton.jit
def _load_rotated_tokens(row_ptrs, row_mask, offs, tok, trig_base, cos_ptr, sin_ptr, stride_ct, rot_half,
                         HEAD_DIM: tl.constexpr, ROT_TOKENS: tl.constexpr):  # fmt: skip
    """`_load_rotated` with per-token tables (ROT_TOKENS): row `tok` of the (tokens, 2 rot_half)
    cos / sin at `trig_base`, each element with its own column (apply_rotary's rule, as
    transformers' position embeddings give them: halves c1, c2 and s1, s2 need not be equal):
    out[:h] = x1 c1 - x2 s1, out[h:2h] = x2 c2 + x1 s2."""
    mask = row_mask[:, None] & (offs[None, :] < HEAD_DIM)
    x = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROT_TOKENS:
        first = offs < rot_half
        partner = tl.where(first, offs + rot_half, offs - rot_half)
        sign = tl.where(first, -1.0, 1.0)
        rot = mask & (offs[None, :] < 2 * rot_half)
        xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        trig = trig_base + tok[:, None].to(tl.int64) * stride_ct + offs[None, :]
        c = tl.load(cos_ptr + trig, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + trig, mask=rot, other=0.0).to(tl.float32)
        x = tl.where(rot, x * c + sign[None, :] * xp * s, x)
    return x


@triton.jit
def _append_in_split(
    kn_ptr, vn_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, block_table_ptr, b, hk, filled, slot0, lo, hi, seqlen_new,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_bt, stride_cb, stride_ct, rot_half, offs_d,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, ROW_TABLE: tl.constexpr, ROT_TOKENS: tl.constexpr,
):  # fmt: skip
    """The fused append (FUSED_APPEND): the new tokens whose keys lie in this program's split
    [lo, hi) (keys counted from the sequence's first token) written into the 16-bit contiguous
    cache, keys rotated with the per-token tables; then a CTA barrier, so the program's own
    loads of those rows see them. No other program reads them (the splits part the keys), and
    the plan runs one program per (sequence, KV head, split) (one block of query rows)."""
    if ROW_TABLE:
        page = tl.load(block_table_ptr + b * stride_bt).to(tl.int64)
    else:
        page = b.to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)  # a small tile: its registers are live beside q's
    first_key = filled - slot0  # the first new token's key index
    mask_d = offs_d[None, :] < HEAD_DIM
    for t0 in range(0, seqlen_new, BLOCK_T):
        t = t0 + offs_t
        key = first_key + t
        valid = (t < seqlen_new) & (key >= lo) & (key < hi)
        kn_rows = kn_ptr + b.to(tl.int64) * stride_knb + t.to(tl.int64) * stride_kns + hk * stride_knh
        vn_rows = vn_ptr + b.to(tl.int64) * stride_vnb + t.to(tl.int64) * stride_vns + hk * stride_vnh
        k = _load_rotated_tokens(kn_rows, valid, offs_d, t, b.to(tl.int64) * stride_cb, cos_ptr, sin_ptr, stride_ct,
                                 rot_half, HEAD_DIM, ROT_TOKENS)  # fmt: skip
        v = tl.load(vn_rows[:, None] + offs_d[None, :], mask=valid[:, None] & mask_d, other=0.0)
        slot = (filled + t).to(tl.int64)
        k_rows = k_ptr + page * stride_kb + slot * stride_ks + hk * stride_kh
        v_rows = v_ptr + page * stride_vb + slot * stride_vs + hk * stride_vh
        tl.store(
            k_rows[:, None] + offs_d[None, :], k.to(k_ptr.dtype.element_ty), mask=valid[:, None] & mask_d
        )
        tl.store(
            v_rows[:, None] + offs_d[None, :], v.to(v_ptr.dtype.element_ty), mask=valid[:, None] & mask_d
        )
    tl.debug_barrier()


@triton.jit
def _kvcache_append_fwd_kernel(
    k_new_ptr, v_new_ptr, k_ptr, v_ptr, k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,
    seqlens_ptr, block_table_ptr, cos_ptr, sin_ptr, leftpad_ptr,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
    stride_bt, stride_ro, seqlen_new, heads_kv, rot_half,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr = False, ROW_TABLE: tl.constexpr = False, FP8: tl.constexpr = False,
    SKIP_KEYS: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_T new tokens of one (sequence, KV head), K and V, written from slot
    seqlens[b] of the sequence's storage on. Positions count from the sequence's first token
    (rotary); with HAS_LEFTPAD that token sits at slot min(leftpad[b], seqlens[b]). ROW_TABLE
    (PAGE_SIZE 0): sequence b's storage is row block_table[b, 0] of the contiguous cache.
    SKIP_KEYS: values only (keys by channel are written by
    _kvcache_append_keys_by_channel_kernel)."""
    bh = tl.program_id(1)
    b = bh // heads_kv
    h = bh % heads_kv
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < seqlen_new
    filled = tl.load(seqlens_ptr + b)  # storage slots (the padding included)
    at = filled + t
    pos = at
    if HAS_LEFTPAD:  # clamped and subtracted here: no per-call launches for it before the kernel
        pos -= tl.minimum(tl.load(leftpad_ptr + b), filled)
    if PAGE_SIZE > 0:
        page = tl.load(block_table_ptr + b * stride_bt + at // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        slot = at % PAGE_SIZE
    elif ROW_TABLE:
        page = tl.load(block_table_ptr + b * stride_bt).to(tl.int64)
        slot = at
    else:
        page = b.to(tl.int64)
        slot = at
    offs = tl.arange(0, BLOCK_D)
    if not SKIP_KEYS:
        k = _load_rotated(k_new_ptr + b.to(tl.int64) * stride_knb + t.to(tl.int64) * stride_kns + h * stride_knh,
                          valid, offs, pos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM, HAS_ROTARY,
                          INTERLEAVED)  # fmt: skip
    v = _load_rotated(v_new_ptr + b.to(tl.int64) * stride_vnb + t.to(tl.int64) * stride_vns + h * stride_vnh,
                      valid, offs, pos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM, False, INTERLEAVED)  # fmt: skip
    k_rows = k_ptr + page * stride_kb + slot * stride_ks + h * stride_kh
    v_rows = v_ptr + page * stride_vb + slot * stride_vs + h * stride_vh
    s_rows = page * stride_sb + slot * stride_ss + h * stride_sh
    if BITS == 16:
        mask = valid[:, None] & (offs[None, :] < HEAD_DIM)
        tl.store(k_rows[:, None] + offs[None, :], k.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(v_rows[:, None] + offs[None, :], v.to(v_ptr.dtype.element_ty), mask=mask)
    elif FP8:  # the head's fixed scale; x / scale as format.quantize_fp8 divides
        mask = valid[:, None] & (offs[None, :] < HEAD_DIM)
        k_s = tl.load(k_scale_ptr + h * stride_sh)
        v_s = tl.load(v_scale_ptr + h * stride_sh)
        tl.store(k_rows[:, None] + offs[None, :], _fp8_encode(tl.math.div_rn(k, k_s)), mask=mask)
        tl.store(v_rows[:, None] + offs[None, :], _fp8_encode(tl.math.div_rn(v, v_s)), mask=mask)
    else:
        if not SKIP_KEYS:
            _quantize_store(k, k_rows, k_scale_ptr + s_rows, k_zero_ptr + s_rows, valid, offs, HEAD_DIM, BLOCK_D,
                            BLOCK_T, BITS, GROUP)  # fmt: skip
        _quantize_store(v, v_rows, v_scale_ptr + s_rows, v_zero_ptr + s_rows, valid, offs, HEAD_DIM, BLOCK_D,
                        BLOCK_T, BITS, GROUP)  # fmt: skip


@triton.jit
def _scale_zero(lo, hi, LEVELS: tl.constexpr):
    """float16 scale and zero of a range lo..hi over 2^bits - 1 levels (format.py's
    expressions), and the float32 reciprocal of the scale (0 where the scale is 0)."""
    scale = tl.math.div_rn(hi - lo, LEVELS * 1.0).to(tl.float16)
    s32 = scale.to(tl.float32)
    inv = tl.where(s32 > 0, tl.math.div_rn(1.0, tl.where(s32 > 0, s32, 1.0)), 0.0)
    return scale, lo.to(tl.float16), inv


@triton.jit
def _kvcache_append_keys_by_channel_kernel(
    k_new_ptr, k_ptr, k_scale_ptr, k_zero_ptr, res_ptr, seqlens_ptr, block_table_ptr, cos_ptr, sin_ptr,
    stride_knb, stride_kns, stride_knh, stride_kb, stride_ks, stride_kh, stride_gb, stride_gg, stride_gh,
    stride_rb, stride_rs, stride_rh, stride_bt, stride_ro, seqlen_new, heads_kv, rot_half,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KEY_GROUP: tl.constexpr, BITS: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Keys by channel (format.py): one program per (group of KEY_GROUP positions the append
    touches, sequence and KV head). The group's keys, earlier ones from the residual and new
    ones rotated and rounded to float16, are quantized per channel when the append fills the
    group (codes to their slots, scale and zero to the group's row); else the new keys go to
    the residual rows. PAGE_SIZE is a multiple of KEY_GROUP: a group sits in one page."""
    bh = tl.program_id(1)
    b = bh // heads_kv
    h = bh % heads_kv
    length = tl.load(seqlens_ptr + b)  # before the append
    end = length + seqlen_new
    first = (length // KEY_GROUP + tl.program_id(0)) * KEY_GROUP
    r = tl.arange(0, KEY_GROUP)
    pos = first + r
    old = pos < length
    new = (pos >= length) & (pos < end)
    offs = tl.arange(0, BLOCK_D)
    in_dim = offs[None, :] < HEAD_DIM
    t = tl.where(new, pos - length, 0)
    k_rows = k_new_ptr + b.to(tl.int64) * stride_knb + t.to(tl.int64) * stride_kns + h * stride_knh
    x = _load_rotated(k_rows, new, offs, pos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM, HAS_ROTARY,
                      INTERLEAVED).to(tl.float16)  # fmt: skip
    res_rows = res_ptr + b.to(tl.int64) * stride_rb + r * stride_rs + h * stride_rh
    earlier = tl.load(res_rows[:, None] + offs[None, :], mask=old[:, None] & in_dim, other=0.0)
    x = tl.where(old[:, None], earlier, x)
    if first + KEY_GROUP <= end:  # the group fills: quantize it per channel over its tokens
        LEVELS: tl.constexpr = (1 << BITS) - 1
        xf = x.to(tl.float32)
        lo = tl.min(xf, 0)
        hi = tl.max(xf, 0)
        scale, zero, inv = _scale_zero(lo, hi, LEVELS)
        codes = tl.floor((xf - zero.to(tl.float32)[None, :]) * inv[None, :] + 0.5)
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.uint8)
        if PAGE_SIZE > 0:
            page = tl.load(block_table_ptr + b * stride_bt + first // PAGE_SIZE).to(tl.int64)
            slot0 = first % PAGE_SIZE
        else:
            page = b.to(tl.int64)
            slot0 = first
        g_row = page * stride_gb + (slot0 // KEY_GROUP) * stride_gg + h * stride_gh + offs
        tl.store(k_scale_ptr + g_row, scale, mask=offs < HEAD_DIM)
        tl.store(k_zero_ptr + g_row, zero, mask=offs < HEAD_DIM)
        data_rows = k_ptr + page * stride_kb + (slot0 + r) * stride_ks + h * stride_kh
        if BITS == 8:
            tl.store(data_rows[:, None] + offs[None, :], codes, mask=in_dim)
        else:
            lo4, hi4 = tl.split(tl.reshape(codes, (KEY_GROUP, BLOCK_D // 2, 2)))
            half = tl.arange(0, BLOCK_D // 2)
            tl.store(data_rows[:, None] + half[None, :], lo4 | (hi4 << 4), mask=half[None, :] < HEAD_DIM // 2)
    else:  # still incomplete: the new keys wait in the residual
        tl.store(res_rows[:, None] + offs[None, :], x, mask=new[:, None] & in_dim)


@triton.jit
def _quantize_store(x, data_rows, scale_rows, zero_rows, valid, offs, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """Quantize float32 rows x (BLOCK_T, BLOCK_D) per group (format.py's expressions) and
    store codes, scales and zeros."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    in_dim = offs[None, :] < HEAD_DIM
    if GROUP == HEAD_DIM:  # one group per row (any head_dim): plain row reductions
        lo = tl.min(tl.where(in_dim, x, float("inf")), 1)
        hi = tl.max(tl.where(in_dim, x, float("-inf")), 1)
        scale, zero, inv = _scale_zero(lo, hi, LEVELS)
        codes = tl.floor((x - zero.to(tl.float32)[:, None]) * inv[:, None] + 0.5)
        tl.store(scale_rows, scale, mask=valid)
        tl.store(zero_rows, zero, mask=valid)
    else:  # GROUP a power of two: groups are a reshape (the head_dim pad forms whole groups)
        NG: tl.constexpr = BLOCK_D // GROUP
        xg = tl.reshape(x, (BLOCK_T, NG, GROUP))
        lo = tl.min(xg, 2)
        hi = tl.max(xg, 2)
        scale, zero, inv = _scale_zero(lo, hi, LEVELS)
        codes = tl.floor((xg - zero.to(tl.float32)[:, :, None]) * inv[:, :, None] + 0.5)
        codes = tl.reshape(codes, (BLOCK_T, BLOCK_D))
        groups = tl.arange(0, NG)
        g_mask = valid[:, None] & (groups[None, :] < HEAD_DIM // GROUP)
        tl.store(scale_rows[:, None] + groups[None, :], scale, mask=g_mask)
        tl.store(zero_rows[:, None] + groups[None, :], zero, mask=g_mask)
    codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0).to(tl.uint8)
    if BITS == 8:
        tl.store(data_rows[:, None] + offs[None, :], codes, mask=valid[:, None] & in_dim)
    else:
        lo4, hi4 = tl.split(tl.reshape(codes, (BLOCK_T, BLOCK_D // 2, 2)))
        half = tl.arange(0, BLOCK_D // 2)
        tl.store(data_rows[:, None] + half[None, :], lo4 | (hi4 << 4),
                 mask=valid[:, None] & (half[None, :] < HEAD_DIM // 2))  # fmt: skip


@triton.jit
def _fp8_encode(y):
    """float32 -> float8_e4m3fn bytes (uint8), rounded to nearest even and saturated at +-448
    as torch's conversion of format.quantize_fp8 does, in integer operations (sm_80 and
    AMD's fnuz chips have no e4m3fn convert). Normal results round float32's mantissa to 3
    bits in place, the carry running into the exponent; below 2^-6 the result is a multiple
    of 2^-9 (a subnormal, or 2^-6 itself)."""
    a = tl.minimum(tl.abs(y), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # exponent bias 127 -> 7
    t = a * 512.0
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)  # ties to even
    code = tl.where(a < 0.015625, r.to(tl.int32), normal)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _fp8_to_f16(raw, NATIVE: tl.constexpr):
    """float8_e4m3fn bytes (uint8) -> float16. NATIVE (sm_89+): the hardware convert, exact.
    Else two masks and shifts put the byte's exponent and mantissa under float16's, whose
    exponent bias is 8 larger: the value times 2^-8, exact, subnormals included (the callers
    fold 2^8 into the scales), NaN (0x7f / 0xff) kept NaN."""
    if NATIVE:
        f = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        c = raw.to(tl.uint16)
        h = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        h = tl.where((c & 0x7F) == 0x7F, h | 0x7E00, h)
        f = h.to(tl.float16, bitcast=True)
    return f


@triton.jit
def _to_f16_range(x):
    """Clamp to float16's finite range: a q * softmax_scale past 65504 (a hard argmax either
    way) would turn into inf and then NaN in the scores."""
    return tl.clamp(x, -65504.0, 65504.0)


@triton.jit
def _u8_magic(codes):
    """uint8 codes -> fp16 1024 + code, by placing each byte under fp16 1024's exponent
    (0x64xx): two byte permutes per four codes instead of int-to-float conversions, which
    bounded the decode kernel at about 1.7 T codes/s on H200 (slower than reading them)."""
    return tl.inline_asm_elementwise(
        asm="prmt.b32 $0, $2, 0x64646464, 0x4140;\n\tprmt.b32 $1, $2, 0x64646464, 0x4342;",
        constraints="=r,=r,r", args=[codes], dtype=tl.float16, is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _u4x2_magic(packed):
    """uint8 bytes -> (fp16 1024 + low nibble, fp16 1024 + high nibble): bytes reordered
    (b0 b2 b1 b3) so that a mask-and-or (lop3) on each shift lands two nibbles of
    neighbouring bytes in one fp16 pair."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, s;
        prmt.b32 t, $4, 0, 0x3120;
        lop3.b32 $0, t, 0x000f000f, 0x64006400, 0xea;
        shr.b32 s, t, 8;
        lop3.b32 $1, s, 0x000f000f, 0x64006400, 0xea;
        shr.b32 s, t, 4;
        lop3.b32 $2, s, 0x000f000f, 0x64006400, 0xea;
        shr.b32 s, t, 12;
        lop3.b32 $3, s, 0x000f000f, 0x64006400, 0xea;
        }""",
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _scale_tiles(scale_rows, zero_rows, mask_n, elems, MASK: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GATHER: tl.constexpr):  # fmt: skip
    """float16 scale and zero for a tile whose columns are head_dim elements `elems`: (BLOCK_N,
    1) with one group per head; else (BLOCK_N, len(elems)) gathered per column (GATHER), or
    (BLOCK_N, groups, 1) for a reshape of the tile to (BLOCK_N, groups, columns per group)."""
    if GROUP == HEAD_DIM:
        if MASK:
            sc = tl.load(scale_rows, mask=mask_n, other=0.0)
            zr = tl.load(zero_rows, mask=mask_n, other=0.0)
        else:
            sc = tl.load(scale_rows)
            zr = tl.load(zero_rows)
        sc, zr = sc[:, None], zr[:, None]
    elif GATHER:  # every column of a group reads the same (L1-cached) scale
        g = (elems // GROUP)[None, :]
        sc = tl.load(scale_rows[:, None] + g, mask=mask_n[:, None], other=0.0)
        zr = tl.load(zero_rows[:, None] + g, mask=mask_n[:, None], other=0.0)
    else:
        groups = tl.arange(0, BLOCK_D // GROUP)
        m = mask_n[:, None] & (groups[None, :] < HEAD_DIM // GROUP)
        sc = tl.load(scale_rows[:, None] + groups[None, :], mask=m, other=0.0)[:, :, None]
        zr = tl.load(zero_rows[:, None] + groups[None, :], mask=m, other=0.0)[:, :, None]
    return sc, zr


@triton.jit
def _apply_scale(x, sc, zr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GATHER: tl.constexpr):
    """x (BLOCK_N, W) * scale + zero, with scale/zero from _scale_tiles."""
    if GROUP == HEAD_DIM or GATHER:
        y = x * sc + zr
    else:
        n: tl.constexpr = x.shape[0]
        w: tl.constexpr = x.shape[1]
        ng: tl.constexpr = sc.shape[1]
        y = tl.reshape(tl.reshape(x, (n, ng, w // ng)) * sc + zr, (n, w))
    return y


@triton.jit
def _load_codes(rows, cols, mask_n, MASK: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Tile (BLOCK_N, BLOCK_W) of a cache side's data, zeros past the sequence and WIDTH."""
    return _load_rows(rows[:, None] + cols[None, :], mask_n[:, None], cols, MASK, WIDTH, BLOCK_W)


@triton.jit
def _raw_tile(data_ptr, scale_ptr, zero_ptr, rows, s_rows, mask_n, offs_d, offs_h, MASK: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
              SCALE_GATHER: tl.constexpr):  # fmt: skip
    """The loads of one K or V tile: (data, scale, zero); 16-bit tiles have no scale (the data
    is returned in their place)."""
    if BITS == 16:
        codes = _load_codes(data_ptr + rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D)
        sc, zr = codes, codes
    elif BITS == 8:
        codes = _load_codes(data_ptr + rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D)
        sc, zr = _scale_tiles(scale_ptr + s_rows, zero_ptr + s_rows, mask_n, offs_d, MASK, GROUP, HEAD_DIM,
                              BLOCK_D, SCALE_GATHER)  # fmt: skip
    else:
        codes = _load_codes(data_ptr + rows, offs_h, mask_n, MASK, HEAD_DIM // 2, BLOCK_D // 2)
        sc, zr = _scale_tiles(scale_ptr + s_rows, zero_ptr + s_rows, mask_n, offs_h * 2, MASK, GROUP, HEAD_DIM,
                              BLOCK_D, SCALE_GATHER)  # fmt: skip
    return codes, sc, zr


@triton.jit
def _code_tiles(codes, BITS: tl.constexpr, FAST_DEQUANT: tl.constexpr):
    """Codes as float16 tiles, exact: 1024 + code from the bit trick (FAST_DEQUANT) or the
    code by an int-to-float cast; (codes,) for int8, (low nibbles, high nibbles) for int4 (the
    second is the first for int8)."""
    if BITS == 8:
        if FAST_DEQUANT:
            t0 = _u8_magic(codes)
        else:
            t0 = codes.to(tl.float16)
        t1 = t0
    else:
        if FAST_DEQUANT:
            t0, t1 = _u4x2_magic(codes)
        else:
            t0, t1 = (codes & 15).to(tl.float16), (codes >> 4).to(tl.float16)
    return t0, t1


@triton.jit
def _centred_codes(codes, BITS: tl.constexpr, FAST_DEQUANT: tl.constexpr):
    """_code_tiles centred on the format's middle code (code - 2^(BITS-1), exact in float16),
    by one packed subtract."""
    MID: tl.constexpr = 1 << (BITS - 1)
    if FAST_DEQUANT:
        shift = tl.full((1, 1), 1024.0 + MID, tl.float16)
    else:
        shift = tl.full((1, 1), MID * 1.0, tl.float16)
    t0, t1 = _code_tiles(codes, BITS, FAST_DEQUANT)
    t0 = t0 - shift
    if BITS == 4:
        t1 = t1 - shift
    else:
        t1 = t0
    return t0, t1


@triton.jit
def _dequant_tile(codes, sc, zr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  FAST_DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr):  # fmt: skip
    """A loaded tile as the dot takes it: 16-bit data as is, codes as (code * scale + zero) in
    float16 from 1024 + code built with bit operations (FAST_DEQUANT, NVIDIA) or an
    int-to-float cast; int4 gives the even and odd elements of head_dim as two
    (BLOCK_N, BLOCK_D // 2) tiles (the second is the first otherwise)."""
    if BITS == 16:
        t0 = codes
        t1 = codes
    else:
        c1024 = tl.full((1, 1), 1024.0, tl.float16)
        if BITS == 8:
            if FAST_DEQUANT:
                x = _u8_magic(codes) - c1024
            else:
                x = codes.to(tl.float16)
            t0 = _apply_scale(x, sc, zr, GROUP, HEAD_DIM, SCALE_GATHER)
            t1 = t0
        else:
            if FAST_DEQUANT:
                lo, hi = _u4x2_magic(codes)
                lo, hi = lo - c1024, hi - c1024
            else:
                lo, hi = (codes & 15).to(tl.float16), (codes >> 4).to(tl.float16)
            t0 = _apply_scale(lo, sc, zr, GROUP, HEAD_DIM, SCALE_GATHER)
            t1 = _apply_scale(hi, sc, zr, GROUP, HEAD_DIM, SCALE_GATHER)
    return t0, t1


@triton.jit
def _block_rows(block_table_ptr, stride_bt, b, start_n, offs_n, limit, slot0, PAGE_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                ROW_TABLE: tl.constexpr):  # fmt: skip
    """(page, slot, mask) of keys start_n + offs_n: the page (int64; the sequence's row for a
    contiguous cache: b, or block_table[b, 0] with ROW_TABLE), the row within it, and which
    keys are below `limit`. With HAS_LEFTPAD key j sits at position slot0 + j of the
    sequence's storage (its left padding skipped)."""
    mask_n = start_n + offs_n < limit
    if HAS_LEFTPAD:
        start_n += slot0
    cols = start_n + offs_n
    if PAGE_SIZE > 0:  # a constant page size: the division is a multiply-shift
        row = block_table_ptr + b.to(tl.int64) * stride_bt
        if PAGE_SIZE % BLOCK_N == 0 and not HAS_LEFTPAD:  # the block sits in one page: one table entry
            if MASK:
                page = tl.load(row + start_n // PAGE_SIZE, mask=start_n < limit, other=0)
            else:
                page = tl.load(row + start_n // PAGE_SIZE)
            slot = start_n % PAGE_SIZE + offs_n
        else:
            if MASK:
                page = tl.load(row + cols // PAGE_SIZE, mask=mask_n, other=0)
            else:
                page = tl.load(row + cols // PAGE_SIZE)
            slot = cols % PAGE_SIZE
        page = page.to(tl.int64)
    elif ROW_TABLE:  # one scalar load: the rows cache_batch_idx picks
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt).to(tl.int64)
        slot = cols
    else:
        page = b.to(tl.int64)
        slot = cols
    return page, slot, mask_n


@triton.jit
def _channel_scores(q0, q1, qf0, qf1, k_ptr, k_scale_ptr, k_zero_ptr, res_ptr, k_rows, page, start_n, b, hk, full_end,
                    sk, mask_n, offs_n, offs_d, offs_h, stride_gb, stride_gg, stride_gh, stride_rb, stride_rs,
                    stride_rh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    BITS: tl.constexpr, PAGE_SIZE: tl.constexpr, MASK: tl.constexpr, FAST_DEQUANT: tl.constexpr,
                    KEY_GROUP: tl.constexpr):  # fmt: skip
    """Scores (BLOCK_M, BLOCK_N) of the key block at start_n with keys by channel (BLOCK_N
    divides KEY_GROUP: a block lies in one group): a full group's from its codes and
    per-channel scale and zero (see _kv_blocks), the last, incomplete group's from the
    residual rows. int4 works on even and odd elements apart, as q0 and q1 do."""
    MID: tl.constexpr = 1 << (BITS - 1)
    if start_n < full_end:
        if BITS == 4:
            codes = _load_codes(k_ptr + k_rows, offs_h, mask_n, MASK, HEAD_DIM // 2, BLOCK_D // 2)
            cols0 = offs_h * 2
        else:
            codes = _load_codes(k_ptr + k_rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D)
            cols0 = offs_d
        if PAGE_SIZE > 0:
            g_row = page * stride_gb + (start_n % PAGE_SIZE) // KEY_GROUP * stride_gg + hk * stride_gh
        else:
            g_row = b.to(tl.int64) * stride_gb + (start_n // KEY_GROUP) * stride_gg + hk * stride_gh
        k0, k1 = _centred_codes(codes, BITS, FAST_DEQUANT)
        in0 = cols0 < HEAD_DIM
        s0 = tl.load(k_scale_ptr + g_row + cols0, mask=in0, other=0.0).to(tl.float32)
        z0 = tl.load(k_zero_ptr + g_row + cols0, mask=in0, other=0.0).to(tl.float32)
        qk = tl.dot(_to_f16_range(qf0 * s0[None, :]).to(q0.dtype), tl.trans(k0))
        const = tl.sum(qf0 * (z0 + s0 * MID)[None, :], 1)
        if BITS == 4:
            in1 = cols0 + 1 < HEAD_DIM
            s1 = tl.load(k_scale_ptr + g_row + cols0 + 1, mask=in1, other=0.0).to(tl.float32)
            z1 = tl.load(k_zero_ptr + g_row + cols0 + 1, mask=in1, other=0.0).to(tl.float32)
            qk = tl.dot(_to_f16_range(qf1 * s1[None, :]).to(q0.dtype), tl.trans(k1), qk)
            const += tl.sum(qf1 * (z1 + s1 * MID)[None, :], 1)
        qk += const[:, None]
    else:  # the residual: rows 0 .. sk - full_end - 1 hold the incomplete group's keys
        rows = (
            res_ptr + b.to(tl.int64) * stride_rb + (start_n % KEY_GROUP + offs_n) * stride_rs + hk * stride_rh
        )
        valid = offs_n < sk - start_n
        if BITS == 4:
            r0 = tl.load(rows[:, None] + (offs_h * 2)[None, :], mask=valid[:, None] & (offs_h * 2 < HEAD_DIM)[None, :],
                         other=0.0)  # fmt: skip
            r1 = tl.load(rows[:, None] + (offs_h * 2 + 1)[None, :],
                         mask=valid[:, None] & (offs_h * 2 + 1 < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
            qk = tl.dot(q0, tl.trans(r0))
            qk = tl.dot(q1, tl.trans(r1), qk)
        else:
            r0 = tl.load(
                rows[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0
            )
            qk = tl.dot(q0, tl.trans(r0))
    return qk


@triton.jit
def _token_scales(k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr, block_table_ptr, stride_bt, b, hk, start_n,
                  stop, offs_n, limit, slot0, stride_sb, stride_ss, stride_sh, PAGE_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_LEFTPAD: tl.constexpr, ROW_TABLE: tl.constexpr,
                  KEYS: tl.constexpr):  # fmt: skip
    """(BLOCK_N,) int32 K and V (scale, zero) pairs of the key block at start_n (one float16
    scale and zero per token, packed by _pack_halves), zeros past `limit` and for a block at
    or past `stop`; without KEYS (keys by channel) the K pair is zeros."""
    live = start_n < stop
    page, slot, mask_n = _block_rows(block_table_ptr, stride_bt, b, tl.where(live, start_n, 0), offs_n, limit, slot0,
                                     PAGE_SIZE, BLOCK_N, True, HAS_LEFTPAD, ROW_TABLE)  # fmt: skip
    m = mask_n & live
    rows = page * stride_sb + slot * stride_ss + hk * stride_sh
    vs = tl.load(v_scale_ptr + rows, mask=m, other=0.0)
    vz = tl.load(v_zero_ptr + rows, mask=m, other=0.0)
    if KEYS:
        ks = tl.load(k_scale_ptr + rows, mask=m, other=0.0)
        kz = tl.load(k_zero_ptr + rows, mask=m, other=0.0)
    else:
        ks, kz = tl.zeros_like(vs), tl.zeros_like(vz)
    return _pack_halves(ks, kz), _pack_halves(vs, vz)


@triton.jit
def _pack_halves(a, b):
    """Two float16 tensors in one int32 (a low, b high): half the registers of a prefetch."""
    lo = a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (b.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _unpack_halves(x):
    """float32 (a, b) of _pack_halves."""
    a = x.to(tl.int16).to(tl.float16, bitcast=True)
    b = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def _kv_blocks(
    acc0, acc1, l_i, m_i, zsum_i, q0, q1, qsum, qf0, qf1, k_ptr, v_ptr, k_scale_ptr, k_zero_ptr, v_scale_ptr,
    v_zero_ptr, res_ptr, block_table_ptr, stride_bt, b, hk, slot0, start, stop, qrow, sk, diag, window_left,
    window_right, slope_log2, qk_scale, cap_scale, cap_out, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
    stride_vh, stride_sb, stride_ss, stride_sh, stride_gb, stride_gg, stride_gh, stride_rb, stride_rs, stride_rh,
    offs_n, offs_d, offs_h,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr,
    HAS_WINDOW_RIGHT: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    FAST_DEQUANT: tl.constexpr, SCALE_GATHER: tl.constexpr, HAS_LEFTPAD: tl.constexpr, ROW_TABLE: tl.constexpr,
    FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, KEY_GROUP: tl.constexpr,
):  # fmt: skip
    """Key blocks start..stop of one program.

    With one scale s and zero z per token (GROUP == HEAD_DIM) a quantized tile never gets
    them applied elementwise. With codes centred on the middle code M (c - M, exact in
    float16) and the token's value at M, z + s M:
        q . (s c + z)              = s (q . (c - M)) + (z + s M) sum(q)   on the scores,
        sum_n p_n (s_n c_n + z_n)  = (p s) . (c - M) + sum_n p_n (z_n + s_n M)
    with the scales folded into P; zsum_i carries the last sum per row. Measured on H200:
    the elementwise float16 scale-and-shift made int4 decode as slow as bf16. The values'
    codes must be centred before the dot: fed as 1024 + c (the bit trick's raw output) the
    float32 accumulators carried 1024 sum(p s), thousands of times the output at long
    context, and removing the offset afterwards cancelled the output away (H200, GQA 32/8,
    N(0, 1) keys and values: relative error 1.9 for int4 and 0.12 for int8 at 131072
    tokens, against the formats' own 0.14 and 0.008). int4 keys' codes go in as 1024 + c,
    with s (q . (1024 + c)) + (z - 1024 s) sum(q) on the scores: each score is its own sum
    of head_dim products (no sum over the context), whose float32 rounding at the offset's
    magnitude is ~1e-4 of a logit for N(0, 1) data; one packed subtract per two codes saved.
    fp8 tiles are converted to float16 as they are: the head's scales act on q and on the
    output (the caller's).
    Keys by channel (BLOCK_N divides KEY_GROUP: a block lies in one group): a group's scale s_c and
    zero z_c per channel go on q, q' = float16(q * s) against the centred codes, plus the
    row constant sum_c q_c (z_c + s_c M); the sequence's last, incomplete group is read from
    the float16 residual rows. qf0, qf1: q (pre-scaled) in float32.
    Per-token scales are loaded one key block ahead: Triton pipelines only loads of 4 bytes
    or more per thread (one float16 each here), and waiting on four of them per block left
    the int8 and int4 decode latency-bound (ncu: 1 eligible warp of 3.6 per scheduler)."""
    dtype = q0.dtype
    FACTORED: tl.constexpr = BITS != 16 and GROUP == HEAD_DIM and not FP8
    RAW_KEYS: tl.constexpr = FACTORED and BITS == 4  # int8's one-warp tile spilled with them (sm_90)
    MID: tl.constexpr = 1 << (BITS - 1)
    full_end = sk // KEY_GROUP * KEY_GROUP if KEY_GROUP > 0 else 0  # keys below it are in full groups
    k_next = tl.zeros((BLOCK_N,), tl.int32)
    v_next = k_next
    if FACTORED:
        k_next, v_next = _token_scales(
            k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr, block_table_ptr, stride_bt, b, hk, start, stop, offs_n,
            sk, slot0, stride_sb, stride_ss, stride_sh, PAGE_SIZE, BLOCK_N, HAS_LEFTPAD, ROW_TABLE, KEY_GROUP == 0,
        )  # fmt: skip
    for start_n in range(start, stop, BLOCK_N):
        k_tok, v_tok = k_next, v_next
        if FACTORED:
            k_next, v_next = _token_scales(
                k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr, block_table_ptr, stride_bt, b, hk,
                start_n + BLOCK_N, stop, offs_n, sk, slot0, stride_sb, stride_ss, stride_sh, PAGE_SIZE, BLOCK_N,
                HAS_LEFTPAD, ROW_TABLE, KEY_GROUP == 0,
            )  # fmt: skip
        cols = start_n + offs_n
        page, slot, mask_n = _block_rows(
            block_table_ptr,
            stride_bt,
            b,
            start_n,
            offs_n,
            sk,
            slot0,
            PAGE_SIZE,
            BLOCK_N,
            MASK,
            HAS_LEFTPAD,
            ROW_TABLE,
        )
        k_rows = page * stride_kb + slot * stride_ks + hk * stride_kh
        if KEY_GROUP > 0:
            qk = _channel_scores(q0, q1, qf0, qf1, k_ptr, k_scale_ptr, k_zero_ptr, res_ptr, k_rows, page, start_n, b,
                                 hk, full_end, sk, mask_n, offs_n, offs_d, offs_h, stride_gb, stride_gg, stride_gh,
                                 stride_rb, stride_rs, stride_rh, HEAD_DIM, BLOCK_D, BLOCK_N, BITS, PAGE_SIZE, MASK,
                                 FAST_DEQUANT, KEY_GROUP)  # fmt: skip
        elif FP8:
            k0 = _fp8_to_f16(_load_codes(k_ptr + k_rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D), FP8_NATIVE)
            k1 = k0
        elif FACTORED:
            if BITS == 4:
                kc = _load_codes(k_ptr + k_rows, offs_h, mask_n, MASK, HEAD_DIM // 2, BLOCK_D // 2)
            else:
                kc = _load_codes(k_ptr + k_rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D)
            if RAW_KEYS:  # uncentred: see the docstring
                k0, k1 = _code_tiles(kc, BITS, FAST_DEQUANT)
            else:
                k0, k1 = _centred_codes(kc, BITS, FAST_DEQUANT)
        else:
            kc, ks, kz = _raw_tile(k_ptr, k_scale_ptr, k_zero_ptr, k_rows,
                                   page * stride_sb + slot * stride_ss + hk * stride_sh, mask_n, offs_d, offs_h, MASK,
                                   HEAD_DIM, BLOCK_D, BITS, GROUP, SCALE_GATHER)  # fmt: skip
            k0, k1 = _dequant_tile(kc, ks, kz, HEAD_DIM, BITS, GROUP, FAST_DEQUANT, SCALE_GATHER)
        if KEY_GROUP == 0:
            qk = tl.dot(q0, tl.trans(k0))
            if BITS == 4:
                qk = tl.dot(q1, tl.trans(k1), qk)
            if FACTORED:
                ks_tok, kz_tok = _unpack_halves(k_tok)
                ks_row, kz_row = ks_tok[None, :], kz_tok[None, :]
                if not RAW_KEYS:
                    qk = ks_row * qk + (kz_row + ks_row * MID) * qsum[:, None]
                elif FAST_DEQUANT:  # the codes came as 1024 + c
                    qk = ks_row * qk + (kz_row - ks_row * 1024.0) * qsum[:, None]
                else:
                    qk = ks_row * qk + kz_row * qsum[:, None]
        s, _ = _log2_scores(
            qk, qrow[:, None], cols[None, :], sk, diag, 0.0, window_left, window_right, slope_log2, qk_scale,
            cap_scale, cap_out, MASK, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
        )  # fmt: skip
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASK)
        v_rows = page * stride_vb + slot * stride_vs + hk * stride_vh
        if FP8:
            v0 = _fp8_to_f16(_load_codes(v_ptr + v_rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D), FP8_NATIVE)
            v1 = v0
            pv = p.to(dtype)
        elif FACTORED:
            if BITS == 4:
                vc = _load_codes(v_ptr + v_rows, offs_h, mask_n, MASK, HEAD_DIM // 2, BLOCK_D // 2)
            else:
                vc = _load_codes(v_ptr + v_rows, offs_d, mask_n, MASK, HEAD_DIM, BLOCK_D)
            v0, v1 = _centred_codes(vc, BITS, FAST_DEQUANT)
            vs_tok, vz_tok = _unpack_halves(v_tok)
            vs_row, vz_row = vs_tok[None, :], vz_tok[None, :]
            pv = (p * vs_row).to(dtype)
            zsum_i = zsum_i * alpha + tl.sum(p * (vz_row + vs_row * MID), 1)
        else:
            vc, vs, vz = _raw_tile(v_ptr, v_scale_ptr, v_zero_ptr, v_rows,
                                   page * stride_sb + slot * stride_ss + hk * stride_sh, mask_n, offs_d, offs_h, MASK,
                                   HEAD_DIM, BLOCK_D, BITS, GROUP, SCALE_GATHER)  # fmt: skip
            v0, v1 = _dequant_tile(vc, vs, vz, HEAD_DIM, BITS, GROUP, FAST_DEQUANT, SCALE_GATHER)
            pv = p.to(dtype)
        acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
        if BITS == 4:
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
        m_i = m_new
    return acc0, acc1, l_i, m_i, zsum_i


@triton.jit
def _attention_kvcache_fwd_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, k_zero_ptr, v_scale_ptr, v_zero_ptr,
    seqlens_ptr, block_table_ptr, cos_ptr, sin_ptr, slopes_ptr, leftpad_ptr, res_ptr, kn_ptr, vn_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_sb, stride_ss, stride_sh, stride_gb, stride_gg, stride_gh, stride_rb, stride_rs, stride_rh,
    stride_ob, stride_os, stride_oh, stride_osplit,
    stride_lb, stride_lh, stride_ls, stride_lsplit, stride_bt, stride_ro,
    stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh, stride_cb, stride_ct,
    seqlen_q, seqlen_new, heads_kv, group, split_len, rot_half,
    q_scale, qk_scale, cap_scale, cap_out, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_WINDOW_LEFT: tl.constexpr, HAS_WINDOW_RIGHT: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_DEQUANT: tl.constexpr = False,
    SCALE_GATHER: tl.constexpr = False, HAS_LEFTPAD: tl.constexpr = False, ROW_TABLE: tl.constexpr = False,
    FP8: tl.constexpr = False, FP8_NATIVE: tl.constexpr = False, KEY_GROUP: tl.constexpr = 0,
    FUSED_APPEND: tl.constexpr = False, ROT_TOKENS: tl.constexpr = False,
):  # fmt: skip
    """One program: BLOCK_M packed (query, head) rows of one (sequence, KV head), keys of one
    split. FUSED_APPEND (16-bit contiguous caches, one block of query rows): the seqlen_new
    new tokens at kn_ptr / vn_ptr (strides stride_kn*, stride_vn*) are written into the cache
    by the program whose split holds them (_append_in_split) instead of by an append kernel
    before. ROT_TOKENS (16-bit, with FUSED_APPEND): per-token cos / sin tables (batch stride
    stride_cb, token stride stride_ct, 2 rot_half columns) rotate query row i and new token i
    (seqlen_q == seqlen_new) instead of the position-indexed ones (HAS_ROTARY). Writes out/lse at split index program_id(2) (a float32 partial when split). FP8:
    k/v data are float8_e4m3fn bytes with float32 scales per KV head (k_scale_ptr +
    hk * stride_sh); FP8_NATIVE converts them with the hardware (sm_89+). KEY_GROUP > 0: keys by
    channel over groups of KEY_GROUP tokens (a multiple of BLOCK_N), their scale and zero at (page or
    sequence, group, head) strides stride_g*, the incomplete group in res_ptr (stride_r*)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    split = tl.program_id(2)
    b = bh // heads_kv
    hk = bh % heads_kv
    filled = tl.load(seqlens_ptr + b)  # storage slots (the padding included)
    slot0 = 0  # HAS_LEFTPAD: where the sequence's first token sits in its storage
    if HAS_LEFTPAD:
        slot0 = tl.minimum(tl.load(leftpad_ptr + b), filled)
    sk = filled - slot0 + seqlen_new  # keys counted from the sequence's first token
    diag = sk - seqlen_q
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    qrow = r // group
    head = hk * group + r % group
    row_ok = qrow < seqlen_q
    qpos = tl.maximum(qrow + diag, 0)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + qrow.to(tl.int64) * stride_qs + head * stride_qh
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_D // 2)
    # A quantized cache dequantizes to float16 (its scale and zero are float16), so q meets it
    # in float16, pre-scaled by softmax_scale (q_scale) to stay far from float16's range.
    if BITS == 16:
        dtype = q_ptr.dtype.element_ty
    else:
        dtype = tl.float16
    if BITS == 4:  # even and odd elements, against the two nibbles
        q0 = _load_rotated(q_rows, row_ok, offs_h * 2, qpos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM,
                           HAS_ROTARY, INTERLEAVED)  # fmt: skip
        q1 = _load_rotated(q_rows, row_ok, offs_h * 2 + 1, qpos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM,
                           HAS_ROTARY, INTERLEAVED)  # fmt: skip
        qf0, qf1 = q0 * q_scale, q1 * q_scale  # float32: keys by channel scale them per group
        q0, q1 = _to_f16_range(qf0).to(dtype), _to_f16_range(qf1).to(dtype)
        acc0 = tl.zeros((BLOCK_M, BLOCK_D // 2), dtype=tl.float32)
    else:
        if ROT_TOKENS:
            q0 = _load_rotated_tokens(q_rows, row_ok, offs_d, qrow, b.to(tl.int64) * stride_cb, cos_ptr, sin_ptr,
                                      stride_ct, rot_half, HEAD_DIM, ROT_TOKENS)  # fmt: skip
        else:
            q0 = _load_rotated(q_rows, row_ok, offs_d, qpos, cos_ptr, sin_ptr, stride_ro, rot_half, HEAD_DIM,
                               HAS_ROTARY, INTERLEAVED)  # fmt: skip
        if FP8:  # the keys' scale on q (times 2^8 with the converted tiles' 2^-8: _fp8_to_f16)
            q_scale *= tl.load(k_scale_ptr + hk * stride_sh) * (1.0 if FP8_NATIVE else 256.0)
        qf0 = q0 * q_scale
        q0 = _to_f16_range(qf0).to(dtype)
        q1 = q0
        qf1 = qf0
        acc0 = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_D // 2), dtype=tl.float32)
    slope_log2 = tl.zeros((BLOCK_M, 1), dtype=tl.float32)
    if HAS_ALIBI:
        slope_log2 = (
            tl.load(slopes_ptr + b * heads_kv * group + head, mask=row_ok, other=0.0)[:, None] * LOG2E
        )
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    zsum_i = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per-token-scale caches: see _kv_blocks
    qsum = tl.sum(q0.to(tl.float32), 1)
    if BITS == 4:
        qsum += tl.sum(q1.to(tl.float32), 1)
    first = pid_m * BLOCK_M // group
    last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // group, seqlen_q - 1)
    a, b_full, c_full, end = _segments(first, last, sk, diag, window_left, window_right, BLOCK_N, HAS_WINDOW_LEFT,
                                       HAS_WINDOW_RIGHT)  # fmt: skip
    lo = split * split_len
    hi = lo + split_len
    if FUSED_APPEND:
        _append_in_split(kn_ptr, vn_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, block_table_ptr, b, hk, filled, slot0, lo, hi,
                         seqlen_new, stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh, stride_kb,
                         stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_cb, stride_ct,
                         rot_half, offs_d, HEAD_DIM, 8, ROW_TABLE, ROT_TOKENS)  # fmt: skip
    args = (
        k_ptr,
        v_ptr,
        k_scale_ptr,
        k_zero_ptr,
        v_scale_ptr,
        v_zero_ptr,
        res_ptr,
        block_table_ptr,
        stride_bt,
        b,
        hk,
        slot0,
    )
    opts = (qrow, sk, diag, window_left, window_right, slope_log2, qk_scale, cap_scale, cap_out,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sb, stride_ss, stride_sh,
            stride_gb, stride_gg, stride_gh, stride_rb, stride_rs, stride_rh, offs_n, offs_d, offs_h)  # fmt: skip
    if HAS_WINDOW_LEFT:  # one masked loop, as in the prefill kernel
        acc0, acc1, l_i, m_i, zsum_i = _kv_blocks(
            acc0, acc1, l_i, m_i, zsum_i, q0, q1, qsum, qf0, qf1, *args, tl.maximum(a, lo), tl.minimum(end, hi), *opts, BLOCK_N, HEAD_DIM,
            BLOCK_D, BITS, GROUP, PAGE_SIZE, True, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI, HAS_SOFTCAP,
            FAST_DEQUANT, SCALE_GATHER, HAS_LEFTPAD, ROW_TABLE, FP8, FP8_NATIVE, KEY_GROUP,
        )  # fmt: skip
    else:
        acc0, acc1, l_i, m_i, zsum_i = _kv_blocks(
            acc0, acc1, l_i, m_i, zsum_i, q0, q1, qsum, qf0, qf1, *args, tl.maximum(b_full, lo), tl.minimum(c_full, hi), *opts, BLOCK_N,
            HEAD_DIM, BLOCK_D, BITS, GROUP, PAGE_SIZE, False, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI,
            HAS_SOFTCAP, FAST_DEQUANT, SCALE_GATHER, HAS_LEFTPAD, ROW_TABLE, FP8, FP8_NATIVE, KEY_GROUP,
        )  # fmt: skip
        acc0, acc1, l_i, m_i, zsum_i = _kv_blocks(
            acc0, acc1, l_i, m_i, zsum_i, q0, q1, qsum, qf0, qf1, *args, tl.maximum(c_full, lo), tl.minimum(end, hi), *opts, BLOCK_N,
            HEAD_DIM, BLOCK_D, BITS, GROUP, PAGE_SIZE, True, HAS_WINDOW_LEFT, HAS_WINDOW_RIGHT, HAS_ALIBI,
            HAS_SOFTCAP, FAST_DEQUANT, SCALE_GATHER, HAS_LEFTPAD, ROW_TABLE, FP8, FP8_NATIVE, KEY_GROUP,
        )  # fmt: skip
    if FP8:  # the values' scale (times 2^8, as on q)
        acc0 *= tl.load(v_scale_ptr + hk * stride_sh) * (1.0 if FP8_NATIVE else 256.0)
    elif BITS != 16 and GROUP == HEAD_DIM:  # the values' middle terms (see _kv_blocks)
        acc0 += zsum_i[:, None]
        acc1 += zsum_i[:, None]
    empty = l_i == 0.0  # no visible key in this split
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    o_rows = (o_ptr + b.to(tl.int64) * stride_ob + qrow.to(tl.int64) * stride_os + head * stride_oh
              + split * stride_osplit)  # fmt: skip
    out_ty = o_ptr.dtype.element_ty
    if BITS == 4:
        cols = offs_h * 2
        mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
        tl.store(o_rows[:, None] + cols[None, :], (acc0 * inv_l[:, None]).to(out_ty), mask=mask)
        tl.store(o_rows[:, None] + cols[None, :] + 1, (acc1 * inv_l[:, None]).to(out_ty), mask=mask)
    else:
        mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_rows[:, None] + offs_d[None, :], (acc0 * inv_l[:, None]).to(out_ty), mask=mask)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + head * stride_lh + qrow * stride_ls + split * stride_lsplit,
             lse, mask=row_ok)  # fmt: skip


@triton.jit
def _attention_kvcache_combine_kernel(
    part_o_ptr, part_lse_ptr, advance_ptr, o_ptr, lse_ptr,
    stride_pb, stride_ps, stride_ph, stride_psplit, stride_plb, stride_plh, stride_pls,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh,
    seqlen_q, heads_q, num_splits, advance_by,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLITS_TILE: tl.constexpr = False,
    ADVANCE: tl.constexpr = False,
):  # fmt: skip
    """One program: one (sequence, query, head) row; merges its splits' partials by their lse.
    SPLITS_TILE: every split's partial in one (splits, head_dim) load, issued together (the
    split loop waits on one load after another); the plan sets it where the tile is small.
    ADVANCE: program 0 also adds advance_by to the int32 at advance_ptr (a static cache's
    length, which the main kernel read before this kernel started): one launch fewer per
    layer and decode step than an add of its own."""
    row = tl.program_id(0)
    if ADVANCE:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if row == 0:
            tl.store(advance_ptr, tl.load(advance_ptr) + advance_by)
    b = row // (seqlen_q * heads_q)
    i = (row // heads_q) % seqlen_q
    h = row % heads_q
    splits = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    lse_base = part_lse_ptr + b.to(tl.int64) * stride_plb + h * stride_plh + i * stride_pls
    lse = tl.load(lse_base + splits, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp2((lse - m_safe) * LOG2E), 0)
    base = part_o_ptr + b.to(tl.int64) * stride_pb + i * stride_ps + h * stride_ph
    if SPLITS_TILE:
        w = tl.exp2((lse - m_safe) * LOG2E)  # 0 past num_splits (lse -inf there)
        mask = (splits[:, None] < num_splits) & (offs_d[None, :] < HEAD_DIM)
        parts = tl.load(base + splits[:, None] * stride_psplit + offs_d[None, :], mask=mask, other=0.0)
        acc = tl.sum(w[:, None] * parts, 0)
    else:
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s in range(num_splits):  # one split at a time: a (splits, head_dim) tile spilled at D256
            w = tl.exp2((tl.load(lse_base + s) - m_safe) * LOG2E)
            acc += w * tl.load(base + s * stride_psplit + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + i * stride_os + h * stride_oh + offs_d,
             out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)  # fmt: skip
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + i,
             tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total))))  # fmt: skip
