"""attention_with_kvcache on JAX arrays: the PyTorch op as a function that returns the
updated caches instead of writing them in place (semantics in reference.py).

The append is a jax.numpy scatter on every backend (XLA updates the caches in place when
jit donates them); the attention runs `_attention_kvcache_fwd_kernel` (and its split
combine) with the PyTorch launcher's plan on the kernel backends for float16 / bfloat16,
and a jax.numpy composition otherwise. 16-bit (and float32) caches only: quantized caches
(QuantizedKV) have no JAX front end. Inference only, like the PyTorch op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from . import jax_jnp
from .jax_checks import (
    check_alibi,
    check_kvcache,
    check_kvcache_values,
    check_per_sequence,
    check_rows_and_padding,
)
from .problem import KERNEL_DTYPES, KVProblem, Problem, check_options, resolve_scale

__all__ = ["attention_with_kvcache"]

_KERNEL_DTYPES = tuple(jnp.dtype(name) for name in KERNEL_DTYPES)


def _attend(
    q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, problem: KVProblem, leftpad=None
):
    if q.size == 0:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    if okjax.backend() != "jnp" and q.dtype in _KERNEL_DTYPES:
        from . import jax_kernels

        return jax_kernels.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, problem, leftpad
        )
    p = Problem(q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2], k_cache.shape[2], q.shape[3], False,
                     problem.scale, problem.window_left, problem.window_right, slopes is not None, problem.softcap)  # fmt: skip
    return jax_jnp.kvcache_attention(q, k_cache, v_cache, cache_seqlens, block_table, cos, sin, slopes, p,
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
            check_per_sequence(name, what, value, batch)
    check_kvcache(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
                  rows_indexed=cache_batch_idx is not None)  # fmt: skip
    left, right = check_options(name, causal, softmax_scale, window, softcap)
    batch, seqlen_q, heads_q, head_dim = q.shape
    check_alibi(name, alibi_slopes, heads_q, batch)
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
        check_rows_and_padding(
            name, cache_batch_idx, cache_leftpad, cache_seqlens, k_cache.shape[0], seqlen_new > 0
        )
        check_kvcache_values(name, cache_seqlens, block_table, capacity, page, k_cache.shape[0], seqlen_new,
                             seqlen_q, None)  # fmt: skip
        if rows is not None:  # rotary positions count from each sequence's first token
            check_kvcache_values(
                name, seqlens, None, capacity, page, k_cache.shape[0], seqlen_new, seqlen_q, rows
            )
    if cache_batch_idx is not None:  # the cache as pages of one row each
        block_table = cache_batch_idx[:, None]
    if k_new is not None and seqlen_new:
        k_cache, v_cache = jax_jnp.kvcache_append(k_cache, v_cache, k_new, v_new, seqlens, block_table,
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
    slopes = None if alibi_slopes is None else jnp.broadcast_to(alibi_slopes, (batch, heads_q))
    out, lse = _attend(
        q, k_cache, v_cache, seqlens, block_table, rotary_cos, rotary_sin, slopes, problem, cache_leftpad
    )
    return (out, lse, k_cache, v_cache) if return_lse else (out, k_cache, v_cache)
