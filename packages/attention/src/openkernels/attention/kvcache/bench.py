"""Benchmark cases of decoding against a KV cache: one query token per sequence, GQA.

Decode is memory-bound: each case's `bytes` is the KV cache of the bf16 layout (K and V,
B·S·Hkv·D·2 bytes each), so GB/s reads as "bf16 cache served per second" for every
contender: the quantized caches read fewer bytes and may go past the copy ceiling (their
ratio to it is the speed-up a 16-bit kernel at copy bandwidth could not have).
Shapes: (batch, heads_q, heads_kv, seqlen, head_dim); every sequence holds `seqlen` tokens.
Contenders (each cache built from the same bf16 K/V in a setup step, outside the timing):
  ours            KVCache bf16, contiguous          ours-paged16 / ours-paged256: paged, pages
  ours-int8       KVCache int8 (group = head)       in a random order
  ours-int4       KVCache int4 (group = head)       ours-int4-g32: int4, groups of 32
  ours-fp8        KVCache fp8 e4m3 (scale 1.0 per head)
  ours-int4-keys32  KVCache int4, keys by channel over groups of 32 tokens, values per token
  ours-step       a static cache's decode step on the bf16 cache: the new token's keys and
                  values appended and attended in one op (attention_kvcache_append: on CUDA
                  the append inside the attention kernel), the same slot rewritten each call
  sdpa            F.scaled_dot_product_attention(enable_gqa=True) on the bf16 cache (B, H, S, D)
  flex            FlexAttention (enable_gqa=True, no mask: the query is the last position),
                  torch.compile(dynamic=False)'d once per case
`KVCache.attend` is the call timed for ours: it knows its lengths, so no device-to-host copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import BenchCase, compiled_peer

from .cache import KVCache

__all__ = ["GPU_SHAPES", "CPU_SHAPES", "FORMATS", "PEERS", "cases", "kv_bytes"]

# DESIGN.md's decode anchors (GQA 32/8, D128) and the long single sequence.
GPU_SHAPES = ((32, 32, 8, 4096, 128), (8, 32, 8, 32768, 128), (1, 32, 8, 131072, 128))
CPU_SHAPES = ((4, 32, 8, 1024, 128),)
# contender -> KVCache arguments
FORMATS: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours-paged16": {"page_size": 16},
    "ours-paged256": {"page_size": 256},
    "ours-int8": {"kv_dtype": "int8"},
    "ours-int4": {"kv_dtype": "int4"},
    "ours-int4-g32": {"kv_dtype": "int4", "group_size": 32},
    "ours-fp8": {"kv_dtype": "fp8"},
    "ours-int4-keys32": {"kv_dtype": "int4", "key_group": 32},
}
STEPS = ("ours-step",)
OP_CONTENDERS = STEPS  # `openkernels env` explains attention_kvcache_append on this one's call
PEERS = ("sdpa", "flex")


def kv_bytes(shape: tuple[int, int, int, int, int], element_size: int = 2) -> int:
    b, _, hkv, s, d = shape
    return 2 * b * s * hkv * d * element_size


def _cache_setup(options: dict[str, Any]) -> Callable[[dict], dict]:
    def prepare(s: dict) -> dict:
        k, v = s["k"], s["v"]
        b, n, hkv, d = k.shape
        cache = KVCache(b, n, hkv, d, device=k.device, **{"kv_dtype": k.dtype, **options})
        if cache.page_size is not None:  # pages in a random order, as a serving engine leaves them
            pages = torch.randperm(cache.block_table.numel(), device=k.device, dtype=torch.int64)
            cache.block_table = pages.to(torch.int32).view_as(cache.block_table)
        cache.append(k, v)
        return {"q": s["q"], "cache": cache}

    return prepare


def _step_setup(s: dict) -> dict:
    """A cache of the case's tokens with room for one more, and that token's keys and values."""
    k, v = s["k"], s["v"]
    b, n = k.shape[:2]
    k_cache = torch.cat([k, torch.zeros_like(k[:, :16])], 1)
    v_cache = torch.cat([v, torch.zeros_like(v[:, :16])], 1)
    seqlens = torch.full((b,), n - 1, dtype=torch.int32, device=k.device)
    return {"q": s["q"], "k_cache": k_cache, "v_cache": v_cache, "seqlens": seqlens, "lengths": [n] * b,
            "k_new": k[:, -1:].clone(), "v_new": v[:, -1:].clone()}  # fmt: skip


def _step(s: dict) -> Any:
    from .api import _kvcache_append_call

    return _kvcache_append_call(s["q"], s["k_cache"], s["v_cache"], s["seqlens"], s["k_new"], s["v_new"], None, None,
                                None, True, None, (-1, -1), 0.0, None, s["lengths"])[0]  # fmt: skip


def _bhsd_setup(s: dict) -> dict:
    return {"q": s["q"].transpose(1, 2).contiguous(), "k": s["k"].transpose(1, 2).contiguous(),
            "v": s["v"].transpose(1, 2).contiguous()}  # fmt: skip


def _flex() -> Callable[[dict], Any]:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = compiled_peer(flex_attention)
    return lambda s: compiled(s["q"], s["k"], s["v"], enable_gqa=True)


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, int, int, int, int]] | None = None,
    formats: Sequence[str] | None = None,
    peers: Sequence[str] = PEERS,
    dtype: torch.dtype = torch.bfloat16,
) -> list[BenchCase]:
    """Decode cases on `device` (GPU_SHAPES on CUDA, CPU_SHAPES on CPU)."""
    device = torch.device(device)
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    formats = [*FORMATS, *STEPS] if formats is None else list(formats)
    unknown = set(formats) - set(FORMATS) - set(STEPS) | set(peers) - set(PEERS)
    if unknown:
        raise ValueError(
            f"decode benchmark contenders are {[*FORMATS, *STEPS, *PEERS]}, got {sorted(unknown)}"
        )
    out = []
    for shape in shapes:
        b, hq, hkv, n, d = shape

        def make(dev: torch.device, b=b, hq=hq, hkv=hkv, n=n, d=d) -> dict:
            return {"q": torch.randn(b, 1, hq, d, device=dev, dtype=dtype),
                    "k": torch.randn(b, n, hkv, d, device=dev, dtype=dtype),
                    "v": torch.randn(b, n, hkv, d, device=dev, dtype=dtype)}  # fmt: skip

        fns: dict[str, Callable[[dict], Any]] = {}
        setup: dict[str, Callable[[dict], dict]] = {}
        for name in formats:
            if name in STEPS:
                fns[name], setup[name] = _step, _step_setup
                continue
            fns[name] = lambda s: s["cache"].attend(s["q"])
            setup[name] = _cache_setup(FORMATS[name])
        if "sdpa" in peers:
            fns["sdpa"] = lambda s: F.scaled_dot_product_attention(s["q"], s["k"], s["v"], enable_gqa=True)
            setup["sdpa"] = _bhsd_setup
        if "flex" in peers:
            try:
                fns["flex"] = _flex()
                setup["flex"] = _bhsd_setup
            except ImportError:  # a torch without FlexAttention
                pass
        out.append(
            BenchCase("attention", "decode", "fwd", shape, dtype, kv_bytes(shape), make, fns, setup=setup)
        )
    return out
