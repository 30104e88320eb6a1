"""Triton kernels of the activations family (CUDA and ROCm from one source).

Every program works on a (BLOCK_R, BLOCK_C) tile of a row-major 2D problem: rows have an
arbitrary stride (int64 offsets, so tensors past 2^31 elements work), columns are unit
stride, which lets Triton emit 16-byte vector loads when strides and sizes are multiples
of 16 elements (it specializes on that). Math is float32; one rounding at the store.
ACT is an `Act` code from spec.py; gated kernels read a = x[:, :n_cols], b = x[:, n_cols:].
"""

import triton
import triton.language as tl

from ..spec import Act

# Constants of the activation definitions (see reference.py); jit code may only read
# module globals that are constexpr.
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)
_GELU_QUICK_C = tl.constexpr(1.702)
# The activation codes, from spec.Act (the C++ kernels' enum is checked against it by a test).
_SILU = tl.constexpr(int(Act.SILU))
_GELU = tl.constexpr(int(Act.GELU))
_GELU_TANH = tl.constexpr(int(Act.GELU_TANH))
_GELU_QUICK = tl.constexpr(int(Act.GELU_QUICK))
_RELU_SQUARED = tl.constexpr(int(Act.RELU_SQUARED))
_SIGMOID = tl.constexpr(int(Act.SIGMOID))


@triton.jit
def _sigmoid(x):
    # 1 / (1 + e^-x): exp overflows to inf for x << 0, giving exactly 0, never NaN.
    # Approximate division (2 ulp): IEEE division costs ~10 instructions more per element.
    return tl.fdiv(1.0, 1.0 + tl.exp(-x))


@triton.jit
def _sigmoid_and_complement(x):
    """(sigmoid(x), 1 - sigmoid(x)), both to a few ulps.

    1 - s cancels badly once s nears 1, and derivatives multiply it by large factors
    (x * du for GELU-tanh: errors of 5e-6 in fp32); e * s == e / (1 + e) is the same value
    without the cancellation, from the exp already computed. For x < 0, 1 - s is exact
    enough and stays finite where e overflows.
    """
    e = tl.exp(-x)
    s = tl.fdiv(1.0, 1.0 + e)
    return s, tl.where(x < 0.0, 1.0 - s, e * s)


@triton.jit
def _normal_cdf(x):
    """Phi(x) = 0.5 erfc(-x / sqrt(2)), relative error ~1e-7 on both tails.

    erfc(z) for z >= 0 uses the Chebyshev fit erfc(z) = t exp(-z^2 + P(t)), t = 1/(1 + z/2)
    (fractional error < 1.2e-7 for all z): branch-free, one exp and one reciprocal, about
    half the instructions of libdevice erff, which made exact GELU compute-bound on H200
    (0.85 of copy for gelu_and_mul forward, docs/perf.md).
    """
    z = tl.abs(x) * _INV_SQRT2
    t = tl.fdiv(1.0, 1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    p = -1.26551223 + t * p
    half_erfc = 0.5 * t * tl.exp(p - z * z)
    return tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    # EVEN: the tile divides the problem, so no element needs a mask (no predication).
    if EVEN:
        value = tl.load(ptrs)
    else:
        value = tl.load(ptrs, mask=mask, other=0.0)
    return value.to(tl.float32)


@triton.jit
def _store(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty))
    else:
        tl.store(ptrs, value.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x) for float32 x."""
    if ACT == _SILU:
        y = x * _sigmoid(x)
    elif ACT == _GELU:  # exact
        y = x * _normal_cdf(x)
    elif ACT == _GELU_TANH:  # 0.5 (1 + tanh(u)) == sigmoid(2u), no tanh intrinsic needed
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        y = x * _sigmoid(2.0 * u)
    elif ACT == _GELU_QUICK:
        y = x * _sigmoid(_GELU_QUICK_C * x)
    elif ACT == _RELU_SQUARED:  # where(x < 0) rather than maximum, which would turn NaN into 0
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
    elif ACT == _SIGMOID:
        y = _sigmoid(x)
    else:
        tl.static_assert(False, "unknown activation code (spec.Act)")
    return y


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x)) for float32 x, sharing the transcendental between the two."""
    if ACT == _SILU:
        s, one_minus_s = _sigmoid_and_complement(x)
        y = x * s
        dy = s * (1.0 + x * one_minus_s)
    elif ACT == _GELU:
        cdf = _normal_cdf(x)
        y = x * cdf
        dy = cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif ACT == _GELU_TANH:
        u = _SQRT_2_OVER_PI * (x + _GELU_TANH_C * x * x * x)
        s, one_minus_s = _sigmoid_and_complement(2.0 * u)
        du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * x * x)
        y = x * s
        dy = s + 2.0 * x * s * one_minus_s * du
    elif ACT == _GELU_QUICK:
        s, one_minus_s = _sigmoid_and_complement(_GELU_QUICK_C * x)
        y = x * s
        dy = s + _GELU_QUICK_C * x * s * one_minus_s
    elif ACT == _RELU_SQUARED:
        r = tl.where(x < 0.0, 0.0, x)
        y = r * r
        dy = 2.0 * r
    elif ACT == _SIGMOID:  # s' = s (1 - s)
        s, one_minus_s = _sigmoid_and_complement(x)
        y = s
        dy = s * one_minus_s
    else:
        tl.static_assert(False, "unknown activation code (spec.Act)")
    return y, dy


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A 1D grid in row-major tile order: programs that run together stream consecutive
    # memory. Walking rows first (a 2D grid) cost 6% on unary forward on H200 (docs/perf.md).
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(n_cols, BLOCK_C)
    rows = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit
