"""Benchmark cases of attention and attention_varlen: shape grid, peers and FLOP counts.

Used by `openkernels bench` and benchmarks/peers/run.py (tables and JSON), the asv suite and
the demo, through the family's manifest (the KV cache's and rotary's are ../kvcache/bench.py
and ../rotary/bench.py). Attention is
compute-bound: cases carry FLOPs and report TFLOP/s against a bf16 matmul measured in the
same run.
Shapes: (batch, heads, seqlen, head_dim), self-attention (seqlen_q = seqlen_k), heads_q =
heads_kv. Ops: "causal" and "full" (no mask). Directions: "fwd", and "fwd+bwd" (forward,
then torch.autograd.grad of the output w.r.t. q, k and v with a fixed random grad).
FLOPs: fwd 4·B·H·S²·D (QKᵀ and PV), halved when causal; fwd+bwd 3.5x the forward (the
backward's five matmuls over the forward's two), the convention of DESIGN.md's anchors.
Peers (each given its natural layout in a setup step, outside the timed region: ours
takes (B, S, H, D), SDPA and FlexAttention contiguous (B, H, S, D)):
  sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math   F.scaled_dot_product_attention with
      that one backend forced by torch.nn.attention.sdpa_kernel (a backend that cannot
      run a case is an error row)
  sdpa     plain SDPA, torch's own backend choice (the CPU peer); asked for as "torch"
           (the demo's and other families' name for the torch a user would write) the
           same contender is named "torch"
  flex     FlexAttention, torch.compile(dynamic=False)'d once per case, with the causal
           BlockMask built once per case in setup (create_block_mask)
GPU default: the three fused SDPA backends and flex; CPU default: sdpa and flex.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import BenchCase, Check, compiled_peer
from openkernels.shared.dev.bench import score as _score

from . import api

__all__ = [
    "GPU_SHAPES",
    "CPU_SHAPES",
    "OPS",
    "SDPA_BACKENDS",
    "GPU_PEERS",
    "CPU_PEERS",
    "cases",
    "checks",
    "flops",
    "jax_cases",
    "JAX_SHAPES",
]

# (B, H, S, D): head_dim 128 at 16K tokens per batch from S 2048 to 16384, then head_dim 64
# with 32 heads (the shapes of DESIGN.md's anchors); each runs causal and full.
GPU_SHAPES = (
    (8, 16, 2048, 128),
    (4, 16, 4096, 128),
    (2, 16, 8192, 128),
    (1, 16, 16384, 128),
    (8, 32, 2048, 64),
)
CPU_SHAPES = ((2, 8, 1024, 64),)
# The JAX front end against the PyTorch one: the first head_dim 128 shape and the head_dim 64 one.
JAX_SHAPES = (GPU_SHAPES[0], GPU_SHAPES[-1])
OPS = ("causal", "full")
DIRECTIONS = ("fwd", "fwd+bwd")
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
GPU_PEERS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex")
CPU_PEERS = ("sdpa", "flex")
# Peer names of other families (demo, CLI, run.py's old default) that have no attention
# counterpart: accepted and skipped, so one peer list can drive every family.
_OTHER_FAMILIES_PEERS = ("torch.compile", "liger")


def flops(shape: tuple[int, int, int, int], op: str, direction: str) -> int:
    """FLOPs of one call: 4·B·H·S²·D forward, halved when causal; fwd+bwd 3.5x that."""
    b, h, s, d = shape
    fwd = 4 * b * h * s * s * d // (2 if op == "causal" else 1)
    return fwd if direction == "fwd" else fwd * 7 // 2


def _ours(causal: bool, dropout: float = 0.0) -> Callable[[dict], Any]:
    return lambda s: api.attention(s["q"], s["k"], s["v"], causal=causal, dropout_p=dropout)


def _sdpa(causal: bool, backend: str | None, dropout: float = 0.0) -> Callable[[dict], Any]:
    if backend is None:
        return lambda s: F.scaled_dot_product_attention(
            s["q"], s["k"], s["v"], is_causal=causal, dropout_p=dropout
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = getattr(SDPBackend, backend)

    def fn(s: dict) -> Any:
        with sdpa_kernel(forced):
            return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=causal, dropout_p=dropout)

    return fn


def _flex() -> Callable[[dict], Any]:
    from torch.nn.attention.flex_attention import flex_attention

    compiled = compiled_peer(flex_attention)  # one per case; dynamo compiles per shape
    return lambda s: compiled(s["q"], s["k"], s["v"], block_mask=s["block_mask"])


def _causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def _fwd_bwd(fn: Callable[[dict], Any]) -> Callable[[dict], Any]:
    """Forward, then the gradients of q, k and v (no .grad accumulation)."""

    def step(s: dict) -> Any:
        return torch.autograd.grad(fn(s), (s["q"], s["k"], s["v"]), s["dout"])

    return step


def _setup(
    bhsd: bool, grad: bool, block_mask: Callable[[torch.Tensor], Any] | None = None
) -> Callable[[dict], dict]:
    """An input set in one contender's layout: (B, S, H, D) as made, or contiguous
    (B, H, S, D); leaves that require grad for fwd+bwd; the flex BlockMask."""

    def prepare(s: dict) -> dict:
        out = {}
        for name in ("q", "k", "v", "dout"):
            t = s[name].transpose(1, 2).contiguous() if bhsd else s[name]
            out[name] = t.detach().requires_grad_() if grad and name != "dout" else t
        if block_mask is not None:
            out["block_mask"] = block_mask(out["q"])
        return out

    return prepare


def _block_mask_once(causal: bool) -> Callable[[torch.Tensor], Any]:
    """The case's BlockMask (None when full), built on first use and shared by its input sets."""
    cache: dict[tuple, Any] = {}

    def get(q: torch.Tensor) -> Any:
        if not causal:
            return None
        key = (q.shape[2], q.device)
        if key not in cache:
            from torch.nn.attention.flex_attention import create_block_mask

            cache[key] = create_block_mask(_causal_mask, None, None, q.shape[2], q.shape[2], device=q.device)
        return cache[key]

    return get


