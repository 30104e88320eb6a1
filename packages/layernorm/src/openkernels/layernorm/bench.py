"""Benchmark cases of the layernorm family: shape grid, peers and byte counts.

Used by benchmarks/peers/run.py (tables and JSON), the asv suite and the demo. Ops:
  rms_norm, layer_norm      y = norm(x) * w (+ b)
  add_rms_norm              y, h = rms_norm(x + r), x + r   (prenorm, fused residual)
Directions: "fwd", and "fwd+bwd" (forward, then gradients of x and the parameters).
Peers: torch eager (F.rms_norm / F.layer_norm; for add_rms_norm the unfused `x + r` then
F.rms_norm), the same under torch.compile(dynamic=False), Liger-Kernel
(LigerRMSNormFunction, LigerLayerNormFunction, LigerFusedAddRMSNormFunction) and QuACK
(`quack.rmsnorm`, rms_norm and add_rms_norm; GPUs where it imports). On sm_90, contender
"ours:cluster" is our call with the cluster forward forced (cuda/, not yet picked by default).
Bytes: fwd reads x and writes y (add_rms_norm also reads r and writes h); fwd+bwd counts
x, y, dy and dx once each (add_rms_norm: x, r, y, h, dy, dx), the convention of the peer
numbers in DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import BenchCase, Check, compiled_peer
from openkernels.shared.dev.bench import score as _score

from . import api
from .problem import BENCH_OPS, norm_name

__all__ = [
    "GPU_SHAPES",
    "LONG_ROW_SHAPES",
    "CPU_SHAPES",
    "OPS",
    "cases",
    "jax_cases",
    "checks",
    "torch_composition",
]

# (rows, N) with rows * N = 64M elements: the bar's grid; then rows of 64K and 256K.
GPU_SHAPES = ((32768, 2048), (16384, 4096), (8192, 8192), (4096, 16384))
LONG_ROW_SHAPES = ((1024, 65536), (256, 262144))
CPU_SHAPES = ((4096, 4096), (16384, 1024))
OPS = BENCH_OPS
EPS = 1e-6


def torch_composition(op: str) -> Callable[..., Any]:
    """What a user writes in plain PyTorch for `op` (the eager and torch.compile peer)."""
    if op == "rms_norm":
        return lambda x, w, b, r: F.rms_norm(x, (x.shape[-1],), w, EPS)
    if op == "layer_norm":
        return lambda x, w, b, r: F.layer_norm(x, (x.shape[-1],), w, b, EPS)

    def add_rms_norm(x, w, b, r):
        h = x + r
        return F.rms_norm(h, (h.shape[-1],), w, EPS), h

    return add_rms_norm


def _ours(op: str, face: Any = api) -> Callable[..., Any]:
    """Our op on the cases' (x, w, b, r), through `face`: the PyTorch API, or the JAX face
    (openkernels.layernorm.jax, same functions and arguments) on JAX arrays."""
    if op == "rms_norm":
        return lambda x, w, b, r: face.rms_norm(x, w, EPS)
    if op == "layer_norm":
        return lambda x, w, b, r: face.layer_norm(x, w, b, EPS)
    return lambda x, w, b, r: face.rms_norm(x, w, EPS, residual=r, prenorm=True)


def _cluster(op: str, device: torch.device) -> Callable[..., Any] | None:
    """Our call with the sm_90 cluster forward forced (the backward stays Triton's): on
    devices where dispatch finds it usable."""
    from openkernels.shared import dispatch

    from .cuda import supports

    if supports(dispatch.key_for(torch.empty(0, device=device, dtype=torch.bfloat16))) is not None:
        return None
    ours = _ours(op)

    def forced(x, w, b, r):
        with dispatch.force("cluster"):
            return ours(x, w, b, r)

    return forced


def _liger(op: str, device: torch.device | None = None) -> Callable[..., Any] | None:
    try:
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return lambda x, w, b, r: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "none", False)
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return lambda x, w, b, r: LigerLayerNormFunction.apply(x, w, b, EPS)
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return lambda x, w, b, r: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "none", False)
    except ImportError:
        return None


def _quack(op: str, device: torch.device | None = None) -> Callable[..., Any] | None:
    """QuACK's RMSNorm (CuTe DSL, differentiable; thread-block clusters on Hopper). Its
    LayerNorm has no backward through autograd: no peer for layer_norm."""
    if op == "layer_norm":
        return None
    try:
        import quack
    except Exception:  # ImportError, or a CUDA / CuTe DSL mismatch raised at import
        return None
    if op == "rms_norm":
        return lambda x, w, b, r: quack.rmsnorm(x, w, eps=EPS)
    return lambda x, w, b, r: quack.rmsnorm(x, w, residual=r, eps=EPS, prenorm=True)


def _bytes(op: str, rows: int, n: int, dtype: torch.dtype, direction: str) -> int:
    size = torch.finfo(dtype).bits // 8
    units = {("fwd", False): 2, ("fwd", True): 4, ("fwd+bwd", False): 4, ("fwd+bwd", True): 6}
    return units[direction, op == "add_rms_norm"] * rows * n * size


def _fwd(fn: Callable[..., Any]) -> Callable[[dict], Any]:
    return lambda s: fn(s["x"], s["w"], s["b"], s["r"])


def _fwd_bwd(fn: Callable[..., Any]) -> Callable[[dict], Any]:
    """Forward, then the gradients of x and the parameters (no .grad accumulation)."""

    def step(s: dict) -> Any:
        out = fn(s["x"], s["w"], s["b"], s["r"])
        y = out[0] if isinstance(out, tuple) else out
        return torch.autograd.grad(y, s["leaves"], s["dy"])

    return step


def _with_grad(s: dict) -> dict:
    x, w = s["x"].detach().requires_grad_(), s["w"].detach().requires_grad_()
    b = None if s["b"] is None else s["b"].detach().requires_grad_()
    r = None if s["r"] is None else s["r"].detach().requires_grad_()
    leaves = tuple(t for t in (x, w, b, r) if t is not None)
    return {**s, "x": x, "w": w, "b": b, "r": r, "leaves": leaves}


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    ops: Sequence[str] = OPS,
    directions: Sequence[str] = ("fwd", "fwd+bwd"),
    peers: Sequence[str] = ("torch", "torch.compile", "liger", "quack", "ours:cluster"),
) -> list[BenchCase]:
    """Benchmark cases for `device` (the GPU grid on CUDA/ROCm, CPU shapes on CPU)."""
    device = torch.device(device)
    unknown = set(directions) - {"fwd", "fwd+bwd"}
    if unknown:
        raise ValueError(f"layernorm benchmark directions are 'fwd' and 'fwd+bwd', got {sorted(unknown)}")
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    out = []
    for op in ops:
        ours, composed = _ours(op), torch_composition(op)
        contenders_fns: dict[str, Callable[..., Any]] = {"ours": ours}
        if "torch" in peers:
            contenders_fns["torch"] = composed
        if "torch.compile" in peers:
            contenders_fns["torch.compile"] = compiled_peer(composed)
        for name, load in (("liger", _liger), ("quack", _quack), ("ours:cluster", _cluster)):
            fn = load(op, device) if name in peers and device.type == "cuda" else None
            if fn is not None:
                contenders_fns[name] = fn
        for rows, n in shapes:
            for dtype in dtypes:

                def make(dev: torch.device, rows: int = rows, n: int = n, dtype=dtype, op=op) -> dict:
                    def rand(*shape: int) -> torch.Tensor:
                        return torch.randn(*shape, device=dev, dtype=torch.float32).to(dtype)

                    return {
                        "x": rand(rows, n),
                        "w": 1 + 0.1 * rand(n),
                        "b": rand(n) if op == "layer_norm" else None,
                        "r": rand(rows, n) if op == "add_rms_norm" else None,
                        "dy": rand(rows, n),
                    }

                for direction in directions:
                    wrap = _fwd if direction == "fwd" else _fwd_bwd
                    setup = {} if direction == "fwd" else dict.fromkeys(contenders_fns, _with_grad)
                    out.append(
                        BenchCase(
                            "layernorm",
                            op,
                            direction,
                            (rows, n),
                            dtype,
                            _bytes(op, rows, n, dtype, direction),
                            make,
                            {name: wrap(fn) for name, fn in contenders_fns.items()},
                            setup=setup,
                        )
                    )
    return out


_PARAMS = ("x", "w", "b", "r")


def _jax_ours(op: str) -> Callable[..., Any]:
    """`_ours` on JAX arrays (openkernels.layernorm.jax)."""
    from . import jax as ljax

    return _ours(op, ljax)


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def _present(fn: Callable[..., Any]) -> Callable[[dict], Any]:
    return lambda s: fn(s["x"], s["w"], s.get("b"), s.get("r"))


def _torch_fwd_bwd(fn: Callable[..., Any]) -> Callable[[dict], Any]:
    """Forward, then the gradients of x and the parameters from dy (y's gradient only)."""

    def step(s: dict) -> Any:
        leaves = {k: s[k].detach().requires_grad_() for k in _PARAMS if k in s}
        y = _first(fn(leaves["x"], leaves["w"], leaves.get("b"), leaves.get("r")))
        grads = torch.autograd.grad(y, list(leaves.values()), s["dy"])
        return tuple(g for k, g in zip(leaves, grads) if k != "r")

    return step


def _jax_fwd_bwd(fn: Callable[..., Any]) -> Callable[[dict], Any]:
    """The same through jax.vjp; gradients in the torch step's order (for the diff)."""
    import jax

    def step(s: dict) -> Any:
        params = {k: s[k] for k in _PARAMS if k in s}
        _, vjp = jax.vjp(lambda p: _first(fn(p["x"], p["w"], p.get("b"), p.get("r"))), params)
        (grads,) = vjp(s["dy"])
        # The residual's gradient is x's array: returning it again from a jitted function
        # makes XLA copy it into a second buffer (+0.066 ms at 32768x2048, measured), which
        # torch, returning one tensor twice, does not. Both sides return it once.
        return tuple(grads[k] for k in params if k != "r")

    return step


def jax_cases(
    *,
    shapes: Sequence[tuple[int, int]] = GPU_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    ops: Sequence[str] = OPS,
) -> list:
    """`JaxCase`s (openkernels.shared.dev.bench_jax): each op forward, and forward+backward
    (jax.vjp against torch.autograd; the backward needs the forward's statistics, so the
    pair is what both sides can time) on the GPU shapes. Inputs hold only the present
    tensors: x, w, dy, plus b (layer_norm) or r (add_rms_norm)."""
    from openkernels.shared.dev.bench_jax import JaxCase

    out = []
    for op in ops:
        ours, jax_op = _ours(op), _jax_ours(op)
        for rows, n in shapes:

            def make(dev: torch.device, rows: int = rows, n: int = n, op: str = op) -> dict:
                def rand(*shape: int) -> torch.Tensor:
                    return torch.randn(*shape, device=dev, dtype=torch.float32).to(dtype)

                s = {"x": rand(rows, n), "w": 1 + 0.1 * rand(n), "dy": rand(rows, n)}
                if op == "layer_norm":
                    s["b"] = rand(n)
                if op == "add_rms_norm":
                    s["r"] = rand(rows, n)
                return s

            pairs = {
                "fwd": (_present(ours), _present(jax_op)),
                "fwd+bwd": (_torch_fwd_bwd(ours), _jax_fwd_bwd(jax_op)),
            }
            for direction, (torch_fn, jax_fn) in pairs.items():
                nbytes = _bytes(op, rows, n, dtype, direction)
                out.append(
                    JaxCase("layernorm", op, direction, (rows, n), dtype, nbytes, make, torch_fn, jax_fn)
                )
    return out


def checks(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[Check]:
    """Each op, forward and backward, on every implementation usable on `device`, against
    the float64 reference: the demo's and the CLI's self-check."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations

    from . import reference

    device = torch.device(device)
    dt = str(dtype).removeprefix("torch.")
    results = []
    x = torch.randn(257, 1000, device=device).to(dtype)
    r = torch.randn(257, 1000, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(1000, device=device)).to(dtype)
    b = torch.randn(1000, device=device).to(dtype)
    dy = torch.randn(257, 1000, device=device).to(dtype)
    for op in OPS:
        rms = op != "layer_norm"
        res = r if op == "add_rms_norm" else None
        leaves64 = [t.double().requires_grad_() for t in (x, w, b if not rms else None, res) if t is not None]
        x64, w64 = leaves64[0], leaves64[1]
        if rms:
            h64 = x64 if res is None else x64 + leaves64[2]
            h64 = h64 + (h64.to(dtype).double() - h64).detach()  # the kernel rounds h to the dtype
            ref = reference.rms_norm_ref(h64, w64, EPS)
        else:
            ref = reference.layer_norm_ref(x64, w64, leaves64[2], EPS)
        ref_grads = torch.autograd.grad(ref, leaves64, dy.double())
        name = norm_name(rms)
        for impl in testable_implementations(name, device):
            leaves = [t.detach().to(dtype).requires_grad_() for t in leaves64]
            with dispatch.force(f"{name}:{impl}", f"{name}_backward:{impl}"):
                if rms:
                    out = api.rms_norm(
                        leaves[0], leaves[1], EPS, residual=leaves[2] if res is not None else None
                    )
                else:
                    out = api.layer_norm(leaves[0], leaves[1], leaves[2], EPS)
                grads = torch.autograd.grad(out, leaves, dy)
            results.append(Check(op, "fwd", impl, dt, *_score(out, ref, dtype)))
            # Gradients compare to the tolerance of their dtype, widened for the 257-row /
            # 1000-column sums they are (see openkernels.shared.dev.testing.assert_close).
            worst = max(_score(g, g_ref, dtype)[0] for g, g_ref in zip(grads, ref_grads))
            results.append(Check(op, "bwd", impl, dt, worst, worst <= 1.0))
    return results
