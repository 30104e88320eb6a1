"""Benchmark cases and self-checks of the rotary position embedding (apply_rotary).

Memory-bound: each case's `bytes` counts q and k read and written once plus the cos and sin
tables read once (forward: q, k in, q_out, k_out out; backward: the output gradients in, the
input gradients out, the same count), reported as GB/s against the device copy.
Shapes: (batch, seqlen, heads_q, heads_k, head_dim, rot_dim); tables (1, seqlen, rot_dim) in
the inputs' dtype, what transformers passes for the default position ids.
Contenders (the same input sets):
  ours            apply_rotary on q, k (B, S, H, D), the views of the projections' outputs;
                  "bwd" times the backward library op alone
  torch           transformers' apply_rotary_pos_emb written out (q * cos + rotate_half(q) *
                  sin, on the (B, H, S, D) transposed views transformers passes, the partial
                  rotary split of GPT-NeoX / Phi when rot_dim < head_dim); "bwd" times the
                  autograd backward of its graph
  torch.compile   the same function under torch.compile(dynamic=False)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from openkernels.shared.dev.bench import BenchCase, Check, compiled_peer
from openkernels.shared.dev.bench import score as _score

from . import api

__all__ = [
    "GPU_SHAPES",
    "CPU_SHAPES",
    "PEERS",
    "cases",
    "checks",
    "jax_cases",
    "rotary_bytes",
    "torch_rotary",
]

# Llama 3 8B (GQA 32/8, D128) prefill as one long sequence and as a batch, a decode step of 64
# sequences, Phi-2 (32 heads of 80, 32 rotated).
GPU_SHAPES = (
    (1, 8192, 32, 8, 128, 128),
    (8, 2048, 32, 8, 128, 128),
    (64, 1, 32, 8, 128, 128),
    (4, 2048, 32, 32, 80, 32),
)
CPU_SHAPES = ((1, 1024, 32, 8, 128, 128),)
PEERS = ("torch", "torch.compile")
DIRECTIONS = ("fwd", "bwd")


def rotary_bytes(shape: tuple[int, ...], element_size: int = 2) -> int:
    """q, k in and out (or their gradients) plus the (1, S, R) cos and sin tables once."""
    b, s, hq, hk, d, r = shape
    return (2 * b * s * (hq + hk) * d + 2 * s * r) * element_size


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def torch_rotary(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb on (B, H, S, D) q and k, (B or 1, S, R) tables
    (with GPT-NeoX's partial-rotary split when R < D): the torch peer."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, k_rot = q[..., :r], k[..., :r]
    q_embed = torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., r:]), dim=-1)
    k_embed = torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., r:]), dim=-1)
    return q_embed, k_embed


def _bhsd(s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return s["q"].transpose(1, 2), s["k"].transpose(1, 2)


def _grad_setup(fn: Callable[..., Any]) -> Callable[[dict], dict]:
    """Leaves that require grad and the peer's graph, built once per input set."""

    def setup(s: dict) -> dict:
        q, k = (t.detach().requires_grad_() for t in (s["q"], s["k"]))
        q_out, k_out = fn(q.transpose(1, 2), k.transpose(1, 2), s["cos"], s["sin"])
        return {**s, "leaves": (q, k), "outs": (q_out, k_out)}

    return setup


def _grad_step(s: dict) -> Any:
    grads = (s["gq"].transpose(1, 2), s["gk"].transpose(1, 2))
    return torch.autograd.grad(s["outs"], s["leaves"], grads, retain_graph=True)


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, ...]] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    directions: Sequence[str] = DIRECTIONS,
    peers: Sequence[str] = PEERS,
) -> list[BenchCase]:
    """Benchmark cases for `device` (GPU_SHAPES on CUDA/ROCm, CPU_SHAPES on CPU). Peer names
    other families use and this op has no counterpart for (liger, sdpa, flex) are skipped."""
    device = torch.device(device)
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    unknown = set(directions) - set(DIRECTIONS)
    if unknown:
        raise ValueError(f"rotary benchmark directions are 'fwd' and 'bwd', got {sorted(unknown)}")
    for shape in shapes:
        if len(shape) != 6:
            raise ValueError(f"rotary benchmark shapes are (batch, seqlen, heads_q, heads_k, head_dim, rot_dim), "
                             f"got {shape}")  # fmt: skip
    compiled = compiled_peer(torch_rotary) if "torch.compile" in peers else None
    backward = torch.ops.openkernels.apply_rotary_backward
    out = []
    for shape in shapes:
        b, s, hq, hk, d, r = shape
        for dtype in dtypes:

            def make(dev: torch.device, b=b, s=s, hq=hq, hk=hk, d=d, r=r, dtype=dtype) -> dict:
                def rand(*size: int) -> torch.Tensor:
                    return torch.randn(*size, device=dev, dtype=torch.float32).to(dtype)

                angles = torch.rand(1, s, r, device=dev) * 6.3
                return {"q": rand(b, s, hq, d), "k": rand(b, s, hk, d), "cos": angles.cos().to(dtype),
                        "sin": angles.sin().to(dtype), "gq": rand(b, s, hq, d), "gk": rand(b, s, hk, d)}  # fmt: skip

            for direction in directions:
                contenders: dict[str, Callable[[dict], Any]] = {}
                setup: dict[str, Callable[[dict], dict]] = {}
                if direction == "fwd":
                    contenders["ours"] = lambda s: api.apply_rotary(s["q"], s["k"], s["cos"], s["sin"])
                    if "torch" in peers:
                        contenders["torch"] = lambda s: torch_rotary(*_bhsd(s), s["cos"], s["sin"])
                    if compiled is not None:
                        contenders["torch.compile"] = lambda s, f=compiled: f(*_bhsd(s), s["cos"], s["sin"])
                else:
                    contenders["ours"] = lambda s, f=backward: f(s["gq"], s["gk"], s["cos"], s["sin"])
                    if "torch" in peers:
                        contenders["torch"], setup["torch"] = _grad_step, _grad_setup(torch_rotary)
                    if compiled is not None:
                        contenders["torch.compile"], setup["torch.compile"] = (
                            _grad_step,
                            _grad_setup(compiled),
                        )
                element = torch.finfo(dtype).bits // 8
                out.append(BenchCase("attention", "apply_rotary", direction, tuple(shape), dtype,
                                     rotary_bytes(shape, element), make, contenders, setup=setup))  # fmt: skip
    return out


