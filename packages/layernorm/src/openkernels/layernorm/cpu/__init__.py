"""CPU backend: fused C++ kernels (layernorm.cpp), compiled on first call, run through ctypes.

Same entry points as reference.norm_fwd / reference.norm_bwd. Inputs (x, residual, dy, h, dh_out)
are 2D CPU tensors with unit column stride and any row stride; outputs (out, residual_out, dh) are
contiguous. Every tensor may have its own dtype among float32, bfloat16 and float16; float64 runs
the same kernels with double accumulators, for exactness (gradcheck), not speed. Statistics (mean,
rstd), dweight and dbias are float32 (float64 when x is float64).
"""

from __future__ import annotations

import ctypes
import math
import pathlib

import torch
from torch import Tensor

from openkernels.shared import cpu_build
from openkernels.shared.dispatch import DispatchKey

__all__ = ["norm_bwd", "norm_fwd", "supports"]

_SOURCE = pathlib.Path(__file__).with_name("layernorm.cpp")
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_NARROW = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes of the float32 path
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "ok_norm_fwd": [_P, _I64, _I32, _P, _I64, _I32, _P, _P, _P, _I32, _P, _I32, _P, _P, _I32, _I64, _I64, _F64, _I32, _I32],
    "ok_norm_bwd": [_P, _I64, _I32, _P, _I64, _I32, _P, _P, _P, _P, _I64, _I32, _P, _I32, _P, _P, _I64, _I64, _I32, _I32, _I32],
}  # fmt: skip
_library = cpu_build.KernelLibrary(_SOURCE, name="openkernels_layernorm", signatures=_SIGNATURES)


def supports(key: DispatchKey) -> str | None:
    """Dispatch predicate: None when these kernels can run `key`, else why not."""
    return cpu_build.dtype_support(key.dtype, _CODES)


def _code(t: Tensor, name: str, wide: bool) -> int:
    """The dtype code of `t`; float64 only on the float64 path (`wide`)."""
    allowed = _CODES if wide else _NARROW
    if t.dtype not in allowed:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name}: expected one of {kinds}, got {t.dtype}")
    return _CODES[t.dtype]


def _cpu(t: Tensor, name: str) -> None:
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got one on {t.device}")


def _input(t: Tensor | None, name: str, shape: tuple[int, int], wide: bool) -> tuple[int, int, int]:
    """(data_ptr, row stride, dtype code) of a 2D input with unit column stride; zeros for None."""
    if t is None:
        return 0, 0, 0
    _cpu(t, name)
    code = _code(t, name, wide)
    if t.dim() != 2 or tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.stride(1) != 1 and shape[1] > 1:
        raise ValueError(f"{name}: expected unit column stride, got strides {t.stride()}")
    if t.stride(0) < 0:
        raise ValueError(f"{name}: expected a non-negative row stride, got {t.stride(0)}")
    return t.data_ptr(), t.stride(0) if shape[0] > 1 else shape[1], code


