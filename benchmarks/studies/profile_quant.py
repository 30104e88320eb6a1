"""Run int4_linear a few times at one (M, N, K) for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:int4 --launch-skip 3 --launch-count 1 \\
        python benchmarks/studies/profile_quant.py --m 1 --n 28672 --k 8192 [--config tc-t4-u1-k2]

--config forces one of quant's CUDA configs (cuda.int4_linear_fwd's `config`) instead of the
public op's choice (--tiled: on format.tile_codes' layout); --scale-dtype picks the scales' dtype (quantize_int4's float16 by default).
The weights are 16 copies of the quantized tensor used in turn, so that with ncu's cache control
off the profiled call still reads its weight from DRAM.
"""

from __future__ import annotations

import argparse

import torch

import openkernels.quant as Q
from openkernels.quant.format import tile_codes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--config", default=None)
    parser.add_argument("--scale-dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument(
        "--tiled", action="store_true", help="format.tile_codes' layout (with --config tc...)"
    )
    args = parser.parse_args()
    w = (torch.randn(args.n, args.k, device="cuda") * 0.02).to(torch.bfloat16)
    q = Q.quantize_int4(w, 128)
    scales = q.scales.to(getattr(torch, args.scale_dtype))
    codes = tile_codes(q.qweight) if args.tiled else q.qweight
    copies = [(codes.clone(), scales.clone(), q.zeros.to(scales.dtype).clone()) for _ in range(4)]
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    if args.config is not None:
        from openkernels.quant import cuda as G

        for i in range(args.calls):
            qw, s, z = copies[i % len(copies)]
            G.int4_linear_fwd(x, qw, s, z, None, out, 128, "int4", config=args.config)
        torch.cuda.synchronize()
        if G._broken:
            raise SystemExit(f"the launch fell back: {G._broken}")
        return
    for _ in range(args.calls):
        Q.int4_linear(x, q)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
