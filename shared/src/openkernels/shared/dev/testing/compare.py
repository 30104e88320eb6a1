"""Comparison against a float64 reference with one tolerance table per dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Tolerance", "TOLERANCES", "tolerance", "assert_close"]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# Elementwise kernels compute in float32 and round once, so the error is half an ulp of
# the output dtype plus a few float32 ulps: rtol is one ulp of the dtype (bf16 2^-7,
# fp16 2^-10), fp32 allows ~100 ulps for exp/erf approximations (ex2.approx, libdevice).
# atol covers outputs that underflow toward the dtype's smallest normals.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-12, atol=1e-14),
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6),
    torch.float16: Tolerance(rtol=2**-10, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=2**-7, atol=1e-5),
}


def tolerance(dtype: torch.dtype, *, scale: float = 1.0) -> Tolerance:
    """The table's tolerance for `dtype`, optionally scaled (a derived factor, with a reason)."""
    base = TOLERANCES[dtype]
    return Tolerance(base.rtol * scale, base.atol * scale)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    scale: float = 1.0,
    terms: int = 1,
    term_scale: float = 0.0,
    msg: str = "",
) -> None:
    """Compare `actual` with a (float64) reference using the tolerance of `dtype`.

    NaN matches only NaN at the same place; shapes must be equal; any NaN in `actual`
    where the reference is finite fails. `terms`: how many products each output sums in a
    float32 accumulator (a norm's row, a weight gradient's rows); rounding errors of such
    a sum grow like sqrt(terms) ulps of its largest terms, so atol grows by
    4 * sqrt(terms) * 2^-24 * max(max|expected|, term_scale) (2^-53 for float64), where
    `term_scale` bounds the terms when they cancel to a smaller result.
    """
    dtype = dtype or actual.dtype
    tol = tolerance(dtype, scale=scale)
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg} shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if (terms > 1 or term_scale) and e.numel():
        unit = 2.0**-53 if dtype == torch.float64 else 2.0**-24
        largest = max(float(e.nan_to_num(0.0, 0.0, 0.0).abs().max()), term_scale)
        tol = Tolerance(tol.rtol, tol.atol + 4 * terms**0.5 * unit * largest)
    stray_nan = torch.isnan(a) & ~torch.isnan(e)
    if stray_nan.any():
        first = tuple(int(i) for i in stray_nan.nonzero()[0])
        raise AssertionError(f"{msg} {int(stray_nan.sum())} NaN where the reference is not, first at {first}")
    torch.testing.assert_close(a, e, rtol=tol.rtol, atol=tol.atol, equal_nan=True, msg=_with(msg))


def _with(prefix: str):
    if not prefix:
        return None
    return lambda default: f"{prefix}: {default}"
