"""The 1B decode step's attention (batch 1, 4096 cached tokens, GQA 32/8, head_dim 64, a
bfloat16 cache) across launch configs and split counts, with one cache per layer so that the
step's 16 caches (134 MB) rotate past the L2 as they do in the step, in one process.

The decode step's profile (H100, seventeenth session) put this at 7.5 us per layer plus
3.4 us of split combine for 8.4 MB of keys and values: 0.26-0.30 of the copy bandwidth, the
step's largest item after the int4 GEMVs. A short sequence gives few programs (8 KV heads)
and few key blocks per split; this sweeps the tile (keys x warps x stages), the split count
and the combine's one-tile load (plan.COMBINE_SPLITS_TILE) to see what the shipped plan
leaves. Each row: us per layer (decode + combine, CUDA-graph replays of all layers, median of
3 rounds), GB/s of the cache read and its ratio to the copy ceiling, max |difference| from
the shipped plan's output.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/kvcache_short_decode.py [--context 4096] [--head-dim 64] [--layers 16]
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench_cudagraph

from openkernels.attention import KVCache
from openkernels.attention.core.triton.configs import AttnConfig
from openkernels.attention.kvcache import triton as launcher
from openkernels.attention.kvcache.triton import plan as kv_plan
from openkernels.shared.dev.bench import copy_ceiling_gbps


def _layer_calls(caches, q, config, splits):
    """One launcher call per layer's cache; config / splits None: the shipped plan."""
    outs = [torch.empty_like(q) for _ in caches]
    lses = [torch.empty(q.shape[0], q.shape[2], 1, device=q.device) for _ in caches]

    def step():
        for cache, out, lse in zip(caches, outs, lses, strict=True):
            launcher.attention_kvcache_fwd(
                q, cache.k, cache.v, None, None, None, None, out, lse, cache.seqlens, None, None, None,
                seqlen_new=0, max_seqlen_k=max(cache.lengths), scale=q.shape[-1] ** -0.5, window_left=-1,
                window_right=0, alibi_slopes=None, softcap=0.0, rotary_interleaved=False, bits=16,
                group_size=q.shape[-1], config=config, num_splits=splits,
            )  # fmt: skip

    return step, outs


def _use_tile(tile: bool) -> None:
    kv_plan.COMBINE_SPLITS_TILE = tile
    kv_plan.kvcache.cache_clear()
    launcher._plans.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--splits", default="8,16,32,64")
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    s, d, hq, hkv = args.context, args.head_dim, 32, 8
    caches = []
    for _ in range(args.layers):
        cache = KVCache(1, s, hkv, d, kv_dtype=torch.bfloat16, device=dev)
        cache.append(torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16),
                     torch.randn(1, s, hkv, d, device=dev, dtype=torch.bfloat16))  # fmt: skip
        caches.append(cache)
    q = torch.randn(1, 1, hq, d, device=dev, dtype=torch.bfloat16)
    nbytes = caches[0].nbytes
    print(f"{torch.cuda.get_device_name(dev)}; B1 S{s} GQA {hq}/{hkv} D{d} bf16, {args.layers} caches of "
          f"{nbytes / 1e6:.1f} MB; copy ceiling {ceiling:.0f} GB/s; us per layer (decode + combine)")  # fmt: skip

    def timed(config, splits):
        step, outs = _layer_calls(caches, q, config, splits)
        step()
        torch.cuda.synchronize()
        ms = sorted(do_bench_cudagraph(step, rep=30, return_mode="median") for _ in range(3))[1]
        return ms * 1e3 / args.layers, outs[0].clone()

    results = {}
    for tile in (False, True):
        _use_tile(tile)
        us, out = timed(None, None)
        results[("shipped", tile)] = us
        if not tile:
            reference = out
        kv = next(iter(launcher._plans.values()))[0]
        print(f"shipped plan (tile {tile}): n{kv.main.config.block_n} w{kv.main.num_warps} "
              f"s{kv.main.num_stages} splits {kv.splits}: {us:.2f} us, "
              f"{nbytes / us / 1e3:.0f} GB/s ({nbytes / us / 1e3 / ceiling:.2f} of copy)")  # fmt: skip
    _use_tile(False)
    rows = []
    for bn, w, st in itertools.product(ints(args.blocks), ints(args.warps), ints(args.stages)):
        for splits in ints(args.splits):
            if splits * bn > s:
                continue
            try:
                us, out = timed(AttnConfig(16, bn, w, st), splits)
            except Exception as exc:  # a config that does not compile or launch: say so, go on
                print(f"n{bn} w{w} s{st} splits {splits}: failed ({type(exc).__name__})")
                break
            diff = float((out.float() - reference.float()).abs().max())
            rows.append((us, bn, w, st, splits, diff))
    rows.sort()
    print("| keys | warps | stages | splits | us per layer | GB/s (of copy) | max diff vs shipped |")
    print("|---|---|---|---|---|---|---|")
    for us, bn, w, st, splits, diff in rows[:15]:
        gbps = nbytes / us / 1e3
        print(f"| {bn} | {w} | {st} | {splits} | {us:.2f} | {gbps:.0f} ({gbps / ceiling:.2f}) | {diff:.1e} |")
    bad = [r for r in rows if not r[5] < 2e-2]
    print(f"{len(rows)} variants timed; {len(bad)} differ from the shipped output by >= 2e-2 or NaN")


if __name__ == "__main__":
    main()
