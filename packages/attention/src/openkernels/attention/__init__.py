"""openkernels.attention: fused attention for PyTorch (training, prefill, and decode against a
(paged, int8/int4 quantized) KV cache).

Backends: Triton (CUDA and ROCm), CPU, reference.
"""

from . import ops as _ops  # registers the torch.library ops and dispatch entries
from .api import attention, attention_varlen, attention_with_kvcache
from .hf import hf_attention_forward, register_with_transformers
from .kvcache import KVCache
from .kvformat import QuantizedKV, dequantize_kv, quantize_kv

__version__ = "0.2.0"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "KVCache",
    "QuantizedKV",
    "quantize_kv",
    "dequantize_kv",
    "hf_attention_forward",
    "register_with_transformers",
    "OpenKernelsCache",
]

del _ops


def __getattr__(name: str):
    """`OpenKernelsCache` (a transformers Cache) is built on first use: the package imports
    without transformers."""
    if name == "OpenKernelsCache":
        from . import hf_cache

        return hf_cache.OpenKernelsCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
