"""Host overhead per call of a family's ops on tiny inputs (microseconds, wall clock).

    python benchmarks/overhead.py [--device cuda]

Tiny inputs make every path host-bound, so the numbers are the Python + dispatch +
launch cost a small call pays: our public function (eager fast path), the same op
through torch.library (what autograd and torch.compile use), the bare launcher, and
the torch eager composition for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import openkernels.activations as A
from openkernels.activations import ops
from openkernels.shared import dispatch


def per_call_us(fn, device: torch.device, n: int = 5000) -> float:
    for _ in range(50):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args().device)
    x = torch.randn(8, 256, device=device)
    xg = x.clone().requires_grad_()
    out = torch.empty(8, 128, device=device)
    impl = dispatch.select("silu_and_mul", dispatch.key_for(x))[0]
    rows = [
        ("openkernels silu_and_mul (eager fast path)", lambda: A.silu_and_mul(x)),
        ("openkernels silu_and_mul out=", lambda: A.silu_and_mul(x, out=out)),
        ("torch.ops.openkernels.silu_and_mul (library op)", lambda: torch.ops.openkernels.silu_and_mul(x)),
        ("openkernels silu_and_mul, requires_grad input", lambda: A.silu_and_mul(xg)),
        (f"bare launcher ({impl.name})", lambda: impl.fn(x, out, 0)),
        ("ops.forward (no argument checks)", lambda: ops.forward("silu_and_mul", x)),
        ("torch: F.silu(a) * b", lambda: F.silu(x[:, :128]) * x[:, 128:]),
        ("torch: F.silu(x)", lambda: F.silu(x)),
    ]
    for name, fn in rows:
        print(f"{name:<52} {per_call_us(fn, device):7.1f} us", flush=True)


if __name__ == "__main__":
    main()