def _activation_fwd_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_x, stride_out,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    x = _load(x_ptr + rows * stride_x + cols, mask, EVEN)
    _store(out_ptr + rows * stride_out + cols, _act(x, ACT), mask, EVEN)


@triton.jit
def _activation_bwd_kernel(
    dy_ptr, x_ptr, dx_ptr, n_rows, n_cols, stride_dy, stride_x, stride_dx,
    ACT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dy = _load(dy_ptr + rows * stride_dy + cols, mask, EVEN)
    x = _load(x_ptr + rows * stride_x + cols, mask, EVEN)
    _, grad = _act_and_grad(x, ACT)
    _store(dx_ptr + rows * stride_dx + cols, dy * grad, mask, EVEN)


@triton.jit
def _gated_activation_fwd_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_x, stride_out,
    ACT: tl.constexpr, ACT_FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    # n_cols is the output width d; x rows hold [a | b], 2d wide.
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    a_ptrs = x_ptr + rows * stride_x + cols
    a = _load(a_ptrs, mask, EVEN)
    b = _load(a_ptrs + n_cols, mask, EVEN)
    if ACT_FIRST:
        y = _act(a, ACT) * b
    else:
        y = a * _act(b, ACT)
    _store(out_ptr + rows * stride_out + cols, y, mask, EVEN)


@triton.jit
def _gated_activation_bwd_kernel(
    dy_ptr, x_ptr, dx_ptr, n_rows, n_cols, stride_dy, stride_x, stride_dx,
    ACT: tl.constexpr, ACT_FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    # out = act(a) * b  =>  da = dy * b * act'(a), db = dy * act(a)   (mirrored if not ACT_FIRST)
    rows, cols, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dy = _load(dy_ptr + rows * stride_dy + cols, mask, EVEN)
    a_ptrs = x_ptr + rows * stride_x + cols
    a = _load(a_ptrs, mask, EVEN)
    b = _load(a_ptrs + n_cols, mask, EVEN)
    if ACT_FIRST:
        f, df = _act_and_grad(a, ACT)
        da = dy * b * df
        db = dy * f
    else:
        f, df = _act_and_grad(b, ACT)
        da = dy * f
        db = dy * a * df
    da_ptrs = dx_ptr + rows * stride_dx + cols
    _store(da_ptrs, da, mask, EVEN)
    _store(da_ptrs + n_cols, db, mask, EVEN)
