"""attention and attention_varlen on JAX arrays: same names, shapes, options, checks and math
as the PyTorch API (../api.py; the checks are ../problem.py's, semantics in ../reference.py).
The family's JAX face (openkernels.attention.jax) adds apply_rotary and attention_with_kvcache.

    attention(q, k, v):        q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> (B, Sq, Hq, D) [, lse (B, Hq, Sq)]
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                               q (Tq, Hq, D), k, v (Tk, Hkv, D) packed -> (Tq, Hq, D) [, lse (Hq, Tq)]

Both work under ``jax.jit`` and differentiate through ``jax.custom_vjp`` with the backward
kernels (in q, k, v and through lse as well). ALiBi slopes get no gradient: differentiating
with respect to them raises ValueError (wrap them in ``jax.lax.stop_gradient``). Dropout
takes its randomness from `generator`, a jax.random key (JAX has no global generator): the
same key draws the same mask as the PyTorch functions given the same Philox seed
(../reference.py), and the backward regenerates it.

Backends (`openkernels.shared.jax`, fixed when a call is traced; the backward runs on the
forward's): float16 / bfloat16 run the Triton kernels (jax-triton on GPUs, the interpreter in
tests) with the PyTorch path's launch configs; float32, float64 (with jax_enable_x64) and
the "jnp" backend run a jax.numpy composition of the reference. Needs the ``[jax]`` extra.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from openkernels.shared import jax as okjax

from ..problem import (
    HEAD_DIMS,
    KERNEL_DTYPES,
    ArrayKind,
    Problem,
    check_dense_call,
    check_dropout,
    check_varlen_call,
)

# jax.numpy goes by its full name here: in this package, jnp is the submodule jnp.py.
from . import jnp as jnp_backend

__all__ = ["attention", "attention_varlen", "JAX", "concrete", "dropout_seed"]

_KERNEL_DTYPES = tuple(jax.numpy.dtype(name) for name in KERNEL_DTYPES)


def concrete(x: jax.Array) -> np.ndarray | None:
    """x's values when they are known now (not while tracing): one device-to-host copy."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _host_values(x: jax.Array) -> list | None:
    values = concrete(x)
    return None if values is None else values.tolist()


_F = jax.numpy
JAX = ArrayKind("jax.Array", jax.Array, (_F.float16, _F.bfloat16, _F.float32, _F.float64), _F.float32, _F.int32,
                False, _host_values)  # fmt: skip


# ---- attention: one custom_vjp for dense and varlen calls --------------------------------


@dataclass(frozen=True)
class _Static:
    """What is fixed at trace time: the call's sizes and options, and the backend."""

    problem: Problem
    backend: str


def _kernels(static: _Static, dtype) -> bool:
    return static.backend != "jnp" and jax.numpy.dtype(dtype) in _KERNEL_DTYPES


