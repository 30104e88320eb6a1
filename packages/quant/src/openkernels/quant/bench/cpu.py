"""CPU timing of the fused 4-bit linear (cpu/int4_linear.cpp) against dense PyTorch matmuls.

    python -m openkernels.quant.bench.cpu [--m 1 16 128] [--n 4096] [--k 4096] [--group-size 128]
                                           [--kind int4|int4-sym|nf4] [--rep-ms 1000]

For each activation dtype (bfloat16, float32) and M, prints the median milliseconds of
  ours       cpu.int4_linear_fwd on the packed weight (N, K // 2 bytes),
  dense bf16 x.to(bfloat16) @ w.T with a bfloat16 weight,
  dense fp32 x.to(float32) @ w.T with a float32 weight,
  deq+mm     cpu.dequantize_int4_fwd into a fresh weight, then the matmul: the faster of doing
             both in x's dtype and both in float32 (x converted),
and the speedups best dense / ours and deq+mm / ours. Ours and the dense matmuls are timed in
rounds, one call of each per round, for about --rep-ms each (deq+mm's routes likewise, apart).
Threads: torch.get_num_threads() (the kernel and PyTorch's matmuls use the same count). Nothing runs
at import.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["main", "measure"]


def _interleaved_ms(contenders: dict[str, Callable[[], Any]], rep_ms: float) -> dict[str, float]:
    """Median milliseconds of each contender, timed in rounds (one call of each per round) so that
    all of them see the same machine: on a shared one, load that comes and goes shifts all alike."""
    for fn in contenders.values():
        fn()  # first calls compile the C++ library and grow the allocator: not timed
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    deadline = time.perf_counter() + rep_ms * len(contenders) / 1e3
    rounds = 0
    while rounds < 5 or (time.perf_counter() < deadline and rounds < 1000):
        rounds += 1
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def measure(
    m: int, n: int, k: int, group_size: int, kind: str, dtype: torch.dtype, *, rep_ms: float = 1000.0
) -> dict[str, float]:
    """Median milliseconds of each contender for x (m, k) in `dtype` against a random (n, k) weight:
    ours, dense_bf16, dense_fp32, and deq_mm (the faster of its two routes)."""
    from .. import cpu
    from ..quantize import quantize_int4, quantize_nf4
    from ..reference import dequantize_int4_ref

    weight = torch.randn(n, k) * 0.02
    if kind == "nf4":
        q = quantize_nf4(weight, group_size)
    else:
        q = quantize_int4(weight, group_size, symmetric=kind == "int4-sym")
    base_kind = "nf4" if kind == "nf4" else "int4"
    w32 = dequantize_int4_ref(q.qweight, q.scales, q.zeros, group_size, base_kind)
    w16 = w32.to(torch.bfloat16)
    x = torch.randn(m, k).to(dtype)
    out = torch.empty(m, n, dtype=dtype)

    def ours() -> None:
        cpu.int4_linear_fwd(x, q.qweight, q.scales, q.zeros, None, out, group_size, base_kind)

    def deq_mm(work: torch.dtype) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            w = torch.empty(n, k, dtype=work)
            cpu.dequantize_int4_fwd(q.qweight, q.scales, q.zeros, w, group_size, base_kind)
            return x.to(work) @ w.t()

        return run

    times = _interleaved_ms(
        {
            "ours": ours,
            "dense_bf16": lambda: x.to(torch.bfloat16) @ w16.t(),
            "dense_fp32": lambda: x.to(torch.float32) @ w32.t(),
        },
        rep_ms,
    )
    # Apart: allocating and freeing the (n, k) weight every call leaves the kernel's memory
    # management busy for a while after it, which slowed the next contender (ours by up to 0.6 ms).
    routes = {"deq_mm": deq_mm(dtype)}
    if dtype != torch.float32:
        routes["deq_mm_fp32"] = deq_mm(torch.float32)
    times["deq_mm"] = min(_interleaved_ms(routes, rep_ms).values())
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m openkernels.quant.bench.cpu", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--kind", choices=["int4", "int4-sym", "nf4"], default="int4")
    parser.add_argument("--rep-ms", type=float, default=1000.0, help="time spent per contender")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    print(
        f"{args.kind} N={args.n} K={args.k} group_size={args.group_size}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; median ms"
    )
    header = f"{'x dtype':>8} {'M':>5} {'ours':>9} {'dense bf16':>11} {'dense fp32':>11} {'deq+mm':>9}"
    print(header + f" {'vs dense':>9} {'vs deq+mm':>10}")
    for dtype in (torch.bfloat16, torch.float32):
        for m in args.m:
            t = measure(m, args.n, args.k, args.group_size, args.kind, dtype, rep_ms=args.rep_ms)
            dense = min(t["dense_bf16"], t["dense_fp32"])
            print(
                f"{str(dtype).removeprefix('torch.'):>8} {m:>5} {t['ours']:>9.3f} {t['dense_bf16']:>11.3f} "
                f"{t['dense_fp32']:>11.3f} {t['deq_mm']:>9.3f} {dense / t['ours']:>8.2f}x "
                f"{t['deq_mm'] / t['ours']:>9.2f}x"
            )


if __name__ == "__main__":
    main()
