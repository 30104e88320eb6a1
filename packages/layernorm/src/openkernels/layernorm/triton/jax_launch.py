"""The layernorm kernels' launches as JAX makes them, described without JAX.

openkernels.layernorm.jax launches these through `openkernels.shared.jax.launch`, and
tests/test_aot.py compiles the same descriptions for GPUs this machine lacks. Under JAX
every array is contiguous (row stride = n_cols) and every integer and float argument is a
compile-time constant; the kernel, config and grid come from the same plans as the
PyTorch launchers (`configs.fwd_plan` / `configs.bwd_plan`).

Absent arrays are stand-ins the kernel's flags keep it from touching: an input slot takes
another input (as the PyTorch launchers do), an output slot a one-element array.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import bwd_plan, fwd_plan

__all__ = ["Launch", "fwd_launch", "bwd_launch"]

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
    plan = fwd_plan(n_rows, n_cols, getattr(torch, dtype), vendor, _aligned(n_cols), rms, sm_count)
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
        HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, **plan.constexprs,
    )  # fmt: skip
    zeroed: tuple[str, ...] = ()
    if plan.config.mode == "split":
        # Scratch of the split kernel: partial statistics, and per-row arrival counters
        # that must start at zero (the PyTorch launcher zeroes them too).
        outputs += [("part_ptr", (n_rows * plan.splits * 2,), _STATS), ("arrived_ptr", (n_rows,), "int32")]
        constants["n_splits"] = plan.splits
        zeroed = ("arrived_ptr",)
    cfg = plan.config
    return Launch(plan.kernel, plan.grid, inputs, tuple(outputs), tuple(constants.items()), cfg.num_warps,
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
    plan = bwd_plan(n_rows, n_cols, getattr(torch, h_dtype), vendor, _aligned(n_cols), rms, sm_count)
    parts = (plan.programs, n_cols)
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
        rows_per_program=plan.rows_per_program, weight_offset=float(weight_offset),
        IS_RMS=rms, HAS_WEIGHT=has_weight, HAS_DH_OUT=has_dh_out, WEIGHT_GRAD=weight_grad,
        BIAS_GRAD=bias_grad, **plan.constexprs,
    )  # fmt: skip
    cfg = plan.config
    return Launch("_norm_bwd_kernel", plan.grid, inputs, outputs, tuple(constants.items()), cfg.num_warps,
                  cfg.num_stages)  # fmt: skip
