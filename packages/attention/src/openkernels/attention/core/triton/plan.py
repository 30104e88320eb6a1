"""Launch plans of the attention kernels: grid, config and every argument of one launch but
its pointers, as a pure function of the call's sizes, strides and options (the KV-cache and
rotary plans, ../../kvcache/triton/plan.py and ../../rotary/triton/plan.py, build on the
`Launch`, `Strides` and helpers here).

The PyTorch launchers (__init__.py), the JAX launches (../jax/launch.py) and the JAX compile
checks (tests/aot_jax_cases.py) all go through these, so both front ends run the same kernels with the same configs and values. JAX
passes every entry of `Launch.args` as a compile-time constant, PyTorch as ordinary
arguments (Triton specializes the integers on divisibility by 16 and on the value 1).
Plans are cached: every argument is hashable (strides are tuples, in the kernel's order).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..problem import Problem, dropout_threshold
from .configs import AttnConfig, arch_family, block_d, launch_config, preprocess_block_m

__all__ = ["Problem", "Launch", "Strides", "aligned", "scales", "cdiv", "stride_args", "dropout_args", "fwd", "preprocess", "bwd",
           "contiguous", "lse_layout", "Contiguous", "contiguous_launches", "softcap_flag"]  # fmt: skip

LOG2E = 1.0 / math.log(2.0)
# Threads of the backward's delta pass (memory-bound, fixed).
_PREPROCESS_WARPS = 4

Strides = tuple[int, int, int]
"""(batch, sequence, head) strides of a (B, S, H, D) operand (head_dim's stride is 1);
varlen calls pack every sequence on the sequence axis of a batch of one: batch stride 0."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Launch:
    """grid, launch options and `args`: every kernel argument but the pointers, by name (a
    plain dict, cheap to ** at every launch; read-only: the callers of a cached plan share
    it). num_stages None: the Triton backend's default (kernels without a pipelined loop,
    launched so from PyTorch)."""

    grid: tuple[int, ...]
    num_warps: int
    num_stages: int | None
    args: Mapping[str, Any]
    config: object | None = None  # the config the plan chose: AttnConfig, or the rotary plan's RotaryConfig


def softcap_flag(softcap: float, arch: str) -> int:
    """The kernels' HAS_SOFTCAP: 0 without a softcap, 2 on Hopper (tanh in one instruction),
    else 1 (the portable formula). sm_80 keeps the formula: with the instruction three of
    its general backward configs spill 4 B (AOT check), and it was measured on sm_90 only."""
    if softcap <= 0:
        return 0
    return 2 if arch_family(arch) == "hopper" else 1


def _flags(p: Problem, arch: str) -> dict[str, Any]:
    return {
        "HEAD_DIM": p.head_dim,
        "BLOCK_D": block_d(p.head_dim),
        "IS_VARLEN": p.varlen,
        "HAS_WINDOW_LEFT": p.window_left >= 0,
        "HAS_WINDOW_RIGHT": p.window_right >= 0,
        "HAS_ALIBI": alibi_flag(p),
        "HAS_SOFTCAP": softcap_flag(p.softcap, arch),
    }


SPLIT_ALIBI = True  # False: the absolute-distance form everywhere (the study's "abs" variant)


def alibi_flag(p: Problem) -> int:
    """The kernels' HAS_ALIBI: 0 without ALiBi; 2 where no key right of the diagonal is
    visible (window_right 0: causal, with or without a left window), so the distance
    i + diag - j needs no absolute value and the bias splits into a key term and a row term
    (kernels._log2_scores: one add per score, folded into the scale's multiply, instead of an
    integer subtraction, an absolute value and a conversion); 1 otherwise."""
    if not p.alibi:
        return 0
    return 2 if p.window_right == 0 and SPLIT_ALIBI else 1


def aligned(*strides: tuple[int, ...]) -> bool:
    """Every stride given (head_dim's left out) is a multiple of 16."""
    return all(st % 16 == 0 for group in strides for st in group)


def scales(scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_scale, cap_out): log2-unit score = qk * qk_scale, or with a softcap
    softcap * tanh(qk * scale / softcap) * log2(e) = tanh(qk * cap_scale) * cap_out."""
    if softcap > 0:
        return scale * LOG2E, scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0, 0.0


def stride_args(names: tuple[str, ...], values: tuple[Strides, ...]) -> dict[str, int]:
    out = {}
    for name, (sb, ss, sh) in zip(names, values, strict=True):
        out[f"stride_{name}b"], out[f"stride_{name}s"], out[f"stride_{name}h"] = sb, ss, sh
    return out


def dropout_args(dropout: float) -> dict[str, Any]:
    """The dropout arguments of the forward and backward kernels: drop_below (the threshold
    of reference.dropout_threshold less 2**31, as the kernels compare signed words) and
    drop_scale = 1 / (1 - dropout)."""
    if dropout <= 0:
        return {"drop_below": 0, "drop_scale": 1.0, "HAS_DROPOUT": False}
    return {
        "drop_below": dropout_threshold(dropout) - 2**31,
        "drop_scale": 1.0 / (1.0 - dropout),
        "HAS_DROPOUT": True,
    }


def _sizes(p: Problem, lse_strides: tuple[int, int]) -> dict[str, Any]:
    return {"stride_lb": lse_strides[0], "stride_lh": lse_strides[1], "seqlen_q": p.seqlen_q,
            "seqlen_k": p.seqlen_k, "heads_q": p.heads_q, "group": p.group}  # fmt: skip


@functools.lru_cache(maxsize=4096)
def fwd(
    p: Problem,
    arch: str,
    dtype: torch.dtype,
    strides: tuple[Strides, Strides, Strides, Strides],
    lse_strides: tuple[int, int],
    config: AttnConfig | None = None,
) -> Launch:
    """`_attn_fwd_kernel`: strides of (q, k, v, out); lse_strides (batch, head) of lse. The
    caller adds USE_TMA (PyTorch decides it from the tensors' addresses)."""
    cfg = config or launch_config(
        p.head_dim, dtype, arch, "fwd", p.general(aligned(*strides)), p.option_configs
    )
    qk_scale, cap_scale, cap_out = scales(p.scale, p.softcap)
    args = {
        **stride_args(("q", "k", "v", "o"), strides), **_sizes(p, lse_strides), "qk_scale": qk_scale,
        "cap_scale": cap_scale, "cap_out": cap_out, "window_left": p.window_left, "window_right": p.window_right,
        **_flags(p, arch), **dropout_args(p.dropout), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
    }  # fmt: skip
    grid = (cdiv(p.seqlen_q, cfg.block_m), p.n_seqs * p.heads_q)
    return Launch(grid, cfg.num_warps, cfg.num_stages, args, cfg)


@functools.lru_cache(maxsize=4096)
def preprocess(p: Problem, strides: tuple[Strides, Strides], lse_strides: tuple[int, int]) -> Launch:
    """`_attn_bwd_preprocess_kernel` (delta = rowsum(o * do)): strides of (out, dout);
    delta is laid out as lse."""
    block_m = preprocess_block_m(p.head_dim)
    args = {
        **stride_args(("o", "do"), strides), "stride_lb": lse_strides[0], "stride_lh": lse_strides[1],
        "seqlen_q": p.seqlen_q, "heads_q": p.heads_q, "HEAD_DIM": p.head_dim, "BLOCK_D": block_d(p.head_dim),
        "BLOCK_M": block_m, "IS_VARLEN": p.varlen,
    }  # fmt: skip
    return Launch((cdiv(p.seqlen_q, block_m), p.n_seqs * p.heads_q), _PREPROCESS_WARPS, None, args)


# The backward's two kernels and their output operands (a dK/dV program owns a block of keys,
# a dQ program a block of query rows: see `bwd`'s grid).
_BWD_OUTPUTS = {"dkdv": ("dk", "dv"), "dq": ("dq",)}


@functools.lru_cache(maxsize=4096)
def bwd(
    kernel: str,
    p: Problem,
    arch: str,
    dtype: torch.dtype,
    strides: tuple[Strides, ...],
    lse_strides: tuple[int, int],
    strides_aligned: bool,
    config: AttnConfig | None = None,
) -> Launch:
    """`_attn_bwd_dkdv_kernel` (kernel "dkdv": strides of (q, k, v, dout, dk, dv), dk / dv
    being the per-query-head float32 buffers under GQA) or `_attn_bwd_dq_kernel` ("dq":
    strides of (q, k, v, dout, dq)); strides_aligned: every operand of the backward (dout, q,
    k, v, dq, dk, dv) has strides that are multiples of 16 (picks the config, the same for
    both kernels)."""
    cfg = config or launch_config(
        p.head_dim, dtype, arch, kernel, p.general(strides_aligned), p.option_configs
    )
    qk_scale, cap_scale, cap_out = scales(p.scale, p.softcap)
    args = {
        **stride_args(("q", "k", "v", "do", *_BWD_OUTPUTS[kernel]), strides), **_sizes(p, lse_strides),
        "qk_scale": qk_scale, "sm_scale": p.scale, "cap_scale": cap_scale, "cap_out": cap_out,
        "window_left": p.window_left, "window_right": p.window_right, **_flags(p, arch), **dropout_args(p.dropout),
        "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
    }  # fmt: skip
    blocks = cdiv(p.seqlen_k, cfg.block_n) if kernel == "dkdv" else cdiv(p.seqlen_q, cfg.block_m)
    return Launch((blocks, p.n_seqs * p.heads_q), cfg.num_warps, cfg.num_stages, args, cfg)


# ---- contiguous operands (JAX arrays) -----------------------------------------------------


def contiguous(shape: tuple[int, ...], varlen: bool) -> Strides:
    """Strides of a contiguous (B, S, H, D), or of packed (T, H, D) as a batch of one."""
    if varlen:
        _, heads, dim = shape
        return 0, heads * dim, dim
    _, seq, heads, dim = shape
    return seq * heads * dim, heads * dim, dim


def lse_layout(p: Problem, tokens_q: int) -> tuple[tuple[int, ...], tuple[int, int]]:
    """lse's shape and (batch, head) strides: (B, Hq, Sq), or (Hq, Tq) as (1, Hq, Tq)."""
    if p.varlen:
        return (p.heads_q, tokens_q), (0, tokens_q)
    return (p.n_seqs, p.heads_q, p.seqlen_q), (p.heads_q * p.seqlen_q, p.seqlen_q)


@dataclass(frozen=True)
class Contiguous:
    """The launches of one call on contiguous operands; dk_shape: the dkdv kernel's outputs
    (float32 with one head per query head under GQA, else k's shape and dtype)."""

    fwd: Launch
    preprocess: Launch
    dkdv: Launch
    dq: Launch
    lse_shape: tuple[int, ...]
    dk_shape: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def contiguous_launches(
    p: Problem, arch: str, dtype: torch.dtype, tokens_q: int, tokens_k: int
) -> Contiguous:
    """Every launch of a call whose operands are contiguous (what JAX passes): q (B, Sq, Hq,
    D) or packed (tokens_q, Hq, D), k and v likewise with tokens_k."""
    if p.varlen:
        q_shape, k_shape = (tokens_q, p.heads_q, p.head_dim), (tokens_k, p.heads_kv, p.head_dim)
    else:
        q_shape = (p.n_seqs, p.seqlen_q, p.heads_q, p.head_dim)
        k_shape = (p.n_seqs, p.seqlen_k, p.heads_kv, p.head_dim)
    dk_shape = (*k_shape[:-2], p.heads_q, p.head_dim) if p.group > 1 else k_shape
    sq, sk, sdk = contiguous(q_shape, p.varlen), contiguous(k_shape, p.varlen), contiguous(dk_shape, p.varlen)
    lse_shape, lse_strides = lse_layout(p, tokens_q)
    strides_aligned = aligned(sq, sk)  # dout, dq like q; dk, dv like k
    return Contiguous(
        fwd=fwd(p, arch, dtype, (sq, sk, sk, sq), lse_strides),
        preprocess=preprocess(p, (sq, sq), lse_strides),
        dkdv=bwd("dkdv", p, arch, dtype, (sq, sk, sk, sq, sdk, sdk), lse_strides, strides_aligned),
        dq=bwd("dq", p, arch, dtype, (sq, sk, sk, sq, sq), lse_strides, strides_aligned),
        lse_shape=lse_shape,
        dk_shape=dk_shape,
    )
