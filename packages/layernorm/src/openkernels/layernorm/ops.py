"""torch.library ops of the layernorm family and their dispatch registrations.

Library ops (one explicit schema each; the op, its fake, the backward op, autograd, the
dispatch registrations and the eager fast paths all come from one `opdef` declaration each):
  openkernels::rms_norm(x, weight?, residual?, eps, weight_offset, store_residual, out_dtype?,
                        residual_dtype?) -> (out, residual_out, rstd)
  openkernels::layer_norm(x, weight?, bias?, residual?, eps, store_residual, out_dtype?,
                          residual_dtype?) -> (out, residual_out, mean, rstd)
  openkernels::rms_norm_backward / layer_norm_backward -> (grad_h, grad_weight[, grad_bias])
  openkernels::rms_norm_out / layer_norm_out(..., *, Tensor(a!) out) -> (): the result into out
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

from openkernels.shared import dispatch, opdef
from openkernels.shared.layout import as_rows

# The CPU backend's dispatch predicate; importing it compiles nothing (the library
# builds on its first call).
from .cpu import supports as _cpu_supports
from .cuda import push_supports as _push_supports
from .cuda import supports as _cluster_supports
from .problem import NORMS, NormSpec, norm_name
from .reference import stats_dtype

__all__ = [
    "forward",
    "backward",
    "RMS_NORM",
    "LAYER_NORM",
    "RMS_NORM_OUT",
    "LAYER_NORM_OUT",
    "KERNEL_DTYPES",
    "OPS",
]

_PKG = "openkernels.layernorm"
# Dtypes the Triton kernels take; the CPU kernels take float64 too (gradcheck).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LIB = torch.library.Library("openkernels", "FRAGMENT")


def _h_dtype(x: torch.Tensor, residual: torch.Tensor | None, residual_dtype: torch.dtype | None):
    return residual_dtype or (residual.dtype if residual is not None else x.dtype)


def _empty(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ref.new_empty((0,), dtype=dtype)


def _flat(stats: torch.Tensor) -> torch.Tensor:
    return stats if stats.dim() == 1 else stats.view(-1)  # a view costs host time: 2D x needs none


def _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, rms, out=None):
    """(out, residual_out, mean or None, rstd), allocated (out: given, or allocated when None);
    shared by the impl and the fake."""
    # empty_like of a contiguous x and new_empty cost less host time than torch.empty with a
    # device argument (1.9 / 2.7 / 3.3 us on the H200's host).
    if out is None and x.is_contiguous():
        out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    elif out is None:
        out = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    h_dtype = _h_dtype(x, residual, residual_dtype)
    residual_out = x.new_empty(x.shape, dtype=h_dtype) if store_residual else None
    stats = stats_dtype(x.dtype)
    rstd = x.new_empty(x.shape[:-1], dtype=stats)
    mean = None if rms else x.new_empty(x.shape[:-1], dtype=stats)
    return out, residual_out, mean, rstd


def forward(
    rms: bool, x, weight, bias, residual, eps: float, weight_offset: float, store_residual: bool, out_dtype,
    residual_dtype, out=None,
) -> tuple:  # fmt: skip
    """Run the best backend on the library op's arguments (the module docstring's schemas;
    bias is None for RMSNorm); returns (out, residual_out or None, mean or None, rstd). out:
    the tensor to write the result into (contiguous, x's shape; x or residual itself is
    allowed: every backend reads an element before it writes it), else a new one."""
    out, residual_out, mean, rstd = _fwd_outputs(
        x, residual, store_residual, out_dtype, residual_dtype, rms, out
    )
    if x.numel() == 0:
        return out, residual_out, mean, rstd
    dispatch.run(
        norm_name(rms),
        as_rows(x),
        None if residual is None else as_rows(residual),
        weight,
        bias,
        as_rows(out),
        None if residual_out is None else as_rows(residual_out),
        None if mean is None else _flat(mean),
        _flat(rstd),
        eps=eps,
        weight_offset=weight_offset,
        rms=rms,
        h_dtype=_h_dtype(x, residual, residual_dtype),
    )
    return out, residual_out, mean, rstd


def backward(
    rms: bool, grad_out, grad_residual_out, h, weight, mean, rstd, weight_offset: float, weight_grad: bool,
    bias_grad: bool,
) -> tuple:  # fmt: skip
    """(grad_h in h's dtype, grad_weight or None, grad_bias or None), on the backward ops'
    arguments (the module docstring's schemas; mean is None for RMSNorm)."""
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    n = h.shape[-1]
    # The parameters' gradients in their final dtype: backends sum in float32 (or float64)
    # and round once when they store.
    param_dtype = rstd.dtype if weight is None else weight.dtype
    dweight = torch.empty(n, dtype=param_dtype, device=h.device) if weight_grad else None
    dbias = torch.empty(n, dtype=param_dtype, device=h.device) if bias_grad else None
    if h.numel() == 0:
        for t in (dweight, dbias):
            if t is not None:
                t.zero_()
    else:
        dispatch.run(
            f"{norm_name(rms)}_backward",
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
    return grad_h, dweight, dbias


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


# The sm_90 cluster kernels (CUDA C++): below Triton's priority (20), so they run only when
# forced by name; the pushed forward ("push", norm_push.cu) above it: its launcher runs the
# rows it measured faster on (cuda.push_config: 32768-262144 columns, to 524288 on clusters of 9-16; H200 and H100) and hands every
# other call to the Triton launcher.
_CLUSTER_PRIORITY = 15
_PUSH_PRIORITY = 25


def _impls(entry: str) -> tuple[opdef.Impl, ...]:
    """`entry`: norm_fwd or norm_bwd."""
    impls = opdef.standard_impls(_PKG, entry, triton_supports=_triton_supports, cpu_supports=_cpu_supports)
    push = (
        (opdef.Impl("push", f"{_PKG}.cuda:push_norm_fwd", ("cuda",), _PUSH_PRIORITY, _push_supports),)
        if entry == "norm_fwd"
        else ()
    )
    return (
        *push,
        *impls,
        opdef.Impl("cluster", f"{_PKG}.cuda:{entry}", ("cuda",), _CLUSTER_PRIORITY, _cluster_supports),
    )


def _or_empty(t: torch.Tensor | None, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _empty(ref, dtype) if t is None else t


def _param_grad_dtype(h: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    return h.dtype if weight is None else weight.dtype


# ---- what the forward keeps, and the gradients from it (both norms) ----------------------


def _save(x, residual, residual_out, weight, stats, store_residual, residual_dtype, out, extra=()):
    """Keep the normalized h (the stored residual stream, or x itself when there is no
    residual), the weight and the statistics; x and residual only when h must be rebuilt."""
    h_dtype = _h_dtype(x, residual, residual_dtype)
    if store_residual:
        h = residual_out
    elif residual is None and h_dtype == x.dtype:
        h = x
    else:
        h = None
    tensors = (h, weight, x if h is None else None, residual if h is None else None, *stats)
    values = (
        x.dtype,
        None if residual is None else residual.dtype,
        h_dtype,
        store_residual,
        out.dtype,
        *extra,
    )
    return tensors, values


def _saved_h(tensors: tuple, h_dtype: torch.dtype) -> torch.Tensor:
    h, _, x, residual = tensors[:4]
    if h is None:  # not stored (the API stores it whenever a gradient is needed)
        acc = stats_dtype(x.dtype)
        h = (x.to(acc) if residual is None else x.to(acc) + residual.to(acc)).to(h_dtype)
    return h


def _upstream(grad_out, grad_residual_out, h, store_residual, out_dtype):
    """The normalized output's gradient (zeros when only the residual stream was used) and
    the stored residual stream's (None when it was not stored: the placeholder carries nothing)."""
    if grad_out is None:
        grad_out = torch.zeros(h.shape, dtype=out_dtype, device=h.device)
    return grad_out, grad_residual_out if store_residual else None


def _input_grads(grad_h, x_dtype, residual_dtype, needs_x: bool, needs_residual: bool):
    grad_x = grad_h.to(x_dtype) if needs_x else None
    grad_res = grad_h.to(residual_dtype) if residual_dtype is not None and needs_residual else None
    return grad_x, grad_res


# ---- openkernels::rms_norm -----------------------------------------------------------


def _rms_forward(x, weight, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype):
    out, res_out, _, rstd = forward(
        True, x, weight, None, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype
    )
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), rstd


def _rms_fake(x, weight, residual, eps, weight_offset, store_residual, out_dtype, residual_dtype):
    out, res_out, _, rstd = _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, True)
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), rstd


def _rms_backward(grad_out, grad_residual_out, h, weight, rstd, weight_offset, weight_grad):
    grad_h, grad_w, _ = backward(
        True, grad_out, grad_residual_out, h, weight, None, rstd, weight_offset, weight_grad, False
    )
    return grad_h, _or_empty(grad_w, h, _param_grad_dtype(h, weight))


def _rms_backward_fake(grad_out, grad_residual_out, h, weight, rstd, weight_offset, weight_grad):
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if weight_grad and weight is not None:
        return grad_h, torch.empty_like(weight, memory_format=torch.contiguous_format)
    return grad_h, _empty(h, _param_grad_dtype(h, weight))


def _rms_save(inputs: tuple, output: tuple) -> tuple[tuple, tuple]:
    x, weight, residual, _eps, weight_offset, store_residual, _out_dtype, residual_dtype = inputs
    out, residual_out, rstd = output
    return _save(
        x, residual, residual_out, weight, (rstd,), store_residual, residual_dtype, out, (weight_offset,)
    )


def _rms_grads(run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
    x_dtype, residual_dtype, h_dtype, store_residual, out_dtype, weight_offset = values
    weight, rstd = tensors[1], tensors[4]
    h = _saved_h(tensors, h_dtype)
    grad_out, grad_residual_out = _upstream(grad_outputs[0], grad_outputs[1], h, store_residual, out_dtype)
    weight_grad = weight is not None and needs[1]
    grad_h, grad_w = run(grad_out, grad_residual_out, h, weight, rstd, weight_offset, weight_grad)
    grad_x, grad_res = _input_grads(grad_h, x_dtype, residual_dtype, needs[0], needs[2])
    return grad_x, grad_w if weight_grad else None, grad_res, None, None, None, None, None


# ---- openkernels::layer_norm ---------------------------------------------------------


def _ln_forward(x, weight, bias, residual, eps, store_residual, out_dtype, residual_dtype):
    out, res_out, mean, rstd = forward(
        False, x, weight, bias, residual, eps, 0.0, store_residual, out_dtype, residual_dtype
    )
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), mean, rstd


def _ln_fake(x, weight, bias, residual, eps, store_residual, out_dtype, residual_dtype):
    out, res_out, mean, rstd = _fwd_outputs(x, residual, store_residual, out_dtype, residual_dtype, False)
    return out, _or_empty(res_out, x, _h_dtype(x, residual, residual_dtype)), mean, rstd


def _ln_backward(grad_out, grad_residual_out, h, weight, mean, rstd, weight_grad, bias_grad):
    grad_h, grad_w, grad_b = backward(
        False, grad_out, grad_residual_out, h, weight, mean, rstd, 0.0, weight_grad, bias_grad
    )
    dtype = _param_grad_dtype(h, weight)
    return grad_h, _or_empty(grad_w, h, dtype), _or_empty(grad_b, h, dtype)


def _ln_backward_fake(grad_out, grad_residual_out, h, weight, mean, rstd, weight_grad, bias_grad):
    n, dtype = h.shape[-1], _param_grad_dtype(h, weight)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    grad_w = torch.empty(n, dtype=dtype, device=h.device) if weight_grad else _empty(h, dtype)
    grad_b = torch.empty(n, dtype=dtype, device=h.device) if bias_grad else _empty(h, dtype)
    return grad_h, grad_w, grad_b


def _ln_save(inputs: tuple, output: tuple) -> tuple[tuple, tuple]:
    x, weight, bias, residual, _eps, store_residual, _out_dtype, residual_dtype = inputs
    out, residual_out, mean, rstd = output
    bias_dtype = None if bias is None else bias.dtype
    return _save(
        x, residual, residual_out, weight, (mean, rstd), store_residual, residual_dtype, out, (bias_dtype,)
    )


def _ln_grads(run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
    x_dtype, residual_dtype, h_dtype, store_residual, out_dtype, bias_dtype = values
    weight, mean, rstd = tensors[1], tensors[4], tensors[5]
    h = _saved_h(tensors, h_dtype)
    grad_out, grad_residual_out = _upstream(grad_outputs[0], grad_outputs[1], h, store_residual, out_dtype)
    weight_grad = weight is not None and needs[1]
    bias_grad = bias_dtype is not None and needs[2]
    # The op returns dbias in the weight's dtype; a bias of another dtype (a float32 bias beside
    # a bfloat16 weight) takes its sum of grad_out over the rows apart, in float32, rounded once.
    bias_apart = bias_grad and bias_dtype != _param_grad_dtype(h, weight)
    grad_h, grad_w, grad_b = run(
        grad_out, grad_residual_out, h, weight, mean, rstd, weight_grad, bias_grad and not bias_apart
    )
    grad_x, grad_res = _input_grads(grad_h, x_dtype, residual_dtype, needs[0], needs[3])
    if bias_apart:
        grad_b = grad_out.reshape(-1, h.shape[-1]).sum(0, dtype=rstd.dtype)
    grad_b = grad_b.to(bias_dtype) if bias_grad else None
    return grad_x, grad_w if weight_grad else None, grad_b, grad_res, None, None, None, None


# ---- openkernels::rms_norm_out / layer_norm_out: the result into a given tensor --------


def _rms_out(x, weight, residual, eps, weight_offset, residual_dtype, *, out) -> None:
    forward(True, x, weight, None, residual, eps, weight_offset, False, out.dtype, residual_dtype, out)


def _ln_out(x, weight, bias, residual, eps, residual_dtype, *, out) -> None:
    forward(False, x, weight, bias, residual, eps, 0.0, False, out.dtype, residual_dtype, out)


# ---- the library ops, one declaration per norm of the op table ----------------------------


def _schemas(rms: bool) -> tuple[str, str, str, int]:
    """(op, backward op, _out op) schemas of RMSNorm (rms) or LayerNorm, and the op's number
    of tensor inputs. RMSNorm takes weight_offset; LayerNorm takes a bias, returns the mean
    beside rstd, and its backward returns the bias gradient."""
    bias, offset = ("", ", float weight_offset") if rms else (", Tensor? bias", "")
    inputs = f"Tensor x, Tensor? weight{bias}, Tensor? residual, float eps{offset}"
    stats = "Tensor rstd" if rms else "Tensor mean, Tensor rstd"
    param_grads = "bool weight_grad" if rms else "bool weight_grad, bool bias_grad"
    outputs = ", Tensor" * stats.count("Tensor")
    op = f"({inputs}, bool store_residual, ScalarType? out_dtype, ScalarType? residual_dtype) -> (Tensor, Tensor{outputs})"
    backward = (f"(Tensor grad_out, Tensor? grad_residual_out, Tensor h, Tensor? weight, {stats}{offset}, {param_grads}) "
                f"-> (Tensor{', Tensor' * param_grads.count('bool')})")  # fmt: skip
    out = f"({inputs}, ScalarType? residual_dtype, *, Tensor(a!) out) -> ()"
    return op, backward, out, inputs.count("Tensor")


# NormSpec.rms -> the functions behind that norm's ops: forward, fake, backward, backward fake,
# save, grads, _out
_FUNCTIONS = {
    True: (_rms_forward, _rms_fake, _rms_backward, _rms_backward_fake, _rms_save, _rms_grads, _rms_out),
    False: (_ln_forward, _ln_fake, _ln_backward, _ln_backward_fake, _ln_save, _ln_grads, _ln_out),
}


def _define(spec: NormSpec) -> tuple[opdef.DefinedOp, opdef.DefinedOp]:
    """openkernels::<name> (with autograd and <name>_backward) and openkernels::<name>_out.

    The _out op has no autograd (the public call refuses out= when a gradient is wanted); eager
    calls run its forward directly, the library op serves torch.compile and tensor subclasses.
    The statistics (outputs 2 on) carry no gradient."""
    schema, backward_schema, out_schema, n_tensors = _schemas(spec.rms)
    forward, fake, backward, backward_fake, save, grads, out = _FUNCTIONS[spec.rms]
    n_stats = 1 if spec.rms else 2
    bwd = opdef.BackwardDef(
        schema=backward_schema, compute=backward, fake=backward_fake, save=save, grads=grads, key=_bwd_key,
        impls=_impls("norm_bwd"), non_differentiable=tuple(range(2, 2 + n_stats)), materialize_grads=False,
    )  # fmt: skip
    op = opdef.OpDef(name=spec.name, schema=schema, forward=forward, fake=fake, key=_fwd_key, impls=_impls("norm_fwd"),
                     tensor_args=tuple(range(n_tensors)), backward=bwd)  # fmt: skip
    out_op = opdef.OpDef(
        name=f"{spec.name}_out", schema=out_schema, forward=out, fake=lambda *args, out: None
    )
    return opdef.define(_LIB, op), opdef.define(_LIB, out_op)


# op name -> (its callable, its _out op's): every norm of problem.NORMS
OPS: dict[str, tuple[opdef.DefinedOp, opdef.DefinedOp]] = {
    name: _define(spec) for name, spec in NORMS.items()
}
(RMS_NORM, RMS_NORM_OUT), (LAYER_NORM, LAYER_NORM_OUT) = OPS[norm_name(True)], OPS[norm_name(False)]