def checks(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[Check]:
    """apply_rotary forward and backward, full and partial rotary, GQA, odd seqlen, on every
    implementation usable on `device`, against the float64 reference (the CLI's self-check,
    run from bench.checks). The table's tolerance: the kernel rounds once from float32."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations

    from . import reference

    device = torch.device(device)
    dt = str(dtype).removeprefix("torch.")
    results = []
    for rot_dim in (128, 64):
        name = f"apply_rotary r{rot_dim}"
        b, s, hq, hk, d = 2, 97, 4, 2, 128
        q, k, gq = (torch.randn(b, s, h, d, device=device).to(dtype) for h in (hq, hk, hq))
        gk = torch.randn(b, s, hk, d, device=device).to(dtype)
        cos, sin = (torch.randn(1, s, rot_dim, device=device).to(dtype) for _ in range(2))
        leaves64 = [t.double().requires_grad_() for t in (q, k)]
        ref = reference.apply_rotary_ref(*leaves64, cos.double(), sin.double())
        ref_grads = torch.autograd.grad(ref, leaves64, (gq.double(), gk.double()))
        for impl in testable_implementations("apply_rotary", device):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
            try:
                with dispatch.force(f"apply_rotary:{impl}", f"apply_rotary_backward:{impl}"):
                    outs = api.apply_rotary(*leaves, cos, sin)
                    grads = torch.autograd.grad(outs, leaves, (gq, gk))
            except Exception as exc:  # reported as a failed check, not a crash of the CLI
                warnings.warn(f"{name} on {impl}: {type(exc).__name__}: {exc}", stacklevel=2)
                results += [Check(name, direction, impl, dt, float("nan"), False) for direction in DIRECTIONS]
                continue
            for direction, got, want in (("fwd", outs, ref), ("bwd", grads, ref_grads)):
                scores = [_score(a, e, dtype) for a, e in zip(got, want)]
                worst = max(e for e, _ in scores)
                results.append(Check(name, direction, impl, dt, worst, all(ok for _, ok in scores)))
    return results


def jax_cases(*, shapes: Sequence[tuple[int, ...]] = GPU_SHAPES, dtype: torch.dtype = torch.bfloat16) -> list:
    """`JaxCase`s (openkernels.shared.dev.bench_jax) of apply_rotary: forward, and backward (the
    library's backward op against jax.vjp of the JAX function; the backward needs only the
    tables, so XLA drops the forward), on (batch, seqlen, heads_q, heads_k, head_dim, rot_dim)."""
    import jax

    from openkernels.shared.dev.bench_jax import JaxCase

    from .. import jax as attention_jax

    def make_for(shape: tuple[int, ...]) -> Callable[[torch.device], dict]:
        b, s, hq, hk, d, r = shape

        def make(dev: torch.device) -> dict:
            def rand(*size: int) -> torch.Tensor:
                return torch.randn(*size, device=dev, dtype=torch.float32).to(dtype)

            angles = torch.rand(1, s, r, device=dev) * 6.3
            return {"q": rand(b, s, hq, d), "k": rand(b, s, hk, d), "cos": angles.cos().to(dtype),
                    "sin": angles.sin().to(dtype), "gq": rand(b, s, hq, d), "gk": rand(b, s, hk, d)}  # fmt: skip

        return make

    def jax_bwd(t: dict) -> Any:
        _, vjp = jax.vjp(lambda q, k: attention_jax.apply_rotary(q, k, t["cos"], t["sin"]), t["q"], t["k"])
        return vjp((t["gq"], t["gk"]))

    backward = torch.ops.openkernels.apply_rotary_backward
    pairs = {
        "fwd": (lambda t: api.apply_rotary(t["q"], t["k"], t["cos"], t["sin"]),
                lambda t: attention_jax.apply_rotary(t["q"], t["k"], t["cos"], t["sin"])),
        "bwd": (lambda t: backward(t["gq"], t["gk"], t["cos"], t["sin"]), jax_bwd),
    }  # fmt: skip
    out = []
    for shape in shapes:
        nbytes = rotary_bytes(shape, torch.finfo(dtype).bits // 8)
        for direction, (torch_fn, jax_fn) in pairs.items():
            out.append(JaxCase("attention", "apply_rotary", direction, tuple(shape), dtype, nbytes, make_for(shape),
                               torch_fn, jax_fn))  # fmt: skip
    return out
