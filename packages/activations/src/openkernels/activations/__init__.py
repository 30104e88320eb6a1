"""openkernels.activations: fused GELU, SiLU and gated activations for PyTorch.

Backends: Triton (CUDA and ROCm), fused C++ (CPU, compiled on first use), reference.
"""

from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import (
    Gelu,
    GeluAndMul,
    GeluQuick,
    MulAndSilu,
    ReluSquared,
    Silu,
    SiluAndMul,
    gelu,
    gelu_and_mul,
    gelu_quick,
    mul_and_silu,
    relu_squared,
    silu,
    silu_and_mul,
)

__version__ = "0.3.3"

__all__ = [
    "Gelu",
    "GeluAndMul",
    "GeluQuick",
    "MulAndSilu",
    "ReluSquared",
    "Silu",
    "SiluAndMul",
    "gelu",
    "gelu_and_mul",
    "gelu_quick",
    "mul_and_silu",
    "relu_squared",
    "silu",
    "silu_and_mul",
]

del _ops
