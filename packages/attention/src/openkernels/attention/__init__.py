"""openkernels.attention: fused attention for PyTorch (training and prefill).

Backends: Triton (CUDA and ROCm), CPU, reference.
"""

from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import attention, attention_varlen
from .hf import hf_attention_forward, register_with_transformers

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "hf_attention_forward", "register_with_transformers"]

del _ops
