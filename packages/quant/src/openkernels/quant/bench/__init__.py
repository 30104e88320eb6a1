"""Benchmark cases of the quant family: shape grid, peers and byte / FLOP counts.

y = x (M, K) @ W^T with W (N, K) in 4 bits, group 128, bf16 activations. Peers, each on the
same x and a weight quantized from the same W in its own format:
  "torch"       torch.nn.functional.linear with the 16-bit W (cuBLAS on GPUs): the speed to beat
  "tinygemm"    torch's int4 kernel (aten._weight_int4pack_mm), from our int4 codes
  "bnb-nf4"     bitsandbytes NF4, blocksize 64 (if installed)
  "gemlite"     GemLite's Triton int4 GEMM/GEMV, group 128 (if installed)
  "ours:gemv"   our call with the CUDA C++ kernels forced (cuda/: M = 1, and int4 up to M =
                16; NVIDIA GPUs where dispatch finds them usable; not yet picked by default)
(peers.py sets each up). Small M is memory-bound (GB/s of the weight bytes read once, ratio
to the copy ceiling); from M >= 128 the case also counts FLOPs. Nothing runs at import.
cpu.py times the CPU kernel against dense matmuls (python -m openkernels.quant.bench.cpu).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import BenchCase, Check
from openkernels.shared.dev.bench import score as _score

from .. import api, reference
from ..problem import KINDS
from ..quantize import quantize_int4, quantize_nf4
from .peers import available, run_bnb, run_gemlite, run_tinygemm, setup_bnb, setup_gemlite, setup_tinygemm

__all__ = ["GPU_SHAPES", "CPU_SHAPES", "GPU_MS", "CPU_MS", "cases", "checks", "jax_cases", "PEERS"]

GPU_SHAPES = ((8192, 8192), (28672, 8192))  # (N, K): a square projection and an MLP up-projection
CPU_SHAPES = ((4096, 4096),)
GPU_MS = (1, 16, 128, 2048)
CPU_MS = (1, 16, 128)
PEERS = ("torch", "tinygemm", "bnb-nf4", "gemlite", "ours:gemv")
COMPUTE_BOUND_M = 128


def weight_bytes(n: int, k: int, group: int) -> int:
    """Bytes of a 4-bit weight with float16 scales and zeros."""
    return n * k // 2 + 2 * 2 * n * (k // group)


def _make(
    m: int, n: int, k: int, group: int, dtype: torch.dtype, kind: str
) -> Callable[[torch.device], dict]:
    def make(device: torch.device) -> dict[str, Any]:
        w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
        q = quantize_nf4(w, group) if kind == "nf4" else quantize_int4(w, group)
        return {"x": torch.randn(m, k, device=device, dtype=dtype), "w": w, "q": q}

    return make


def _gemv_usable(device: torch.device, dtype: torch.dtype, kind: str) -> bool:
    from openkernels.shared import dispatch

    from ..cuda import supports

    return supports(dispatch.key_for(torch.empty(0, device=device, dtype=dtype), kind)) is None


def _forced_gemv(s: dict) -> Any:
    from openkernels.shared import dispatch

    with dispatch.force("gemv"):
        return api.int4_linear(s["x"], s["q"])


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    ms: Sequence[int] | None = None,
    group: int = 128,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    kinds: Sequence[str] = ("int4",),
    ops: Sequence[str] | None = None,
    peers: Sequence[str] = PEERS,
) -> list[BenchCase]:
    """One case per (kind, dtype, M, N, K): ours plus the installed peers, on the same inputs.
    `ops` (benchmarks/peers/run.py's --ops) picks kinds: "int4", "nf4"."""
    device = torch.device(device)
    kinds = tuple(ops) if ops else kinds
    gpu = device.type == "cuda"
    shapes = shapes or (GPU_SHAPES if gpu else CPU_SHAPES)
    ms = ms or (GPU_MS if gpu else CPU_MS)
    out = []
    for kind, dtype in ((kind, dtype) for kind in kinds for dtype in dtypes):
        for n, k in shapes:
            for m in ms:
                g = 64 if kind == "nf4" and group == 128 else group
                contenders: dict[str, Callable] = {"ours": lambda s: api.int4_linear(s["x"], s["q"])}
                setup: dict[str, Callable] = {}
                if "torch" in peers:
                    contenders["torch"] = lambda s: F.linear(s["x"], s["w"])
                if gpu and kind == "int4" and "tinygemm" in peers and dtype == torch.bfloat16:
                    contenders["tinygemm"], setup["tinygemm"] = run_tinygemm, setup_tinygemm
                if gpu and "bnb-nf4" in peers and available("bnb-nf4"):
                    contenders["bnb-nf4"], setup["bnb-nf4"] = run_bnb, setup_bnb
                if gpu and kind == "int4" and "gemlite" in peers and available("gemlite"):
                    contenders["gemlite"], setup["gemlite"] = run_gemlite, setup_gemlite
                small = m == 1 or (m <= 16 and kind == "int4")  # what the CUDA C++ kernels take
                if gpu and small and "ours:gemv" in peers and _gemv_usable(device, dtype, kind):
                    contenders["ours:gemv"] = _forced_gemv
                nbytes = weight_bytes(n, k, g) + 2 * m * (k + n)
                flops = 2 * m * n * k if m >= COMPUTE_BOUND_M else 0
                out.append(BenchCase("quant", f"int4_linear[{kind}]", "fwd", (m, n, k), dtype, nbytes,
                                     _make(m, n, k, g, dtype, kind), contenders, flops=flops, setup=setup))  # fmt: skip
    return out


def checks(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[Check]:
    """int4_linear (every kind, the gemv / tiled / dequantize paths) and dequantize_int4 on every
    implementation usable on `device`, against the float64 reference: the self-check."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations

    device = torch.device(device)
    results = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for kind in KINDS:
        w = torch.randn(300, 512, generator=gen) * 0.02
        q = (quantize_nf4(w) if kind == "nf4" else quantize_int4(w)).to(device)
        w64 = reference.dequantize_int4_ref(q.qweight, q.scales, q.zeros, q.group_size, kind, torch.float64)
        for m in (1, 16, 1100):
            x = torch.randn(m, 512, generator=gen).to(device, dtype)
            ref = x.double() @ w64.t()
            bound = reference.linear_error_bound(x.double(), w64, ref, dtype, weight_rounded_to=dtype)
            for impl in testable_implementations("int4_linear", device):
                with dispatch.force(impl):
                    out = api.int4_linear(x, q)
                error, ok = _bound_score(out, ref, bound)
                results.append(Check(f"int4_linear[{kind}] M={m}", "fwd", impl, str(dtype).removeprefix("torch."),
                                     error, ok))  # fmt: skip
        for impl in testable_implementations("dequantize_int4", device):
            with dispatch.force(impl):
                got = api.dequantize_int4(q, dtype)
            results.append(Check(f"dequantize_int4[{kind}]", "fwd", impl, str(dtype).removeprefix("torch."),
                                 *_score(got, w64.to(dtype).double(), dtype)))  # fmt: skip
        results += _fused_checks(q, w64, kind, device, dtype, gen)
    return results


def _fused_checks(q, w64, kind: str, device: torch.device, dtype: torch.dtype, gen) -> list[Check]:
    """The decode step's fused ops (fused.py) at 1 and 5 rows on every implementation usable on
    `device`: int4_linear of the composed input (act(gate) * up, x's RMSNorm) against float64,
    within the linear's bound plus one rounding of each input value (the kernels compute it
    in float32 as they load x)."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations

    from .. import ops
    from ..fused import gated_product, rms_normed

    results = []
    unit = 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    norm_weight = (0.5 + torch.rand(512, generator=gen)).to(device, dtype)
    for m in (1, 5):
        gate_up = torch.randn(m, 1024, generator=gen).to(device, dtype)
        x = (3 * torch.randn(m, 512, generator=gen)).to(device, dtype)
        parts = (q.qweight, q.scales, q.zeros, None, q.group_size, kind)
        for op, h, fn, args in (
            ("int4_linear_gated", gated_product(gate_up, "silu"), ops.INT4_LINEAR_GATED, (gate_up, *parts, "silu")),
            ("int4_linear_rmsnorm", rms_normed(x, norm_weight, 1e-5), ops.INT4_LINEAR_RMSNORM,
             (x, norm_weight, 1e-5, 0.0, *parts)),
        ):  # fmt: skip
            ref = h.double() @ w64.t()
            bound = reference.linear_error_bound(h.double(), w64, ref, dtype, weight_rounded_to=dtype)
            bound = bound + 2 * unit * (h.double().abs() @ w64.abs().t())
            for impl in testable_implementations(op, device):
                with dispatch.force(impl):
                    out = fn(*args)
                error, ok = _bound_score(out, ref, bound)
                results.append(Check(f"{op}[{kind}] M={m}", "fwd", impl, str(dtype).removeprefix("torch."), error,
                                     ok))  # fmt: skip
    return results


def _bound_score(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> tuple[float, bool]:
    got = out.double()
    if torch.isnan(got).any():
        return float("nan"), False
    error = float(((got - ref).abs() / bound).max())
    return error, error <= 1.0


def jax_cases(
    *,
    shapes: Sequence[tuple[int, int]] = GPU_SHAPES,
    ms: Sequence[int] = GPU_MS,
    group: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    kinds: Sequence[str] = ("int4",),
) -> list:
    """`JaxCase`s (openkernels.shared.dev.bench_jax): int4_linear forward from JAX against the
    PyTorch call, on the GPU shapes: decode (M = 1, 16: the split-K tiled kernel), M = 128
    and prefill (M = 2048: dequantize + GEMM). Both sides get the same packed parts; the
    JAX weight is built inside the jitted function (no cost at run time)."""
    from openkernels.shared.dev.bench_jax import JaxCase

    from .. import jax as qjax

    out = []
    for kind in kinds:
        g = 64 if kind == "nf4" and group == 128 else group
        for n, k in shapes:
            for m in ms:

                def make(
                    device: torch.device, m: int = m, n: int = n, k: int = k, g: int = g, kind: str = kind
                ) -> dict:
                    w = (torch.randn(n, k, device=device) * 0.02).to(dtype)
                    q = quantize_nf4(w, g) if kind == "nf4" else quantize_int4(w, g)
                    parts = {"qweight": q.qweight, "scales": q.scales}
                    if q.zeros is not None:
                        parts["zeros"] = q.zeros
                    return {"x": torch.randn(m, k, device=device, dtype=dtype), **parts}

                def torch_fn(s: dict, g: int = g, kind: str = kind) -> torch.Tensor:
                    # What Int4Linear.forward calls: no Int4Weight to build per call.
                    return api.linear_parts(s["x"], s["qweight"], s["scales"], s.get("zeros"), None, g, kind)

                def jax_fn(s: dict, g: int = g, kind: str = kind) -> Any:
                    weight = qjax.Int4Weight(s["qweight"], s["scales"], s.get("zeros"), g, kind)
                    return qjax.int4_linear(s["x"], weight)

                nbytes = weight_bytes(n, k, g) + 2 * m * (k + n)
                flops = 2 * m * n * k if m >= COMPUTE_BOUND_M else 0
                out.append(JaxCase("quant", f"int4_linear[{kind}]", "fwd", (m, n, k), dtype, nbytes, make, torch_fn,
                                   jax_fn, flops=flops))  # fmt: skip
    return out
