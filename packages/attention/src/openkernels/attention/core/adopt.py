"""Results of aten attention kernels taken over instead of copied.

PyTorch's CPU flash kernel and cuDNN's attention take (B, H, S, D) views of our (B, S, H, D)
tensors and allocate their outputs and gradients in the inputs' memory order, so a result
viewed back as (B, S, H, D) usually has the strides of the tensor ops.py allocated for it.
"""

from __future__ import annotations

import torch

__all__ = ["adopt"]


def adopt(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src. dst takes src's memory when dtype and strides agree (no copy: at B8 H16
    S2048 D128 fp32 a copy moves 128 MB), else src is copied in. dst must be a fresh tensor of
    ops.py's (not a view of another: only its own handle would change)."""
    if (
        dst.dtype == src.dtype
        and dst.stride() == src.stride()
        and dst._base is None
        and dst.storage_offset() == 0
    ):
        dst.set_(src)
    else:
        dst.copy_(src)
