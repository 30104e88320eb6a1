"""Launch plans of the quant kernels: the grid, constexprs and integer arguments of one launch,
from a LinearConfig (configs.py) and the problem's sizes.

Pure Python (no torch, no JAX, no Triton): the PyTorch launcher (triton/__init__.py), the
JAX launcher (openkernels.quant.jax) and the compile-only checks (tests/test_aot.py) all
build their launches here, so the three cannot drift apart.

Pointers a launch does not read (the kernels guard every use behind a constexpr flag):
* zeros of a symmetric weight, the NF4 table of an int4 weight, an absent bias: inputs in
  the middle of the pointer list, `stand_ins()`; both launchers pass the scales there.
  (jax-triton binds array arguments by position, so no constant may sit between two of
  them; the same stand-in keeps both sides' specializations alike.)
* the split-K scratch of a launch without a split, the last pointers: `pointers()` lists
  them as absent; the PyTorch launcher passes the output there, the JAX launcher None.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .configs import LinearConfig, dequant_block, kernel_group

__all__ = [
    "GEMV_KERNEL",
    "TILED_KERNEL",
    "DEQUANT_KERNEL",
    "LinearPlan",
    "DequantPlan",
    "linear_plan",
    "dequant_plan",
    "k_per_split",
    "nf4_shuffle",
]

GEMV_KERNEL = "_int4_linear_gemv_fwd_kernel"
# The bits of 128.0: the GEMV kernel's `magic` argument (an argument, not a constant, so that
# the compiler keeps it in a register; kernels.py says why).
GEMV_MAGIC = 0x43000000
TILED_KERNEL = "_int4_linear_fwd_kernel"
DEQUANT_KERNEL = "_dequantize_int4_fwd_kernel"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nf4_shuffle(vendor: str, interpreting: bool) -> bool:
    """Whether the kernels read NF4 levels by a warp shuffle (the NF4_SHUFFLE constexpr): on
    NVIDIA GPUs ("cuda"), compiled. Inline PTX runs neither on ROCm nor under the Triton
    interpreter; both keep the gather from the table in global memory. Both launchers ask
    here: PyTorch with the device's backend, JAX with its GPU vendor."""
    return vendor == "cuda" and not interpreting


def k_per_split(k: int, cfg: LinearConfig) -> tuple[int, int]:
    """(K columns per split, a whole number of BLOCK_K steps; splits actually used)."""
    steps = _cdiv(k, cfg.block_k)
    per = _cdiv(steps, cfg.split_k) * cfg.block_k
    return per, _cdiv(k, per)


def _stand_ins(flags: dict[str, Any]) -> tuple[str, ...]:
    """The optional weight inputs (z_ptr, lut_ptr, bias_ptr) this launch does not read."""
    unread = {"z_ptr": not flags["HAS_ZEROS"], "lut_ptr": not flags["NF4"]}
    if "HAS_BIAS" in flags:  # the linear kernels; the dequantize kernel has no bias
        unread["bias_ptr"] = not flags["HAS_BIAS"]
    return tuple(p for p, off in unread.items() if off)


