"""Eager wall time of `int4_linear` as a user calls it, NF4 beside int4 and F.linear (issue 24:
NF4 at int4's speed), with each of NF4's tensor-core GEMV lookups (cuda.TC_NF4_LOOKUPS): the
kernel and its host path together (quant_tc_gemv.py times the kernels alone).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_nf4_wall.py [--ms 1,16]

bf16 x, group 128 (NF4 with bfloat16 scales), weights rotated over copies past L2 (>= 200 MB),
100 calls back to back per repetition, the best of 5 repetitions, us per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F

from openkernels.quant import cuda as G
from openkernels.quant import int4_linear
from openkernels.quant.quantize import quantize_int4, quantize_nf4
from openkernels.shared import replay
from openkernels.shared.dev.bench import eager_wall_us, tensor_bytes

DEV = torch.device("cuda")
SERIES_BYTES = 200e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--shapes", default="8192x8192,28672x8192,2048x8192")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(DEV), flush=True)
    default = G.TC_NF4_LOOKUP
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        w = torch.randn(n, k, device=DEV) * 0.02
        quantized = {"int4": quantize_int4(w, 128), "nf4": quantize_nf4(w, 128, scale_dtype=torch.bfloat16)}
        dense = [w.to(torch.bfloat16)] + [torch.randn_like(w, dtype=torch.bfloat16) for _ in range(2)]
        del w
        copies = {
            kind: [
                dataclasses.replace(q, qweight=q.qweight.clone(), scales=q.scales.clone())
                for _ in range(max(2, math.ceil(SERIES_BYTES / tensor_bytes(q.qweight, q.scales))))
            ]
            for kind, q in quantized.items()
        }
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            row = {"F.linear": eager_wall_us([lambda w=w, x=x: F.linear(x, w) for w in dense])}
            row["int4"] = eager_wall_us([lambda q=q, x=x: int4_linear(x, q) for q in copies["int4"]])
            for lookup in G.TC_NF4_LOOKUPS:
                G.TC_NF4_LOOKUP = lookup
                replay.set_mode(replay.mode())  # forget recorded calls: they keep the build they recorded
                row[f"nf4 {lookup}"] = eager_wall_us(
                    [lambda q=q, x=x: int4_linear(x, q) for q in copies["nf4"]]
                )
            G.TC_NF4_LOOKUP = default
            replay.set_mode(replay.mode())
            print(
                f"{n}x{k} M={m}: " + ", ".join(f"{name} {us:.1f}" for name, us in row.items()) + " us",
                flush=True,
            )


if __name__ == "__main__":
    main()
