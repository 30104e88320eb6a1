"""CPU backend: a fused dequantize + matmul C++ kernel (int4_linear.cpp), compiled on first call,
run through ctypes. bfloat16 x of 4 rows or more, where the library is built with AVX512-BF16
(bf16_kernel_min_m), multiplies bfloat16 blocks of W by vdpbf16ps inside the kernel; where it is not
and torch's bfloat16 GEMM is fast (or torch has AMX tiles), bfloat16 x of many rows goes to the same
library's dequantization in panels, each multiplied by torch.mm (dequantizes_then_multiplies). Both
round W to bfloat16 before the products (rounds_weight).

Same entry points as reference.py. x (M, K) has unit column stride and any row stride, in float32,
bfloat16 or float16; out (M, N) is contiguous in x's dtype; qweight (N, K // 2) uint8 and
scales / zeros (K // group_size, N) float16 or bfloat16 have unit column stride; bias (N,) may be
any float dtype (converted to float32 here, which is what the reference adds).

PyTorch's own CPU int4 kernel (aten._weight_int4pack_mm_for_cpu) is not used: it reads a blocked
packing of its own (_convert_weight_to_int4pack_for_cpu, not format.py's bytes) and a scale-and-
offset form, (q - 8) * s + offset, that our zeros reach only through an offset rounded to bfloat16,
so every call (or a cache) would convert the weight; it has no NF4. Measured against this kernel on a
2-core AVX2 machine, N = K = 4096, group 128, bfloat16 x: 1.3 / 10 / 76 ms at M = 1 / 16 / 128,
against 1.0 / 5.4 / 32 ms here.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch
from torch import Tensor

from openkernels.shared import cpu_build
from openkernels.shared.dispatch import DispatchKey, InvalidInputError

from ..format import KINDS, SCALE_DTYPES, nf4_values

__all__ = [
    "bf16_kernel_min_m",
    "dequantize_int4_fwd",
    "dequantizes_then_multiplies",
    "int4_linear_fwd",
    "rounds_weight",
    "supports",
]

_SOURCE = pathlib.Path(__file__).with_name("int4_linear.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INT4_ZEROS, _INT4_SYMMETRIC, _NF4 = 0, 1, 2
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # x, x_stride, q, q_stride, s, s_stride, z, z_stride, s_bf16, nf4, bias, out,
    # M, N, K, group_size, dtype, kind, threads
    "ok_int4_linear": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I32, _P, _P, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32],
    # q, q_stride, s, s_stride, z, z_stride, s_bf16, nf4, out, N, K, group_size, dtype, kind, threads
    "ok_int4_dequantize": [_P, _I64, _P, _I64, _P, _I64, _I32, _P, _P, _I64, _I64, _I64, _I32, _I32, _I32],
}  # fmt: skip
_library = cpu_build.KernelLibrary(_SOURCE, name="openkernels_quant", signatures=_SIGNATURES)

# From this many rows of bfloat16 x (and no bias), W goes to bfloat16 in panels of
# PANEL_ROWS rows (the C++ dequantization below) and torch's bfloat16 GEMM multiplies: where
# the CPU has AVX512-BF16 or AMX, that GEMM outruns the float32 kernel. Measured on the 2-core
# AVX-512 BF16 VM (torch 2.13, group 128, N x K = 4096 x 4096, 11008 x 4096, 4096 x 11008, the
# table dequantization): 1.06-1.17x the kernel at M = 24, 1.09-1.25x at 32, 1.4x at 40 (1.0x at
# K = 11008), 1.6-1.8x at 128; the kernel at M = 16 (0.91-1.03x); 1024-row panels were the
# fastest of 256-11008 (docs/perf.md). W is rounded to bfloat16 before the products, as on the
# GPU's large-M path (reference.linear_error_bound's weight term). A bias stays with the
# kernel, which adds it before its single rounding. Without those instructions torch's bf16
# GEMM is several times slower (25 ms at M = 16 on an AVX2 machine): the kernel runs. Where the
# kernel has its own vdpbf16ps path, that path runs instead (it measured as fast as torch's
# GEMM on the 16-bit weight at M = 128 on that VM, so ahead of the panels, which also dequantize);
# AMX tiles, not measured here, keep the panels.
DEQUANTIZE_MATMUL_MIN_M = 24
# Panels of at most 1024 rows and 8 MiB: glibc serves blocks of that size from its heap after
# the first call, where a fresh 32 MB block costs ~10 ms of page faults on that VM.
PANEL_ROWS, PANEL_BYTES = 1024, 8 << 20


def _torch_probe(name: str) -> bool:
    try:
        return bool(getattr(torch.cpu, name)())
    except Exception:  # a torch without the probe: assume the slow GEMM
        return False


@functools.cache
def _fast_bf16_gemm() -> bool:
    """Whether torch's CPU bfloat16 GEMM has AVX512-BF16 or AMX tiles to run on."""
    return _amx_tiles() or _torch_probe("_is_avx512_bf16_supported")


