"""Plain PyTorch definitions of RMSNorm and LayerNorm: the definition of correct.

Casting contract (every backend follows it):
  h   = round_{residual_dtype}(x + residual)     (x itself when there is no residual)
  rms:  y = h * rstd * (w + weight_offset),        rstd = 1 / sqrt(mean(h^2) + eps)
  ln:   y = (h - mean) * rstd * w + b,             rstd = 1 / sqrt(var(h) + eps), var biased
  y is rounded once to out_dtype. Sums, statistics and the affine math run in float32
  (float64 when x is float64); a missing weight is 1, a missing bias 0.
The normalized input is the rounded h, so the forward and the backward (which reads the
stored h) see the same numbers, and the result equals the unfused `norm(x + residual)`.

`rms_norm_ref` / `layer_norm_ref` are differentiable and take the public API's arguments;
`norm_fwd` / `norm_bwd` are the reference backend's entry points (see ops.py).
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm_ref", "layer_norm_ref", "norm_fwd", "norm_bwd", "stats_dtype"]


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of sums and saved statistics for inputs of `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _residual_stream(
    x: torch.Tensor, residual: torch.Tensor | None, residual_dtype: torch.dtype | None
) -> torch.Tensor:
    h_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    acc = stats_dtype(x.dtype)
    h = x.to(acc) if residual is None else x.to(acc) + residual.to(acc)
    return h.to(h_dtype)


def _statistics(h: torch.Tensor, eps: float, rms: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mean or None, rstd) over the last dim of h (already in the compute dtype)."""
    if rms:
        return None, torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).square().mean(-1, keepdim=True)
    return mean, torch.rsqrt(var + eps)


def _normalize(h, weight, bias, eps: float, weight_offset: float, rms: bool) -> tuple:
    """(y, mean or None, rstd) of h (..., N) over its last dim, with weight and bias (N,) or
    None, all in the compute dtype (statistics keep that dim)."""
    hc = h.to(stats_dtype(h.dtype))
    acc = hc.dtype
    mean, rstd = _statistics(hc, eps, rms)
    y = (hc if mean is None else hc - mean) * rstd
    if weight is not None:
        y = y * (weight.to(acc) + weight_offset)
    if bias is not None:
        y = y + bias.to(acc)
    return y, mean, rstd


def _norm_ref(
    x, weight, bias, eps, *, rms: bool, residual=None, prenorm=False, weight_offset=0.0, out_dtype=None,
    residual_dtype=None,
):  # fmt: skip
    h = _residual_stream(x, residual, residual_dtype)
    y = _normalize(h, weight, bias, eps, weight_offset, rms)[0].to(out_dtype or x.dtype)
    return (y, h) if prenorm else y


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, **options: object
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim under the casting contract above (differentiable). options,
    by keyword: residual, prenorm, weight_offset, out_dtype, residual_dtype, as in
    `openkernels.layernorm.rms_norm`."""
    return _norm_ref(x, weight, None, eps, rms=True, **options)


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    **options: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim under the casting contract above (differentiable). options,
    by keyword: residual, prenorm, out_dtype, residual_dtype, as in
    `openkernels.layernorm.layer_norm` (a weight_offset is a TypeError)."""
    return _norm_ref(x, weight, bias, eps, rms=False, weight_offset=0.0, **options)


# Backend entry points: ops.py's docstring gives the arguments' shapes and dtypes (2D inputs
# with unit column stride, outputs preallocated and contiguous).


def norm_fwd(
    x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset, rms, h_dtype
) -> None:
    h = _residual_stream(x, residual, h_dtype)
    if residual_out is not None:
        residual_out.copy_(h)
    y, mu, r = _normalize(h, weight, bias, eps, weight_offset, rms)
    rstd.copy_(r.squeeze(-1))
    if mean is not None:
        mean.copy_(mu.squeeze(-1))
    out.copy_(y)


def norm_bwd(dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias, *, weight_offset, rms) -> None:
    """dh = d(norm)/dh applied to dy, plus dh_out; dweight = sum(dy * xhat); dbias = sum(dy).

    With xhat = (h - mean) * rstd and g = dy * (w + weight_offset):
      rms: dh = rstd * (g - xhat * mean(g * xhat))
      ln:  dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
    """
    acc = rstd.dtype
    hc, g = h.to(acc), dy.to(acc)
    r = rstd.to(acc).unsqueeze(-1)
    xhat = (hc if mean is None else hc - mean.to(acc).unsqueeze(-1)) * r
    wg = g if weight is None else g * (weight.to(acc) + weight_offset)
    inner = wg - xhat * (wg * xhat).mean(-1, keepdim=True)
    if not rms:
        inner = inner - wg.mean(-1, keepdim=True)
    grad = r * inner
    if dh_out is not None:
        grad = grad + dh_out.to(acc)
    dh.copy_(grad)
    if dweight is not None:
        dweight.copy_((g * xhat).sum(0))
    if dbias is not None:
        dbias.copy_(g.sum(0))
