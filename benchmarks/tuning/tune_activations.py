"""Sweep tile shapes and warps of the activations Triton kernels on a GPU (GB/s vs copy).

    python benchmarks/tuning/tune_activations.py [--dtype bfloat16]

Prints one row per (shape, config): gated forward for silu and exact gelu, gated backward
for silu. Used to pick TILE_ELEMENTS / MAX_BLOCK_COLS / num_warps in triton/configs.py
(results in docs/perf.md).
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from openkernels.activations.spec import Act
from openkernels.activations.triton import kernels as K
from openkernels.shared.dev.bench import copy_ceiling_gbps, time_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--unary", action="store_true", help="sweep the unary kernels instead")
    args = parser.parse_args()
    if args.unary:
        return sweep_unary(getattr(torch, args.dtype))
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    size = torch.finfo(dtype).bits // 8
    for rows, d in ((16384, 8192), (4096, 4096)):
        sets = []
        for _ in range(2 if rows * d * 2 * size > 180e6 else 4):
            x = torch.randn(rows, 2 * d, device=dev).to(dtype)
            sets.append(
                {
                    "x": x,
                    "out": torch.empty(rows, d, device=dev, dtype=dtype),
                    "dy": torch.randn(rows, d, device=dev).to(dtype),
                    "dx": torch.empty_like(x),
                }
            )
        for block_cols, tile, warps in itertools.product((1024, 2048, 4096), (2048, 4096, 8192), (4, 8, 16)):
            if tile < block_cols or not 4 <= tile // (32 * warps) <= 64:
                continue
            block_rows = tile // block_cols
            grid = (triton.cdiv(rows, block_rows) * triton.cdiv(d, block_cols),)
            meta = dict(BLOCK_R=block_rows, BLOCK_C=block_cols, EVEN=True, num_warps=warps)

            def fwd(s, act, g=grid, m=meta, rows=rows, d=d):
                K._gated_activation_fwd_kernel[g](
                    s["x"], s["out"], rows, d, s["x"].stride(0), d, ACT=int(act), ACT_FIRST=True, **m
                )

            def bwd(s, g=grid, m=meta, rows=rows, d=d):
                K._gated_activation_bwd_kernel[g](
                    s["dy"],
                    s["x"],
                    s["dx"],
                    rows,
                    d,
                    d,
                    s["x"].stride(0),
                    2 * d,
                    ACT=int(Act.SILU),
                    ACT_FIRST=True,
                    **m,
                )

            silu = 3 * rows * d * size / time_ms(lambda s: fwd(s, Act.SILU), sets, dev, rep_ms=60) / 1e6
            gelu = 3 * rows * d * size / time_ms(lambda s: fwd(s, Act.GELU), sets, dev, rep_ms=60) / 1e6
            back = 5 * rows * d * size / time_ms(bwd, sets, dev, rep_ms=60) / 1e6
            print(
                f"{rows}x{2 * d} cols={block_cols:5d} tile={tile:6d} warps={warps:2d}  "
                f"silu fwd {silu / ceiling:.3f}  gelu fwd {gelu / ceiling:.3f}  silu bwd {back / ceiling:.3f}",
                flush=True,
            )
        del sets
        torch.cuda.empty_cache()


def sweep_unary(dtype: torch.dtype) -> None:
    """Unary forward (silu, relu^2) and backward (silu) over tile and warp choices."""
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    size = torch.finfo(dtype).bits // 8
    for rows, d in ((16384, 8192), (4096, 4096)):
        sets = [
            {
                "x": torch.randn(rows, d, device=dev).to(dtype),
                "out": torch.empty(rows, d, device=dev, dtype=dtype),
                "dy": torch.randn(rows, d, device=dev).to(dtype),
            }
            for _ in range(3)
        ]
        for block_cols, tile, warps in (
            (1024, 1024, 4),
            (1024, 2048, 8),
            (2048, 2048, 4),
            (2048, 2048, 8),
            (2048, 4096, 8),
            (4096, 4096, 8),
            (4096, 4096, 16),
            (4096, 8192, 8),
            (4096, 8192, 16),
            (1024, 4096, 4),
            (512, 2048, 4),
        ):
            block_rows = tile // block_cols
            grid = (triton.cdiv(rows, block_rows) * triton.cdiv(d, block_cols),)
            meta = dict(BLOCK_R=block_rows, BLOCK_C=block_cols, EVEN=True, num_warps=warps)

            def fwd(s, act, g=grid, m=meta, rows=rows, d=d):
                K._activation_fwd_kernel[g](s["x"], s["out"], rows, d, d, d, ACT=int(act), **m)

            def bwd(s, g=grid, m=meta, rows=rows, d=d):
                K._activation_bwd_kernel[g](
                    s["dy"], s["x"], s["out"], rows, d, d, d, d, ACT=int(Act.SILU), **m
                )

            silu = 2 * rows * d * size / time_ms(lambda s: fwd(s, Act.SILU), sets, dev, rep_ms=60) / 1e6
            relu2 = (
                2 * rows * d * size / time_ms(lambda s: fwd(s, Act.RELU_SQUARED), sets, dev, rep_ms=60) / 1e6
            )
            back = 3 * rows * d * size / time_ms(bwd, sets, dev, rep_ms=60) / 1e6
            print(
                f"unary {rows}x{d} cols={block_cols:5d} tile={tile:6d} warps={warps:2d}  silu fwd {silu / ceiling:.3f}  "
                f"relu2 fwd {relu2 / ceiling:.3f}  silu bwd {back / ceiling:.3f}",
                flush=True,
            )
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
