"""Sweep tile shapes and warps of the activations Triton kernels on a GPU (GB/s vs copy).

    python benchmarks/tuning/tune_activations.py [--dtype bfloat16]

Prints one row per (shape, config): gated forward for silu and exact gelu, gated backward
for silu. Used to pick TILE_ELEMENTS / MAX_BLOCK_COLS / num_warps in triton/configs.py
(results in docs/perf.md).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import triton

from openkernels.activations.spec import Act
from openkernels.activations.triton import kernels as K
from openkernels.shared.dev.bench import copy_ceiling_gbps, time_ms

Shape = tuple[int, int]  # rows, d: the gated kernels read (rows, 2d)
Config = tuple[int, int, int]  # block_cols, tile elements, warps
# name -> (bytes moved a call in units of rows * d elements, the launch on one input set)
Kernels = dict[str, tuple[int, Callable[[dict], object]]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--unary", action="store_true", help="sweep the unary kernels instead")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    (sweep_unary if args.unary else sweep_gated)(dtype)


def sweep_gated(dtype: torch.dtype) -> None:
    """Gated forward (silu, exact gelu) and backward (silu) over tile and warp choices."""
    size = torch.finfo(dtype).bits // 8

    def input_sets(rows: int, d: int, dev: torch.device) -> list[dict]:
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
        return sets

    def kernels(rows: int, d: int, grid: tuple[int], meta: dict) -> Kernels:
        def fwd(s, act):
            K._gated_activation_fwd_kernel[grid](
                s["x"], s["out"], rows, d, s["x"].stride(0), d, ACT=int(act), ACT_FIRST=True, **meta
            )

        def bwd(s):
            K._gated_activation_bwd_kernel[grid](
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
                **meta,
            )

        # fwd reads x (2d) and writes d; bwd reads dy and x, writes dx (2d).
        return {
            "silu fwd": (3, lambda s: fwd(s, Act.SILU)),
            "gelu fwd": (3, lambda s: fwd(s, Act.GELU)),
            "silu bwd": (5, bwd),
        }

    configs = [
        (block_cols, tile, warps)
        for block_cols, tile, warps in itertools.product((1024, 2048, 4096), (2048, 4096, 8192), (4, 8, 16))
        if tile >= block_cols and 4 <= tile // (32 * warps) <= 64
    ]
    _sweep(lambda rows, d: f"{rows}x{2 * d}", size, input_sets, configs, kernels)


def sweep_unary(dtype: torch.dtype) -> None:
    """Unary forward (silu, relu^2) and backward (silu) over tile and warp choices."""
    size = torch.finfo(dtype).bits // 8

    def input_sets(rows: int, d: int, dev: torch.device) -> list[dict]:
        return [
            {
                "x": torch.randn(rows, d, device=dev).to(dtype),
                "out": torch.empty(rows, d, device=dev, dtype=dtype),
                "dy": torch.randn(rows, d, device=dev).to(dtype),
            }
            for _ in range(3)
        ]

    def kernels(rows: int, d: int, grid: tuple[int], meta: dict) -> Kernels:
        def fwd(s, act):
            K._activation_fwd_kernel[grid](s["x"], s["out"], rows, d, d, d, ACT=int(act), **meta)

        def bwd(s):
            K._activation_bwd_kernel[grid](
                s["dy"], s["x"], s["out"], rows, d, d, d, d, ACT=int(Act.SILU), **meta
            )

        # fwd reads x and writes out; bwd reads dy and x, writes the gradient.
        return {
            "silu fwd": (2, lambda s: fwd(s, Act.SILU)),
            "relu2 fwd": (2, lambda s: fwd(s, Act.RELU_SQUARED)),
            "silu bwd": (3, bwd),
        }

    configs = [
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
    ]
    _sweep(lambda rows, d: f"unary {rows}x{d}", size, input_sets, configs, kernels)


def _sweep(
    label: Callable[[int, int], str],
    size: int,
    input_sets: Callable[[int, int, torch.device], list[dict]],
    configs: list[Config],
    kernels: Callable[[int, int, tuple[int], dict], Kernels],
    shapes: tuple[Shape, ...] = ((16384, 8192), (4096, 4096)),
) -> None:
    """One row per (shape, config): each kernel's GB/s as a fraction of the copy ceiling.
    `size`: bytes per element."""
    dev = torch.device("cuda")
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for rows, d in shapes:
        sets = input_sets(rows, d, dev)
        for block_cols, tile, warps in configs:
            block_rows = tile // block_cols
            grid = (triton.cdiv(rows, block_rows) * triton.cdiv(d, block_cols),)
            meta = dict(BLOCK_R=block_rows, BLOCK_C=block_cols, EVEN=True, num_warps=warps)
            row = [f"{label(rows, d)} cols={block_cols:5d} tile={tile:6d} warps={warps:2d}"]
            for name, (units, fn) in kernels(rows, d, grid, meta).items():
                gbps = units * rows * d * size / time_ms(fn, sets, dev, rep_ms=60) / 1e6
                row.append(f"{name} {gbps / ceiling:.3f}")
            print("  ".join(row), flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