def _peer_names(peers: Sequence[str]) -> list[str]:
    known = {"sdpa", "torch", "flex", *SDPA_BACKENDS}
    names = []
    for name in peers:
        if name in _OTHER_FAMILIES_PEERS:
            continue
        if name not in known:
            raise ValueError(
                f"attention benchmark peers are {sorted(known)} ('torch': plain SDPA), got {name!r}"
            )
        if name not in names:
            names.append(name)
    return names


def cases(
    device: torch.device | str,
    *,
    shapes: Sequence[tuple[int, int, int, int]] | None = None,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    ops: Sequence[str] = OPS,
    directions: Sequence[str] = DIRECTIONS,
    peers: Sequence[str] | None = None,
    dropout: float = 0.0,
) -> list[BenchCase]:
    """Benchmark cases for `device`: the GPU grid on CUDA/ROCm, CPU shapes on CPU; peers
    default to GPU_PEERS / CPU_PEERS. Shapes are (batch, heads, seqlen, head_dim).
    dropout: every contender's dropout_p (ops are named "causal+dropout", ...; flex, which
    has no dropout, is left out)."""
    device = torch.device(device)
    unknown = set(directions) - set(DIRECTIONS)
    if unknown:
        raise ValueError(f"attention benchmark directions are 'fwd' and 'fwd+bwd', got {sorted(unknown)}")
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"attention benchmark ops are 'causal' and 'full', got {sorted(unknown)}")
    shapes = shapes or (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)
    for shape in shapes:
        if len(shape) != 4:
            raise ValueError(f"attention benchmark shapes are (batch, heads, seqlen, head_dim), got {shape}")
    if peers is None:
        peers = GPU_PEERS if device.type == "cuda" else CPU_PEERS
    peer_names = _peer_names(peers)
    out = []
    for shape in shapes:
        b, h, s, d = shape
        for op in ops:
            causal = op == "causal"
            for dtype in dtypes:

                def make(
                    dev: torch.device, b: int = b, h: int = h, s: int = s, d: int = d, dtype=dtype
                ) -> dict:
                    def rand() -> torch.Tensor:
                        return torch.randn(b, s, h, d, device=dev, dtype=torch.float32).to(dtype)

                    return {"q": rand(), "k": rand(), "v": rand(), "dout": rand()}

                for direction in directions:
                    grad = direction == "fwd+bwd"
                    fns: dict[str, Callable[[dict], Any]] = {"ours": _ours(causal, dropout)}
                    setup: dict[str, Callable[[dict], dict]] = {"ours": _setup(False, grad)}
                    for name in peer_names:
                        if name == "flex" and dropout:
                            continue
                        if name == "flex":
                            try:
                                fns[name] = _flex()
                            except ImportError:  # a torch without FlexAttention: no peer
                                continue
                            setup[name] = _setup(True, grad, _block_mask_once(causal))
                        else:
                            fns[name] = _sdpa(causal, SDPA_BACKENDS.get(name), dropout)
                            setup[name] = _setup(True, grad)
                    if grad:
                        fns = {name: _fwd_bwd(fn) for name, fn in fns.items()}
                    size = torch.finfo(dtype).bits // 8
                    # q, k, v read and out written; the backward also reads dout and writes
                    # dq, dk, dv. Only sizes the input rotation: the table reports TFLOP/s.
                    tensors = 8 if grad else 4
                    out.append(
                        BenchCase(
                            "attention",
                            f"{op}+dropout" if dropout else op,
                            direction,
                            tuple(shape),
                            dtype,
                            tensors * b * h * s * d * size,
                            make,
                            fns,
                            flops=flops(shape, op, direction),
                            setup=setup,
                        )
                    )
    return out


