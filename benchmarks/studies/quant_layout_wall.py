"""Int4Linear with its codes stored in rows against the same layer stored tiled
(Int4Linear(layout="tiled"), issue 24's packed layout), as a user calls it: eager wall time per
call, and CUDA-graph time of the same calls (the kernels without the host), beside F.linear.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_layout_wall.py [--ms 1,4,16,32]

bf16 x and weight, group 128 (bfloat16 scales), int4 and NF4; each variant's layers rotated over
copies past the L2 (>= 200 MB); us per call, the best of 5 repetitions of 100 eager calls, and
rotating_graph_ms's CUDA-graph time. Calls past 16 rows convert tiled codes per call (one
warning per shape: silenced here).
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from torch import nn

from openkernels.quant import Int4Linear
from openkernels.shared.dev.bench import eager_wall_us, rotating_graph_ms, tensor_bytes

DEV = torch.device("cuda")
SERIES_BYTES = 200e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,4,16,32")
    parser.add_argument("--shapes", default="8192x8192,28672x8192,2048x8192,4096x4096")
    parser.add_argument("--kinds", default="int4,nf4")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(torch.cuda.get_device_name(DEV), flush=True)
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        linear = nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        dense = [linear.weight.detach()] + [torch.randn_like(linear.weight) for _ in range(2)]
        for kind in args.kinds.split(","):
            layers = {}
            for layout in ("rows", "tiled"):
                one = Int4Linear.from_linear(linear, kind=kind, layout=layout)
                count = max(2, math.ceil(SERIES_BYTES / tensor_bytes(one.qweight, one.scales)))
                layers[layout] = [one] + [
                    Int4Linear.from_weight(one.weight, layout=layout).to(DEV) for _ in range(count - 1)
                ]
            for m in (int(v) for v in args.ms.split(",")):
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                row = {}
                for name, calls in (
                    ("F.linear", [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in dense]),
                    ("rows", [lambda layer=layer, x=x: layer(x) for layer in layers["rows"]]),
                    ("tiled", [lambda layer=layer, x=x: layer(x) for layer in layers["tiled"]]),
                ):
                    with torch.no_grad():
                        wall = eager_wall_us(calls)
                        graph = rotating_graph_ms(calls, 20)
                    row[name] = (wall, None if graph is None else graph * 1e3)
                cells = ", ".join(
                    f"{name} {wall:.1f} / {'-' if graph is None else f'{graph:.1f}'}"
                    for name, (wall, graph) in row.items()
                )
                print(f"{n}x{k} {kind} M={m} (eager wall / graph us): {cells}", flush=True)
            del layers


if __name__ == "__main__":
    main()
