"""Argument checks of openkernels.attention.jax: api.py's checks and messages, for jax.Array
(values are checked only where they are known: not while jax.jit traces)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import problem
from .problem import HEAD_DIMS, check_lengths, check_qkv_shapes

__all__ = ["check_qkv", "check_alibi", "check_cu_seqlens", "concrete", "DTYPES"]

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def check_qkv(name: str, q: object, k: object, v: object, dims: int) -> None:
    layout = "(batch, seqlen, heads, head_dim)" if dims == 4 else "(tokens, heads, head_dim)"
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, jax.Array):
            raise TypeError(f"{name}: {what} must be a jax.Array, got {type(t).__name__}")
        if t.ndim != dims:
            raise ValueError(f"{name}: {what} must be {dims}D {layout}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: q, k, v must share a dtype, got q {q.dtype} and {what} {t.dtype}")
    if q.dtype not in DTYPES:
        raise TypeError(f"{name}: dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    check_qkv_shapes(name, tuple(q.shape), tuple(k.shape), tuple(v.shape), dims, HEAD_DIMS)


def check_alibi(name: str, alibi_slopes: object, heads: int, n_seqs: int) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, jax.Array):
        raise TypeError(
            f"{name}: alibi_slopes must be a jax.Array or None, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != jnp.float32:
        raise TypeError(f"{name}: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    problem.check_alibi_shape(name, tuple(alibi_slopes.shape), heads, n_seqs)


def concrete(x: jax.Array) -> np.ndarray | None:
    """x's values when they are known now (not while tracing): one device-to-host copy."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_cu_seqlens(name: str, what: str, cu: object, tokens: int, max_seqlen: object) -> None:
    if not isinstance(cu, jax.Array):
        raise TypeError(f"{name}: {what} must be a jax.Array, got {type(cu).__name__}")
    if cu.dtype != jnp.int32:
        raise TypeError(f"{name}: {what} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: {what} must be 1D (n_seqs + 1,), got shape {tuple(cu.shape)}")
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise ValueError(f"{name}: max_seqlen for {what} must be a Python int >= 0, got {max_seqlen!r}")
    values = concrete(cu)
    if values is None:
        return  # under jax.jit: the caller vouches for the values (as for any index array)
    problem.check_cu_values(name, what, values.tolist(), tokens, max_seqlen)


