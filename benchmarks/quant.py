"""asv suite of the quant family: the same cases as benchmarks/quant_linear.py.

`track_ms` times each contender with the shared harness (do_bench median on GPU, rotating
weights past L2; perf_counter median on CPU) and reports milliseconds; `track_ratio_to_torch`
the speed-up over the 16-bit weight in torch (F.linear), the number the issue's bars are
written in. M and shapes come from openkernels.quant.bench; nothing runs at import.
"""

from __future__ import annotations

import torch

MS = [1, 16, 128, 2048]
CONTENDERS = ["ours", "torch", "tinygemm"]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Int4LinearSuite:
    params = (MS, CONTENDERS)
    param_names = ["m", "contender"]
    timeout = 300

    def setup(self, m: int, contender: str) -> None:
        from openkernels.quant import bench

        device = _device()
        ms = bench.GPU_MS if device.type == "cuda" else bench.CPU_MS
        if m not in ms:
            raise NotImplementedError  # asv skips parameter combinations that raise here
        shape = bench.GPU_SHAPES[-1] if device.type == "cuda" else bench.CPU_SHAPES[0]
        (case,) = bench.cases(device, shapes=[shape], ms=[m], peers=CONTENDERS[1:])
        if contender not in case.contenders:
            raise NotImplementedError
        self.case, self.device = case, device
        inputs = case.make_inputs(device)
        self.inputs = case.setup[contender](inputs) if contender in case.setup else inputs
        self.fn = case.contenders[contender]
        self.torch_fn, self.torch_inputs = case.contenders["torch"], inputs

    def track_ms(self, m: int, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        return time_ms(self.fn, [self.inputs], self.device)

    track_ms.unit = "ms"

    def track_ratio_to_torch(self, m: int, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        base = time_ms(self.torch_fn, [self.torch_inputs], self.device)
        return base / time_ms(self.fn, [self.inputs], self.device)

    track_ratio_to_torch.unit = "x"
