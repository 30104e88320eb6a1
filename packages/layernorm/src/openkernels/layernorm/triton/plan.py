"""Launch plans of the layernorm kernels: kernel, grid, split count, rows per program and
every constexpr of one launch, as a pure function of the problem's shape and options.

`plan("fwd" | "bwd", ...)` is what the PyTorch launchers (triton/__init__.py) launch;
`fwd_launch` / `bwd_launch` describe, without JAX, the whole launch JAX makes from them
(jax/launch.py launches these through `openkernels.shared.jax.launch`, and tests/test_aot.py
compiles the same descriptions for GPUs this machine lacks). Under JAX every array is
contiguous (row stride = n_cols) and every integer and float argument is a compile-time
constant. Absent arrays are stand-ins the kernel's flags keep it from touching: an input slot
takes another input (as the PyTorch launchers do), an output slot a one-element array.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .configs import MAX_SPLITS, NormConfig, launch_config, looped_config, next_pow2

__all__ = ["FwdPlan", "BwdPlan", "plan", "Launch", "fwd_launch", "bwd_launch"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _programs(blocks: int, cfg: NormConfig, sm_count: int) -> int:
    return blocks if cfg.programs_per_sm == 0 else max(1, min(blocks, sm_count * cfg.programs_per_sm))


@dataclass(frozen=True)
class FwdPlan:
    """One forward launch. kernel: its name in kernels.py; grid: 1D; splits: programs per
    row (the split kernel's n_splits and scratch size; 1 otherwise); meta: the constexprs
    the config and the row length decide (see `constexprs`)."""

    config: NormConfig
    kernel: str
    grid: tuple[int]
    splits: int
    meta: tuple[tuple[str, int | bool], ...]

    @property
    def constexprs(self) -> dict[str, int | bool]:
        return dict(self.meta)


@dataclass(frozen=True)
class BwdPlan:
    """One backward launch. kernel: its name in kernels.py (_norm_bwd_kernel, or
    _norm_bwd_split_kernel for long rows); grid: 1D. Each program takes rows_per_program
    consecutive rows (of its chunk, when split over `splits` programs per row) and writes
    its part of one partial row of dweight/dbias."""

    config: NormConfig
    kernel: str
    grid: tuple[int]
    splits: int
    rows_per_program: int
    meta: tuple[tuple[str, int | bool], ...]

    @property
    def programs(self) -> int:
        """Rows of the dweight/dbias partials: one per run of rows."""
        return self.grid[0] // self.splits

    @property
    def constexprs(self) -> dict[str, int | bool]:
        return dict(self.meta)


# Plans are cached per shape: bounded, since row counts vary from call to call.
@functools.lru_cache(maxsize=4096)
def plan(
    direction: str,
    n_rows: int,
    n_cols: int,
    dtype: torch.dtype,
    backend: str,
    aligned: bool,
    rms: bool,
    sm_count: int,
    config: NormConfig | None = None,
) -> FwdPlan | BwdPlan:
    """The launch of an (n_rows, n_cols) problem in `direction` ("fwd" or "bwd"); PyTorch
    and JAX launch through this.

    backend: "cuda", "rocm" or "cpu" (the Triton interpreter); sm_count: SMs / CUs of the
    device (sizes persistent grids); config: overrides `launch_config` (tests)."""
    cfg = config or launch_config(n_cols, dtype, backend, direction, aligned, rms)
    if (
        config is None
        and cfg.mode == "split"
        and direction == "bwd"
        and _cdiv(n_cols, cfg.block_cols) > sm_count
    ):
        # A row's programs must be resident together: on a GPU of fewer SMs than split
        # programs per row (small GPUs, long rows), the looped kernel runs instead.
        cfg = looped_config(direction, aligned, backend)
    if direction == "bwd":
        return _bwd_plan(cfg, n_rows, n_cols, backend, sm_count)
    return _fwd_plan(cfg, n_rows, n_cols, backend, sm_count, rms)


def _fwd_plan(cfg: NormConfig, n_rows: int, n_cols: int, backend: str, sm_count: int, rms: bool) -> FwdPlan:
    if cfg.mode == "tile":
        blocks = _cdiv(n_rows, cfg.block_rows)
        meta = dict(EVEN_C=n_cols == cfg.block_cols, PERSISTENT=cfg.programs_per_sm > 0,
                    PREFETCH=cfg.prefetch, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols)  # fmt: skip
        return FwdPlan(cfg, "_norm_fwd_kernel", (_programs(blocks, cfg, sm_count),), 1, tuple(meta.items()))
    if cfg.mode == "split":
        splits = _split_count(cfg, n_cols, backend, MAX_SPLITS)
        # NARROW for RMSNorm only: LayerNorm's split forward ran faster holding h in float32
        # (H200, bf16, norm_split_variants.py, fraction of copy at 32768 / 65536 / 131072 /
        # 262144 / 1048576 columns: 0.61 / 0.58 / 0.60 / 0.59 / 0.50 against 0.56 / 0.54 /
        # 0.51 / 0.50 / 0.48 narrow; with a residual 0.87 / 0.84 / 0.85 / 0.83 / 0.69 against
        # 0.84 / 0.84 / 0.83 / 0.70 / 0.59), RMSNorm's faster narrow (0.73 / 0.73 / 0.71 /
        # 0.68 / 0.63 against 0.64-0.68 / 0.60-0.65 / 0.62-0.65 / 0.63-0.64 / 0.56-0.60).
        meta = dict(BLOCK_C=cfg.block_cols, MAX_SPLITS=next_pow2(splits), NARROW=rms and _narrow(cfg, backend),
                    ONE_PASS=cfg.one_pass)  # fmt: skip
        return FwdPlan(cfg, "_norm_fwd_split_kernel", (n_rows * splits,), splits, tuple(meta.items()))
    return FwdPlan(cfg, "_norm_fwd_looped_kernel", (n_rows,), 1, (("BLOCK_C", cfg.block_cols),))


def _split_count(cfg: NormConfig, n_cols: int, backend: str, limit: int) -> int:
    """Programs per row of a split kernel, checked: they wait for each other, so more than
    fit at once (or any on the interpreter, which runs programs one by one) never finish."""
    splits = _cdiv(n_cols, cfg.block_cols)
    if splits > limit or (splits > 1 and backend == "cpu"):
        raise ValueError(f"the split kernel cannot run {splits} splits per row on backend {backend!r}")
    return splits


def _narrow(cfg: NormConfig, backend: str) -> bool:
    """NARROW: the split kernels' 16-bit register holding, through PTX (CUDA only), on chunks
    of at least one 16-byte vector per thread (its register copy moves pairs of elements)."""
    return backend == "cuda" and cfg.block_cols >= 8 * 32 * cfg.num_warps


def _bwd_plan(cfg: NormConfig, n_rows: int, n_cols: int, backend: str, sm_count: int) -> BwdPlan:
    if cfg.mode == "split":
        # One program per SM always fits (a program's registers fit an SM), so a row's
        # programs are resident together when there are no more of them than SMs.
        splits = _split_count(cfg, n_cols, backend, min(MAX_SPLITS, sm_count))
        blocks = max(1, min(n_rows, sm_count * cfg.programs_per_sm // splits))
        rows_per_program = _cdiv(n_rows, blocks)
        blocks = _cdiv(n_rows, rows_per_program)
        meta = dict(BLOCK_C=cfg.block_cols, MAX_SPLITS=next_pow2(splits), NARROW=_narrow(cfg, backend))
        return BwdPlan(cfg, "_norm_bwd_split_kernel", (blocks * splits,), splits, rows_per_program,
                       tuple(meta.items()))  # fmt: skip
    # Every program gets at least one row, so every partial row is written.
    rows_per_program = _cdiv(n_rows, _programs(n_rows, cfg, sm_count))
    if not cfg.looped:
        rows_per_program = _cdiv(rows_per_program, cfg.block_rows) * cfg.block_rows
    programs = _cdiv(n_rows, rows_per_program)
    meta = dict(LOOPED=cfg.looped, EVEN_C=n_cols == cfg.block_cols, PREFETCH=cfg.prefetch,
                BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols)  # fmt: skip
    return BwdPlan(cfg, "_norm_bwd_kernel", (programs,), 1, rows_per_program, tuple(meta.items()))


_STATS = "float32"


@dataclass(frozen=True)
class Launch:
    """One kernel launch.

    kernel: its name in kernels.py. inputs: (pointer, array) pairs, the array named by its
    role ("x", "residual", "weight", "bias"; "dy", "h", "mean", "rstd", "dh_out"); outputs:
    (pointer, shape, dtype name) triples, in the kernel's order; constants: every other
    argument; zeroed: outputs that must start at zero.
    """

    kernel: str
    grid: tuple[int]
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, tuple[int, ...], str], ...]
    constants: tuple[tuple[str, int | float | bool], ...]
    num_warps: int
    num_stages: int
    zeroed: tuple[str, ...] = ()


def _aligned(n_cols: int) -> bool:
    # Contiguous rows: every stride is n_cols, so n_cols alone decides vector loads.
    return n_cols % 16 == 0


def fwd_launch(
    n_rows: int,
    n_cols: int,
    *,
    dtype: str,
    out_dtype: str,
    h_dtype: str,
    rms: bool,
    has_residual: bool,
    store_residual: bool,
    has_weight: bool,
    has_bias: bool,
    eps: float,
    weight_offset: float,
    vendor: str,
    sm_count: int,
) -> Launch:
    """The forward launch on x (n_rows, n_cols) of dtype (a numpy dtype name such as
    "bfloat16"). Outputs: out (n_rows, n_cols) out_dtype; res_out (n_rows, n_cols) h_dtype
    when store_residual; mean, rstd (n_rows,) float32 (mean for LayerNorm only).
    vendor: "cuda", "rocm" or "cpu" (the Triton interpreter)."""
    lp = plan("fwd", n_rows, n_cols, getattr(torch, dtype), vendor, _aligned(n_cols), rms, sm_count)
    rows = (n_rows, n_cols)
    inputs = (
        ("x_ptr", "x"),
        ("res_ptr", "residual" if has_residual else "x"),
        ("w_ptr", "weight" if has_weight else "x"),
        ("b_ptr", "bias" if has_bias else "x"),
    )
    outputs = [
        ("out_ptr", rows, out_dtype),
        # Always present: its pointer type carries the residual stream's dtype.
        ("res_out_ptr", rows if store_residual else (1,), h_dtype),
        ("mean_ptr", (1,) if rms else (n_rows,), _STATS),
        ("rstd_ptr", (n_rows,), _STATS),
    ]
    constants: dict[str, int | float | bool] = dict(
        n_rows=n_rows, n_cols=n_cols, stride_x=n_cols, stride_res=n_cols if has_residual else 0,
        stride_out=n_cols, stride_res_out=n_cols if store_residual else 0,
        eps=float(eps), weight_offset=float(weight_offset),
        IS_RMS=rms, HAS_RESIDUAL=has_residual, STORE_RESIDUAL=store_residual,
        HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, **lp.constexprs,
    )  # fmt: skip
    zeroed: tuple[str, ...] = ()
    if lp.config.mode == "split":
        # Scratch of the split kernel: partial statistics, and per-row arrival counters
        # that must start at zero (the PyTorch launcher zeroes them too).
        outputs += [("part_ptr", (n_rows * lp.splits * 2,), _STATS), ("arrived_ptr", (n_rows,), "int32")]
        constants["n_splits"] = lp.splits
        zeroed = ("arrived_ptr",)
    cfg = lp.config
    return Launch(lp.kernel, lp.grid, inputs, tuple(outputs), tuple(constants.items()), cfg.num_warps,
                  cfg.num_stages, zeroed)  # fmt: skip


def bwd_launch(
    n_rows: int,
    n_cols: int,
    *,
    h_dtype: str,
    rms: bool,
    has_weight: bool,
    has_dh_out: bool,
    weight_grad: bool,
    bias_grad: bool,
    weight_offset: float,
    vendor: str,
    sm_count: int,
) -> Launch:
    """The backward launch on h (n_rows, n_cols) of h_dtype. Outputs: dh (n_rows, n_cols)
    h_dtype; dw_part, db_part (programs, n_cols) float32 partial sums over each program's
    rows, to be summed over axis 0 (one-element stand-ins when not wanted)."""
    lp = plan("bwd", n_rows, n_cols, getattr(torch, h_dtype), vendor, _aligned(n_cols), rms, sm_count)
    parts = (lp.programs, n_cols)
    inputs = (
        ("dy_ptr", "dy"),
        ("h_ptr", "h"),
        ("w_ptr", "weight" if has_weight else "h"),
        ("mean_ptr", "rstd" if rms else "mean"),
        ("rstd_ptr", "rstd"),
        ("dh_out_ptr", "dh_out" if has_dh_out else "h"),
    )
    outputs = (
        ("dh_ptr", (n_rows, n_cols), h_dtype),
        ("dw_part_ptr", parts if weight_grad else (1,), _STATS),
        ("db_part_ptr", parts if bias_grad else (1,), _STATS),
    )
    constants: dict[str, int | float | bool] = dict(
        n_rows=n_rows, n_cols=n_cols, stride_dy=n_cols, stride_h=n_cols,
        stride_dh_out=n_cols if has_dh_out else 0, stride_dh=n_cols,
        rows_per_program=lp.rows_per_program, weight_offset=float(weight_offset),
        IS_RMS=rms, HAS_WEIGHT=has_weight, HAS_DH_OUT=has_dh_out, WEIGHT_GRAD=weight_grad,
        BIAS_GRAD=bias_grad, **lp.constexprs,
    )  # fmt: skip
    zeroed: tuple[str, ...] = ()
    if lp.config.mode == "split":  # its scratch, as the split forward's
        outputs += (("part_ptr", (n_rows * lp.splits * 2,), _STATS), ("arrived_ptr", (n_rows,), "int32"))
        constants["n_splits"] = lp.splits
        zeroed = ("arrived_ptr",)
    cfg = lp.config
    return Launch(lp.kernel, lp.grid, inputs, outputs, tuple(constants.items()), cfg.num_warps,
                  cfg.num_stages, zeroed)  # fmt: skip
