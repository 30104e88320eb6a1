"""Triton launchers of the quant family (the backend contract is in reference.py)."""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

from openkernels.shared.platform import device_info, triton_interpreting

from ..format import nf4_values
from ..ops import LIBRARY_CALL
from .configs import LinearConfig, arch_family, dequant_block, kernel_group, linear_config
from .fastlaunch import launch
from .kernels import _dequantize_int4_fwd_kernel, _int4_linear_fwd_kernel, _int4_linear_gemv_fwd_kernel

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


# Split-K scratch, per (device, stream): float32 partials and per-tile arrival counters. The
# kernels leave every counter at 0 when they finish, so the counters are zeroed only when made.
_scratch: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index) if device_index >= 0 else 0


def _split_scratch(device: torch.device, partials: int, tiles: int) -> tuple[Tensor, Tensor]:
    index = device.index if device.type == "cuda" else -1
    if index >= 0 and (LIBRARY_CALL.get() or torch.cuda.is_current_stream_capturing()):
        # Inside torch.compile graphs or a CUDA-graph capture: temporaries (the zeroing is
        # captured and replays). A cached buffer made there would live on in the graph's
        # private pool, which CUDA-graph trees reject ("tensors in the cudagraph pool not
        # tracked as outputs").
        return (torch.empty(partials, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
    key = (index, _current_stream(index))
    ws, counters = _scratch.get(key, (None, None))
    if ws is None or ws.numel() < partials:
        ws = torch.empty(max(partials, 1 << 20), dtype=torch.float32, device=device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    _scratch[key] = (ws, counters)
    return ws, counters


def dequantize_int4_fwd(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, out: Tensor, group_size: int, kind: str
) -> None:
    n, k = out.shape
    block_n, block_k, warps = dequant_block(group_size, k)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    args = (qweight, scales, scales if zeros is None else zeros, _lut(kind, scales), out,
            n, k, qweight.stride(0), scales.stride(0), out.stride(0))  # fmt: skip
    flags = dict(GROUP=kernel_group(group_size, k), BLOCK_N=block_n, BLOCK_K=block_k, HAS_ZEROS=zeros is not None,
                 NF4=kind == "nf4")  # fmt: skip
    static = ("dequant", n, k, qweight.stride(0), scales.stride(0), out.stride(0), out.dtype, scales.dtype, kind,
              zeros is None, group_size)  # fmt: skip
    launch(_dequantize_int4_fwd_kernel, grid, args, flags, warps, 1, static)


def _k_per_split(k: int, cfg: LinearConfig) -> tuple[int, int]:
    """(K columns per split, a whole number of BLOCK_K steps; splits actually used)."""
    steps = triton.cdiv(k, cfg.block_k)
    per = triton.cdiv(steps, cfg.split_k) * cfg.block_k
    return per, triton.cdiv(k, per)


class _Plan:
    """Everything about one int4_linear launch that depends only on shapes, dtypes, strides
    and flags, computed once (host time is what M=1 decode pays per layer)."""

    def __init__(self, cfg: LinearConfig, m: int, n: int, k: int, group_size: int, kind: str, device: torch.device,
                 has_zeros: bool, has_bias: bool, key: tuple) -> None:  # fmt: skip
        per_split, splits = _k_per_split(k, cfg)
        self.cfg, self.m, self.n, self.k, self.device = cfg, m, n, k, device
        self.gemv = cfg.path == "gemv"
        self.per_split, self.splits = per_split, splits
        rows = 1 if self.gemv else m
        self.tiles = triton.cdiv(n, cfg.block_n) * (1 if self.gemv else triton.cdiv(m, cfg.block_m))
        self.partials = splits * rows * n
        self.grid = (triton.cdiv(n, cfg.block_n) if self.gemv else self.tiles, splits)
        self.flags = dict(
            GROUP=kernel_group(group_size, k), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_ZEROS=has_zeros,
            NF4=kind == "nf4", HAS_BIAS=has_bias, SPLIT_K=splits, EVEN_K=k % cfg.block_k == 0,
        )  # fmt: skip
        if not self.gemv:
            # Constexprs in parameter order (the direct launch passes them positionally).
            self.flags = dict(
                GROUP=self.flags["GROUP"], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_N=cfg.group_n, HAS_ZEROS=has_zeros, NF4=kind == "nf4", HAS_BIAS=has_bias, SPLIT_K=splits,
                EVEN_K=self.flags["EVEN_K"], BITCAST=not (triton_interpreting() and key[5] == torch.bfloat16),
                SWAP_AB=cfg.swap_ab,
                UNROLL=cfg.unroll,
            )  # fmt: skip
        self.key = key

    def __call__(self, x: Tensor, weight: tuple, out: Tensor, qw_stride: int, s_stride: int) -> None:
        cfg = self.cfg
        ws, counters = (
            _split_scratch(self.device, self.partials, self.tiles) if self.splits > 1 else (out, out)
        )
        if self.gemv:
            for row in range(self.m):  # the table sends M == 1 here; a forced config may send more
                args = (
                    x[row],
                    *weight,
                    out[row],
                    ws,
                    counters,
                    self.n,
                    self.k,
                    self.per_split,
                    qw_stride,
                    s_stride,
                )
                launch(_int4_linear_gemv_fwd_kernel, self.grid, args, self.flags, cfg.num_warps, cfg.num_stages,
                       self.key)  # fmt: skip
            return
        args = (x, *weight, out, ws, counters, self.m, self.n, self.k, self.per_split, x.stride(0), qw_stride, s_stride,
                out.stride(0))  # fmt: skip
        launch(_int4_linear_fwd_kernel, self.grid, args, self.flags, cfg.num_warps, cfg.num_stages, self.key)


_plans: dict[tuple, _Plan] = {}
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
    config: LinearConfig | None = None,
) -> None:
    """out (M, N) = x (M, K) @ W^T + bias. `config` overrides the table (tuning sweeps)."""
    m, k = x.shape
    n = qweight.shape[0]
    qw_stride, s_stride = qweight.stride(0), scales.stride(0)
    key = (m, n, k, group_size, kind, x.dtype, scales.dtype, zeros is None, None if bias is None else bias.dtype,
           x.stride(0), out.stride(0), qw_stride, s_stride, x.get_device(), config)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:  # many distinct M (ragged prefill batches): start over
            _plans.clear()
        cfg = config or config_for(m, n, k, group_size, x.device)
        if cfg.path == "dequant":
            _dequantize_then_matmul(x, qweight, scales, zeros, bias, out, group_size, kind)
            return
        plan = _plans[key] = _Plan(cfg, m, n, k, group_size, kind, x.device, zeros is not None, bias is not None,
                                   key)  # fmt: skip
    weight = (
        qweight,
        scales,
        scales if zeros is None else zeros,
        _lut(kind, scales),
        scales if bias is None else bias,
    )
    plan(x, weight, out, qw_stride, s_stride)


def _dequantize_then_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bias: Tensor | None,
                            out: Tensor, group_size: int, kind: str) -> None:  # fmt: skip
    """Large M: W (N, K) in x's dtype once, then the vendor GEMM."""
    w = torch.empty((qweight.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    dequantize_int4_fwd(qweight, scales, zeros, w, group_size, kind)
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias.to(x.dtype), x, w.t(), out=out)
