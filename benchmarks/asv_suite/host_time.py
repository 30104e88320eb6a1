"""asv suite: host time per call of every public op on tiny inputs, beside its closest torch
eager equivalent (the bar of the op-layer issue: ours <= 1.0x torch's).

Tiny inputs make every call host-bound, so a number here is the Python, dispatch, checking,
allocation and launch cost that a user pays on each eager call, whatever the kernel. The
case table (`cases`) is shared with `benchmarks/peers/host_time.py`, which prints the table and
the ratios; this suite keeps the per-commit history (`track_us`, microseconds per call).

Each case is (op, direction, ours, torch): "fwd" calls the op; "fwd+bwd" calls it on inputs
that require grad and back-propagates a sum (both sides do the same extra work: the sum's
gradient reaches the op broadcast, with zero strides); "fwd+bwd(g)" back-propagates a dense
gradient made once (`out.backward(g)`, what a layer inside a model gets).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _harness as _h

OPS = (
    "rms_norm",
    "rms_norm+residual",
    "layer_norm",
    "silu_and_mul",
    "gelu",
    "attention",
    "apply_rotary",
    "attention_with_kvcache",
    "attention_with_kvcache(check=False)",
    "KVCache.attend",
    "int4_linear",
)
DIRECTIONS = ("fwd", "fwd+bwd", "fwd+bwd(g)")
# Ops without a backward (decode-time calls, a quantized weight).
FORWARD_ONLY = {
    "attention_with_kvcache",
    "attention_with_kvcache(check=False)",
    "KVCache.attend",
    "int4_linear",
}


@dataclass(frozen=True)
class HostCase:
    """One op and direction: `ours` and `torch` take no arguments and make one call each."""

    op: str
    direction: str
    ours: Callable[[], Any]
    torch: Callable[[], Any]
    torch_name: str


def _grad(fn: Callable[[], Any]) -> Callable[[], None]:
    def step() -> None:
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    return step


def _grad_given(fn: Callable[[], Any]) -> Callable[[], None]:
    given: list = []

    def step() -> None:
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        if not given:  # made once, outside the timed calls after the warm-up
            given.append(out.detach().clone().normal_())
        out.backward(given[0])

    return step


def _norm_cases(dev: Any, dtype: Any, grad: bool) -> dict[str, tuple]:
    import torch
    import torch.nn.functional as F

    import openkernels.layernorm as L

    n = 256
    x = torch.randn(4, n, device=dev, dtype=dtype, requires_grad=grad)
    r = torch.randn(4, n, device=dev, dtype=dtype, requires_grad=grad)
    w = torch.randn(n, device=dev, dtype=dtype, requires_grad=grad)
    b = torch.randn(n, device=dev, dtype=dtype, requires_grad=grad)
    return {
        "rms_norm": (lambda: L.rms_norm(x, w), lambda: F.rms_norm(x, (n,), w, 1e-6), "F.rms_norm"),
        "rms_norm+residual": (
            lambda: L.rms_norm(x, w, residual=r, prenorm=True),
            lambda: (F.rms_norm(h := x + r, (n,), w, 1e-6), h),
            "x + r; F.rms_norm",
        ),
        "layer_norm": (lambda: L.layer_norm(x, w, b), lambda: F.layer_norm(x, (n,), w, b), "F.layer_norm"),
    }


def _activation_cases(dev: Any, dtype: Any, grad: bool) -> dict[str, tuple]:
    import torch
    import torch.nn.functional as F

    import openkernels.activations as A

    x = torch.randn(4, 512, device=dev, dtype=dtype, requires_grad=grad)
    return {
        "silu_and_mul": (lambda: A.silu_and_mul(x), lambda: F.silu(x[:, :256]) * x[:, 256:], "F.silu(a) * b"),
        "gelu": (lambda: A.gelu(x), lambda: F.gelu(x), "F.gelu"),
    }


def _attention_cases(dev: Any, dtype: Any, grad: bool) -> dict[str, tuple]:
    import torch
    import torch.nn.functional as F

    import openkernels.attention as T

    # (batch, seqlen, heads, head_dim) for ours; SDPA takes (batch, heads, seqlen, head_dim).
    q, k, v = (torch.randn(1, 16, 4, 64, device=dev, dtype=dtype, requires_grad=grad) for _ in range(3))
    qt, kt, vt = (torch.randn(1, 4, 16, 64, device=dev, dtype=dtype, requires_grad=grad) for _ in range(3))
    cos = torch.randn(1, 16, 64, device=dev, dtype=dtype)
    sin = torch.randn(1, 16, 64, device=dev, dtype=dtype)

    def rotary_torch():  # transformers' apply_rotary_pos_emb, rotate-half convention
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)

        def rot(t):
            return torch.cat((-t[..., 32:], t[..., :32]), dim=-1)

        return q * c + rot(q) * s, k * c + rot(k) * s

    cases = {
        "attention": (
            lambda: T.attention(q, k, v, causal=True),
            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
            "SDPA",
        ),
        "apply_rotary": (lambda: T.apply_rotary(q, k, cos, sin), rotary_torch, "rotate-half in torch"),
    }
    if grad:
        return cases
    # Decode: one query token, GQA 32/8, head_dim 128, 256 cached tokens.
    seq, hkv, hq, d = 256, 8, 32, 128
    qd = torch.randn(1, 1, hq, d, device=dev, dtype=dtype)
    k_cache = torch.randn(1, seq, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.randn(1, seq, hkv, d, device=dev, dtype=dtype)
    lens = torch.full((1,), seq, dtype=torch.int32, device=dev)
    cache = T.KVCache(1, seq, hkv, d, kv_dtype=dtype, device=dev)
    cache.append(k_cache, v_cache)
    q_sdpa = torch.randn(1, hq, 1, d, device=dev, dtype=dtype)
    k_sdpa, v_sdpa = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()

    def sdpa_decode():
        return F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)

    cases["attention_with_kvcache"] = (
        lambda: T.attention_with_kvcache(qd, k_cache, v_cache, lens), sdpa_decode, "SDPA(enable_gqa) on the cache"
    )  # fmt: skip
    cases["attention_with_kvcache(check=False)"] = (
        lambda: T.attention_with_kvcache(qd, k_cache, v_cache, lens, check=False), sdpa_decode,
        "SDPA(enable_gqa) on the cache",
    )  # fmt: skip
    cases["KVCache.attend"] = (lambda: cache.attend(qd), sdpa_decode, "SDPA(enable_gqa) on the cache")
    return cases


def _quant_cases(dev: Any, dtype: Any, grad: bool) -> dict[str, tuple]:
    import torch
    import torch.nn.functional as F

    import openkernels.quant as Q

    if grad:
        return {}
    w = (torch.randn(256, 256, device=dev) * 0.02).to(dtype)
    qw = Q.quantize_int4(w, 128)
    x = torch.randn(1, 256, device=dev, dtype=dtype)
    return {"int4_linear": (lambda: Q.int4_linear(x, qw), lambda: F.linear(x, w), "F.linear (bf16 weight)")}


_FAMILIES = {"layernorm": _norm_cases, "activations": _activation_cases, "attention": _attention_cases,
             "quant": _quant_cases}  # fmt: skip


def cases(dev: Any, ops: tuple[str, ...] = OPS, directions: tuple[str, ...] = DIRECTIONS) -> list[HostCase]:
    """Every (op, direction) asked for whose family is installed. GPU: bfloat16 inputs;
    CPU: float32 (torch's CPU ops are fastest there, so the comparison is the strictest)."""
    import importlib.util

    import torch

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    found = []
    for family, make in _FAMILIES.items():
        if importlib.util.find_spec(f"openkernels.{family}") is None:
            continue
        for direction in directions:
            grad = direction != "fwd"
            for op, (ours, theirs, name) in make(dev, dtype, grad).items():
                if op in ops:
                    wrap = {"fwd": lambda fn: fn, "fwd+bwd": _grad, "fwd+bwd(g)": _grad_given}[direction]
                    found.append(HostCase(op, direction, wrap(ours), wrap(theirs), name))
    return found


def per_call_us(fn: Callable[[], Any], dev: Any, calls: int) -> float:
    """Mean wall time of `calls` back-to-back calls, device work waited for at the end."""
    import torch

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def measure(
    found: list[HostCase], dev: Any, calls: int = 1000, rounds: int = 7
) -> dict[tuple[str, str], dict]:
    """{(op, direction): {"ours": [us per round], "torch": [...]}}: the contenders of one case
    alternate round by round, so a noisy host slows both alike."""
    results: dict[tuple[str, str], dict] = {}
    for case in found:
        for fn in (case.ours, case.torch):  # warm-up: compiles, caches, allocator pools
            for _ in range(20):
                fn()
        runs: dict[str, list[float]] = {"ours": [], "torch": []}
        for _ in range(rounds):
            runs["ours"].append(per_call_us(case.ours, dev, calls))
            runs["torch"].append(per_call_us(case.torch, dev, calls))
        results[case.op, case.direction] = runs
    return results


def summary(runs: dict[str, list[float]]) -> dict[str, float]:
    ours, theirs = statistics.median(runs["ours"]), statistics.median(runs["torch"])
    return {"ours_us": ours, "torch_us": theirs, "ratio": ours / theirs}


class HostTime(_h.Suite):
    """track_ms: time per call (median of alternated rounds); contender "torch" is
    the closest torch eager op measured in the same process."""

    params = [list(OPS), list(DIRECTIONS), ["ours", "torch"]]
    param_names = ["op", "direction", "contender"]
    version = "host-time-1"

    def applies(self, device_type: str, **params: str) -> bool:
        return not (params["direction"] != "fwd" and params["op"] in FORWARD_ONLY)

    def setup_cache(self) -> dict:
        dev = _h.device()
        wanted = [c for c in self.combos(dev.type) if self._selected(c)]
        ops = tuple({c[0] for c in wanted})
        found = cases(dev, ops=ops)
        if _h.smoke():
            for case in found:  # once each, untimed
                case.ours()
                case.torch()
            return {c: {"us": 0.0} for c in wanted}
        results = {}
        for (op, direction), runs in measure(found, dev).items():
            for contender in ("ours", "torch"):
                results[op, direction, contender] = {"us": statistics.median(runs[contender])}
        return results

    def setup(self, cache: dict, *combo: str) -> None:
        found = cache.get(tuple(combo))
        if found is None:
            raise NotImplementedError
        self.found = found

    def track_ms(self, cache: dict, *combo: str) -> float:
        return self.found["us"] / 1e3

    track_ms.unit = "ms"
