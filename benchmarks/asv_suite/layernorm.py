"""asv suite of the layernorm family: rms_norm, layer_norm and add_rms_norm (rms_norm with a
residual, prenorm=True), forward and forward+backward.

Cases come from openkernels.layernorm.bench (`benchmarks/peers/run.py layernorm`): the GPU grid
32768x2048 ... 4096x16384 (the same bytes at four row lengths), 4096x4096 and 16384x1024
on CPUs. `LayerNormPeers`: the same cases in bfloat16 for the peers (`peer`): torch eager
(F.rms_norm / F.layer_norm, `x + r` then F.rms_norm for add_rms_norm), the same under
torch.compile, and on GPUs Liger-Kernel and QuACK (rms_norm and add_rms_norm) where installed.
"""

from __future__ import annotations

from typing import Any

from . import _harness as _h
from . import _peers

SMOKE_SHAPE = (64, 256)


def _case(dev: Any, op: str, direction: str, shape: str, dtype: str, peers: list[str]) -> Any:
    """The one case of openkernels.layernorm.bench for these parameters (tiny in smoke mode)."""
    from openkernels.layernorm import bench

    return _h.grid_case(bench, dev, shape, dtype, SMOKE_SHAPE, ops=[op], directions=[direction], peers=peers)


class LayerNorm(_h.Suite, _h.GBps):
    gpu_shapes = ["32768x2048", "16384x4096", "8192x8192", "4096x16384"]
    cpu_shapes = ["4096x4096", "16384x1024"]
    params = [["rms_norm", "layer_norm", "add_rms_norm"], ["fwd", "fwd+bwd"], gpu_shapes + cpu_shapes,
              _h.DTYPES, _h.BACKENDS]  # fmt: skip
    param_names = ["op", "direction", "shape", "dtype", "backend"]
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()


class LayerNormPeers(_h.PeerSuite, _h.GBps, family=LayerNorm):
    # name in the report: contender of openkernels.layernorm.bench (QuACK: of _peers)
    peers = {
        "torch eager": "torch",
        "torch.compile": "torch.compile",
        "Liger": "liger",
        "QuACK": _peers.QUACK,
    }
    peer_devices = {"Liger": ("cuda",), "QuACK": ("cuda",)}

    def setup_cache(self) -> dict:
        return self.measure_all()

    def build(self, dev: Any, op: str, direction: str, shape: str, dtype: str, peer: str) -> Any:
        from openkernels.layernorm import bench

        name = self.peers[peer]
        case = _case(dev, op, direction, shape, dtype, peers=[] if name == _peers.QUACK else [name])
        if name == _peers.QUACK:
            _peers.add_quack(case, eps=getattr(bench, "EPS", 1e-6))
        return case
