"""The main job: every op of every installed openkernels family, on every backend this
machine has, checked against the float64 reference, then a short speed table against
the torch composition a user would otherwise write.

    python -m openkernels.shared.demo [--device cpu|cuda] [--quick]

Exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import torch

import openkernels

from .bench import copy_ceiling_gbps, format_table, run_cases
from .platform import device_info


def families() -> list[str]:
    """Installed families: openkernels.<name> packages that ship a bench module."""
    names = []
    for module in pkgutil.iter_modules(openkernels.__path__):
        if module.name != "shared" and importlib.util.find_spec(f"openkernels.{module.name}.bench"):
            names.append(module.name)
    return sorted(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller timing runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    info = device_info(device)
    print(f"openkernels demo on {info.backend}/{info.arch} ({info.name}), torch {torch.__version__}")
    failed = 0
    for family in families():
        bench = importlib.import_module(f"openkernels.{family}.bench")
        print(f"\n== {family}: every implementation against the float64 reference ==")
        print(f"{'op':<22} {'dir':<4} {'implementation':<14} {'dtype':<9} {'error/tol':>9}  result")
        for check in bench.checks(device):
            failed += not check.ok
            verdict = "ok" if check.ok else "FAIL"
            print(
                f"{check.op:<22} {check.direction:<4} {check.implementation:<14} {check.dtype:<9} "
                f"{check.error:9.3f}  {verdict}"
            )
        print(f"\n== {family}: speed against torch eager (same inputs, same process) ==")
        cases = bench.cases(device, peers=("torch",))  # each family's own directions
        ceiling = copy_ceiling_gbps(device)
        results = run_cases(cases, device, ceiling_gbps=ceiling, rep_ms=50 if args.quick else 200)
        print(format_table(results, ceiling_gbps=ceiling), flush=True)
    print(f"\n{'all checks passed' if not failed else f'{failed} checks FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
