"""The family's op table and the norms' argument rules on shapes and Python scalars alone,
shared by the PyTorch (api.py, ops.py) and JAX (jax/) faces; each face checks its own array
types and dtypes first."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NormSpec",
    "NORMS",
    "BENCH_OPS",
    "MODULES",
    "HALF_AND_FLOAT",
    "DTYPES",
    "norm_name",
    "check_arrays",
    "check_shapes_and_scalars",
]


@dataclass(frozen=True)
class NormSpec:
    """One norm of the op table: its names on every face."""

    name: str  # public function (api.py, jax/), library op openkernels::<name>, reference <name>_ref
    rms: bool  # normalizes by the root mean square (no mean, no bias); else LayerNorm
    module: str  # the nn.Module, a drop-in for torch.nn.<module>
    add_module: str  # the module of the fused residual add + norm (prenorm)


NORMS: dict[str, NormSpec] = {
    s.name: s
    for s in (
        NormSpec("rms_norm", rms=True, module="RMSNorm", add_module="AddRMSNorm"),
        NormSpec("layer_norm", rms=False, module="LayerNorm", add_module="AddLayerNorm"),
    )
}
MODULES = (*(s.module for s in NORMS.values()), *(s.add_module for s in NORMS.values()))
# Benchmark and test variants: each norm, and RMSNorm on a residual stream (prenorm=True).
BENCH_OPS = (*NORMS, "add_rms_norm")


def norm_name(rms: bool) -> str:
    """The op name of RMSNorm (rms=True) or LayerNorm."""
    return _NAMES[rms]


_NAMES = {s.rms: s.name for s in NORMS.values()}

HALF_AND_FLOAT = ("float16", "bfloat16", "float32")
DTYPES = (*HALF_AND_FLOAT, "float64")  # x's dtypes: float64 on the reference-exact paths only
_WIDE = ("float64",)


def check_arrays(
    name: str, x_shape: tuple[int, ...], x_dtype: str, arrays: tuple, eps: object, weight_offset: object,
    check_array: Callable[[str, Any, tuple[str, ...]], None],
) -> tuple[str, ...]:  # fmt: skip
    """The rules both faces share once x itself is checked (x_dtype: its dtype name).

    arrays: (weight, bias, residual), each an array with .shape or None; the face's
    check_array(what, array, allowed dtype names) checks each present one: mixed precision
    within float16, bfloat16 and float32, float64 only all the way (tests, gradcheck). Then
    their shapes and the scalars. Returns the allowed dtype names (out_dtype, residual_dtype)."""
    allowed = _WIDE if x_dtype == "float64" else HALF_AND_FLOAT
    weight, bias, residual = arrays
    if weight is not None:
        check_array("weight", weight, allowed)
        weight = tuple(weight.shape)
    if bias is not None:
        check_array("bias", bias, allowed)
        bias = tuple(bias.shape)
    if residual is not None:
        check_array("residual", residual, allowed)
        residual = tuple(residual.shape)
    check_shapes_and_scalars(name, x_shape, {"weight": weight, "bias": bias}, residual, eps, weight_offset)
    return allowed


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
    if not -math.inf < weight_offset < math.inf:  # comparisons: torch.compile traces them on a SymFloat
        raise ValueError(f"{name}: weight_offset must be finite, got {weight_offset!r}")
    if weight_offset != 0 and params.get("weight") is None:
        raise ValueError(f"{name}: weight_offset={weight_offset} scales a weight, but weight is None")