def _output(t: Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> int:
    """data_ptr of a contiguous output of `shape` (and `dtype` when given); 0 for None."""
    if t is None:
        return 0
    _cpu(t, name)
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor of shape {shape}, got {tuple(t.shape)}")
    return t.data_ptr()


def _param(t: Tensor | None, name: str, n: int, acc: torch.dtype, offset: float = 0.0) -> Tensor | None:
    """weight / bias as a contiguous (N,) tensor of the accumulator dtype, plus `offset`."""
    if t is None:
        return None
    _cpu(t, name)
    if not t.is_floating_point() or tuple(t.shape) != (n,):
        got = f"{t.dtype} {tuple(t.shape)}"
        raise ValueError(f"{name}: expected a floating-point tensor of shape ({n},), got {got}")
    if t.dtype != acc or not t.is_contiguous():  # N elements; weight.to(acc) + offset, as the reference
        t = t.detach().to(acc).contiguous()
    return t + offset if offset != 0.0 else t


def _threads(rows: int) -> int:
    return max(1, min(torch.get_num_threads(), rows))


def norm_fwd(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    out: Tensor,
    residual_out: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    *,
    eps: float,
    weight_offset: float,
    rms: bool,
    h_dtype: torch.dtype,
) -> None:
    """h = round_{h_dtype}(x + residual) (into residual_out), normalize h, write out, mean and rstd."""
    _cpu(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2D tensor, got {x.dim()}D")
    M, N = x.shape
    wide = x.dtype == torch.float64
    acc = torch.float64 if wide else torch.float32
    x_ptr, x_stride, x_code = _input(x, "x", (M, N), wide)
    r_ptr, r_stride, r_code = _input(residual, "residual", (M, N), wide)
    if h_dtype not in (_CODES if wide else _NARROW):
        raise TypeError(f"h_dtype: {h_dtype} is not supported with x of {x.dtype}")
    out_ptr = _output(out, "out", (M, N))
    ro_ptr = _output(residual_out, "residual_out", (M, N))
    out_code = _code(out, "out", wide)
    ro_code = 0 if residual_out is None else _code(residual_out, "residual_out", wide)
    if rms and mean is not None:
        raise ValueError("mean: RMSNorm has no mean; pass None")
    mean_ptr = _output(mean, "mean", (M,), acc)
    rstd_ptr = _output(rstd, "rstd", (M,), acc)
    w = _param(weight, "weight", N, acc, weight_offset)
    b = _param(bias, "bias", N, acc)
    if M == 0:
        return
    if N == 0:  # statistics of an empty row: NaN, as the reference's mean over nothing
        rstd.fill_(math.nan)
        if mean is not None:
            mean.fill_(math.nan)
        return
    status = _library().ok_norm_fwd(
        x_ptr, x_stride, x_code, r_ptr, r_stride, r_code,
        0 if w is None else w.data_ptr(), 0 if b is None else b.data_ptr(),
        out_ptr, out_code, ro_ptr, ro_code, mean_ptr, rstd_ptr, _CODES[h_dtype],
        M, N, float(eps), int(rms), _threads(M),
    )  # fmt: skip
    if status != 0:
        raise TypeError("ok_norm_fwd: unsupported dtype combination")


def norm_bwd(
    dy: Tensor,
    h: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    dh_out: Tensor | None,
    dh: Tensor,
    dweight: Tensor | None,
    dbias: Tensor | None,
    *,
    weight_offset: float,
    rms: bool,
) -> None:
    """dh = d(norm)/dh applied to dy, plus dh_out; dweight = sum(dy * xhat); dbias = sum(dy)."""
    _cpu(rstd, "rstd")
    if rstd.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"rstd: expected float32 or float64, got {rstd.dtype}")
    acc = rstd.dtype
    wide = acc == torch.float64
    _cpu(h, "h")
    if h.dim() != 2:
        raise ValueError(f"h: expected a 2D tensor, got {h.dim()}D")
    M, N = h.shape
    dy_ptr, dy_stride, dy_code = _input(dy, "dy", (M, N), wide)
    h_ptr, h_stride, h_code = _input(h, "h", (M, N), wide)
    do_ptr, do_stride, do_code = _input(dh_out, "dh_out", (M, N), wide)
    dh_ptr = _output(dh, "dh", (M, N))
    dh_code = _code(dh, "dh", wide)
    if not rms and mean is None:
        raise ValueError("mean: LayerNorm's backward needs the saved mean")
    mean_ptr = _output(mean, "mean", (M,), acc)
    rstd_ptr = _output(rstd, "rstd", (M,), acc)
    # dweight / dbias in the parameters' dtype: the kernel sums into the accumulator's, stored once.
    sums = [t if t is None or t.dtype == acc else torch.empty(N, dtype=acc) for t in (dweight, dbias)]
    dw_ptr = _output(sums[0], "dweight", (N,), acc)
    db_ptr = _output(sums[1], "dbias", (N,), acc)
    w = _param(weight, "weight", N, acc, weight_offset)
    if M == 0 or N == 0:  # sums over no rows
        for t in (dweight, dbias):
            if t is not None:
                t.zero_()
        return
    status = _library().ok_norm_bwd(
        dy_ptr, dy_stride, dy_code, h_ptr, h_stride, h_code,
        0 if w is None else w.data_ptr(), mean_ptr, rstd_ptr, do_ptr, do_stride, do_code,
        dh_ptr, dh_code, dw_ptr, db_ptr, M, N, int(rms), int(wide), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise TypeError("ok_norm_bwd: unsupported dtype combination")
    for total, summed in zip((dweight, dbias), sums):
        if summed is not total:
            total.copy_(summed)
