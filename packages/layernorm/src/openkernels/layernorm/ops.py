"""torch.library ops of the layernorm family and their dispatch registrations.

Library ops (one explicit schema each, fakes and autograd below):
  openkernels::rms_norm(x, weight?, residual?, eps, weight_offset, store_residual, out_dtype?,
                        residual_dtype?) -> (out, residual_out, rstd)
  openkernels::layer_norm(x, weight?, bias?, residual?, eps, store_residual, out_dtype?,
                          residual_dtype?) -> (out, residual_out, mean, rstd)
  openkernels::rms_norm_backward / layer_norm_backward -> (grad_h, grad_weight[, grad_bias])
residual_out is h = x + residual in the residual dtype when store_residual is set, else an
empty tensor; mean/rstd are the per-row statistics the backward reuses. Unwanted weight and
bias gradients come back as empty tensors.

Backends (reference.py, cpu/, triton/) implement, on 2D tensors:
  norm_fwd(x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset,
           rms, h_dtype)
  norm_bwd(dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias, *, weight_offset, rms)
x, residual, dy, h, dh_out: (M, N) with unit column stride and any row stride; out,
residual_out, dh: contiguous (M, N); weight, bias: contiguous (N,); mean, rstd: (M,) in the
statistics dtype (float32; float64 for float64 inputs); dweight, dbias: (N,) in that dtype,
written as full sums over the rows. Optional arguments are None when absent or unwanted.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch
from openkernels.shared.layout import as_rows

from .reference import stats_dtype

__all__ = ["forward", "backward", "EagerNorm", "KERNEL_DTYPES", "OPS"]

_PKG = "openkernels.layernorm"
# Dtypes the Triton kernels take; the CPU kernels take float64 too (gradcheck).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPS = ("rms_norm", "layer_norm")

_LIB = torch.library.Library("openkernels", "FRAGMENT")
_LIB.define(
    "rms_norm(Tensor x, Tensor? weight, Tensor? residual, float eps, float weight_offset, "
    "bool store_residual, ScalarType? out_dtype, ScalarType? residual_dtype) -> (Tensor, Tensor, Tensor)"
)
_LIB.define(
    "layer_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, "
    "bool store_residual, ScalarType? out_dtype, ScalarType? residual_dtype) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_LIB.define(
    "rms_norm_backward(Tensor grad_out, Tensor? grad_residual_out, Tensor h, Tensor? weight, "
    "Tensor rstd, float weight_offset, bool weight_grad) -> (Tensor, Tensor)"
)
_LIB.define(
    "layer_norm_backward(Tensor grad_out, Tensor? grad_residual_out, Tensor h, Tensor? weight, "
    "Tensor mean, Tensor rstd, bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)"
)


def _h_dtype(x: torch.Tensor, residual: torch.Tensor | None, residual_dtype: torch.dtype | None):
    return residual_dtype or (residual.dtype if residual is not None else x.dtype)


def _empty(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype, device=ref.device)


def _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, rms):
    """(out, residual_out, mean or None, rstd), allocated; shared by the impl and the fake."""
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    h_dtype = _h_dtype(x, residual, residual_dtype)
    residual_out = torch.empty(x.shape, dtype=h_dtype, device=x.device) if store_residual else None
    stats = stats_dtype(x.dtype)
    rstd = torch.empty(x.shape[:-1], dtype=stats, device=x.device)
    mean = None if rms else torch.empty(x.shape[:-1], dtype=stats, device=x.device)
    return out, residual_out, mean, rstd


def forward(
    rms: bool,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    store_residual: bool,
    out_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Run the best backend; returns (out, residual_out or None, mean or None, rstd)."""
    out, residual_out, mean, rstd = _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, rms)
    if x.numel() == 0:
        return out, residual_out, mean, rstd
    dispatch.run(
        "rms_norm" if rms else "layer_norm",
        as_rows(x),
        None if residual is None else as_rows(residual),
        weight,
        bias,
        as_rows(out),
        None if residual_out is None else as_rows(residual_out),
        None if mean is None else mean.view(-1),
        rstd.view(-1),
        eps=eps,
        weight_offset=weight_offset,
        rms=rms,
        h_dtype=_h_dtype(x, residual, residual_dtype),
    )
    return out, residual_out, mean, rstd


