"""asv suite of the attention family: the same cases as `benchmarks/run.py attention`.

`track_tflops` times each contender with the shared harness (do_bench median on GPU,
perf_counter median on CPU) and reports TFLOP/s with the family's FLOP count (4·B·H·S²·D
forward, halved when causal; fwd+bwd 3.5x); `time_step` is asv's own timing of one step
(synchronized on GPUs). asv keeps the history and flags regressions. Ops, shapes, FLOPs
and peers come from openkernels.attention.bench; nothing runs at import.

Shapes (batch x heads x seqlen x head_dim): three of the GPU grid, the anchors of
DESIGN.md (head_dim 128 at the grid's shortest and longest sequences, head_dim 64), run
on GPUs only; "cpu" is CPU_SHAPES[0], run on CPUs only. The forced SDPA backends are GPU
peers; on CPUs plain SDPA ("sdpa") stands in.
"""

from __future__ import annotations

import torch

OPS = ["causal", "full"]
DIRECTIONS = ["fwd", "fwd+bwd"]
SHAPES = ["8x16x2048x128", "1x16x16384x128", "8x32x2048x64", "cpu"]
CONTENDERS = ["ours", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex"]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class AttentionSuite:
    params = (OPS, DIRECTIONS, SHAPES, CONTENDERS)
    param_names = ["op", "direction", "shape", "contender"]
    timeout = 600  # FlexAttention compiles per shape and direction in setup

    def setup(self, op: str, direction: str, shape: str, contender: str) -> None:
        from openkernels.attention import bench

        device = _device()
        # asv skips parameter combinations whose setup raises NotImplementedError.
        if (shape == "cpu") != (device.type == "cpu"):
            raise NotImplementedError  # GPU shapes on GPUs, the CPU shape on CPUs
        if device.type == "cpu" and contender.startswith("sdpa-"):
            raise NotImplementedError  # forced SDPA backends are the GPU peers
        bhsd = bench.CPU_SHAPES[0] if shape == "cpu" else tuple(int(n) for n in shape.split("x"))
        (case,) = bench.cases(
            device,
            shapes=[bhsd],
            ops=[op],
            directions=[direction],
            peers=[] if contender == "ours" else [contender],
        )
        if contender not in case.contenders:
            raise NotImplementedError  # e.g. a torch without FlexAttention
        self.case, self.device = case, device
        inputs = case.make_inputs(device)
        self.inputs = case.setup[contender](inputs) if contender in case.setup else inputs
        self.fn = case.contenders[contender]
        self.fn(self.inputs)  # compilation (flex) and first-call work stay out of the timings
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_step(self, op: str, direction: str, shape: str, contender: str) -> None:
        self.fn(self.inputs)
        self._sync()

    def track_tflops(self, op: str, direction: str, shape: str, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        return self.case.flops / time_ms(self.fn, [self.inputs], self.device) / 1e9

    track_tflops.unit = "TFLOP/s"


DECODE_SHAPES = ["32x32x8x4096x128", "1x32x8x131072x128", "cpu"]
DECODE_CONTENDERS = ["ours", "ours-paged16", "ours-paged256", "ours-int8", "ours-int4", "sdpa", "flex"]


class DecodeSuite:
    """Decode against a KV cache (openkernels.attention.bench_kvcache): one query per
    sequence, GQA 32/8, D128; `track_gbps` counts the bf16 cache's bytes for every contender
    (a quantized cache past the copy ceiling is faster than a 16-bit kernel could be)."""

    params = (DECODE_SHAPES, DECODE_CONTENDERS)
    param_names = ["shape", "contender"]
    timeout = 600

    def setup(self, shape: str, contender: str) -> None:
        from openkernels.attention import bench_kvcache

        device = _device()
        if (shape == "cpu") != (device.type == "cpu"):
            raise NotImplementedError
        dims = bench_kvcache.CPU_SHAPES[0] if shape == "cpu" else tuple(int(n) for n in shape.split("x"))
        ours = contender.startswith("ours")
        (case,) = bench_kvcache.cases(
            device, shapes=[dims], formats=[contender] if ours else [], peers=[] if ours else [contender]
        )
        if contender not in case.contenders:
            raise NotImplementedError
        self.case, self.device = case, device
        self.inputs = case.setup[contender](case.make_inputs(device))
        self.fn = case.contenders[contender]
        self.fn(self.inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_step(self, shape: str, contender: str) -> None:
        self.fn(self.inputs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def track_gbps(self, shape: str, contender: str) -> float:
        from openkernels.shared.bench import time_ms

        return self.case.bytes / time_ms(self.fn, [self.inputs], self.device) / 1e6

    track_gbps.unit = "GB/s"
