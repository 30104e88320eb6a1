"""Public functions and nn.Modules of the activations family, with argument checks.

Unary ops take x of any shape; gated ops take x of shape (..., 2d) and return (..., d).
Dtypes: float16, bfloat16, float32 on every backend; float64 on the reference backend.
Math is float32 inside, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from openkernels.shared import opdef, replay
from openkernels.shared.outputs import check_out

from . import ops
from .problem import check_approximate, check_shape, out_shape
from .spec import SPECS, OpSpec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(name: str, x: torch.Tensor, out: torch.Tensor | None, approximate: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}; supported: float16, bfloat16, float32, float64")
    check_approximate(name, approximate)
    check_shape(name, tuple(x.shape))
    if out is None:
        return
    # In place (out=x) is safe for an elementwise op: each element is read before it is
    # written, by the same thread. A gated op reads two elements per one it writes.
    in_place = () if SPECS[name].gated else ("x",)
    check_out(name, out, out_shape(name, tuple(x.shape)), x.dtype, x, {"x": x}, in_place=in_place)


def _call(name: str, x: torch.Tensor, out: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    _check(name, x, out, approximate)
    extra = (approximate,) if SPECS[name].approximate else ()
    if out is not None:
        if opdef.plain_eager(x, out):  # out= takes no autograd (checked)
            ops.forward_into(name, x, out, approximate)
        else:
            getattr(torch.ops.openkernels, f"{name}_out")(x, *extra, out=out)
        return out
    return ops.OPS[name](x, *extra)  # the op picks its path: eager, eager autograd or library


def _function(spec: OpSpec):
    """The public function of one op of the table: f(x, *, out=None), or f(x, approximate="none",
    *, out=None) for the GELU ops; replayable, its docstring the table's."""
    name = spec.name
    if spec.approximate:

        def fn(
            x: torch.Tensor, approximate: str = "none", *, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            return _call(name, x, out, approximate)

    else:

        def fn(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
            return _call(name, x, out)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = spec.doc
    return replay.replayable(fn)


# op name -> its function (silu, gelu, ..., glu), made from the op table.
FUNCTIONS = {name: _function(spec) for name, spec in SPECS.items()}
globals().update(FUNCTIONS)


class _Approximated(nn.Module):
    """Base of the GELU modules: validates and shows `approximate` ("none" or "tanh")."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        check_approximate(type(self).__name__, approximate)
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def module_name(op: str) -> str:
    """The nn.Module of op `op`: its name in CamelCase (silu_and_mul -> SiluAndMul)."""
    return "".join(part.capitalize() for part in op.split("_"))


def _module(spec: OpSpec) -> type[nn.Module]:
    """The module form of one op of the table: forward(x) calls the function (with the
    module's `approximate` for the GELU ops)."""
    fn = FUNCTIONS[spec.name]
    if spec.approximate:

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x, self.approximate)

    else:

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x)

    name = module_name(spec.name)
    doc = f"Module form of `{spec.name}`" + (": (..., 2d) -> (..., d)" if spec.gated else "")
    doc += '; approximate is "none" (erf) or "tanh".' if spec.approximate else "."
    base = _Approximated if spec.approximate else nn.Module
    return type(
        name, (base,), {"__module__": __name__, "__qualname__": name, "__doc__": doc, "forward": forward}
    )


# op name -> its module (Silu, Gelu, GeluQuick, ..., Glu), made from the op table.
MODULES: dict[str, type[nn.Module]] = {name: _module(spec) for name, spec in SPECS.items()}
globals().update({cls.__name__: cls for cls in MODULES.values()})

# The functions and modules are named by the op table (spec.SPECS).
__all__ = [*SPECS, *(cls.__name__ for cls in MODULES.values())]
