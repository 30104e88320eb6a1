"""Plain PyTorch definitions of every activation op: the definition of correct.

`<op>_ref` functions are differentiable and compute in the input's precision when it is
float64 and in float32 otherwise, rounding once to the input dtype (the kernels' casting
contract). Tests call them on float64 inputs; the reference backend calls the
`*_into` functions, which write into preallocated outputs.
"""

from __future__ import annotations

import math

import torch

from .spec import Act

__all__ = [
    "act_ref",
    "act_grad_ref",
    "silu_ref",
    "gelu_ref",
    "gelu_quick_ref",
    "relu_squared_ref",
    "silu_and_mul_ref",
    "gelu_and_mul_ref",
    "mul_and_silu_ref",
    "glu_ref",
    "unary_fwd",
    "unary_bwd",
    "gated_fwd",
    "gated_bwd",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def act_ref(x: torch.Tensor, act: Act) -> torch.Tensor:
    """act(x), elementwise, in x's own dtype (callers upcast)."""
    if act == Act.SILU:
        return x * torch.sigmoid(x)
    if act == Act.GELU:
        # Phi(x) as erfc(-x / sqrt 2) / 2: 1 + erf(x / sqrt 2) cancels for x << 0 (float32
        # loses every digit below x = -4, where gelu(x) is still -1e-4).
        return 0.5 * x * torch.erfc(-x / math.sqrt(2.0))
    if act == Act.GELU_TANH:
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
    if act == Act.GELU_QUICK:
        return x * torch.sigmoid(1.702 * x)
    if act == Act.RELU_SQUARED:
        return torch.relu(x) ** 2
    if act == Act.SIGMOID:
        return torch.sigmoid(x)
    raise ValueError(f"unknown activation {act!r}")


def act_grad_ref(x: torch.Tensor, act: Act) -> torch.Tensor:
    """d act(x) / dx, elementwise, in x's own dtype."""
    # 1 - sigmoid(z) is computed as sigmoid(-z): the subtraction cancels in float32 and
    # the derivatives multiply it by large factors.
    if act == Act.SILU:
        s = torch.sigmoid(x)
        return s * (1.0 + x * torch.sigmoid(-x))
    if act == Act.GELU:
        return 0.5 * torch.erfc(-x / math.sqrt(2.0)) + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if act == Act.GELU_TANH:
        # 0.5 (1 + tanh u) = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u) sigmoid(-2u)
        u = _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
        du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return torch.sigmoid(2 * u) + 2.0 * x * torch.sigmoid(2 * u) * torch.sigmoid(-2 * u) * du
    if act == Act.GELU_QUICK:
        s = torch.sigmoid(1.702 * x)
        return s + 1.702 * x * s * torch.sigmoid(-1.702 * x)
    if act == Act.RELU_SQUARED:
        return 2.0 * torch.relu(x)
    if act == Act.SIGMOID:
        return torch.sigmoid(x) * torch.sigmoid(-x)
    raise ValueError(f"unknown activation {act!r}")


def _unary(x: torch.Tensor, act: Act) -> torch.Tensor:
    return act_ref(x.to(_compute_dtype(x)), act).to(x.dtype)


def _gated(x: torch.Tensor, act: Act, act_first: bool) -> torch.Tensor:
    a, b = x.to(_compute_dtype(x)).chunk(2, dim=-1)
    out = act_ref(a, act) * b if act_first else a * act_ref(b, act)
    return out.to(x.dtype)


def silu_ref(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, Act.SILU)


def gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _unary(x, Act.GELU_TANH if approximate == "tanh" else Act.GELU)


def gelu_quick_ref(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, Act.GELU_QUICK)


def relu_squared_ref(x: torch.Tensor) -> torch.Tensor:
    return _unary(x, Act.RELU_SQUARED)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, Act.SILU, act_first=True)


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return _gated(x, Act.GELU_TANH if approximate == "tanh" else Act.GELU, act_first=True)


def mul_and_silu_ref(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, Act.SILU, act_first=False)


def glu_ref(x: torch.Tensor) -> torch.Tensor:
    return _gated(x, Act.SIGMOID, act_first=False)


# Backend entry points: 2D tensors, outputs preallocated (see ops.py for the contract).


def unary_fwd(x: torch.Tensor, out: torch.Tensor, act: int) -> None:
    out.copy_(_unary(x, Act(act)))


def unary_bwd(grad_out: torch.Tensor, x: torch.Tensor, grad_in: torch.Tensor, act: int) -> None:
    dt = _compute_dtype(x)
    grad_in.copy_(grad_out.to(dt) * act_grad_ref(x.to(dt), Act(act)))


def gated_fwd(x: torch.Tensor, out: torch.Tensor, act: int, *, act_first: bool) -> None:
    out.copy_(_gated(x, Act(act), act_first))


def gated_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, grad_in: torch.Tensor, act: int, *, act_first: bool
) -> None:
    dt = _compute_dtype(x)
    g = grad_out.to(dt)
    a, b = x.to(dt).chunk(2, dim=-1)
    if act_first:
        grad_a, grad_b = g * b * act_grad_ref(a, Act(act)), g * act_ref(a, Act(act))
    else:
        grad_a, grad_b = g * act_ref(b, Act(act)), g * a * act_grad_ref(b, Act(act))
    d = a.shape[-1]
    grad_in[..., :d].copy_(grad_a)
    grad_in[..., d:].copy_(grad_b)
