"""torch.library ops of the quant family and their dispatch registrations.

Library ops (one explicit schema each; op, fake, backward op, autograd, dispatch
registrations and eager fast paths from one `opdef` declaration each):
  openkernels::int4_linear(x, qweight, scales, zeros?, bias?, group_size, kind) -> out
      x (..., K) float16 / bfloat16 / float32 / float64, out (..., N) in x's dtype.
      Differentiable in x and bias (the 4-bit weight is frozen):
      grad_x = grad_out @ W, grad_bias = grad_out summed over the leading dims
      (openkernels::int4_linear_backward).
  openkernels::dequantize_int4(qweight, scales, zeros?, group_size, kind, dtype) -> W (N, K)
  openkernels::int4_linear_gated(gate_up, qweight, scales, zeros?, bias?, group_size, kind, act) -> out
      A gated MLP's down projection on its stacked gate / up output (fused.py): gate_up
      (..., 2K), out (..., N) = (act(gate) * up) @ W^T + bias in gate_up's dtype. Inference
      only (no autograd); the tensor-core GEMV's gated build where it takes the call, else
      composed (the activation, then int4_linear).
  openkernels::int4_linear_rmsnorm(x, norm_weight, eps, weight_offset, qweight, scales, zeros?,
                                   bias?, group_size, kind) -> out
      A pre-norm decoder's projection on its un-normed hidden state (fused.py): out (..., N)
      = RMSNorm(x) @ W^T + bias in x's dtype. Inference only; the tensor-core GEMV's normed
      build where it takes the call, else composed (the norm, then int4_linear).
The weight parts are format.py's layout (checked once, when the Int4Weight is built); the
act-order perm is applied by api.py before these ops. The backend contract
(int4_linear_fwd / dequantize_int4_fwd) is in reference.py.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from openkernels.shared import dispatch, opdef

from . import problem

__all__ = [
    "forward",
    "forward_gated",
    "dequantize",
    "INT4_LINEAR",
    "INT4_LINEAR_GATED",
    "INT4_LINEAR_RMSNORM",
    "forward_normed",
    "DEQUANTIZE_INT4",
    "KERNEL_DTYPES",
    "OPS",
]

_PKG = "openkernels.quant"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # activations the Triton kernels take

_LIB = torch.library.Library("openkernels", "FRAGMENT")
_LINEAR, _DEQUANTIZE = problem.OPS  # the op table's names (problem.OPS)
# a decode step's fused ops, not in the table (no JAX face, no gradient)
_GATED, _NORMED = "int4_linear_gated", "int4_linear_rmsnorm"


def _out_features(qweight: Tensor) -> int:
    """N of the stored rows (N, K // 2) or of format.tile_codes' tiled codes (N // 16, K // 128, 1024)."""
    return qweight.shape[0] * 16 if qweight.dim() == 3 else qweight.shape[0]


def forward(x: Tensor, qweight, scales, zeros, bias, group_size: int, kind: str) -> Tensor:
    """x (..., K) @ W^T + bias -> (..., N) in x's dtype, by the best backend (the weight's
    parts as format.py lays them out; zeros and bias may be None). Tiled codes (3-D,
    format.tile_codes; api.linear_parts passes them where tiled_runner names a launcher that
    reads them: the tensor-core GEMV or the Gluon wgmma kernel) go to that launcher."""
    n, k = _out_features(qweight), x.shape[-1]
    flat = x.dim() == 2 and x.stride(1) == 1  # the common case: no reshape, no view (host time)
    rows = x if flat else x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        if qweight.dim() == 3:
            _forward_tiled(rows, qweight, scales, zeros, bias, out, group_size, kind)
        else:
            dispatch.run(_LINEAR, rows, qweight, scales, zeros, bias, out, group_size, kind)
    return out if flat else out.view(*x.shape[:-1], n)


def forward_gated(
    gate_up: Tensor, qweight, scales, zeros, bias, group_size: int, kind: str, act: str
) -> Tensor:
    """(act(gate) * up) @ W^T + bias -> (..., N) in gate_up's dtype, gate_up (..., 2K) (fused.py)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = _out_features(qweight)
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and n:
        dispatch.run(_GATED, rows, qweight, scales, zeros, bias, out, group_size, kind, act)
    return out.view(*gate_up.shape[:-1], n)


def forward_normed(x: Tensor, norm_weight: Tensor, eps: float, weight_offset: float, qweight, scales, zeros, bias,
                   group_size: int, kind: str) -> Tensor:  # fmt: skip
    """RMSNorm(x) @ W^T + bias -> (..., N) in x's dtype, x (..., K) (fused.py)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n = _out_features(qweight)
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0] and n:
        dispatch.run(_NORMED, rows, norm_weight, eps, weight_offset, qweight, scales, zeros, bias, out, group_size,
                     kind)  # fmt: skip
    return out.view(*x.shape[:-1], n)


