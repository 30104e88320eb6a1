"""Plain PyTorch definitions of this family's ops: the definition of correct.

The weight is dequantized to float32 (format.py gives the formula), the product is taken in
float32 (float64 for float64 inputs) and rounded once to the input dtype. The reference
backend calls the `*_fwd` entries, which write into preallocated outputs; every backend
implements the same two entries:

    dequantize_int4_fwd(qweight, scales, zeros, out, group_size, kind)
        qweight (N, K // 2) uint8, scales / zeros (K // group_size, N), zeros may be None;
        out (N, K) contiguous, any float dtype.
    int4_linear_fwd(x, qweight, scales, zeros, bias, out, group_size, kind)
        x (M, K) with unit column stride, fp16 / bf16 / fp32 (fp64 on the reference); bias
        (N,) or None; out (M, N) contiguous, x's dtype. The act-order perm is applied by
        the caller (api.py), never by a backend.
    int4_linear_gated_fwd(gate_up, qweight, scales, zeros, bias, out, group_size, kind, act)
        int4_linear of act(gate) * up (fused.py): gate_up (M, 2K), gate in columns [0, K) and
        up in [K, 2K); the product rounded to gate_up's dtype before the linear; inference
        only (no gradient).
    int4_linear_normed_fwd(x, norm_weight, eps, weight_offset, qweight, scales, zeros, bias, out,
                           group_size, kind)
        int4_linear of x's RMSNorm (fused.py), rounded to x's dtype before the linear;
        inference only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .format import nf4_values

__all__ = [
    "unpack_codes",
    "dequantize_int4_ref",
    "int4_linear_ref",
    "dequantize_int4_fwd",
    "int4_linear_fwd",
    "int4_linear_gated_fwd",
    "int4_linear_normed_fwd",
    "linear_error_bound",
]


def unpack_codes(qweight: Tensor) -> Tensor:
    """(N, K // 2) uint8 -> (N, K) int64 codes 0..15, column 2j from the low nibble of byte j."""
    low = (qweight & 0xF).long()
    high = (qweight >> 4).long()
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize_int4_ref(
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    kind: str = "int4",
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The weight (N, K) in float32 (or float64 when dtype is float64), cast to `dtype`."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    codes = unpack_codes(qweight)
    s = scales.to(work).t().repeat_interleave(group_size, dim=1)  # (N, K)
    if kind == "nf4":
        w = nf4_values(qweight.device, work)[codes] * s
    else:
        z = 8.0 if zeros is None else zeros.to(work).t().repeat_interleave(group_size, dim=1)
        w = (codes.to(work) - z) * s
    return w.to(dtype)


def int4_linear_ref(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    group_size: int,
    kind: str = "int4",
    bias: Tensor | None = None,
) -> Tensor:
    """x (..., K) @ W^T (+ bias) computed in float32 (float64 for float64 x), in x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_int4_ref(qweight, scales, zeros, group_size, kind, work)
    y = x.to(work) @ w.t()
    if bias is not None:
        y = y + bias.to(work)
    return y.to(x.dtype)


# The backend contract's entries (module docstring gives the arguments' shapes and dtypes).


def dequantize_int4_fwd(qweight, scales, zeros, out: Tensor, group_size: int, kind: str) -> None:
    out.copy_(dequantize_int4_ref(qweight, scales, zeros, group_size, kind, out.dtype))


def int4_linear_fwd(x, qweight, scales, zeros, bias, out: Tensor, group_size: int, kind: str) -> None:
    out.copy_(int4_linear_ref(x, qweight, scales, zeros, group_size, kind, bias))


def int4_linear_gated_fwd(gate_up, qweight, scales, zeros, bias, out: Tensor, group_size: int, kind: str,
                          act: str) -> None:  # fmt: skip
    from .format import untile_codes
    from .fused import gated_product

    if qweight.dim() == 3:  # format.tile_codes' layout: the reference reads rows
        qweight = untile_codes(qweight)
    out.copy_(int4_linear_ref(gated_product(gate_up, act), qweight, scales, zeros, group_size, kind, bias))


def int4_linear_normed_fwd(x, norm_weight, eps: float, weight_offset: float, qweight, scales, zeros, bias,
                           out: Tensor, group_size: int, kind: str) -> None:  # fmt: skip
    from .format import untile_codes
    from .fused import rms_normed

    if qweight.dim() == 3:
        qweight = untile_codes(qweight)
    normed = rms_normed(x, norm_weight, eps, weight_offset)
    out.copy_(int4_linear_ref(normed, qweight, scales, zeros, group_size, kind, bias))


_SMALLEST_SUBNORMAL = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
    torch.float32: 2.0**-149,
    torch.float64: 2.0**-1074,
}
_UNIT_ROUNDOFF = {
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
    torch.float32: 2.0**-24,
    torch.float64: 2.0**-53,
}


def linear_error_bound(
    x: Tensor,
    w: Tensor,
    ref: Tensor,
    out_dtype: torch.dtype,
    *,
    weight_rounded_to: torch.dtype | None = None,
    abs_sum: Tensor | None = None,
) -> Tensor:
    """Elementwise bound on |out - ref| for int4_linear (the kernels' error contract).

    x (M, K) and w (N, K) in float64 (w dequantized), ref = x @ w^T (+ bias) in float64:
        u_out (|ref| + E) + eta_out / 2  the single rounding of the output, of the value the
                                       kernel computed (ref plus the terms E below), with
                                       the absolute floor of subnormal results
      + E, where E is
        4 u_w sqrt(sum_k (x_k w_k)^2)  W rounded to x's dtype before the products (the
                                       dequantize + matmul path, NF4 levels in the MMA):
                                       K independent roundings, a random walk, 4 sigma
      + eta_w / 2 sum_k |x_k|           those roundings' absolute floor (subnormal weights)
      + 4 sqrt(K) 2^-24 sum_k |x_k w_k| float32 accumulation of K products
    (eta: the dtype's smallest subnormal; float16 rounds values below 6e-5 to multiples of
    2^-24, where the relative bound alone does not hold.)
    abs_sum: what the kernel accumulates in place of sum_k |x_k w_k| when its terms are not
    the products x_k w_k (the CPU GEMV of int4 sums x_k s (q_k) and takes zero * s * sum x off
    per group: sum_k |x_k| s (|q_k| + |z|)).
    """
    u_out = _UNIT_ROUNDOFF[out_dtype]
    u_w = _UNIT_ROUNDOFF[weight_rounded_to] if weight_rounded_to is not None else 0.0
    eta_w = _SMALLEST_SUBNORMAL[weight_rounded_to] if weight_rounded_to is not None else 0.0
    rss = ((x * x) @ (w * w).t()).sqrt()
    if abs_sum is None:
        abs_sum = x.abs() @ w.abs().t()
    terms = 4 * u_w * rss + 4 * w.shape[1] ** 0.5 * 2.0**-24 * abs_sum
    if eta_w:
        terms = terms + eta_w / 2 * x.abs().sum(-1, keepdim=True)
    return u_out * (ref.abs() + terms) + terms + _SMALLEST_SUBNORMAL[out_dtype] / 2 + 1e-30
