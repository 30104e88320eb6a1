"""What each activation op computes, as data shared by every backend.

Gated ops split the last dim of x, shape (..., 2d), into halves a = x[..., :d] and
b = x[..., d:]. `*_and_mul` ops return act(a) * b (activated half first); `mul_and_silu`
(vLLM's convention) and `glu` (torch.nn.functional.glu over the last dim) return
a * act(b). Every backend computes in float32 and rounds once to the input dtype.

Adding an activation: an `Act` code and an `OpSpec` here, then the code's formula and
derivative in reference.py, triton/kernels.py, cpu/activations.cpp and jax/jnp.py, and the
public function and module in api.py; the JAX functions, the benchmark variants and their
torch peers follow from this table (docs/adding-a-kernel.md, "Adding an activation").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["Act", "APPROXIMATE", "OpSpec", "SPECS", "act_for"]

APPROXIMATE = ("none", "tanh")  # the GELU ops' approximate= values


class Act(IntEnum):
    """Activation codes passed to kernels (Triton constexpr, C++ switch)."""

    SILU = 0  # x * sigmoid(x)
    GELU = 1  # x * Phi(x), exact (erf)
    GELU_TANH = 2  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    GELU_QUICK = 3  # x * sigmoid(1.702 x)
    RELU_SQUARED = 4  # max(x, 0)^2
    SIGMOID = 5  # 1 / (1 + exp(-x))


@dataclass(frozen=True)
class OpSpec:
    name: str
    gated: bool
    act_first: bool = True  # gated: act(a) * b; False: a * act(b)
    approximate: bool = False  # takes approximate="none" | "tanh" (GELU family)
    act: Act = Act.SILU
    # The torch.nn.functional function that computes the whole op, called as fn(x) (with
    # approximate= for the GELU ops): the benchmarks' eager peer. None: the activation's
    # torch form, times the other half for gated ops (bench.torch_composition).
    torch_peer: str | None = None
    # The public function's docstring (api.py makes the function from this table).
    doc: str = ""


# One row per op (a table: kept one line each).
# fmt: off
SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("silu", gated=False, act=Act.SILU, doc="x * sigmoid(x), elementwise. Any shape; returns x's shape and dtype."),
        OpSpec("gelu", gated=False, approximate=True, act=Act.GELU, doc='GELU: x * Phi(x) ("none", exact erf) or its tanh approximation ("tanh").'),
        OpSpec("gelu_quick", gated=False, act=Act.GELU_QUICK, doc="x * sigmoid(1.702 x), elementwise."),
        OpSpec("relu_squared", gated=False, act=Act.RELU_SQUARED, doc="max(x, 0)^2, elementwise."),
        OpSpec("silu_and_mul", gated=True, act=Act.SILU, doc="silu(x[..., :d]) * x[..., d:] for x of shape (..., 2d); returns (..., d)."),
        OpSpec("gelu_and_mul", gated=True, approximate=True, act=Act.GELU, doc="gelu(x[..., :d], approximate) * x[..., d:] for x of shape (..., 2d); returns (..., d)."),
        OpSpec("mul_and_silu", gated=True, act_first=False, act=Act.SILU, doc="x[..., :d] * silu(x[..., d:]) for x of shape (..., 2d); returns (..., d)."),
        OpSpec("glu", gated=True, act_first=False, act=Act.SIGMOID, torch_peer="glu", doc="x[..., :d] * sigmoid(x[..., d:]) for x of shape (..., 2d); returns (..., d): GLU over the last dim."),
    )
}
# fmt: on


def act_for(spec: OpSpec, approximate: str = "none") -> Act:
    """The activation code of one call; `approximate` only matters for the GELU ops."""
    if spec.approximate and approximate == "tanh":
        return Act.GELU_TANH
    return spec.act
