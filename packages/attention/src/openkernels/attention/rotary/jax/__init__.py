"""apply_rotary for JAX (re-exported by openkernels.attention.jax): the rotary kernel through
jax-triton (launch.py) or jax.numpy (jnp.py), checked by the rules in ../problem.py that the
PyTorch face uses too."""

from __future__ import annotations

import functools

import jax

from openkernels.shared import jax as okjax

from ..problem import KERNEL_DTYPES, MAX_HEAD_DIM, Part, check_rotary
from .jnp import rotate_half  # binds .jnp here: jax.numpy is spelt out below

__all__ = ["apply_rotary"]


def _check_rotary(name: str, q: object, k: object, cos: object, sin: object) -> None:
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, jax.Array):
            raise TypeError(f"{name}: {what} must be a jax.Array, got {type(t).__name__}")
    check_rotary(name, *(Part(tuple(t.shape), str(t.dtype)) for t in (q, k, cos, sin)))


def _rotate(x_q, x_k, cos, sin, backend: str, backward: bool):
    """(out_q, out_k): the rotation, or its transpose, on the kernel or in jax.numpy."""
    if x_q.shape[0] * x_q.shape[1] == 0:
        return jax.numpy.zeros(x_q.shape, x_q.dtype), jax.numpy.zeros(x_k.shape, x_k.dtype)
    if (
        backend != "jnp"
        and jax.numpy.dtype(x_q.dtype).name in KERNEL_DTYPES
        and x_q.shape[-1] <= MAX_HEAD_DIM
    ):
        from .launch import rotary

        return rotary(x_q, x_k, cos, sin, backward)
    return rotate_half(x_q, cos, sin, backward), rotate_half(x_k, cos, sin, backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rotary(q, k, cos, sin, backend: str):
    return _rotate(q, k, cos, sin, backend, False)


def _rotary_fwd(q, k, cos, sin, backend: str):
    if cos.perturbed or sin.perturbed:
        raise ValueError("apply_rotary: cos and sin get no gradient; pass them through jax.lax.stop_gradient")
    return _rotate(q.value, k.value, cos.value, sin.value, backend, False), (cos.value, sin.value)


def _rotary_bwd(backend: str, residuals, cotangents):
    cos, sin = residuals
    zero = jax.custom_derivatives.SymbolicZero
    g_q, g_k = (jax.numpy.zeros(g.shape, g.dtype) if isinstance(g, zero) else g for g in cotangents)
    with okjax.use_backend(backend):
        grad_q, grad_k = _rotate(g_q, g_k, cos, sin, backend, True)
    return grad_q, grad_k, None, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd, symbolic_zeros=True)


def apply_rotary(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rotary position embedding of q and k, GPT-NeoX "rotate half" convention, q and k in
    one kernel launch.

    q: (batch, seqlen, heads_q, head_dim), k: (batch, seqlen, heads_k, head_dim); float16,
    bfloat16, float32 (kernel), float64 (jax.numpy, with x64). cos, sin: (batch, seqlen, R),
    (1, seqlen, R) or (seqlen, R), any float dtype, R even and <= head_dim. With h = R / 2,
    c1 = cos[..., :h], c2 = cos[..., h:], s1, s2 likewise, x1 = x[..., :h], x2 = x[..., h:R]:
        out[..., :h] = x1 c1 - x2 s1;  out[..., h:R] = x2 c2 + x1 s2;  out[..., R:] = x[..., R:]
    computed in float32 and rounded once to q's dtype.
    Returns (q_out, k_out) of q's and k's shapes. Differentiable in q and k; cos and sin get
    no gradient (differentiating with respect to them raises ValueError).
    """
    _check_rotary("apply_rotary", q, k, cos, sin)
    return _rotary(q, k, cos, sin, okjax.backend())
