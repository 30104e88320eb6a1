"""The quant ops on JAX arrays: same names, arguments and math as the PyTorch API (api.py).

    int4_linear(x, weight, bias=None)      x (..., K) @ W^T (+ bias) -> (..., N), x's dtype
    dequantize_int4(weight, dtype)         W (N, K)
    quantize_int4 / quantize_nf4           a float (N, K) weight -> Int4Weight
    from_torch(weight)                     a torch Int4Weight -> Int4Weight (JAX arrays)

`Int4Weight` (jax_format.py) is format.py's layout as a JAX pytree. x: float16 or bfloat16
(the Triton kernels), float32 and float64 (with jax_enable_x64) run the jax.numpy
composition. int4_linear works under ``jax.jit`` and differentiates through
``jax.custom_vjp`` with PyTorch's backward: grad_x = grad_out @ W (W dequantized to x's
dtype), grad_bias = grad_out summed in float32; the 4-bit weight gets no gradient.

Backends (`openkernels.shared.jax`): on "triton" and "interpret" the family's kernels with
the PyTorch path's launch configs and plans (triton/configs.py, triton/plan.py): the tiled
kernel with split-K from M = 1, dequantize + XLA's GEMM from M = 512; "jnp" is
reference.py in jax.numpy (W in float32, one float32 product, rounded once).
Needs the ``[jax]`` extra: ``pip install openkernels-quant[jax]``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from . import format as torch_format
from .format import NF4_VALUES
from .jax_format import Int4Weight, from_torch
from .jax_quantize import quantize_int4, quantize_nf4

if TYPE_CHECKING:  # the triton package imports Triton: only where a launch needs it
    from .triton.configs import LinearConfig

__all__ = ["Int4Weight", "from_torch", "quantize_int4", "quantize_nf4", "int4_linear", "dequantize_int4"]

_X_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
_KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))  # activations the kernels take
_DEQUANT_KERNEL_DTYPES = (*_KERNEL_DTYPES, jnp.dtype(jnp.float32))


# jax.numpy definitions, mirroring reference.py (the jnp backend and what the tests check).


def _work_dtype(dtype: Any) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with float32 (float64) accumulation; full precision for float32 / float64 inputs
    (torch's default, no TF32)."""
    wide = a.dtype in (jnp.float32, jnp.float64)
    precision = jax.lax.Precision.HIGHEST if wide else None
    return jnp.matmul(a, b, precision=precision, preferred_element_type=_work_dtype(a.dtype))


def _unpack_codes(qweight: jax.Array) -> jax.Array:
    """(N, K // 2) uint8 -> (N, K) int32 codes, column 2j from the low nibble of byte j."""
    pairs = jnp.stack((qweight & 0xF, qweight >> 4), axis=-1).astype(jnp.int32)
    return pairs.reshape(qweight.shape[0], -1)


