"""The jax.numpy definitions of the activations (the "jnp" backend), mirroring reference.py:
for float64, empty inputs and wherever the Triton kernels do not run."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..spec import Act

__all__ = ["forward", "backward"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


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


def forward(x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    xf = x.astype(_compute_dtype(x.dtype))
    if not gated:
        return _act(xf, act).astype(x.dtype)
    a, b = jnp.split(xf, 2, axis=-1)
    out = _act(a, act) * b if act_first else a * _act(b, act)
    return out.astype(x.dtype)


def backward(dy: jax.Array, x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
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
