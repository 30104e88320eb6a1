"""Random inputs for kernel tests: fresh every call, odd shapes, non-contiguous views."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["ODD_SIZES", "random_tensor", "noncontiguous_views", "poisoned_empty"]

# Sizes that stress masking and vector widths: 1, a small prime, just under and over a power of two.
ODD_SIZES = (1, 7, 127, 4097)


def random_tensor(
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    scale: float = 1.0,
    requires_grad: bool = False,
) -> torch.Tensor:
    """Normal(0, scale) values, drawn fresh (never zeros), rounded to `dtype`."""
    t = (torch.randn(shape, dtype=torch.float32, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def noncontiguous_views(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Non-contiguous tensors of `shape` (at least 2D): (name, tensor) pairs.

    - "col-slice": the last dim sliced out of a wider buffer (row stride > width);
    - "row-step": every other row of a taller buffer;
    - "transposed": a transposed buffer (last dim not unit stride: forces a copy path).
    """
    *lead, n = shape
    wide = random_tensor((*lead, n + 13), dtype, device)
    yield "col-slice", wide[..., 5 : 5 + n]
    if lead:
        tall = random_tensor((*lead[:-1], 2 * lead[-1], n), dtype, device)
        yield "row-step", tall[..., ::2, :]
        flipped = random_tensor((*lead[:-1], n, lead[-1]), dtype, device)
        yield "transposed", flipped.transpose(-1, -2)


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside the block torch.empty fills new tensors with NaN (integers with their max),
    so any output element a kernel forgets to write fails the comparison."""
    import torch.utils.deterministic as det

    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        det.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
