"""jax.numpy compositions of attention against a KV cache, mirroring ../reference.py: the
append (a functional scatter) on every backend, and the attention for the "jnp" backend and
what no kernel takes (float32). The attention itself is ../../core/jax/jnp.py's dense one with
per-sequence key lengths."""

from __future__ import annotations

import jax.numpy as jnp

from ...core.jax.jnp import dense_fwd
from ...core.problem import Problem

__all__ = ["rotate_at", "kvcache_append", "kvcache_attention"]


def rotate_at(x, positions, cos, sin, interleaved: bool):
    """../reference.py's rotate: x (B, S, H, D) at positions (B, S) by cos, sin (rows, R / 2), in
    float32 (the first R elements of each head; halves or interleaved pairs)."""
    half = cos.shape[-1]
    c = cos.astype(jnp.float32)[positions][..., None, :]  # (B, S, 1, R / 2)
    s = sin.astype(jnp.float32)[positions][..., None, :]
    x = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        rot = jnp.stack((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1).reshape(*x.shape[:-1], 2 * half)
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        rot = jnp.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1)
    return jnp.concatenate((rot, x[..., 2 * half :]), axis=-1)


def _slots(positions, block_table, page: int):
    """Storage index (lead 0, lead 1) of each sequence's token positions (B, S)."""
    if block_table is None:
        return jnp.arange(positions.shape[0])[:, None], positions
    return jnp.take_along_axis(block_table, positions // page, axis=1), positions % page


def kvcache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, cos, sin, interleaved: bool,
                   leftpad=None):  # fmt: skip
    """The caches with k_new (rotated first when cos is given) and v_new written at
    cache_seqlens[b] + t: a functional scatter (in place under jit with donated caches).
    leftpad (B,) or None: sequence b's tokens start at slot leftpad[b] of its storage, and
    cache_seqlens counts from there (the rotary position of token t)."""
    positions = cache_seqlens[:, None] + jnp.arange(k_new.shape[1])[None, :]
    k = k_new if cos is None else rotate_at(k_new, positions, cos, sin, interleaved)
    at = positions if leftpad is None else positions + leftpad[:, None]
    lead = _slots(at, block_table, k_cache.shape[1])
    return k_cache.at[lead].set(k.astype(k_cache.dtype)), v_cache.at[lead].set(v_new.astype(v_cache.dtype))


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, p: Problem, seqlen_new: int,
                      interleaved: bool, leftpad=None):  # fmt: skip
    """out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) of q against each sequence's first
    cache_seqlens[b] + seqlen_new cache positions (query i at position L - Sq + i, also its
    rotary position); slopes (B, Hq) float32 or None; leftpad as in kvcache_append (the
    positions start at that slot)."""
    batch, seqlen_q = q.shape[:2]
    lengths = cache_seqlens + seqlen_new
    if block_table is not None:  # the pages of each sequence, in order: (B, pages * page, Hkv, D)
        k_cache, v_cache = (c[block_table].reshape(batch, -1, *c.shape[2:]) for c in (k_cache, v_cache))
    if leftpad is not None:  # each sequence's tokens from its first slot on (wrapped tail: masked below)
        index = (leftpad[:, None] + jnp.arange(k_cache.shape[1])[None, :]) % k_cache.shape[1]
        k_cache, v_cache = (
            jnp.take_along_axis(c, index[:, :, None, None], axis=1) for c in (k_cache, v_cache)
        )
    keep = (jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None])[..., None, None]
    k, v = (jnp.where(keep, c, jnp.zeros((), c.dtype)) for c in (k_cache, v_cache))  # no stray NaN
    if cos is not None:
        positions = jnp.maximum(lengths[:, None] - seqlen_q + jnp.arange(seqlen_q)[None, :], 0)
        q = rotate_at(q, positions, cos, sin, interleaved).astype(q.dtype)
    return dense_fwd(q, k, v, slopes, p, jnp.full((batch,), seqlen_q, jnp.int32), lengths)
