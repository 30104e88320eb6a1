"""The CPU decode kernel (decode.cpp): attention of a few query tokens against an unquantized
KV cache in one C++ call, compiled on first use and called through ctypes.

It reads the cache lengths, left paddings and block table itself, so a call reads no tensor
value on the host (the whole call replays, shared.replay) and gathers no copy of the keys.
Contract: reference.attention_kvcache_fwd for bits 16 without rotary; `why_not` says which
calls it takes (the rest keep cpu/kvcache.py's gather path).
"""

from __future__ import annotations

import ctypes
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from openkernels.shared import cpu_build, dispatch

__all__ = ["why_not", "why_not_dense", "attend", "backward_dense", "MAX_ROWS"]

_SOURCE = pathlib.Path(__file__).with_name("decode.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Query rows per task (query heads per KV head x query tokens) the kernel keeps in float32
# scratch; more (a prefill through the cache) runs on the gather path's flash kernel.
MAX_ROWS = 64
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "ok_attention_decode": [_P, _I64, _I64, _I64, _P, _I64, _I64, _I64, _P, _I64, _I64, _I64,  # q, k, v and strides
                            _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64,  # lengths, block table, leftpad, slopes
                            _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,  # out, lse, B, Sq, Hq, Hkv, D, seqlen_new
                            _F64, _F64, _I64, _I64, _I32, _I32, _I32],  # scale, softcap, window, dtypes, threads
    # q, k, v, out, dout and strides; lse, slopes, dq, dk, dv; B .. D, scale, softcap, window, dtype, threads
    "ok_attention_short_backward": [_P, _I64, _I64, _I64] * 5 + [_P, _P, _I64, _P, _P, _P, *[_I64] * 6, _F64, _F64,
                                                                 _I64, _I64, _I32, _I32],
}  # fmt: skip


def _load(
    name: str = "openkernels_attention_decode", extra_flags: Sequence[str] = ()
) -> cpu_build.KernelLibrary:
    """decode.cpp's kernels, built with `extra_flags` under the cache name `name` on first call
    (tests swap in narrower builds as `_lib`)."""
    return cpu_build.KernelLibrary(_SOURCE, name=name, signatures=_SIGNATURES, extra_flags=extra_flags)


_lib = _load()


def _library() -> Any:
    """The loaded kernels: `_lib` looked up at each call, so a test's replacement takes effect."""
    return _lib()


def _int32(t: torch.Tensor | None, dims: int) -> bool:
    return t is None or (t.dtype == torch.int32 and t.dim() == dims and (t.numel() <= 1 or t.stride(-1) == 1))


def why_not(
    q, k_data, v_data, cache_seqlens, block_table, rotary_cos, *, bits, key_group, leftpad
) -> str | None:
    """None when the kernel runs this call, else why not (the gather path runs it)."""
    if bits != 16 or k_data.dtype not in _DTYPE_CODES or v_data.dtype != k_data.dtype:
        return "a quantized cache"
    if q.dtype not in _DTYPE_CODES:
        return f"q in {q.dtype}"
    if rotary_cos is not None:
        return "rotary in the call"
    if key_group:
        return "keys quantized by channel"
    rows = q.shape[2] // k_data.shape[2] * q.shape[1]
    if rows > MAX_ROWS:
        return f"{rows} query rows per KV head (more than {MAX_ROWS})"
    if q.stride(-1) != 1 or k_data.stride(-1) != 1 or v_data.stride(-1) != 1:
        return "a head_dim stride other than 1"
    if not (_int32(cache_seqlens, 1) and _int32(block_table, 2) and _int32(leftpad, 1)):
        return "lengths, block table or left padding not int32 with a unit last stride"
    return cpu_build.no_compiler_reason()


# Most keys the backward kernel takes: one task per (sequence, KV head) walks all of them, and
# with few rows per task the flash kernel's backward wins on long key sequences (2-core AVX-512
# VM, fp32, forward+backward ms, this kernel / flash: Sq1 Sk4096 Hq32/Hkv8 D128 23.3 / 13.2;
# B2 Sq16 Sk1024 Hq16/Hkv4 D64 causal 7.7 / 8.3; B8 Sq=Sk=64 H16 D64 causal 8.8 / 8.8).
MAX_BACKWARD_KEYS = 1024


