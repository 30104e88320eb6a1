"""Public functions of the quant family: argument checks with clear errors, then the ops.

    int4_linear(x, weight, bias=None)       x (..., K) @ W^T (+ bias) -> (..., N), x's dtype
    dequantize_int4(weight, dtype)          W (N, K)
quantize_int4 / quantize_nf4 (quantize.py) make the Int4Weight (format.py) these take.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openkernels.shared import replay

from . import ops
from .format import Int4Weight

__all__ = ["int4_linear", "dequantize_int4", "linear_parts"]

_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_call(x: Tensor, qweight: Tensor, bias: Tensor | None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"int4_linear: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"int4_linear: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(
            f"int4_linear: x has shape {tuple(x.shape)}, its last dimension must be in_features {k}"
        )
    if x.device != qweight.device:
        raise ValueError(f"int4_linear: x is on {x.device}, the weight on {qweight.device}")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (n,):
            raise ValueError(f"int4_linear: bias must be a float tensor of shape ({n},), got "
                             f"{getattr(bias, 'shape', bias)} {getattr(bias, 'dtype', '')}")  # fmt: skip
        if bias.device != x.device:
            raise ValueError(f"int4_linear: bias is on {bias.device}, x on {x.device}")


@replay.replayable
def linear_parts(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    kind: str,
    perm: Tensor | None = None,
) -> Tensor:
    """int4_linear on the weight's parts (what Int4Linear.forward calls; the parts were
    checked when the module was built or loaded)."""
    _check_call(x, qweight, bias)
    if perm is not None:
        x = x.index_select(-1, perm)
    # Plain eager tensors: the kernel directly, or one autograd.Function; anything else
    # (torch.compile, meta and fake tensors, tensor subclasses such as DTensor): the library op.
    return ops.INT4_LINEAR(x, qweight, scales, zeros, bias, group_size, kind)


def int4_linear(x: Tensor, weight: Int4Weight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W^T + bias with W a 4-bit weight.

    Args:
        x: (..., K) float16 or bfloat16 (the GPU kernels); float32 and float64 also run
            (CPU kernels / reference). Any leading shape, any strides.
        weight: Int4Weight (N, K) from quantize_int4, quantize_nf4 or a checkpoint import.
        bias: optional (N,) float tensor; added in float32 before the single rounding.

    Returns:
        (..., N) in x's dtype. Differentiable in x and bias.
    """
    if not isinstance(weight, Int4Weight):
        raise TypeError(f"int4_linear: weight must be an Int4Weight, got {type(weight).__name__}")
    return linear_parts(x, weight.qweight, weight.scales, weight.zeros, bias, weight.group_size, weight.kind,
                        weight.perm)  # fmt: skip


def dequantize_int4(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight (N, K) in `dtype` (float16, bfloat16, float32 or float64), in the original
    column order (act-order perm undone)."""
    if not isinstance(weight, Int4Weight):
        raise TypeError(f"dequantize_int4: weight must be an Int4Weight, got {type(weight).__name__}")
    if dtype not in _X_DTYPES:
        raise TypeError(f"dequantize_int4: dtype must be float16, bfloat16, float32 or float64, got {dtype}")
    w = ops.dequantize(weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.kind, dtype)
    if weight.perm is not None:
        restored = torch.empty_like(w)
        restored[:, weight.perm] = w
        w = restored
    return w