def tiled_runner(x: Tensor, tiled: Tensor, scales, zeros, bias, group_size: int, kind: str) -> str | None:
    """Which launcher runs this call (x (..., K)) on tiled codes (format.tile_codes): "gemv"
    (the tensor-core GEMV, 1-16 rows), "wgmma" (the Gluon kernel, 16 or more), or None (no
    kernel reads them for this call: the codes are converted to rows). CUDA only; not with grad
    mode on and x needing a gradient (the op's forward runs with grad mode off and reads them;
    its backward converts them) and not while compiling (the launchers' checks read data
    pointers; the compiled graph's op decides when it runs)."""
    if not x.is_cuda or x.dim() < 1 or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        return None  # forward would copy it: a new tensor, nothing to check here
    names = [impl.name for impl in dispatch.select(_LINEAR, dispatch.key_for(rows, kind))]
    from . import cuda

    if names[:1] == ["gemv"] and cuda.takes_tiled(rows, tiled, scales, zeros, bias, group_size, kind):
        return "gemv"
    from . import gluon  # after the gemv launcher hands a call on, or first where it is not registered

    if (names[:1] == ["wgmma"] or names[:2] == ["gemv", "wgmma"]) and gluon.takes_tiled(
        rows, tiled, scales, zeros, group_size, kind
    ):
        return "wgmma"
    return None


def _forward_tiled(x, qweight, scales, zeros, bias, out, group_size, kind) -> None:
    """forward on tiled codes: the launcher tiled_runner names, else the codes converted to
    rows for the call (a pass over them; one warning per layer shape and device type)."""
    runner = tiled_runner(x, qweight, scales, zeros, bias, group_size, kind)
    if runner == "gemv":
        from . import cuda

        cuda.int4_linear_fwd(x, qweight, scales, zeros, bias, out, group_size, kind)
    elif runner == "wgmma":
        from . import gluon

        gluon.int4_linear_fwd(x, qweight, scales, zeros, bias, out, group_size, kind)
    else:
        from .format import untile_codes

        _warn_untiled(x, qweight, kind)
        dispatch.run(_LINEAR, x, untile_codes(qweight), scales, zeros, bias, out, group_size, kind)


_untiled_warned: set[tuple] = set()


def _warn_untiled(x: Tensor, qweight: Tensor, kind: str) -> None:
    """One warning per (device type, codes shape, kind) that a call on tiled codes runs a
    kernel that reads rows (the codes converted for the call)."""
    key = (x.device.type, tuple(qweight.shape), kind)
    if key in _untiled_warned:
        return
    _untiled_warned.add(key)
    where = (
        "not on an NVIDIA GPU" if not x.is_cuda
        else f"e.g. {x.shape[0]} rows of x, on a path that reads rows: Triton or the one-round kernel"
    )  # fmt: skip
    warnings.warn(
        f"int4_linear: codes stored in the 'tiled' layout {tuple(qweight.shape)} run this call on a kernel that "
        f"reads rows ({where}): they are converted for each such call (a pass over them). "
        "Int4Linear.to_layout('rows') stores the rows instead.",
        stacklevel=2,
    )


def dequantize(
    qweight: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, kind: str, dtype: torch.dtype
) -> Tensor:
    """The weight (N, K) in `dtype`, by the best backend."""
    out = torch.empty((qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype, device=qweight.device)
    if out.numel():
        dispatch.run(_DEQUANTIZE, qweight, scales, zeros, out, group_size, kind)
    return out


def _grad_bias(grad_out: Tensor, bias: Tensor) -> Tensor:
    return grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)


# ---- dispatch -------------------------------------------------------------------------------


def _linear_key(x: Tensor, qweight: Tensor, scales: Tensor, zeros, bias, out, group_size: int, kind: str):
    return dispatch.key_for(x, kind)


