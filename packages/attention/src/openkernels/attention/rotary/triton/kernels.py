"""Triton kernel of the rotary position embedding (apply_rotary; semantics in reference.py).

`_apply_rotary_kernel`: one program takes BLOCK_T tokens (flattened (batch, seqlen) pairs),
loads their cos/sin rows once, in float32, then rotates every q head and every k head of
those tokens: q and k in one launch. Heads are taken BLOCK_HQ (BLOCK_HK) at a time as
(BLOCK_T, heads, BLOCK_HALF) tiles of the two halves x1 = x[:R/2], x2 = x[R/2:R], each a
contiguous run of the head (16-byte vector loads), plus a tile of the copied rest x[R:].
The backward is the same kernel: the transposed rotation is the forward one with (s1, s2)
replaced by (-s2, -s1) (BACKWARD). Math in float32, one rounding at the store; token
offsets are int64 (tensors past 2^31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, o_ptr, x_tok, o_tok, valid, heads, stride_h, c1, c2, s1, s2, HEAD_DIM: tl.constexpr,
                  ROT_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_PASS: tl.constexpr):  # fmt: skip
    """Heads 0..heads-1 of the tokens whose rows start at x_ptr + x_tok (any head stride) and
    o_ptr + o_tok (contiguous heads). c1, c2, s1, s2: (BLOCK_T, 1, BLOCK_HALF) float32."""
    j = tl.arange(0, BLOCK_HALF)[None, None, :]
    token = valid[:, None, None]
    for h0 in range(0, heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        row = token & (h < heads)
        x_row = x_ptr + x_tok[:, None, None] + h.to(tl.int64) * stride_h
        o_row = o_ptr + o_tok[:, None, None] + h.to(tl.int64) * HEAD_DIM
        mask = row & (j < ROT_HALF)
        x1 = tl.load(x_row + j, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + ROT_HALF + j, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + j, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_row + ROT_HALF + j, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)
        if BLOCK_PASS > 0:  # partial rotary: x[R:] is copied
            p = 2 * ROT_HALF + tl.arange(0, BLOCK_PASS)[None, None, :]
            rest = row & (p < HEAD_DIM)
            tl.store(o_row + p, tl.load(x_row + p, mask=rest).to(o_ptr.dtype.element_ty), mask=rest)


@triton.jit
def _apply_rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_cb, stride_cs, stride_sb, stride_ss,
    tokens, seqlen, heads_q, heads_k,
    HEAD_DIM: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_T tokens, all q and k heads. q, k (B, S, H, D) strided with a unit
    last stride; cos, sin (Bc, S, R) (batch stride 0 when broadcast); outputs contiguous."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < tokens
    b = (t // seqlen).to(tl.int64)
    s = (t % seqlen).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = valid[:, None] & (j < ROT_HALF)
    c_row = cos_ptr + (b * stride_cb + s * stride_cs)[:, None] + j
    s_row = sin_ptr + (b * stride_sb + s * stride_ss)[:, None] + j
    c1 = tl.load(c_row, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + ROT_HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + ROT_HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
        s1, s2 = -s2, -s1
    c1, c2, s1, s2 = c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :]
    t64 = t.to(tl.int64)
    _rotate_heads(q_ptr, qo_ptr, b * stride_qb + s * stride_qs, t64 * heads_q * HEAD_DIM, valid, heads_q, stride_qh,
                  c1, c2, s1, s2, HEAD_DIM, ROT_HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
    _rotate_heads(k_ptr, ko_ptr, b * stride_kb + s * stride_ks, t64 * heads_k * HEAD_DIM, valid, heads_k, stride_kh,
                  c1, c2, s1, s2, HEAD_DIM, ROT_HALF, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)  # fmt: skip
