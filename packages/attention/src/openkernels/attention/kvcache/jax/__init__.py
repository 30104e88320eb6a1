"""attention_with_kvcache on JAX arrays: the PyTorch op as a function that returns the
updated caches instead of writing them in place (semantics in ../reference.py; the checks on
shapes and values are ../problem.py's and ../../core/problem.py's, the checks on JAX arrays
here).

The append is a jax.numpy scatter on every backend (XLA updates the caches in place when
jit donates them); the attention runs `_attention_kvcache_fwd_kernel` (and its split
combine) with the PyTorch launcher's plan on the kernel backends for float16 / bfloat16,
and a jax.numpy composition otherwise. 16-bit (and float32) caches only: quantized caches
(QuantizedKV) have no JAX front end. Inference only, like the PyTorch op.
"""

from __future__ import annotations

import jax
import numpy as np

from openkernels.shared import jax as okjax

from ...core.jax import JAX, concrete
from ...core.problem import Problem, check_alibi, check_options, resolve_scale
from .. import problem
from ..problem import HEAD_DIMS, KERNEL_DTYPES, KVProblem, check_lengths

# jax.numpy goes by its full name here: in this package, jnp is the submodule jnp.py.
from . import jnp as jnp_backend

__all__ = ["attention_with_kvcache"]

_KERNEL_DTYPES = tuple(jax.numpy.dtype(name) for name in KERNEL_DTYPES)


_CACHE_DTYPES = (jax.numpy.float16, jax.numpy.bfloat16, jax.numpy.float32)