def _dequantize_key(qweight: Tensor, scales: Tensor, zeros, out: Tensor, group_size: int, kind: str):
    return dispatch.key_for(out, kind)


def _gated_key(gate_up: Tensor, qweight, scales, zeros, bias, out, group_size: int, kind: str, act: str):
    return dispatch.key_for(gate_up, kind)


def _normed_key(
    x: Tensor, norm_weight, eps, weight_offset, qweight, scales, zeros, bias, out, group_size, kind
):
    return dispatch.key_for(x, kind)


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


def _gemv_supports(key: dispatch.DispatchKey) -> str | None:
    from .cuda import supports  # imports no compiler; nvcc builds the library on first call

    return supports(key)


# The CUDA C++ kernels for 1-16 rows of x: above wgmma (25) and Triton (20); the launcher runs
# the tensor-core GEMV or the one-round kernel where they measured fastest (cuda.default_config:
# sm_90, up to 16 rows of x) and hands every other call to the implementation below it.
_GEMV_PRIORITY = 30
# The Gluon Hopper kernel (gluon/, asynchronous wgmma, M >= 16): above Triton (20) on sm_90,
# where its launcher sends the calls it measured slower on (gluon.slower_than_triton: M < 96
# at N < 8192, M < 64 at N < 12288, shapes not measured) and those it cannot take to the
# Triton launcher.
_WGMMA_PRIORITY = 25


def _wgmma_supports(key: dispatch.DispatchKey) -> str | None:
    from .gluon import supports  # imports no compiler

    return supports(key)


def _impls(op: str, triton_supports) -> tuple[opdef.Impl, ...]:
    """Entry point `<op>_fwd`; int4_linear also has the CUDA C++ GEMV ("gemv") and the Gluon
    Hopper kernel ("wgmma")."""
    impls = opdef.standard_impls(
        _PKG, f"{op}_fwd", triton_supports=triton_supports, cpu_supports=_cpu_supports
    )
    if op == _LINEAR:
        impls = (
            *impls,
            opdef.Impl("gemv", f"{_PKG}.cuda:int4_linear_fwd", ("cuda",), _GEMV_PRIORITY, _gemv_supports),
            opdef.Impl("wgmma", f"{_PKG}.gluon:int4_linear_fwd", ("cuda",), _WGMMA_PRIORITY, _wgmma_supports),
        )
    return impls


# ---- library op impls, fakes, autograd ------------------------------------------------------


def _linear_fake(x, qweight, scales, zeros, bias, group_size, kind):
    return x.new_empty((*x.shape[:-1], _out_features(qweight)))


def _linear_backward(grad_out, qweight, scales, zeros, bias, group_size, kind, dtype, x_grad, bias_grad):
    """(grad_x (..., K) in x's dtype, or empty; grad_bias (N,) in bias's dtype, or empty)."""
    grad_x = grad_out.new_empty((0,), dtype=dtype)
    if x_grad:
        if qweight.dim() == 3:  # tiled codes (api passes them without autograd; kept correct anyway)
            from .format import untile_codes

            qweight = untile_codes(qweight)
        grad_x = grad_out.to(dtype) @ dequantize(qweight, scales, zeros, group_size, kind, dtype)
    grad_bias = grad_out.new_empty((0,)) if bias is None or not bias_grad else _grad_bias(grad_out, bias)
    return grad_x, grad_bias


def _linear_backward_fake(grad_out, qweight, scales, zeros, bias, group_size, kind, dtype, x_grad, bias_grad):
    k = qweight.shape[1] * (128 if qweight.dim() == 3 else 2)
    grad_x = grad_out.new_empty((*grad_out.shape[:-1], k) if x_grad else (0,), dtype=dtype)
    grad_bias = grad_out.new_empty((0,)) if bias is None or not bias_grad else torch.empty_like(bias)
    return grad_x, grad_bias


def _linear_save(inputs: tuple, output: Tensor) -> tuple[tuple, tuple]:
    x, qweight, scales, zeros, bias, group_size, kind = inputs
    return (qweight, scales, zeros, bias), (group_size, kind, x.dtype)


