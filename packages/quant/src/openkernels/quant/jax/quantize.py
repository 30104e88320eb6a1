"""Round-to-nearest 4-bit quantization on JAX arrays: quantize.py's math, step for step.

On the CPU, the packed codes, scales and zeros equal quantize.py's bit for bit when search
is None (on GPUs XLA's code may round a tie the other way: seen in 1 of 16 configurations
on the H200):
every step is an elementwise float32 operation (IEEE division and rounding, round half to
even, nearest NF4 level by the same float32 midpoints) in the same order. With
search="clip" each ratio's squared error is a float32 sum whose order XLA picks, so a
group whose two best ratios tie to the last bit may keep the other one (same error up to
rounding). Quantizing is an offline step: it runs eagerly, not under ``jax.jit`` (it
checks values and raises on NaN, infinity and scale overflow).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import problem
from ..format import NF4_VALUES
from .format import SCALE_DTYPES, Int4Weight

__all__ = ["quantize_int4", "quantize_nf4"]

_CHUNK_ELEMENTS = 1 << 24  # rows per pass keep float32 temporaries near 64 MB each, as in quantize.py


def _round_to(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """float32 x rounded to `dtype` (to nearest even, overflow to inf), kept in float32.

    A plain convert pair is not enough: XLA may drop it on GPUs (excess precision allowed
    by default), and the scales then differ from quantize.py's (seen on the H200).
    reduce_precision is kept but flushes values below the smallest normal; those round on
    the dtype's subnormal grid instead (exact float32 steps: a power-of-two scaling, a
    round half to even, the scaling back).
    """
    info = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp >= 8:  # bfloat16: its subnormals are float32 subnormals, flushed on GPUs anyway
        return rounded
    step = float(info.smallest_subnormal)
    subnormal = jnp.round(x / step) * step
    return jnp.where(jnp.abs(x) < float(info.smallest_normal), subnormal, rounded)


def _fit(w: jax.Array, kind: str, symmetric: bool, ratio: float, scale_dtype: jnp.dtype):
    """Scales (R, G), zeros (R, G) or None, codes (R, G, gs) and squared errors (R, G) of
    groups w (R, G, gs) at clip ratio `ratio` (quantize.py's _fit)."""
    zero = None
    if kind == "nf4" or symmetric:
        top = jnp.abs(w).max(axis=-1) * ratio
        scale = top if kind == "nf4" else top / 7
    else:
        # The range holds 0, so that the zero point is a code (quantize.py's _fit).
        hi = jnp.maximum(w.max(axis=-1) * ratio, 0.0)
        lo = jnp.minimum(w.min(axis=-1) * ratio, 0.0)
        scale = (hi - lo) / 15
    scale = _round_to(scale, scale_dtype)
    scale = jnp.where(scale > 0, scale, 1.0)  # all-zero group: any scale works
    s = scale[..., None]
    if kind == "nf4":
        levels = jnp.asarray(NF4_VALUES, jnp.float32)
        edges = (levels[1:] + levels[:-1]) / 2
        codes = jnp.searchsorted(edges, w / s, side="left")  # torch.bucketize(right=False)
        deq = levels[codes] * s
    else:
        zero_f = jnp.full_like(scale, 8.0) if symmetric else jnp.clip(jnp.round(-lo / scale), 0, 15)
        zero = None if symmetric else zero_f
        codes = jnp.clip(jnp.round(w / s) + zero_f[..., None], 0, 15)
        deq = (codes - zero_f[..., None]) * s
    err = jnp.square(deq - w).sum(axis=-1)
    return scale, zero, codes.astype(jnp.uint8), err


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _quantize_rows(w: jax.Array, ratios: jax.Array, group_size: int, kind: str, symmetric: bool, scale_dtype):
    """Rows w (R, K) at clip ratios (float32, 1.0 first) -> packed codes (R, K // 2), scales
    (G, R), zeros (G, R) or None, and whether any tried scale overflowed scale_dtype."""
    rows, k = w.shape
    w = w.astype(jnp.float32).reshape(rows, k // group_size, group_size)

    def fit(r):
        scale, zero, codes, err = _fit(w, kind, symmetric, r, scale_dtype)
        return (scale, zero, codes, err), ~jnp.isfinite(scale).all()

    def step(best, r):  # strict improvement keeps the earlier ratio on ties, as quantize.py
        new, overflow = fit(r)
        better = new[3] < best[3]  # (R, G); codes are (R, G, gs)

        def pick(a, b):
            return None if a is None else jnp.where(better.reshape(better.shape + (1,) * (a.ndim - 2)), a, b)

        return tuple(pick(a, b) for a, b in zip(new, best)), overflow

    first, overflow = fit(ratios[0])
    (scale, zero, codes, _), overflows = jax.lax.scan(step, first, ratios[1:])  # one compiled step
    codes = codes.reshape(rows, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    zeros = None if zero is None else zero.T.astype(scale_dtype)
    return packed, scale.T.astype(scale_dtype), zeros, overflow | overflows.any()


def _check(weight, group_size, scale_dtype, search: str | None, grid: int, min_ratio: float) -> int:
    """problem.check_quantize_options, plus what is JAX's own; returns the resolved group size."""
    if isinstance(weight, jax.core.Tracer):
        raise TypeError("quantize: runs eagerly (it checks the weight's values), not under jax.jit")
    if not isinstance(weight, jax.Array) or weight.ndim != 2:
        raise ValueError(
            f"weight must be a 2D jax.Array (out_features, in_features), got {getattr(weight, 'shape', weight)}"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"weight must be a float array, got {weight.dtype}")
    if jnp.dtype(scale_dtype) not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be jnp.float16 or jnp.bfloat16, got {scale_dtype}")
    group_size = problem.resolve_group_size(group_size, weight.shape[1])
    problem.check_quantize_options(weight.shape[1], group_size, search, grid, min_ratio)
    if weight.size and not bool(jnp.isfinite(weight).all()):
        raise ValueError("weight contains NaN or infinity")
    return group_size


def _quantize(weight, group_size, kind, symmetric, search, scale_dtype, grid, min_ratio) -> Int4Weight:
    group_size = _check(weight, group_size, scale_dtype, search, grid, min_ratio)
    scale_dtype = jnp.dtype(scale_dtype)
    # Ratios in float32, as torch rounds a Python scalar multiplying a float32 tensor.
    ratios = jnp.asarray(problem.clip_ratios(search, grid, min_ratio), jnp.float32)
    n, k = weight.shape
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    parts = [
        _quantize_rows(weight[start : start + rows], ratios, group_size, kind, symmetric, scale_dtype)
        for start in range(0, n, rows)
    ]
    if not parts:  # no rows: empty parts of the right shapes
        parts = [
            _quantize_rows(jnp.zeros((0, k), jnp.float32), ratios, group_size, kind, symmetric, scale_dtype)
        ]
    if any(bool(p[3]) for p in parts):
        raise ValueError(f"a group's scale overflows {scale_dtype}; pass scale_dtype=jnp.bfloat16")
    packed = jnp.concatenate([p[0] for p in parts])
    scales = jnp.concatenate([p[1] for p in parts], axis=1)
    zeros = None if parts[0][2] is None else jnp.concatenate([p[2] for p in parts], axis=1)
    return Int4Weight(packed, scales, zeros, group_size, kind)


def quantize_int4(
    weight: jax.Array,
    group_size: int | None = 128,
    symmetric: bool = False,
    *,
    search: str | None = None,
    scale_dtype=jnp.float16,
    grid: int = 20,
    min_ratio: float = 0.5,
) -> Int4Weight:
    """Quantize a weight (out_features, in_features) to 4-bit integers (quantize.quantize_int4).

    Args:
        weight: (N, K) float array, K even.
        group_size: 32, 64, 128, or None for one group per row; must divide K.
        symmetric: no zeros, codes centered on 8 (scale = max|w| / 7); else per-group
            zeros from the group's min and max.
        search: None (round to nearest) or "clip" (per-group clipping ratio search, `grid`
            steps from 1 down to `min_ratio`, keeping the smallest squared error).
        scale_dtype (jax.typing.DTypeLike): jnp.float16 (default) or jnp.bfloat16 for scales
            and zeros.

    Returns:
        jax Int4Weight with kind "int4"; qweight (N, K // 2) uint8, scales / zeros (K // group, N).
    """
    return _quantize(weight, group_size, "int4", symmetric, search, scale_dtype, grid, min_ratio)


def quantize_nf4(
    weight: jax.Array,
    group_size: int | None = 64,
    *,
    search: str | None = None,
    scale_dtype=jnp.float16,
    grid: int = 20,
    min_ratio: float = 0.5,
) -> Int4Weight:
    """Quantize a weight (N, K) to NF4 (blocks of 64 by default, scale = the block's max|w|);
    same arguments as `quantize_int4`; a jax Int4Weight with kind "nf4" and no zeros."""
    return _quantize(weight, group_size, "nf4", True, search, scale_dtype, grid, min_ratio)
