"""Launch configs of the attention kernels: one pure function of (head_dim, dtype, arch,
direction, path), shared by the launchers, the tuning sweep and the compile-only checks.

Directions: "fwd" (forward), "dkdv" (backward, one program per key block), "dq"
(backward, one program per query block). The preprocess (delta = rowsum(o * do)) is a
memory-bound pass with a fixed config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AttnConfig",
    "arch_family",
    "launch_config",
    "all_configs",
    "options_configs",
    "DIRECTIONS",
    "block_d",
    "preprocess_block_m",
    "group_sum_block_rows",
]

DIRECTIONS = ("fwd", "dkdv", "dq")


@dataclass(frozen=True)
class AttnConfig:
    """block_m: query rows per tile, block_n: keys per tile; num_stages: software
    pipelining depth of the block loop; tma: load K/V tiles with the Hopper copy engine
    (tensor descriptors; used on sm_90+ only, where the strides allow)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


def block_d(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16, a matrix-unit tile's depth (96 -> 128,
    40 -> 64, 8 -> 16; the pad is masked)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def preprocess_block_m(head_dim: int) -> int:
    """Rows per program of the backward's delta = rowsum(o * do) pass: o and do in float32
    take 2 * rows * BLOCK_D / 128 registers per thread at 4 warps; 64 x 256 spilled 48 B."""
    return min(64, 8192 // block_d(head_dim))


def group_sum_block_rows(block_d: int) -> int:
    """(token, head) rows per program of GQA's dK/dV group sum: 4096 float32 sums a program
    (32 registers a thread at 4 warps)."""
    return max(1, 4096 // block_d)


# (arch family, direction) -> {largest head_dim: (fast, general)}. "fast" serves dense
# calls whose sequence lengths and strides are multiples of 16 (what the benchmarks and most
# models run), with any window, ALiBi, softcap or dropout (where the fast config spills with
# them, _OPTIONS_TABLE's); "general" serves varlen and the other lengths and strides. All
# compile without register spills for every variant they serve on every arch of the family
# (tests/test_aot.py); the general one gives up some speed for that: the backward's key-block
# kernel holds K, V and float32 dK, dV for its whole loop, and window masks, varlen offsets,
# ALiBi, the softcap's tanh and dropout's Philox each add live registers. (Until attention
# 0.7.1 every option ran the general configs: the Hopper backward at D128 on 32x32 key blocks.)
# Hopper, measured on H200 bf16 (benchmarks/tune_attention.py, docs/perf.md):
# - fwd: 64x64 tiles, 4 warps, 3 stages led at D64 and D128 (480 TFLOP/s at B8 H16 S2048
#   D128 vs 445 for 128x64/8 warps; 354 vs 345 at D64 causal); 128x128/8 warps won causal
#   S8192 by 4% but sits at 255 registers. TMA K/V loads (tensor descriptors) were 0-7%
#   slower except 128x128 at S16384 (+2%): off.
# - dkdv: 64 queries x 128 keys, 8 warps, 3 stages at D128 (326 vs 286 TFLOP/s for 32x128;
#   64x64/4 warps was as fast but spilled); 32x64/4 warps at D64.
# - dq: 128 queries x 64 keys, 8 warps at D128 (309 vs 286 for 128x32); 64x32/4 warps at
#   D64 (ties the best at 96 registers).
# Ampere (sm_80, no device here): the Hopper tiles where they compile clean, smaller ones
# where mma.sync's register operands made them spill (general dQ at D128: 8 warps, as 4 spilled
# 4-8 B with every option and dropout on). CDNA (gfx90a/gfx942/gfx950, no device
# here): untuned, sized for 64 KiB of LDS and single-stage as the AMD backend prefers.
_C = AttnConfig
_TABLE: dict[tuple[str, str], dict[int, tuple[AttnConfig, AttnConfig]]] = {
    ("hopper", "fwd"): {64: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)), 128: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)),
                        256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("hopper", "dkdv"): {64: (_C(32, 64, 4, 3), _C(32, 32, 8, 2)), 128: (_C(64, 128, 8, 3), _C(32, 32, 8, 2)),
                         256: (_C(32, 32, 8, 2), _C(16, 32, 8, 1))},
    ("hopper", "dq"): {64: (_C(64, 32, 4, 3), _C(64, 32, 8, 3)), 128: (_C(128, 64, 8, 3), _C(64, 32, 4, 3)),
                       256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("ampere", "fwd"): {64: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)), 128: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)),
                        256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("ampere", "dkdv"): {64: (_C(32, 32, 4, 3), _C(32, 32, 8, 2)), 128: (_C(32, 64, 8, 3), _C(32, 32, 8, 2)),
                         256: (_C(32, 32, 8, 2), _C(16, 32, 8, 1))},
    ("ampere", "dq"): {64: (_C(64, 32, 8, 3), _C(64, 32, 8, 3)), 128: (_C(64, 32, 4, 3), _C(64, 32, 8, 3)),
                       256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("cdna", "fwd"): {64: (_C(64, 64, 4, 1), _C(64, 64, 4, 1)), 128: (_C(64, 64, 4, 1), _C(64, 32, 4, 1)),
                      256: (_C(32, 32, 4, 1), _C(32, 32, 4, 1))},
    ("cdna", "dkdv"): {64: (_C(32, 64, 4, 1), _C(16, 32, 4, 1)), 128: (_C(32, 64, 4, 1), _C(16, 32, 4, 1)),
                       256: (_C(16, 32, 4, 1), _C(16, 16, 4, 1))},
    ("cdna", "dq"): {64: (_C(64, 32, 4, 1), _C(32, 32, 4, 1)), 128: (_C(64, 32, 4, 1), _C(32, 32, 4, 1)),
                     256: (_C(32, 16, 4, 1), _C(16, 16, 4, 1))},
}  # fmt: skip
# Options (a window other than causal, ALiBi, softcap, dropout) on the fast path: its config,
# unless that spills with every option on; then this one. Hopper at D128: dK/dV 64x128/8 warps
# spilled 180 B (32x128 holds 255 registers), dQ 128x64/8 warps 24 B (128x32: 234).
_OPTIONS_TABLE: dict[tuple[str, str], dict[int, AttnConfig]] = {
    ("hopper", "dkdv"): {128: _C(32, 128, 8, 3)},
    ("hopper", "dq"): {128: _C(128, 32, 8, 3)},
}
# The interpreter runs programs one after another on numpy: small tiles keep it quick.
_INTERPRETER = AttnConfig(16, 16, 4, 1)


