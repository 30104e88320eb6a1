"""torch.library ops of the activations family and their dispatch registrations.

Every public op `<op>` is three library ops in the `openkernels` namespace:
  openkernels::<op>(Tensor x[, str approximate]) -> Tensor
  openkernels::<op>_out(Tensor x[, str approximate], *, Tensor(a!) out) -> ()
  openkernels::<op>_backward(Tensor grad_out, Tensor x[, str approximate]) -> Tensor
each with a fake impl, and autograd registered on the functional op. Their device impl
asks `openkernels.shared.dispatch` for the best backend; backends implement
  unary_fwd(x, out, act) / unary_bwd(grad_out, x, grad_in, act)
  gated_fwd(x, out, act, *, act_first) / gated_bwd(grad_out, x, grad_in, act, *, act_first)
on 2D tensors: x and grad_out with unit column stride and any row stride, out and grad_in
contiguous, all of one dtype.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch
from openkernels.shared.layout import as_rows

from .spec import SPECS, OpSpec, act_for

__all__ = ["forward", "forward_into", "backward", "KERNEL_DTYPES"]

_PKG = "openkernels.activations"
# Dtypes the Triton and C++ kernels take; float64 runs on the reference implementation.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# One explicit schema per library op; `approximate` only for the GELU family.
_SCHEMAS: dict[str, tuple[str, str, str]] = {
    "silu": (
        "(Tensor x) -> Tensor",
        "(Tensor x, *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x) -> Tensor",
    ),
    "gelu": (
        "(Tensor x, str approximate='none') -> Tensor",
        "(Tensor x, str approximate='none', *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x, str approximate='none') -> Tensor",
    ),
    "gelu_quick": (
        "(Tensor x) -> Tensor",
        "(Tensor x, *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x) -> Tensor",
    ),
    "relu_squared": (
        "(Tensor x) -> Tensor",
        "(Tensor x, *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x) -> Tensor",
    ),
    "silu_and_mul": (
        "(Tensor x) -> Tensor",
        "(Tensor x, *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x) -> Tensor",
    ),
    "gelu_and_mul": (
        "(Tensor x, str approximate='none') -> Tensor",
        "(Tensor x, str approximate='none', *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x, str approximate='none') -> Tensor",
    ),
    "mul_and_silu": (
        "(Tensor x) -> Tensor",
        "(Tensor x, *, Tensor(a!) out) -> ()",
        "(Tensor grad_out, Tensor x) -> Tensor",
    ),
}
assert _SCHEMAS.keys() == SPECS.keys()

_LIB = torch.library.Library("openkernels", "FRAGMENT")
# (op, approximate) -> Act code as an int, looked up once per call.
_ACT_CODES = {(name, a): int(act_for(spec, a)) for name, spec in SPECS.items() for a in ("none", "tanh")}


def _out_shape(spec: OpSpec, x: torch.Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], x.shape[-1] // 2) if spec.gated else tuple(x.shape)


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
    out = x.new_empty(_out_shape(SPECS[name], x))
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


def _register_backends(spec: OpSpec) -> None:
    kind = "gated" if spec.gated else "unary"
    bound = {"act_first": spec.act_first} if spec.gated else {}
    for op, direction, key_fn in ((spec.name, "fwd", _fwd_key), (f"{spec.name}_backward", "bwd", _bwd_key)):
        dispatch.define(op, key_fn)
        entry = f"{kind}_{direction}"
        dispatch.register(
            op,
            "triton",
            dispatch.lazy(f"{_PKG}.triton:{entry}", **bound),
            backends=("cuda", "rocm"),
            priority=20,
            supports=_triton_supports,
            interpretable=True,
        )
        dispatch.register(
            op,
            "cpu",
            dispatch.lazy(f"{_PKG}.cpu:{entry}", **bound),
            backends=("cpu",),
            priority=10,
            supports=_cpu_supports,
        )
        dispatch.register(
            op,
            "reference",
            dispatch.lazy(f"{_PKG}.reference:{entry}", **bound),
            backends=("cuda", "rocm", "cpu"),
            priority=0,
        )


def _triton_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"dtype {key.dtype} runs on the reference implementation"
    return dispatch.triton_supports(key)


def _cpu_supports(key: dispatch.DispatchKey) -> str | None:
    from .cpu import supports  # imports no compiler; the library builds on first call

    return supports(key)


def _define_library_ops(spec: OpSpec) -> None:
    name = spec.name
    fwd_schema, out_schema, bwd_schema = _SCHEMAS[name]
    _LIB.define(name + fwd_schema)
    _LIB.define(f"{name}_out{out_schema}", tags=())
    _LIB.define(f"{name}_backward{bwd_schema}")
    qualified = f"openkernels::{name}"

    # Device impls: every device type goes through dispatch, which picks per backend.
    def fwd_impl(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return forward(name, x, approximate)

    def out_impl(x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor) -> None:
        forward_into(name, x, out, approximate)

    def bwd_impl(grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return backward(name, grad_out, x, approximate)

    for op_name, impl in ((name, fwd_impl), (f"{name}_out", out_impl), (f"{name}_backward", bwd_impl)):
        _LIB.impl(op_name, impl, "CompositeExplicitAutograd")

    # Fakes: shapes and dtypes only, for torch.compile and meta tensors.
    def fwd_fake(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return x.new_empty(_out_shape(spec, x))

    def out_fake(x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor) -> None:
        return None

    def bwd_fake(grad_out: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    torch.library.register_fake(qualified, fwd_fake, lib=_LIB)
    torch.library.register_fake(f"{qualified}_out", out_fake, lib=_LIB)
    torch.library.register_fake(f"{qualified}_backward", bwd_fake, lib=_LIB)

    backward_op = getattr(torch.ops.openkernels, f"{name}_backward").default

    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.approximate = inputs[1] if len(inputs) > 1 else None
        ctx.dispatch_context = dispatch.snapshot()  # the backward runs under the forward's force/strict

    def autograd_bwd(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.approximate is None:
            return ctx.dispatch_context.run(backward_op, grad_out, x)
        return ctx.dispatch_context.run(backward_op, grad_out, x, ctx.approximate), None

    torch.library.register_autograd(qualified, autograd_bwd, setup_context=setup_context, lib=_LIB)

    def no_double_backward(ctx, grad):
        raise NotImplementedError(f"openkernels::{name}: double backward is not supported")

    torch.library.register_autograd(f"{qualified}_backward", no_double_backward, lib=_LIB)


for _spec in SPECS.values():
    _define_library_ops(_spec)
    _register_backends(_spec)
