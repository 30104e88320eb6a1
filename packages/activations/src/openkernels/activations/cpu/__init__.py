"""CPU backend: fused C++ kernels (activations.cpp), compiled on first call, run through ctypes.

Same entry points as reference.py: 2D CPU tensors of one dtype (float32, bfloat16 or float16);
x / grad_out have unit column stride and any row stride; out / grad_in are contiguous.
"""

from __future__ import annotations

import ctypes
import pathlib

import torch
from torch import Tensor

from openkernels.shared import cpu_build
from openkernels.shared.dispatch import DispatchKey

__all__ = ["gated_bwd", "gated_fwd", "supports", "unary_bwd", "unary_fwd"]

_SOURCE = pathlib.Path(__file__).with_name("activations.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_library = cpu_build.KernelLibrary(
    _SOURCE,
    name="openkernels_activations",
    signatures={
        "ok_unary_fwd": [_P, _I64, _P, _I64, _I64, _I32, _I32, _I32],
        "ok_unary_bwd": [_P, _I64, _P, _I64, _P, _I64, _I64, _I32, _I32, _I32],
        "ok_gated_fwd": [_P, _I64, _P, _I64, _I64, _I32, _I32, _I32, _I32],
        "ok_gated_bwd": [_P, _I64, _P, _I64, _P, _I64, _I64, _I32, _I32, _I32, _I32],
    },
)


def supports(key: DispatchKey) -> str | None:
    """Dispatch predicate: None when these kernels can run `key`, else why not."""
    return cpu_build.dtype_support(key.dtype, _DTYPE_CODES)


def _check(out: Tensor, rows: int, n_out: int, *inputs: tuple[Tensor, int]) -> int:
    """Validate what the kernels rely on (they index raw memory); return the dtype code.

    `inputs` are (tensor, number of columns) pairs.
    """
    code = _DTYPE_CODES.get(out.dtype)
    if code is None:
        raise TypeError(f"unsupported dtype {out.dtype}")
    for t in (out, *(t for t, _ in inputs)):
        if t.device.type != "cpu" or t.dtype != out.dtype or t.dim() != 2:
            raise ValueError(f"expected 2D CPU {out.dtype} tensors, got {t.dim()}D {t.device} {t.dtype}")
    for t, n in inputs:
        if t.shape != (rows, n) or (t.stride(1) != 1 and n > 1):
            raise ValueError(f"expected shape ({rows}, {n}) with unit column stride, got {tuple(t.shape)}")
    if out.shape != (rows, n_out) or not out.is_contiguous():
        raise ValueError(f"expected a contiguous ({rows}, {n_out}) output, got {tuple(out.shape)}")
    return code


def _done(status: int, act: int) -> None:
    if status != 0:
        raise ValueError(f"unknown activation code {act}")


def unary_fwd(x: Tensor, out: Tensor, act: int) -> None:
    """out = act(x)."""
    rows, n = x.shape
    code = _check(out, rows, n, (x, n))
    if out.numel() == 0:
        return
    status = _library().ok_unary_fwd(
        x.data_ptr(), x.stride(0), out.data_ptr(), rows, n, code, int(act), torch.get_num_threads()
    )
    _done(status, act)


def unary_bwd(grad_out: Tensor, x: Tensor, grad_in: Tensor, act: int) -> None:
    """grad_in = grad_out * act'(x)."""
    rows, n = x.shape
    code = _check(grad_in, rows, n, (grad_out, n), (x, n))
    if grad_in.numel() == 0:
        return
    status = _library().ok_unary_bwd(
        grad_out.data_ptr(), grad_out.stride(0), x.data_ptr(), x.stride(0), grad_in.data_ptr(),
        rows, n, code, int(act), torch.get_num_threads(),
    )  # fmt: skip
    _done(status, act)


def gated_fwd(x: Tensor, out: Tensor, act: int, *, act_first: bool) -> None:
    """out = act(a) * b (act_first) or a * act(b), with a, b = x[:, :d], x[:, d:]."""
    rows, n_in = x.shape
    d = n_in // 2
    if n_in != 2 * d:
        raise ValueError(f"gated ops need an even last dim, got {n_in}")
    code = _check(out, rows, d, (x, n_in))
    if out.numel() == 0:
        return
    status = _library().ok_gated_fwd(
        x.data_ptr(), x.stride(0), out.data_ptr(), rows, d, code, int(act), int(act_first),
        torch.get_num_threads(),
    )  # fmt: skip
    _done(status, act)


def gated_bwd(grad_out: Tensor, x: Tensor, grad_in: Tensor, act: int, *, act_first: bool) -> None:
    """grad_in = d(gated_fwd)/dx applied to grad_out, both halves written."""
    rows, n_in = x.shape
    d = n_in // 2
    if n_in != 2 * d:
        raise ValueError(f"gated ops need an even last dim, got {n_in}")
    code = _check(grad_in, rows, n_in, (grad_out, d), (x, n_in))
    if grad_in.numel() == 0:
        return
    status = _library().ok_gated_bwd(
        grad_out.data_ptr(), grad_out.stride(0), x.data_ptr(), x.stride(0), grad_in.data_ptr(),
        rows, d, code, int(act), int(act_first), torch.get_num_threads(),
    )  # fmt: skip
    _done(status, act)