def _dequantize_jnp(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    work = _work_dtype(dtype)
    codes = _unpack_codes(qweight)
    s = jnp.repeat(scales.astype(work).T, group_size, axis=1)  # (N, K)
    if kind == "nf4":
        w = jnp.asarray(NF4_VALUES, work)[codes] * s
    else:
        z = 8.0 if zeros is None else jnp.repeat(zeros.astype(work).T, group_size, axis=1)
        w = (codes.astype(work) - z) * s
    return w.astype(dtype)


def _linear_jnp(x2, qweight, scales, zeros, bias, group_size: int, kind: str) -> jax.Array:
    work = _work_dtype(x2.dtype)
    w = _dequantize_jnp(qweight, scales, zeros, group_size, kind, work)
    y = _matmul(x2.astype(work), w.T)
    if bias is not None:
        y = y + bias.astype(work)
    return y.astype(x2.dtype)


# Triton launches: the PyTorch path's kernels, configs and plans (triton/plan.py).


@functools.cache
def _gpu_family() -> tuple[str, int]:
    """(arch family, SM / CU count) of JAX's first GPU, as configs.linear_config takes them."""
    from .triton.configs import arch_family

    device = jax.devices()[0]
    arch = "sm_" + str(getattr(device, "compute_capability", "0.0")).replace(".", "")
    return arch_family(okjax.gpu_vendor(), arch), int(getattr(device, "core_count", 0) or 132)


def _config(m: int, n: int, k: int, group_size: int) -> LinearConfig:
    from .triton import config_for
    from .triton.configs import linear_config

    if okjax.backend() == "interpret":  # what the PyTorch launcher picks under the interpreter
        import torch

        return config_for(m, n, k, group_size, torch.device("cpu"))
    return linear_config(m, n, k, group_size, *_gpu_family())


def _launch(plan: Any, arrays: dict, outputs: dict, ints: dict, zeroed: tuple = ()) -> tuple:
    """One launch of a plan.py plan: its inputs from `arrays` (the scales where the kernel
    reads nothing: jax-triton binds arrays by position), absent scratch pointers as None."""
    from .triton import kernels

    inputs, _, absent = plan.pointers()
    arrays = {**arrays, **dict.fromkeys(plan.stand_ins(), arrays["s_ptr"])}
    return okjax.launch(
        getattr(kernels, plan.kernel),
        grid=plan.grid,
        inputs={p: arrays[p] for p in inputs},
        outputs=outputs,
        constants={**ints, **dict.fromkeys(absent), **plan.flags},
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        zeroed=zeroed,
    )


def _weight_arrays(qweight, scales, zeros, bias, kind: str) -> dict:
    """The weight-side pointers by kernel parameter name (None where absent)."""
    lut = jnp.asarray(NF4_VALUES, jnp.float32) if kind == "nf4" else None
    return {"qw_ptr": qweight, "s_ptr": scales, "z_ptr": zeros, "lut_ptr": lut, "bias_ptr": bias}


def _dequantize_triton(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    from .triton.plan import dequant_plan

    n, k = qweight.shape[0], 2 * qweight.shape[1]
    plan = dequant_plan(n, k, group_size, kind, has_zeros=zeros is not None)
    arrays = _weight_arrays(qweight, scales, zeros, None, kind)
    outputs = {"out_ptr": jax.ShapeDtypeStruct((n, k), dtype)}
    (w,) = _launch(plan, arrays, outputs, plan.int_args(k // 2, n, k))
    return w


def _linear_triton(
    x2, qweight, scales, zeros, bias, group_size: int, kind: str, cfg: LinearConfig
) -> jax.Array:
    from .triton.plan import linear_plan

    (m, k), n = x2.shape, qweight.shape[0]
    bitcast = not (okjax.backend() == "interpret" and x2.dtype == jnp.bfloat16)  # as triton/__init__.py
    plan = linear_plan(cfg, m, n, k, group_size, kind, has_zeros=zeros is not None, has_bias=bias is not None,
                       bitcast=bitcast)  # fmt: skip
    arrays = _weight_arrays(qweight, scales, zeros, bias, kind)
    outputs = {"out_ptr": jax.ShapeDtypeStruct((n,) if plan.gemv else (m, n), x2.dtype)}
    if plan.splits > 1:  # split-K scratch: partials, and arrival counters that start at 0
        outputs["ws_ptr"] = jax.ShapeDtypeStruct((plan.partials,), jnp.float32)
        outputs["counter_ptr"] = jax.ShapeDtypeStruct((plan.tiles,), jnp.int32)
    zeroed = ("counter_ptr",) if plan.splits > 1 else ()
    ints = plan.int_args(k, k // 2, n, n)  # JAX arrays are contiguous: row strides are widths
    if plan.gemv:  # one row per launch, as the PyTorch launcher
        rows = [_launch(plan, {**arrays, "x_ptr": x2[r]}, outputs, ints, zeroed)[0] for r in range(m)]
        return jnp.stack(rows)
    return _launch(plan, {**arrays, "x_ptr": x2}, outputs, ints, zeroed)[0]


# Forward, backward and the custom_vjp tying them.


def _dequantize(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    if okjax.backend() == "jnp" or jnp.dtype(dtype) not in _DEQUANT_KERNEL_DTYPES or qweight.size == 0:
        return _dequantize_jnp(qweight, scales, zeros, group_size, kind, dtype)
    return _dequantize_triton(qweight, scales, zeros, group_size, kind, dtype)


def _forward(x2, qweight, scales, zeros, bias, group_size: int, kind: str, config: LinearConfig | None):
    (m, k), n = x2.shape, qweight.shape[0]
    if okjax.backend() == "jnp" or x2.dtype not in _KERNEL_DTYPES or m * n * k == 0:
        return _linear_jnp(x2, qweight, scales, zeros, bias, group_size, kind)
    cfg = config or _config(m, n, k, group_size)
    if cfg.path != "dequant":
        return _linear_triton(x2, qweight, scales, zeros, bias, group_size, kind, cfg)
    # Large M: W in x's dtype once, then XLA's GEMM (torch.mm / addmm on the PyTorch path).
    y = _matmul(x2, _dequantize_triton(qweight, scales, zeros, group_size, kind, x2.dtype).T)
    if bias is not None:
        y = y + bias.astype(x2.dtype).astype(jnp.float32)
    return y.astype(x2.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _linear(x2, qweight, scales, zeros, bias, group_size: int, kind: str, config: LinearConfig | None):
    return _forward(x2, qweight, scales, zeros, bias, group_size, kind, config)


def _linear_fwd(x2, qweight, scales, zeros, bias, group_size, kind, config):
    return _forward(x2, qweight, scales, zeros, bias, group_size, kind, config), (
        qweight,
        scales,
        zeros,
        bias,
    )


def _linear_bwd(group_size, kind, config, residuals, dy):
    qweight, scales, zeros, bias = residuals
    grad_x = _matmul(dy, _dequantize(qweight, scales, zeros, group_size, kind, dy.dtype)).astype(dy.dtype)
    grad_bias = None if bias is None else dy.sum(axis=0, dtype=jnp.float32).astype(bias.dtype)
    return grad_x, None, None, None, grad_bias  # None: no gradient for the 4-bit weight


_linear.defvjp(_linear_fwd, _linear_bwd)


# Public functions.


def _check_weight(name: str, weight: Any) -> None:
    if isinstance(weight, torch_format.Int4Weight):
        raise TypeError(
            f"{name}: weight is a torch Int4Weight; convert it with openkernels.quant.jax.from_torch"
        )
    if not isinstance(weight, Int4Weight):
        raise TypeError(
            f"{name}: weight must be an openkernels.quant.jax.Int4Weight, got {type(weight).__name__}"
        )


def _check_call(x: Any, weight: Any, bias: Any) -> None:
    _check_weight("int4_linear", weight)
    okjax.check_array("int4_linear", "x", x, _X_DTYPES)
    n, k = weight.shape
    if x.ndim == 0 or x.shape[-1] != k:
        raise ValueError(
            f"int4_linear: x has shape {tuple(x.shape)}, its last dimension must be in_features {k}"
        )
    if bias is not None and (
        not isinstance(bias, jax.Array)
        or not jnp.issubdtype(bias.dtype, jnp.floating)
        or tuple(bias.shape) != (n,)
    ):
        raise ValueError(f"int4_linear: bias must be a float jax.Array of shape ({n},), got "
                         f"{getattr(bias, 'shape', type(bias).__name__)} {getattr(bias, 'dtype', '')}")  # fmt: skip


def _int4_linear(
    x: jax.Array, weight: Int4Weight, bias: jax.Array | None, config: LinearConfig | None
) -> jax.Array:
    """int4_linear with an optional launch config overriding the table (tests, sweeps)."""
    _check_call(x, weight, bias)
    if weight.perm is not None:
        x = jnp.take(x, weight.perm, axis=-1)
    n, k = weight.shape
    out = _linear(x.reshape(-1, k), weight.qweight, weight.scales, weight.zeros, bias, weight.group_size,
                  weight.kind, config)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def int4_linear(x: jax.Array, weight: Int4Weight, bias: jax.Array | None = None) -> jax.Array:
    """y = x @ W^T + bias with W a 4-bit weight.

    Args:
        x: (..., K) float16 or bfloat16 (the Triton kernels); float32 and float64 also run
            (the jnp composition). Any leading shape.
        weight: Int4Weight (N, K) from quantize_int4, quantize_nf4 or from_torch.
        bias: optional (N,) float array; added in float32 before the single rounding.

    Returns:
        (..., N) in x's dtype. Differentiable in x and bias (custom_vjp).
    """
    return _int4_linear(x, weight, bias, None)


def dequantize_int4(weight: Int4Weight, dtype: Any = jnp.float32) -> jax.Array:
    """The weight (N, K) in `dtype` (float16, bfloat16, float32, or float64 with
    jax_enable_x64), in the original column order (act-order perm undone). No gradient."""
    _check_weight("dequantize_int4", weight)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype not in _X_DTYPES:
        raise TypeError(f"dequantize_int4: dtype must be float16, bfloat16, float32 or float64, got {dtype}")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise TypeError("dequantize_int4: float64 needs jax_enable_x64")
    parts = jax.lax.stop_gradient((weight.qweight, weight.scales, weight.zeros))
    w = _dequantize(*parts, weight.group_size, weight.kind, dtype)
    if weight.perm is not None:
        w = jnp.zeros_like(w).at[:, weight.perm].set(w)
    return w