def arch_family(arch: str) -> str:
    """ "hopper" (sm_90 and newer), "ampere" (older sm_), "cdna" (gfx), else "interpreter"."""
    if arch.startswith("sm_"):
        return "hopper" if int(arch[3:].rstrip("a")) >= 90 else "ampere"
    if arch.startswith("gfx"):
        return "cdna"
    return "interpreter"


def launch_config(
    head_dim: int, dtype: torch.dtype, arch: str, direction: str, general: bool = False, options: bool = False
) -> AttnConfig:
    """The config the launchers use for `direction` ("fwd", "dkdv", "dq") on `arch`
    ("sm_90", "gfx942", ...; a CPU arch means the Triton interpreter); general: the call is
    off the fast path (see _TABLE); options: a window, softcap or dropout (_OPTIONS_TABLE;
    Problem.option_configs: ALiBi alone keeps the plain configs)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    family = arch_family(arch)
    if family == "interpreter":
        return _INTERPRETER
    by_dim = _TABLE[family, direction]
    bucket = min(d for d in by_dim if d >= head_dim)
    if options and not general and bucket in _OPTIONS_TABLE.get((family, direction), {}):
        return _OPTIONS_TABLE[family, direction][bucket]
    return by_dim[bucket][int(general)]


def options_configs(arch: str) -> list[tuple[int, str, AttnConfig]]:
    """(head_dim, direction, config) of the fast path's overrides for options on `arch`: what
    the compile-only checks build with every option on."""
    family = arch_family(arch)
    return [(d, direction, cfg) for (fam, direction), by_dim in _OPTIONS_TABLE.items() if fam == family
            for d, cfg in by_dim.items()]  # fmt: skip


def all_configs(arch: str) -> list[tuple[int, str, bool, AttnConfig]]:
    """(head_dim, direction, general, config) for every tuned head_dim, and 200 for the padded
    ones (any multiple of 8 runs the config of the next tuned one): what the compile-only
    checks build."""
    dims = (32, 64, 96, 128, 192, 200, 256)
    return [
        (d, direction, general, launch_config(d, torch.bfloat16, arch, direction, general))
        for d in dims
        for direction in DIRECTIONS
        for general in (False, True)
    ]