def backward(
    rms: bool,
    grad_out: torch.Tensor,
    grad_residual_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight_offset: float,
    weight_grad: bool,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(grad_h in h's dtype, grad_weight or None, grad_bias or None)."""
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    n = h.shape[-1]
    stats = rstd.dtype
    dweight = torch.empty(n, dtype=stats, device=h.device) if weight_grad else None
    dbias = torch.empty(n, dtype=stats, device=h.device) if bias_grad else None
    if h.numel() == 0:
        for t in (dweight, dbias):
            if t is not None:
                t.zero_()
    else:
        dispatch.run(
            "rms_norm_backward" if rms else "layer_norm_backward",
            as_rows(grad_out),
            as_rows(h),
            weight,
            None if mean is None else mean.reshape(-1),
            rstd.reshape(-1),
            None if grad_residual_out is None else as_rows(grad_residual_out),
            as_rows(grad_h),
            dweight,
            dbias,
            weight_offset=weight_offset,
            rms=rms,
        )
    if dweight is not None and weight is not None:
        dweight = dweight.to(weight.dtype)
    return grad_h, dweight, None if dbias is None else dbias.to(weight.dtype if weight is not None else stats)


# Selection depends on the normalized input alone: `dispatch.explain("rms_norm", x)` works
# with the public call's arguments.
def _fwd_key(x: torch.Tensor, *args: object, **kwargs: object) -> dispatch.DispatchKey:
    return dispatch.key_for(x)


def _bwd_key(dy: torch.Tensor, h: torch.Tensor, *args: object, **kwargs: object) -> dispatch.DispatchKey:
    return dispatch.key_for(h)


def _triton_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"dtype {key.dtype} runs on the reference implementation"
    return dispatch.triton_supports(key)


def _cpu_supports(key: dispatch.DispatchKey) -> str | None:
    from .cpu import supports  # imports no compiler; the library builds on first call

    return supports(key)


def _register_backends() -> None:
    for name in OPS:
        for op, entry, key_fn in ((name, "norm_fwd", _fwd_key), (f"{name}_backward", "norm_bwd", _bwd_key)):
            dispatch.define(op, key_fn)
            dispatch.register(
                op,
                "triton",
                dispatch.lazy(f"{_PKG}.triton:{entry}"),
                backends=("cuda", "rocm"),
                priority=20,
                supports=_triton_supports,
                interpretable=True,
            )
            dispatch.register(
                op,
                "cpu",
                dispatch.lazy(f"{_PKG}.cpu:{entry}"),
                backends=("cpu",),
                priority=10,
                supports=_cpu_supports,
            )
            dispatch.register(
                op,
                "reference",
                dispatch.lazy(f"{_PKG}.reference:{entry}"),
                backends=("cuda", "rocm", "cpu"),
                priority=0,
            )


# ---- openkernels::rms_norm -------------------------------------------------------------


def _or_empty(t: torch.Tensor | None, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _empty(ref, dtype) if t is None else t


@torch.library.impl(_LIB, "rms_norm", "CompositeExplicitAutograd")
def _rms_norm_impl(x, weight, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype):
    out, res_out, _, rstd = forward(
        True, x, weight, None, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype
    )
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), rstd


@torch.library.register_fake("openkernels::rms_norm", lib=_LIB)
def _rms_norm_fake(x, weight, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype):
    out, res_out, _, rstd = _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, True)
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), rstd


@torch.library.impl(_LIB, "rms_norm_backward", "CompositeExplicitAutograd")
def _rms_norm_backward_impl(grad_out, grad_residual_out, h, weight, rstd, weight_offset, weight_grad):
    grad_h, grad_w, _ = backward(
        True, grad_out, grad_residual_out, h, weight, None, rstd, weight_offset, weight_grad, False
    )
    return grad_h, _or_empty(grad_w, h, h.dtype if weight is None else weight.dtype)


@torch.library.register_fake("openkernels::rms_norm_backward", lib=_LIB)
def _rms_norm_backward_fake(grad_out, grad_residual_out, h, weight, rstd, weight_offset, weight_grad):
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if weight_grad and weight is not None:
        return grad_h, torch.empty_like(weight, memory_format=torch.contiguous_format)
    return grad_h, _empty(h, h.dtype if weight is None else weight.dtype)


# ---- openkernels::layer_norm -----------------------------------------------------------


@torch.library.impl(_LIB, "layer_norm", "CompositeExplicitAutograd")
def _layer_norm_impl(x, weight, bias, residual, eps, store_residual, out_dtype, residual_dtype):
    out, res_out, mean, rstd = forward(
        False, x, weight, bias, residual, eps, 0.0, store_residual, out_dtype, residual_dtype
    )
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), mean, rstd


