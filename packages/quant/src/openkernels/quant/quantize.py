"""Round-to-nearest 4-bit quantization of a weight (N, K) into format.py's layout, with an
optional clipping search.

Per group of `group_size` columns of a row:
  asymmetric int4: scale = (max - min) / 15, zero = round(-min / scale), code = round(w / scale) + zero,
                   with max >= 0 >= min (the range widened to hold 0, so that the zero is a code)
  symmetric int4:  scale = max|w| / 7, code = round(w / scale) + 8 (codes 1..15 used)
  nf4:             scale = max|w|, code = the NF4 level nearest to w / scale
Codes are clamped to 0..15. Scales are rounded to their storage dtype before the codes are
computed, so the codes are the nearest ones for the stored scale.

search="clip" shrinks the range: for each group it tries ratios r in [min_ratio, 1] (max
and min, or max|w|, multiplied by r), keeps the r with the smallest squared error of the
group's dequantized weight; r = 1 is plain round-to-nearest, so the search never does worse.
Clipping trades a few large errors on outliers for a finer grid on the rest.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import problem
from .format import KINDS, SCALE_DTYPES, Int4Weight, nf4_values

__all__ = ["quantize_int4", "quantize_nf4", "pack_codes"]

_CHUNK_ELEMENTS = 1 << 24  # rows per pass are chosen so float32 temporaries stay ~64 MB each


def pack_codes(codes: Tensor) -> Tensor:
    """(N, K) integer codes 0..15 -> (N, K // 2) uint8, column 2j in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _check_weight(weight: Tensor, scale_dtype: torch.dtype) -> None:
    """What is PyTorch's own in the argument checks (problem.check_quantize_options has the rest)."""
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a float tensor, got {weight.dtype}")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.float16 or torch.bfloat16, got {scale_dtype}")


def _fit(w: Tensor, kind: str, symmetric: bool, ratio: float, scale_dtype: torch.dtype):
    """Scales, zeros and codes for groups w (R, G, gs) at clip ratio `ratio`; and the
    squared error per group (R, G)."""
    if kind == "nf4" or symmetric:
        top = w.abs().amax(dim=-1) * ratio
        scale = top if kind == "nf4" else top / 7
        zero = None
    else:
        # The range always holds 0 (as GPTQ's quantizer): the zero point round(-lo / scale) must
        # be a code, 0..15. A group of [10, 11] would otherwise get zero 0 and every code
        # clamped at 15 (all of it dequantized near 1.0); a constant group spans 0..value.
        hi = (w.amax(dim=-1) * ratio).clamp(min=0)
        lo = (w.amin(dim=-1) * ratio).clamp(max=0)
        scale = (hi - lo) / 15
    scale = scale.to(scale_dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero group: any scale works
    if not torch.isfinite(scale).all():
        raise ValueError(f"a group's scale overflows {scale_dtype}; pass scale_dtype=torch.bfloat16")
    s = scale.unsqueeze(-1)
    if kind == "nf4":
        levels = nf4_values(w.device)
        edges = (levels[1:] + levels[:-1]) / 2
        codes = torch.bucketize((w / s).contiguous(), edges)
        deq = levels[codes] * s
    else:
        if symmetric:
            zero_f = torch.full_like(scale, 8.0)
        else:
            zero_f = torch.clamp(torch.round(-lo / scale), 0, 15)
            zero = zero_f
        codes = torch.clamp(torch.round(w / s) + zero_f.unsqueeze(-1), 0, 15)
        deq = (codes - zero_f.unsqueeze(-1)) * s
    err = (deq - w).square().sum(dim=-1)
    return scale, zero, codes, err


def _quantize(
    weight: Tensor,
    group_size: int | None,
    kind: str,
    symmetric: bool,
    search: str | None,
    scale_dtype: torch.dtype,
    grid: int,
    min_ratio: float,
) -> Int4Weight:
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2D tensor (out_features, in_features), got {getattr(weight, 'shape', weight)}"
        )
    n, k = weight.shape
    group_size = problem.resolve_group_size(group_size, k)
    _check_weight(weight, scale_dtype)
    problem.check_quantize_options(k, group_size, search, grid, min_ratio)
    if weight.numel() and not torch.isfinite(weight).all():
        raise ValueError("weight contains NaN or infinity")
    groups = k // group_size
    ratios = problem.clip_ratios(search, grid, min_ratio)
    qweight = torch.empty((n, k // 2), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((groups, n), dtype=scale_dtype, device=weight.device)
    zeros = None if kind == "nf4" or symmetric else torch.empty_like(scales)
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        w = weight[start : start + rows].float().reshape(-1, groups, group_size)
        best = None
        for r in ratios:
            scale, zero, codes, err = _fit(w, kind, symmetric, r, scale_dtype)
            if best is None:
                best = [scale, zero, codes, err]
                continue
            better = err < best[3]
            best[0] = torch.where(better, scale, best[0])
            if zero is not None:
                best[1] = torch.where(better, zero, best[1])
            best[2] = torch.where(better.unsqueeze(-1), codes, best[2])
            best[3] = torch.where(better, err, best[3])
        scale, zero, codes, _ = best
        qweight[start : start + rows] = pack_codes(codes.reshape(-1, k))
        scales[:, start : start + rows] = scale.t().to(scale_dtype)
        if zeros is not None:
            zeros[:, start : start + rows] = zero.t().to(scale_dtype)
    return Int4Weight(qweight, scales, zeros, group_size, kind)


def quantize_int4(
    weight: Tensor,
    group_size: int | None = 128,
    symmetric: bool = False,
    *,
    search: str | None = None,
    scale_dtype: torch.dtype = torch.float16,
    grid: int = 20,
    min_ratio: float = 0.5,
) -> Int4Weight:
    """Quantize a weight (out_features, in_features) to 4-bit integers.

    Args:
        weight: (N, K) float tensor, K even, on any device (the work runs there).
        group_size: 32, 64, 128, or None for one group per row; must divide K.
        symmetric: no zeros, codes centered on 8 (scale = max|w| / 7); else per-group
            zeros from the group's min and max.
        search: None (round to nearest) or "clip" (per-group clipping ratio search, `grid`
            steps from 1 down to `min_ratio`, keeping the smallest squared error).
        scale_dtype: torch.float16 (default) or torch.bfloat16 for scales and zeros.

    Returns:
        Int4Weight with kind "int4" (format.py has the layout).
    """
    return _quantize(weight, group_size, "int4", symmetric, search, scale_dtype, grid, min_ratio)


def quantize_nf4(
    weight: Tensor,
    group_size: int | None = 64,
    *,
    search: str | None = None,
    scale_dtype: torch.dtype = torch.float16,
    grid: int = 20,
    min_ratio: float = 0.5,
) -> Int4Weight:
    """Quantize a weight (N, K) to NF4 (the bitsandbytes / QLoRA levels; blocks of 64 by
    default, scale = the block's max|w|). Same arguments as `quantize_int4`; the result is
    an Int4Weight with kind "nf4", served by the same kernels."""
    return _quantize(weight, group_size, "nf4", True, search, scale_dtype, grid, min_ratio)


assert KINDS == ("int4", "nf4")
