"""Each tensor-core GEMV config (quant's cuda "tc...") run once in its own process on the GPU,
so that a fault in one (an illegal instruction was seen on an H100) does not hide the
others: per (config, M, N x K) OK with the largest error against float64, or the error.
With --sanitize, a faulting case runs again under compute-sanitizer (memcheck), whose first
report lines name the kernel and the access.

    PYTHONPATH=... python3 benchmarks/gpu/check_tc_gpu.py [--sanitize] [--configs tcr-t1-s4,...]
        [--ms 1,8] [--memcheck-first]

--ms: the rows of x per case (9-16: the two-tile build, quant 0.10.6). --memcheck-first: the
first case (smallest shape) runs under compute-sanitizer memcheck whatever its result.

Exits 1 when any case faults or misses (so a script can time only configs that ran clean).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

CHILD = r"""
import sys, torch
from openkernels.quant import cuda as G
from openkernels.quant.quantize import quantize_int4
from openkernels.quant.reference import int4_linear_ref
config, m, n, k, group = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
gen = torch.Generator(device="cuda").manual_seed(m + n)
q = quantize_int4(torch.randn(n, k, device="cuda", generator=gen) * 0.02, group)
x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
from openkernels.quant.format import tile_codes
codes = tile_codes(q.qweight) if config.startswith("tcr") else q.qweight  # the ring reads tiled codes
why = G.unsupported_call(x, codes, q.scales, q.zeros, None, out, group, "int4", config)
if why is not None:
    print("not taken:", why)
    sys.exit(0)
G.int4_linear_fwd(x, codes, q.scales, q.zeros, None, out, group, "int4", config=config)
torch.cuda.synchronize()
if G._broken:  # the launch failed and the Triton kernels answered: not this config's result
    print("FALLBACK:", G._broken)
    sys.exit(1)
ref = int4_linear_ref(x.double(), q.qweight, q.scales, q.zeros, group, "int4")
err = (out.double() - ref).abs().max().item()
if not err <= 0.05 * ref.abs().max().item():  # NaN fails too; the tests hold the exact contract
    print(f"WRONG max|err| {err:.3g} (max|y| {ref.abs().max().item():.3g})")
    sys.exit(1)
print(f"OK max|err| {err:.3g} (max|y| {ref.abs().max().item():.3g})")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--configs", default=None, help="comma-separated (default: every tc and tcr config)")
    parser.add_argument("--ms", default="1,8", help="rows of x, comma-separated")
    parser.add_argument("--memcheck-first", action="store_true")
    args = parser.parse_args()
    from openkernels.quant import cuda as G

    configs = args.configs.split(",") if args.configs else [*G.TC_CONFIGS, *G.TCR_CONFIGS]

    sanitizer = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer")
        else None
    )
    ms = [int(v) for v in args.ms.split(",")]
    cases = [(c, m, 2048, 2048, 128) for c in configs for m in ms]
    cases += [(c, m, 8192, 8192, 128) for c in configs for m in ms]
    cases += [(c, ms[0], 28672, 8192, 128) for c in configs]
    sanitized = failed = 0
    if args.memcheck_first and sanitizer:
        san = subprocess.run(
            [sanitizer, "--tool", "memcheck", "--print-limit", "3", sys.executable, "-c", CHILD,
             *(str(v) for v in cases[0])],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        tail = [ln for ln in (san.stdout + san.stderr).splitlines() if ln.startswith("=========")]
        print(
            f"memcheck {' '.join(str(v) for v in cases[0])}: rc={san.returncode}",
            *tail[-6:],
            sep="\n",
            flush=True,
        )
        failed += san.returncode != 0
    for case in cases:
        argv = [str(v) for v in case]
        run = subprocess.run(
            [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120
        )
        last = (run.stdout.strip().splitlines() or run.stderr.strip().splitlines() or ["?"])[-1]
        print(f"{' '.join(argv):32s} rc={run.returncode} {last[:150]}", flush=True)
        failed += run.returncode != 0
        if run.returncode and args.sanitize and sanitizer and sanitized < 2:
            sanitized += 1
            san = subprocess.run(
                [sanitizer, "--tool", "memcheck", "--print-limit", "3", sys.executable, "-c", CHILD, *argv],
                capture_output=True, text=True, timeout=150,
            )  # fmt: skip
            lines = [ln for ln in (san.stdout + san.stderr).splitlines() if ln.startswith("=========")]
            print("\n".join(lines[:24]), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
