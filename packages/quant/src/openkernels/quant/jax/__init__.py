"""The quant ops on JAX arrays: same names, arguments and math as the PyTorch API (api.py).

    int4_linear(x, weight, bias=None)      x (..., K) @ W^T (+ bias) -> (..., N), x's dtype
    dequantize_int4(weight, dtype)         W (N, K)
    quantize_int4 / quantize_nf4           a float (N, K) weight -> Int4Weight
    from_torch(weight)                     a torch Int4Weight -> Int4Weight (JAX arrays)

`Int4Weight` (jax/format.py) is format.py's layout as a JAX pytree. x: float16 or bfloat16
(the Triton kernels), float32 and float64 (with jax_enable_x64) run the jax.numpy
composition. int4_linear works under ``jax.jit`` and differentiates through
``jax.custom_vjp`` with PyTorch's backward: grad_x = grad_out @ W (W dequantized to x's
dtype), grad_bias = grad_out summed in float32; the 4-bit weight gets no gradient.

Backends (`openkernels.shared.jax`): on "triton" and "interpret" the family's kernels with
the PyTorch path's launch configs and plans (launch.py): the tiled kernel with split-K from
M = 1, dequantize + XLA's GEMM from M = 512; "jnp" is reference.py in jax.numpy (jnp.py: W
in float32, one float32 product, rounded once).
Needs the ``[jax]`` extra: ``pip install openkernels-quant[jax]``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax

from openkernels.shared import jax as okjax

from .. import format as torch_format
from .. import problem

# jax.numpy goes by its full name here: in this package, jnp is the submodule jnp.py.
from . import jnp as jnp_backend
from . import launch
from .format import Int4Weight, from_torch
from .quantize import quantize_int4, quantize_nf4

if TYPE_CHECKING:  # the triton package imports Triton: only where a launch needs it
    from ..triton.configs import LinearConfig

# The ops are named by the op table (problem.OPS); the weight and its quantizers beside them.
__all__ = ["Int4Weight", "from_torch", "quantize_int4", "quantize_nf4", *problem.OPS]

_X_DTYPES = tuple(jax.numpy.dtype(name) for name in problem.X_DTYPES)
_KERNEL_DTYPES = (jax.numpy.dtype("float16"), jax.numpy.dtype("bfloat16"))  # activations the kernels take
_DEQUANT_KERNEL_DTYPES = (*_KERNEL_DTYPES, jax.numpy.dtype("float32"))


# Forward, backward and the custom_vjp tying them.


def _dequantize(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    if okjax.backend() == "jnp" or jax.numpy.dtype(dtype) not in _DEQUANT_KERNEL_DTYPES or qweight.size == 0:
        return jnp_backend.dequantize(qweight, scales, zeros, group_size, kind, dtype)
    return launch.dequantize(qweight, scales, zeros, group_size, kind, dtype)


def _forward(x2, qweight, scales, zeros, bias, group_size: int, kind: str, config: LinearConfig | None):
    (m, k), n = x2.shape, qweight.shape[0]
    if okjax.backend() == "jnp" or x2.dtype not in _KERNEL_DTYPES or m * n * k == 0:
        return jnp_backend.linear(x2, qweight, scales, zeros, bias, group_size, kind)
    cfg = config or launch.config(m, n, k, group_size, kind)
    if cfg.path != "dequant":
        return launch.linear(x2, qweight, scales, zeros, bias, group_size, kind, cfg)
    # Large M: W in x's dtype once, then XLA's GEMM (torch.mm / addmm on the PyTorch path).
    y = jnp_backend.matmul(x2, launch.dequantize(qweight, scales, zeros, group_size, kind, x2.dtype).T)
    if bias is not None:
        y = y + bias.astype(x2.dtype).astype(jax.numpy.float32)
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
    w = _dequantize(qweight, scales, zeros, group_size, kind, dy.dtype)
    grad_x = jnp_backend.matmul(dy, w).astype(dy.dtype)
    grad_bias = None if bias is None else dy.sum(axis=0, dtype=jax.numpy.float32).astype(bias.dtype)
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
    """problem.py's rules on x and bias, plus what is JAX's own: arrays."""
    _check_weight("int4_linear", weight)
    okjax.check_array("int4_linear", "x", x, _X_DTYPES)
    bias_part = problem.Part(tuple(bias.shape), bias.dtype.name) if isinstance(bias, jax.Array) else bias
    problem.check_linear_call(tuple(x.shape), bias_part, *weight.shape, noun="jax.Array")


def _int4_linear(
    x: jax.Array, weight: Int4Weight, bias: jax.Array | None, config: LinearConfig | None
) -> jax.Array:
    """int4_linear with an optional launch config overriding the table (tests, sweeps)."""
    _check_call(x, weight, bias)
    if weight.perm is not None:
        x = jax.numpy.take(x, weight.perm, axis=-1)
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


def dequantize_int4(weight: Int4Weight, dtype: Any = jax.numpy.float32) -> jax.Array:
    """The weight (N, K) in `dtype` (float16, bfloat16, float32, or float64 with
    jax_enable_x64), in the original column order (act-order perm undone). No gradient."""
    _check_weight("dequantize_int4", weight)
    try:
        dtype = jax.numpy.dtype(dtype)
    except TypeError:
        dtype = None
    problem.check_x_dtype("dequantize_int4: dtype", None if dtype is None else dtype.name, dtype)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise TypeError("dequantize_int4: float64 needs jax_enable_x64")
    parts = jax.lax.stop_gradient((weight.qweight, weight.scales, weight.zeros))
    w = _dequantize(*parts, weight.group_size, weight.kind, dtype)
    if weight.perm is not None:
        w = jax.numpy.zeros_like(w).at[:, weight.perm].set(w)
    return w
