"""asv suite of the activations family: the same cases as benchmarks/run.py.

`track_gbps` times each contender with the shared harness (do_bench median on GPU,
rotating inputs past L2) and reports GB/s; asv keeps the history and flags regressions.
Shapes and peers come from openkernels.activations.bench; nothing runs at import.
"""

from __future__ import annotations

import torch

VARIANTS = ["silu", "gelu[tanh]", "silu_and_mul", "gelu_and_mul[none]", "gelu_and_mul[tanh]"]
DIRECTIONS = ["fwd", "bwd"]
CONTENDERS = ["ours", "torch", "torch.compile"]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ActivationsSuite:
    params = (VARIANTS, DIRECTIONS, CONTENDERS)
    param_names = ["op", "direction", "contender"]
    timeout = 300

    def setup(self, op: str, direction: str, contender: str) -> None:
        from openkernels.activations import bench

        name, _, approx = op.partition("[")
        variant = (name, approx.rstrip("]") or None)
        device = _device()
        (case,) = bench.cases(
            device,
            variants=[variant],
            directions=[direction],
            shapes=[bench.GPU_SHAPES[0] if device.type == "cuda" else bench.CPU_SHAPES[0]],
            peers=CONTENDERS[1:],
        )
        if contender not in case.contenders:
            raise NotImplementedError  # asv skips parameter combinations that raise here
        self.case, self.device = case, device
        inputs = case.make_inputs(device)
        self.inputs = case.setup[contender](inputs) if contender in case.setup else inputs
        self.fn = case.contenders[contender]

    def track_gbps(self, op: str, direction: str, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        return self.case.bytes / time_ms(self.fn, [self.inputs], self.device) / 1e6

    track_gbps.unit = "GB/s"
