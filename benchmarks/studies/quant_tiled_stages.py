"""The wgmma kernel at 17-64 rows of x on tiled codes against rows, by ring depth (issue 24's
packed layout). Twenty-fourth session, H100: at M = 32 the tiled codes ran slower than rows
(8192 x 8192 27.3 against 24.7 us, 28672 x 8192 82.7 against 70.1) on the same config. A
guess: each rows box line is 64 bytes of a 4 KB row, and the L2 fetches the line's neighbour
(the next K step's codes) with it; a tiled step's four 1 KB blocks bring nothing of the next
step's. A deeper ring would hide that latency instead; this times both layouts at the routed
config (gluon.config_for) and with its stages raised, after checking tiled against rows bitwise.
H100, same session (--ms 32,48 --shapes 8192x8192,28672x8192 --stages 3,6): six stages slower
for both layouts (fewer programs per SM), and the tiled gap at M = 32 stays (28672 x 8192, 3
stages: rows 69.8, tiled 84.4 us): not a latency the ring hides.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/quant_tiled_stages.py [--ms 24,32,48,64] [--stages 3,4,6,8]

bf16 x, group 128, bfloat16 scales, int4; the layers' codes rotated over copies past the L2
(>= 200 MB); CUDA-graph us per call (shared.dev.bench.rotating_graph_ms).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from torch import nn

from openkernels.quant import Int4Linear, gluon
from openkernels.shared.dev.bench import rotating_graph_ms, tensor_bytes

DEV = torch.device("cuda")
SERIES_BYTES = 200e6
SMEM = 227 * 1024


def _call(x: torch.Tensor, layer: Int4Linear, out: torch.Tensor, cfg) -> torch.Tensor:
    gluon.int4_linear_fwd(x, layer.qweight, layer.scales, layer.zeros, None, out, 128, "int4", config=cfg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="24,32,48,64")
    parser.add_argument("--shapes", default="8192x8192,28672x8192,4096x4096")
    parser.add_argument("--stages", default="3,4,6,8")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(DEV), flush=True)
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        linear = nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
        rows = Int4Linear.from_linear(linear, kind="int4")
        count = max(2, math.ceil(SERIES_BYTES / tensor_bytes(rows.qweight, rows.scales)))
        copies = [rows] + [Int4Linear.from_weight(rows.weight).to(DEV) for _ in range(count - 1)]
        tiled = [Int4Linear.from_weight(layer.weight, layout="tiled") for layer in copies]
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            routed = gluon.config_for(m, n, k, 128)
            cells = []
            for stages in (int(v) for v in args.stages.split(",")):
                cfg = dataclasses.replace(routed, stages=stages)
                if gluon.smem_bytes(cfg) > SMEM:
                    continue
                outs, times = {}, {}
                for name, layers in (("rows", copies), ("tiled", tiled)):
                    outs[name] = _call(x, layers[0], torch.empty(m, n, device=DEV, dtype=x.dtype), cfg)
                    buffers = [torch.empty(m, n, device=DEV, dtype=x.dtype) for _ in layers]
                    calls = [
                        lambda la=la, o=o, c=cfg, x=x: _call(x, la, o, c) for la, o in zip(layers, buffers)
                    ]
                    ms = rotating_graph_ms(calls, 20)
                    times[name] = None if ms is None else ms * 1e3
                same = torch.equal(outs["rows"], outs["tiled"])
                cells.append(
                    f"s{stages} rows {times['rows']:.1f} tiled {times['tiled']:.1f}{'' if same else ' DIFFER'}"
                )
            print(f"{n}x{k} M={m} {routed}: " + "; ".join(cells), flush=True)
        del copies, tiled


if __name__ == "__main__":
    main()
