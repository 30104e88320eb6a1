"""Launch configs of the quant kernels: one pure function of (M, N, K, group size, arch
family), shared by the launchers, the tuning sweep (benchmarks) and the compile-only checks.

Three paths, picked by M:
  "gemv"     M == 1: _int4_linear_gemv_fwd_kernel, CUDA cores, memory-bound.
  "tiled"    2 <= M < DEQUANT_MIN_M: _int4_linear_fwd_kernel, tensor cores on the unpacked
             codes; the weight streams once per band of BLOCK_M rows.
  "dequant"  M >= DEQUANT_MIN_M: W is dequantized once into a scratch (N, K) 16-bit buffer and
             the vendor GEMM runs; at large M the GEMM's time dwarfs the extra pass over W.
split_k > 1 spreads K over more programs when N / BLOCK_N alone would leave SMs idle.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinearConfig", "linear_config", "all_configs", "DEQUANT_MIN_M", "arch_family", "split_k_for",
           "dequant_block", "kernel_group"]  # fmt: skip


@dataclass(frozen=True)
class LinearConfig:
    """path: "gemv", "tiled" or "dequant". block_m is 1 on the gemv path. split_k: programs
    along K (their float32 partials are added by the reduce kernel). group_n: weight tiles a
    program band covers before moving to the next band of M (tiled path)."""

    path: str
    block_m: int = 1
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    group_n: int = 8


# M from which W is dequantized and the vendor GEMM runs (see the module docstring).
DEQUANT_MIN_M = {"hopper": 1024, "ampere": 512, "cdna": 512, "other": 512}
# Programs the split-K rule aims for, per SM: enough memory requests in flight to stream W at
# full bandwidth when M is small.
PROGRAMS_PER_SM = 4


def arch_family(backend: str, arch: str) -> str:
    if backend == "rocm":
        return "cdna"
    if arch.startswith("sm_"):
        major = int(arch[3:-1] or 0) if arch[3:].isdigit() else 0
        return "hopper" if major >= 9 else "ampere"
    return "other"


def _block_k(group: int, k: int, wanted: int) -> int:
    """Largest power of two <= wanted that lies inside one group (divides `group`, or any when
    the group is the whole row)."""
    bk = wanted
    while bk > 16 and group != k and group % bk:
        bk //= 2
    return bk


def split_k_for(tiles: int, k: int, block_k: int, sms: int, max_split: int = 16) -> int:
    """Splits of K so that tiles * splits reaches PROGRAMS_PER_SM * sms, each split a whole
    number of BLOCK_K steps."""
    steps = -(-k // block_k)
    want = -(-PROGRAMS_PER_SM * sms // max(tiles, 1))
    return max(1, min(want, max_split, steps))


def kernel_group(group: int, k: int) -> int:
    """The GROUP constexpr the kernels get: the group size, or for one group per row a power
    of two >= K (every column then maps to group 0 and the kernels' group sub-blocks stay
    powers of two)."""
    return group if group < k else 1 << (k - 1).bit_length()


def dequant_block(group: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the dequantize kernel: 64 columns inside one group or spanning
    whole groups."""
    return 32, 64


def linear_config(m: int, n: int, k: int, group: int, family: str, sms: int) -> LinearConfig:
    """The config for an (M, K) x (K, N) product with groups of `group` columns."""
    if m >= DEQUANT_MIN_M.get(family, 512):
        return LinearConfig("dequant")
    if m == 1:
        block_n, block_k, warps = 16, 512, 4
        block_k = min(block_k, max(32, 1 << (k - 1).bit_length()))
        tiles = -(-n // block_n)
        return LinearConfig("gemv", 1, block_n, block_k, warps, 1, split_k_for(tiles, k, block_k, sms))
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if block_m <= 64 else 128
    block_k = _block_k(group, k, 128 if block_m <= 64 else 64)
    warps = 4 if block_m <= 64 else 8
    stages = 3 if family in ("hopper", "ampere") else 2
    tiles = -(-n // block_n) * -(-m // block_m)
    split = split_k_for(tiles, k, block_k, sms) if block_m <= 64 else 1
    return LinearConfig("tiled", block_m, block_n, block_k, warps, stages, split)


def all_configs(family: str) -> list[LinearConfig]:
    """Every config linear_config can return for the family (for compile-only checks)."""
    seen: dict[LinearConfig, None] = {}
    for m in (1, 2, 16, 17, 32, 64, 65, 128, 256):
        for group in (32, 64, 128, 4096):
            cfg = linear_config(m, 4096, 4096, group, family, 132)
            seen[LinearConfig(**{**cfg.__dict__, "split_k": 1})] = None
    return list(seen)