def dropout_seed(name: str, dropout_p: float, generator) -> jax.Array | None:
    """The Philox key of a call with dropout, int32 (2,), drawn from `generator` (a
    jax.random key); None without dropout."""
    if not dropout_p:
        return None
    if generator is None:
        raise ValueError(
            f"{name}: dropout_p > 0 needs generator, a jax.random key (JAX has no global generator)"
        )
    try:
        bits = jax.random.bits(generator, (2,), jax.numpy.uint32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: generator must be a jax.random key, got {type(generator).__name__}") from e
    return jax.lax.bitcast_convert_type(bits, jax.numpy.int32)


def _forward(q, k, v, cu_q, cu_k, slopes, seed, static: _Static):
    p = static.problem
    acc = jnp_backend.compute_dtype(q.dtype)
    lse_shape = (q.shape[1], q.shape[0]) if p.varlen else (q.shape[0], q.shape[2], q.shape[1])
    if q.size == 0 or k.shape[-3] == 0:  # nothing to compute, or no keys: every row is empty
        return jax.numpy.zeros(q.shape, q.dtype), jax.numpy.full(lse_shape, -jax.numpy.inf, acc)
    if _kernels(static, q.dtype):
        from . import launch

        return launch.attention_fwd(q, k, v, cu_q, cu_k, slopes, p, seed)
    return jnp_backend.attention_fwd(q, k, v, cu_q, cu_k, slopes, p, seed)


def _backward(dout, dlse, q, k, v, out, lse, cu_q, cu_k, slopes, seed, static: _Static, folded: bool = False):
    """folded: out and lse carry learnable sinks (the jax.numpy path then takes its
    probabilities from lse; the kernels always do)."""
    if q.size == 0 or k.shape[-3] == 0:
        return jax.numpy.zeros_like(q), jax.numpy.zeros_like(k), jax.numpy.zeros_like(v)
    if _kernels(static, q.dtype):
        from . import launch

        return launch.attention_bwd(dout, dlse, q, k, v, out, lse, cu_q, cu_k, slopes, static.problem, seed)
    return jnp_backend.attention_bwd(
        dout, dlse, q, k, v, cu_q, cu_k, slopes, static.problem, lse if folded else None, seed
    )


def _lse_layout(sinks: jax.Array, varlen: bool) -> jax.Array:
    """sinks (H,) laid out as lse: (B, H, S) dense, (H, T) varlen."""
    return sinks[:, None] if varlen else sinks[None, :, None]


def _as_rows(x: jax.Array, varlen: bool) -> jax.Array:
    """lse-shaped x as out's rows: (B, S, H, 1) dense, (T, H, 1) varlen."""
    return (x.T if varlen else jax.numpy.transpose(x, (0, 2, 1)))[..., None]


def _fold_sinks(out, lse, sinks, varlen: bool):
    """(out', lse') with learnable sinks, as ../ops.py folds them: out * sigmoid(lse - sink),
    logaddexp(lse, sink)."""
    sink = _lse_layout(sinks.astype(lse.dtype), varlen)
    share = _as_rows(jax.nn.sigmoid(lse - sink), varlen)
    return (out.astype(lse.dtype) * share).astype(out.dtype), jax.numpy.logaddexp(lse, sink)


def _forward_with_sinks(q, k, v, cu_q, cu_k, slopes, sinks, seed, static: _Static):
    out, lse = _forward(q, k, v, cu_q, cu_k, slopes, seed, static)
    return (out, lse) if sinks is None else _fold_sinks(out, lse, sinks, static.problem.varlen)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _attention(q, k, v, cu_q, cu_k, slopes, sinks, seed, static: _Static):
    return _forward_with_sinks(q, k, v, cu_q, cu_k, slopes, sinks, seed, static)


def _value(x):
    return None if x is None else x.value


def _attention_fwd(q, k, v, cu_q, cu_k, slopes, sinks, seed, static: _Static):
    # symbolic_zeros: the primals come wrapped, with whether each is differentiated.
    if slopes is not None and slopes.perturbed:
        raise ValueError("attention: alibi_slopes gets no gradient; pass jax.lax.stop_gradient(alibi_slopes)")
    q, k, v, cu_q, cu_k, slopes, sinks, seed = (_value(x) for x in (q, k, v, cu_q, cu_k, slopes, sinks, seed))
    out, lse = _forward_with_sinks(q, k, v, cu_q, cu_k, slopes, sinks, seed, static)
    return (out, lse), (q, k, v, out, lse, cu_q, cu_k, slopes, sinks, seed)


def _sinks_grad(dout, dlse, out, lse, sinks, varlen: bool):
    """d sinks: the sink's probability exp(sink - lse') times (dlse - rowsum(dout * out')),
    summed over every row of its head (../ops.py derives it)."""
    delta = (dout.astype(lse.dtype) * out.astype(lse.dtype)).sum(-1)  # (B, S, H) or (T, H)
    delta = delta.T if varlen else jax.numpy.transpose(delta, (0, 2, 1))
    upstream = -delta if dlse is None else dlse - delta
    grad = jax.numpy.exp(_lse_layout(sinks.astype(lse.dtype), varlen) - lse) * upstream
    return grad.sum(axis=1 if varlen else (0, 2)).astype(sinks.dtype)


def _attention_bwd(static: _Static, residuals, cotangents):
    q, k, v, out, lse, cu_q, cu_k, slopes, sinks, seed = residuals
    dout, dlse = cotangents
    zero = jax.custom_derivatives.SymbolicZero
    if isinstance(dout, zero):
        dout = jax.numpy.zeros(out.shape, out.dtype)
    dlse = None if isinstance(dlse, zero) else dlse
    with okjax.use_backend(static.backend):  # the backward runs on the forward's backend
        dq, dk, dv = _backward(
            dout.astype(out.dtype),
            dlse,
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            slopes,
            seed,
            static,
            sinks is not None,
        )
    dsinks = None if sinks is None else _sinks_grad(dout, dlse, out, lse, sinks, static.problem.varlen)
    return dq, dk, dv, None, None, None, dsinks, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _slopes(alibi_slopes: jax.Array | None, n_seqs: int, heads: int) -> jax.Array | None:
    """(n_seqs, heads) float32: the kernels' layout."""
    return None if alibi_slopes is None else jax.numpy.broadcast_to(alibi_slopes, (n_seqs, heads))


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
    sinks: jax.Array | None = None,
    dropout_p: float = 0.0,
    generator: jax.Array | None = None,
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
    sinks: float32 (heads_q,) learnable sink logits, differentiable (as the PyTorch function).
    dropout_p: in [0, 1), applied whenever > 0, as the PyTorch function; generator: the
    jax.random key its mask is drawn from (required with dropout).
    return_lse: also return the logsumexp (batch, heads_q, seqlen_q), float32 (float64 for
    float64 inputs); rows that see no key give output 0 and lse -inf.
    Returns out (batch, seqlen_q, heads_q, head_dim) in q's dtype [, lse]. Differentiable in
    q, k, v (and through lse: d lse / d score = the attention probabilities).
    """
    left, right, scale = check_dense_call("attention", JAX, q, k, v, HEAD_DIMS, causal, softmax_scale, window,
                                          alibi_slopes, softcap, sinks)  # fmt: skip
    dropout_p = check_dropout("attention", dropout_p)
    seed = dropout_seed("attention", dropout_p, generator)
    problem = Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], False, scale, left,
                      right, alibi_slopes is not None, float(softcap), dropout_p)  # fmt: skip
    slopes = _slopes(alibi_slopes, q.shape[0], q.shape[2])
    out, lse = _attention(q, k, v, None, None, slopes, sinks, seed, _Static(problem, okjax.backend()))
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
    sinks: jax.Array | None = None,
    dropout_p: float = 0.0,
    generator: jax.Array | None = None,
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
    left, right, scale = check_varlen_call("attention_varlen", JAX, q, k, v, HEAD_DIMS, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, alibi_slopes,
                                           softcap, sinks)  # fmt: skip
    n_seqs = cu_seqlens_q.shape[0] - 1
    dropout_p = check_dropout("attention_varlen", dropout_p)
    seed = dropout_seed("attention_varlen", dropout_p, generator)
    problem = Problem(n_seqs, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2], True, scale,
                      left, right, alibi_slopes is not None, float(softcap), dropout_p)  # fmt: skip
    slopes = _slopes(alibi_slopes, n_seqs, q.shape[1])
    out, lse = _attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, slopes, sinks, seed, _Static(problem, okjax.backend())
    )
    return (out, lse) if return_lse else out
