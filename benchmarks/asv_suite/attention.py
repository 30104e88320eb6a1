"""asv suite of the attention family: prefill attention, decode against a KV cache, rotary.

- `Attention`: causal and full attention, forward and forward+backward, in TFLOP/s with the
  family's FLOP count (4·B·H·S²·D forward, halved when causal; fwd+bwd 3.5x). Shapes
  (batch x heads x seqlen x head_dim) from openkernels.attention.core.bench: head_dim 128 at the
  grid's shortest and longest sequences and head_dim 64 on GPUs, 2x8x1024x64 on CPUs.
- `Decode`: one query per sequence against a KV cache (openkernels.attention.kvcache.bench,
  GQA 32/8, head_dim 128), per cache format; GB/s count the 16-bit cache's bytes for every
  format, so a quantized cache can pass the copy ceiling.
- `Rotary`: apply_rotary to q and k, forward and backward (openkernels.attention.rotary.bench).
- `AttentionPeers` / `DecodePeers`: the same cases in bfloat16 for the peers (`peer`): on GPUs
  SDPA with one backend forced (flash: FlashAttention-2's kernel; efficient: xFormers'
  memory-efficient kernel; cuDNN's) and FlashAttention-4 (flash_attn.cute) where it
  imports, on CPUs SDPA with torch's own choice; for decode, SDPA with enable_gqa on the
  bf16 cache.
"""

from __future__ import annotations

from typing import Any

from . import _harness as _h
from . import _peers


def _case(dev: Any, op: str, direction: str, shape: str, dtype: str, peers: list[str]) -> Any:
    """The one case of openkernels.attention.core.bench for these parameters (tiny in smoke mode)."""
    from openkernels.attention.core import bench

    cases = bench.cases(
        dev,
        shapes=[(1, 2, 128, 64) if _h.smoke() else _h.parse_shape(shape)],
        dtypes=[_h.torch_dtype(dtype)],
        ops=[op],
        directions=[direction],
        peers=peers,
    )
    return _h.only_case(cases)


class Attention(_h.Suite, _h.TFLOPs):
    gpu_shapes = ["8x16x2048x128", "1x16x16384x128", "8x32x2048x64"]
    cpu_shapes = ["2x8x1024x64"]
    params = [["causal", "full"], ["fwd", "fwd+bwd"], gpu_shapes + cpu_shapes, _h.DTYPES, _h.BACKENDS]
    param_names = ["op", "direction", "shape", "dtype", "backend"]
    case = staticmethod(_case)

    def setup_cache(self) -> dict:
        return self.measure_all()


# Peers by their name in the report: the contender of openkernels.attention.core.bench (SDPA with
# one backend forced by sdpa_kernel; "sdpa": torch's own choice) or of _peers.
ATTENTION_PEERS = {
    "FlashAttention-2 (SDPA flash)": "sdpa-flash",
    "xFormers (SDPA efficient)": "sdpa-efficient",
    "cuDNN (SDPA cudnn)": "sdpa-cudnn",
    "FlashAttention-4": _peers.FLASH_ATTN_4,
    "SDPA": "sdpa",
}
GPU_ONLY = ("cuda",)
CPU_ONLY = ("cpu",)


class AttentionPeers(_h.PeerSuite, _h.TFLOPs, family=Attention):
    """`Attention`'s cases for the peers. SDPA's named backends are NVIDIA's kernels (the
    names would be wrong on ROCm: n/a there); plain SDPA on CPUs, where those do not exist."""

    peers = ATTENTION_PEERS
    peer_devices = {name: GPU_ONLY for name in ATTENTION_PEERS} | {"SDPA": CPU_ONLY}

    def setup_cache(self) -> dict:
        return self.measure_all()

    def build(self, dev: Any, op: str, direction: str, shape: str, dtype: str, peer: str) -> Any:
        import torch

        name = self.peers[peer]
        if name.startswith("sdpa-") and torch.version.hip:
            raise _h.PeerUnavailableError(f"{peer}: SDPA's backends on ROCm are not these kernels")
        case = _case(dev, op, direction, shape, dtype, peers=[] if name == _peers.FLASH_ATTN_4 else [name])
        if name == _peers.FLASH_ATTN_4:
            _peers.add_flash_attn_4(case, causal=op == "causal")
        return case


# Our contenders in bench_kvcache, by cache format.
FORMATS = {"bf16": "ours", "paged16": "ours-paged16", "paged256": "ours-paged256", "int8": "ours-int8",
           "int4": "ours-int4"}  # fmt: skip


class Decode(_h.Suite, _h.GBps):
    gpu_shapes = ["32x32x8x4096x128", "1x32x8x131072x128"]
    cpu_shapes = ["4x32x8x1024x128"]
    params = [list(FORMATS), gpu_shapes + cpu_shapes, _h.DTYPES, _h.BACKENDS]
    param_names = ["cache", "shape", "dtype", "backend"]

    def setup_cache(self) -> dict:
        return self.measure_all()

    def contender(self, **params: str) -> str:
        return FORMATS[params["cache"]]

    def build(self, dev: Any, cache: str, shape: str, dtype: str, backend: str) -> Any:
        from openkernels.attention.kvcache import bench as bench_kvcache

        cases = bench_kvcache.cases(
            dev,
            shapes=[(2, 4, 2, 256, 64) if _h.smoke() else _h.parse_shape(shape)],
            formats=[FORMATS[cache]],
            peers=[],
            dtype=_h.torch_dtype(dtype),
        )
        return _h.only_case(cases)


class DecodePeers(_h.PeerSuite, _h.GBps):
    """`Decode`'s cases for the peer: SDPA with enable_gqa=True on the bf16 cache in its
    (B, H, S, D) layout; GB/s count the same bf16 cache bytes as ours."""

    gpu_shapes = Decode.gpu_shapes
    cpu_shapes = Decode.cpu_shapes
    peers = {"SDPA (enable_gqa)": "sdpa"}
    params = [gpu_shapes + cpu_shapes, _h.PEER_DTYPES, list(peers)]
    param_names = ["shape", "dtype", "peer"]

    def setup_cache(self) -> dict:
        return self.measure_all()

    def build(self, dev: Any, shape: str, dtype: str, peer: str) -> Any:
        from openkernels.attention.kvcache import bench as bench_kvcache

        cases = bench_kvcache.cases(
            dev,
            shapes=[(2, 4, 2, 256, 64) if _h.smoke() else _h.parse_shape(shape)],
            formats=[],
            peers=[self.peers[peer]],
            dtype=_h.torch_dtype(dtype),
        )
        return _h.only_case(cases)


class Rotary(_h.Suite, _h.GBps):
    # batch x seqlen x q heads x kv heads x head_dim x rotary dims
    gpu_shapes = ["1x8192x32x8x128x128", "4x2048x32x32x80x32"]
    cpu_shapes = ["1x1024x32x8x128x128"]
    params = [["fwd", "bwd"], gpu_shapes + cpu_shapes, _h.DTYPES, _h.BACKENDS]
    param_names = ["direction", "shape", "dtype", "backend"]

    def setup_cache(self) -> dict:
        return self.measure_all()

    def build(self, dev: Any, direction: str, shape: str, dtype: str, backend: str) -> Any:
        from openkernels.attention.rotary import bench as bench_rotary

        cases = bench_rotary.cases(
            dev,
            shapes=[(1, 16, 4, 2, 64, 64) if _h.smoke() else _h.parse_shape(shape)],
            dtypes=[_h.torch_dtype(dtype)],
            directions=[direction],
            peers=[],
        )
        return _h.only_case(cases)