_CACHE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def check_kvcache(
    name,
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k_new,
    v_new,
    block_table,
    rotary_cos,
    rotary_sin,
    rows_indexed: bool = False,
) -> None:
    """api._check_kvcache for 16-bit (and float32) caches as jax.Arrays; rows_indexed: a
    contiguous cache whose rows cache_batch_idx picks (any number of rows)."""
    if not isinstance(q, jax.Array) or q.ndim != 4:
        raise ValueError(f"{name}: q must be a 4D (batch, seqlen_q, heads_q, head_dim) jax.Array")
    if q.dtype not in _CACHE_DTYPES:
        raise TypeError(f"{name}: q's dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    batch, seqlen_q, _, head_dim = q.shape
    problem.check_head_dim(name, head_dim, HEAD_DIMS)
    for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, jax.Array):
            raise TypeError(f"{name}: {what} must be a jax.Array in q's dtype (quantized caches are not supported "
                            f"on JAX), got {type(t).__name__}")  # fmt: skip
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {what} must have q's dtype {q.dtype}, got {t.dtype}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must be 4D of one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")  # fmt: skip
    heads_kv = k_cache.shape[2]
    paged = block_table is not None
    problem.check_cache_heads(name, tuple(q.shape), tuple(k_cache.shape), True, paged, rows_indexed)
    if paged:
        if not isinstance(block_table, jax.Array) or block_table.dtype != jnp.int32 or block_table.ndim != 2:
            raise TypeError(f"{name}: block_table must be an int32 (batch, max_pages) jax.Array")
        if block_table.shape[0] != batch:
            raise ValueError(f"{name}: block_table must have {batch} rows, got {tuple(block_table.shape)}")
        problem.check_page_size(name, k_cache.shape[1])
    if not isinstance(cache_seqlens, jax.Array) or cache_seqlens.dtype != jnp.int32:
        raise TypeError(f"{name}: cache_seqlens must be an int32 jax.Array of shape ({batch},)")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(
            f"{name}: cache_seqlens must have shape ({batch},), got {tuple(cache_seqlens.shape)}"
        )
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{name}: k_new and v_new must be given together")
    if k_new is not None:
        want = (batch, seqlen_q, heads_kv, head_dim)
        for what, t in (("k_new", k_new), ("v_new", v_new)):
            problem.check_new_tokens(
                name, what, tuple(t.shape) if isinstance(t, jax.Array) else type(t).__name__, want
            )
            if t.dtype != q.dtype:
                raise TypeError(f"{name}: {what} must have q's dtype, got {t.dtype}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{name}: rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for what, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, jax.Array) or t.ndim != 2 or not jnp.issubdtype(t.dtype, jnp.floating):
                raise TypeError(f"{name}: {what} must be a float (seqlen_ro, rotary_dim / 2) jax.Array")
            if t.shape != rotary_cos.shape:
                raise ValueError(f"{name}: rotary_cos and rotary_sin must share a shape")
        problem.check_rotary_dim(name, rotary_cos.shape[1], head_dim)


def check_kvcache_values(name: str, cache_seqlens, block_table, capacity: int, page: int, num_pages: int,
                         seqlen_new: int, seqlen_q: int, rotary_rows: int | None) -> list[int] | None:  # fmt: skip
    """problem.check_lengths and api.check_block_table when the values are known (one small
    device-to-host copy each); returns the lengths after the append, or None under jit."""
    lengths = concrete(cache_seqlens)
    if lengths is None:
        return None
    after = check_lengths(name, lengths.tolist(), capacity, seqlen_new, seqlen_q, rotary_rows)
    table = None if block_table is None else concrete(block_table)
    if table is not None:
        used = np.arange(table.shape[1])[None, :] * page < np.asarray(after)[:, None]
        bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
        if len(bad):
            b, i = bad[0].tolist()
            raise ValueError(f"{name}: block_table[{b}, {i}] = {table[b, i]} is not a page of the cache "
                             f"(0..{num_pages - 1})")  # fmt: skip
        if seqlen_new > 0:  # a page that receives new tokens must appear once (api.check_block_table)
            starts = np.arange(table.shape[1])[None, :] * page
            pages = np.where(used, table, num_pages)
            uses = np.bincount(pages.ravel(), minlength=num_pages + 1)
            written = used & (starts + page > np.asarray(after)[:, None] - seqlen_new)
            shared = np.argwhere(written & (uses[pages] > 1))
            if len(shared):
                b, i = shared[0].tolist()
                o = next(
                    tuple(x)
                    for x in np.argwhere(used & (pages == table[b, i])).tolist()
                    if tuple(x) != (b, i)
                )
                raise ValueError(f"{name}: block_table[{b}, {i}] = {table[b, i]} receives new tokens but is also "
                                 f"block_table[{o[0]}, {o[1]}]: a page written by an append must belong to one "
                                 "sequence once (pages only read may be shared)")  # fmt: skip
    return after


def check_per_sequence(name: str, what: str, t, batch: int) -> None:
    """cache_batch_idx / cache_leftpad: an int32 (batch,) jax.Array."""
    if not isinstance(t, jax.Array) or t.dtype != jnp.int32 or tuple(t.shape) != (batch,):
        raise TypeError(f"{name}: {what} must be an int32 jax.Array of shape ({batch},)")


def check_rows_and_padding(name: str, cache_batch_idx, cache_leftpad, cache_seqlens, rows: int,
                           appends: bool) -> None:  # fmt: skip
    """Values of cache_batch_idx (rows of the cache, distinct when the call appends) and
    cache_leftpad (0..cache_seqlens[b]) when they are concrete (one small device-to-host copy
    each)."""
    idx = None if cache_batch_idx is None else concrete(cache_batch_idx)
    if idx is not None:
        bad = np.argwhere((idx < 0) | (idx >= rows))
        if len(bad):
            b = int(bad[0][0])
            raise ValueError(
                f"{name}: cache_batch_idx[{b}] = {idx[b]} is not a row of the cache (0..{rows - 1})"
            )
        picked = idx.tolist()
        if appends and len(set(picked)) < len(picked):
            b = next(i for i, r in enumerate(picked) if picked.index(r) != i)
            raise ValueError(f"{name}: cache_batch_idx[{b}] = {picked[b]} names a row another sequence also "
                             "appends to: the rows that receive k_new must be distinct")  # fmt: skip
    pads = None if cache_leftpad is None else concrete(cache_leftpad)
    lengths = concrete(cache_seqlens)
    if pads is not None and lengths is not None:
        for b, (pad, end) in enumerate(zip(pads.tolist(), lengths.tolist())):
            if not 0 <= pad <= end:
                raise ValueError(
                    f"{name}: cache_leftpad[{b}] = {pad} must lie in 0..cache_seqlens[{b}] = {end}"
                )
