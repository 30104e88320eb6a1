"""Reference rotary position embedding (apply_rotary).

Semantics (GPT-NeoX "rotate half", what transformers' apply_rotary_pos_emb computes):
  x (B, S, H, D); cos, sin (B or 1, S, R), R even, R <= D, broadcast over heads. With
  h = R / 2, c1 = cos[..., :h], c2 = cos[..., h:], s1, s2 likewise, x1 = x[..., :h],
  x2 = x[..., h:R]:
    out[..., :h]  = x1 c1 - x2 s1
    out[..., h:R] = x2 c2 + x1 s2
    out[..., R:]  = x[..., R:]                    (partial rotary: the rest is copied)
  in float32 (float64 for float64 x; cos and sin are converted to it first), rounded once to
  x's dtype. Transformers' tables repeat their frequencies (c1 = c2, s1 = s2); the halves
  are kept apart here so a kernel that mixes them up is caught.
  The map is linear in x; its transpose (the backward) is the same map with (s1, s2)
  replaced by (-s2, -s1):  dx1 = g1 c1 + g2 s2,  dx2 = g2 c2 - g1 s1,  dx[R:] = g[R:].
  cos and sin get no gradient.

Backend entry points (ops.py calls them; every backend has the same two):
  apply_rotary_fwd(q, k, cos, sin, q_out, k_out)
  apply_rotary_bwd(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in)
q, grad_q (B, S, Hq, D), k, grad_k (B, S, Hk, D): any strides with a unit last stride;
cos, sin (Bc, S, R) with Bc 1 (broadcast over the batch) or B, any float dtype, a unit last
stride; outputs contiguous in q's dtype, written in full. B * S > 0 (ops.py returns empty
outputs itself).
"""

from __future__ import annotations

import torch

from ..core.reference import compute_dtype

__all__ = ["apply_rotary_ref", "apply_rotary_fwd", "apply_rotary_bwd"]


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """The rotation of x (B, S, H, D) by cos, sin (Bc, S, R) or (S, R), or its transpose, in
    the compute dtype."""
    acc = compute_dtype(x.dtype)
    half = cos.shape[-1] // 2
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)  # broadcast over heads
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        s1, s2 = -s2, -s1
    x = x.to(acc)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, x[..., 2 * half :]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `apply_rotary`: (q_out, k_out) in the compute dtype (float32, float64 for
    float64 inputs), not rounded. Differentiable (autograd through plain torch ops, cos and
    sin included)."""
    return _rotate_half(q, cos, sin, False), _rotate_half(k, cos, sin, False)


def apply_rotary_fwd(q, k, cos, sin, q_out, k_out) -> None:
    with torch.no_grad():
        q_out.copy_(_rotate_half(q, cos, sin, False))
        k_out.copy_(_rotate_half(k, cos, sin, False))


def apply_rotary_bwd(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in) -> None:
    with torch.no_grad():
        grad_q_in.copy_(_rotate_half(grad_q, cos, sin, True))
        grad_k_in.copy_(_rotate_half(grad_k, cos, sin, True))
