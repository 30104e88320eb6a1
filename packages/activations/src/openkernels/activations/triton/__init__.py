"""Triton launchers of the activations family (see ops.py for the backend contract)."""

from __future__ import annotations

import functools

import torch

from openkernels.shared.launch import launch
from openkernels.shared.platform import device_info

from .kernels import (
    _activation_bwd_kernel,
    _activation_fwd_kernel,
    _gated_activation_bwd_kernel,
    _gated_activation_fwd_kernel,
)
from .plan import launch_plan

__all__ = ["unary_fwd", "unary_bwd", "gated_fwd", "gated_bwd"]


def _grid(x: torch.Tensor, n_rows: int, n_cols: int):
    return launch_plan(n_rows, n_cols, x.dtype, _backend(x.device))


@functools.cache
def _backend(device: torch.device) -> str:
    return device_info(device).backend


def unary_fwd(x: torch.Tensor, out: torch.Tensor, act: int) -> None:
    n_rows, n_cols = out.shape
    cfg, grid, even = _grid(x, n_rows, n_cols)
    launch(
        _activation_fwd_kernel, grid, x, out, n_rows, n_cols, x.stride(0), out.stride(0),
        ACT=act, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, EVEN=even,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def unary_bwd(grad_out: torch.Tensor, x: torch.Tensor, grad_in: torch.Tensor, act: int) -> None:
    n_rows, n_cols = grad_in.shape
    cfg, grid, even = _grid(x, n_rows, n_cols)
    launch(
        _activation_bwd_kernel, grid, grad_out, x, grad_in, n_rows, n_cols, grad_out.stride(0), x.stride(0), grad_in.stride(0),
        ACT=act, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, EVEN=even,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def gated_fwd(x: torch.Tensor, out: torch.Tensor, act: int, *, act_first: bool) -> None:
    n_rows, n_cols = out.shape
    cfg, grid, even = _grid(x, n_rows, n_cols)
    launch(
        _gated_activation_fwd_kernel, grid, x, out, n_rows, n_cols, x.stride(0), out.stride(0),
        ACT=act, ACT_FIRST=act_first, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, EVEN=even,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def gated_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, grad_in: torch.Tensor, act: int, *, act_first: bool
) -> None:
    n_rows, n_cols = grad_out.shape
    cfg, grid, even = _grid(x, n_rows, n_cols)
    launch(
        _gated_activation_bwd_kernel, grid, grad_out, x, grad_in, n_rows, n_cols, grad_out.stride(0), x.stride(0), grad_in.stride(0),
        ACT=act, ACT_FIRST=act_first, BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, EVEN=even,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
