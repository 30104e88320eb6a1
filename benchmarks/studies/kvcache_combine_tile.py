"""The KV-cache decode's split combine with every split's partial loaded as one tile (attention
0.8.9, plan.COMBINE_SPLITS_TILE, the default since 0.8.10) against the split loop, in
one process.

The combine launch merges the decode kernel's float32 partials by their lse. Its split loop
issued one partial's load after the other's, each waiting on memory; the tile issues them
together. Each case times the shipped decode (the decode kernel and the combine the
launcher picks for a bfloat16 cache with nothing to append) as CUDA-graph replays (the kernels
alone), both variants alternating, and checks that they agree.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/kvcache_combine_tile.py [BxS:Hq/Hkv:D ...]
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench_cudagraph

from openkernels.attention import KVCache
from openkernels.attention.kvcache import triton as launcher
from openkernels.attention.kvcache.triton import plan as kv_plan
from openkernels.shared.dev.bench import copy_ceiling_gbps

CASES = ("1x4096:32/8:64", "1x32768:32/8:64", "1x4096:32/8:128", "8x4096:32/8:128", "32x4096:32/8:128")


def _parse(case: str) -> tuple[int, int, int, int, int]:
    shape, heads, d = case.split(":")
    b, s = (int(x) for x in shape.split("x"))
    hq, hkv = (int(x) for x in heads.split("/"))
    return b, s, hq, hkv, int(d)


def _decode(cache: KVCache, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """The launcher's call for `q` against the whole cache (the shipped config and splits)."""
    n = max(cache.lengths)
    return lambda: launcher.attention_kvcache_fwd(
        q, cache.k, cache.v, None, None, None, None, out, lse, cache.seqlens, None, None, None, seqlen_new=0,
        max_seqlen_k=n, scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0, alibi_slopes=None, softcap=0.0,
        rotary_interleaved=False, bits=16, group_size=q.shape[-1],
    )  # fmt: skip


def _use(tile: bool) -> None:
    kv_plan.COMBINE_SPLITS_TILE = tile
    kv_plan.kvcache.cache_clear()
    launcher._plans.clear()


def main(cases: list[str]) -> None:
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"{torch.cuda.get_device_name(dev)}; us per call (decode + combine), CUDA-graph replays, median of 5 "
          f"rounds; GB/s of the cache read, against the copy ceiling {ceiling:.0f} GB/s")  # fmt: skip
    print(
        "| B x S, Hq/Hkv, D | splits | split loop | one tile | tile GB/s (of copy) | loop / tile | max |out diff| |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        b, s, hq, hkv, d = _parse(case)
        cache = KVCache(b, s, hkv, d, kv_dtype=torch.bfloat16, device=dev)
        cache.append(torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16),
                     torch.randn(b, s, hkv, d, device=dev, dtype=torch.bfloat16))  # fmt: skip
        q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.bfloat16)
        outs, times = {}, {True: [], False: []}
        for _ in range(5):
            for tile in (False, True):
                _use(tile)
                out = torch.empty_like(q)
                lse = torch.empty(b, hq, 1, device=dev, dtype=torch.float32)
                fn = _decode(cache, q, out, lse)
                fn()
                torch.cuda.synchronize()
                outs[tile] = out.clone()
                times[tile].append(do_bench_cudagraph(fn, rep=30, return_mode="median"))
        splits = next(iter(launcher._plans.values()))[0].splits
        loop, tile = (sorted(times[v])[2] * 1e3 for v in (False, True))
        diff = float((outs[True].float() - outs[False].float()).abs().max())
        gbps = cache.nbytes / tile / 1e3
        print(f"| {b}x{s}, {hq}/{hkv}, {d} | {splits} | {loop:.1f} | {tile:.1f} | {gbps:.0f} ({gbps / ceiling:.2f}) | "
              f"{loop / tile:.2f}x | {diff:.2e} |")  # fmt: skip
        del cache
    _use(False)  # the shipped default


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
