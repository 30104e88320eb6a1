"""Sweep tiles, warps and the backward grid of the layernorm Triton kernels on a GPU.

    python benchmarks/tuning/tune_layernorm.py [--dtype bfloat16] [--shapes 8192x8192,...] [--rep-ms 50]

One row per (shape, op, direction, config): GB/s and the ratio to the copy ceiling measured
in the same run, with the config launch_config picks today marked '*'. Used to pick the
constants in openkernels/layernorm/triton/configs.py (results in docs/perf.md).
"""

from __future__ import annotations

import argparse

import torch

from openkernels.layernorm.bench import GPU_SHAPES, LONG_ROW_SHAPES
from openkernels.layernorm.triton import norm_bwd, norm_fwd
from openkernels.layernorm.triton.configs import MAX_TILE_COLS, NormConfig, launch_config
from openkernels.shared.dev.bench import copy_ceiling_gbps, time_ms


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidates(n: int, direction: str) -> list[NormConfig]:
    out = []
    if n <= MAX_TILE_COLS[direction]:
        cols = _pow2(n)
        for rows in (1, 2, 4):
            if rows > 1 and rows * cols > 8192:
                continue
            for warps in (2, 4, 8, 16, 32):
                per_thread = rows * cols // (32 * warps)
                if direction == "fwd" and 8 <= per_thread <= 32:
                    out += [NormConfig(rows, cols, warps, "tile", p, p > 0) for p in (0, max(1, 32 // warps))]
                if direction == "bwd" and 4 <= per_thread <= 32:
                    out += [
                        NormConfig(rows, cols, warps, "tile", p, True)
                        for p in {max(1, 32 // warps), max(1, 64 // warps)}
                    ]
    if n > 8192 and direction == "fwd":
        for chunk in (4096, 8192, 16384):
            for warps in (4, 8, 16, 32):
                if 8 <= chunk // (32 * warps) <= 32 and chunk < n and -(-n // chunk) <= 64:
                    out.append(NormConfig(1, chunk, warps, "split"))
    if n >= 65536 or (direction == "bwd" and n > MAX_TILE_COLS["bwd"]):
        for chunk in (4096, 8192):
            for warps in (8, 16):
                if 8 <= chunk // (32 * warps) <= 32:
                    out.append(
                        NormConfig(
                            1,
                            chunk,
                            warps,
                            "looped",
                            max(1, 64 // warps // (1 if direction == "bwd" else 64)),
                        )
                    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--rep-ms", type=float, default=30.0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        if args.shapes
        else [*GPU_SHAPES, *LONG_ROW_SHAPES]
    )
    ceiling = copy_ceiling_gbps(dev)
    print(f"copy ceiling {ceiling:.0f} GB/s")
    size = torch.finfo(dtype).bits // 8
    for rows, n in shapes:
        sets = []
        for _ in range(2):
            x = torch.randn(rows, n, device=dev).to(dtype)
            sets.append(
                {
                    "x": x,
                    "w": (1 + 0.1 * torch.randn(n, device=dev)).to(dtype),
                    "b": torch.randn(n, device=dev).to(dtype),
                    "out": torch.empty_like(x),
                    "mean": torch.empty(rows, device=dev),
                    "rstd": torch.empty(rows, device=dev),
                    "dy": torch.randn(rows, n, device=dev).to(dtype),
                    "dx": torch.empty_like(x),
                    "dw": torch.empty(n, device=dev),
                    "db": torch.empty(n, device=dev),
                }
            )
        for rms in (True, False):
            op = "rms" if rms else "ln"
            for direction in ("fwd", "bwd"):
                picked = launch_config(n, dtype, "cuda", direction, True, rms)
                nbytes = (2 if direction == "fwd" else 3) * rows * n * size
                for cfg in candidates(n, direction):

                    def fwd(s, cfg=cfg, rms=rms):
                        norm_fwd(s["x"], None, s["w"], None if rms else s["b"], s["out"], None,
                                 None if rms else s["mean"], s["rstd"], eps=1e-6, weight_offset=0.0,
                                 rms=rms, h_dtype=dtype, config=cfg)  # fmt: skip

                    def bwd(s, cfg=cfg, rms=rms):
                        norm_bwd(s["dy"], s["x"], s["w"], None if rms else s["mean"], s["rstd"], None,
                                 s["dx"], s["dw"], None if rms else s["db"], weight_offset=0.0, rms=rms,
                                 config=cfg)  # fmt: skip

                    if direction == "bwd":
                        for s in sets:
                            fwd(s)
                    try:
                        ms = time_ms(fwd if direction == "fwd" else bwd, sets, dev, rep_ms=args.rep_ms)
                    except Exception as exc:  # a config that does not compile or launch
                        print(f"{rows}x{n} {op} {direction} {cfg} error {type(exc).__name__}: {exc}"[:200])
                        continue
                    gbps = nbytes / ms / 1e6
                    mark = "*" if _same(cfg, picked) else " "
                    print(
                        f"{rows}x{n} {op} {direction} r{cfg.block_rows} c{cfg.block_cols} w{cfg.num_warps} "
                        f"p{cfg.programs_per_sm} {'prefetch' if cfg.prefetch else '-'} "
                        f"{cfg.mode}{mark} {gbps:7.0f} GB/s ({gbps / ceiling:.3f})",
                        flush=True,
                    )


def _same(a: NormConfig, b: NormConfig) -> bool:
    return a == b


if __name__ == "__main__":
    main()
