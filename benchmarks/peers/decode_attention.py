"""Decode against a KV cache (openkernels.attention.kvcache.bench) next to SDPA and
FlexAttention, with the issue's ratios: bf16 GB/s over the measured copy bandwidth,
quantized and paged times against SDPA and the contiguous bf16 cache.

    python benchmarks/peers/decode_attention.py [--shapes 32x32x8x4096x128] [--formats ours,ours-int4]
        [--json out.json] [--kernel-time]
"""

from __future__ import annotations

import torch

import _cli
from openkernels.attention.kvcache import bench as bench_kvcache
from openkernels.shared.dev.bench import copy_ceiling_gbps, write_json


def main() -> None:
    parser = _cli.parser()
    parser.add_argument("--shapes", default="")
    parser.add_argument("--formats", default="")
    parser.add_argument("--peers", default="sdpa,flex")
    _cli.add_run_options(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    kwargs = {"peers": _cli.names(args.peers)}
    if args.shapes:
        kwargs["shapes"] = _cli.shapes(args.shapes)
    if args.formats:
        kwargs["formats"] = args.formats.split(",")
    ceiling = copy_ceiling_gbps(device)
    results = _cli.run_and_print(bench_kvcache.cases(device, **kwargs), device, args, ceiling_gbps=ceiling)
    by_shape: dict[tuple, dict[str, float]] = {}
    for m in results:
        by_shape.setdefault(m.shape, {})[m.contender] = m.ms
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; GB/s above count the bf16 cache's bytes for every contender")
    for shape, ms in by_shape.items():
        nbytes = bench_kvcache.kv_bytes(shape)
        line = [f"B{shape[0]} Hq{shape[1]} Hkv{shape[2]} S{shape[3]} D{shape[4]}:"]
        if "ours" in ms:
            line.append(f"bf16 {nbytes / ms['ours'] / 1e6 / ceiling:.3f} of copy")
        for name in (
            "ours-fp8",
            "ours-int8",
            "ours-int4",
            "ours-int4-g32",
            "ours-int4-keys32",
            "ours",
            "flex",
        ):
            if name in ms and "sdpa" in ms:
                line.append(f"{name} {ms['sdpa'] / ms[name]:.2f}x sdpa")
        for name in ("ours-paged16", "ours-paged256"):
            if name in ms and "ours" in ms:
                line.append(f"{name} {ms[name] / ms['ours']:.3f}x contiguous time")
        print("  ".join(line))
    if args.json:
        write_json(results, args.json, ceiling_gbps=ceiling)


if __name__ == "__main__":
    main()
