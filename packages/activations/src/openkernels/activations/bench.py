"""Benchmark cases of the activations family: shape grid, peers and byte counts.

Used by benchmarks/peers/run.py (tables and JSON), the asv suite and the demo. Peers: the
torch eager composition a user would write, the same under torch.compile(dynamic=False),
and Liger-Kernel where it has the op (SwiGLU = silu_and_mul, GEGLU = gelu_and_mul tanh).
The variants and the torch peers follow from the op table (spec.SPECS): a new op needs no
edit here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import BenchCase, Check, compiled_peer
from openkernels.shared.dev.bench import score as _score

from . import api, reference
from .spec import APPROXIMATE, SPECS, Act, act_for

__all__ = ["GPU_SHAPES", "CPU_SHAPES", "VARIANTS", "cases", "jax_cases", "checks", "torch_composition"]

# (rows, d): gated ops read (rows, 2d) and write (rows, d); unary ops map (rows, d).
GPU_SHAPES = ((16384, 8192), (4096, 4096))
CPU_SHAPES = ((4096, 4096),)
# (op, approximate): every op of the table, the GELU ops once per `approximate` value.
VARIANTS = tuple(
    (name, approximate)
    for name, spec in SPECS.items()
    for approximate in (APPROXIMATE if spec.approximate else (None,))
)

# Activations torch has one fused function for; every other code is written as the
# reference writes it (reference.act_ref: x * torch.sigmoid(1.702 * x), torch.relu(x) ** 2, ...).
_TORCH_ACTS: dict[Act, Callable[[torch.Tensor], torch.Tensor]] = {
    Act.SILU: F.silu,
    Act.GELU: F.gelu,
    Act.GELU_TANH: functools.partial(F.gelu, approximate="tanh"),
}


def torch_composition(op: str, approximate: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a user writes in plain PyTorch for `op` (the eager and torch.compile peer): the
    op's torch.nn.functional function where it has one (`OpSpec.torch_peer`), else its
    activation, times the other half for gated ops."""
    spec = SPECS[op]
    if spec.torch_peer is not None:
        peer = getattr(F, spec.torch_peer)
        return functools.partial(peer, approximate=approximate or "none") if spec.approximate else peer
    code = act_for(spec, approximate or "none")
    act = _TORCH_ACTS.get(code, functools.partial(reference.act_ref, act=code))
    if not spec.gated:
        return act
    if spec.act_first:
        return lambda x: act(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :]
    return lambda x: x[..., : x.shape[-1] // 2] * act(x[..., x.shape[-1] // 2 :])


def _ours(op: str, approximate: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = getattr(api, op)
    return fn if approximate is None else functools.partial(fn, approximate=approximate)


def _liger(op: str, approximate: str | None) -> Any:
    try:
        if op == "silu_and_mul":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction

            return LigerSiLUMulFunction
        if op == "gelu_and_mul" and approximate == "tanh":
            from liger_kernel.ops.geglu import LigerGELUMulFunction

            return LigerGELUMulFunction
    except ImportError:
        return None
    return None


def _bytes(gated: bool, rows: int, d: int, dtype: torch.dtype, direction: str) -> int:
    size = torch.finfo(dtype).bits // 8
    # fwd: read x, write out. bwd: read grad_out and x, write grad_in.
    if gated:
        units = 3 if direction == "fwd" else 5
    else:
        units = 2 if direction == "fwd" else 3
    return units * rows * d * size


def _grad_setup(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], dict]:
    def setup(s: dict) -> dict:
        x = s["x"].detach().requires_grad_()
        return {**s, "x": x, "y": fn(x)}

    return setup


def _liger_setup(liger: Any) -> Callable[[dict], dict]:
    def setup(s: dict) -> dict:
        d = s["x"].shape[-1] // 2
        a = s["x"][..., :d].contiguous().requires_grad_()
        b = s["x"][..., d:].contiguous().requires_grad_()
        return {**s, "a": a, "b": b, "y": liger.apply(a, b)}

    return setup


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    variants: Sequence[tuple[str, str | None]] = VARIANTS,
    directions: Sequence[str] = ("fwd", "bwd"),
    peers: Sequence[str] = ("torch", "torch.compile", "liger"),
) -> list[BenchCase]:
    """Benchmark cases for `device` (GPU shapes on CUDA/ROCm, CPU shapes on CPU)."""
    device = torch.device(device)
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    out = []
    for op, approximate in variants:
        gated = SPECS[op].gated
        name = f"{op}[{approximate}]" if approximate else op
        ours, composed = _ours(op, approximate), torch_composition(op, approximate)
        compiled = compiled_peer(composed) if "torch.compile" in peers else None
        liger = _liger(op, approximate) if "liger" in peers else None
        backward = getattr(torch.ops.openkernels, f"{op}_backward")
        for rows, d in shapes:
            for dtype in dtypes:
                width = 2 * d if gated else d

                def make(
                    dev: torch.device, rows: int = rows, width: int = width, d: int = d, dtype=dtype
                ) -> dict:
                    x = torch.randn(rows, width, device=dev, dtype=torch.float32).to(dtype)
                    return {"x": x, "dy": torch.randn(rows, d, device=dev, dtype=torch.float32).to(dtype)}

                for direction in directions:
                    contenders: dict[str, Callable[[dict], Any]] = {}
                    setup: dict[str, Callable[[dict], dict]] = {}
                    if direction == "fwd":
                        contenders["ours"] = lambda s, f=ours: f(s["x"])
                        if "torch" in peers:
                            contenders["torch"] = lambda s, f=composed: f(s["x"])
                        if compiled is not None:
                            contenders["torch.compile"] = lambda s, f=compiled: f(s["x"])
                        if liger is not None:
                            contenders["liger"] = lambda s, L=liger: L.apply(s["a"], s["b"])
                            setup["liger"] = _liger_split
                    else:
                        extra = (approximate,) if approximate else ()
                        contenders["ours"] = lambda s, f=backward, e=extra: f(s["dy"], s["x"], *e)
                        grad = _autograd_step
                        if "torch" in peers:
                            contenders["torch"], setup["torch"] = grad, _grad_setup(composed)
                        if compiled is not None:
                            contenders["torch.compile"], setup["torch.compile"] = grad, _grad_setup(compiled)
                        if liger is not None:
                            contenders["liger"], setup["liger"] = _liger_grad_step, _liger_setup(liger)
                    out.append(
                        BenchCase(
                            "activations",
                            name,
                            direction,
                            (rows, width),
                            dtype,
                            _bytes(gated, rows, d, dtype, direction),
                            make,
                            contenders,
                            setup=setup,
                        )
                    )
    return out