def _linear_grads(run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
    qweight, scales, zeros, bias = tensors
    group_size, kind, dtype = values
    x_grad, bias_grad = needs[0], bias is not None and needs[4]
    grad_x, grad_bias = run(
        grad_outputs[0], qweight, scales, zeros, bias, group_size, kind, dtype, x_grad, bias_grad
    )
    return grad_x if x_grad else None, None, None, None, grad_bias if bias_grad else None, None, None


INT4_LINEAR = opdef.define(
    _LIB,
    opdef.OpDef(
        name=_LINEAR,
        schema="(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, str kind) "
        "-> Tensor",
        forward=forward,
        fake=_linear_fake,
        key=_linear_key,
        impls=_impls(_LINEAR, _triton_linear_supports),
        tensor_args=(0, 1, 2, 3, 4),
        backward=opdef.BackwardDef(
            schema="(Tensor grad_out, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
            "str kind, ScalarType dtype, bool x_grad, bool bias_grad) -> (Tensor, Tensor)",
            compute=_linear_backward,
            fake=_linear_backward_fake,
            save=_linear_save,
            grads=_linear_grads,
        ),
    ),
)


DEQUANTIZE_INT4 = opdef.define(
    _LIB,
    opdef.OpDef(
        name=_DEQUANTIZE,
        schema="(Tensor qweight, Tensor scales, Tensor? zeros, int group_size, str kind, ScalarType dtype) -> Tensor",
        forward=dequantize,
        fake=lambda qweight, scales, zeros, group_size, kind, dtype: qweight.new_empty(
            (qweight.shape[0], 2 * qweight.shape[1]), dtype=dtype
        ),
        key=_dequantize_key,
        impls=_impls(_DEQUANTIZE, _triton_dequantize_supports),
    ),
)


def _gated_fake(gate_up, qweight, scales, zeros, bias, group_size, kind, act):
    return gate_up.new_empty((*gate_up.shape[:-1], _out_features(qweight)))


_PKG_ENTRY = "int4_linear_gated_fwd"
INT4_LINEAR_GATED = opdef.define(
    _LIB,
    opdef.OpDef(
        name=_GATED,
        schema="(Tensor gate_up, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size, "
        "str kind, str act) -> Tensor",
        forward=forward_gated,
        fake=_gated_fake,
        key=_gated_key,
        impls=(
            # the GEMV's gated build where it takes the call; it composes every other call itself
            opdef.Impl("gemv", f"{_PKG}.cuda:{_PKG_ENTRY}", ("cuda",), _GEMV_PRIORITY, _gemv_supports),
            opdef.Impl("composed", f"{_PKG}.fused:{_PKG_ENTRY}", ("cuda", "rocm", "cpu"), 5),
            opdef.Impl("reference", f"{_PKG}.reference:{_PKG_ENTRY}", ("cuda", "rocm", "cpu"), 0),
        ),
        tensor_args=(0, 1, 2, 3, 4),
    ),
)


_NORMED_ENTRY = "int4_linear_normed_fwd"
INT4_LINEAR_RMSNORM = opdef.define(
    _LIB,
    opdef.OpDef(
        name=_NORMED,
        schema="(Tensor x, Tensor norm_weight, float eps, float weight_offset, Tensor qweight, Tensor scales, "
        "Tensor? zeros, Tensor? bias, int group_size, str kind) -> Tensor",
        forward=forward_normed,
        fake=lambda x, norm_weight, eps, weight_offset, qweight, scales, zeros, bias, group_size, kind: (
            x.new_empty((*x.shape[:-1], _out_features(qweight)))
        ),
        key=_normed_key,
        impls=(
            # the GEMV's normed build where it takes the call; it composes every other call itself
            opdef.Impl("gemv", f"{_PKG}.cuda:{_NORMED_ENTRY}", ("cuda",), _GEMV_PRIORITY, _gemv_supports),
            opdef.Impl("composed", f"{_PKG}.fused:{_NORMED_ENTRY}", ("cuda", "rocm", "cpu"), 5),
            opdef.Impl("reference", f"{_PKG}.reference:{_NORMED_ENTRY}", ("cuda", "rocm", "cpu"), 0),
        ),
        tensor_args=(0, 1, 4, 5, 6, 7),
    ),
)


# op name -> its callable (eager fast paths, library op otherwise): every op of problem.OPS
OPS: dict[str, opdef.DefinedOp] = {_LINEAR: INT4_LINEAR, _DEQUANTIZE: DEQUANTIZE_INT4}
# ... and the fused ops outside the op table
FUSED_OPS: dict[str, opdef.DefinedOp] = {_GATED: INT4_LINEAR_GATED, _NORMED: INT4_LINEAR_RMSNORM}
