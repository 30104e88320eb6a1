"""The attention family on JAX arrays: same names, shapes, options and math as the PyTorch API.

    attention(q, k, v):        q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> (B, Sq, Hq, D) [, lse (B, Hq, Sq)]
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                               q (Tq, Hq, D), k, v (Tk, Hkv, D) packed -> (Tq, Hq, D) [, lse (Hq, Tq)]
    apply_rotary(q, k, cos, sin): q (B, S, Hq, D), k (B, S, Hk, D), cos, sin (B or 1, S, R) or
                               (S, R) -> (q_out, k_out), GPT-NeoX rotary embedding
    attention_with_kvcache:    see its docstring (functional: returns the updated caches).

Each problem's face is its sub-package's jax/ (core, kvcache, rotary); this module gathers
them. Every op works under ``jax.jit``; attention and apply_rotary differentiate through
``jax.custom_vjp`` with the family's backward kernels (attention in q, k, v and through lse;
rotary in q, k). ALiBi slopes, cos and sin get no gradient: differentiating with respect to
them raises ValueError (wrap them in ``jax.lax.stop_gradient``). There is no ``out=``.

Backends (`openkernels.shared.jax`, fixed when a call is traced; the backward runs on the
forward's): float16 / bfloat16 run the Triton kernels (jax-triton on GPUs, the interpreter in
tests) with the PyTorch path's launch configs; float32, float64 (with jax_enable_x64) and
the "jnp" backend run a jax.numpy composition of the reference. Needs the ``[jax]`` extra.
"""

from __future__ import annotations

from ..core.jax import attention, attention_varlen
from ..kvcache.jax import attention_with_kvcache
from ..rotary.jax import apply_rotary

__all__ = ["attention", "attention_varlen", "apply_rotary", "attention_with_kvcache"]
