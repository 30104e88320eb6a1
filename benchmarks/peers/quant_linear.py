"""4-bit weight-only linear (openkernels.quant.bench) next to the 16-bit weight in torch (cuBLAS), torch's tinygemm,
bitsandbytes NF4 and GemLite, with the issue's ratios: each contender's speed-up over bf16
at the same (M, N, K), same process, weights rotated past L2.

    python benchmarks/peers/quant_linear.py [--shapes 8192x8192,28672x8192] [--ms 1,16,128,2048]
        [--kinds int4,nf4] [--peers torch,tinygemm,bnb-nf4,gemlite] [--json out.json] [--kernel-time]
"""

from __future__ import annotations

import argparse

import torch

from openkernels.quant import bench
from openkernels.shared.dev.bench import (
    copy_ceiling_gbps,
    format_table,
    matmul_ceiling_tflops,
    run_cases,
    write_json,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--ms", default="")
    parser.add_argument("--kinds", default="int4")
    parser.add_argument("--peers", default=",".join(bench.PEERS))
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--json", default="")
    parser.add_argument("--kernel-time", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    kwargs = {"peers": [p for p in args.peers.split(",") if p], "kinds": args.kinds.split(",")}
    if args.shapes:
        kwargs["shapes"] = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    if args.ms:
        kwargs["ms"] = [int(m) for m in args.ms.split(",")]
    gbps = copy_ceiling_gbps(device)
    tflops = matmul_ceiling_tflops(device)
    results = run_cases(bench.cases(device, **kwargs), device, ceiling_gbps=gbps, ceiling_tflops=tflops,
                        rep_ms=args.rep_ms, kernel_time=args.kernel_time)  # fmt: skip
    print(format_table(results, ceiling_gbps=gbps, ceiling_tflops=tflops))
    by_case: dict[tuple, dict[str, tuple[float, float]]] = {}
    for m in results:
        if not m.error:
            by_case.setdefault((m.op, m.shape), {})[m.contender] = (m.ms, m.kernel_ms)
    print(
        f"\nceilings: copy {gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s; speed-up over the 16-bit weight in torch (wall / kernel):"
    )
    for (op, shape), times in by_case.items():
        base = times.get("torch")
        if base is None:
            continue
        parts = [f"{op} M={shape[0]} {shape[1]}x{shape[2]}:"]
        for name, (ms, kms) in times.items():
            if name in ("torch", "copy"):
                continue
            kernel = f" / {base[1] / kms:.2f}x" if kms and base[1] else ""
            parts.append(f"{name} {base[0] / ms:.2f}x{kernel}")
        print("  ".join(parts))
    if args.json:
        write_json(results, args.json, ceiling_gbps=gbps, ceiling_tflops=tflops)


if __name__ == "__main__":
    main()
