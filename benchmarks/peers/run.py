"""Run a family's benchmark cases against its peers and print a table (and JSON).

    python benchmarks/peers/run.py activations [--device cuda] [--dtype bfloat16] [--json out.json]
        [--ops silu_and_mul,gelu_and_mul] [--directions fwd,bwd] [--shapes 16384x8192,4096x4096]
    python benchmarks/peers/run.py layernorm [--ops rms_norm,add_rms_norm] [--directions fwd,fwd+bwd]
    python benchmarks/peers/run.py attention [--shapes 8x16x2048x128] [--ops causal,full]
        [--directions fwd,fwd+bwd] [--peers sdpa-flash,sdpa-cudnn,sdpa-efficient,flex] [--dropout 0.1]

Shapes are (rows, d) for activations (gated ops read (rows, 2d)) and layernorm, and
(batch, heads, seqlen, head_dim) for attention. Memory-bound cases print GB/s against the
device copy, compute-bound ones (attention) TFLOP/s against a bf16 matmul, both measured
in this run. --peers defaults to the family's own list. Needs the repo's src folders
importable.
"""

from __future__ import annotations

import importlib

import torch

import _cli
from openkernels.shared.dev.bench import copy_ceiling_gbps, matmul_ceiling_tflops, write_json


def main() -> None:
    parser = _cli.parser()
    parser.add_argument("family")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ops", default="")
    parser.add_argument("--directions", default="", help="default: the family's (fwd,bwd / fwd,fwd+bwd)")
    parser.add_argument("--shapes", default="")
    parser.add_argument(
        "--peers",
        default="",
        help="default: the family's (torch,torch.compile,liger; attention: "
        "sdpa-flash,sdpa-cudnn,sdpa-efficient,flex on GPUs, sdpa,flex on CPUs)",
    )
    parser.add_argument("--dropout", type=float, default=0.0, help="attention: every contender's dropout_p")
    _cli.add_run_options(parser)
    args = parser.parse_args()

    from openkernels.shared import manifest

    headline = manifest.families()[args.family].bench[0]  # "bench", or attention's "core.bench"
    bench = importlib.import_module(f"openkernels.{args.family}.{headline}")
    device = torch.device(args.device)
    kwargs = {"dtypes": [getattr(torch, d) for d in args.dtype.split(",")]}
    if args.peers:
        kwargs["peers"] = _cli.names(args.peers)
    if args.directions:
        kwargs["directions"] = args.directions.split(",")
    if args.ops:
        wanted = args.ops.split(",")
        if hasattr(bench, "VARIANTS"):  # activations: (op, approximate) pairs
            kwargs["variants"] = [v for v in bench.VARIANTS if v[0] in wanted or f"{v[0]}[{v[1]}]" in wanted]
        else:
            kwargs["ops"] = wanted
    if args.shapes:
        kwargs["shapes"] = _cli.shapes(args.shapes)
    if args.dropout:
        kwargs["dropout"] = args.dropout
    cases = bench.cases(device, **kwargs)
    # Each ceiling only where some case is measured against it.
    ceilings = {}
    if any(not c.flops for c in cases):
        ceilings["ceiling_gbps"] = copy_ceiling_gbps(device)
    if any(c.flops for c in cases):
        ceilings["ceiling_tflops"] = matmul_ceiling_tflops(device)
    results = _cli.run_and_print(cases, device, args, **ceilings)
    if args.json:
        write_json(results, args.json, **ceilings, device=str(device), torch=torch.__version__)


if __name__ == "__main__":
    main()
