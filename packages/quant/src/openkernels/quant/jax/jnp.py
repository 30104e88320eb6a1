"""The jax.numpy composition of the quant ops (the "jnp" backend), mirroring reference.py:
W dequantized in float32 (float64 for float64), one product, rounded once. It runs for
float32 / float64 activations, empty shapes and wherever the Triton kernels do not."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..format import NF4_VALUES

__all__ = ["work_dtype", "matmul", "dequantize", "linear"]


def work_dtype(dtype: Any) -> jnp.dtype:
    """float64 for float64, else float32: what the reference computes in."""
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with float32 (float64) accumulation; full precision for float32 / float64 inputs
    (torch's default, no TF32)."""
    wide = a.dtype in (jnp.float32, jnp.float64)
    precision = jax.lax.Precision.HIGHEST if wide else None
    return jnp.matmul(a, b, precision=precision, preferred_element_type=work_dtype(a.dtype))


def _unpack_codes(qweight: jax.Array) -> jax.Array:
    """(N, K // 2) uint8 -> (N, K) int32 codes, column 2j from the low nibble of byte j."""
    pairs = jnp.stack((qweight & 0xF, qweight >> 4), axis=-1).astype(jnp.int32)
    return pairs.reshape(qweight.shape[0], -1)


def dequantize(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    """W (N, K) in `dtype`, computed in the work dtype (reference.dequantize_int4_ref)."""
    work = work_dtype(dtype)
    codes = _unpack_codes(qweight)
    s = jnp.repeat(scales.astype(work).T, group_size, axis=1)  # (N, K)
    if kind == "nf4":
        w = jnp.asarray(NF4_VALUES, work)[codes] * s
    else:
        z = 8.0 if zeros is None else jnp.repeat(zeros.astype(work).T, group_size, axis=1)
        w = (codes.astype(work) - z) * s
    return w.astype(dtype)


def linear(x2, qweight, scales, zeros, bias, group_size: int, kind: str) -> jax.Array:
    """x2 (M, K) @ W^T (+ bias) -> (M, N) in x2's dtype (reference.int4_linear_ref)."""
    work = work_dtype(x2.dtype)
    w = dequantize(qweight, scales, zeros, group_size, kind, work)
    y = matmul(x2.astype(work), w.T)
    if bias is not None:
        y = y + bias.astype(work)
    return y.astype(x2.dtype)
