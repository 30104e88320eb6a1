"""torch.library ops of the quant family and their dispatch registrations.

Library ops (one explicit schema each, fakes and autograd below):
  openkernels::int4_linear(x, qweight, scales, zeros?, bias?, group_size, kind) -> out
      x (..., K) float16 / bfloat16 / float32 / float64, out (..., N) in x's dtype.
      Differentiable in x and bias (the 4-bit weight is frozen):
      grad_x = grad_out @ W, grad_bias = grad_out summed over the leading dims.
  openkernels::dequantize_int4(qweight, scales, zeros?, group_size, kind, dtype) -> W (N, K)
The weight parts are format.py's layout (checked once, when the Int4Weight is built); the
act-order perm is applied by api.py before these ops. The backend contract
(int4_linear_fwd / dequantize_int4_fwd) is in reference.py.
"""

from __future__ import annotations

import contextvars

import torch
from torch import Tensor

from openkernels.shared import dispatch

__all__ = ["forward", "dequantize", "EagerInt4Linear", "KERNEL_DTYPES"]

_PKG = "openkernels.quant"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # activations the Triton kernels take

_LIB = torch.library.Library("openkernels", "FRAGMENT")
_LIB.define(
    "int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
    "str kind) -> Tensor"
)
_LIB.define(
    "dequantize_int4(Tensor qweight, Tensor scales, Tensor? zeros, int group_size, str kind, "
    "ScalarType dtype) -> Tensor"
)


def forward(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    kind: str,
) -> Tensor:
    """x (..., K) @ W^T + bias -> (..., N) in x's dtype, by the best backend."""
    n, k = qweight.shape[0], x.shape[-1]
    flat = x.dim() == 2 and x.stride(1) == 1  # the common case: no reshape, no view (host time)
    rows = x if flat else x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        dispatch.run("int4_linear", rows, qweight, scales, zeros, bias, out, group_size, kind)
    return out if flat else out.view(*x.shape[:-1], n)


def dequantize(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, kind: str, dtype: torch.dtype
) -> Tensor:
    """The weight (N, K) in `dtype`, by the best backend."""
    out = torch.empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype, device=qweight.device)
    if out.numel():
        dispatch.run("dequantize_int4", qweight, scales, zeros, out, group_size, kind)
    return out


def _grad_x(grad_out: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, kind: str,
            dtype: torch.dtype) -> Tensor:  # fmt: skip
    w = torch.ops.openkernels.dequantize_int4(qweight, scales, zeros, group_size, kind, dtype)
    return grad_out.to(dtype) @ w


def _grad_bias(grad_out: Tensor, bias: Tensor) -> Tensor:
    return grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


# ---- dispatch -------------------------------------------------------------------------------


def _linear_key(x: Tensor, qweight: Tensor, scales: Tensor, zeros, bias, out, group_size: int, kind: str):
    return dispatch.key_for(x, kind)


def _dequantize_key(qweight: Tensor, scales: Tensor, zeros, out: Tensor, group_size: int, kind: str):
    return dispatch.key_for(out, kind)


def _triton_linear_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"activations in {key.dtype} run on the CPU or reference implementation (Triton: float16, bfloat16)"
    return dispatch.triton_supports(key)


def _triton_dequantize_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in (*KERNEL_DTYPES, torch.float32):
        return f"{key.dtype} output runs on the reference implementation"
    return dispatch.triton_supports(key)


def _cpu_supports(key: dispatch.DispatchKey) -> str | None:
    from .cpu import supports  # imports no compiler; the library builds on first call

    return supports(key)