def _check_kvcache(
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
    """../api.py's _check_kvcache for 16-bit (and float32) caches as jax.Arrays; rows_indexed: a
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
        if (
            not isinstance(block_table, jax.Array)
            or block_table.dtype != jax.numpy.int32
            or block_table.ndim != 2
        ):
            raise TypeError(f"{name}: block_table must be an int32 (batch, max_pages) jax.Array")
        if block_table.shape[0] != batch:
            raise ValueError(f"{name}: block_table must have {batch} rows, got {tuple(block_table.shape)}")
        problem.check_page_size(name, k_cache.shape[1])
    if not isinstance(cache_seqlens, jax.Array) or cache_seqlens.dtype != jax.numpy.int32:
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
            if (
                not isinstance(t, jax.Array)
                or t.ndim != 2
                or not jax.numpy.issubdtype(t.dtype, jax.numpy.floating)
            ):
                raise TypeError(f"{name}: {what} must be a float (seqlen_ro, rotary_dim / 2) jax.Array")
            if t.shape != rotary_cos.shape:
                raise ValueError(f"{name}: rotary_cos and rotary_sin must share a shape")
        problem.check_rotary_dim(name, rotary_cos.shape[1], head_dim)


def _check_kvcache_values(name: str, cache_seqlens, block_table, capacity: int, page: int, num_pages: int,
                         seqlen_new: int, seqlen_q: int, rotary_rows: int | None) -> list[int] | None:  # fmt: skip
    """problem.check_lengths and ../api.py's check_block_table when the values are known (one small
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
        if seqlen_new > 0:  # a page that receives new tokens must appear once (../api.py's check_block_table)
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


def _check_per_sequence(name: str, what: str, t, batch: int) -> None:
    """cache_batch_idx / cache_leftpad: an int32 (batch,) jax.Array."""
    if not isinstance(t, jax.Array) or t.dtype != jax.numpy.int32 or tuple(t.shape) != (batch,):
        raise TypeError(f"{name}: {what} must be an int32 jax.Array of shape ({batch},)")


def _check_rows_and_padding(name: str, cache_batch_idx, cache_leftpad, cache_seqlens, rows: int,
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


def _attend(q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, problem: KVProblem, leftpad=None,
            filled=None):  # fmt: skip
    """cache_seqlens: tokens from each sequence's first (after leftpad); filled: the storage
    slots (the padding included), what the Triton kernel takes with leftpad."""
    if q.size == 0:
        return jax.numpy.zeros(q.shape, q.dtype), jax.numpy.zeros(
            (q.shape[0], q.shape[2], q.shape[1]), jax.numpy.float32
        )
    if okjax.backend() != "jnp" and q.dtype in _KERNEL_DTYPES:
        from . import launch

        slots = cache_seqlens if leftpad is None else filled
        return launch.attention_kvcache(
            q, k_cache, v_cache, slots, block_table, cos, sin, slopes, problem, leftpad
        )
    p = Problem(q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[2], q.shape[3], False,
                     problem.scale, problem.window_left, problem.window_right, slopes is not None, problem.softcap)  # fmt: skip
    return jnp_backend.kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, p,
                                     problem.seqlen_new, problem.interleaved, leftpad)  # fmt: skip


def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    block_table: jax.Array | None = None,
    cache_batch_idx: jax.Array | None = None,
    cache_leftpad: jax.Array | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: jax.Array | None = None,
    softcap: float = 0.0,
    rotary_cos: jax.Array | None = None,
    rotary_sin: jax.Array | None = None,
    rotary_interleaved: bool = False,
    return_lse: bool = False,
    check: bool = True,
) -> tuple[jax.Array, ...]:
    """Attention of new queries against a KV cache (decode, chunked prefill), functional.

    q: (batch, seqlen_q, heads_q, head_dim) float16/bfloat16 (kernels) or float32 (jax.numpy).
    k_cache, v_cache: arrays in q's dtype, contiguous (batch, capacity, heads_kv, head_dim)
    or paged (num_pages, page_size, heads_kv, head_dim) with block_table (batch, max_pages)
    int32 (page_size a multiple of 16). cache_seqlens: int32 (batch,), tokens already cached.
    k_new, v_new: (batch, seqlen_q, heads_kv, head_dim), written at cache_seqlens (k_new
    rotated first when rotary_cos is given) into the returned caches; the inputs are not
    changed (donate them to jax.jit for an in-place update).
    Sequence b attends its first cache_seqlens[b] (+ seqlen_q with k_new) positions, query i
    at the last seqlen_q of them (also its rotary position). causal (default True),
    softmax_scale, window, alibi_slopes ((heads_q,) or (batch, heads_q) float32), softcap:
    as in `attention`. rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); halves or
    (rotary_interleaved) GPT-J pairs.
    Bounds (lengths against the capacity, block_table entries, rotary rows) are checked when
    cache_seqlens and block_table are concrete (not under jax.jit) unless check=False (the
    caller guarantees them, as in the PyTorch function). The key splits are
    planned for the capacity (PyTorch: the longest sequence): every integer is a kernel
    constant under jax-triton, and a plan that followed the lengths would recompile as they
    grow.
    Returns (out, k_cache, v_cache), or (out, lse, k_cache, v_cache) with return_lse: out in
    q's dtype, lse (batch, heads_q, seqlen_q) float32. Inference only (no gradients).
    cache_batch_idx: int32 (batch,), contiguous caches only: sequence b is row
    cache_batch_idx[b] of the cache (which may have any number of rows; the others are
    returned as they were). cache_leftpad: int32 (batch,), contiguous caches only: sequence
    b's tokens start at slot cache_leftpad[b] of its row (a left-padded batch); cache_seqlens
    still counts the padding, positions count from the first token. As the PyTorch function.
    """
    name = "attention_with_kvcache"
    batch = q.shape[0] if isinstance(q, jax.Array) and q.ndim == 4 else 0
    for what, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            if block_table is not None:
                raise ValueError(f"{name}: {what} applies to contiguous caches; a paged cache's block_table "
                                 "already maps sequences to pages")  # fmt: skip
            _check_per_sequence(name, what, value, batch)
    _check_kvcache(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
                  rows_indexed=cache_batch_idx is not None)  # fmt: skip
    left, right = check_options(name, causal, softmax_scale, window, softcap)
    batch, seqlen_q, heads_q, head_dim = q.shape
    check_alibi(name, JAX, alibi_slopes, q, heads_q, batch)
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"{name}: rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    page = k_cache.shape[1]
    capacity = page if block_table is None else block_table.shape[1] * page
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    rows = None if rotary_cos is None else rotary_cos.shape[0]
    if not isinstance(check, bool):
        raise TypeError(f"{name}: check must be a bool, got {check!r}")
    seqlens = cache_seqlens if cache_leftpad is None else cache_seqlens - cache_leftpad
    if check:
        _check_rows_and_padding(
            name, cache_batch_idx, cache_leftpad, cache_seqlens, k_cache.shape[0], seqlen_new > 0
        )
        _check_kvcache_values(name, cache_seqlens, block_table, capacity, page, k_cache.shape[0], seqlen_new,
                             seqlen_q, None)  # fmt: skip
        if rows is not None:  # rotary positions count from each sequence's first token
            _check_kvcache_values(
                name, seqlens, None, capacity, page, k_cache.shape[0], seqlen_new, seqlen_q, rows
            )
    if cache_batch_idx is not None:  # the cache as pages of one row each
        block_table = cache_batch_idx[:, None]
    if k_new is not None and seqlen_new:
        k_cache, v_cache = jnp_backend.kvcache_append(k_cache, v_cache, k_new, v_new, seqlens, block_table,
                                                  rotary_cos, rotary_sin, rotary_interleaved,
                                                  cache_leftpad)  # fmt: skip
    scale = resolve_scale(head_dim, softmax_scale)
    problem = KVProblem(
        batch, seqlen_q, heads_q, k_cache.shape[2], head_dim, 16, head_dim, seqlen_new,
        capacity, scale, left, right, alibi_slopes is not None,
        float(softcap), 0 if block_table is None or cache_batch_idx is not None else page,
        0 if rotary_cos is None else rotary_cos.shape[1], rotary_interleaved, cache_leftpad is not None,
        cache_batch_idx is not None,
    )  # fmt: skip
    slopes = None if alibi_slopes is None else jax.numpy.broadcast_to(alibi_slopes, (batch, heads_q))
    out, lse = _attend(q, k_cache, v_cache, seqlens, block_table, rotary_cos, rotary_sin, slopes, problem,
                       cache_leftpad, cache_seqlens)  # fmt: skip
    return (out, lse, k_cache, v_cache) if return_lse else (out, k_cache, v_cache)
