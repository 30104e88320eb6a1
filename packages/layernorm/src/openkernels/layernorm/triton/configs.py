"""Launch configs of the layernorm kernels: one pure function of (row length, dtype, arch,
direction).

Rows up to MAX_TILE_COLS wide live in registers (one tile: BLOCK_R rows x next_pow2(n)
columns); wider rows take the looped kernels in CHUNK_COLS pieces. The backward runs a
persistent grid of PROGRAMS_PER_SM programs per SM, each reducing its rows' dweight/dbias
into one partial row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["NormConfig", "launch_config", "all_configs", "MAX_TILE_COLS", "CHUNK_COLS"]

# Past 16384 columns a register-resident row needs > 32 float32 values per thread at 16
# warps (CUDA allows 32 warps, ROCm 16 wavefronts): the looped kernel takes over.
MAX_TILE_COLS = 16384
CHUNK_COLS = 4096
# Elements each thread holds per tile (forward / backward, whose tile carries dy, h, dh
# and the dweight accumulator).
ELEMENTS_PER_THREAD = {"fwd": 16, "bwd": 8}
# Narrow rows stack until a tile holds this many elements.
TILE_ELEMENTS = {"fwd": 4096, "bwd": 4096}
PROGRAMS_PER_SM = 8  # backward persistent grid: programs = SMs x this (capped by rows)
MAX_WARPS = {"cuda": 32, "rocm": 16}


@dataclass(frozen=True)
class NormConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    looped: bool
    num_stages: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def launch_config(n_cols: int, dtype: torch.dtype, backend: str, direction: str) -> NormConfig:
    """Tile and warps for rows of n_cols elements.

    direction: "fwd" or "bwd"; backend: "cuda" or "rocm" (64-wide wavefronts: half the
    warps hold the same tile). dtype: unused today (statistics are float32 either way).
    """
    looped = n_cols > MAX_TILE_COLS
    block_cols = CHUNK_COLS if looped else _next_pow2(n_cols)
    block_rows = 1 if looped else max(1, TILE_ELEMENTS[direction] // block_cols)
    threads = block_rows * block_cols // ELEMENTS_PER_THREAD[direction]
    vendor = "rocm" if backend == "rocm" else "cuda"  # the interpreter ("cpu") takes CUDA's
    lane = 64 if vendor == "rocm" else 32
    warps = min(MAX_WARPS[vendor], max(1, _next_pow2(threads // lane)))
    return NormConfig(block_rows, block_cols, warps, looped)


def all_configs(backend: str, direction: str) -> list[NormConfig]:
    """Every config `launch_config` can return (for compile-only checks)."""
    seen = {launch_config(1 << k, torch.float32, backend, direction) for k in range(0, 19)}
    seen.add(launch_config(MAX_TILE_COLS + 1, torch.float32, backend, direction))
    return sorted(seen, key=lambda c: (c.looped, c.block_cols))
