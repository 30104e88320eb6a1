"""openkernels.quant: 4-bit weight-only linear layers (int4 with per-group scales and zeros,
NF4), from batch 1 decode to prefill; GPTQ and AWQ checkpoint import.

Backends: Triton (CUDA and ROCm), CPU (C++), reference.
"""

from . import ops as _ops  # registers the torch.library ops and dispatch entries
from . import problem as _problem
from .api import *  # noqa: F403 - the op table's functions (problem.OPS), and linear_parts
from .checkpoints import from_awq, from_gptq, load_awq_state_dict, load_gptq_state_dict
from .format import NF4_VALUES, Int4Weight
from .linear import (
    Int4Linear,
    QuantizeReport,
    load_quantized,
    quantize_model,
    save_quantized,
    use_tiled_codes,
)
from .quantize import quantize_int4, quantize_nf4

__version__ = "0.10.18"

__all__ = [
    "Int4Weight",
    "NF4_VALUES",
    "quantize_int4",
    "quantize_nf4",
    *_problem.OPS,  # the op table's functions
    "Int4Linear",
    "QuantizeReport",
    "quantize_model",
    "save_quantized",
    "load_quantized",
    "use_tiled_codes",
    "from_gptq",
    "from_awq",
    "load_gptq_state_dict",
    "load_awq_state_dict",
]

del _ops, _problem
