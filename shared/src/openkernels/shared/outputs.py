"""The checks of an `out=` argument, shared by every family's public functions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["check_out"]


def check_out(
    name: str,
    out: object,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    like: torch.Tensor,
    inputs: Mapping[str, torch.Tensor | None],
    in_place: Iterable[str] = (),
) -> None:
    """Raise a clear error unless `out` can take a result of `shape` and `dtype`: a contiguous
    tensor on `like`'s device, no autograd (none of `inputs` nor `out` requiring grad under
    grad mode), and no memory shared with any of `inputs` except those named in `in_place`
    given exactly (same address and strides: an op that reads each element before it writes
    it may run in place)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{name}: out must have shape {tuple(shape)} and dtype {dtype}, "
            f"got shape {tuple(out.shape)} and dtype {out.dtype}"
        )
    if out.device != like.device:
        raise ValueError(f"{name}: out is on {out.device} but x is on {like.device}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous")
    if torch.is_grad_enabled() and (
        out.requires_grad or any(t is not None and t.requires_grad for t in inputs.values())
    ):
        raise RuntimeError(f"{name}: out= does not support autograd; call it without out= to get gradients")
    if out.numel() == 0 or torch.compiler.is_compiling():  # traced tensors have no storage to compare
        return
    allowed = tuple(in_place)
    base = out.untyped_storage().data_ptr()
    for what, t in inputs.items():
        if t is None or t.untyped_storage().data_ptr() != base:
            continue
        if what in allowed and t.data_ptr() == out.data_ptr() and t.stride() == out.stride():
            continue
        but = f", except out={' or out='.join(allowed)}" if allowed else ""
        raise ValueError(f"{name}: out must not share memory with {what}{but}")
