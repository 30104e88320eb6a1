"""Triton launchers of the layernorm family (see ops.py for the backend contract)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared.platform import device_info

from .configs import MAX_SPLITS, NormConfig, launch_config
from .kernels import _norm_bwd_kernel, _norm_fwd_kernel, _norm_fwd_looped_kernel, _norm_fwd_split_kernel

__all__ = ["norm_fwd", "norm_bwd"]


@functools.cache
def _config(
    n_cols: int, dtype: torch.dtype, device: torch.device, direction: str, aligned: bool, rms: bool
) -> NormConfig:
    return launch_config(n_cols, dtype, device_info(device).backend, direction, aligned, rms)


def _aligned(n_cols: int, *tensors: torch.Tensor | None) -> bool:
    """What Triton specializes on at launch: sizes and strides divisible by 16."""
    return n_cols % 16 == 0 and all(t is None or t.stride(0) % 16 == 0 for t in tensors)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another: a few are enough


def _programs(blocks: int, cfg: NormConfig, device: torch.device) -> int:
    return (
        blocks if cfg.programs_per_sm == 0 else max(1, min(blocks, _sm_count(device) * cfg.programs_per_sm))
    )


@functools.cache
def _dtype_token(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor whose pointer type tells the kernel the residual stream's dtype
    when nothing is stored."""
    return torch.zeros(1, dtype=dtype, device=device)


def norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    residual_out: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    *,
    eps: float,
    weight_offset: float,
    rms: bool,
    h_dtype: torch.dtype,
    config: NormConfig | None = None,
) -> None:
    n_rows, n_cols = x.shape
    cfg = config or _config(n_cols, x.dtype, x.device, "fwd", _aligned(n_cols, x, residual), rms)
    res_out = residual_out if residual_out is not None else _dtype_token(h_dtype, x.device)
    tensors = (
        x, x if residual is None else residual, x if weight is None else weight, x if bias is None else bias,
        out, res_out, rstd if mean is None else mean, rstd,
    )  # fmt: skip
    sizes_strides = (
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0),
    )  # fmt: skip
    flags = dict(
        IS_RMS=rms, HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=residual_out is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if cfg.mode == "tile":
        grid = (_programs(triton.cdiv(n_rows, cfg.block_rows), cfg, x.device),)
        _norm_fwd_kernel[grid](
            *tensors, n_rows, n_cols, *sizes_strides, eps, weight_offset,
            EVEN_C=n_cols == cfg.block_cols, PERSISTENT=cfg.programs_per_sm > 0, PREFETCH=cfg.prefetch,
            BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, **flags,
        )  # fmt: skip
    elif cfg.mode == "split":
        splits = triton.cdiv(n_cols, cfg.block_cols)
        if splits > MAX_SPLITS or (splits > 1 and x.device.type != "cuda"):
            # Its programs wait for each other: more than fit at once (or the interpreter,
            # which runs them one by one) would never finish.
            raise ValueError(f"the split kernel cannot run {splits} splits per row on {x.device}")
        partials = torch.empty(n_rows * splits * 2, dtype=torch.float32, device=x.device)
        arrived = torch.zeros(n_rows, dtype=torch.int32, device=x.device)
        _norm_fwd_split_kernel[(n_rows * splits,)](
            *tensors, partials, arrived, n_rows, n_cols, splits, *sizes_strides, eps, weight_offset,
            BLOCK_C=cfg.block_cols, MAX_SPLITS=triton.next_power_of_2(splits), **flags,
        )  # fmt: skip
    else:
        _norm_fwd_looped_kernel[(n_rows,)](
            *tensors, n_rows, n_cols, *sizes_strides, eps, weight_offset, BLOCK_C=cfg.block_cols, **flags,
        )  # fmt: skip


def norm_bwd(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    dh_out: torch.Tensor | None,
    dh: torch.Tensor,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None,
    *,
    weight_offset: float,
    rms: bool,
    config: NormConfig | None = None,
) -> None:
    n_rows, n_cols = h.shape
    cfg = config or _config(n_cols, h.dtype, h.device, "bwd", _aligned(n_cols, dy, h, dh_out), rms)
    # Every program gets at least one row, so every partial row is written.
    rows_per_program = triton.cdiv(n_rows, _programs(n_rows, cfg, h.device))
    if not cfg.looped:
        rows_per_program = triton.cdiv(rows_per_program, cfg.block_rows) * cfg.block_rows
    programs = triton.cdiv(n_rows, rows_per_program)
    dw_part = db_part = rstd
    if dweight is not None:
        dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=h.device)
    if dbias is not None:
        db_part = torch.empty((programs, n_cols), dtype=torch.float32, device=h.device)
    _norm_bwd_kernel[(programs,)](
        dy, h, h if weight is None else weight, rstd if mean is None else mean, rstd,
        dh if dh_out is None else dh_out, dh, dw_part, db_part,
        n_rows, n_cols, dy.stride(0), h.stride(0), 0 if dh_out is None else dh_out.stride(0), dh.stride(0),
        rows_per_program, weight_offset,
        IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_DH_OUT=dh_out is not None,
        WEIGHT_GRAD=dweight is not None, BIAS_GRAD=dbias is not None, LOOPED=cfg.looped,
        EVEN_C=n_cols == cfg.block_cols, PREFETCH=cfg.prefetch, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    # A fixed-order sum over the program axis: deterministic, unlike atomics.
    if dweight is not None:
        torch.sum(dw_part, dim=0, out=dweight)
    if dbias is not None:
        torch.sum(db_part, dim=0, out=dbias)
