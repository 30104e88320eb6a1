"""The layernorm ops on JAX arrays: `rms_norm` and `layer_norm` with the PyTorch API's
arguments, casting contract (reference.py) and math.

x (..., N) is normalized over its last dim. Dtypes: x in float16, bfloat16, float32; weight,
bias and residual in any of those three (mixed precision), or float64 throughout (with
jax_enable_x64, on the jnp backend). Statistics run in float32 (float64 for float64 x).
Both ops work under ``jax.jit`` and differentiate in x, weight, bias and residual through
``jax.custom_vjp`` with the family's backward kernel.

Against the PyTorch API (openkernels.layernorm.api):

* out_dtype and residual_dtype are JAX dtypes (``jax.numpy.float32``, ``"float32"``, ...).
* eps and weight_offset must be Python numbers, not traced values: the kernels take them
  as compile-time constants (JAX passes every non-array argument that way).
* No nn.Module classes, no device checks (JAX places arrays) and no strided views (JAX
  arrays are contiguous).
* Gradients follow JAX's differentiation: weight and bias gradients are computed only
  for the arguments being differentiated, and a zero cotangent of h (prenorm) is not read.
* ``jax.vmap`` works on the jnp backend only (the kernel launches have no batching rule);
  a norm over the last dim needs none: call it on the batched array.

Backends (`openkernels.shared.jax`): the family's Triton kernels with the PyTorch path's
launch plans, through jax-triton on GPUs or the Triton interpreter in tests; a jax.numpy
composition mirroring reference.py everywhere else, for float64 and for empty inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.custom_derivatives import SymbolicZero

from openkernels.shared import jax as okjax

from ..problem import DTYPES, NORMS, check_arrays

# jax.numpy goes by its full name here: in this package, jnp is the submodule jnp.py.
from . import jnp as jnp_backend
from . import launch

__all__ = [*NORMS]

_F64 = jax.numpy.dtype(jax.numpy.float64)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one call (a nondiff argument of the custom_vjp). backend is
    fixed when the forward is traced, so the backward runs there too even when it is
    traced outside the caller's `use_backend` block."""

    rms: bool
    eps: float
    weight_offset: float
    prenorm: bool
    out_dtype: jax.numpy.dtype
    h_dtype: jax.numpy.dtype
    x_dtype: jax.numpy.dtype
    residual_dtype: jax.numpy.dtype | None
    bias_dtype: jax.numpy.dtype | None
    backend: str


# ---- argument checks (the PyTorch API's messages, for JAX arrays) -----------------------


def _dtype_arg(name: str, what: str, dtype: Any, allowed: tuple) -> jax.numpy.dtype | None:
    if dtype is None:
        return None
    try:
        resolved = jax.numpy.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jax.numpy.issubdtype(resolved, jax.numpy.floating):
        raise TypeError(f"{name}: {what} must be a floating JAX dtype or None, got {dtype!r}")
    if resolved.name not in allowed:
        raise TypeError(
            f"{name}: {what}={resolved.name} is not supported here; allowed: {', '.join(allowed)}"
        )
    return resolved


def _check(
    name: str, x: Any, weight: Any, bias: Any, residual: Any, eps: Any, weight_offset: Any,
    out_dtype: Any, residual_dtype: Any,
) -> tuple[jax.numpy.dtype, jax.numpy.dtype]:  # fmt: skip
    """Raise TypeError / ValueError for bad arguments; returns (out dtype, h dtype)."""
    okjax.check_array(name, "x", x, DTYPES)

    def check_array(what: str, t: Any, names: tuple[str, ...]) -> None:
        okjax.check_array(name, what, t, names)

    arrays = (weight, bias, residual)
    allowed = check_arrays(name, tuple(x.shape), x.dtype.name, arrays, eps, weight_offset, check_array)
    out = _dtype_arg(name, "out_dtype", out_dtype, allowed) or x.dtype
    h = _dtype_arg(name, "residual_dtype", residual_dtype, allowed)
    return out, h or (residual.dtype if residual is not None else x.dtype)


def _kernels_apply(spec: _Spec, x: jax.Array) -> bool:
    return spec.backend != "jnp" and x.dtype != _F64 and x.size > 0


def _forward(spec: _Spec, x, weight, bias, residual, store: bool):
    impl = launch.forward if _kernels_apply(spec, x) else jnp_backend.forward
    return impl(spec, x, weight, bias, residual, store)


