"""Sweep launch configs and split counts of the KV-cache decode kernel on this GPU.

    python benchmarks/tune_kvcache.py [--quick]

For each shape and cache format: every (block_n, warps, stages) candidate that compiles
without spills, at several split counts; prints microseconds and GB/s of the bytes the
format actually reads, against the copy ceiling measured here.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from openkernels.attention import KVCache, QuantizedKV
from openkernels.attention.triton import kvcache as launcher
from openkernels.attention.triton.configs import AttnConfig
from openkernels.shared.bench import copy_ceiling_gbps

SHAPES = ((32, 32, 8, 4096, 128), (1, 32, 8, 131072, 128))
FORMATS = {"bf16": {}, "int8": {"kv_dtype": "int8"}, "int4": {"kv_dtype": "int4"},
           "int4-g32": {"kv_dtype": "int4", "group_size": 32}, "int8-g32": {"kv_dtype": "int8", "group_size": 32},
           "paged16": {"page_size": 16}, "paged256": {"page_size": 256}, "fp8": {"kv_dtype": "fp8"}}  # fmt: skip


def _call(cache: KVCache, q, cfg, splits, gather=False):
    k, v = cache.k, cache.v
    quant = (k.scale, k.zero, v.scale, v.zero) if isinstance(k, QuantizedKV) else (None,) * 4
    kd = k.data if isinstance(k, QuantizedKV) else k
    vd = v.data if isinstance(v, QuantizedKV) else v
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    n = max(cache.lengths)
    return lambda: launcher.attention_kvcache_fwd(
        q, kd, vd, *quant, out, lse, cache.seqlens, cache.block_table, None, None, seqlen_new=0, max_seqlen_k=n,
        scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0, alibi_slopes=None, softcap=0.0,
        rotary_interleaved=False, bits=cache.bits, group_size=cache.group_size, config=cfg, num_splits=splits,
        scale_gather=gather,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--stages", default="2,3,4")
    args = parser.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    blocks = (32, 64, 128)
    warps = (4, 8)
    stages = tuple(int(x) for x in args.stages.split(",")) if not args.quick else (3,)
    formats = {name: FORMATS[name] for name in args.formats.split(",")}
    for shape, (fmt, opts) in itertools.product(SHAPES, formats.items()):
        b, hq, hkv, n, d = shape
        cache = KVCache(b, n, hkv, d, device=dev, **{"kv_dtype": torch.bfloat16, **opts})
        cache.append(torch.randn(b, n, hkv, d, device=dev, dtype=torch.bfloat16),
                     torch.randn(b, n, hkv, d, device=dev, dtype=torch.bfloat16))  # fmt: skip
        q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
        nbytes = cache.nbytes
        rows = []
        base_programs = b * hkv
        for bn, w, st in itertools.product(blocks, warps, stages):
            cfg = AttnConfig(16, bn, w, st)
            for per_sm in (1, 2, 4, 8, 16):
                splits = max(1, min(128, -(-per_sm * 132 // base_programs), n // (4 * bn)))
                try:
                    ms = do_bench(_call(cache, q, cfg, splits), warmup=10, rep=40, return_mode="median")
                except Exception as exc:
                    print(f"  {fmt} {cfg} failed: {type(exc).__name__}")
                    break
                rows.append((ms, bn, w, st, splits))
        rows.sort()
        label = f"B{b} S{n} {fmt} ({nbytes / 1e6:.0f} MB)"
        for ms, bn, w, st, splits in rows[:5]:
            gbps = nbytes / ms / 1e6
            print(f"{label}: n{bn} w{w} s{st} splits {splits:3d}: {ms * 1e3:7.1f} us {gbps:6.0f} GB/s "
                  f"{gbps / ceiling:.3f} of copy")  # fmt: skip
        heuristic = _call(cache, q, None, None)
        ms = do_bench(heuristic, warmup=10, rep=40, return_mode="median")
        print(f"{label}: shipped config: {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s")
        del cache


if __name__ == "__main__":
    main()