def why_not_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> str | None:
    """None when the kernel runs plain attention (no cache: every key of k / v, (B, S, H, D)) of
    these tensors, forward or `backward`, else why not. It takes calls of few query rows per KV
    head (a decode through `attention`, short sequences): one C++ call replayed whole, where the
    flash kernel's call goes through several aten ops (host time on the 2-core VM, B1 S16 H4 D64
    fp32 causal: forward 14.4 us against 28.8 before, forward+backward 80 against 150)."""
    if q.dtype not in _DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v in {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] % 16:
        return f"head_dim {q.shape[-1]} (the kernel takes multiples of 16)"
    rows = q.shape[2] // k.shape[2] * q.shape[1]
    if rows > MAX_ROWS:
        return f"{rows} query rows per KV head (more than {MAX_ROWS})"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "a head_dim stride other than 1"
    if backward and k.shape[1] > MAX_BACKWARD_KEYS:
        return f"{k.shape[1]} keys in a backward (more than {MAX_BACKWARD_KEYS})"
    return cpu_build.no_compiler_reason()


def attend(q, k_data, v_data, out, lse, cache_seqlens, block_table, *, seqlen_new, scale, window_left,
           window_right, alibi_slopes, softcap, leftpad) -> None:  # fmt: skip
    """Write out (B, Sq, Hq, D) and lse (B, Hq, Sq), both contiguous, for a call `why_not`
    (or `why_not_dense`) accepts. alibi_slopes: (B, Hq) float32 contiguous or None.
    cache_seqlens None: no cached tokens, each sequence's keys are k_data's first seqlen_new rows."""
    b, sq, hq, d = q.shape
    hkv = k_data.shape[2]
    paged = block_table is not None
    slopes = alibi_slopes
    status = _library().ok_attention_decode(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k_data.data_ptr(), k_data.stride(0), k_data.stride(1), k_data.stride(2),
        v_data.data_ptr(), v_data.stride(0), v_data.stride(1), v_data.stride(2),
        None if cache_seqlens is None else cache_seqlens.data_ptr(), block_table.data_ptr() if paged else None,
        block_table.stride(0) if paged else 0, block_table.shape[1] if paged else 0,
        k_data.shape[1], k_data.shape[0], None if leftpad is None else leftpad.data_ptr(),
        None if slopes is None else slopes.data_ptr(), 0 if slopes is None else slopes.stride(0),
        out.data_ptr(), lse.data_ptr(), b, sq, hq, hkv, d, seqlen_new,
        scale, softcap, window_left, window_right, _DTYPE_CODES[q.dtype], _DTYPE_CODES[k_data.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:  # the caller's lengths or pages (check=False): theirs to fix, not a kernel failure
        raise dispatch.InvalidInputError(
            "attention_kvcache: a sequence's cache_seqlens (plus the new tokens), cache_leftpad or block_table "
            "entries point outside the cache (check=True says which)"
        )
    if status != 0:  # not reached: the op's checks cover what the kernel rejects
        raise ValueError(f"attention decode kernel rejected its arguments (status {status})")


def backward_dense(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, *, scale, window_left, window_right,
                   softcap) -> None:  # fmt: skip
    """Write dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D), all contiguous, of plain attention (no
    cache) for a call `why_not_dense` accepts, from the saved out and lse (B, Hq, Sq) float32
    contiguous. dout: any strides with a unit last one. One task per (sequence, KV
    head) owns its keys' gradients: deterministic, no accumulation between tasks."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    slopes = alibi_slopes
    status = _library().ok_attention_short_backward(
        *(x for t in (q, k, v, out, dout) for x in (t.data_ptr(), t.stride(0), t.stride(1), t.stride(2))),
        lse.data_ptr(), None if slopes is None else slopes.data_ptr(), 0 if slopes is None else slopes.stride(0),
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), b, sq, sk, hq, hkv, d, scale, softcap, window_left,
        window_right, _DTYPE_CODES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:  # not reached: why_not_dense covers what the kernel rejects
        raise ValueError(f"attention short backward kernel rejected its arguments (status {status})")
