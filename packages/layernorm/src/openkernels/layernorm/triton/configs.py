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

__all__ = ["NormConfig", "launch_config", "all_configs", "MAX_TILE_COLS", "CHUNK_COLS", "PROGRAMS_PER_SM"]

# Widest row held in registers. Forward: past 16384 columns a row needs > 32 float32
# values per thread at 16 warps (CUDA allows 32 warps, ROCm 16 wavefronts). Backward keeps
# dy, h, w and the dweight/dbias accumulators live: at 16384 columns and 32 warps (64
# registers per thread) it spilled 264-900 B per thread on sm_90, so it loops from there.
MAX_TILE_COLS = {"fwd": 16384, "bwd": 8192}
CHUNK_COLS = 4096
# Elements each thread holds per tile (forward / backward, whose tile carries dy, h, dh
# and the dweight accumulator).
ELEMENTS_PER_THREAD = {"fwd": 16, "bwd": 16}
# Narrow rows stack until a tile holds this many elements.
TILE_ELEMENTS = {"fwd": 4096, "bwd": 2048}
PROGRAMS_PER_SM = 8  # backward persistent grid: programs = SMs x this (capped by rows)
MAX_WARPS = {"cuda": 32, "rocm": 16}


@dataclass(frozen=True)
class NormConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    looped: bool
    programs_per_sm: int = PROGRAMS_PER_SM  # backward: persistent grid of SMs x this
    num_stages: int = 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def launch_config(
    n_cols: int, dtype: torch.dtype, backend: str, direction: str, aligned: bool = True
) -> NormConfig:
    """Tile and warps for rows of n_cols elements.

    direction: "fwd" or "bwd"; backend: "cuda" or "rocm" (64-wide wavefronts: half the
    warps hold the same tile). aligned: n_cols and the row strides are multiples of 16, so
    loads are vectorized; unaligned rows load element by element, each element with its
    own address registers, and switch to the looped kernel at half the width (the 16384
    forward tile spilled 8 B per thread on sm_80 unaligned). dtype: unused today.
    """
    limit = MAX_TILE_COLS[direction] if aligned else MAX_TILE_COLS[direction] // 2
    looped = n_cols > limit
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
    seen.add(launch_config(MAX_TILE_COLS[direction] + 1, torch.float32, backend, direction))
    return sorted(seen, key=lambda c: (c.looped, c.block_cols))
