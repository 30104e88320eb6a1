"""The rotary embedding in jax.numpy (the "jnp" backend of openkernels.attention.jax.apply_rotary)."""

from __future__ import annotations

import jax.numpy as jnp

from ...core.jax.jnp import compute_dtype

__all__ = ["rotate_half"]


def rotate_half(x, cos, sin, transpose: bool):
    """rotary/reference.py's _rotate_half: x (B, S, H, D) by cos, sin (Bc, S, R) or (S, R), or its
    transpose (the backward), in the compute dtype, rounded to x's dtype."""
    acc = compute_dtype(x.dtype)
    half = cos.shape[-1] // 2
    c, s = cos.astype(acc)[..., None, :], sin.astype(acc)[..., None, :]  # broadcast over heads
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        s1, s2 = -s2, -s1
    xf = x.astype(acc)
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    out = jnp.concatenate((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, xf[..., 2 * half :]), axis=-1)
    return out.astype(x.dtype)
