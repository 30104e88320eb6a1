"""openkernels.layernorm: fused LayerNorm and RMSNorm for PyTorch, with a fused residual add.

Backends: Triton (CUDA and ROCm), fused C++ (CPU, compiled on first use), reference.
"""

from . import api as _api
from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import *  # noqa: F403 - the public API is api.__all__ (named by problem.NORMS)

__version__ = "0.11.15"

__all__ = _api.__all__

del _ops, _api
