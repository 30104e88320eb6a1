"""Launch configs of the attention kernels: one pure function of (head_dim, dtype, backend,
direction), shared by the launchers, the tuning sweep and the compile-only checks.

Directions: "fwd" (forward), "dkdv" (backward, one program per key block), "dq"
(backward, one program per query block). The preprocess (delta = rowsum(o * do)) is a
memory-bound pass with a fixed config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttnConfig", "launch_config", "all_configs", "DIRECTIONS", "block_d"]

DIRECTIONS = ("fwd", "dkdv", "dq")


@dataclass(frozen=True)
class AttnConfig:
    """block_m: query rows per tile, block_n: keys per tile; num_stages: software
    pipelining depth of the block loop."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def block_d(head_dim: int) -> int:
    """head_dim padded to a power of two (96 -> 128, 192 -> 256; the pad is masked)."""
    return 1 << (head_dim - 1).bit_length()


# (backend, direction) -> {largest head_dim: config}. Starting points from FlashAttention-2
# style Triton kernels; tuned values and the measurements behind them replace these as
# they are taken (docs/perf.md). Shared memory bounds them: sm_80 164 KiB, sm_90 228 KiB,
# gfx90a/gfx942 64 KiB of LDS, gfx950 160 KiB.
_TABLE: dict[tuple[str, str], dict[int, AttnConfig]] = {
    ("cuda", "fwd"): {
        64: AttnConfig(128, 64, 4, 3),
        128: AttnConfig(128, 64, 8, 3),
        256: AttnConfig(64, 64, 4, 2),
    },
    ("cuda", "dkdv"): {
        64: AttnConfig(32, 128, 4, 3),
        128: AttnConfig(32, 128, 8, 3),
        256: AttnConfig(32, 64, 8, 2),
    },
    ("cuda", "dq"): {
        64: AttnConfig(128, 32, 4, 3),
        128: AttnConfig(128, 32, 8, 3),
        256: AttnConfig(64, 32, 8, 2),
    },
    ("rocm", "fwd"): {
        64: AttnConfig(128, 64, 4, 1),
        128: AttnConfig(128, 64, 4, 1),
        256: AttnConfig(64, 32, 4, 1),
    },
    ("rocm", "dkdv"): {
        64: AttnConfig(32, 64, 4, 1),
        128: AttnConfig(32, 64, 4, 1),
        256: AttnConfig(16, 32, 4, 1),
    },
    ("rocm", "dq"): {
        64: AttnConfig(64, 32, 4, 1),
        128: AttnConfig(64, 32, 4, 1),
        256: AttnConfig(32, 32, 4, 1),
    },
}
# The interpreter runs programs one after another on numpy: small tiles keep it quick.
_INTERPRETER = AttnConfig(16, 16, 4, 1)


def launch_config(head_dim: int, dtype: torch.dtype, backend: str, direction: str) -> AttnConfig:
    """The config the launchers use for `direction` ("fwd", "dkdv", "dq") on `backend`
    ("cuda", "rocm", or "cpu" for the Triton interpreter)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if backend == "cpu":
        return _INTERPRETER
    by_dim = _TABLE[backend, direction]
    return by_dim[min(d for d in by_dim if d >= head_dim)]


def all_configs(backend: str) -> list[tuple[int, str, AttnConfig]]:
    """(head_dim, direction, config) for every head_dim the API takes: what the
    compile-only checks build."""
    dims = (32, 64, 96, 128, 192, 256)
    return [(d, direction, launch_config(d, torch.bfloat16, backend, direction)) for d in dims for direction in DIRECTIONS]
