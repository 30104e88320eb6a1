"""The launch plan of the activations kernels: config, grid and EVEN flag of one launch from
its shape. The PyTorch launchers (triton/__init__.py), the JAX ones (jax/launch.py) and the
compile-only checks (tests/test_aot.py) all launch through it."""

from __future__ import annotations

import functools

import torch

from .configs import MAX_GRID, LaunchConfig, launch_config

__all__ = ["launch_plan"]


@functools.cache
def launch_plan(
    n_rows: int, n_cols: int, dtype: torch.dtype, backend: str
) -> tuple[LaunchConfig, tuple[int], bool]:
    """Config, 1D grid and EVEN flag of one launch; PyTorch and JAX launch through this."""
    cfg = launch_config(n_rows, n_cols, dtype, backend)
    tiles = -(-n_rows // cfg.block_rows) * -(-n_cols // cfg.block_cols)
    if tiles > MAX_GRID:
        raise ValueError(f"{n_rows}x{n_cols} needs {tiles} programs, more than one launch takes ({MAX_GRID})")
    even = n_rows % cfg.block_rows == 0 and n_cols % cfg.block_cols == 0
    return cfg, (tiles,), even