@torch.library.register_fake("openkernels::layer_norm", lib=_LIB)
def _layer_norm_fake(x, weight, bias, residual, eps, store_residual, out_dtype, residual_dtype):
    out, res_out, mean, rstd = _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, False)
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), mean, rstd


def _param_grad_dtype(h: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return h.dtype if weight is None else weight.dtype


@torch.library.impl(_LIB, "layer_norm_backward", "CompositeExplicitAutograd")
def _layer_norm_backward_impl(grad_out, grad_residual_out, h, weight, mean, rstd, weight_grad, bias_grad):
    grad_h, grad_w, grad_b = backward(
        False, grad_out, grad_residual_out, h, weight, mean, rstd, 0.0, weight_grad, bias_grad
    )
    dtype = _param_grad_dtype(h, weight)
    return grad_h, _or_empty(grad_w, h, dtype), _or_empty(grad_b, h, dtype)


@torch.library.register_fake("openkernels::layer_norm_backward", lib=_LIB)
def _layer_norm_backward_fake(grad_out, grad_residual_out, h, weight, mean, rstd, weight_grad, bias_grad):
    n, dtype = h.shape[-1], _param_grad_dtype(h, weight)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    grad_w = torch.empty(n, dtype=dtype, device=h.device) if weight_grad else _empty(h, dtype)
    grad_b = torch.empty(n, dtype=dtype, device=h.device) if bias_grad else _empty(h, dtype)
    return grad_h, grad_w, grad_b


# ---- autograd --------------------------------------------------------------------------


def _save(ctx, x, weight, residual, residual_out, stats, store_residual, residual_dtype) -> None:
    """Save what the backward reads: the normalized h (the stored residual stream, or x
    itself when there is no residual), the weight and the statistics."""
    ctx.set_materialize_grads(False)
    ctx.dispatch_context = dispatch.snapshot()  # the backward runs under the forward's force/strict
    ctx.x_dtype = x.dtype
    ctx.residual_dtype_in = None if residual is None else residual.dtype
    ctx.h_dtype = _h_dtype(x, residual, residual_dtype)
    ctx.store_residual = store_residual
    if store_residual:
        h = residual_out
    elif residual is None and ctx.h_dtype == x.dtype:
        h = x
    else:
        h = None
    ctx.save_for_backward(h, weight, x if h is None else None, residual if h is None else None, *stats)


def _saved_h(ctx) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    h, weight, x, residual, *stats = ctx.saved_tensors
    if h is None:  # not stored (the API stores it whenever a gradient is needed)
        acc = stats_dtype(x.dtype)
        h = (x.to(acc) if residual is None else x.to(acc) + residual.to(acc)).to(ctx.h_dtype)
    return h, weight, tuple(stats)


def _input_grads(ctx, grad_h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    grad_x = grad_h.to(ctx.x_dtype) if ctx.needs_input_grad[ctx.x_index] else None
    grad_res = None
    if ctx.residual_dtype_in is not None and ctx.needs_input_grad[ctx.residual_index]:
        grad_res = grad_h.to(ctx.residual_dtype_in)
    return grad_x, grad_res


def _grad_residual_out(grad: torch.Tensor | None, ctx) -> torch.Tensor | None:
    # Without store_residual the second output is an empty placeholder: its gradient is
    # an empty (or zero-filled) tensor that carries nothing.
    return grad if ctx.store_residual else None


def _grad_out(grad_out: torch.Tensor | None, h: torch.Tensor, ctx) -> torch.Tensor:
    # Only the residual stream was used downstream: the normalized output's gradient is 0.
    return torch.zeros(h.shape, dtype=ctx.out_dtype, device=h.device) if grad_out is None else grad_out


def _rms_setup(ctx, inputs, output) -> None:
    x, weight, residual, _eps, weight_offset, store_residual, _out_dtype, residual_dtype = inputs
    out, residual_out, rstd = output
    ctx.weight_offset, ctx.x_index, ctx.residual_index, ctx.out_dtype = weight_offset, 0, 2, out.dtype
    ctx.mark_non_differentiable(rstd)
    _save(ctx, x, weight, residual, residual_out, (rstd,), store_residual, residual_dtype)


def _rms_backward(ctx, grad_out, grad_residual_out, _grad_rstd):
    h, weight, (rstd,) = _saved_h(ctx)
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    grad_h, grad_w = ctx.dispatch_context.run(
        torch.ops.openkernels.rms_norm_backward,
        _grad_out(grad_out, h, ctx),
        _grad_residual_out(grad_residual_out, ctx),
        h,
        weight,
        rstd,
        ctx.weight_offset,
        weight_grad,
    )
    grad_x, grad_res = _input_grads(ctx, grad_h)
    return grad_x, grad_w if weight_grad else None, grad_res, None, None, None, None, None


def _ln_setup(ctx, inputs, output) -> None:
    x, weight, bias, residual, _eps, store_residual, _out_dtype, residual_dtype = inputs
    out, residual_out, mean, rstd = output
    ctx.x_index, ctx.residual_index, ctx.out_dtype, ctx.has_bias = 0, 3, out.dtype, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)
    _save(ctx, x, weight, residual, residual_out, (mean, rstd), store_residual, residual_dtype)


def _ln_backward(ctx, grad_out, grad_residual_out, _grad_mean, _grad_rstd):
    h, weight, (mean, rstd) = _saved_h(ctx)
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    bias_grad = ctx.has_bias and ctx.needs_input_grad[2]
    grad_h, grad_w, grad_b = ctx.dispatch_context.run(
        torch.ops.openkernels.layer_norm_backward,
        _grad_out(grad_out, h, ctx),
        _grad_residual_out(grad_residual_out, ctx),
        h,
        weight,
        mean,
        rstd,
        weight_grad,
        bias_grad,
    )
    grad_x, grad_res = _input_grads(ctx, grad_h)
    return (
        grad_x,
        grad_w if weight_grad else None,
        grad_b.to(ctx.bias_dtype) if bias_grad else None,
        grad_res,
        None,
        None,
        None,
        None,
    )


def _no_double_backward(name: str):
    def fail(ctx, *grads):
        raise NotImplementedError(f"openkernels::{name}: double backward is not supported")

    return fail


class EagerNorm(torch.autograd.Function):
    """The library ops' forward and backward as a plain autograd.Function, for eager calls
    that need gradients: it skips the torch.library layers (custom-op dispatch, the
    backward op's own dispatch), which cost about as much host time as the kernels take on
    a 64M-element bf16 tensor. torch.compile and non-plain tensors use the library ops.

    apply(rms, x, weight, bias, residual, eps, weight_offset, store_residual, out_dtype,
          residual_dtype) -> (out, residual_out or None)
    """

    @staticmethod
    def forward(ctx, rms, x, weight, bias, residual, eps, weight_offset, store_residual, out_dtype,
                residual_dtype):  # fmt: skip
        out, residual_out, mean, rstd = forward(
            rms, x, weight, bias, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype
        )
        ctx.rms, ctx.weight_offset, ctx.out_dtype = rms, weight_offset, out.dtype
        ctx.x_index, ctx.residual_index = 1, 4
        ctx.bias_dtype = None if bias is None else bias.dtype
        stats = (rstd,) if rms else (mean, rstd)
        _save(ctx, x, weight, residual, residual_out, stats, store_residual, residual_dtype)
        return out, residual_out

    @staticmethod
    @torch.autograd.function.once_differentiable  # double backward: a clear error
    def backward(ctx, grad_out, grad_residual_out):
        h, weight, stats = _saved_h(ctx)
        mean, rstd = (None, stats[0]) if ctx.rms else stats
        weight_grad = weight is not None and ctx.needs_input_grad[2]
        bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
        grad_h, grad_w, grad_b = ctx.dispatch_context.run(
            backward, ctx.rms, _grad_out(grad_out, h, ctx), _grad_residual_out(grad_residual_out, ctx), h, weight, mean,
            rstd, ctx.weight_offset, weight_grad, bias_grad,
        )  # fmt: skip
        grad_x, grad_res = _input_grads(ctx, grad_h)
        grad_b = grad_b.to(ctx.bias_dtype) if bias_grad else None
        return None, grad_x, grad_w, grad_b, grad_res, None, None, None, None, None


torch.library.register_autograd("openkernels::rms_norm", _rms_backward, setup_context=_rms_setup, lib=_LIB)
torch.library.register_autograd("openkernels::layer_norm", _ln_backward, setup_context=_ln_setup, lib=_LIB)
for _name in OPS:
    torch.library.register_autograd(
        f"openkernels::{_name}_backward", _no_double_backward(f"{_name}_backward"), lib=_LIB
    )
_register_backends()