def _register_backends() -> None:
    for op, key_fn, triton_supports in (
        ("int4_linear", _linear_key, _triton_linear_supports),
        ("dequantize_int4", _dequantize_key, _triton_dequantize_supports),
    ):
        dispatch.define(op, key_fn)
        entry = f"{op}_fwd"
        dispatch.register(op, "triton", dispatch.lazy(f"{_PKG}.triton:{entry}"), backends=("cuda", "rocm"),
                          priority=20, supports=triton_supports, interpretable=True)  # fmt: skip
        dispatch.register(op, "cpu", dispatch.lazy(f"{_PKG}.cpu:{entry}"), backends=("cpu",), priority=10,
                          supports=_cpu_supports)  # fmt: skip
        dispatch.register(op, "reference", dispatch.lazy(f"{_PKG}.reference:{entry}"),
                          backends=("cuda", "rocm", "cpu"), priority=0)  # fmt: skip


# ---- library op impls, fakes, autograd ------------------------------------------------------


# True while the library op runs: calls from torch.compile graphs, whose CUDA-graph trees warm
# up and capture into a private memory pool that a cached split-K scratch must not live in
# (triton/__init__.py allocates temporaries then). Eager calls keep the cached scratch.
LIBRARY_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "openkernels_quant_library_call", default=False
)


@torch.library.impl(_LIB, "int4_linear", "CompositeExplicitAutograd")
def _int4_linear_impl(x, qweight, scales, zeros, bias, group_size, kind):
    token = LIBRARY_CALL.set(True)
    try:
        return forward(x, qweight, scales, zeros, bias, group_size, kind)
    finally:
        LIBRARY_CALL.reset(token)


@torch.library.register_fake("openkernels::int4_linear", lib=_LIB)
def _int4_linear_fake(x, qweight, scales, zeros, bias, group_size, kind):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.impl(_LIB, "dequantize_int4", "CompositeExplicitAutograd")
def _dequantize_impl(qweight, scales, zeros, group_size, kind, dtype):
    return dequantize(qweight, scales, zeros, group_size, kind, dtype)


@torch.library.register_fake("openkernels::dequantize_int4", lib=_LIB)
def _dequantize_fake(qweight, scales, zeros, group_size, kind, dtype):
    return qweight.new_empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype)


def _setup(ctx, inputs, output) -> None:
    x, qweight, scales, zeros, bias, group_size, kind = inputs
    ctx.save_for_backward(qweight, scales, zeros, bias)
    ctx.options = (group_size, kind, x.dtype)


def _backward(ctx, grad_out):
    qweight, scales, zeros, bias = ctx.saved_tensors
    group_size, kind, dtype = ctx.options
    grad_x = (
        _grad_x(grad_out, qweight, scales, zeros, group_size, kind, dtype)
        if ctx.needs_input_grad[0]
        else None
    )
    grad_bias = _grad_bias(grad_out, bias) if bias is not None and ctx.needs_input_grad[4] else None
    return grad_x, None, None, None, grad_bias, None, None


torch.library.register_autograd("openkernels::int4_linear", _backward, setup_context=_setup, lib=_LIB)


class EagerInt4Linear(torch.autograd.Function):
    """The library op's forward and backward as a plain autograd.Function, for eager calls
    that need gradients (skips the torch.library dispatch layers; torch.compile uses the op).

    apply(x, qweight, scales, zeros, bias, group_size, kind) -> out
    """

    @staticmethod
    def forward(ctx, x, qweight, scales, zeros, bias, group_size, kind):
        ctx.save_for_backward(qweight, scales, zeros, bias)
        ctx.options = (group_size, kind, x.dtype)
        ctx.dispatch_context = dispatch.snapshot()  # the backward runs under the forward's force/strict
        return forward(x, qweight, scales, zeros, bias, group_size, kind)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        qweight, scales, zeros, bias = ctx.saved_tensors
        group_size, kind, dtype = ctx.options
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = ctx.dispatch_context.run(dequantize, qweight, scales, zeros, group_size, kind, dtype)
            grad_x = grad_out.to(dtype) @ w
        if bias is not None and ctx.needs_input_grad[4]:
            grad_bias = _grad_bias(grad_out, bias)
        return grad_x, None, None, None, grad_bias, None, None


_register_backends()
