"""LayerNorm at all-MiniLM-L6-v2's shape on the CPU (issue 25's CPU item: >= 1.2x torch at 384
columns): the public `layer_norm` against F.layer_norm, with and without a residual (torch's
fused-residual path is `F.layer_norm(x + r)`), float32 and bfloat16, fresh outputs per call as
a model's forward makes them.

Each of `--reps` repetitions times ours, then torch (mean of `--calls` calls after 5 warm-up
calls), so slow phases of a shared machine hit both; the table gives the medians and the
range of the per-repetition ratios. Results are checked against F.layer_norm first (float32:
max abs difference; any NaN or a difference past the dtype's tolerance exits 1).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python benchmarks/studies/layernorm_cpu_minilm.py [--rows 4096] [--cols 384] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openkernels.layernorm import layer_norm


def _mean_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _calls(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, tuple]:
    """name -> (ours, torch's), each a call without arguments."""
    n = x.shape[-1]
    return {
        "layer_norm": (lambda: layer_norm(x, w, b), lambda: F.layer_norm(x, (n,), w, b)),
        "layer_norm + residual": (
            lambda: layer_norm(x, w, b, residual=r),
            lambda: F.layer_norm(x + r, (n,), w, b),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="tokens (32 sentences x 128)")
    parser.add_argument("--cols", type=int, default=384, help="hidden size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = args.cols
    failed = False
    print(f"{args.rows} x {n}, {args.threads} threads; ms per call (median), torch / ours")
    print("| dtype | call | ours | torch | speed-up | per-repetition range |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x, r = torch.randn(args.rows, n, dtype=dtype), torch.randn(args.rows, n, dtype=dtype)
        w, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
        calls = _calls(x, r, w, b)
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for name, (ours, theirs) in calls.items():
            diff = (ours().float() - theirs().float()).abs().max().item()
            if not diff <= tol:  # NaN fails too
                print(f"{name} {dtype}: max abs difference {diff} > {tol}", file=sys.stderr)
                failed = True
            mine, torch_ms = [], []
            for _ in range(args.reps):
                mine.append(_mean_ms(ours, args.calls))
                torch_ms.append(_mean_ms(theirs, args.calls))
            ratios = [t / o for t, o in zip(torch_ms, mine)]
            o, t = statistics.median(mine), statistics.median(torch_ms)
            print(f"| {str(dtype).removeprefix('torch.')} | {name} | {o:.3f} | {t:.3f} | {t / o:.2f}x "
                  f"| {min(ratios):.2f}-{max(ratios):.2f}x |")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
