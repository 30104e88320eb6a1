"""Public functions of the quant family: argument checks with clear errors, then the ops.

    int4_linear(x, weight, bias=None)       x (..., K) @ W^T (+ bias) -> (..., N), x's dtype
    dequantize_int4(weight, dtype)          W (N, K)
quantize_int4 / quantize_nf4 (quantize.py) make the Int4Weight (format.py) these take.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openkernels.shared import replay

from . import ops, problem
from .format import Int4Weight

# The public functions are named by the op table (problem.OPS); linear_parts is Int4Linear's.
__all__ = [*problem.OPS, "linear_parts", "gated_linear_parts", "normed_linear_parts"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_call(x: Tensor, qweight: Tensor, bias: Tensor | None) -> None:  # qweight: rows or tiled codes
    """problem.py's rules on x and bias, plus what is PyTorch's own: tensors, one device."""
    if not isinstance(x, Tensor):
        raise TypeError(f"int4_linear: x must be a tensor, got {type(x).__name__}")
    problem.check_x_dtype("int4_linear: x", _dtype_name(x.dtype), x.dtype)
    bias_part = problem.Part(tuple(bias.shape), _dtype_name(bias.dtype)) if isinstance(bias, Tensor) else bias
    if qweight.dim() == 3:  # format.tile_codes' layout (Int4Linear(layout="tiled"))
        n, k = 16 * qweight.shape[0], 128 * qweight.shape[1]
    else:
        n, k = qweight.shape[0], 2 * qweight.shape[1]
    problem.check_linear_call(tuple(x.shape), bias_part, n, k, noun="tensor")
    if x.device != qweight.device:
        raise ValueError(f"int4_linear: x is on {x.device}, the weight on {qweight.device}")
    if bias is not None and bias.device != x.device:
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
    tiled: Tensor | None = None,
) -> Tensor:
    """int4_linear on the weight's parts (what Int4Linear.forward calls; the parts were
    checked when the module was built or loaded). qweight: the stored rows (N, K // 2), or the
    codes in format.tile_codes' layout (Int4Linear(layout="tiled")). `tiled`: the same codes
    tiled beside the rows (Int4Linear.use_tiled_codes). Tiled codes run where a kernel reads
    them (ops.tiled_runner: on sm_90, the tensor-core GEMV at 1-16 rows of x, the Gluon wgmma
    kernel where it takes the call; the backward converts them); any other call reads rows:
    the stored ones, or tiled codes converted for the call (one warning per layer shape)."""
    _check_call(x, qweight, bias)
    if perm is not None:
        x = x.index_select(-1, perm)
    codes = qweight  # stored tiled codes go to the op as they are: ops.forward picks their path
    if (
        tiled is not None
        and qweight.dim() == 2
        and x.is_cuda
        and not torch.compiler.is_compiling()
        and ops.tiled_runner(x, tiled, scales, zeros, bias, group_size, kind) is not None
    ):
        codes = tiled
    # Plain eager tensors: the kernel directly, or one autograd.Function; anything else
    # (torch.compile, meta and fake tensors, tensor subclasses such as DTensor): the library op.
    return ops.INT4_LINEAR(x, codes, scales, zeros, bias, group_size, kind)


@replay.replayable
def gated_linear_parts(
    gate_up: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    kind: str,
    act: str,
    tiled: Tensor | None = None,
) -> Tensor:
    """(act(gate) * up) @ W^T + bias on the weight's parts (Int4Linear.forward_gated; fused.py):
    gate_up (..., 2K), gate in [0, K) and up in [K, 2K) of its last dim; no act-order perm, no
    gradient. `tiled`: the codes tiled beside the rows, read where the tensor-core GEMV's gated
    build takes the call."""
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"int4_linear_gated: gate_up's last dim {gate_up.shape[-1]} is not even (gate, then up)"
        )
    _check_call(gate_up[..., : gate_up.shape[-1] // 2], qweight, bias)
    codes = qweight
    if tiled is not None and qweight.dim() == 2 and gate_up.is_cuda and not torch.compiler.is_compiling():
        from . import cuda

        rows = gate_up.reshape(-1, gate_up.shape[-1])
        if rows.stride(-1) == 1 and cuda.takes_gated(rows, tiled, scales, zeros, bias, group_size, kind, act):
            codes = tiled
    return ops.INT4_LINEAR_GATED(gate_up, codes, scales, zeros, bias, group_size, kind, act)


@replay.replayable
def normed_linear_parts(
    x: Tensor,
    norm_weight: Tensor,
    eps: float,
    weight_offset: float,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    kind: str,
    tiled: Tensor | None = None,
) -> Tensor:
    """RMSNorm(x) @ W^T + bias on the weight's parts (Int4Linear.forward_normed; fused.py): x
    (..., K), norm_weight (K,) in x's dtype; no act-order perm, no gradient. `tiled`: the codes
    tiled beside the rows, read where the tensor-core GEMV's normed build takes the call."""
    _check_call(x, qweight, bias)
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise ValueError(
            f"int4_linear_rmsnorm: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} on "
            f"{norm_weight.device}, expected ({x.shape[-1]},) {x.dtype} on {x.device}"
        )
    codes = qweight
    if tiled is not None and qweight.dim() == 2 and x.is_cuda and not torch.compiler.is_compiling():
        from . import cuda

        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) == 1 and cuda.takes_normed(
            rows, norm_weight, tiled, scales, zeros, bias, group_size, kind
        ):
            codes = tiled
    return ops.INT4_LINEAR_RMSNORM(
        x, norm_weight, eps, weight_offset, codes, scales, zeros, bias, group_size, kind
    )


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
    name = _dtype_name(dtype) if isinstance(dtype, torch.dtype) else None
    problem.check_x_dtype("dequantize_int4: dtype", name, dtype)
    w = ops.dequantize(weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.kind, dtype)
    if weight.perm is not None:
        restored = torch.empty_like(w)
        restored[:, weight.perm] = w
        w = restored
    return w
