"""The attention ops on JAX arrays: same names, shapes, options and math as the PyTorch API
(api.py; semantics in reference.py).

    attention(q, k, v):        q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> (B, Sq, Hq, D) [, lse (B, Hq, Sq)]
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                               q (Tq, Hq, D), k, v (Tk, Hkv, D) packed -> (Tq, Hq, D) [, lse (Hq, Tq)]
    apply_rotary(q, k, cos, sin): q (B, S, Hq, D), k (B, S, Hk, D), cos, sin (B or 1, S, R) or
                               (S, R) -> (q_out, k_out), GPT-NeoX rotary embedding
    attention_with_kvcache:    see its docstring (functional: returns the updated caches).

Every op works under ``jax.jit`` and differentiates through ``jax.custom_vjp`` with the
family's backward kernels (attention: in q, k, v and through lse as well; rotary: in q, k).
ALiBi slopes, cos and sin get no gradient: differentiating with respect to them raises
ValueError (wrap them in ``jax.lax.stop_gradient``). There is no ``out=``.

Backends (`openkernels.shared.jax`, fixed when a call is traced; the backward runs on the
forward's): float16 / bfloat16 run the Triton kernels (jax-triton on GPUs, the interpreter in
tests) with the PyTorch path's launch configs; float32, float64 (with jax_enable_x64) and
the "jnp" backend run a jax.numpy composition of the reference. Needs the ``[jax]`` extra.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from . import jax_jnp
from .jax_checks import check_alibi, check_cu_seqlens, check_qkv
from .jax_kvcache import attention_with_kvcache
from .problem import KERNEL_DTYPES, Problem, check_options, check_same_n_seqs, resolve_scale
from .rotary.jax import apply_rotary

__all__ = ["attention", "attention_varlen", "apply_rotary", "attention_with_kvcache"]

_KERNEL_DTYPES = tuple(jnp.dtype(name) for name in KERNEL_DTYPES)


# ---- attention: one custom_vjp for dense and varlen calls --------------------------------


@dataclass(frozen=True)
class _Static:
    """What is fixed at trace time: the call's sizes and options, and the backend."""

    problem: Problem
    backend: str


def _kernels(static: _Static, dtype) -> bool:
    return static.backend != "jnp" and jnp.dtype(dtype) in _KERNEL_DTYPES


def _forward(q, k, v, cu_q, cu_k, slopes, static: _Static):
    p = static.problem
    acc = jax_jnp.compute_dtype(q.dtype)
    lse_shape = (q.shape[1], q.shape[0]) if p.varlen else (q.shape[0], q.shape[2], q.shape[1])
    if q.size == 0 or k.shape[-3] == 0:  # nothing to compute, or no keys: every row is empty
        return jnp.zeros(q.shape, q.dtype), jnp.full(lse_shape, -jnp.inf, acc)
    if _kernels(static, q.dtype):
        from . import jax_kernels

        return jax_kernels.attention_fwd(q, k, v, cu_q, cu_k, slopes, p)
    return jax_jnp.attention_fwd(q, k, v, cu_q, cu_k, slopes, p)


def _backward(dout, dlse, q, k, v, out, lse, cu_q, cu_k, slopes, static: _Static):
    if q.size == 0 or k.shape[-3] == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    if _kernels(static, q.dtype):
        from . import jax_kernels

        return jax_kernels.attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, slopes, static.problem)
    return jax_jnp.attention_bwd(dout, dlse, q, k, v, cu_q, cu_k, slopes, static.problem)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, cu_q, cu_k, slopes, static: _Static):
    return _forward(q, k, v, cu_q, cu_k, slopes, static)


def _value(x):
    return None if x is None else x.value


def _attention_fwd(q, k, v, cu_q, cu_k, slopes, static: _Static):
    # symbolic_zeros: the primals come wrapped, with whether each is differentiated.
    if slopes is not None and slopes.perturbed:
        raise ValueError("attention: alibi_slopes gets no gradient; pass jax.lax.stop_gradient(alibi_slopes)")
    q, k, v, cu_q, cu_k, slopes = (_value(x) for x in (q, k, v, cu_q, cu_k, slopes))
    out, lse = _forward(q, k, v, cu_q, cu_k, slopes, static)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, slopes)


