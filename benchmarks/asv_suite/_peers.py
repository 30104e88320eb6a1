"""Peers the families' bench modules do not run yet, added to their cases for the asv peer
suites: FlashAttention-4 (attention) and QuACK (rms_norm). Each is a contender of the same
BenchCase as ours, on ours' input sets (the case's "ours" setup), forward or
forward+backward like the case's other contenders. A library that does not import raises
PeerUnavailableError: asv records the peer as n/a.

(Move these into openkernels.attention.core.bench / openkernels.layernorm.bench once those modules
take them; the suites then ask the bench module for them by name.)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from . import _harness as _h

FLASH_ATTN_4 = "flash-attn-4"
QUACK = "quack"


def _first(out: Any) -> Any:
    """The output tensor of a call that may also return lse or a residual."""
    return out[0] if isinstance(out, tuple) else out


def _import(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # ImportError, or a CUDA / CuTe DSL mismatch raised at import
        raise _h.PeerUnavailableError(f"{what} does not import: {type(exc).__name__}: {exc}") from exc


def add_flash_attn_4(case: Any, causal: bool) -> None:
    """FlashAttention-4 (`flash_attn.cute.flash_attn_func`, CuTe DSL, Hopper and Blackwell)
    as contender "flash-attn-4" of an attention case: q, k, v (and dout) in ours' (B, S, H, D)
    layout, which is FlashAttention's own."""

    def load() -> Any:
        from flash_attn.cute import flash_attn_func

        return flash_attn_func

    attn = _import("flash_attn.cute", load)

    def fwd(s: dict) -> Any:
        return _first(attn(s["q"], s["k"], s["v"], causal=causal))

    def fwd_bwd(s: dict) -> Any:
        import torch

        return torch.autograd.grad(fwd(s), (s["q"], s["k"], s["v"]), s["dout"])

    case.contenders[FLASH_ATTN_4] = fwd if case.direction == "fwd" else fwd_bwd
    if "ours" in case.setup:
        case.setup[FLASH_ATTN_4] = case.setup["ours"]


def add_quack(case: Any, eps: float) -> None:
    """QuACK's RMSNorm (`quack.rmsnorm`, CuTe DSL, with its backward) as contender "quack" of a
    layernorm case: rms_norm, and add_rms_norm through its residual (prenorm=True returns
    the normalized output and x + r). QuACK has no LayerNorm with a backward: n/a there."""
    if case.op not in ("rms_norm", "add_rms_norm"):
        raise _h.PeerUnavailableError(f"QuACK has no {case.op} with a backward")
    quack = _import("quack", lambda: importlib.import_module("quack"))

    def call(s: dict) -> Any:
        if case.op == "rms_norm":
            return quack.rmsnorm(s["x"], s["w"], eps=eps)
        return quack.rmsnorm(s["x"], s["w"], residual=s["r"], eps=eps, prenorm=True)

    def fwd_bwd(s: dict) -> Any:
        import torch

        return torch.autograd.grad(_first(call(s)), s["leaves"], s["dy"])

    case.contenders[QUACK] = call if case.direction == "fwd" else fwd_bwd
    if "ours" in case.setup:  # fwd+bwd: leaves that require grad, as ours gets them
        case.setup[QUACK] = case.setup["ours"]
