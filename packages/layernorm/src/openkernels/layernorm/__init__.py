"""openkernels.layernorm: fused LayerNorm and RMSNorm for PyTorch, with a fused residual add.

Backends: Triton (CUDA and ROCm), fused C++ (CPU, compiled on first use), reference.
"""

from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import AddLayerNorm, AddRMSNorm, LayerNorm, RMSNorm, layer_norm, rms_norm

__version__ = "0.6.0"

__all__ = ["AddLayerNorm", "AddRMSNorm", "LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]

del _ops
