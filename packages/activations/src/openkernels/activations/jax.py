"""The activations ops on JAX arrays: same names, arguments and math as the PyTorch API.

Unary ops take x of any shape; gated ops take x of shape (..., 2d) and return (..., d).
Dtypes: float16, bfloat16, float32 (float64 too with jax_enable_x64, on the jnp backend).
Math is float32 inside, rounded once to the input dtype. Every op works under
``jax.jit`` and differentiates through ``jax.custom_vjp`` with the family's backward
kernels. There is no ``out=``: JAX arrays are immutable.

Backends (`openkernels.shared.jax`): the family's Triton kernels through jax-triton on
GPUs, the Triton interpreter for tests, and a jax.numpy composition everywhere else.
Needs the ``[jax]`` extra: ``pip install openkernels-activations[jax]``.

The functions are made from the op table (`spec.SPECS`), one per op of
`openkernels.activations`: its name, its docstring, and its arguments without ``out=``
(``x``, and ``approximate="none"`` for the GELU ops).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from . import api as _api
from .spec import APPROXIMATE as _APPROXIMATE
from .spec import SPECS, Act, OpSpec, act_for

__all__ = list(SPECS)  # one function per op of the table

_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# jax.numpy definitions, mirroring reference.py (the jnp backend and the checks' ground truth).


def _act(x: jax.Array, act: Act) -> jax.Array:
    if act == Act.SILU:
        return x * jax.nn.sigmoid(x)
    if act == Act.GELU:
        return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))
    if act == Act.GELU_TANH:
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if act == Act.GELU_QUICK:
        return x * jax.nn.sigmoid(1.702 * x)
    if act == Act.RELU_SQUARED:
        return jnp.square(jnp.maximum(x, 0.0))
    if act == Act.SIGMOID:
        return jax.nn.sigmoid(x)
    raise ValueError(f"unknown activation {act!r}")


def _act_grad(x: jax.Array, act: Act) -> jax.Array:
    # 1 - sigmoid(z) as sigmoid(-z): the subtraction cancels in float32 (as in reference.py).
    sig = jax.nn.sigmoid
    if act == Act.SILU:
        return sig(x) * (1.0 + x * sig(-x))
    if act == Act.GELU:
        return 0.5 * (1.0 + jax.lax.erf(x / math.sqrt(2.0))) + x * _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)
    if act == Act.GELU_TANH:
        u = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
        du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return sig(2 * u) + 2.0 * x * sig(2 * u) * sig(-2 * u) * du
    if act == Act.GELU_QUICK:
        s = sig(1.702 * x)
        return s + 1.702 * x * s * sig(-1.702 * x)
    if act == Act.RELU_SQUARED:
        return 2.0 * jnp.maximum(x, 0.0)
    if act == Act.SIGMOID:
        return sig(x) * sig(-x)
    raise ValueError(f"unknown activation {act!r}")


def _compute_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def _jnp_fwd(x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    xf = x.astype(_compute_dtype(x.dtype))
    if not gated:
        return _act(xf, act).astype(x.dtype)
    a, b = jnp.split(xf, 2, axis=-1)
    out = _act(a, act) * b if act_first else a * _act(b, act)
    return out.astype(x.dtype)


def _jnp_bwd(dy: jax.Array, x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    dt = _compute_dtype(x.dtype)
    g, xf = dy.astype(dt), x.astype(dt)
    if not gated:
        return (g * _act_grad(xf, act)).astype(x.dtype)
    a, b = jnp.split(xf, 2, axis=-1)
    if act_first:
        da, db = g * b * _act_grad(a, act), g * _act(a, act)
    else:
        da, db = g * _act(b, act), g * a * _act_grad(b, act)
    return jnp.concatenate([da, db], axis=-1).astype(x.dtype)


# Triton launches: the kernels and launch plans of the PyTorch path.


def _launch(
    kernel_name: str, inputs: dict, output: tuple[str, tuple[int, int]], n_cols: int, dtype, constants: dict
):
    """One kernel launch; n_cols is the output width d for gated ops, as from PyTorch."""
    from .triton import configs, kernels

    vendor = okjax.gpu_vendor() if okjax.backend() == "triton" else "cuda"
    out_name, out_shape = output
    n_rows = out_shape[0]
    cfg, grid, even = configs.plan(n_rows, n_cols, okjax.torch_dtype(dtype), vendor)
    # JAX arrays are contiguous: every row stride is the row's width.
    strides = {f"stride_{name[: -len('_ptr')]}": a.shape[1] for name, a in inputs.items()}
    strides[f"stride_{out_name[: -len('_ptr')]}"] = out_shape[1]
    (out,) = okjax.launch(
        getattr(kernels, kernel_name),
        grid=grid,
        inputs=inputs,
        outputs={out_name: jax.ShapeDtypeStruct(out_shape, dtype)},
        constants={
            "n_rows": n_rows,
            "n_cols": n_cols,
            **strides,
            **constants,
            "BLOCK_R": cfg.block_rows,
            "BLOCK_C": cfg.block_cols,
            "EVEN": even,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _constants(act: Act, gated: bool, act_first: bool) -> dict:
    return {"ACT": int(act), "ACT_FIRST": act_first} if gated else {"ACT": int(act)}


def _triton_applies(x: jax.Array) -> bool:
    return okjax.backend() != "jnp" and x.dtype != jnp.float64 and x.size > 0


def _forward(x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    if not _triton_applies(x):
        return _jnp_fwd(x, act, gated, act_first)
    x2, n_rows, n_cols = okjax.row_view(x)
    d = n_cols // 2 if gated else n_cols
    kernel = "_gated_activation_fwd_kernel" if gated else "_activation_fwd_kernel"
    out = _launch(
        kernel, {"x_ptr": x2}, ("out_ptr", (n_rows, d)), d, x.dtype, _constants(act, gated, act_first)
    )
    return out.reshape(*x.shape[:-1], d) if x.ndim else out.reshape(())


def _backward(dy: jax.Array, x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    if not _triton_applies(x):
        return _jnp_bwd(dy, x, act, gated, act_first)
    x2, n_rows, n_cols = okjax.row_view(x)
    dy2, _, d = okjax.row_view(dy.astype(x.dtype))
    kernel = "_gated_activation_bwd_kernel" if gated else "_activation_bwd_kernel"
    inputs = {"dy_ptr": dy2, "x_ptr": x2}
    dx = _launch(kernel, inputs, ("dx_ptr", (n_rows, n_cols)), d, x.dtype, _constants(act, gated, act_first))
    return dx.reshape(x.shape)


# The backend is a static argument, read when the public function is called: a backward
# traced later (a vjp function called outside the caller's `use_backend` block) still
# runs where the forward ran.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _apply(x: jax.Array, act: Act, gated: bool, act_first: bool, backend: str) -> jax.Array:
    with okjax.use_backend(backend):
        return _forward(x, act, gated, act_first)


def _apply_fwd(x, act, gated, act_first, backend):
    return _apply(x, act, gated, act_first, backend), x


def _apply_bwd(act, gated, act_first, backend, x, dy):
    with okjax.use_backend(backend):
        return (_backward(dy, x, act, gated, act_first),)


_apply.defvjp(_apply_fwd, _apply_bwd)


def _call(name: str, x: jax.Array, approximate: str = "none") -> jax.Array:
    okjax.check_array(name, "x", x, _DTYPES)
    if approximate not in _APPROXIMATE:
        raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    spec = SPECS[name]
    if spec.gated and (x.ndim == 0 or x.shape[-1] % 2):
        raise ValueError(
            f"{name}: x must have an even last dim (..., 2*d) holding the two halves, got shape {tuple(x.shape)}"
        )
    return _apply(x, act_for(spec, approximate), spec.gated, spec.act_first, okjax.backend())


def _public(spec: OpSpec) -> Callable[..., jax.Array]:
    """The JAX function of one op: the PyTorch function's name, docstring and arguments
    (less ``out=``)."""
    name = spec.name
    if spec.approximate:

        def fn(x: jax.Array, approximate: str = "none") -> jax.Array:
            return _call(name, x, approximate)
    else:

        def fn(x: jax.Array) -> jax.Array:
            return _call(name, x)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = getattr(_api, name).__doc__
    return fn


globals().update({name: _public(spec) for name, spec in SPECS.items()})
