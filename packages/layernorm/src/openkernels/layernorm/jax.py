"""The layernorm ops on JAX arrays: `rms_norm` and `layer_norm` with the PyTorch API's
arguments, casting contract (reference.py) and math.

x (..., N) is normalized over its last dim. Dtypes: x in float16, bfloat16, float32; weight,
bias and residual in any of those three (mixed precision), or float64 throughout (with
jax_enable_x64, on the jnp backend). Statistics run in float32 (float64 for float64 x).
Both ops work under ``jax.jit`` and differentiate in x, weight, bias and residual through
``jax.custom_vjp`` with the family's backward kernel.

Against the PyTorch API (openkernels.layernorm.api):

* out_dtype and residual_dtype are JAX dtypes (``jnp.float32``, ``"float32"``, ...).
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
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from openkernels.shared import jax as okjax

from .problem import check_shapes_and_scalars

__all__ = ["rms_norm", "layer_norm"]

_HALF_AND_FLOAT = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32))
_F64 = jnp.dtype(jnp.float64)
_DTYPES = (*_HALF_AND_FLOAT, _F64)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about one call (a nondiff argument of the custom_vjp). backend is
    fixed when the forward is traced, so the backward runs there too even when it is
    traced outside the caller's `use_backend` block."""

    rms: bool
    eps: float
    weight_offset: float
    prenorm: bool
    out_dtype: jnp.dtype
    h_dtype: jnp.dtype
    x_dtype: jnp.dtype
    residual_dtype: jnp.dtype | None
    bias_dtype: jnp.dtype | None
    backend: str


# ---- argument checks (the PyTorch API's messages, for JAX arrays) -----------------------


def _dtype_arg(name: str, what: str, dtype: Any, allowed: tuple) -> jnp.dtype | None:
    if dtype is None:
        return None
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise TypeError(f"{name}: {what} must be a floating JAX dtype or None, got {dtype!r}")
    if resolved not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name}: {what}={resolved.name} is not supported here; allowed: {names}")
    return resolved


def _check(
    name: str, x: Any, weight: Any, bias: Any, residual: Any, eps: Any, weight_offset: Any,
    out_dtype: Any, residual_dtype: Any,
) -> tuple[jnp.dtype, jnp.dtype]:  # fmt: skip
    """Raise TypeError / ValueError for bad arguments; returns (out dtype, h dtype)."""
    okjax.check_array(name, "x", x, _DTYPES)
    # Mixed precision within {fp16, bf16, fp32}; float64 only all the way.
    allowed = (_F64,) if x.dtype == _F64 else _HALF_AND_FLOAT
    for what, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None:
            okjax.check_array(name, what, t, allowed)
    shape = lambda t: None if t is None else tuple(t.shape)  # noqa: E731
    check_shapes_and_scalars(
        name,
        tuple(x.shape),
        {"weight": shape(weight), "bias": shape(bias)},
        shape(residual),
        eps,
        weight_offset,
    )
    out = _dtype_arg(name, "out_dtype", out_dtype, allowed) or x.dtype
    h = _dtype_arg(name, "residual_dtype", residual_dtype, allowed)
    return out, h or (residual.dtype if residual is not None else x.dtype)


# ---- jax.numpy composition, mirroring reference.py ---------------------------------------


def _jnp_forward(spec: _Spec, x, weight, bias, residual, store: bool):
    """(y, h or None, mean or None, rstd); statistics of shape x.shape[:-1]."""
    acc = _F64 if x.dtype == _F64 else jnp.dtype(jnp.float32)
    h = x.astype(acc) if residual is None else x.astype(acc) + residual.astype(acc)
    h = h.astype(spec.h_dtype)
    hc = h.astype(acc)
    if spec.rms:
        mean = None
        rstd = jax.lax.rsqrt(jnp.mean(hc * hc, axis=-1) + spec.eps)
        y = hc * rstd[..., None]
    else:
        mean = jnp.mean(hc, axis=-1)
        centered = hc - mean[..., None]
        rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1) + spec.eps)
        y = centered * rstd[..., None]
    if weight is not None:
        y = y * (weight.astype(acc) + spec.weight_offset)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(spec.out_dtype), h if store else None, mean, rstd


