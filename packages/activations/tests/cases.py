"""Op variants, shapes and implementations the activation tests run over."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import openkernels.activations as A
from openkernels.activations import reference as R
from openkernels.activations.spec import APPROXIMATE, SPECS
from openkernels.shared.dev import testing
from openkernels.shared.dev.testing import ODD_SIZES
from openkernels.shared.platform import triton_interpreting


@dataclass(frozen=True)
class Variant:
    op: str
    approximate: str | None = None

    @property
    def gated(self) -> bool:
        return SPECS[self.op].gated

    @property
    def id(self) -> str:
        return f"{self.op}-{self.approximate}" if self.approximate else self.op

    def args(self) -> tuple:
        return (self.approximate,) if self.approximate else ()

    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return getattr(A, self.op)(x, *self.args(), **kwargs)

    def ref(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(R, f"{self.op}_ref")(x, *self.args())

    def grad_ref(self, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
        """The reference's gradient with respect to x, in float64."""
        x64 = x.detach().to(torch.float64).requires_grad_()
        (grad,) = torch.autograd.grad(self.ref(x64), x64, grad_out.to(torch.float64))
        return grad

    @property
    def library_op(self):
        return getattr(torch.ops.openkernels, self.op).default


# Every op of the table, the GELU ops once per `approximate` value: a new op is tested as
# soon as it is in spec.SPECS.
VARIANTS = [
    Variant(name, approximate)
    for name, spec in SPECS.items()
    for approximate in (APPROXIMATE if spec.approximate else (None,))
]
KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def variant_params():
    return [pytest.param(v, id=v.id) for v in VARIANTS]


def targets():
    """(device, implementation) params of every test that runs all implementations."""
    return testing.targets("silu")


def shapes(gated: bool) -> list[tuple[int, ...]]:
    """Odd shapes; small ones under the interpreter, which runs each program in Python."""
    if triton_interpreting():
        # (64, 128) divides the 4096-element tile exactly: the unmasked (EVEN) kernels.
        base = [(1, 1), (7, 7), (33, 130), (2, 3, 5), (64, 128)]
    else:
        base = [(1, ODD_SIZES[0]), (7, 127), (127, ODD_SIZES[3]), (4097, 7), (2, 3, 130), (64, 128)]
    return [(*s[:-1], 2 * s[-1]) if gated else s for s in base]
