"""Launch configs of the layernorm kernels: one pure function of (row length, dtype, arch,
direction, norm), shared by the launchers, the tuning sweep and the compile-only checks.

Forward: rows up to MAX_TILE_COLS wide live in registers (the tile kernel); longer rows are
split over up to MAX_SPLITS programs that exchange partial statistics (the split kernel),
and rows longer still take the looped kernel. Backward: the tile kernel on a persistent
grid of programs_per_sm programs per SM, each reducing its rows' dweight/dbias into one
partial row; past MAX_TILE_COLS the split kernel (runs of rows, each row split over
programs that exchange its gradient sums), and the looped kernel past that.

plan.py turns a config into one launch (kernel, grid, split count, rows per program,
shape-derived constexprs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "NormConfig",
    "launch_config",
    "all_configs",
    "MAX_TILE_COLS",
    "MAX_SPLITS",
    "looped_config",
]

# Widest row held in registers. Forward: past 16384 columns a row needs > 32 float32
# values per thread at 16 warps (CUDA allows 32 warps, ROCm 16 wavefronts). Backward keeps
# dy, h and the dweight/dbias accumulators live: at 16384 columns and 32 warps (64
# registers per thread) it spilled 264-900 B per thread on sm_90, so it loops from there.
MAX_TILE_COLS = {"fwd": 16384, "bwd": 8192}
# Split kernel: at most this many programs per row (they must be resident together; any
# GPU holds 64 such programs at once). Looped kernels: chunk per step.
MAX_SPLITS = 64
# The backward's dweight/dbias reduction over the programs' partial rows: parts per step,
# columns per program (enough programs at 2048 columns), warps.
SUM_BLOCK_P, SUM_BLOCK_C, SUM_WARPS = 32, 128, 4
LOOPED_COLS = 4096
SPLIT_COLS = 8192  # the split kernels' chunk per program (doubled for the longest rows)
# LayerNorm split forward: the chunk's (mean, M2) in one pass (two independent sums about
# a shift, kernels._chunk_stats_one_pass) instead of two reductions in a row, which frees
# the registers to hold 64 elements per thread (4 warps on an 8192-column chunk) as RMSNorm
# does: ptxas, bf16, every flag, sm_90, 118 registers per thread at 8192 x 4 warps (two
# passes: 168 at 4 warps, 119 at 8; RMSNorm 128 at 4). Off until it is measured (issue 25:
# LayerNorm 0.46-0.49 of copy on the H200 at 65536-262144 bf16 columns where RMSNorm runs
# 0.63-0.67); launch_config(..., one_pass=True) gives the candidate config.
SPLIT_FWD_ONE_PASS = False
# The split backward, by norm (RMSNorm?): chunk per program and elements per thread for
# 16-bit rows (float32 rows hold half as many per thread), and the programs per SM its grid
# is sized to (each takes a run of rows of one chunk). H200, bf16, 16384-262144 columns
# (docs/perf.md): RMSNorm 0.57-0.66 of copy at 8192 x 8 warps, LayerNorm (a second row sum
# and the dbias accumulator: more registers) 0.35-0.45 at 4096 x 8; loading the next row
# before the wait ran slower (fewer programs per SM) or spilled.
SPLIT_BWD = {True: (8192, 32), False: (4096, 16)}
SPLIT_BWD_PROGRAMS_PER_SM = 2
# Elements each thread holds, by (direction, norm), and how many rows a tile stacks.
# Measured on H200, bf16, 64M-element grids (docs/perf.md): the RMSNorm forward ran best at
# 16 per thread (4096 cols: 0.879 of copy at 8 warps vs 0.871 at 4), LayerNorm's at 32
# (its two extra row sums favour fewer warps: 8192 cols 0.836 at 8 warps, 0.749 at 16);
# the backward, loading the next block ahead, on 1-2 programs per SM past 2048 columns:
# RMSNorm at 8 per thread (4096 cols: 0.757-0.813 at 16 warps x 2 programs vs 0.709 at
# 4 x 8), LayerNorm at 16 on 8192-element tiles (4096 cols: 0.672 with 2 rows x 16 warps
# vs 0.564 with 1 row; 8192 cols: 0.662 at 16 warps vs 0.570 at 32). The "bwd" entries are
# ROCm's now: CUDA's backward tiles come from _cuda_bwd_tile (layernorm 0.11.5).
ELEMENTS_PER_THREAD = {("fwd", True): 16, ("fwd", False): 32, ("bwd", True): 8, ("bwd", False): 16}
TILE_ELEMENTS = {("fwd", True): 2048, ("fwd", False): 2048, ("bwd", True): 2048, ("bwd", False): 8192}
MAX_WARPS = {"cuda": 32, "rocm": 16}


@dataclass(frozen=True)
class NormConfig:
    """mode: "tile", "split" or "looped". programs_per_sm: 0 = one program per row block,
    else a persistent grid of SMs x this. prefetch: the tile kernels load the next row block
    before reducing the current one. one_pass: the split forward's LayerNorm chunk statistics
    in one reduction (its ONE_PASS; the other kernels and RMSNorm ignore it)."""

    block_rows: int
    block_cols: int
    num_warps: int
    mode: str = "tile"
    programs_per_sm: int = 0
    prefetch: bool = False
    num_stages: int = 1
    one_pass: bool = False

    @property
    def looped(self) -> bool:
        return self.mode == "looped"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(elements: int, per_thread: int, vendor: str) -> int:
    lane = 64 if vendor == "rocm" else 32
    return min(MAX_WARPS[vendor], max(1, next_pow2(elements // per_thread // lane)))


@functools.cache
def launch_config(
    n_cols: int,
    dtype: torch.dtype,
    backend: str,
    direction: str,
    aligned: bool = True,
    rms: bool = True,
    one_pass: bool = SPLIT_FWD_ONE_PASS,
) -> NormConfig:
    """Kernel, tile and warps for rows of n_cols elements.

    direction: "fwd" or "bwd"; backend: "cuda", "rocm" (64-wide wavefronts: half the warps
    hold the same tile) or "cpu" (the Triton interpreter: never the split kernel, whose
    programs wait for each other and the interpreter runs them one after another).
    aligned: n_cols and the row strides are multiples of 16, so loads are vectorized;
    unaligned rows load element by element, each element with its own address registers,
    and leave the tile at half the width (the 16384 forward tile spilled 8 B per thread on
    sm_80 unaligned). rms: RMSNorm (one row reduction) or LayerNorm (three). dtype: the
    rows' (the wider of dy's and h's in the backward): it sizes the split backward's chunk
    per thread. one_pass: the LayerNorm split forward with one-pass chunk statistics, at 64
    elements per thread like RMSNorm's (default SPLIT_FWD_ONE_PASS; no other config changes).
    """
    vendor = "rocm" if backend == "rocm" else "cuda"
    limit = MAX_TILE_COLS[direction] if aligned else MAX_TILE_COLS[direction] // 2
    per_thread = ELEMENTS_PER_THREAD[direction, rms]
    if n_cols <= limit:
        block_cols = next_pow2(n_cols)
        block_rows = max(1, TILE_ELEMENTS[direction, rms] // block_cols)
        if direction == "fwd":
            return NormConfig(block_rows, block_cols, _warps(block_rows * block_cols, per_thread, vendor))
        if vendor == "cuda":
            return _cuda_bwd_tile(block_cols, dtype, aligned)
        # ROCm (not re-measured since): narrow rows keep 2048-element tiles at 16 per thread
        # on 8 programs per CU (H200: 2048 cols RMSNorm 0.768-0.783, LayerNorm 0.691-0.706).
        if block_cols <= 2048:
            block_rows, per_thread = max(1, 2048 // block_cols), 16
        warps = _warps(block_rows * block_cols, per_thread, vendor)
        lane_warps = 16  # half a CU's wavefront slots
        if block_cols >= 8192:
            # The prefetched 8192-column tile spilled 8-92 B per thread on sm_80/sm_90
            # (float32 h, 32 warps): 16 warps on 4 programs per SM without prefetching.
            warps = _warps(block_cols, 16, vendor)
            return NormConfig(1, block_cols, warps, "tile", max(1, 2 * lane_warps // warps))
        return NormConfig(block_rows, block_cols, warps, "tile", max(1, lane_warps // warps), prefetch=True)
    if direction == "fwd" and backend in ("cuda", "rocm"):
        # 8192-column chunks, 16384 past 64 of them (1M columns). H200, bf16, 65536-1048576
        # columns (docs/perf.md): RMSNorm best at 64 per thread (0.74-0.76 of copy at 8192 x
        # 4 warps against 0.66 for the 16384 x 16 it replaced), LayerNorm's two reductions in
        # a row at 8 warps; LayerNorm in one pass (one_pass) takes RMSNorm's 64 (unmeasured).
        base = SPLIT_COLS if aligned else SPLIT_COLS // 2
        chunk = base if -(-n_cols // base) <= MAX_SPLITS else 2 * base
        if -(-n_cols // chunk) <= MAX_SPLITS:
            ln_one_pass = one_pass and not rms
            # Unaligned rows hold an address per element: 32 per thread, as before. So do
            # float32 rows on the doubled chunk (RMSNorm with a residual spilled 4 B on sm_90
            # at 64 per thread; layernorm 0.11.5, not timed).
            thin = (
                not aligned
                or (not rms and not one_pass and chunk == base)
                or (dtype.itemsize > 2 and chunk > base)
            )
            per_thread = 32 if thin else 64
            return NormConfig(1, chunk, _warps(chunk, per_thread, vendor), "split", one_pass=ln_one_pass)
    if direction == "bwd" and backend in ("cuda", "rocm"):
        base, per_thread = SPLIT_BWD[rms]
        base = base if aligned else base // 2
        per_thread = per_thread // 2 if dtype.itemsize > 2 or not aligned else per_thread
        # No doubled chunk past MAX_SPLITS (its 16384-column LayerNorm spilled on sm_80/sm_90):
        # the looped kernel takes those rows.
        if -(-n_cols // base) <= MAX_SPLITS:
            return NormConfig(1, base, _warps(base, per_thread, vendor), "split", SPLIT_BWD_PROGRAMS_PER_SM)
    return looped_config(direction, aligned, backend)


def _cuda_bwd_tile(block_cols: int, dtype: torch.dtype, aligned: bool) -> NormConfig:
    """The CUDA backward tile on a persistent grid of as many programs per SM as fit at once,
    so that every program runs in the first wave (test_aot checks it for sm_80 and sm_90:
    registers, threads, shared memory). Aligned 16-bit rows: rows of 2048 columns and more on
    tiles of at least 4096 elements at 16 per thread (ptxas, sm_90, Triton 3.6: 110-128
    registers, two 8-warp or one 16-warp program per SM), narrower rows stacked into
    2048-element tiles at 8 per thread, both prefetching the next block. Float16 rows: ptxas
    held the prefetching tiles to 64 registers and spilled 8-40 B, and the 2048-element ones
    4 B at 512 columns: 4096-element tiles at 16 per thread loading in turn. Float32 rows (dtype, the wider
    of dy and h) on 2048-element tiles at 8 per thread (at 16: up to 168 registers), the
    8192-column one at 16 per thread without prefetching (it spilled 52-88 B with it).
    Unaligned rows (an address per element: up to 145 registers at 8 per thread, spills at 8
    and with prefetching) on 1024-element tiles at 4 per thread, one program per SM.

    The layernorm 0.11.4 grids asked for 8 programs of 4 warps at 2048 columns where 4-5 fit,
    and 4 of 16 warps at 8192 where 1 fits: the rest ran as later waves. H100, bf16, 64M
    elements, the backward's kernels (benchmarks/studies/norm_bwd_occupancy.py): 2048 columns
    RMSNorm 0.2419 -> 0.1581 ms, LayerNorm 0.3208 -> 0.1694, with dh_out 0.2775 -> 0.2020; 8192
    columns 0.2188 -> 0.1564, 0.2847 -> 0.1656, 0.2685 -> 0.2002; 4096 columns RMSNorm 0.1600
    either way, with dh_out 0.2347 -> 0.2026 (other widths, float16, float32 and unaligned
    rows: not timed)."""
    wide = dtype.itemsize > 2
    if not aligned:
        block_rows = max(1, 1024 // block_cols)
        return NormConfig(block_rows, block_cols, _warps(block_rows * block_cols, 4, "cuda"), "tile", 1)
    if wide and block_cols >= 8192:
        return NormConfig(1, block_cols, _warps(block_cols, 16, "cuda"), "tile", 1)
    half = dtype == torch.float16
    big = (block_cols >= 2048 or half) and not wide
    block_rows = max(1, (4096 if big else 2048) // block_cols)
    warps = _warps(block_rows * block_cols, 16 if big else 8, "cuda")
    return NormConfig(block_rows, block_cols, warps, "tile", max(1, 16 // warps), prefetch=not half)


def looped_config(direction: str, aligned: bool, backend: str) -> NormConfig:
    """The looped kernels' config: 4096-column chunks at 16 per thread (8192-column chunks
    measured faster, 0.41 vs 0.35 of copy for the RMSNorm backward at 16384, but spilled on
    sm_80). Also what the backward's plan takes when a row would need more split programs
    than the GPU has SMs."""
    vendor = "rocm" if backend == "rocm" else "cuda"
    chunk = LOOPED_COLS if aligned else LOOPED_COLS // 2
    warps = _warps(chunk, 16, vendor)
    return NormConfig(1, chunk, warps, "looped", max(1, 32 // warps) if direction == "bwd" else 0)


def all_configs(backend: str, direction: str, dtype: torch.dtype = torch.float32) -> list[NormConfig]:
    """Every config `launch_config` can return for aligned rows of dtype, with one_pass off
    and on (for compile-only checks; 16-bit and float32 rows differ in the split backward)."""
    seen = set()
    for rms, one_pass in ((True, False), (False, False), (False, True)):
        for k in range(0, 21):
            seen.add(launch_config(1 << k, dtype, backend, direction, True, rms, one_pass))
        # The split forward's chunk doubled, then the looped kernels.
        for splits in (MAX_SPLITS, 2 * MAX_SPLITS, 4 * MAX_SPLITS):
            seen.add(launch_config(splits * SPLIT_COLS + 1, dtype, backend, direction, True, rms, one_pass))
    return sorted(seen, key=lambda c: (c.mode, c.block_cols, c.block_rows, c.num_warps, c.one_pass))
