"""Make the Triton interpreter round float32 -> bfloat16 casts the way GPUs do.

Triton 3.6's interpreter truncates float32 -> bfloat16 casts (its round-to-nearest path
does not carry into the exponent either), while CUDA and ROCm round to nearest even. A
kernel that rounds an intermediate (the layernorm residual stream is rounded to its dtype
before it is normalized) then differs from the reference by an ulp that the normalization
amplifies. Its tl.dot also multiplies bfloat16 operands as their raw uint16 bit patterns
(numpy has no bfloat16), which is off by ~1e10; the patch widens them to float32 first,
exactly as the tensor cores read them. The test plugin installs both fixes under
TRITON_INTERPRET=1 only.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["install_bf16_round_to_nearest"]

_installed = False


def _to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """float32 array -> bfloat16 bit patterns (uint16), rounded to nearest even by torch."""
    rounded = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
    return rounded.view(torch.int16).numpy().view(np.uint16)


def _bf16_bits_to_f32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def install_bf16_round_to_nearest() -> None:
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as I

    builder = I.InterpreterBuilder
    cast_impl, fp_to_fp, dot = builder.cast_impl, builder.create_fp_to_fp, builder.create_dot

    def is_fp32_to_bf16(src, dst_type) -> bool:
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def patched_cast(self, src, dst_type):
        if is_fp32_to_bf16(src, dst_type):
            return I.TensorHandle(_to_bf16_bits(src.data), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if is_fp32_to_bf16(src, dst_type) and rounding_mode != ir.ROUNDING_MODE.RTZ:
            return I.TensorHandle(_to_bf16_bits(src.data), dst_type.scalar)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = I.TensorHandle(
                _bf16_bits_to_f32(a.data) if a.dtype.scalar == tl.bfloat16 else a.data, tl.float32
            )
            b = I.TensorHandle(
                _bf16_bits_to_f32(b.data) if b.dtype.scalar == tl.bfloat16 else b.data, tl.float32
            )
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = patched_cast
    builder.create_fp_to_fp = patched_fp_to_fp
    builder.create_dot = patched_dot
    # create_fp_trunc and friends are lambdas that look cast_impl up on the instance.
    _installed = True
