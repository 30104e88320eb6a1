"""Launch plans of the attention and rotary kernels: grid, config and every argument of one
launch but its pointers, as a pure function of the call's sizes, strides and options.

The PyTorch launchers (__init__.py, rotary.py) and the JAX front end (../jax.py) both launch
through these, so the two sides run the same kernels with the same configs and values. JAX
passes every entry of `Launch.args` as a compile-time constant, PyTorch as ordinary
arguments (Triton specializes the integers on divisibility by 16 and on the value 1).
Plans are cached: every argument is hashable (strides are tuples, in the kernel's order).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .configs import (
    AttnConfig,
    RotaryConfig,
    block_d,
    launch_config,
    preprocess_block_m,
    rotary_blocks,
    rotary_config,
)

__all__ = ["Problem", "Launch", "Strides", "aligned", "scales", "fwd", "preprocess", "dkdv", "dq", "rotary"]

LOG2E = 1.0 / math.log(2.0)
# Threads of the backward's delta pass (memory-bound, fixed).
_PREPROCESS_WARPS = 4

Strides = tuple[int, int, int]
"""(batch, sequence, head) strides of a (B, S, H, D) operand (head_dim's stride is 1);
varlen calls pack every sequence on the sequence axis of a batch of one: batch stride 0."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Problem:
    """One attention call as the kernels see it. seqlen_q / seqlen_k: the dense lengths, or
    the longest sequence of a varlen call (n_seqs sequences); window_right 0 is causal, -1
    an unbounded side; alibi: slopes are given ((n_seqs, heads_q) float32); softcap 0: off."""

    n_seqs: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    varlen: bool
    scale: float
    window_left: int
    window_right: int
    alibi: bool
    softcap: float

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def flags(self) -> dict[str, Any]:
        return {
            "HEAD_DIM": self.head_dim,
            "BLOCK_D": block_d(self.head_dim),
            "IS_VARLEN": self.varlen,
            "HAS_WINDOW_LEFT": self.window_left >= 0,
            "HAS_WINDOW_RIGHT": self.window_right >= 0,
            "HAS_ALIBI": self.alibi,
            "HAS_SOFTCAP": self.softcap > 0,
        }

    def general(self, strides_aligned: bool) -> bool:
        """Whether the call is off the fast path (configs._TABLE): a window other than
        causal, varlen, ALiBi, softcap, or lengths or strides that are not multiples of 16."""
        return (
            self.varlen
            or self.window_left >= 0
            or self.window_right > 0
            or self.alibi
            or self.softcap > 0
            or self.seqlen_q % 16 != 0
            or self.seqlen_k % 16 != 0
            or not strides_aligned
        )


@dataclass(frozen=True)
class Launch:
    """grid, launch options and `args`: every kernel argument but the pointers, by name
    (read-only; shared by the callers of a cached plan). num_stages None: the Triton
    backend's default (kernels without a pipelined loop, launched so from PyTorch)."""

    grid: tuple[int, ...]
    num_warps: int
    num_stages: int | None
    args: Mapping[str, Any]
    config: AttnConfig | RotaryConfig | None = None


def aligned(*strides: tuple[int, ...]) -> bool:
    """Every stride given (head_dim's left out) is a multiple of 16."""
    return all(st % 16 == 0 for group in strides for st in group)


def scales(scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_scale, cap_out): log2-unit score = qk * qk_scale, or with a softcap
    softcap * tanh(qk * scale / softcap) * log2(e) = tanh(qk * cap_scale) * cap_out."""
    if softcap > 0:
        return scale * LOG2E, scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0, 0.0


def _strides(names: tuple[str, ...], values: tuple[Strides, ...]) -> dict[str, int]:
    out = {}
    for name, (sb, ss, sh) in zip(names, values, strict=True):
        out[f"stride_{name}b"], out[f"stride_{name}s"], out[f"stride_{name}h"] = sb, ss, sh
    return out


def _sizes(p: Problem, lse_strides: tuple[int, int]) -> dict[str, Any]:
    return {"stride_lb": lse_strides[0], "stride_lh": lse_strides[1], "seqlen_q": p.seqlen_q,
            "seqlen_k": p.seqlen_k, "heads_q": p.heads_q, "group": p.group}  # fmt: skip


def _frozen(args: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(args)


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
    cfg = config or launch_config(p.head_dim, dtype, arch, "fwd", p.general(aligned(*strides)))
    qk_scale, cap_scale, cap_out = scales(p.scale, p.softcap)
    args = {
        **_strides(("q", "k", "v", "o"), strides), **_sizes(p, lse_strides), "qk_scale": qk_scale,
        "cap_scale": cap_scale, "cap_out": cap_out, "window_left": p.window_left, "window_right": p.window_right,
        **p.flags(), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
    }  # fmt: skip
    grid = (_cdiv(p.seqlen_q, cfg.block_m), p.n_seqs * p.heads_q)
    return Launch(grid, cfg.num_warps, cfg.num_stages, _frozen(args), cfg)


@functools.lru_cache(maxsize=4096)
def preprocess(p: Problem, strides: tuple[Strides, Strides], lse_strides: tuple[int, int]) -> Launch:
    """`_attn_bwd_preprocess_kernel` (delta = rowsum(o * do)): strides of (out, dout);
    delta is laid out as lse."""
    block_m = preprocess_block_m(p.head_dim)
    args = {
        **_strides(("o", "do"), strides), "stride_lb": lse_strides[0], "stride_lh": lse_strides[1],
        "seqlen_q": p.seqlen_q, "heads_q": p.heads_q, "HEAD_DIM": p.head_dim, "BLOCK_D": block_d(p.head_dim),
        "BLOCK_M": block_m, "IS_VARLEN": p.varlen,
    }  # fmt: skip
    return Launch((_cdiv(p.seqlen_q, block_m), p.n_seqs * p.heads_q), _PREPROCESS_WARPS, None, _frozen(args))


def _bwd_args(p: Problem, names: tuple[str, ...], strides: tuple[Strides, ...], lse_strides, cfg) -> dict:
    qk_scale, cap_scale, cap_out = scales(p.scale, p.softcap)
    return {
        **_strides(names, strides), **_sizes(p, lse_strides), "qk_scale": qk_scale, "sm_scale": p.scale,
        "cap_scale": cap_scale, "cap_out": cap_out, "window_left": p.window_left, "window_right": p.window_right,
        **p.flags(), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
    }  # fmt: skip


@functools.lru_cache(maxsize=4096)
def dkdv(
    p: Problem,
    arch: str,
    dtype: torch.dtype,
    strides: tuple[Strides, ...],
    lse_strides: tuple[int, int],
    strides_aligned: bool,
    config: AttnConfig | None = None,
) -> Launch:
    """`_attn_bwd_dkdv_kernel`: strides of (q, k, v, dout, dk, dv), dk / dv being the
    per-query-head float32 buffers under GQA; strides_aligned: every operand of the backward
    (dout, q, k, v, dq, dk, dv) has strides that are multiples of 16 (picks the config, the
    same for dkdv and dq)."""
    cfg = config or launch_config(p.head_dim, dtype, arch, "dkdv", p.general(strides_aligned))
    args = _bwd_args(p, ("q", "k", "v", "do", "dk", "dv"), strides, lse_strides, cfg)
    grid = (_cdiv(p.seqlen_k, cfg.block_n), p.n_seqs * p.heads_q)
    return Launch(grid, cfg.num_warps, cfg.num_stages, _frozen(args), cfg)


@functools.lru_cache(maxsize=4096)
def dq(
    p: Problem,
    arch: str,
    dtype: torch.dtype,
    strides: tuple[Strides, ...],
    lse_strides: tuple[int, int],
    strides_aligned: bool,
    config: AttnConfig | None = None,
) -> Launch:
    """`_attn_bwd_dq_kernel`: strides of (q, k, v, dout, dq); strides_aligned as in `dkdv`."""
    cfg = config or launch_config(p.head_dim, dtype, arch, "dq", p.general(strides_aligned))
    args = _bwd_args(p, ("q", "k", "v", "do", "dq"), strides, lse_strides, cfg)
    grid = (_cdiv(p.seqlen_q, cfg.block_m), p.n_seqs * p.heads_q)
    return Launch(grid, cfg.num_warps, cfg.num_stages, _frozen(args), cfg)


@functools.lru_cache(maxsize=4096)
def rotary(
    shape_q: tuple[int, int, int, int],
    heads_k: int,
    rot_dim: int,
    strides: tuple[Strides, Strides],
    table_strides: tuple[tuple[int, int], tuple[int, int]],
    backward: bool,
    arch: str,
    config: RotaryConfig | None = None,
) -> Launch:
    """`_apply_rotary_kernel`: q of shape_q (B, S, Hq, D), k with heads_k heads; strides of
    (q, k); table_strides (batch, token) of (cos, sin), batch 0 when the table broadcasts."""
    batch, seqlen, heads_q, head_dim = shape_q
    cfg = config or rotary_config(head_dim, rot_dim, heads_q, heads_k, arch)
    block_half, block_pass = rotary_blocks(head_dim, rot_dim)
    tokens = batch * seqlen
    (cb, cs), (sb, ss) = table_strides
    args = {
        **_strides(("q", "k"), strides), "stride_cb": cb, "stride_cs": cs, "stride_sb": sb, "stride_ss": ss,
        "tokens": tokens, "seqlen": seqlen, "heads_q": heads_q, "heads_k": heads_k, "HEAD_DIM": head_dim,
        "ROT_HALF": rot_dim // 2, "BLOCK_T": cfg.block_t, "BLOCK_HQ": cfg.block_hq, "BLOCK_HK": cfg.block_hk,
        "BLOCK_HALF": block_half, "BLOCK_PASS": block_pass, "BACKWARD": backward,
    }  # fmt: skip
    return Launch((_cdiv(tokens, cfg.block_t),), cfg.num_warps, None, _frozen(args), cfg)