def _liger_split(s: dict) -> dict:
    d = s["x"].shape[-1] // 2
    return {**s, "a": s["x"][..., :d].contiguous(), "b": s["x"][..., d:].contiguous()}


def _autograd_step(s: dict) -> Any:
    return torch.autograd.grad(s["y"], s["x"], s["dy"], retain_graph=True)


def _liger_grad_step(s: dict) -> Any:
    return torch.autograd.grad(s["y"], (s["a"], s["b"]), s["dy"], retain_graph=True)


def checks(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[Check]:
    """Every op, forward and backward, on every implementation usable on `device`, against
    the float64 reference: the demo's and the CLI's self-check."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations

    device = torch.device(device)
    results = []
    for op, approximate in VARIANTS:
        gated = SPECS[op].gated
        extra = (approximate,) if approximate else ()
        ref_fn = getattr(reference, f"{op}_ref")
        x = torch.randn(257, 2 * 300 if gated else 300, device=device).to(dtype)
        x64 = x.double().requires_grad_()
        ref_out = ref_fn(x64, *extra)
        grad_out = torch.randn(ref_out.shape, device=device).to(dtype)
        (ref_grad,) = torch.autograd.grad(ref_out, x64, grad_out.double())
        for impl in testable_implementations(op, device):
            with dispatch.force(f"{op}:{impl}", f"{op}_backward:{impl}"):
                xg = x.clone().requires_grad_()
                out = _ours(op, approximate)(xg)
                (grad,) = torch.autograd.grad(out, xg, grad_out)
            label = f"{op}[{approximate}]" if approximate else op
            results.append(
                Check(label, "fwd", impl, str(dtype).removeprefix("torch."), *_score(out, ref_out, dtype))
            )
            results.append(
                Check(label, "bwd", impl, str(dtype).removeprefix("torch."), *_score(grad, ref_grad, dtype))
            )
    return results


def jax_cases(
    *,
    shapes: Sequence[tuple[int, int]] = GPU_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    variants: Sequence[tuple[str, str | None]] = VARIANTS,
) -> list:
    """`JaxCase`s (openkernels.shared.dev.bench_jax): each op forward, and its gradient through
    jax.vjp against torch.autograd, on the GPU shapes."""
    import jax

    from openkernels.shared.dev.bench_jax import JaxCase

    from . import jax as ajax

    out = []
    for op, approximate in variants:
        gated = SPECS[op].gated
        name = f"{op}[{approximate}]" if approximate else op
        extra = (approximate,) if approximate else ()
        ours, jax_op = _ours(op, approximate), getattr(ajax, op)
        backward = getattr(torch.ops.openkernels, f"{op}_backward")
        for rows, d in shapes:
            width = 2 * d if gated else d

            def make(dev: torch.device, rows: int = rows, width: int = width, d: int = d) -> dict:
                x = torch.randn(rows, width, device=dev, dtype=torch.float32).to(dtype)
                return {"x": x, "dy": torch.randn(rows, d, device=dev, dtype=torch.float32).to(dtype)}

            def jax_grad(s: dict, f=jax_op, e=extra) -> Any:
                _, vjp = jax.vjp(lambda x: f(x, *e), s["x"])
                return vjp(s["dy"])[0]

            for direction in ("fwd", "bwd"):
                if direction == "fwd":
                    torch_fn, jax_fn = (
                        (lambda s, f=ours: f(s["x"])),
                        (lambda s, f=jax_op, e=extra: f(s["x"], *e)),
                    )
                else:
                    torch_fn, jax_fn = (lambda s, f=backward, e=extra: f(s["dy"], s["x"], *e)), jax_grad
                nbytes = _bytes(gated, rows, d, dtype, direction)
                out.append(
                    JaxCase(
                        "activations", name, direction, (rows, width), dtype, nbytes, make, torch_fn, jax_fn
                    )
                )
    return out
