"""Triton launchers of the quant family (the backend contract is in reference.py)."""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from openkernels.shared.platform import device_info

from ..format import nf4_values
from .configs import LinearConfig, arch_family, dequant_block, kernel_group, linear_config
from .kernels import (
    _dequantize_int4_fwd_kernel,
    _int4_linear_fwd_kernel,
    _int4_linear_gemv_fwd_kernel,
    _int4_linear_reduce_kernel,
)

__all__ = ["int4_linear_fwd", "dequantize_int4_fwd", "config_for"]


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another: a few are enough


@functools.cache
def _family(device: torch.device) -> str:
    info = device_info(device)
    return arch_family(info.backend, info.arch)


@functools.cache
def config_for(m: int, n: int, k: int, group: int, device: torch.device) -> LinearConfig:
    return linear_config(m, n, k, group, _family(device), _sm_count(device))


def _lut(kind: str, scales: Tensor) -> Tensor:
    """The NF4 levels (float32) for nf4; any pointer otherwise (never read)."""
    return nf4_values(scales.device) if kind == "nf4" else scales


def dequantize_int4_fwd(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, out: Tensor, group_size: int, kind: str
) -> None:
    n, k = out.shape
    block_n, block_k = dequant_block(group_size, k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_int4_fwd_kernel[grid](
        qweight, scales, scales if zeros is None else zeros, _lut(kind, scales), out,
        n, k, qweight.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=zeros is not None, NF4=kind == "nf4",
        num_warps=4,
    )  # fmt: skip


def _reduce(partials: Tensor, bias: Tensor | None, out: Tensor) -> None:
    split, m, n = partials.shape
    block = 1024
    _int4_linear_reduce_kernel[(m, triton.cdiv(n, block))](
        partials, out if bias is None else bias, out, m, n, out.stride(0),
        SPLIT_K=split, BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
    )  # fmt: skip


def _k_per_split(k: int, cfg: LinearConfig) -> tuple[int, int]:
    """(K columns per split, a whole number of BLOCK_K steps; splits actually used)."""
    steps = triton.cdiv(k, cfg.block_k)
    per = triton.cdiv(steps, cfg.split_k) * cfg.block_k
    return per, triton.cdiv(k, per)


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
    config: LinearConfig | None = None,
) -> None:
    """out (M, N) = x (M, K) @ W^T + bias. `config` overrides the table (tuning sweeps)."""
    m, k = x.shape
    n = qweight.shape[0]
    cfg = config or config_for(m, n, k, group_size, x.device)
    if cfg.path == "dequant":
        w = torch.empty((n, k), dtype=x.dtype, device=x.device)
        dequantize_int4_fwd(qweight, scales, zeros, w, group_size, kind)
        if bias is None:
            torch.mm(x, w.t(), out=out)
        else:
            torch.addmm(bias.to(x.dtype), x, w.t(), out=out)
        return
    per_split, splits = _k_per_split(k, cfg)
    even_k = k % cfg.block_k == 0
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    common = dict(
        GROUP=kernel_group(group_size, k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_ZEROS=zeros is not None,
        NF4=kind == "nf4", HAS_BIAS=bias is not None, SPLIT_K=splits, EVEN_K=even_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    pointers = (x, qweight, scales, scales if zeros is None else zeros, _lut(kind, scales),
                scales if bias is None else bias, target)  # fmt: skip
    if cfg.path == "gemv":
        for row in range(m):  # the table sends M == 1 here; a forced config may send more
            row_target = target[row] if splits == 1 else target[:, row]
            row_ptrs = (x[row], *pointers[1:6], row_target.contiguous() if splits > 1 else row_target)
            _int4_linear_gemv_fwd_kernel[(triton.cdiv(n, cfg.block_n), splits)](
                *row_ptrs, n, k, per_split, qweight.stride(0), scales.stride(0), **common
            )
            if splits > 1:
                _reduce(row_ptrs[-1].view(splits, 1, n), bias, out[row : row + 1])
        return
    grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m), splits)
    _int4_linear_fwd_kernel[grid](
        *pointers, m, n, k, per_split, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, GROUP_N=cfg.group_n, **common,
    )  # fmt: skip
    if splits > 1:
        _reduce(target, bias, out)
