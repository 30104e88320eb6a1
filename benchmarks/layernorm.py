"""asv suite of the layernorm family: the same cases as `benchmarks/run.py layernorm`.

`track_gbps` times each contender with the shared harness (do_bench median on GPU,
perf_counter median on CPU) and reports GB/s; asv keeps the history and flags regressions.
Ops, shapes and peers come from openkernels.layernorm.bench; nothing runs at import.

Shapes: "grid" is the first shape of the device's grid (GPU_SHAPES[0] on a GPU, many
short rows in one tile each; CPU_SHAPES[0] on the CPU); "long-row" is LONG_ROW_SHAPES[0]
(rows of 64K elements, the looped kernels), on GPUs only.
"""

from __future__ import annotations

import torch

OPS = ["rms_norm", "layer_norm", "add_rms_norm"]
DIRECTIONS = ["fwd", "fwd+bwd"]
SHAPES = ["grid", "long-row"]
CONTENDERS = ["ours", "torch", "torch.compile"]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LayerNormSuite:
    params = (OPS, DIRECTIONS, SHAPES, CONTENDERS)
    param_names = ["op", "direction", "shape", "contender"]
    timeout = 300

    def setup(self, op: str, direction: str, shape: str, contender: str) -> None:
        from openkernels.layernorm import bench

        device = _device()
        if shape == "grid":
            rows_cols = bench.GPU_SHAPES[0] if device.type == "cuda" else bench.CPU_SHAPES[0]
        elif device.type == "cuda":
            rows_cols = bench.LONG_ROW_SHAPES[0]
        else:
            raise NotImplementedError  # the long-row shape is a GPU case; asv skips it here
        (case,) = bench.cases(
            device,
            shapes=[rows_cols],
            ops=[op],
            directions=[direction],
            peers=CONTENDERS[1:],
        )
        if contender not in case.contenders:
            raise NotImplementedError  # asv skips parameter combinations that raise here
        self.case, self.device = case, device
        inputs = case.make_inputs(device)
        self.inputs = case.setup[contender](inputs) if contender in case.setup else inputs
        self.fn = case.contenders[contender]

    def track_gbps(self, op: str, direction: str, shape: str, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        return self.case.bytes / time_ms(self.fn, [self.inputs], self.device) / 1e6

    track_gbps.unit = "GB/s"
