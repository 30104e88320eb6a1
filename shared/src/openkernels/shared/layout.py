"""Tensor layout helpers shared by the row-wise kernels of every family."""

from __future__ import annotations

import torch

__all__ = ["as_rows"]


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2D (rows, last dim) view of `t` whose last dim has stride 1.

    No copy when the leading dims collapse into one row stride (contiguous tensors,
    slices along the last dim, slices along the batch dims); otherwise a contiguous copy.
    """
    if t.dim() == 2 and t.stride(1) == 1:  # the common case, kept cheap
        return t
    n = t.shape[-1] if t.dim() else 1
    if t.dim() >= 1 and (t.stride(-1) == 1 or n <= 1):
        try:
            rows = t.view(-1, n)
        except RuntimeError:
            pass
        else:
            if rows.stride(1) == 1 or n <= 1:
                return rows
    return t.contiguous().view(-1, n)
