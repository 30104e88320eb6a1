"""The norms' argument rules on shapes and Python scalars alone, shared by the PyTorch
(api.py) and JAX (jax/) faces; each face checks its own array types and dtypes first."""

from __future__ import annotations

import math
import numbers

__all__ = ["check_shapes_and_scalars"]


def check_shapes_and_scalars(
    name: str,
    x_shape: tuple[int, ...],
    params: dict[str, tuple[int, ...] | None],
    residual_shape: tuple[int, ...] | None,
    eps: object,
    weight_offset: object,
) -> None:
    """params: {"weight": shape or None, "bias": shape or None}. Raise ValueError /
    TypeError naming the argument."""
    if len(x_shape) == 0:
        raise ValueError(f"{name}: x must have at least one dim (the normalized one), got a scalar")
    n = x_shape[-1]
    for what, shape in params.items():
        if shape is not None and tuple(shape) != (n,):
            raise ValueError(f"{name}: {what} must have shape ({n},) for x of shape {tuple(x_shape)}, "
                             f"got {tuple(shape)}")  # fmt: skip
    if residual_shape is not None and tuple(residual_shape) != tuple(x_shape):
        raise ValueError(
            f"{name}: residual must have x's shape {tuple(x_shape)}, got {tuple(residual_shape)}"
        )
    # A NaN or inf eps or weight_offset makes every output NaN (or zero, or the bias).
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not 0 <= eps < math.inf:
        raise ValueError(f"{name}: eps must be a non-negative float, not NaN or inf, got {eps!r}")
    if not isinstance(weight_offset, numbers.Real) or isinstance(weight_offset, bool):
        raise TypeError(f"{name}: weight_offset must be a float, got {weight_offset!r}")
    if not math.isfinite(weight_offset):
        raise ValueError(f"{name}: weight_offset must be finite, got {weight_offset!r}")
    if weight_offset != 0 and params.get("weight") is None:
        raise ValueError(f"{name}: weight_offset={weight_offset} scales a weight, but weight is None")
