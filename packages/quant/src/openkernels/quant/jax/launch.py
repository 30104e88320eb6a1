"""Launches of the quant Triton kernels from JAX (jax-triton on GPUs, the Triton interpreter
in tests), with the PyTorch path's launch configs and plans (triton/configs.py,
triton/plan.py): the tiled kernel with split-K from M = 1, the dequantize kernel (its result
goes to XLA's GEMM from M = 512)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from ..format import NF4_VALUES

if TYPE_CHECKING:  # the triton package imports Triton: only where a launch needs it
    from ..triton.configs import LinearConfig

__all__ = ["config", "dequantize", "linear"]


@functools.cache
def _gpu_family() -> tuple[str, int]:
    """(arch family, SM / CU count) of JAX's first GPU, as configs.linear_config takes them."""
    from ..triton.configs import arch_family

    device = jax.devices()[0]
    arch = "sm_" + str(getattr(device, "compute_capability", "0.0")).replace(".", "")
    return arch_family(okjax.gpu_vendor(), arch), int(getattr(device, "core_count", 0) or 132)


def config(m: int, n: int, k: int, group_size: int, kind: str = "int4") -> LinearConfig:
    """The launch config of the tables for this shape on the current backend (JAX arrays are
    contiguous and aligned: the codes can always be read as words)."""
    from ..triton import config_for
    from ..triton.configs import linear_config

    if okjax.backend() == "interpret":  # what the PyTorch launcher picks under the interpreter
        import torch

        return config_for(m, n, k, group_size, torch.device("cpu"), kind)
    return linear_config(m, n, k, group_size, *_gpu_family(), kind)


def _shuffle() -> bool:
    """NF4 levels by a warp shuffle (plan.nf4_shuffle): jax-triton on an NVIDIA GPU."""
    from ..triton.plan import nf4_shuffle

    return nf4_shuffle(okjax.gpu_vendor(), okjax.backend() == "interpret")


def _launch(plan: Any, arrays: dict, outputs: dict, ints: dict, zeroed: tuple = ()) -> tuple:
    """One launch of a plan.py plan: its inputs from `arrays` (the scales where the kernel
    reads nothing: jax-triton binds arrays by position), absent scratch pointers as None."""
    from ..triton import kernels

    inputs, _, absent = plan.pointers()
    arrays = {**arrays, **dict.fromkeys(plan.stand_ins(), arrays["s_ptr"])}
    return okjax.launch(
        getattr(kernels, plan.kernel),
        grid=plan.grid,
        inputs={p: arrays[p] for p in inputs},
        outputs=outputs,
        constants={**ints, **dict.fromkeys(absent), **plan.flags},
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        zeroed=zeroed,
    )


def _weight_arrays(qweight, scales, zeros, bias, kind: str) -> dict:
    """The weight-side pointers by kernel parameter name (None where absent)."""
    lut = jnp.asarray(NF4_VALUES, jnp.float32) if kind == "nf4" else None
    return {"qw_ptr": qweight, "s_ptr": scales, "z_ptr": zeros, "lut_ptr": lut, "bias_ptr": bias}


def dequantize(qweight, scales, zeros, group_size: int, kind: str, dtype: Any) -> jax.Array:
    """W (N, K) in `dtype` (float16, bfloat16 or float32) by the dequantize kernel."""
    from ..triton.plan import dequant_plan

    n, k = qweight.shape[0], 2 * qweight.shape[1]
    plan = dequant_plan(n, k, group_size, kind, has_zeros=zeros is not None, shuffle=_shuffle())
    arrays = _weight_arrays(qweight, scales, zeros, None, kind)
    outputs = {"out_ptr": jax.ShapeDtypeStruct((n, k), dtype)}
    (w,) = _launch(plan, arrays, outputs, plan.int_args(k // 2, n, k))
    return w


def linear(x2, qweight, scales, zeros, bias, group_size: int, kind: str, cfg: LinearConfig) -> jax.Array:
    """x2 (M, K) float16 / bfloat16 @ W^T (+ bias) -> (M, N) by the GEMV or tiled kernel of `cfg`."""
    from ..triton.plan import linear_plan

    (m, k), n = x2.shape, qweight.shape[0]
    bitcast = not (okjax.backend() == "interpret" and x2.dtype == jnp.bfloat16)  # as triton/__init__.py
    plan = linear_plan(cfg, m, n, k, group_size, kind, has_zeros=zeros is not None, has_bias=bias is not None,
                       bitcast=bitcast, shuffle=_shuffle())  # fmt: skip
    arrays = _weight_arrays(qweight, scales, zeros, bias, kind)
    outputs = {"out_ptr": jax.ShapeDtypeStruct((n,) if plan.gemv else (m, n), x2.dtype)}
    if plan.splits > 1:  # split-K scratch: partials, and arrival counters that start at 0
        outputs["ws_ptr"] = jax.ShapeDtypeStruct((plan.partials,), jnp.float32)
        outputs["counter_ptr"] = jax.ShapeDtypeStruct((plan.tiles,), jnp.int32)
    zeroed = ("counter_ptr",) if plan.splits > 1 else ()
    ints = plan.int_args(k, k // 2, n, n)  # JAX arrays are contiguous: row strides are widths
    if plan.gemv:  # one row per launch, as the PyTorch launcher
        rows = [_launch(plan, {**arrays, "x_ptr": x2[r]}, outputs, ints, zeroed)[0] for r in range(m)]
        return jnp.stack(rows)
    return _launch(plan, {**arrays, "x_ptr": x2}, outputs, ints, zeroed)[0]
