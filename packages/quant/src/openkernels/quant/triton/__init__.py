"""Triton launchers of the quant family (the backend contract is in reference.py)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from openkernels.shared import opdef, replay
from openkernels.shared.launch import launch
from openkernels.shared.platform import device_info, graph_capturing, triton_interpreting

from ..format import nf4_values
from .configs import LinearConfig, arch_family, linear_config
from .kernels import _dequantize_int4_fwd_kernel, _int4_linear_fwd_kernel, _int4_linear_gemv_fwd_kernel
from .plan import dequant_plan, linear_plan, nf4_shuffle

__all__ = ["int4_linear_fwd", "dequantize_int4_fwd", "config_for", "reserve_graph_scratch"]


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
def config_for(
    m: int, n: int, k: int, group: int, device: torch.device, kind: str = "int4", words: bool = True
) -> LinearConfig:
    return linear_config(m, n, k, group, _family(device), _sm_count(device), kind, words)


def _shuffle(device: torch.device) -> bool:
    """NF4 levels by a warp shuffle on this device (plan.nf4_shuffle): an NVIDIA GPU
    (torch.version.hip is None), not under the Triton interpreter."""
    return nf4_shuffle(device_info(device).backend, triton_interpreting())


def _lut(kind: str, scales: Tensor) -> Tensor:
    """The NF4 levels (float32) for nf4; any pointer otherwise (never read)."""
    return nf4_values(scales.device) if kind == "nf4" else scales


# Split-K scratch, per (device, stream): float32 partials and per-tile arrival counters. The
# kernels leave every counter at 0 when they finish, so the counters are zeroed only when made.
_scratch: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def _current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index) if device_index >= 0 else 0


# Split-K scratch for launches inside torch.compile graphs and CUDA-graph captures, per device,
# made outside them by reserve_graph_scratch (kernelize(quantize=...) calls it). One buffer
# for every such launch of the device: they must run one after another (one stream, as
# CUDA-graph trees replay), which the kernels' self-resetting counters then make safe.
_graph_scratch: dict[int, tuple[Tensor, Tensor]] = {}


# The default reserve: the Gluon wgmma kernel's largest split (gluon._split: up to 128 rows of
# x, split * N / 64 programs <= 264, so split * M * N <= 128 * 64 * 264 floats, 8.6 MB), which
# also covers every M=1 launch of the Triton kernels up to 65536 output features.
GRAPH_SCRATCH_PARTIALS = 128 * 64 * 264


def reserve_graph_scratch(
    device: torch.device, partials: int = GRAPH_SCRATCH_PARTIALS, tiles: int = 4096
) -> None:
    """Make (or grow) the split-K scratch that launches inside compiled graphs and CUDA-graph
    captures on `device` use: `partials` float32 and `tiles` int32 counters (the default
    covers every split the launchers pick: GRAPH_SCRATCH_PARTIALS). Without it such launches
    allocate and zero temporaries each call (a fill kernel per launch in the graph). No-op on
    a non-CUDA device or while capturing."""
    if device.type != "cuda" or graph_capturing(device):
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    ws, counters = _graph_scratch.get(index, (None, None))
    if ws is None or ws.numel() < partials:
        ws = replay.persistent(torch.empty(partials, dtype=torch.float32, device=device))
    if counters is None or counters.numel() < tiles:
        counters = replay.persistent(torch.zeros(tiles, dtype=torch.int32, device=device))
    _graph_scratch[index] = (ws, counters)


def split_scratch(device: torch.device, partials: int, tiles: int) -> tuple[Tensor, Tensor]:
    """(float32 partials, int32 counters) for a split-K launch on `device`: the Triton kernels'
    and the Gluon wgmma kernel's (one scratch per device and stream)."""
    index = device.index if device.type == "cuda" else -1
    if index >= 0 and (opdef.library_call() or graph_capturing(device)):
        # Inside torch.compile graphs or a CUDA-graph capture: the reserved scratch, or
        # temporaries (the zeroing is captured and replays). A cached buffer made here would
        # live on in the graph's private pool, which CUDA-graph trees reject ("tensors in the
        # cudagraph pool not tracked as outputs").
        held = _graph_scratch.get(index)
        if held is not None and held[0].numel() >= partials and held[1].numel() >= tiles:
            return held
        return (torch.empty(partials, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
    key = (index, _current_stream(index))
    ws, counters = _scratch.get(key, (None, None))
    # Replayed launches (shared.replay, keyed by stream) pass these addresses: held for good,
    # so a buffer outgrown here stays valid for the recordings that name it.
    if ws is None or ws.numel() < partials:
        ws = replay.persistent(torch.empty(max(partials, 1 << 20), dtype=torch.float32, device=device))
    if counters is None or counters.numel() < tiles:
        counters = replay.persistent(torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device))
    _scratch[key] = (ws, counters)
    return ws, counters


def dequantize_int4_fwd(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, out: Tensor, group_size: int, kind: str
) -> None:
    n, k = out.shape
    plan = dequant_plan(n, k, group_size, kind, has_zeros=zeros is not None, shuffle=_shuffle(out.device))
    ints = plan.int_args(qweight.stride(0), scales.stride(0), out.stride(0))
    args = (qweight, scales, scales if zeros is None else zeros, _lut(kind, scales), out, *ints.values())
    launch(_dequantize_int4_fwd_kernel, plan.grid, *args, num_warps=plan.num_warps, num_stages=plan.num_stages,
           **plan.flags)  # fmt: skip


class _Plan:
    """An int4_linear launch (plan.py) bound to its kernel and integer arguments, computed once
    per shape, dtype, stride and flag set (host time is what M=1 decode pays per layer)."""

    def __init__(self, cfg: LinearConfig, m: int, n: int, k: int, group_size: int, kind: str, device: torch.device,
                 has_zeros: bool, has_bias: bool, strides: tuple[int, int, int, int], key: tuple) -> None:  # fmt: skip
        bitcast = not (triton_interpreting() and key[5] == torch.bfloat16)
        launch_plan = linear_plan(cfg, m, n, k, group_size, kind, has_zeros=has_zeros, has_bias=has_bias,
                                  bitcast=bitcast, shuffle=_shuffle(device))  # fmt: skip
        self.m, self.device, self.key = m, device, key
        self.gemv, self.grid, self.flags = launch_plan.gemv, launch_plan.grid, launch_plan.flags
        self.splits, self.partials, self.tiles = launch_plan.splits, launch_plan.partials, launch_plan.tiles
        self.num_warps, self.num_stages = launch_plan.num_warps, launch_plan.num_stages
        self.kernel = _int4_linear_gemv_fwd_kernel if self.gemv else _int4_linear_fwd_kernel
        self.ints = tuple(launch_plan.int_args(*strides).values())

    def __call__(self, x: Tensor, weight: tuple, out: Tensor) -> None:
        ws, counters = (
            split_scratch(self.device, self.partials, self.tiles) if self.splits > 1 else (out, out)
        )
        if self.gemv:
            for row in range(self.m):  # the table never sends M > 1 here; a forced config may
                args = (x[row], *weight, out[row], ws, counters, *self.ints)
                launch(
                    self.kernel,
                    self.grid,
                    *args,
                    num_warps=self.num_warps,
                    num_stages=self.num_stages,
                    **self.flags,
                )
            return
        args = (x, *weight, out, ws, counters, *self.ints)
        launch(
            self.kernel, self.grid, *args, num_warps=self.num_warps, num_stages=self.num_stages, **self.flags
        )


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
    """out (M, N) = x (M, K) @ W^T + bias. `config` overrides the table (tuning sweeps; its
    nf4_gather forces the NF4 table gather where the warp shuffle would run)."""
    m, k = x.shape
    n = qweight.shape[0]
    qw_stride, s_stride = qweight.stride(0), scales.stride(0)
    # The GEMV reads the codes as 32-bit words: rows 4-byte aligned (stride and address).
    words = qw_stride % 4 == 0 and qweight.data_ptr() % 4 == 0
    key = (m, n, k, group_size, kind, x.dtype, scales.dtype, zeros is None, None if bias is None else bias.dtype,
           x.stride(0), out.stride(0), qw_stride, s_stride, x.get_device(), config, words)  # fmt: skip
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:  # many distinct M (ragged prefill batches): start over
            _plans.clear()
        if config is not None and config.path == "gemv" and not words:
            raise ValueError(
                "int4_linear_fwd: the gemv config reads the codes as 32-bit words and needs qweight rows "
                f"4-byte aligned (row stride {qw_stride} bytes, address {qweight.data_ptr():#x})"
            )
        cfg = config or config_for(m, n, k, group_size, x.device, kind, words)
        if cfg.path == "dequant":
            _dequantize_then_matmul(x, qweight, scales, zeros, bias, out, group_size, kind)
            return
        strides = (x.stride(0), qw_stride, s_stride, out.stride(0))
        plan = _plans[key] = _Plan(cfg, m, n, k, group_size, kind, x.device, zeros is not None, bias is not None,
                                   strides, key)  # fmt: skip
    weight = (
        qweight,
        scales,
        scales if zeros is None else zeros,
        _lut(kind, scales),
        scales if bias is None else bias,
    )
    plan(x, weight, out)


def _dequantize_then_matmul(x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bias: Tensor | None,
                            out: Tensor, group_size: int, kind: str) -> None:  # fmt: skip
    """Large M: W (N, K) in x's dtype once, then the vendor GEMM."""
    w = torch.empty((qweight.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    dequantize_int4_fwd(qweight, scales, zeros, w, group_size, kind)
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias.to(x.dtype), x, w.t(), out=out)
