"""Host time per call of int4_linear on a tiny weight (the kernel is negligible), next to
F.linear and the launcher called directly: what a decode step pays per layer on the CPU side.

    python benchmarks/overhead_quant.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import openkernels.quant as Q
from openkernels.quant.triton import int4_linear_fwd
from openkernels.shared import launch as fastlaunch


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    device = torch.device("cuda")
    w = (torch.randn(256, 256, device=device) * 0.02).to(torch.bfloat16)
    q = Q.quantize_int4(w, 128)
    for fast in (True, False):
        fastlaunch.FAST = fast
        print(f"direct launch of compiled kernels: {fast}")
        _rows(device, w, q)
    fastlaunch.FAST = True


def _rows(device: torch.device, w: torch.Tensor, q: Q.Int4Weight) -> None:
    for m in (1, 16):
        x = torch.randn(m, 256, device=device, dtype=torch.bfloat16)
        out = torch.empty(m, 256, device=device, dtype=torch.bfloat16)
        torch.testing.assert_close(
            Q.int4_linear(x, q).float(), (x.float() @ Q.dequantize_int4(q).t()), rtol=2e-2, atol=2e-2
        )
        rows = {
            "F.linear": lambda x=x: F.linear(x, w),
            "int4_linear": lambda x=x: Q.int4_linear(x, q),
            "launcher": lambda x=x, out=out: int4_linear_fwd(
                x, q.qweight, q.scales, q.zeros, None, out, 128, "int4"
            ),
        }
        print(f"M={m}: " + "  ".join(f"{name} {per_call_us(fn):.1f} us" for name, fn in rows.items()))


if __name__ == "__main__":
    main()
