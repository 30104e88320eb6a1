"""Attention through PyTorch's own CPU flash kernel (aten::_scaled_dot_product_flash_attention_for_cpu
and its _backward): a blockwise online-softmax kernel in C++, parallel over batch, heads and
query blocks.

What it takes, checked on torch 2.13: (B, H, S, D) views of any strides; Hq a multiple of
Hkv (GQA read in place); is_causal aligned top-left; attn_mask an additive mask of the
query's dtype broadcast to (B, H, Sq, Sk); lse natural-log (B, H, Sq) float32 (float64 for
float64). A row masked everywhere gives out 0 and lse 0 (and the backward wants that lse
back: -inf would give NaN). No softcap.

So: plain causal with Sq == Sk is is_causal; other windows and ALiBi are an additive mask
built per block of query rows (bounding the mask to _MASK_ELEMENTS and skipping keys no row
of the block sees); float16 / bfloat16 run the kernel in float32 (see `work_dtype`).
Layouts as in blockwise.py: q, out, dout, dq (B, Sq, Hq, D), k, v, dk, dv (B, Sk, Hkv, D)
views, lse (B, Hq, Sq), slopes (B, Hq) float32 or None.
"""

from __future__ import annotations

import torch

from ..adopt import adopt
from ..reference import compute_dtype
from .geometry import Geometry

__all__ = ["forward", "backward", "available"]

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# Mask elements per kernel call (float32: 16 MiB); more rows are split into row blocks.
_MASK_ELEMENTS = 2**22
# Rows per call under a window: keys no row of the block sees are not computed.
_WINDOW_ROWS = 256


def available() -> bool:
    return _FWD is not None and _BWD is not None


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel runs in. Half types run in float32: without bfloat16 / float16
    GEMM units (AVX2) the kernel's half backward is 12-15x slower than float32 (causal B2 H8
    S1024 D64, one thread: bf16 1532 ms, fp16 1917 ms, fp32 128 ms), its half forward no
    faster (bf16 69 vs 74 ms with the conversion, fp16 106 vs 69 ms), and an ALiBi mask in
    a half type would round the bias (slope * distance) to 8 or 11 bits."""
    return compute_dtype(dtype)


def _bhsd(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, H, D) -> a (B, H, S, D) view (a converted copy when `dtype` differs)."""
    return t.transpose(1, 2).to(dtype)