def _torch_composition(q, k, v, causal: bool) -> torch.Tensor:
    """Attention in plain torch ops in the inputs' dtype ((B, S, H, D) layout, GQA by
    repeating k and v): the baseline whose rounding error sets the checks' tolerance."""
    groups = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(groups, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vh).transpose(1, 2)


def checks(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[Check]:
    """attention, causal and full, forward and backward (dq, dk, dv), on every
    implementation usable on `device`, against the float64 reference: the demo's and the
    CLI's self-check. Odd seqlen (97) and GQA (4 query heads on 2 KV heads), head_dim 64.

    Tolerance: the dtype's rtol, with atol twice the largest error of the same attention
    written in plain torch ops in `dtype` (the criterion of FlashAttention's own tests: a
    fused kernel rounds P and dS to the dtype before its matmuls, and its outputs are sums
    of up to S rounded terms, so the table's elementwise atol does not apply). An
    implementation that raises fails its checks, with a warning naming the error."""
    from openkernels.shared import dispatch
    from openkernels.shared.dev.testing import testable_implementations, tolerance

    from . import reference

    device = torch.device(device)
    dt = str(dtype).removeprefix("torch.")
    b, s, hq, hkv, d = 2, 97, 4, 2, 64
    q = torch.randn(b, s, hq, d, device=device).to(dtype)
    k = torch.randn(b, s, hkv, d, device=device).to(dtype)
    v = torch.randn(b, s, hkv, d, device=device).to(dtype)
    dout = torch.randn(b, s, hq, d, device=device).to(dtype)
    results = []
    for op in OPS:
        causal = op == "causal"
        leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref = reference.attention_ref(*leaves64, causal=causal)
        ref_grads = torch.autograd.grad(ref, leaves64, dout.double())
        base_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        base = _torch_composition(*base_leaves, causal)
        base_grads = torch.autograd.grad(base, base_leaves, dout)
        floor = tolerance(dtype).atol
        atol_out = max(floor, 2 * float((base.double() - ref).detach().abs().max()))
        atol_grads = [
            max(floor, 2 * float((g.double() - r).abs().max())) for g, r in zip(base_grads, ref_grads)
        ]
        name = f"attention {op}"
        for impl in testable_implementations("attention", device):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            try:
                with dispatch.force(f"attention:{impl}", f"attention_backward:{impl}"):
                    out = api.attention(*leaves, causal=causal)
                    grads = torch.autograd.grad(out, leaves, dout)
            except Exception as exc:  # reported as a failed check, not a crash of the demo
                warnings.warn(f"{name} on {impl}: {type(exc).__name__}: {exc}", stacklevel=2)
                results += [
                    Check(name, direction, impl, dt, float("nan"), False) for direction in ("fwd", "bwd")
                ]
                continue
            results.append(Check(name, "fwd", impl, dt, *_score(out, ref, dtype, atol=atol_out)))
            errors = [
                _score(g, g_ref, dtype, atol=atol)[0] for g, g_ref, atol in zip(grads, ref_grads, atol_grads)
            ]
            worst = float("nan") if any(e != e for e in errors) else max(errors)
            results.append(Check(name, "bwd", impl, dt, worst, worst <= 1.0))
    return results


def _attention_inputs(shape: tuple[int, int, int, int], dtype: torch.dtype) -> Callable[[torch.device], dict]:
    b, h, s, d = shape

    def make(dev: torch.device) -> dict:
        def rand() -> torch.Tensor:
            return torch.randn(b, s, h, d, device=dev, dtype=torch.float32).to(dtype)

        return {"q": rand(), "k": rand(), "v": rand(), "dout": rand()}

    return make


def _torch_fwd_bwd(causal: bool) -> Callable[[dict], Any]:
    def step(s: dict) -> Any:
        leaves = tuple(s[n].detach().requires_grad_() for n in ("q", "k", "v"))
        return torch.autograd.grad(api.attention(*leaves, causal=causal), leaves, s["dout"])

    return step


def _jax_fwd_bwd(causal: bool) -> Callable[[dict], Any]:
    import jax

    from ..jax import attention as jax_attention

    def step(s: dict) -> Any:
        _, vjp = jax.vjp(lambda q, k, v: jax_attention(q, k, v, causal=causal), s["q"], s["k"], s["v"])
        return vjp(s["dout"])

    return step


def jax_cases(
    *,
    shapes: Sequence[tuple[int, int, int, int]] = JAX_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    ops: Sequence[str] = OPS,
) -> list:
    """`JaxCase`s (openkernels.shared.dev.bench_jax): attention causal and full, forward and
    forward+backward (jax.vjp against torch.autograd: the backward needs the forward's out and
    lse, so the pair is what both sides can time), shapes (batch, heads, seqlen, head_dim)
    with FLOPs as in `flops` (apply_rotary's are ../rotary/bench.py's)."""
    from openkernels.shared.dev.bench_jax import JaxCase

    from ..jax import attention as jax_attention

    out = []
    for shape in shapes:
        b, h, s, d = shape
        size = torch.finfo(dtype).bits // 8
        for op in ops:
            causal = op == "causal"
            pairs = {
                "fwd": (
                    _ours(causal),
                    lambda t, c=causal: jax_attention(t["q"], t["k"], t["v"], causal=c),
                ),
                "fwd+bwd": (_torch_fwd_bwd(causal), _jax_fwd_bwd(causal)),
            }
            for direction, (torch_fn, jax_fn) in pairs.items():
                tensors = 8 if direction == "fwd+bwd" else 4
                out.append(JaxCase("attention", op, direction, tuple(shape), dtype, tensors * b * h * s * d * size,
                                   _attention_inputs(shape, dtype), torch_fn, jax_fn,
                                   flops=flops(shape, op, direction)))  # fmt: skip
    return out
