"""CPU backend of the rotary position embedding: the reference's float32 math (float64 for
float64) in token chunks whose float32 intermediates stay in cache, each half computed as one
multiply and one multiply-add straight from the 16-bit inputs (no float32 copy of x) and
rounded once into the output. Contract: reference.apply_rotary_fwd / apply_rotary_bwd.

Measured on the 2-core development machine (shared, noisy: min of 7 x 10 calls, forward,
bf16, tables (1, S, R), ms at 1 / 2 threads; runs differed by up to 1.5x):
  q 1x512x32x128, k 1x512x8x128:   reference 6.8 / 6.1, this path 5.5 / 4.8, transformers'
                                   formula in bf16 arithmetic 4.1-6.6 / 2.7-4.0
  Phi-2 1x256x32x80 (R 32):        reference 1.3 / 1.4, this path 1.0 / 1.0, transformers' 1.0 / 1.0-1.2
  decode 64x1x32x128:              reference 0.49 / 0.57, this path 0.44 / 0.37, transformers' 0.40 / 0.27
So about 1.3x the reference and on par with the torch formula (which rounds three times).
Chunks of 2^14 and 2^16 elements and no chunking measured 13.7, 7.3 and 11.2 ms against 5.8
for 2^18 (first shape, 1 thread).

Where a C++ compiler exists, rotary.cpp runs the float16 / bfloat16 / float32 calls instead:
one fused pass over q and k in one call, which replays whole (shared.replay) where the torch
ops above replay as a program of about twenty aten ops (2-core VM, q (1, 16, 4, 64) float32:
see the CHANGELOG for the host time).
"""

from __future__ import annotations

import ctypes
import pathlib

import torch

from openkernels.shared import cpu_build

from ...core.reference import compute_dtype

__all__ = ["apply_rotary_fwd", "apply_rotary_bwd", "CHUNK_ELEMENTS", "FORCE_TORCH"]

_SOURCE = pathlib.Path(__file__).with_name("rotary.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# True: the torch ops even where the C++ kernel runs (tests).
FORCE_TORCH = False
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    # q then k: data, strides (sequence, token, head), heads, out; cos, sin, table strides, B, S, D, R,
    # x dtype, table dtype, transpose, threads
    "ok_rotary": [_P, _I64, _I64, _I64, _I64, _P] * 2 + [_P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I32, _I32,
                                                       _I32, _I32],
}  # fmt: skip
_library = cpu_build.KernelLibrary(_SOURCE, name="openkernels_attention_rotary", signatures=_SIGNATURES)


def _kernel_runs(x_q, x_k, cos, sin, out_q, out_k) -> bool:
    """The C++ kernel takes this call: its dtypes, one table layout, contiguous outputs."""
    if (
        FORCE_TORCH
        or x_q.dtype not in _DTYPE_CODES
        or x_k.dtype != x_q.dtype
        or cos.dtype not in _DTYPE_CODES
    ):
        return False
    if (
        sin.dtype != cos.dtype
        or sin.shape != cos.shape
        or sin.stride() != cos.stride()
        or cos.stride(-1) != 1
    ):
        return False
    if not (out_q.is_contiguous() and out_k.is_contiguous()) or x_q.shape[0] != x_k.shape[0]:
        return False
    return cpu_build.no_compiler_reason() is None


def _run_kernel(x_q, x_k, cos, sin, out_q, out_k, transpose: bool) -> None:
    b, s, _, d = x_q.shape
    status = _library().ok_rotary(
        x_q.data_ptr(), x_q.stride(0), x_q.stride(1), x_q.stride(2), x_q.shape[2], out_q.data_ptr(),
        x_k.data_ptr(), x_k.stride(0), x_k.stride(1), x_k.stride(2), x_k.shape[2], out_k.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), b, s, d,
        cos.shape[-1], _DTYPE_CODES[x_q.dtype], _DTYPE_CODES[cos.dtype], int(transpose), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:  # not reached: the op's checks cover what the kernel rejects
        raise ValueError(f"rotary kernel rejected its arguments (status {status})")


CHUNK_ELEMENTS = 2**18  # float32 elements of one half per chunk (1 MiB)


def _tables(
    cos: torch.Tensor, sin: torch.Tensor, acc: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, ...]:
    """(c1, c2, s1, s2) as (Bc, S, 1, R / 2) in the compute dtype; the transpose's (s1, s2) are
    (-s2, -s1)."""
    half = cos.shape[-1] // 2
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)
    if transpose:
        return c[..., :half], c[..., half:], -s[..., half:], -s[..., :half]
    return c[..., :half], c[..., half:], s[..., :half], s[..., half:]


def _rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    """out = the rotation of x (B, S, H, D) by tables (c1, c2, s1, s2) of (Bc, S, 1, R / 2)."""
    batch, seqlen, heads, head_dim = x.shape
    half = tables[0].shape[-1]
    tokens = max(1, CHUNK_ELEMENTS // max(1, batch * heads * half))
    buf = torch.empty((batch, min(tokens, seqlen), heads, half), dtype=tables[0].dtype)
    for start in range(0, seqlen, tokens):
        if tokens >= seqlen:  # one chunk: no slicing (about 10 us a view op on the dev machine)
            xs, os, b, (c1, c2, s1, s2) = x, out, buf, tables
        else:
            rows = slice(start, start + tokens)
            xs, os = x[:, rows], out[:, rows]
            b = buf[:, : xs.shape[1]]
            c1, c2, s1, s2 = (t[:, rows] for t in tables)
        x1, x2 = xs[..., :half], xs[..., half : 2 * half]
        torch.mul(x1, c1, out=b)
        b.addcmul_(x2, s1, value=-1.0)
        os[..., :half].copy_(b)
        torch.mul(x2, c2, out=b)
        b.addcmul_(x1, s2)
        os[..., half : 2 * half].copy_(b)
    if 2 * half < head_dim:
        out[..., 2 * half :].copy_(x[..., 2 * half :])


def _run(x_q, x_k, cos, sin, out_q, out_k, transpose: bool) -> None:
    if _kernel_runs(x_q, x_k, cos, sin, out_q, out_k):
        _run_kernel(x_q, x_k, cos, sin, out_q, out_k, transpose)
        return
    with torch.no_grad():
        tables = _tables(cos, sin, compute_dtype(x_q.dtype), transpose)
        _rotate(x_q, tables, out_q)
        _rotate(x_k, tables, out_k)


def apply_rotary_fwd(q, k, cos, sin, q_out, k_out) -> None:
    _run(q, k, cos, sin, q_out, k_out, False)


def apply_rotary_bwd(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in) -> None:
    _run(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, True)
