"""Config sweep of the quant Triton kernels on this GPU: for each (M, N, K) of the benchmark
grid, every candidate config of the path the table would pick (and the neighbouring paths),
timed on rotating weights (past L2) through the launcher directly; prints the best few and
cuBLAS bf16 for scale. Each config is checked against the reference before it is timed.

    python benchmarks/tuning/tune_quant.py [--ms 1,16,128,2048] [--shapes 8192x8192,28672x8192] [--top 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools

import torch
import torch.nn.functional as F
import triton

from openkernels.quant import quantize_int4, reference
from openkernels.quant.triton import config_for, int4_linear_fwd
from openkernels.quant.triton.configs import LinearConfig


def candidates(m: int) -> list[LinearConfig]:
    t = functools.partial(LinearConfig, "tiled")

    def both(*cfgs: LinearConfig) -> list[LinearConfig]:  # each tile as W @ x^T and as x @ W^T
        return [c for cfg in cfgs for c in (cfg, dataclasses.replace(cfg, swap_ab=False))]

    def unrolled(bm: int, bn: int, warps: int, splits: tuple[int, ...]) -> list[LinearConfig]:
        return [
            t(bm, bn, 128 * u, warps, st, s, unroll=u) for u in (1, 2, 4) for st in (3, 4) for s in splits
        ]

    if m == 1:
        return [
            LinearConfig("gemv", 1, 16, 1024, 4, 1, 1),
            *unrolled(16, 64, 4, (2, 4)),
            *both(t(16, 128, 128, 8, 3, 4)),
        ]
    if m <= 64:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        return [*unrolled(bm, 64, 4, (2, 4)), *both(t(bm, 128, 128, 8, 3, 4))]
    if m <= 128:
        # 128-row tiles unrolled spill (sm_90: 244 B at 128 x 64 x 256): not swept.
        return [*unrolled(64, 64, 4, (1,)), t(128, 64, 128, 4, 3, 1), t(64, 128, 128, 8, 3, 1),
                LinearConfig("dequant")]  # fmt: skip
    return [t(128, 64, 128, 4, 3, 1), t(128, 128, 128, 8, 3, 1), LinearConfig("dequant")]


def _row(x, weights, out, cfg, ref, bound, rep_ms: float) -> tuple[float, LinearConfig, str]:
    """(ms, cfg, note) of one config: checked against the reference first, then timed."""
    q0 = weights[0]
    try:
        int4_linear_fwd(x, q0.qweight, q0.scales, q0.zeros, None, out, 128, "int4", config=cfg)
        err = float(((out.double() - ref).abs() / bound).max())
        if not err <= 1.0:
            return float("inf"), cfg, f"WRONG error {err:.3g}"
        it = itertools.count()

        def call() -> None:
            q = weights[next(it) % len(weights)]
            int4_linear_fwd(x, q.qweight, q.scales, q.zeros, None, out, 128, "int4", config=cfg)

        ms = triton.testing.do_bench(call, rep=rep_ms)
        graph = triton.testing.do_bench_cudagraph(call, rep=rep_ms) if x.shape[0] <= 16 else ms
        return ms, cfg, f"graph {graph:.4f}"
    except Exception as error:  # a config that does not compile or fit is reported
        return float("inf"), cfg, f"{type(error).__name__}: {str(error)[:80]}"


def sweep_shape(n: int, k: int, ms: list[int], top: int, rep_ms: float) -> None:
    device = torch.device("cuda")
    count = max(2, -(-180 * 2**20 // (n * k // 2)))  # int4 weights past 3x L2
    weights = [
        quantize_int4((torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16), 128) for _ in range(count)
    ]
    dense = [(torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16) for _ in range(3)]
    q0 = weights[0]
    w64 = reference.dequantize_int4_ref(q0.qweight, q0.scales, q0.zeros, 128, "int4", torch.float64)
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        it = itertools.count()
        bf16 = triton.testing.do_bench(lambda: F.linear(x, dense[next(it) % 3]), rep=rep_ms)  # noqa: B023
        ref = x.double() @ w64.t()
        bound = reference.linear_error_bound(
            x.double(), w64, ref, torch.bfloat16, weight_rounded_to=torch.bfloat16
        )
        rows = sorted(
            (_row(x, weights, out, cfg, ref, bound, rep_ms) for cfg in candidates(m)), key=lambda r: r[0]
        )
        table = config_for(m, n, k, 128, device)
        tabled = next((r for r in rows if r[1] == table), None)
        print(
            f"\nM={m} N={n} K={k}: bf16 {bf16:.4f} ms; table {table} -> {tabled[0] if tabled else 'not swept'}"
        )
        for ms_, cfg, note in rows[:top]:
            print(f"  {ms_:.4f} ms  {bf16 / ms_:.2f}x bf16  {cfg}  {note}")
        for _, cfg, note in [r for r in rows if r[0] == float("inf")][:5]:
            print(f"  failed: {cfg} {note}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,128,256,512,1024,2048")
    parser.add_argument("--shapes", default="8192x8192,28672x8192")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--rep-ms", type=float, default=40.0)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        sweep_shape(n, k, [int(v) for v in args.ms.split(",")], args.top, args.rep_ms)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
