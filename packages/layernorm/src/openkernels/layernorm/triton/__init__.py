"""Triton launchers of the layernorm family (ops.py's docstring gives the backend contract:
the entries' arguments, their shapes and dtypes). `config`, a configs.NormConfig, overrides
the launch plan's choice (tests)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared import opdef, replay
from openkernels.shared.launch import launch
from openkernels.shared.platform import device_info, graph_capturing

from . import kernels
from .configs import SUM_BLOCK_C, SUM_BLOCK_P, SUM_WARPS
from .plan import plan as launch_plan

__all__ = ["norm_fwd", "norm_bwd"]


def _aligned(n_cols: int, *tensors: torch.Tensor | None) -> bool:
    """What Triton specializes on at launch: sizes and strides divisible by 16."""
    return n_cols % 16 == 0 and all(t is None or t.stride(0) % 16 == 0 for t in tensors)


# The forward kernels' runtime parameters, in the tile and looped kernels' order.
_FWD_ARG_NAMES = ("x_ptr", "res_ptr", "w_ptr", "b_ptr", "out_ptr", "res_out_ptr", "mean_ptr", "rstd_ptr", "n_rows",
                  "n_cols", "stride_x", "stride_res", "stride_out", "stride_res_out", "eps", "weight_offset")  # fmt: skip


@functools.cache
def _device_state(index: int) -> tuple[str, int]:
    """(backend, SM count) of the device a tensor's get_device() names: -1 is the CPU (the
    interpreter runs programs one after another there: a few are enough)."""
    if index < 0:
        return "cpu", 4
    return device_info(torch.device("cuda", index)).backend, torch.cuda.get_device_properties(
        index
    ).multi_processor_count


@functools.cache
def _dtype_token(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor whose pointer type tells the kernel the residual stream's dtype
    when nothing is stored."""
    return replay.persistent(torch.zeros(1, dtype=dtype, device=device))  # replayed launches pass it


# The split kernels' per-row arrival counters, per (device, stream), zeroed once when made:
# the kernels leave every counter at 0 (kernels._leave_row), and launches on one stream run
# one after another. Held for good, so replayed launches (shared.replay) can name them: a
# fill kernel per call would keep long-row calls on the Python path.
_counters: dict[tuple[int, int], torch.Tensor] = {}
_MIN_COUNTERS = 4096


def _arrival_counters(device: torch.device, n_rows: int) -> torch.Tensor:
    """int32 zeros, at least n_rows of them, for one split launch on the current stream."""
    index = device.index if device.type == "cuda" else -1
    if index >= 0 and (opdef.library_call() or graph_capturing(device)):
        # torch.compile graphs and CUDA-graph captures: a temporary (its zeroing is captured
        # and replays); a buffer kept from here would live in the graph's private pool.
        return torch.zeros(n_rows, dtype=torch.int32, device=device)
    key = (index, torch._C._cuda_getCurrentRawStream(index) if index >= 0 else 0)
    held = _counters.get(key)
    if held is None or held.numel() < n_rows:
        # An outgrown buffer stays alive (replay.persistent): recordings may still name it.
        held = replay.persistent(torch.zeros(max(n_rows, _MIN_COUNTERS), dtype=torch.int32, device=device))
        _counters[key] = held
    return held


