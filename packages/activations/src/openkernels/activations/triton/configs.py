"""Launch configs of the activations kernels: one pure function of (shape, dtype, arch);
plan.py turns one into a launch.

Every kernel here is memory-bound: a program moves one (block_rows, block_cols) tile, and
the only choices are the tile's shape and the warps that move it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["LaunchConfig", "launch_config", "all_configs", "MAX_GRID"]

# Wide rows fill a program by themselves; narrow rows stack several rows per tile.
MAX_BLOCK_COLS = 2048
# Elements per program, and warps (16 elements, two 16-byte bf16 vectors, per thread).
# Swept on H200 with the row-major 1D grid (docs/perf.md, bf16): 2048-element tiles with
# 4 warps gave gated silu fwd 1.001 / bwd 0.996 and unary silu fwd 0.959 / bwd 0.989 of
# copy at 16384 rows, against 0.995 / 1.000 and 0.926 / 0.995 for 4096-element tiles with
# 8 warps; 8192+-element tiles lost 1-8%.
TILE_ELEMENTS = 2048
MAX_GRID = 2**31 - 1  # grid axis 0 limit on CUDA and ROCm


@dataclass(frozen=True)
class LaunchConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    num_stages: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def launch_config(n_rows: int, n_cols: int, dtype: torch.dtype, backend: str) -> LaunchConfig:
    """Tile and warps for an (n_rows, n_cols) problem; shared by forward and backward.

    backend: "cuda" or "rocm" (64-wide wavefronts: half the warps move the same tile).
    dtype: unused today (fp32 tiles are twice the bytes but stay under register limits).
    """
    block_cols = min(_next_pow2(n_cols), MAX_BLOCK_COLS)
    # Narrow rows stack up to a full tile; rows past n_rows are masked off (cheap), which
    # keeps the set of compiled configs small: one per block_cols.
    block_rows = max(1, TILE_ELEMENTS // block_cols)
    warps = 2 if backend == "rocm" else 4  # same 128 threads: AMD wavefronts are 64 wide
    return LaunchConfig(block_rows, block_cols, warps)


def all_configs(backend: str) -> list[LaunchConfig]:
    """Every config `launch_config` can return for `backend` (for compile-only checks)."""
    seen = {launch_config(1024, 1 << log_cols, torch.float32, backend) for log_cols in range(0, 17)}
    return sorted(seen, key=lambda c: c.block_cols)
