"""Public functions and nn.Modules of the layernorm family, with argument checks.

Functions normalize over the last dim of x (..., N). Dtypes: x in float16, bfloat16,
float32 on every backend, float64 on the CPU and reference backends; statistics in float32
(float64 for float64 x); see reference.py for the exact casting contract.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from openkernels.shared import opdef, replay
from openkernels.shared.outputs import check_out

from . import ops
from .problem import DTYPES, HALF_AND_FLOAT, MODULES, NORMS, check_arrays

# The functions and modules are named by the op table (problem.NORMS).
__all__ = [*NORMS, *MODULES]

_DTYPE_NAMES = "float16, bfloat16, float32 (or float64 throughout)"
# problem.py's dtype names <-> torch dtypes
_NAME = {getattr(torch, name): name for name in DTYPES}
# problem.check_arrays' allowed dtype names -> torch dtypes
_ALLOWED = {names: tuple(getattr(torch, n) for n in names) for names in (HALF_AND_FLOAT, ("float64",))}


def _check_tensor(name: str, what: str, t: object, x: torch.Tensor, allowed: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{name}: {what} is on {t.device} but x is on {x.device}")
    if t.dtype not in allowed:
        raise TypeError(
            f"{name}: {what} has dtype {t.dtype}; with x in {x.dtype} it must be one of {allowed}"
        )


def _check_dtype_arg(name: str, what: str, dtype: object, allowed: tuple) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name}: {what} must be a floating torch.dtype or None, got {dtype!r}")
    if dtype not in allowed:
        raise TypeError(f"{name}: {what}={dtype} is not supported here; allowed: {allowed}")


def _check(
    name: str,
    x: object,
    weight: object,
    bias: object,
    residual: object,
    eps: object,
    weight_offset: object,
    out_dtype: object,
    residual_dtype: object,
) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _NAME:
        raise TypeError(f"{name}: x has dtype {x.dtype}; supported: {_DTYPE_NAMES}")

    def check_tensor(what: str, t: object, names: tuple[str, ...]) -> None:
        _check_tensor(name, what, t, x, _ALLOWED[names])

    arrays = (weight, bias, residual)
    allowed = _ALLOWED[
        check_arrays(name, tuple(x.shape), _NAME[x.dtype], arrays, eps, weight_offset, check_tensor)
    ]
    _check_dtype_arg(name, "out_dtype", out_dtype, allowed)
    _check_dtype_arg(name, "residual_dtype", residual_dtype, allowed)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _check_out(
    name: str,
    out: object,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    prenorm: bool,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> None:
    """out= takes y: x's shape and y's dtype; x or residual itself is allowed (every backend
    reads an element before it writes it)."""
    if prenorm:
        raise ValueError(f"{name}: out= is not supported with prenorm=True")
    inputs = {"x": x, "residual": residual, "weight": weight, "bias": bias}
    check_out(name, out, tuple(x.shape), out_dtype or x.dtype, x, inputs, in_place=("x", "residual"))


@replay.replayable
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: y = h / sqrt(mean(h^2) + eps) * (weight + weight_offset).

    x: (..., N); weight: (N,) or None; residual: x's shape or None, then h = x + residual
    (rounded to residual_dtype, default residual's dtype) is what gets normalized, in one
    pass. Returns y (..., N) in out_dtype (default x's dtype), or (y, h) with prenorm=True,
    h being the residual stream for the next block. weight_offset=1.0 gives Gemma's (1 + w).
    Differentiable in x, weight and residual.

    out: a contiguous tensor of x's shape and y's dtype to write y into and return (x or
    residual itself is allowed: in place); not with prenorm=True, nor when a gradient is
    wanted.
    """
    _check("rms_norm", x, weight, None, residual, eps, weight_offset, out_dtype, residual_dtype)
    weight = _contiguous(weight)
    if out is not None:
        _check_out("rms_norm", out, x, residual, out_dtype, prenorm, weight)
        args = (x, weight, residual, float(eps), float(weight_offset), residual_dtype)
        if opdef.plain_eager(x, weight, residual, out):
            ops.RMS_NORM_OUT.direct(*args, out=out)
        else:
            torch.ops.openkernels.rms_norm_out(*args, out=out)
        return out
    needs_grad = _needs_grad(x, weight, residual)
    store = prenorm or (needs_grad and residual is not None)
    eps, weight_offset = float(eps), float(weight_offset)
    # Plain eager tensors: the kernels directly, or one autograd.Function; else the library op.
    out, h, _ = ops.RMS_NORM(x, weight, residual, eps, weight_offset, store, out_dtype, residual_dtype)
    return (out, h) if prenorm else out


