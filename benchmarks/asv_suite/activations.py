"""asv suite of the activations family: every op at the family's benchmark shapes.

Cases (bytes moved, inputs) come from openkernels.activations.bench, the module behind
`benchmarks/peers/run.py activations`: 16384x8192 and 4096x4096 on GPUs, 4096x4096 on CPUs;
fwd reads x and writes y, bwd reads dy and x and writes dx (gated ops: x is (rows, 2d)).
`ActivationsPeers`: the same cases in bfloat16 for the peers (`peer`): the torch eager
composition, the same under torch.compile, and on GPUs Liger-Kernel where installed (it has
silu_and_mul and gelu_and_mul[tanh]; n/a for the other ops).
"""

from __future__ import annotations

from typing import Any

from . import _harness as _h

VARIANTS = [
    "silu",
    "gelu[none]",
    "gelu[tanh]",
    "gelu_quick",
    "relu_squared",
    "silu_and_mul",
    "gelu_and_mul[none]",
    "gelu_and_mul[tanh]",
    "mul_and_silu",
    "glu",
]
SMOKE_SHAPE = (64, 256)


def _case(dev: Any, op: str, direction: str, shape: str, dtype: str, peers: list[str]) -> Any:
    """The family's one case for these parameters, with `peers` beside ours."""
    from openkernels.activations import bench

    name, _, approximate = op.partition("[")
    variants = [(name, approximate.rstrip("]") or None)]
    return _h.grid_case(
        bench, dev, shape, dtype, SMOKE_SHAPE, variants=variants, directions=[direction], peers=peers
    )


class Activations(_h.Suite, _h.GBps):
    gpu_shapes = ["16384x8192", "4096x4096"]
    cpu_shapes = ["4096x4096"]
    params = [VARIANTS, ["fwd", "bwd"], gpu_shapes, _h.DTYPES, _h.BACKENDS]
    param_names = ["op", "direction", "shape", "dtype", "backend"]
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()


class ActivationsPeers(_h.PeerSuite, _h.GBps, family=Activations):
    # name in the report: contender of openkernels.activations.bench
    peers = {"torch eager": "torch", "torch.compile": "torch.compile", "Liger": "liger"}
    peer_devices = {"Liger": ("cuda",)}
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()
