"""The activations' argument rules on shapes and option values alone, shared by the PyTorch
(api.py, ops.py) and JAX (jax/) faces; each face checks its own array type and dtype first."""

from __future__ import annotations

from .spec import APPROXIMATE, SPECS

__all__ = ["check_approximate", "check_shape", "out_shape"]


def check_approximate(name: str, approximate: object) -> None:
    """ValueError unless `approximate` is "none" or "tanh"; name: the op or module, for the message."""
    if approximate not in APPROXIMATE:
        raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")


def check_shape(name: str, shape: tuple[int, ...]) -> None:
    """ValueError unless x of op `name` has a shape it takes: a gated op's x is (..., 2*d)."""
    if SPECS[name].gated and (len(shape) == 0 or shape[-1] % 2):
        raise ValueError(
            f"{name}: x must have an even last dim (..., 2*d) holding the two halves, got shape {tuple(shape)}"
        )


def out_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The output shape of op `name` on x of `shape`: x's, or (..., d) for a gated op."""
    return (*shape[:-1], shape[-1] // 2) if SPECS[name].gated else tuple(shape)
