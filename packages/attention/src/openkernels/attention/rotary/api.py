"""apply_rotary, the PyTorch face of the rotary position embedding, with its argument checks.

apply_rotary(q, k, cos, sin): q (B, S, Hq, D), k (B, S, Hk, D), cos, sin (B or 1, S, R) or
                              (S, R) -> (q_out, k_out), GPT-NeoX rotary embedding
The shape and dtype rules are problem.py's, shared with the JAX face.
"""

from __future__ import annotations

import torch

from openkernels.shared import replay

from . import ops, problem

__all__ = ["apply_rotary"]


def _part(t: torch.Tensor) -> problem.Part:
    return problem.Part(tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _check_rotary(name: str, q: object, k: object, cos: object, sin: object) -> None:
    for what, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    problem.check_rotary(name, *(_part(t) for t in (q, k, cos, sin)))
    for what, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device} but q is on {q.device}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError(f"{name}: cos and sin get no gradient; pass them detached (cos.requires_grad is "
                         f"{cos.requires_grad}, sin.requires_grad is {sin.requires_grad})")  # fmt: skip


@replay.replayable
def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k, GPT-NeoX "rotate half" convention (what
    transformers' `apply_rotary_pos_emb` computes for Llama-style models), q and k in one
    kernel launch.

    q: (batch, seqlen, heads_q, head_dim), k: (batch, seqlen, heads_k, head_dim), any strides
    with a unit head_dim stride (views of a fused qkv projection run without copies);
    float16, bfloat16, float32 (float64 on the reference). cos, sin: (batch, seqlen, R),
    (1, seqlen, R) or (seqlen, R) (broadcast over the batch and the heads), any float dtype,
    R even and <= head_dim. With h = R / 2, c1 = cos[..., :h], c2 = cos[..., h:], s1, s2
    likewise, x1 = x[..., :h], x2 = x[..., h:R]:
        out[..., :h] = x1 c1 - x2 s1;  out[..., h:R] = x2 c2 + x1 s2;  out[..., R:] = x[..., R:]
    computed in float32 and rounded once to q's dtype.
    Returns (q_out, k_out): new contiguous tensors of q's and k's shapes. Differentiable in q
    and k; cos and sin get no gradient (passing ones that require grad is an error).
    """
    name = "apply_rotary"
    _check_rotary(name, q, k, cos, sin)
    return ops.APPLY_ROTARY(q, k, cos, sin)
