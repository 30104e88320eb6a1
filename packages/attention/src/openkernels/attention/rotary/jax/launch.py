"""The rotary kernel (rotary/triton/kernels.py) launched from JAX, through the family's
jax-triton runner (core/jax/launch.py)."""

from __future__ import annotations

import jax

from ...core.jax.launch import arch, run_kernel
from ..triton import plan
from ..triton.kernels import _apply_rotary_kernel

__all__ = ["rotary"]


def rotary(x_q, x_k, cos, sin, backward: bool):
    """`_apply_rotary_kernel` on x_q (B, S, Hq, D), x_k (B, S, Hk, D) with cos, sin (Bc, S, R)
    or (S, R): (out_q, out_k), the rotation or (backward) its transpose."""
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    launch = plan.contiguous_rotary(tuple(x_q.shape), x_k.shape[2], tuple(cos.shape), backward, arch())
    inputs = {"q_ptr": x_q, "k_ptr": x_k, "cos_ptr": cos, "sin_ptr": sin}
    outputs = {"qo_ptr": jax.ShapeDtypeStruct(x_q.shape, x_q.dtype),
               "ko_ptr": jax.ShapeDtypeStruct(x_k.shape, x_k.dtype)}  # fmt: skip
    return run_kernel(_apply_rotary_kernel, launch, inputs, outputs)