@functools.cache
def _amx_tiles() -> bool:
    """Whether torch's CPU bfloat16 GEMM has AMX tiles (not measured here: kept on the panels)."""
    return _torch_probe("_is_amx_tile_supported")


@functools.cache
def _build_query(lib: cpu_build.KernelLibrary, name: str) -> int:
    """An int that `lib` reports about its build (a function of no arguments: not a kernel, so it
    is called on the library itself, unseen by replay recordings)."""
    lib()  # compiles and loads it
    raw = cpu_build.load_library(lib.source, name=lib.name, extra_flags=lib.extra_flags)
    fn = getattr(raw, name)
    fn.argtypes, fn.restype = [], ctypes.c_int
    return int(fn())


def bf16_kernel_min_m() -> int | None:
    """The smallest M from which bfloat16 x runs the C++ kernel's vdpbf16ps path (W rounded to
    bfloat16, float32 sums), or None where the library was built without AVX512-BF16."""
    return _build_query(_library, "ok_int4_bf16_min_rows") or None


def dequantizes_then_multiplies(m: int, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether int4_linear_fwd takes the dequantize-then-GEMM path (W rounded to bfloat16): where
    torch's bfloat16 GEMM is fast and the kernel has no vdpbf16ps path, or torch has AMX tiles."""
    return (
        dtype == torch.bfloat16
        and not has_bias
        and m >= DEQUANTIZE_MATMUL_MIN_M
        and _fast_bf16_gemm()
        and (_amx_tiles() or bf16_kernel_min_m() is None)
    )


def rounds_weight(m: int, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether int4_linear_fwd rounds W to x's dtype before the products (the error contract's
    weight term): bfloat16 x on the kernel's vdpbf16ps path or the dequantize-then-GEMM path."""
    if dtype != torch.bfloat16:
        return False
    first = bf16_kernel_min_m()
    return (first is not None and m >= first) or dequantizes_then_multiplies(m, dtype, has_bias)


def supports(key: DispatchKey) -> str | None:
    """Dispatch predicate: None when these kernels can run `key`, else why not."""
    return cpu_build.dtype_support(key.dtype, _DTYPE_CODES)


def _unit_columns(t: Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def _check_weight(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, kind: str
) -> tuple[int, int, int]:
    """Validate what the kernels rely on (they index raw memory); return (N, K, kind code).
    InvalidInputError (a ValueError): dispatch raises it to the caller, marking nothing."""
    if kind not in KINDS:
        raise InvalidInputError(f"kind must be one of {KINDS}, got {kind!r}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.device.type != "cpu":
        raise InvalidInputError(
            f"qweight must be a 2D uint8 CPU tensor, got {qweight.dim()}D {qweight.dtype} {qweight.device}"
        )
    if not _unit_columns(qweight):
        raise InvalidInputError(f"qweight must have unit column stride, got strides {qweight.stride()}")
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise InvalidInputError(f"group_size must be a positive even int, got {group_size!r}")
    if k % group_size:
        raise InvalidInputError(f"group_size {group_size} does not divide in_features {k}")
    groups = k // group_size
    if scales.dtype not in SCALE_DTYPES or scales.device.type != "cpu":
        raise InvalidInputError(
            f"scales must be a float16 or bfloat16 CPU tensor, got {scales.dtype} {scales.device}"
        )
    if tuple(scales.shape) != (groups, n) or not _unit_columns(scales):
        raise InvalidInputError(
            f"scales must be ({groups}, {n}) (in_features // group_size, out_features) with unit column "
            f"stride, got {tuple(scales.shape)} strides {scales.stride()}"
        )
    if zeros is None:
        return n, k, _NF4 if kind == "nf4" else _INT4_SYMMETRIC
    if kind == "nf4":
        raise InvalidInputError("nf4 weights have no zeros")
    if zeros.dtype != scales.dtype or zeros.device.type != "cpu":
        raise InvalidInputError(
            f"zeros must be a CPU tensor of the scales' dtype {scales.dtype}, got {zeros.dtype}"
        )
    if tuple(zeros.shape) != (groups, n) or not _unit_columns(zeros):
        raise InvalidInputError(
            f"zeros must be ({groups}, {n}) with unit column stride, got {tuple(zeros.shape)} strides {zeros.stride()}"
        )
    return n, k, _INT4_ZEROS


def _zeros_args(zeros: Tensor | None) -> tuple[int | None, int]:
    return (None, 0) if zeros is None else (zeros.data_ptr(), zeros.stride(0))


def _status(status: int) -> None:
    if status != 0:  # not reached: the checks above cover what the kernels reject
        raise ValueError(f"int4 kernel rejected its arguments (status {status})")


def int4_linear_fwd(x, qweight, scales, zeros, bias, out: Tensor, group_size: int, kind: str) -> None:
    """out = x @ W^T (+ bias), W dequantized from (qweight, scales, zeros) as format.py says.

    x (M, K) float32 / bfloat16 / float16 with unit column stride; qweight (N, K // 2) uint8;
    scales / zeros (K // group_size, N) float16 or bfloat16 (zeros None: symmetric int4, or nf4);
    bias (N,) any float dtype or None; out (M, N) contiguous, x's dtype. Accumulates in float32;
    zeros are used as the reference uses them, (code - zero) in float32, whatever their values.
    """
    n, k, kind_code = _check_weight(qweight, scales, zeros, group_size, kind)
    code = _DTYPE_CODES.get(x.dtype)
    if code is None or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(
            f"x must be a 2D float32, bfloat16 or float16 CPU tensor, got {x.dim()}D {x.dtype} {x.device}"
        )
    m = x.shape[0]
    if x.shape[1] != k or not _unit_columns(x):
        raise ValueError(
            f"x must be ({m}, {k}) with unit column stride, got {tuple(x.shape)} strides {x.stride()}"
        )
    if (
        out.dtype != x.dtype
        or out.device.type != "cpu"
        or tuple(out.shape) != (m, n)
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous ({m}, {n}) CPU tensor of x's dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if bias is not None:
        if not bias.is_floating_point() or bias.device.type != "cpu" or tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be a float ({n},) CPU tensor, got {tuple(bias.shape)} {bias.dtype}")
        bias = bias.to(torch.float32).contiguous()
    if out.numel() == 0:
        return
    if dequantizes_then_multiplies(m, x.dtype, bias is not None):
        _dequantize_then_multiply(x, qweight, scales, zeros, out, group_size, kind)
        return
    z_ptr, z_stride = _zeros_args(zeros)
    status = _library().ok_int4_linear(
        x.data_ptr(), x.stride(0), qweight.data_ptr(), qweight.stride(0), scales.data_ptr(), scales.stride(0),
        z_ptr, z_stride, int(scales.dtype == torch.bfloat16), nf4_values().data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k, group_size, code, kind_code,
        torch.get_num_threads(),
    )  # fmt: skip
    _status(status)


def _dequantize_then_multiply(x, qweight, scales, zeros, out: Tensor, group_size: int, kind: str) -> None:
    """out (M, N) bfloat16 = x @ W^T, W dequantized to bfloat16 PANEL_ROWS rows at a time (a
    panel stays in cache between the dequantization and the GEMM that reads it)."""
    n, k = qweight.shape[0], x.shape[1]
    rows = min(PANEL_ROWS, max(64, PANEL_BYTES // (2 * k) // 64 * 64), n)
    panel = torch.empty(rows, k, dtype=torch.bfloat16)
    for n0 in range(0, n, rows):
        nb = min(rows, n - n0)
        w = panel[:nb]
        part = None if zeros is None else zeros[:, n0 : n0 + nb]
        dequantize_int4_fwd(qweight[n0 : n0 + nb], scales[:, n0 : n0 + nb], part, w, group_size, kind)
        if nb == n:
            torch.mm(x, w.t(), out=out)
        else:
            out[:, n0 : n0 + nb] = torch.mm(x, w.t())


def dequantize_int4_fwd(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, out: Tensor, group_size: int, kind: str
) -> None:
    """out (N, K) = W, dequantized in float32 and rounded once to out's dtype.

    qweight (N, K // 2) uint8; scales / zeros (K // group_size, N) float16 or bfloat16;
    out contiguous float32 / bfloat16 / float16.
    """
    n, k, kind_code = _check_weight(qweight, scales, zeros, group_size, kind)
    code = _DTYPE_CODES.get(out.dtype)
    if code is None or out.device.type != "cpu" or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({n}, {k}) float32, bfloat16 or float16 CPU tensor, got "
            f"{tuple(out.shape)} {out.dtype} {out.device}"
        )
    if out.numel() == 0:
        return
    z_ptr, z_stride = _zeros_args(zeros)
    status = _library().ok_int4_dequantize(
        qweight.data_ptr(), qweight.stride(0), scales.data_ptr(), scales.stride(0), z_ptr, z_stride,
        int(scales.dtype == torch.bfloat16), nf4_values().data_ptr(), out.data_ptr(), n, k, group_size, code,
        kind_code, torch.get_num_threads(),
    )  # fmt: skip
    _status(status)
