"""Launches of the layernorm Triton kernels from JAX (jax-triton on GPUs, the Triton
interpreter in tests), with the launch plans of the PyTorch path (triton/plan.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from openkernels.shared import jax as okjax

from ..triton.plan import bwd_launch, fwd_launch

if TYPE_CHECKING:
    from . import _Spec as Spec

__all__ = ["forward", "backward"]


@functools.cache
def _gpu_sm_count() -> int:
    # Only the size of the persistent grids depends on it; 132 (H100/H200) where the
    # device does not say.
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _target() -> tuple[str, int]:
    """(vendor, SM count) the launch plans are made for."""
    if okjax.backend() == "triton":
        return okjax.gpu_vendor(), _gpu_sm_count()
    return "cpu", 4  # the interpreter, planned as the PyTorch launchers plan CPU tensors


def _run(launch, arrays: dict) -> dict:
    """Launch a `plan.Launch` on the arrays named by its input roles; returns its
    outputs by pointer name."""
    from ..triton import kernels  # imports triton: only when a kernel runs

    outputs = {p: jax.ShapeDtypeStruct(shape, jnp.dtype(dt)) for p, shape, dt in launch.outputs}
    results = okjax.launch(
        getattr(kernels, launch.kernel),
        grid=launch.grid,
        inputs={p: arrays[role] for p, role in launch.inputs},
        outputs=outputs,
        constants=dict(launch.constants),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        zeroed=launch.zeroed,
    )
    return dict(zip(outputs, results))


def forward(spec: Spec, x, weight, bias, residual, store: bool):
    x2, n_rows, n_cols = okjax.row_view(x)
    vendor, sm_count = _target()
    launch = fwd_launch(
        n_rows, n_cols, dtype=x.dtype.name, out_dtype=spec.out_dtype.name, h_dtype=spec.h_dtype.name,
        rms=spec.rms, has_residual=residual is not None, store_residual=store, has_weight=weight is not None,
        has_bias=bias is not None, eps=spec.eps, weight_offset=spec.weight_offset, vendor=vendor,
        sm_count=sm_count,
    )  # fmt: skip
    arrays = {"x": x2, "residual": None if residual is None else residual.reshape(n_rows, n_cols),
              "weight": weight, "bias": bias}  # fmt: skip
    out = _run(launch, arrays)
    stats = x.shape[:-1]
    h = out["res_out_ptr"].reshape(x.shape) if store else None
    mean = None if spec.rms else out["mean_ptr"].reshape(stats)
    return out["out_ptr"].reshape(x.shape), h, mean, out["rstd_ptr"].reshape(stats)


def backward(spec: Spec, dy, dh_out, h, weight, mean, rstd, weight_grad: bool, bias_grad: bool):
    h2, n_rows, n_cols = okjax.row_view(h)
    vendor, sm_count = _target()
    launch = bwd_launch(
        n_rows, n_cols, h_dtype=h.dtype.name, rms=spec.rms, has_weight=weight is not None,
        has_dh_out=dh_out is not None, weight_grad=weight_grad, bias_grad=bias_grad,
        weight_offset=spec.weight_offset, vendor=vendor, sm_count=sm_count,
    )  # fmt: skip
    arrays = {
        "dy": dy.reshape(n_rows, n_cols), "h": h2, "weight": weight, "rstd": rstd.reshape(n_rows),
        "mean": None if mean is None else mean.reshape(n_rows),
        "dh_out": None if dh_out is None else dh_out.reshape(n_rows, n_cols),
    }  # fmt: skip
    out = _run(launch, arrays)
    # A fixed-order sum of the per-program partial rows, as the PyTorch launcher does.
    dw = jnp.sum(out["dw_part_ptr"], axis=0) if weight_grad else None
    db = jnp.sum(out["db_part_ptr"], axis=0) if bias_grad else None
    return out["dh_ptr"].reshape(h.shape), dw, db
