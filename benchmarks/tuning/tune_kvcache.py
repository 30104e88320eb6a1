"""Sweep launch configs and split counts of the KV-cache decode kernel on this GPU.

    python benchmarks/tuning/tune_kvcache.py [--quick]

For each shape and cache format: every (block_n, warps, stages) candidate that compiles
without spills, at several split counts; prints microseconds and GB/s of the bytes the
format actually reads, against the copy ceiling measured here. Times are CUDA-graph replays
(`do_bench_cudagraph`): a decode kernel of 0.1 ms is shorter than the launcher's host path,
so `do_bench` of the eager call measured the host (every config within noise of the others).

    python benchmarks/tuning/tune_kvcache.py --formats int4,fp8 --shapes 32x4096,8x32768 \
        --blocks 64,128 --warps 4 --stages 2,3 --per-sm 2,4,8
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench, do_bench_cudagraph

from openkernels.attention import KVCache, QuantizedKV
from openkernels.attention.core.triton.configs import AttnConfig
from openkernels.attention.kvcache import triton as launcher
from openkernels.shared.dev.bench import copy_ceiling_gbps

SHAPES = "32x4096,8x32768,1x131072"  # batch x cached tokens, GQA 32/8, head_dim 128
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


def _time(fn) -> float:
    """Milliseconds per call from CUDA-graph replays (the kernels alone, no host path)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument(
        "--configs", default="", help="keys/warps pairs (64/4,32/1) instead of blocks x warps"
    )
    parser.add_argument("--per-sm", default="1,2,4,8,16", help="programs per SM the split count aims at")
    parser.add_argument("--min-blocks", type=int, default=4, help="key blocks each split keeps at least")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-splits", type=int, default=128, help="the most splits of the key axis")
    args = parser.parse_args()
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    blocks, warps, per_sms = ints(args.blocks), ints(args.warps), ints(args.per_sm)
    shapes = [
        (int(b), 32, 8, int(n), args.head_dim) for b, n in (s.split("x") for s in args.shapes.split(","))
    ]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    stages = tuple(int(x) for x in args.stages.split(",")) if not args.quick else (3,)
    formats = {name: FORMATS[name] for name in args.formats.split(",")}
    for shape, (fmt, opts) in itertools.product(shapes, formats.items()):
        b, hq, hkv, n, d = shape
        cache = KVCache(b, n, hkv, d, device=dev, **{"kv_dtype": torch.bfloat16, **opts})
        cache.append(torch.randn(b, n, hkv, d, device=dev, dtype=torch.bfloat16),
                     torch.randn(b, n, hkv, d, device=dev, dtype=torch.bfloat16))  # fmt: skip
        q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
        nbytes = cache.nbytes
        rows = []
        base_programs = b * hkv
        pairs = [tuple(map(int, c.split("/"))) for c in args.configs.split(",")] if args.configs else None
        candidates = (
            [(bn, w, st) for (bn, w), st in itertools.product(pairs, stages)]
            if pairs
            else (itertools.product(blocks, warps, stages))
        )
        for bn, w, st in candidates:
            cfg = AttnConfig(16, bn, w, st)
            for per_sm in per_sms:
                splits = max(
                    1, min(args.max_splits, -(-per_sm * sms // base_programs), n // (args.min_blocks * bn))
                )
                try:
                    ms = _time(_call(cache, q, cfg, splits))
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
        ms = _time(heuristic)
        print(f"{label}: shipped config: {ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s")
        wall = do_bench(heuristic, warmup=10, rep=40, return_mode="median")
        print(f"{label}: shipped config, eager launch (host included): {wall * 1e3:7.1f} us")
        del cache


if __name__ == "__main__":
    main()