def _attention_bwd(static: _Static, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, slopes = residuals
    dout, dlse = cotangents
    zero = jax.custom_derivatives.SymbolicZero
    if isinstance(dout, zero):
        dout = jnp.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, zero) else dlse
    with okjax.use_backend(static.backend):  # the backward runs on the forward's backend
        dq, dk, dv = _backward(dout.astype(out.dtype), dlse, q, k, v, out, lse, cu_q, cu_k, slopes, static)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _slopes(alibi_slopes: jax.Array | None, n_seqs: int, heads: int) -> jax.Array | None:
    """(n_seqs, heads) float32: the kernels' layout."""
    return None if alibi_slopes is None else jnp.broadcast_to(alibi_slopes, (n_seqs, heads))


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: jax.Array | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Fused scaled dot-product attention (FlashAttention-style on the kernel backends).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA). head_dim in 32, 64, 96, 128, 192, 256;
    float16/bfloat16 (kernels), float32 (jax.numpy), float64 (jax.numpy, with x64).
    causal: mask keys after each query, aligned bottom-right when seqlen_q != seqlen_k.
    softmax_scale: default 1 / sqrt(head_dim). window: (left, right) sliding window, -1 =
    unbounded. alibi_slopes: float32 (heads_q,) or (batch, heads_q). softcap: > 0 caps
    scores with softcap * tanh(s / softcap). Options are Python values (static under jit).
    return_lse: also return the logsumexp (batch, heads_q, seqlen_q), float32 (float64 for
    float64 inputs); rows that see no key give output 0 and lse -inf.
    Returns out (batch, seqlen_q, heads_q, head_dim) in q's dtype [, lse]. Differentiable in
    q, k, v (and through lse: d lse / d score = the attention probabilities).
    """
    name = "attention"
    check_qkv(name, q, k, v, 4)
    left, right = check_options(name, causal, softmax_scale, window, softcap)
    check_alibi(name, alibi_slopes, q.shape[2], q.shape[0])
    scale = resolve_scale(q.shape[-1], softmax_scale)
    problem = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], False, scale, left,
                      right, alibi_slopes is not None, float(softcap))  # fmt: skip
    slopes = _slopes(alibi_slopes, q.shape[0], q.shape[2])
    out, lse = _attention(q, k, v, None, None, slopes, _Static(problem, okjax.backend()))
    return (out, lse) if return_lse else out


def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: jax.Array | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`attention` over packed sequences of different lengths.

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim); sequence i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k, v.
    `cu_seqlens_*`: int32 (n_seqs + 1,), starting at 0, non-decreasing (empty sequences
    allowed). `max_seqlen_*`: Python ints, at least the longest sequence (they size the grids).
    Values are checked when known (concrete arrays: one device-to-host copy); under jax.jit
    they are not, and wrong ones give wrong results. Options as in `attention`, per
    sequence; alibi_slopes (heads_q,) or (n_seqs, heads_q).
    Returns out (total_q, heads_q, head_dim) [, lse (heads_q, total_q)].
    """
    name = "attention_varlen"
    check_qkv(name, q, k, v, 3)
    check_cu_seqlens(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    check_cu_seqlens(name, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    check_same_n_seqs(name, cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
    left, right = check_options(name, causal, softmax_scale, window, softcap)
    n_seqs = cu_seqlens_q.shape[0] - 1
    check_alibi(name, alibi_slopes, q.shape[1], n_seqs)
    scale = resolve_scale(q.shape[-1], softmax_scale)
    problem = Problem(n_seqs, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2], True, scale,
                      left, right, alibi_slopes is not None, float(softcap))  # fmt: skip
    slopes = _slopes(alibi_slopes, n_seqs, q.shape[1])
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, slopes, _Static(problem, okjax.backend()))
    return (out, lse) if return_lse else out
