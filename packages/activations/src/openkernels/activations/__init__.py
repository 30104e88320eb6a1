"""openkernels.activations: fused GELU, SiLU and gated activations for PyTorch.

Backends: Triton (CUDA and ROCm), fused C++ (CPU, compiled on first use), reference.
"""

from . import api as _api
from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import *  # noqa: F403 - the public API is api.__all__ (a new op is added there only)

__version__ = "0.6.4"

__all__ = _api.__all__

del _ops, _api
