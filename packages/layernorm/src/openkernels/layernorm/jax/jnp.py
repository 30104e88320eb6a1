"""The jax.numpy composition of the norms (the "jnp" backend), mirroring reference.py: for
float64, empty inputs and wherever the Triton kernels do not run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from . import _Spec as Spec

__all__ = ["forward", "backward"]


def forward(spec: Spec, x, weight, bias, residual, store: bool):
    """(y, h or None, mean or None, rstd); statistics of shape x.shape[:-1]."""
    acc = x.dtype if x.dtype == jnp.float64 else jnp.dtype(jnp.float32)
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


def backward(spec: Spec, dy, dh_out, h, weight, mean, rstd, weight_grad: bool, bias_grad: bool):
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
