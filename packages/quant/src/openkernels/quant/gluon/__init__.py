"""Gluon launcher of int4_linear for Hopper (sm_90a): kernels.py's asynchronous-wgmma kernel,
the dequantization of step i + 1 overlapping the tensor cores' product of step i.

Registered as implementation "wgmma" of `int4_linear` above the Triton kernels' priority on
sm_90: its launcher sends to the Triton launcher the calls it measured slower on
(`slower_than_triton`: M < 96 at N < 8192, M < 64 at N < 12288, and shapes not measured;
from M = 256 it takes the large-M calls the Triton launcher ran as dequantize + cuBLAS)
unless forced by name
(`dispatch.force("int4_linear:wgmma")`). Host path: a launch plan per call shape, dtype and
stride, descriptors built per call: ~40 us of host time per call on the H200's host (23 us
of it in shared.launch with both descriptors built, 6-8 us building them); from a key's
third call the C++ replay runs it in ~10 us (its tensor maps encoded per call: shared.replay),
as it does the Triton path's. Gluon's own JIT launch took ~0.1 ms. Same entry point as
triton.int4_linear_fwd; a call this kernel does not take goes to the Triton launcher
(`unsupported_call` says why): fewer than MIN_M rows of x, x or
scales other than bfloat16 / float16, zeros in another dtype than the scales, K not a
multiple of 64, a group size (below K) not a multiple of 64, or rows of x / qweight, the
output or their base addresses not 16-byte aligned (TMA), an output or scales with a
non-unit column stride. The act-order perm is applied before any backend (api.py); the
bias is added in float32 before the single rounding, as the Triton kernels do. Up to M = 128
the config may split K over programs where the weight tiles alone leave SMs short of two
programs (`_split`), finished in the launch (kernels.py, `_finish_split`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from openkernels.shared import dispatch
from openkernels.shared.launch import launch as direct_launch
from openkernels.shared.platform import gluon_hopper_available

__all__ = [
    "ARCHS",
    "MIN_M",
    "MAX_M",
    "WgmmaConfig",
    "config_for",
    "all_configs",
    "int4_linear_fwd",
    "supports",
    "slower_than_triton",
    "unsupported_call",
    "smem_bytes",
    "takes_tiled",
]

ARCHS = ("sm_90",)
MIN_M, MAX_M = 16, 2**31 - 1  # rows of x this kernel takes; the Triton launcher takes fewer
DTYPES = (torch.bfloat16, torch.float16)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on sm_90


@dataclass(frozen=True)
class WgmmaConfig:
    """block_m: rows of x per program (16, 32, 64, 128: the wgmma's N); block_n: rows of W
    (64: one warpgroup, 128: two; num_warps = block_n // 16); block_k: columns per step (64
    or 128, a divisor of the group); stages: depth of the TMA ring; scales_ahead: how many K
    steps ahead of its use a step's scales and zeros are loaded (1 or 2); split_k: programs
    per output tile, each a contiguous share of the K steps, finished in the same launch (the
    Triton kernels' protocol: float32 partials, a self-resetting arrival counter per tile,
    the last split adding them in split order); persistent: one program per SM taking tiles in
    turn, the next tile's first loads issued before this one's epilogue (split_k 1 only)."""

    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    scales_ahead: int = 1
    split_k: int = 1
    persistent: bool = False

    @property
    def num_warps(self) -> int:
        return self.block_n // 16


def smem_bytes(cfg: WgmmaConfig) -> int:
    """Shared memory of the ring: STAGES x (x tile (block_m, block_k) 16-bit + codes
    (block_n, block_k / 2) bytes) + one 8-byte mbarrier per stage (the epilogue's layout
    conversion reuses it, except in persistent programs, whose ring is live under it)."""
    ring = cfg.stages * (cfg.block_m * cfg.block_k * 2 + cfg.block_n * cfg.block_k // 2 + 8)
    return ring + (cfg.block_m * cfg.block_n * 2 if cfg.persistent else 0)


# The persistent configs the large-M study times (forced only until they measure faster).
PERSISTENT_STUDY = (
    WgmmaConfig(256, 128, 64, 4, 1, 1, True),
    WgmmaConfig(128, 128, 128, 4, 2, 1, True),
)


def programs(cfg: WgmmaConfig, tiles: int, device: torch.device) -> int:
    """Programs to launch: one per tile and split, or for persistent configs one per SM (the
    8-warp tiles they are used with take one SM each) where there are more tiles."""
    if not cfg.persistent:
        return tiles * cfg.split_k
    from ..triton import _sm_count  # the Triton launchers' (cached per device)

    return min(tiles, _sm_count(device))


def _block_k(k: int, group: int) -> int | None:
    """128 or 64 columns per step: a divisor of K and of the group (any, for one group per
    row); None when neither is."""
    for bk in (128, 64):
        if k % bk == 0 and (group >= k or group % bk == 0):
            return bk
    return None


TILES_FOR_A_WAVE = 96  # weight x band tiles that keep most of an H100 / H200's 132 SMs busy


def config_for(m: int, n: int, k: int, group: int) -> WgmmaConfig | None:
    """The launch config for x (M, K) @ W^T, W (N, K) with groups of `group`; None when K and
    the group admit no step. From the sweeps of 2026-12-05 (H200) and 2026-12-06 (H100)
    (benchmarks/studies/quant_wgmma.py and quant_wgmma_large_m.py, bf16, group 128, CUDA-graph
    kernel time as a fraction of F.linear's; docs/perf.md):
      M <= 64    BLOCK_M the smallest of 16 / 32 / 64 holding M, 64-row weight tiles (one
                 warpgroup), 3 stages (M = 16: 0.98x / 1.60x at 8192 x 8192 / 28672 x 8192).
      M <= 128   one 128-row band on 64-row weight tiles, 3 stages (M = 128 at 28672 x 8192,
                 scales two steps ahead: 1.35x, where 128 x 128 tiles ran 1.23x), K split where
                 the tiles leave SMs short of two programs (_split).
      M > 128    the largest tile that still gives TILES_FOR_A_WAVE programs, of: 256-row bands
                 of x on 128-row weight tiles, 64-column steps, 4 stages (from M = 256: the
                 dequantized weight serves twice the columns; M = 2048 0.95x / 0.97x, where
                 128 x 128 tiles ran 0.82x / 0.78x and dequantize + cuBLAS 0.71x / 0.79x);
                 128-row bands on 128-row tiles, 4 stages (M = 256 at 8192 x 8192: 0.90x);
                 128-row bands on 64-row tiles, 3 stages (M = 128 at 8192 x 8192: 1.03x; the
                 fallback when no tile fills a wave: 2048 x 8192 at M = 256 0.46x, where
                 128 x 128 tiles ran 0.35x). Fewer, larger tiles lost whenever they left SMs
                 idle (8192 x 8192 M = 256 on 256 x 128 tiles: 0.61x, 64 programs)."""
    bk = _block_k(k, group)
    if bk is None:
        return None
    # Where every step starts a group, its scales are loaded two steps ahead (H100, quant
    # 0.10.8: M = 64 8192 x 8192 1.17x -> 1.31x F.linear, M = 128 1.04x -> 1.15x, 28672 x 8192
    # M = 128 1.31x -> 1.35x); with 64-column steps in groups of 128 one step ahead measured
    # 0.02-0.03x better (M = 2048).
    ahead = 2 if group == bk else 1
    if m <= 64:
        return _split(WgmmaConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64, bk, 3, ahead), m, n, k)
    if m <= 128:  # 128 x 128 tiles lost here even where they filled a wave (28672 x 8192: 1.23x / 1.35x)
        return _split(WgmmaConfig(128, 64, bk, 3, ahead), m, n, k)
    candidates = [WgmmaConfig(256, 128, 64, 4, 2 if group == 64 else 1)] if m >= 256 else []
    candidates += [WgmmaConfig(128, 128, bk, 4, ahead), WgmmaConfig(128, 64, bk, 3, ahead)]
    for cfg in candidates:
        if -(-n // cfg.block_n) * -(-m // cfg.block_m) >= TILES_FOR_A_WAVE:
            # Not split: past 128 rows a tile is work enough (H100, quant 0.10.9: M = 256 at
            # 4096 x 4096 split 1 / 2 0.85x / 0.71x F.linear, M = 512 at 2048 x 8192 0.79x / 0.76x).
            return cfg
    # No tile fills a wave: split K (M = 256 at 2048 x 8192, split 4: 0.51x -> 0.69x).
    return _split(candidates[-1], m, n, k)


SPLIT_PROGRAMS = 264  # two programs per SM of an H100 / H200 (132 SMs)
SPLIT_MIN_STEPS = 16  # K steps per split below which the split's own prologue and epilogue cost more


def _split(cfg: WgmmaConfig, m: int, n: int, k: int) -> WgmmaConfig:
    """cfg with K split 4 or 2 ways where the weight tiles alone leave an SM with less than two
    programs (one warpgroup of 4 warps each) and every split keeps SPLIT_MIN_STEPS K steps.
    H100, 2026-12-06 (quant_wgmma_large_m.py, x F.linear, split 1 / 2 / 4): M = 128 8192 x 8192
    1.22 / 1.27 / 0.88 (128 tiles), 4096 x 4096 0.75 / 0.82 / 0.76 (64 tiles, 32 steps),
    2048 x 8192 0.48 / 0.72 / 0.93 (32 tiles); M = 64 8192 x 8192 1.36 / 1.53 / -."""
    if cfg.block_n != 64:  # two 8-warp programs do not fit an SM (~210 registers a thread)
        return cfg
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    steps = k // cfg.block_k
    for split in (4, 2):
        if tiles * split <= SPLIT_PROGRAMS and steps // split >= SPLIT_MIN_STEPS:
            return replace(cfg, split_k=split)
    return cfg


def all_configs() -> list[WgmmaConfig]:
    """Every config config_for can return (compile-only checks)."""
    seen: dict[WgmmaConfig, None] = {}
    for m in (16, 17, 32, 33, 64, 65, 128, 200, 256, 2048):
        for n in (1024, 4096, 28672):
            for k, group in ((4096, 128), (4096, 64), (4096, 4096), (192, 64)):
                cfg = config_for(m, n, k, group)
                if cfg is not None:
                    seen[cfg] = None
    return list(seen)


def sweep_configs(m: int) -> list[WgmmaConfig]:
    """The study's variants at M rows (benchmarks/studies/quant_wgmma.py), the default first:
    64- and 128-row weight tiles, 128-column steps at 3 and 4 stages, 64-column steps at 4;
    at 65-128 rows also 128-row bands of x (one band instead of two), within 227 KiB."""
    base = config_for(m, 8192, 8192, 128)
    bands = [base.block_m] + ([128] if 64 < m <= 128 else [])
    out = {base: None}
    for bm in bands:
        for bn in (64, 128):
            for bk, stages in ((128, 4), (128, 3), (64, 4)):
                cfg = WgmmaConfig(bm, bn, bk, stages)
                if smem_bytes(cfg) <= SMEM_LIMIT:
                    out[cfg] = None
    return list(out)


def slower_than_triton(m: int, n: int, k: int) -> str | None:
    """Why a call the kernel takes goes to the Triton launcher by default (None: it runs here).
    From kernel times (CUDA graphs, `benchmarks/studies/quant_wgmma_wall.py`, bf16, group 128,
    2026-12-05; docs/perf.md), since with the C++ replay of its calls (shared 0.16.4: their
    TMA descriptors encoded per call) an eager call costs ~10 us of host time like the Triton
    path's. x F.linear, Triton / wgmma:
      8192 x 8192: M = 16 1.24 / 0.99 (H200; one wave of 128 weight tiles, no split-K),
        M = 64 0.72 / 0.90, M = 128 0.56 / 0.83, M = 256 0.50 / 0.83 (H100 alike).
      28672 x 8192 (H200) and 14336 x 4096 (H100): the kernel from M = 16 (1.48 / 1.77 and
        1.45 / 1.91), M = 128 0.68 / 1.06 and 0.68 / 1.45.
      4096 x 4096 and 4096 x 14336 (H100): Triton up to M = 64 (4096 x 4096 M = 64 0.85 /
        0.71), the kernel from M = 96 (0.55 / 0.63, 4096 x 14336 M = 96 0.54 / 0.65).
      From M = 256 (H100, 2026-12-06, `quant_wgmma_large_m.py`; the Triton launcher runs
        dequantize + cuBLAS from M = 512): the kernel at every shape measured, 2048 x 2048 to
        28672 x 8192, M = 256-4096 (e.g. M = 2048: 0.84-0.97x against 0.65-0.80x; M = 256 at
        2048 x 8192: 0.46x against 0.26x); from M = 96 at N >= 2048 with K >= 8192 (M = 128 at
        2048 x 8192 with K split 4 ways: 0.93x against Triton's 0.36x).
      With K split (quant 0.10.8) and from M = 32 (H100, 2026-12-06, quant 0.10.9): M = 32
        4096 x 14336 1.23 / 1.68, 8192 x 2048 1.03 / 1.28, 2048 x 8192 0.79 / 1.09, 4096 x 4096
        1.00 / 1.01, 2048 x 2048 0.68 / 0.64 (Triton kept below 4096 x 4096); M = 64 4096 x 4096
        0.82 / 0.92, 2048 x 8192 0.73 / 1.02, 8192 x 2048 0.67 / 1.32, 2048 x 2048 0.58 / 0.64.
        At M = 16 the Triton launcher's tensor-core GEMV keeps the calls below N = 12288
        (4096 x 4096 1.66 / 1.22, 8192 x 8192 2.25 / 1.72; 14336 x 4096 alike, 1.81 / 1.81).
    Shapes below 2048 x 2048 were not measured and stay on Triton. A forced "wgmma" ignores
    this."""
    if n < 2048 or k < 2048:
        return f"N x K = {n} x {k}: the wgmma kernel was not measured below 2048 x 2048"
    if m >= 64 or (m >= 32 and n * k >= 4096 * 4096) or (n >= 12288 and k >= 4096):
        return None
    return f"M = {m} at {n} x {k}: Triton's kernels measured faster (few rows for the tensor-core tile)"


def supports(key: dispatch.DispatchKey) -> str | None:
    """Dispatch predicate: None when this kernel can run `key`. Per-call limits are
    unsupported_call's, whose calls go to the Triton launcher, so a forced "wgmma" runs every
    int4_linear call on sm_90 (NF4 included: nf4_slower_than_triton routes the unforced ones)."""
    if key.backend != "cuda":
        return f"the Gluon wgmma kernel runs on NVIDIA GPUs (this is {key.backend}/{key.arch})"
    if key.arch not in ARCHS:
        return f"{key.arch}: the Gluon wgmma kernel is written for Hopper ({', '.join(ARCHS)}: wgmma, TMA)"
    if key.dtype not in DTYPES:
        return f"activations in {key.dtype}: the wgmma kernel takes bfloat16 and float16"
    if not gluon_hopper_available():
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return dispatch.triton_supports(key)


def _aligned(t: Tensor) -> bool:
    """A 2-D tensor TMA can read: unit column stride, rows and base 16-byte aligned."""
    return _rows_aligned(t) and t.data_ptr() % 16 == 0


def _rows_aligned(t: Tensor) -> bool:
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0


def unsupported_call(x, qweight, scales, zeros, bias, out, group_size, kind, config=None) -> str | None:
    """Why this call goes to the Triton launcher instead (None: the wgmma kernel takes it)."""
    reason = _unsupported_layout(x, qweight, scales, zeros, out, group_size, kind, config)
    if reason is None and (x.data_ptr() % 16 or qweight.data_ptr() % 16):
        return "the base of x or qweight not 16-byte aligned (TMA)"
    return reason


def _unsupported_layout(x, qweight, scales, zeros, out, group_size, kind, config) -> str | None:
    """unsupported_call without the base addresses: what a launch plan's key decides."""
    m, k = x.shape
    if not MIN_M <= m <= MAX_M:
        return f"{m} rows of x (the wgmma kernel takes {MIN_M}-{MAX_M})"
    if kind not in ("int4", "nf4"):
        return f"kind {kind!r} (the wgmma kernel takes int4 and nf4)"
    if (
        x.dtype not in DTYPES
        or scales.dtype not in DTYPES
        or (zeros is not None and zeros.dtype != scales.dtype)
    ):
        return "x, scales or zeros not bfloat16 / float16 (zeros as scales)"
    if (config.block_k if config else _block_k(k, group_size)) is None:
        return f"K = {k} or group size {group_size} not a multiple of 64"
    if config is not None and config.persistent and config.split_k > 1:
        return "a persistent config with K split (persistent programs take whole tiles)"
    if config is not None and (k % config.block_k or (group_size < k and group_size % config.block_k)):
        return f"K = {k} or group size {group_size} not a multiple of block_k {config.block_k}"
    if qweight.dim() == 3:  # format.tile_codes' layout, read through a 4-D view (kernels._issue)
        block_k = config.block_k if config else _block_k(k, group_size)
        if qweight.shape[1] * 128 != k or not qweight.is_contiguous():
            return "tiled codes not contiguous or not of x's K"
        if block_k > 128:
            return f"tiled codes with {block_k}-column steps (they hold 128-column blocks)"
    elif not _rows_aligned(qweight):
        return "rows of qweight not 16-byte aligned (TMA)"
    if not _rows_aligned(x):
        return "rows of x not 16-byte aligned (TMA)"
    if out.stride(1) != 1 or scales.stride(1) != 1 or (zeros is not None and zeros.stride(1) != 1):
        return "an output, scales or zeros with a non-unit column stride"
    return None


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA tile (6 us to build: built once per tile)."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.uint8: gl.uint8}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def _desc(t: Tensor, block: tuple[int, ...]):
    """A host TMA descriptor of t in tiles of `block` (about 2 us); tiled codes (N // 16,
    K // 128, 1024) as (N // 16, K // 128, 16, 64), whose 4-D blocks land in shared memory as the
    rows' 2-D tiles do (kernels._code_rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if len(block) == 4:
        t = t.view(t.shape[0], t.shape[1], 16, 64)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _shared_layout(block, t.dtype))


class _Plan:
    """One launch of the kernel with everything but the tensors decided: config, grid, tile
    layouts, integer arguments and flags. The launch goes through openkernels.shared.launch
    (the compiled kernel called directly after the first call) instead of Gluon's own JIT
    launch, most of the ~0.1 ms of host time per call measured on the H200 (quant 0.9.3)."""

    __slots__ = (
        "flags",
        "grid",
        "ints",
        "kernel",
        "num_warps",
        "partials",
        "routed",
        "scratch",
        "tiles",
        "w_block",
        "x_block",
    )

    def __init__(self, cfg: WgmmaConfig, m: int, n: int, k: int, group_size: int, x_dtype: torch.dtype,
                 scales_dtype: torch.dtype, has_zeros: bool, has_bias: bool, s_stride: int, o_stride: int,
                 kind: str = "int4", device: torch.device | None = None, tiled: bool = False) -> None:  # fmt: skip
        from ..triton import split_scratch  # the Triton kernels' split-K scratch and counters
        from ..triton.configs import kernel_group
        from .kernels import int4_linear_wgmma_kernel  # imports Gluon: once per plan, not per call

        self.scratch = split_scratch

        self.kernel = int4_linear_wgmma_kernel
        self.tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
        self.grid = (programs(cfg, self.tiles, device or torch.device("cpu")),)
        steps = k // cfg.block_k
        per_split = -(-steps // cfg.split_k)
        self.partials = cfg.split_k * m * n if cfg.split_k > 1 else 0
        self.ints = (m, n, k, s_stride, o_stride, per_split)
        self.flags = dict(GROUP=kernel_group(group_size, k), STAGES=cfg.stages, HAS_ZEROS=has_zeros,
                          HAS_BIAS=has_bias, SCALE_16=scales_dtype == x_dtype,
                          SCALES_AHEAD=cfg.scales_ahead, SPLIT_K=cfg.split_k, NF4=kind == "nf4",
                          PERSISTENT=cfg.persistent)  # fmt: skip
        if kind == "nf4":
            self.flags["NF4_TABLE"] = NF4_LOOKUPS.index(NF4_LOOKUP)
        self.num_warps = cfg.num_warps
        self.x_block = (cfg.block_m, cfg.block_k)
        # Tiled codes: blocks of whole 16-row tiles, one 128-column block (or half of it) deep.
        self.w_block = (
            (cfg.block_n // 16, 1, 16, cfg.block_k // 2) if tiled else (cfg.block_n, cfg.block_k // 2)
        )
        self.routed: str | None = None  # why unforced calls go to Triton (slower_than_triton)

    def __call__(self, x: Tensor, qweight: Tensor, scales: Tensor, zeros, bias, out: Tensor) -> None:
        if self.partials:
            ws, counters = self.scratch(out.device, self.partials, self.tiles)
        else:
            ws, counters = out, out  # not read without a split
        direct_launch(
            self.kernel, self.grid,
            _desc(x, self.x_block), _desc(qweight, self.w_block),
            scales, scales if zeros is None else zeros, scales if bias is None else bias, out, ws, counters,
            *self.ints, num_warps=self.num_warps, **self.flags,
        )  # fmt: skip


# call key -> its _Plan, or why the Triton launcher takes such calls
_plans: dict[tuple, _Plan | str] = {}
_MAX_PLANS = 4096


def int4_linear_fwd(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
    out: Tensor,
    group_size: int,
    kind: str,
    *,
    config: WgmmaConfig | None = None,
) -> None:
    """triton.int4_linear_fwd's contract. `config` overrides config_for (the study's sweep)."""
    key = (x.shape, qweight.shape, group_size, kind, x.dtype, scales.dtype, zeros is None,
           None if zeros is None else zeros.dtype, None if bias is None else bias.dtype, x.stride(),
           qweight.stride(), scales.stride(), None if zeros is None else zeros.stride(), out.stride(),
           x.device, config, NF4_LOOKUP)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _plan(x, qweight, scales, zeros, bias, out, group_size, kind, config)
    if (
        type(plan) is str
        or x.data_ptr() % 16
        or qweight.data_ptr() % 16
        or (plan.routed is not None and "wgmma" not in dispatch.forced_names("int4_linear"))
    ):
        from ..format import rows_of
        from ..triton import int4_linear_fwd as triton_fwd

        # (Tiled codes reach here only where takes_tiled said yes; kept correct anyway.)
        triton_fwd(x, rows_of(qweight), scales, zeros, bias, out, group_size, kind)
        return
    plan(x, qweight, scales, zeros, bias, out)


def takes_tiled(rows: Tensor, tiled: Tensor, scales, zeros, group_size: int, kind: str) -> bool:
    """Whether this launcher runs the call (rows (M, K); dispatch reaches it and the caller's
    checks are ops.tiled_runner's) on the kernel with tiled codes (format.tile_codes, through a
    4-D TMA view): not routed to Triton, and the codes and x fit TMA."""
    (m, k), n = rows.shape, 16 * tiled.shape[0]
    out = torch.empty((m, n), dtype=rows.dtype, device="meta")
    return (
        _unsupported_layout(rows, tiled, scales, zeros, out, group_size, kind, None) is None
        and _routed(m, n, k, kind) is None
        and rows.data_ptr() % 16 == 0
        and tiled.data_ptr() % 16 == 0
    )


def _plan(x, qweight, scales, zeros, bias, out, group_size, kind, config) -> _Plan | str:
    reason = _unsupported_layout(x, qweight, scales, zeros, out, group_size, kind, config)
    if reason is not None:
        return reason
    m, k = x.shape
    tiled = qweight.dim() == 3
    n = 16 * qweight.shape[0] if tiled else qweight.shape[0]
    cfg = config or config_for(m, n, k, group_size)
    plan = _Plan(cfg, m, n, k, group_size, x.dtype, scales.dtype, zeros is not None, bias is not None,
                 scales.stride(0), out.stride(0), kind, x.device, tiled)  # fmt: skip
    plan.routed = None if config is not None else _routed(m, n, k, kind)
    return plan


def _routed(m: int, n: int, k: int, kind: str) -> str | None:
    """Why unforced calls of this shape and kind go to the Triton launcher (None: they run here)."""
    if kind == "nf4":
        return nf4_slower_than_triton(m, n, k)
    return slower_than_triton(m, n, k)


# NF4's lookup on this kernel (the kernel's NF4_TABLE: the index here): "registers" =
# kernels._dequantize_nf4 (byte permutes of eight constant words, 12 instructions per pair of
# codes); "pairs" = the level pair of each byte of codes read from a 256-word table in shared
# memory (kernels._dequantize_nf4_shared, one read per pair, but a warp's reads conflict on
# banks); "levels" (the default since quant 0.10.15) = each code's level read from a 16-word
# table (two reads per pair, never a bank conflict). H100 kernel time, NF4 / int4's speed
# (quant_nf4_wgmma_table.py, bf16, group 128; 8192 x 8192 and 28672 x 8192, M = 64-1024):
# registers 0.58-0.83, pairs 0.73-0.91, levels 0.76-0.96.
NF4_LOOKUPS = ("registers", "pairs", "levels")
NF4_LOOKUP = "levels"

# Rows of x where NF4 runs on this kernel by default (nf4_slower_than_triton): from where the
# tensor-core GEMV stops (16 rows) to where dequantize + cuBLAS measured faster.
NF4_ROWS = (17, 1024)


def nf4_slower_than_triton(m: int, n: int, k: int) -> str | None:
    """Why an NF4 call goes to the Triton launcher (None: it runs here). CUDA-graph kernel time,
    H100, 2026-12-07 (quant_nf4_wgmma_table.py, bf16, group 128, the "levels" lookup), wgmma /
    the Triton path, us:
      M = 17-48: 8192 x 8192 31.9-36.6 / 42.7-54.0, 28672 x 8192 95.3-114.8 / 132.4-164.3,
        14336 x 4096 28.2-30.9 / 38.2-48.4, 2048 x 8192 15.4-17.3 / 17.9-23.0, 4096 x 4096
        16.4-18.3 / 16.5-18.9 (M = 24: 17.2 / 16.8).
      M = 64: 14336 x 4096 31.0 / 50.8, 2048 x 8192 17.8 / 23.4, 4096 x 4096 18.5 / 19.0.
      M = 2048 (dequantize + cuBLAS there): 8192 x 8192 465.4 / 458.8, 28672 x 8192 1722.8 /
        1651.7, 4096 x 4096 129.9 / 118.2, 2048 x 8192 117.3 / 114.9.
    Below 4096 x 4096 in N x K, int4's limits (slower_than_triton), not measured for NF4."""
    if not NF4_ROWS[0] <= m <= NF4_ROWS[1]:
        return f"NF4 at M = {m}: its Triton path measured faster outside {NF4_ROWS[0]}-{NF4_ROWS[1]} rows"
    if n * k < 4096 * 4096:
        return slower_than_triton(m, n, k)
    return None


def launch(
    x,
    qweight,
    scales,
    zeros,
    bias,
    out,
    group_size: int,
    config: WgmmaConfig | None = None,
    kind: str = "int4",
) -> None:
    """The kernel on a call unsupported_call accepts (no checks here)."""
    m, k = x.shape
    n = qweight.shape[0]
    cfg = config or config_for(m, n, k, group_size)
    _Plan(cfg, m, n, k, group_size, x.dtype, scales.dtype, zeros is not None, bias is not None,
          scales.stride(0), out.stride(0), kind, x.device)(x, qweight, scales, zeros, bias, out)  # fmt: skip


def _route(x, qweight, scales, zeros, bias, out, group_size, kind, *, config=None) -> str | None:
    """For dispatch.explain: where a call with these arguments goes when it is not the wgmma
    kernel's (None: the kernel runs it)."""
    reason = _unsupported_layout(x, qweight, scales, zeros, out, group_size, kind, config)
    if reason is None and config is None and "wgmma" not in dispatch.forced_names("int4_linear"):
        reason = _routed(x.shape[0], qweight.shape[0], x.shape[1], kind)
    return None if reason is None else f"handed to the Triton launcher ({reason})"


int4_linear_fwd.route = _route  # type: ignore[attr-defined]