def _blocks(geo: Geometry, mask_rows: int, needs_mask: bool):
    """(r0, r1, k0, k1) per block of rows: the whole sequence in one block when no mask is
    needed, else blocks of up to _MASK_ELEMENTS // (mask_rows * sk) rows (_WINDOW_ROWS under a
    window) after the empty ones."""
    if not needs_mask:
        yield 0, geo.sq, 0, geo.sk
        return
    step = max(1, _MASK_ELEMENTS // max(1, mask_rows * geo.sk))
    if geo.left >= 0 or geo.right >= 0:
        step = min(step, _WINDOW_ROWS)
    for r0 in range(geo.empty_rows(), geo.sq, step):
        r1 = min(geo.sq, r0 + step)
        k0, k1 = geo.key_range(r0, r1)
        yield r0, r1, k0, k1


def _mask(geo: Geometry, slopes: torch.Tensor | None, r0: int, r1: int, k0: int, k1: int, dtype):
    """Additive mask (1 or B, 1 or Hq, R, K) for rows [r0, r1), keys [k0, k1); None if all zero."""
    bias = None
    if slopes is not None:
        bias = geo.distance(r0, r1, k0, k1, dtype) * -slopes.to(dtype)[:, :, None, None]
    if not geo.is_full(r0, r1, k0, k1):
        hidden = ~geo.visible(r0, r1, k0, k1)
        if bias is None:
            bias = torch.zeros(hidden.shape, dtype=dtype)
        bias = bias.masked_fill_(hidden, float("-inf"))
    return bias


def _shared_slopes(slopes: torch.Tensor | None) -> torch.Tensor | None:
    """(1, Hq) when every sequence has the same slopes (a (Hq,) input, expanded by ops.py): a
    mask broadcast over the batch instead of one per sequence."""
    if slopes is None or slopes.shape[0] == 1 or not bool((slopes == slopes[:1]).all()):
        return slopes
    return slopes[:1]


def _plan(geo: Geometry, slopes: torch.Tensor | None, heads: int):
    """(is_causal, row blocks) of one call."""
    causal = geo.is_causal_square() and slopes is None
    needs_mask = not causal and (slopes is not None or not geo.is_full(0, geo.sq, 0, geo.sk))
    mask_rows = 1 if slopes is None else slopes.shape[0] * heads
    return causal, _blocks(geo, mask_rows, needs_mask)


def forward(q, k, v, out, lse, slopes, *, scale: float, left: int, right: int) -> None:
    """Write out (B, Sq, Hq, D) and lse (B, Hq, Sq) in place."""
    sq, hq, sk = q.shape[1], q.shape[2], k.shape[1]
    work = work_dtype(q.dtype)
    geo = Geometry(sq, sk, left, right)
    qt, kt, vt = _bhsd(q, work), _bhsd(k, work), _bhsd(v, work)
    slopes = _shared_slopes(slopes)
    causal, blocks = _plan(geo, slopes, hq)
    n_empty = geo.empty_rows()
    if n_empty:  # slicing and filling nothing still costs host time on every call
        out[:, :n_empty].zero_()
        lse[:, :, :n_empty].fill_(float("-inf"))
    for r0, r1, k0, k1 in blocks:
        if k0 >= k1:  # no visible key in the block: only empty rows, already written
            continue
        mask = None if causal else _mask(geo, slopes, r0, r1, k0, k1, work)
        if (r0, r1, k0, k1) == (0, sq, 0, sk):  # one block (the common case): no slices
            o, row_lse = _FWD(qt, kt, vt, 0.0, causal, attn_mask=mask, scale=scale)
            adopt(out, o.transpose(1, 2))
            lse.copy_(row_lse)
            continue
        o, row_lse = _FWD(qt[:, :, r0:r1], kt[:, :, k0:k1], vt[:, :, k0:k1], 0.0, causal, attn_mask=mask,
                          scale=scale)  # fmt: skip
        out[:, r0:r1].copy_(o.transpose(1, 2))
        lse[:, :, r0:r1].copy_(row_lse)


def backward(dout, q, k, v, out, lse, dq, dk, dv, slopes, *, scale: float, left: int, right: int) -> None:
    """Write dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D) in place, from the saved out and lse."""
    sq, hq, sk = q.shape[1], q.shape[2], k.shape[1]
    work = work_dtype(q.dtype)
    geo = Geometry(sq, sk, left, right)
    qt, kt, vt = _bhsd(q, work), _bhsd(k, work), _bhsd(v, work)
    ot, dot = _bhsd(out, work), _bhsd(dout, work)
    # Rows with no visible key (only leading rows, see Geometry): lse 0 as the kernel's
    # forward gives it (exp(-inf - 0) = 0).
    lse0 = lse.masked_fill(lse == float("-inf"), 0.0) if geo.empty_rows() else lse
    slopes = _shared_slopes(slopes)
    causal, blocks = _plan(geo, slopes, hq)
    blocks = list(blocks)
    if len(blocks) == 1 and blocks[0] == (0, sq, 0, sk):  # one call: its gradients are final
        mask = None if causal else _mask(geo, slopes, 0, sq, 0, sk, work)
        g = _BWD(dot, qt, kt, vt, ot, lse0, 0.0, causal, attn_mask=mask, scale=scale)
        for dst, src in zip((dq, dk, dv), g):
            adopt(dst, src.transpose(1, 2))
        return
    # Row blocks: dq per block, dk and dv summed over the blocks in the compute dtype.
    acc = compute_dtype(q.dtype)
    dq[:, : geo.empty_rows()].zero_()
    dk_acc = torch.zeros(dk.shape, dtype=acc)
    dv_acc = torch.zeros(dv.shape, dtype=acc)
    for r0, r1, k0, k1 in blocks:
        if k0 >= k1:
            continue
        mask = _mask(geo, slopes, r0, r1, k0, k1, work)
        g = _BWD(dot[:, :, r0:r1], qt[:, :, r0:r1], kt[:, :, k0:k1], vt[:, :, k0:k1], ot[:, :, r0:r1],
                 lse0[:, :, r0:r1], 0.0, False, attn_mask=mask, scale=scale)  # fmt: skip
        dq[:, r0:r1].copy_(g[0].transpose(1, 2))
        dk_acc[:, k0:k1].add_(g[1].transpose(1, 2))
        dv_acc[:, k0:k1].add_(g[2].transpose(1, 2))
    dk.copy_(dk_acc)
    dv.copy_(dv_acc)
