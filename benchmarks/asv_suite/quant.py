"""asv suite of the quant family: int4_linear (x @ W^T with a 4-bit weight), int4 and nf4.

Cases come from openkernels.quant.bench (`benchmarks/peers/quant_linear.py`): M = 1, 16, 128 and
2048 tokens against (N, K) = 8192x8192 and 28672x8192 weights on GPUs, M = 1, 16, 128 at
4096x4096 on CPUs. GB/s count the 4-bit weight, its scales and zeros, x and y once (at
M = 2048 the work is compute-bound: benchmarks/peers/quant_linear.py reports its TFLOP/s).
`Int4LinearPeers`: the same cases in bfloat16 for the peers (`peer`): F.linear with the
unquantized 16-bit weight (cuBLAS on GPUs), and on GPUs torch's int4 kernel tinygemm
(aten._weight_int4pack_mm, from our int4 codes; int4 only) where the torch build has it.
"""

from __future__ import annotations

from typing import Any

from . import _harness as _h


def _case(dev: Any, kind: str, m: str, shape: str, dtype: str, peers: list[str]) -> Any:
    """The family's one case for these parameters, with `peers` beside ours."""
    from openkernels.quant import bench

    size = dict(shapes=[(128, 256) if _h.smoke() else _h.parse_shape(shape)], ms=[int(m)], kinds=[kind],
                peers=peers)  # fmt: skip
    try:
        cases = bench.cases(dev, dtypes=[_h.torch_dtype(dtype)], **size)
    except TypeError:  # the family's first commits took one dtype
        cases = bench.cases(dev, dtype=_h.torch_dtype(dtype), **size)
    return _h.only_case(cases)


class Int4Linear(_h.Suite, _h.GBps):
    gpu_shapes = ["8192x8192", "28672x8192"]
    cpu_shapes = ["4096x4096"]
    gpu_only = {
        "m": ["2048"]
    }  # a GPU path (Hopper: the wgmma kernel; else dequantize + GEMM); CPUs stop at M = 128
    params = [["int4", "nf4"], ["1", "16", "128", "2048"], gpu_shapes + cpu_shapes, _h.DTYPES, _h.BACKENDS]
    param_names = ["kind", "m", "shape", "dtype", "backend"]
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()


class Int4LinearPeers(_h.PeerSuite, _h.GBps, family=Int4Linear):
    # name in the report: contender of openkernels.quant.bench
    peers = {"F.linear (16-bit weight)": "torch", "tinygemm (torch int4)": "tinygemm"}
    peer_devices = {"tinygemm (torch int4)": ("cuda",)}
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()