def norm_fwd(
    x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset, rms, h_dtype, config=None
) -> None:
    n_rows, n_cols = x.shape
    backend, sm_count = _device_state(x.get_device())
    aligned = _aligned(n_cols, x, residual)
    plan = launch_plan("fwd", n_rows, n_cols, x.dtype, backend, aligned, rms, sm_count, config)
    cfg = plan.config
    # Absent tensors are stand-ins the kernel's flags keep it from touching. Positional, in
    # the kernels' parameter order (binding by name costs host time on every call).
    args = (
        x, x if residual is None else residual, x if weight is None else weight, x if bias is None else bias, out,
        residual_out if residual_out is not None else _dtype_token(h_dtype, x.device),
        rstd if mean is None else mean, rstd,
        n_rows, n_cols, x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0), eps, weight_offset,
    )  # fmt: skip
    flags = dict(IS_RMS=rms, HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=residual_out is not None,
                 HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)  # fmt: skip
    kernel = getattr(kernels, plan.kernel)
    if cfg.mode == "split":  # its parameters come in another order: by name
        flags.update(zip(_FWD_ARG_NAMES, args))
        flags["part_ptr"] = torch.empty(n_rows * plan.splits * 2, dtype=torch.float32, device=x.device)
        flags["arrived_ptr"] = _arrival_counters(x.device, n_rows)
        flags["n_splits"] = plan.splits
        args = ()
    launch(
        kernel,
        plan.grid,
        *args,
        **flags,
        **plan.constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def norm_bwd(
    dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias, *, weight_offset, rms, config=None
) -> None:
    n_rows, n_cols = h.shape
    backend, sm_count = _device_state(h.get_device())
    aligned = _aligned(n_cols, dy, h, dh_out)
    # The wider of dy and h sizes the split kernel's chunk per thread.
    wider = dy.dtype if dy.element_size() > h.element_size() else h.dtype
    plan = launch_plan("bwd", n_rows, n_cols, wider, backend, aligned, rms, sm_count, config)
    dw_part = db_part = rstd
    if dweight is not None:
        dw_part = torch.empty((plan.programs, n_cols), dtype=torch.float32, device=h.device)
    if dbias is not None:
        db_part = torch.empty((plan.programs, n_cols), dtype=torch.float32, device=h.device)
    split = {}
    if plan.config.mode == "split":  # scratch of the split kernel, as the forward's
        split = dict(part_ptr=torch.empty(n_rows * plan.splits * 2, dtype=torch.float32, device=h.device),
                     arrived_ptr=_arrival_counters(h.device, n_rows), n_splits=plan.splits)  # fmt: skip
    launch(
        getattr(kernels, plan.kernel), plan.grid, **split, dy_ptr=dy, h_ptr=h, w_ptr=h if weight is None else weight, mean_ptr=rstd if mean is None else mean,
        rstd_ptr=rstd, dh_out_ptr=dh if dh_out is None else dh_out, dh_ptr=dh, dw_part_ptr=dw_part,
        db_part_ptr=db_part,
        n_rows=n_rows, n_cols=n_cols, stride_dy=dy.stride(0), stride_h=h.stride(0),
        stride_dh_out=0 if dh_out is None else dh_out.stride(0), stride_dh=dh.stride(0),
        rows_per_program=plan.rows_per_program, weight_offset=weight_offset,
        IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_DH_OUT=dh_out is not None,
        WEIGHT_GRAD=dweight is not None, BIAS_GRAD=dbias is not None, **plan.constexprs,
        num_warps=plan.config.num_warps, num_stages=plan.config.num_stages,
    )  # fmt: skip
    # A fixed-order sum over the program axis: deterministic, unlike atomics; a kernel of our
    # own rather than torch.sum, so that the whole backward is launches (shared.replay).
    for part, total in ((dw_part, dweight), (db_part, dbias)):
        if total is not None:
            _sum_parts(part, total)


def _sum_parts(part: torch.Tensor, total: torch.Tensor) -> None:
    """total (n_cols,), any float dtype = part (programs, n_cols) float32 summed over programs."""
    n_parts, n_cols = part.shape
    launch(kernels._sum_parts_kernel, (triton.cdiv(n_cols, SUM_BLOCK_C),), part, total, n_parts, n_cols,
           BLOCK_P=SUM_BLOCK_P, BLOCK_C=SUM_BLOCK_C, EVEN_P=n_parts % SUM_BLOCK_P == 0,
           num_warps=SUM_WARPS)  # fmt: skip
