"""4-bit weight-only linear (openkernels.quant.bench) next to the 16-bit weight in torch (cuBLAS), torch's tinygemm,
bitsandbytes NF4 and GemLite, with the issue's ratios: each contender's speed-up over bf16
at the same (M, N, K), same process, weights rotated past L2.

    python benchmarks/peers/quant_linear.py [--shapes 8192x8192,28672x8192] [--ms 1,16,128,2048]
        [--kinds int4,nf4] [--peers torch,tinygemm,bnb-nf4,gemlite] [--json out.json] [--kernel-time]
"""

from __future__ import annotations

import torch

import _cli
from openkernels.quant import bench
from openkernels.shared.dev.bench import copy_ceiling_gbps, matmul_ceiling_tflops, write_json


def main() -> None:
    parser = _cli.parser()
    parser.add_argument("--shapes", default="")
    parser.add_argument("--ms", default="")
    parser.add_argument("--kinds", default="int4")
    parser.add_argument("--peers", default=",".join(bench.PEERS))
    _cli.add_run_options(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    kwargs = {"peers": _cli.names(args.peers), "kinds": args.kinds.split(",")}
    if args.shapes:
        kwargs["shapes"] = _cli.shapes(args.shapes)
    if args.ms:
        kwargs["ms"] = [int(m) for m in args.ms.split(",")]
    gbps = copy_ceiling_gbps(device)
    tflops = matmul_ceiling_tflops(device)
    results = _cli.run_and_print(
        bench.cases(device, **kwargs), device, args, ceiling_gbps=gbps, ceiling_tflops=tflops
    )
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