@replay.replayable
def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    out_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim: y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias.

    x: (..., N); weight, bias: (N,) or None; residual, prenorm, out_dtype, residual_dtype,
    out as in `rms_norm`. The variance is the biased one, as in torch.nn.LayerNorm.
    Differentiable in x, weight, bias and residual.
    """
    _check("layer_norm", x, weight, bias, residual, eps, 0.0, out_dtype, residual_dtype)
    weight, bias = _contiguous(weight), _contiguous(bias)
    if out is not None:
        _check_out("layer_norm", out, x, residual, out_dtype, prenorm, weight, bias)
        args = (x, weight, bias, residual, float(eps), residual_dtype)
        if opdef.plain_eager(x, weight, bias, residual, out):
            ops.LAYER_NORM_OUT.direct(*args, out=out)
        else:
            torch.ops.openkernels.layer_norm_out(*args, out=out)
        return out
    needs_grad = _needs_grad(x, weight, bias, residual)
    store = prenorm or (needs_grad and residual is not None)
    eps = float(eps)
    out, h, _, _ = ops.LAYER_NORM(x, weight, bias, residual, eps, store, out_dtype, residual_dtype)
    return (out, h) if prenorm else out


def _flatten_normalized(
    name: str, x: torch.Tensor, normalized_shape: Sequence[int], *params: torch.Tensor | None
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """View x (..., *normalized_shape) as (..., prod) and the parameters as (prod,)."""
    k = len(normalized_shape)
    if tuple(x.shape[x.dim() - k :]) != tuple(normalized_shape) or x.dim() < k:
        raise ValueError(
            f"{name}: x of shape {tuple(x.shape)} does not end in normalized_shape {tuple(normalized_shape)}"
        )
    if k == 1:
        return x, list(params)
    flat = x.reshape(*x.shape[: x.dim() - k], -1)
    return flat, [None if p is None else p.reshape(-1) for p in params]


def _residual_rows(
    name: str, residual: torch.Tensor | None, x: torch.Tensor, flat: torch.Tensor
) -> torch.Tensor | None:
    if residual is None or flat is x:
        return residual
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"{name}: residual must have x's shape {tuple(x.shape)}, got {shape}")
    return residual.reshape(flat.shape)


def torch_default_eps(dtype: torch.dtype) -> float:
    """The epsilon torch's RMSNorm takes for eps=None: that of the type it computes in
    (float32 for float16 / bfloat16 inputs, float64 for float64), not of x's dtype (bfloat16's
    is 0.0078, which scaled a bfloat16 row of RMS 0.05 by ~0.45)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


class RMSNorm(nn.RMSNorm):
    """Drop-in for torch.nn.RMSNorm (same arguments, attributes and state_dict keys).

    eps=None means torch's default, torch_default_eps(x.dtype). weight_offset=1.0 gives Gemma's
    (1 + weight) scaling (reset_parameters still starts the weight at ones, as torch does).
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.weight_offset = float(weight_offset)
        if not math.isfinite(self.weight_offset):
            raise ValueError(f"{type(self).__name__}: weight_offset must be finite, got {weight_offset!r}")

    def _eps(self, x: torch.Tensor) -> float:
        return torch_default_eps(x.dtype) if self.eps is None else self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, (w,) = _flatten_normalized(type(self).__name__, x, self.normalized_shape, self.weight)
        y = rms_norm(flat, w, self._eps(x), weight_offset=self.weight_offset)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return super().extra_repr() + offset


class LayerNorm(nn.LayerNorm):
    """Drop-in for torch.nn.LayerNorm (same arguments, attributes and state_dict keys)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, (w, b) = _flatten_normalized(
            type(self).__name__, x, self.normalized_shape, self.weight, self.bias
        )
        return layer_norm(flat, w, b, self.eps).view(x.shape)


class _ResidualAdd(nn.Module):
    """Base of the fused residual-add modules: the norm's parameters, plus the keyword
    residual_dtype, the dtype of the residual stream h = x + residual they return (default:
    residual's dtype, or x's when residual is None)."""

    def __init__(self, *args: Any, residual_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.residual_dtype = residual_dtype


class AddRMSNorm(_ResidualAdd, RMSNorm):
    """Fused residual add + RMSNorm: forward(x, residual) returns (rms_norm(x + residual), x + residual).

    The second output is the residual stream for the next block, in residual_dtype. Same
    parameters as RMSNorm, plus the keyword residual_dtype.
    """

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat, (w,) = _flatten_normalized(type(self).__name__, x, self.normalized_shape, self.weight)
        r = _residual_rows(type(self).__name__, residual, x, flat)
        y, h = rms_norm(flat, w, self._eps(x), residual=r, prenorm=True, weight_offset=self.weight_offset,
                        residual_dtype=self.residual_dtype)  # fmt: skip
        return y.view(x.shape), h.view(x.shape)


class AddLayerNorm(_ResidualAdd, LayerNorm):
    """Fused residual add + LayerNorm: forward(x, residual) returns (layer_norm(x + residual), x + residual).

    Same parameters as LayerNorm, plus the keyword residual_dtype as in AddRMSNorm.
    """

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat, (w, b) = _flatten_normalized(
            type(self).__name__, x, self.normalized_shape, self.weight, self.bias
        )
        r = _residual_rows(type(self).__name__, residual, x, flat)
        y, h = layer_norm(flat, w, b, self.eps, residual=r, prenorm=True, residual_dtype=self.residual_dtype)
        return y.view(x.shape), h.view(x.shape)
