"""torch.library ops of the activations family and their dispatch registrations.

Every public op `<op>` is three library ops in the `openkernels` namespace:
  openkernels::<op>(Tensor x[, str approximate]) -> Tensor
  openkernels::<op>_out(Tensor x[, str approximate], *, Tensor(a!) out) -> ()
  openkernels::<op>_backward(Tensor grad_out, Tensor x[, str approximate]) -> Tensor
each with a fake impl, and autograd registered on the functional op, all made from one
declaration by `openkernels.shared.opdef` (which also gives the eager fast paths, `OPS`).
Their device impl asks `openkernels.shared.dispatch` for the best backend; backends implement
  unary_fwd(x, out, act) / unary_bwd(grad_out, x, grad_in, act)
  gated_fwd(x, out, act, *, act_first) / gated_bwd(grad_out, x, grad_in, act, *, act_first)
on 2D tensors: x and grad_out with unit column stride and any row stride, out and grad_in
contiguous, all of one dtype.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch, opdef
from openkernels.shared.layout import as_rows

# The CPU backend's dispatch predicate; importing it compiles nothing (the library
# builds on its first call).
from .cpu import supports as _cpu_supports
from .problem import out_shape
from .spec import SPECS, OpSpec, act_for

__all__ = ["forward", "forward_into", "backward", "KERNEL_DTYPES", "OPS"]

_PKG = "openkernels.activations"
# Dtypes the Triton and C++ kernels take; float64 runs on the reference implementation.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_LIB = torch.library.Library("openkernels", "FRAGMENT")
# (op, approximate) -> Act code as an int, looked up once per call.
_ACT_CODES = {(name, a): int(act_for(spec, a)) for name, spec in SPECS.items() for a in ("none", "tanh")}


# Selection depends on x alone, so `dispatch.explain("silu_and_mul", x)` works with the
# public call's arguments as well as with the backend's.
def _fwd_key(x: torch.Tensor, *args: object, **kwargs: object) -> dispatch.DispatchKey:
    return dispatch.key_for(x)


def _bwd_key(
    grad_out: torch.Tensor, x: torch.Tensor, *args: object, **kwargs: object
) -> dispatch.DispatchKey:
    return dispatch.key_for(x)


def forward_into(name: str, x: torch.Tensor, out: torch.Tensor, approximate: str = "none") -> None:
    """Compute op `name` of x into the contiguous tensor `out` with the best backend."""
    if x.numel() == 0:
        return
    dispatch.run(name, as_rows(x), as_rows(out), _ACT_CODES[name, approximate])


def forward(name: str, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    out = x.new_empty(out_shape(name, tuple(x.shape)))
    forward_into(name, x, out, approximate)
    return out


def backward(name: str, grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Gradient of op `name` with respect to x, shape and dtype of x."""
    grad_in = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return grad_in
    grad_out = grad_out.to(x.dtype)
    codes = _ACT_CODES[name, approximate]
    dispatch.run(f"{name}_backward", as_rows(grad_out), as_rows(x), as_rows(grad_in), codes)
    return grad_in


def _impls(spec: OpSpec, direction: str) -> tuple[opdef.Impl, ...]:
    """One entry point per kind of op and direction (unary_fwd, gated_bwd, ...)."""
    entry = f"{'gated' if spec.gated else 'unary'}_{direction}"
    bound = {"act_first": spec.act_first} if spec.gated else {}
    return opdef.standard_impls(_PKG, entry, triton_supports=_triton_supports, cpu_supports=_cpu_supports,
                                bound=bound)  # fmt: skip


def _triton_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"dtype {key.dtype} runs on the reference implementation"
    return dispatch.triton_supports(key)


def _define(spec: OpSpec) -> opdef.DefinedOp:
    """openkernels::<op> (with autograd and <op>_backward) and openkernels::<op>_out."""
    name = spec.name
    approx = ", str approximate='none'" if spec.approximate else ""

    def fwd(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return forward(name, x, approximate)

    def bwd(grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return backward(name, grad_out, x, approximate)

    def save(inputs: tuple, output: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple]:
        return (inputs[0],), tuple(inputs[1:])  # x; approximate when the op has it

    def grads(run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
        return (run(grad_outputs[0], tensors[0], *values), *(None for _ in values))

    defined = opdef.define(
        _LIB,
        opdef.OpDef(
            name=name,
            schema=f"(Tensor x{approx}) -> Tensor",
            forward=fwd,
            fake=lambda x, approximate="none": x.new_empty(out_shape(name, tuple(x.shape))),
            key=_fwd_key,
            impls=_impls(spec, "fwd"),
            backward=opdef.BackwardDef(
                schema=f"(Tensor grad_out, Tensor x{approx}) -> Tensor",
                compute=bwd,
                fake=lambda grad_out, x, approximate="none": torch.empty_like(
                    x, memory_format=torch.contiguous_format
                ),
                save=save,
                grads=grads,
                key=_bwd_key,
                impls=_impls(spec, "bwd"),
            ),
        ),
    )

    def out_impl(x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor) -> None:
        forward_into(name, x, out, approximate)

    opdef.define(
        _LIB,
        opdef.OpDef(name=f"{name}_out", schema=f"(Tensor x{approx}, *, Tensor(a!) out) -> ()", forward=out_impl,
                    fake=lambda x, approximate="none", *, out: None),
    )  # fmt: skip
    return defined


# op name -> its callable (eager fast paths, library op otherwise)
OPS: dict[str, opdef.DefinedOp] = {spec.name: _define(spec) for spec in SPECS.values()}
