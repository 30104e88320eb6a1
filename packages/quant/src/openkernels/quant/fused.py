"""The decode step's fused projections: a 4-bit layer that takes what precedes it in a decoder
layer, in one launch of the tensor-core GEMV where it can, composed here where it cannot.

A gated MLP's down projection on its stacked gate / up output: down(act(gate) * up).
kernelize's gated MLP (the activations family) computes gate_up = x @ [W_gate; W_up]^T in one
launch, then act(gate) * up in a second, then the down projection in a third. With a 4-bit
down projection the tensor-core GEMV computes act(gate) * up itself where it loads x's windows
(cuda.int4_linear_gated_fwd), one launch and one pass over the (M, K) product fewer. Composed:
the activation in float32, rounded once to gate_up's dtype (as activations' *_and_mul kernels
round it), then int4_linear by its best backend.

    gate_up (M, 2K) fp16 / bf16 / fp32 with unit column stride: gate in columns [0, K), up in
    [K, 2K); out (M, N) contiguous, gate_up's dtype; act one of ACTS.

A pre-norm decoder's projection on its un-normed hidden state: forward(RMSNorm(x)). A decoder
layer runs its input norm (and its post-attention norm) as a launch of its own, whose output
only the next projection reads: the q / k / v projection (the gate / up projection). With
4-bit weights the tensor-core GEMV computes the norm itself (cuda.int4_linear_normed_fwd):
each CTA takes its rows' sums of squares (the whole row, from L2) and scales x's windows as it
loads them. Composed: the norm in float32, rounded once to x's dtype, then int4_linear.

    x (M, K) fp16 / bf16 / fp32 with unit column stride; norm_weight (K,) in x's dtype;
    RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * (norm_weight + weight_offset) (Llama-style
    norms: offset 0; Gemma's: 1); out (M, N) contiguous, x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ACTS", "gated_product", "int4_linear_gated_fwd", "rms_normed", "int4_linear_normed_fwd"]

ACTS = ("silu", "gelu", "gelu_tanh")


def gated_product(gate_up: Tensor, act: str) -> Tensor:
    """act(gate) * up (..., K) in gate_up's dtype, computed in float32 (float64 for float64)."""
    if act not in ACTS:
        raise ValueError(f"gated activation {act!r}: one of {ACTS}")
    work = torch.float64 if gate_up.dtype == torch.float64 else torch.float32
    gate, up = gate_up.to(work).chunk(2, dim=-1)
    if act == "silu":
        a = F.silu(gate)
    else:
        a = F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none")
    return (a * up).to(gate_up.dtype)


def int4_linear_gated_fwd(gate_up, qweight, scales, zeros, bias, out: Tensor, group_size: int, kind: str,
                          act: str) -> None:  # fmt: skip
    """The composed implementation: the activation, then ops.forward (int4_linear's dispatch)."""
    from . import ops

    out.copy_(ops.forward(gated_product(gate_up, act), qweight, scales, zeros, bias, group_size, kind))


def rms_normed(x: Tensor, weight: Tensor, eps: float, weight_offset: float = 0.0) -> Tensor:
    """RMSNorm(x) (..., K) in x's dtype, computed in float32 (float64 for float64 x)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd * (weight.to(work) + weight_offset)).to(x.dtype)


def int4_linear_normed_fwd(x, norm_weight, eps: float, weight_offset: float, qweight, scales, zeros, bias,
                           out: Tensor, group_size: int, kind: str) -> None:  # fmt: skip
    """The composed implementation: the norm, then ops.forward (int4_linear's dispatch)."""
    from . import ops

    normed = rms_normed(x, norm_weight, eps, weight_offset)
    out.copy_(ops.forward(normed, qweight, scales, zeros, bias, group_size, kind))
