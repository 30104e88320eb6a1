"""Launch configs of the quant kernels: one pure function of (M, N, K, group size, arch
family), shared by the launchers, the tuning sweep (benchmarks) and the compile-only checks.

Three paths, picked by M:
  "gemv"     M == 1 on CUDA: _int4_linear_gemv_fwd_kernel, CUDA cores on the codes read as
             32-bit words (K % 8 == 0 and 4-byte aligned rows of codes and x).
  "tiled"    2 <= M < DEQUANT_MIN_M: _int4_linear_fwd_kernel, tensor cores on the unpacked
             codes; the weight streams once per band of BLOCK_M rows.
  "dequant"  M >= DEQUANT_MIN_M: W is dequantized once into a scratch (N, K) 16-bit buffer and
             the vendor GEMM runs; at large M the GEMM's time dwarfs the extra pass over W.
split_k > 1 spreads K over more programs when N / BLOCK_N alone would leave SMs idle.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LinearConfig", "linear_config", "all_configs", "DEQUANT_MIN_M", "arch_family",
           "dequant_block", "kernel_group", "gemv_split"]  # fmt: skip


@dataclass(frozen=True)
class LinearConfig:
    """path: "gemv", "tiled" or "dequant". block_m is 1 on the gemv path. split_k: programs
    along K (their float32 partials are added by the reduce kernel). group_n: weight tiles a
    program band covers before moving to the next band of M (tiled path). nf4_gather: NF4
    levels by the table gather even where the warp shuffle runs (plan.nf4_shuffle; for A/B
    studies, benchmarks/studies/quant_nf4_shuffle.py; the table never sets it)."""

    path: str
    block_m: int = 1
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    group_n: int = 8
    swap_ab: bool = True
    unroll: int = 1
    nf4_gather: bool = False


# M from which W is dequantized and the vendor GEMM runs (see the module docstring). H200,
# bf16: at M=256 the tiled kernel led (8192x8192 0.108 vs 0.137 ms, 28672x8192 0.400 vs
# 0.477), at M=512 dequantize + cuBLAS did (0.174 vs 0.198, 0.620 vs 0.688).
DEQUANT_MIN_M = {"hopper": 512, "ampere": 512, "cdna": 512, "other": 512}


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


def kernel_group(group: int, k: int) -> int:
    """The GROUP constexpr the kernels get: the group size, or for one group per row a power
    of two >= K (every column then maps to group 0 and the kernels' group sub-blocks stay
    powers of two)."""
    return group if group < k else 1 << (k - 1).bit_length()


def dequant_block(group: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the dequantize kernel (any group: each column finds its
    own). 64 x 256 tiles at 8 warps: 16 codes per thread, 32 bytes of output stored per thread."""
    return 64, 256, 8


def gemv_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """K splits of the GEMV: about 4 programs per SM (a power of two, at most 16 and at most one
    per BLOCK_K step)."""
    split = 1
    while split < 16 and split * 2 * -(-n // block_n) <= 4 * sms and split * 2 * block_k <= k:
        split *= 2
    return split


def linear_config(
    m: int, n: int, k: int, group: int, family: str, sms: int, kind: str = "int4", words: bool = True
) -> LinearConfig:
    """The config for an (M, K) x (K, N) product with groups of `group` columns. words: the
    codes and x can be read as 32-bit words (K % 8 == 0, their rows 4-byte aligned), which the
    gemv path needs."""
    if m >= DEQUANT_MIN_M.get(family, 512):
        return LinearConfig("dequant")
    if m == 1 and words and k % 8 == 0 and family in ("hopper", "ampere"):
        # H200, bf16, group 128 (.gpu sweep in docs/perf.md): 128-row tiles at 8 warps, ~4
        # programs per SM, were best or within 3% at 2048-28672 x 2048-8192 (8192x8192 20.2 us
        # against 26.5 for the tiled kernel; 28672x8192 59.9 against 76.6). NF4 gathers its
        # levels from an L1-cached table and runs best split 16 ways (group 64: 8192x8192 56.0
        # us against 136.3 for the tiled kernel, 28672x8192 177.6 against 455.8). Measured on
        # Hopper only; Ampere shares the CUDA-core code path. CDNA keeps the tiled kernel.
        # NF4's split 16 was measured with the gather; CUDA now reads the levels by warp
        # shuffle (NF4_SHUFFLE), not yet timed: benchmarks/studies/quant_nf4_shuffle.py times
        # it at split 16 and at int4's split.
        block_k = min(128, kernel_group(group, k))
        split = min(16, k // block_k) if kind == "nf4" else gemv_split(n, k, 128, block_k, sms)
        return LinearConfig("gemv", 1, 128, block_k, 8, 1, max(1, split))
    if m <= 64:
        # Hopper, bf16, group 128 (benchmarks/tune_quant.py, docs/perf.md): M=16 (and M=1
        # before the word-reading GEMV) ran best as 16 x 64 x 128 tiles, 4 warps, 3 stages, K
        # split 4 ways (28672x8192 M=16: 77 us vs 110 at split 2).
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_k = _block_k(group, k, 128)
        split = max(1, min(4, -(-k // block_k)))
        return LinearConfig("tiled", block_m, 64, block_k, 4, 3 if family != "cdna" else 2, split)
    # M = 128: 128 x 64 x 128 tiles at 4 warps (28672x8192: 207 us vs 220 for 128 x 128), and
    # 64-row bands where 128-row ones leave SMs idle (8192x8192: 128 tiles on 132 SMs; 64 x 64
    # x 128: 77 us vs 103).
    block_k = _block_k(group, k, 128)
    block_m = 64 if m <= 128 and -(-n // 64) * -(-m // 128) < 2 * sms else 128
    if family == "ampere":
        block_m = 64  # mma.sync keeps both operands in registers: 128 x 64 x 128 spilled 208 B on sm_80
    # Two 128-column sub-steps per loop step for the 64-row bands on Hopper (8192x8192, M=128:
    # 70 vs 78 us); no gain at 16 rows, and 128-row tiles spill with it.
    unroll = 2 if family == "hopper" and block_m == 64 and block_k == 128 else 1
    stages = 3 if family != "cdna" else 2
    return LinearConfig("tiled", block_m, 64, block_k * unroll, 4, stages, 1, unroll=unroll)


def all_configs(family: str) -> list[LinearConfig]:
    """Every config linear_config can return for the family (for compile-only checks)."""
    seen: dict[LinearConfig, None] = {}
    for m in (1, 2, 16, 17, 32, 64, 65, 128, 256):
        for group in (32, 64, 128, 4096):
            for kind in ("int4", "nf4") if m == 1 else ("int4",):
                cfg = linear_config(m, 4096, 4096, group, family, 132, kind)
                seen[LinearConfig(**{**cfg.__dict__, "split_k": 1})] = None
    return list(seen)
