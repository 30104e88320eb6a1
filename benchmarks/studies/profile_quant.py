"""Run int4_linear a few times at one (M, N, K) for a profiler (ncu) to attach to.

    ncu --clock-control none -k regex:int4 --launch-skip 3 --launch-count 1 \\
        python benchmarks/studies/profile_quant.py --m 1 --n 28672 --k 8192
"""

from __future__ import annotations

import argparse

import torch

import openkernels.quant as Q


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--k", type=int, default=8192)
    args = parser.parse_args()
    w = (torch.randn(args.n, args.k, device="cuda") * 0.02).to(torch.bfloat16)
    q = Q.quantize_int4(w, 128)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    for _ in range(6):
        Q.int4_linear(x, q)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
