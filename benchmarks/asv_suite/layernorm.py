"""asv suite of the layernorm family: rms_norm, layer_norm and add_rms_norm (rms_norm with a
residual, prenorm=True), forward and forward+backward.

Cases come from openkernels.layernorm.bench (`benchmarks/run.py layernorm`): the GPU grid
32768x2048 ... 4096x16384 (the same bytes at four row lengths), 4096x4096 and 16384x1024
on CPUs.
"""

from __future__ import annotations

from typing import Any

from . import _harness as _h

SMOKE_SHAPE = (64, 256)


class LayerNorm(_h.Suite, _h.GBps):
    gpu_shapes = ["32768x2048", "16384x4096", "8192x8192", "4096x16384"]
    cpu_shapes = ["4096x4096", "16384x1024"]
    params = [["rms_norm", "layer_norm", "add_rms_norm"], ["fwd", "fwd+bwd"], gpu_shapes + cpu_shapes,
              _h.DTYPES, _h.BACKENDS]  # fmt: skip
    param_names = ["op", "direction", "shape", "dtype", "backend"]

    def setup_cache(self) -> dict:
        return self.measure_all()

    def build(self, dev: Any, op: str, direction: str, shape: str, dtype: str, backend: str) -> Any:
        from openkernels.layernorm import bench

        cases = bench.cases(
            dev,
            shapes=[SMOKE_SHAPE if _h.smoke() else _h.parse_shape(shape)],
            dtypes=[_h.torch_dtype(dtype)],
            ops=[op],
            directions=[direction],
            peers=[],
        )
        return _h.only_case(cases)
