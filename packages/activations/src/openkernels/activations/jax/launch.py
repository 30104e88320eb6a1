"""Launches of the activations' Triton kernels from JAX (jax-triton on GPUs, the Triton
interpreter in tests), through the launch plan of the PyTorch path (triton/plan.py)."""

from __future__ import annotations

import jax

from openkernels.shared import jax as okjax

from ..spec import Act
from ..triton.plan import launch_plan

__all__ = ["forward", "backward"]


def _launch(
    kernel_name: str, inputs: dict, output: tuple[str, tuple[int, int]], n_cols: int, dtype, constants: dict
):
    """One kernel launch; n_cols is the output width d for gated ops, as from PyTorch."""
    from ..triton import kernels  # imports triton: only when a kernel runs

    vendor = okjax.gpu_vendor() if okjax.backend() == "triton" else "cuda"
    out_name, out_shape = output
    n_rows = out_shape[0]
    cfg, grid, even = launch_plan(n_rows, n_cols, okjax.torch_dtype(dtype), vendor)
    # JAX arrays are contiguous: every row stride is the row's width.
    strides = {f"stride_{name[: -len('_ptr')]}": a.shape[1] for name, a in inputs.items()}
    strides[f"stride_{out_name[: -len('_ptr')]}"] = out_shape[1]
    (out,) = okjax.launch(
        getattr(kernels, kernel_name),
        grid=grid,
        inputs=inputs,
        outputs={out_name: jax.ShapeDtypeStruct(out_shape, dtype)},
        constants={
            "n_rows": n_rows,
            "n_cols": n_cols,
            **strides,
            **constants,
            "BLOCK_R": cfg.block_rows,
            "BLOCK_C": cfg.block_cols,
            "EVEN": even,
        },
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def _constants(act: Act, gated: bool, act_first: bool) -> dict:
    return {"ACT": int(act), "ACT_FIRST": act_first} if gated else {"ACT": int(act)}


def forward(x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    """act(x) (..., n) or the gated op (..., 2d) -> (..., d) on the Triton kernels."""
    x2, n_rows, n_cols = okjax.row_view(x)
    d = n_cols // 2 if gated else n_cols
    kernel = "_gated_activation_fwd_kernel" if gated else "_activation_fwd_kernel"
    out = _launch(
        kernel, {"x_ptr": x2}, ("out_ptr", (n_rows, d)), d, x.dtype, _constants(act, gated, act_first)
    )
    return out.reshape(*x.shape[:-1], d) if x.ndim else out.reshape(())


def backward(dy: jax.Array, x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    """dx in x's shape and dtype, on the Triton kernels."""
    x2, n_rows, n_cols = okjax.row_view(x)
    dy2, _, d = okjax.row_view(dy.astype(x.dtype))
    kernel = "_gated_activation_bwd_kernel" if gated else "_activation_bwd_kernel"
    inputs = {"dy_ptr": dy2, "x_ptr": x2}
    dx = _launch(kernel, inputs, ("dx_ptr", (n_rows, n_cols)), d, x.dtype, _constants(act, gated, act_first))
    return dx.reshape(x.shape)