# ---- differentiation ----------------------------------------------------------------------


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Wanted:
    """Which parameter gradients the backward computes (those being differentiated): a
    static pytree node, so it rides along with the saved arrays."""

    weight: bool
    bias: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _norm(spec: _Spec, x, weight, bias, residual):
    y, h, _, _ = _forward(spec, x, weight, bias, residual, spec.prenorm)
    return (y, h) if spec.prenorm else y


def _norm_fwd(spec: _Spec, x, weight, bias, residual):
    # symbolic_zeros: the arguments come wrapped, saying whether they are differentiated.
    wanted = _Wanted(weight is not None and weight.perturbed, bias is not None and bias.perturbed)
    x, weight, bias, residual = (None if a is None else a.value for a in (x, weight, bias, residual))
    # The backward reads h: stored unless it is x itself (as the PyTorch autograd saves it).
    store = spec.prenorm or residual is not None or spec.h_dtype != x.dtype
    y, h, mean, rstd = _forward(spec, x, weight, bias, residual, store)
    return ((y, h) if spec.prenorm else y), (x if h is None else h, weight, mean, rstd, wanted)


def _norm_bwd(spec: _Spec, saved, cotangents):
    h, weight, mean, rstd, wanted = saved
    dy, dh_out = cotangents if spec.prenorm else (cotangents, None)
    # A zero cotangent of h adds nothing (no dh_out read); one of y, where only h was used
    # downstream, still needs the backward's form: zeros, as in the PyTorch autograd.
    if isinstance(dh_out, SymbolicZero):
        dh_out = None
    if isinstance(dy, SymbolicZero):
        dy = jax.numpy.zeros(h.shape, spec.out_dtype)
    with okjax.use_backend(spec.backend):
        impl = launch.backward if _kernels_apply(spec, h) else jnp_backend.backward
        dh, dw, db = impl(spec, dy, dh_out, h, weight, mean, rstd, wanted.weight, wanted.bias)
    # None: a zero cotangent (an argument that is not differentiated, or absent).
    return (
        dh.astype(spec.x_dtype),
        dw.astype(weight.dtype) if wanted.weight else None,
        db.astype(spec.bias_dtype) if wanted.bias else None,
        None if spec.residual_dtype is None else dh.astype(spec.residual_dtype),
    )


_norm.defvjp(_norm_fwd, _norm_bwd, symbolic_zeros=True)


def _call(rms: bool, x, weight, bias, residual, eps, weight_offset, prenorm, out_dtype, h_dtype):
    spec = _Spec(
        rms, float(eps), float(weight_offset), bool(prenorm), out_dtype, h_dtype, x.dtype,
        None if residual is None else residual.dtype, None if bias is None else bias.dtype, okjax.backend(),
    )  # fmt: skip
    return _norm(spec, x, weight, bias, residual)


# ---- public API ---------------------------------------------------------------------------


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    eps: float = 1e-6,
    *,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype: Any = None,
    residual_dtype: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm over the last dim: y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset).

    x: (..., N); weight: (N,) or None; residual: x's shape or None, then h = x + residual
    (rounded to residual_dtype, default residual's dtype) is what gets normalized, in one
    pass. Returns y (..., N) in out_dtype (default x's dtype), or (y, h) with prenorm=True,
    h being the residual stream for the next block. weight_offset=1.0 gives Gemma's (1 + w).
    eps, weight_offset: Python numbers (compile-time constants). Differentiable in x,
    weight and residual.
    """
    out_dt, h_dt = _check(
        "rms_norm", x, weight, None, residual, eps, weight_offset, out_dtype, residual_dtype
    )
    return _call(True, x, weight, None, residual, eps, weight_offset, prenorm, out_dt, h_dt)


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    bias: jax.Array | None = None,
    eps: float = 1e-5,
    *,
    residual: jax.Array | None = None,
    prenorm: bool = False,
    out_dtype: Any = None,
    residual_dtype: Any = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """LayerNorm over the last dim: y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias.

    x: (..., N); weight, bias: (N,) or None; residual, prenorm, out_dtype, residual_dtype
    as in `rms_norm`. The variance is the biased one, as in torch.nn.LayerNorm.
    Differentiable in x, weight, bias and residual.
    """
    out_dt, h_dt = _check("layer_norm", x, weight, bias, residual, eps, 0.0, out_dtype, residual_dtype)
    return _call(False, x, weight, bias, residual, eps, 0.0, prenorm, out_dt, h_dt)