def _jnp_backward(spec: _Spec, dy, dh_out, h, weight, mean, rstd, weight_grad: bool, bias_grad: bool):
    """(dh in h's dtype, dweight, dbias in the statistics dtype); see reference.norm_bwd."""
    acc = rstd.dtype
    g, r = dy.astype(acc), rstd[..., None]
    hc = h.astype(acc)
    xhat = (hc if mean is None else hc - mean[..., None]) * r
    wg = g if weight is None else g * (weight.astype(acc) + spec.weight_offset)
    inner = wg - xhat * jnp.mean(wg * xhat, axis=-1, keepdims=True)
    if not spec.rms:
        inner = inner - jnp.mean(wg, axis=-1, keepdims=True)
    dh = r * inner
    if dh_out is not None:
        dh = dh + dh_out.astype(acc)
    rows = tuple(range(h.ndim - 1))
    dw = jnp.sum(g * xhat, axis=rows) if weight_grad else None
    db = jnp.sum(g, axis=rows) if bias_grad else None
    return dh.astype(h.dtype), dw, db


# ---- Triton launches: the kernels and launch plans of the PyTorch path -------------------


@functools.cache
def _gpu_sm_count() -> int:
    # Only the size of the persistent grids depends on it; 132 (H100/H200) where the
    # device does not say.
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _target() -> tuple[str, int]:
    """(vendor, SM count) the launch plans are made for."""
    if okjax.backend() == "triton":
        return okjax.gpu_vendor(), _gpu_sm_count()
    return "cpu", 4  # the interpreter, planned as the PyTorch launchers plan CPU tensors


def _run(launch, arrays: dict) -> dict:
    """Launch a `jax_launch.Launch` on the arrays named by its input roles; returns its
    outputs by pointer name."""
    from .triton import kernels

    outputs = {p: jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for p, shape, dt in launch.outputs}
    results = okjax.launch(
        getattr(kernels, launch.kernel),
        grid=launch.grid,
        inputs={p: arrays[role] for p, role in launch.inputs},
        outputs=outputs,
        constants=dict(launch.constants),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        zeroed=launch.zeroed,
    )
    return dict(zip(outputs, results))


def _triton_forward(spec: _Spec, x, weight, bias, residual, store: bool):
    from .triton.jax_launch import fwd_launch

    x2, n_rows, n_cols = okjax.row_view(x)
    vendor, sm_count = _target()
    launch = fwd_launch(
        n_rows, n_cols, dtype=x.dtype.name, out_dtype=spec.out_dtype.name, h_dtype=spec.h_dtype.name,
        rms=spec.rms, has_residual=residual is not None, store_residual=store, has_weight=weight is not None,
        has_bias=bias is not None, eps=spec.eps, weight_offset=spec.weight_offset, vendor=vendor,
        sm_count=sm_count,
    )  # fmt: skip
    arrays = {"x": x2, "residual": None if residual is None else residual.reshape(n_rows, n_cols),
              "weight": weight, "bias": bias}  # fmt: skip
    out = _run(launch, arrays)
    stats = x.shape[:-1]
    h = out["res_out_ptr"].reshape(x.shape) if store else None
    mean = None if spec.rms else out["mean_ptr"].reshape(stats)
    return out["out_ptr"].reshape(x.shape), h, mean, out["rstd_ptr"].reshape(stats)


def _triton_backward(spec: _Spec, dy, dh_out, h, weight, mean, rstd, weight_grad: bool, bias_grad: bool):
    from .triton.jax_launch import bwd_launch

    h2, n_rows, n_cols = okjax.row_view(h)
    vendor, sm_count = _target()
    launch = bwd_launch(
        n_rows, n_cols, h_dtype=h.dtype.name, rms=spec.rms, has_weight=weight is not None,
        has_dh_out=dh_out is not None, weight_grad=weight_grad, bias_grad=bias_grad,
        weight_offset=spec.weight_offset, vendor=vendor, sm_count=sm_count,
    )  # fmt: skip
    arrays = {
        "dy": dy.reshape(n_rows, n_cols), "h": h2, "weight": weight, "rstd": rstd.reshape(n_rows),
        "mean": None if mean is None else mean.reshape(n_rows),
        "dh_out": None if dh_out is None else dh_out.reshape(n_rows, n_cols),
    }  # fmt: skip
    out = _run(launch, arrays)
    # A fixed-order sum of the per-program partial rows, as the PyTorch launcher does.
    dw = jnp.sum(out["dw_part_ptr"], axis=0) if weight_grad else None
    db = jnp.sum(out["db_part_ptr"], axis=0) if bias_grad else None
    return out["dh_ptr"].reshape(h.shape), dw, db


def _kernels_apply(spec: _Spec, x: jax.Array) -> bool:
    return spec.backend != "jnp" and x.dtype != _F64 and x.size > 0


def _forward(spec: _Spec, x, weight, bias, residual, store: bool):
    impl = _triton_forward if _kernels_apply(spec, x) else _jnp_forward
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
        dy = jnp.zeros(h.shape, spec.out_dtype)
    with okjax.use_backend(spec.backend):
        impl = _triton_backward if _kernels_apply(spec, h) else _jnp_backward
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
