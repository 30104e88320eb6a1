"""Run a family's benchmark cases against its peers and print a table (and JSON).

    python benchmarks/run.py activations [--device cuda] [--dtype bfloat16] [--json out.json]
        [--ops silu_and_mul,gelu_and_mul] [--directions fwd,bwd] [--shapes 16384x8192,4096x4096]
    python benchmarks/run.py layernorm [--ops rms_norm,add_rms_norm] [--directions fwd,fwd+bwd]

Shapes are (rows, d): gated ops read (rows, 2d). Needs the repo's src folders importable.
"""

from __future__ import annotations

import argparse
import importlib

import torch

from openkernels.shared.bench import copy_ceiling_gbps, format_table, run_cases, write_json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ops", default="")
    parser.add_argument("--directions", default="", help="default: the family's (fwd,bwd / fwd,fwd+bwd)")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--peers", default="torch,torch.compile,liger")
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--json", default="")
    parser.add_argument("--kernel-time", action="store_true", help="also report device time in kernels")
    args = parser.parse_args()

    bench = importlib.import_module(f"openkernels.{args.family}.bench")
    device = torch.device(args.device)
    kwargs = {
        "dtypes": [getattr(torch, d) for d in args.dtype.split(",")],
        "peers": [p for p in args.peers.split(",") if p],
    }
    if args.directions:
        kwargs["directions"] = args.directions.split(",")
    if args.ops:
        wanted = args.ops.split(",")
        if hasattr(bench, "VARIANTS"):  # activations: (op, approximate) pairs
            kwargs["variants"] = [v for v in bench.VARIANTS if v[0] in wanted or f"{v[0]}[{v[1]}]" in wanted]
        else:
            kwargs["ops"] = wanted
    if args.shapes:
        kwargs["shapes"] = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    cases = bench.cases(device, **kwargs)
    ceiling = copy_ceiling_gbps(device)
    results = run_cases(cases, device, ceiling_gbps=ceiling, rep_ms=args.rep_ms, kernel_time=args.kernel_time)
    print(format_table(results, ceiling_gbps=ceiling), flush=True)
    if args.json:
        write_json(results, args.json, ceiling_gbps=ceiling, device=str(device), torch=torch.__version__)


if __name__ == "__main__":
    main()
