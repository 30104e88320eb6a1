"""openkernels.attention: fused attention for PyTorch (training, prefill, and decode against a
(paged, int8/int4/fp8 quantized) KV cache), and the rotary position embedding of q and k.

Backends: Triton (CUDA and ROCm), CPU, reference. One sub-package per problem, each with the
same inner layout (docs/adding-a-kernel.md): core/ (attention, attention_varlen), kvcache/
(attention_with_kvcache, KVCache, the quantized formats), rotary/ (apply_rotary). hf.py and
kernelize.py plug them into transformers; jax/ is the JAX face of all three.
"""

from .core.api import attention, attention_varlen  # importing an api registers its torch.library ops
from .hf import hf_attention_forward, register_with_transformers
from .kvcache.api import attention_with_kvcache
from .kvcache.cache import KVCache
from .kvcache.format import QuantizedKV, dequantize_kv, fp8_scale, quantize_fp8, quantize_kv
from .rotary.api import apply_rotary

__version__ = "0.8.15"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "apply_rotary",
    "KVCache",
    "QuantizedKV",
    "quantize_kv",
    "dequantize_kv",
    "quantize_fp8",
    "fp8_scale",
    "hf_attention_forward",
    "register_with_transformers",
    "OpenKernelsCache",
    "OpenKernelsStaticCache",
]


def __getattr__(name: str):
    """`OpenKernelsCache` and `OpenKernelsStaticCache` (transformers Caches) are built on first
    use: the package imports without transformers."""
    if name in ("OpenKernelsCache", "OpenKernelsStaticCache"):
        from .kvcache import hf as hf_cache

        return getattr(hf_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