@dataclass(frozen=True, eq=False)
class LinearPlan:
    """One int4_linear launch. gemv: the kernel takes one row of x (PyTorch and JAX launch it
    once per row); grid and scratch sizes are per launch. flags: every constexpr, in the
    kernel's parameter order. partials / tiles: float32 elements and int32 counters of the
    split-K scratch (used when splits > 1)."""

    kernel: str
    m: int
    n: int
    k: int
    grid: tuple[int, int]
    per_split: int
    splits: int
    tiles: int
    partials: int
    flags: dict[str, Any]
    num_warps: int
    num_stages: int

    @property
    def gemv(self) -> bool:
        return self.kernel == GEMV_KERNEL

    def int_args(self, stride_xm: int, stride_qn: int, stride_sg: int, stride_om: int) -> dict[str, int]:
        """The kernel's integer arguments by name, in parameter order (row strides in elements;
        the gemv kernel takes one row and no row strides of x and out)."""
        if self.gemv:
            return {"N": self.n, "K": self.k, "k_per_split": self.per_split, "stride_qn": stride_qn,
                    "stride_sg": stride_sg, "magic": GEMV_MAGIC}  # fmt: skip
        return {"M": self.m, "N": self.n, "K": self.k, "k_per_split": self.per_split, "stride_xm": stride_xm,
                "stride_qn": stride_qn, "stride_sg": stride_sg, "stride_om": stride_om}  # fmt: skip

    def pointers(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(inputs, outputs, absent) pointer names, inputs and outputs in parameter order;
        absent: the split-K scratch when K is not split (the last pointer parameters)."""
        inputs = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "lut_ptr", "bias_ptr")
        scratch = ("ws_ptr", "counter_ptr")
        if self.splits > 1:
            return inputs, ("out_ptr", *scratch), ()
        return inputs, ("out_ptr",), scratch

    def stand_ins(self) -> tuple[str, ...]:
        """Inputs the kernel does not read here; the launchers pass the scales there."""
        return _stand_ins(self.flags)


def linear_plan(
    cfg: LinearConfig,
    m: int,
    n: int,
    k: int,
    group_size: int,
    kind: str,
    *,
    has_zeros: bool,
    has_bias: bool,
    bitcast: bool,
    shuffle: bool,
) -> LinearPlan:
    """The launch of config `cfg` ("gemv" or "tiled" path) for x (M, K) @ W^T, W (N, K).
    bitcast: the tiled kernel's mantissa trick for 16-bit codes (False only where the Triton
    interpreter runs bfloat16, which it cannot bitcast). shuffle: NF4 levels by a warp
    shuffle (nf4_shuffle() says where; an NF4 weight only, and not where cfg.nf4_gather)."""
    if cfg.path not in ("gemv", "tiled"):
        raise ValueError(f"linear_plan: the {cfg.path!r} path launches no int4_linear kernel")
    gemv = cfg.path == "gemv"
    if gemv:
        if k % 8:
            raise ValueError(
                f"linear_plan: the gemv path reads 32-bit words of codes and needs K % 8 == 0, got K={k}"
            )
        # A GEMV step lies inside one group.
        cfg = replace(cfg, block_k=min(cfg.block_k, kernel_group(group_size, k)))
    per_split, splits = k_per_split(k, cfg)
    tiles_n = _cdiv(n, cfg.block_n)
    tiles = tiles_n if gemv else tiles_n * _cdiv(m, cfg.block_m)
    nf4, group, even_k = kind == "nf4", kernel_group(group_size, k), k % cfg.block_k == 0
    # int4 launches keep NF4_SHUFFLE off: one compiled variant per int4 launch, whatever the platform.
    levels_by_shuffle = nf4 and shuffle and not cfg.nf4_gather
    if gemv:
        flags = dict(GROUP=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_ZEROS=has_zeros, NF4=nf4,
                     HAS_BIAS=has_bias, SPLIT_K=splits, EVEN_K=even_k, NF4_SHUFFLE=levels_by_shuffle)  # fmt: skip
    else:
        flags = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
                     HAS_ZEROS=has_zeros, NF4=nf4, HAS_BIAS=has_bias, SPLIT_K=splits, EVEN_K=even_k, BITCAST=bitcast,
                     SWAP_AB=cfg.swap_ab, UNROLL=cfg.unroll, NF4_SHUFFLE=levels_by_shuffle)  # fmt: skip
    return LinearPlan(
        kernel=GEMV_KERNEL if gemv else TILED_KERNEL,
        m=m,
        n=n,
        k=k,
        grid=(tiles_n if gemv else tiles, splits),
        per_split=per_split,
        splits=splits,
        tiles=tiles,
        partials=splits * (1 if gemv else m) * n,
        flags=flags,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@dataclass(frozen=True, eq=False)
class DequantPlan:
    """One dequantize_int4 launch writing W (N, K)."""

    n: int
    k: int
    grid: tuple[int, int]
    flags: dict[str, Any]
    num_warps: int
    num_stages: int = 1
    kernel: str = DEQUANT_KERNEL

    def int_args(self, stride_qn: int, stride_sg: int, stride_on: int) -> dict[str, int]:
        """The kernel's integer arguments by name, in parameter order."""
        return {
            "N": self.n,
            "K": self.k,
            "stride_qn": stride_qn,
            "stride_sg": stride_sg,
            "stride_on": stride_on,
        }

    def pointers(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(inputs, outputs, absent) pointer names, inputs and outputs in parameter order."""
        return ("qw_ptr", "s_ptr", "z_ptr", "lut_ptr"), ("out_ptr",), ()

    def stand_ins(self) -> tuple[str, ...]:
        """Inputs the kernel does not read here; the launchers pass the scales there."""
        return _stand_ins(self.flags)


def dequant_plan(
    n: int, k: int, group_size: int, kind: str, *, has_zeros: bool, shuffle: bool
) -> DequantPlan:
    """The launch writing the (N, K) weight of a `kind` weight with groups of `group_size`;
    shuffle: NF4 levels by a warp shuffle (as linear_plan)."""
    block_n, block_k, warps = dequant_block(group_size, k)
    nf4 = kind == "nf4"
    flags = dict(GROUP=kernel_group(group_size, k), BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=has_zeros,
                 NF4=nf4, NF4_SHUFFLE=nf4 and shuffle)  # fmt: skip
    return DequantPlan(n, k, (_cdiv(n, block_n), _cdiv(k, block_k)), flags, warps)
