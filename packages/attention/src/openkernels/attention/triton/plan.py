"""Launch plans of the attention and rotary kernels: grid, config and every argument of one
launch but its pointers, as a pure function of the call's sizes, strides and options.

The PyTorch launchers (__init__.py, rotary.py, kvcache.py), the JAX launches
(../jax_kernels.py) and the JAX compile checks (tests/aot_jax_cases.py) all go
through these, so both front ends run the same kernels with the same configs and values. JAX
passes every entry of `Launch.args` as a compile-time constant, PyTorch as ordinary
arguments (Triton specializes the integers on divisibility by 16 and on the value 1).
Plans are cached: every argument is hashable (strides are tuples, in the kernel's order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..problem import KVProblem, Problem
from .configs import (
    AttnConfig,
    RotaryConfig,
    block_d,
    kv_config,
    kv_splits,
    launch_config,
    lean_decode,
    lean_pays,
    preprocess_block_m,
    rotary_blocks,
    rotary_config,
    short_decode_splits,
)

__all__ = ["Problem", "Launch", "Strides", "aligned", "scales", "fwd", "preprocess", "dkdv", "dq", "rotary", "contiguous",
           "lse_layout", "Contiguous", "contiguous_launches", "contiguous_rotary", "KVProblem", "KVLaunches",
           "kvcache"]  # fmt: skip

LOG2E = 1.0 / math.log(2.0)
# Threads of the backward's delta pass (memory-bound, fixed).
_PREPROCESS_WARPS = 4

Strides = tuple[int, int, int]
"""(batch, sequence, head) strides of a (B, S, H, D) operand (head_dim's stride is 1);
varlen calls pack every sequence on the sequence axis of a batch of one: batch stride 0."""


def _cdiv(a: int, b: int) -> int:
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
    config: AttnConfig | RotaryConfig | None = None


def _flags(p: Problem) -> dict[str, Any]:
    return {
        "HEAD_DIM": p.head_dim,
        "BLOCK_D": block_d(p.head_dim),
        "IS_VARLEN": p.varlen,
        "HAS_WINDOW_LEFT": p.window_left >= 0,
        "HAS_WINDOW_RIGHT": p.window_right >= 0,
        "HAS_ALIBI": p.alibi,
        "HAS_SOFTCAP": p.softcap > 0,
    }


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
        **_flags(p), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
    }  # fmt: skip
    grid = (_cdiv(p.seqlen_q, cfg.block_m), p.n_seqs * p.heads_q)
    return Launch(grid, cfg.num_warps, cfg.num_stages, args, cfg)


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
    return Launch((_cdiv(p.seqlen_q, block_m), p.n_seqs * p.heads_q), _PREPROCESS_WARPS, None, args)


def _bwd_args(p: Problem, names: tuple[str, ...], strides: tuple[Strides, ...], lse_strides, cfg) -> dict:
    qk_scale, cap_scale, cap_out = scales(p.scale, p.softcap)
    return {
        **_strides(names, strides), **_sizes(p, lse_strides), "qk_scale": qk_scale, "sm_scale": p.scale,
        "cap_scale": cap_scale, "cap_out": cap_out, "window_left": p.window_left, "window_right": p.window_right,
        **_flags(p), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
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
    return Launch(grid, cfg.num_warps, cfg.num_stages, args, cfg)


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
    return Launch(grid, cfg.num_warps, cfg.num_stages, args, cfg)


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
    return Launch((_cdiv(tokens, cfg.block_t),), cfg.num_warps, None, args, cfg)


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
        dkdv=dkdv(p, arch, dtype, (sq, sk, sk, sq, sdk, sdk), lse_strides, strides_aligned),
        dq=dq(p, arch, dtype, (sq, sk, sk, sq, sq), lse_strides, strides_aligned),
        lse_shape=lse_shape,
        dk_shape=dk_shape,
    )


def contiguous_rotary(
    shape_q: tuple[int, int, int, int],
    heads_k: int,
    table_shape: tuple[int, int, int],
    backward: bool,
    arch: str,
) -> Launch:
    """`rotary` for contiguous q, k and (Bc, S, R) tables."""
    bc, seqlen, rot_dim = table_shape
    k_shape = (*shape_q[:2], heads_k, shape_q[3])
    table = (0 if bc == 1 else seqlen * rot_dim, rot_dim)
    strides = (contiguous(shape_q, False), contiguous(k_shape, False))
    return rotary(tuple(shape_q), heads_k, rot_dim, strides, (table, table), backward, arch)


# ---- attention against a KV cache (kvcache_kernels.py) -----------------------------------


@dataclass(frozen=True)
class KVLaunches:
    """The main launch, and with splits > 1 the combine launch and the float32 partials'
    shapes (out (B, Sq, Hq, splits, D), lse (B, Hq, Sq, splits))."""

    main: Launch
    combine: Launch | None
    splits: int
    partial_out: tuple[int, ...] | None
    partial_lse: tuple[int, ...] | None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


@functools.lru_cache(maxsize=4096)
def kvcache(
    p: KVProblem,
    arch: str,
    sm_count: int,
    strides: tuple[Strides, Strides, Strides, Strides],
    out_strides: Strides,
    lse_strides: Strides,
    table_strides: tuple[int, int],
    fast_dequant: bool,
    scale_gather: bool = False,
    config: AttnConfig | None = None,
    num_splits: int | None = None,
    fp8_native: bool = False,
    key_strides: tuple[Strides, Strides] = ((0, 0, 0), (0, 0, 0)),
) -> KVLaunches:
    """`_attention_kvcache_fwd_kernel` (and the combine): strides of (q, k data, v data, the
    scales: (0, 0, 0) for a 16-bit cache), of out (B, Sq, Hq) and lse (B, Hq, Sq), of the
    block table's rows and the rotary tables' rows (0 when absent). config, num_splits:
    overrides (tuning, tests); else kv_config and kv_splits for sm_count SMs. fp8_native: the
    device converts float8_e4m3fn in hardware (CUDA sm_89+). key_strides: with keys by channel,
    the (page, group, head) strides of their scales and the (sequence, row, head) strides of
    their residual; a key block then lies in one group."""
    group = p.heads_q // p.heads_kv
    lean = lean_decode(p.bits, p.group_size, p.head_dim, p.fp8, p.key_group, p.rot_half > 0,
                       p.alibi or p.softcap > 0 or p.window_left >= 0)  # fmt: skip
    rows = min(p.seqlen_q * group, 17)
    short = False
    if lean and config is None:
        one_warp = kv_config(p.head_dim, p.bits, rows, arch, p.fp8, lean)
        if one_warp.num_warps == 1:
            programs = _cdiv(p.seqlen_q * group, one_warp.block_m) * p.batch * p.heads_kv
            short = not lean_pays(programs, _cdiv(p.max_seqlen_k, one_warp.block_n), sm_count, p.head_dim)
            lean = not short
    cfg = config or kv_config(p.head_dim, p.bits, rows, arch, p.fp8, lean)
    if p.key_group and p.key_group % cfg.block_n:  # a key block must lie in one group (one row of scales)
        cfg = dataclasses.replace(cfg, block_n=p.key_group)
    if cfg.block_n % 16:  # the launcher rounds max_seqlen_k up to a multiple of 16
        raise ValueError(f"kvcache plan: block_n must be a multiple of 16, got {cfg.block_n}")
    m_blocks = _cdiv(p.seqlen_q * group, cfg.block_m)
    key_blocks = _cdiv(p.max_seqlen_k, cfg.block_n)
    programs = m_blocks * p.batch * p.heads_kv
    if num_splits:
        splits = num_splits
    elif short:
        splits = short_decode_splits(programs, key_blocks, sm_count, cfg.num_warps)
    else:
        splits = kv_splits(programs, key_blocks, sm_count, cfg.num_warps, head_dim=p.head_dim)
    split_blocks = max(1, _cdiv(key_blocks, splits))
    splits = max(1, _cdiv(key_blocks, split_blocks))
    partial_out = partial_lse = None
    if splits == 1:
        o_strides, l_strides = (*out_strides, 0), (*lse_strides, 0)
    else:  # float32 partials, merged by the combine kernel
        partial_out = (p.batch, p.seqlen_q, p.heads_q, splits, p.head_dim)
        partial_lse = (p.batch, p.heads_q, p.seqlen_q, splits)
        o_strides, l_strides = _contiguous_strides(partial_out)[:4], _contiguous_strides(partial_lse)
    if p.bits == 16:
        q_scale, (qk_scale, cap_scale, cap_out) = 1.0, scales(p.scale, p.softcap)
    else:  # the kernel multiplies q by softmax_scale before its float16 cast
        q_scale, (qk_scale, cap_scale, cap_out) = p.scale, scales(1.0, p.softcap)
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
             "stride_vh", "stride_sb", "stride_ss", "stride_sh")  # fmt: skip
    args = {
        **dict(zip(names, (st for group_strides in strides for st in group_strides), strict=True)),
        **dict(zip(("stride_ob", "stride_os", "stride_oh", "stride_osplit"), o_strides, strict=True)),
        **dict(zip(("stride_lb", "stride_lh", "stride_ls", "stride_lsplit"), l_strides, strict=True)),
        "stride_bt": table_strides[0], "stride_ro": table_strides[1], "seqlen_q": p.seqlen_q,
        "seqlen_new": p.seqlen_new, "heads_kv": p.heads_kv, "group": group, "split_len": split_blocks * cfg.block_n,
        "rot_half": p.rot_half, "q_scale": q_scale, "qk_scale": qk_scale, "cap_scale": cap_scale,
        "cap_out": cap_out, "window_left": p.window_left, "window_right": p.window_right, "HEAD_DIM": p.head_dim,
        "BLOCK_D": block_d(p.head_dim), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BITS": p.bits,
        "GROUP": p.group_size, "PAGE_SIZE": p.page_size, "HAS_ROTARY": p.rot_half > 0, "INTERLEAVED": p.interleaved,
        "HAS_WINDOW_LEFT": p.window_left >= 0, "HAS_WINDOW_RIGHT": p.window_right >= 0, "HAS_ALIBI": p.alibi,
        "HAS_SOFTCAP": p.softcap > 0, "FAST_DEQUANT": fast_dequant, "SCALE_GATHER": scale_gather,
        "HAS_LEFTPAD": p.leftpad, "ROW_TABLE": p.row_table, "FP8": p.fp8, "FP8_NATIVE": p.fp8 and fp8_native,
        "stride_gb": key_strides[0][0], "stride_gg": key_strides[0][1], "stride_gh": key_strides[0][2],
        "stride_rb": key_strides[1][0], "stride_rs": key_strides[1][1], "stride_rh": key_strides[1][2],
        "KEY_GROUP": p.key_group,
    }  # fmt: skip
    main = Launch((m_blocks, p.batch * p.heads_kv, splits), cfg.num_warps, cfg.num_stages, args, cfg)
    combine = None
    if splits > 1:
        po, pl = _contiguous_strides(partial_out), _contiguous_strides(partial_lse)
        combine_args = {
            "stride_pb": po[0], "stride_ps": po[1], "stride_ph": po[2], "stride_psplit": po[3], "stride_plb": pl[0],
            "stride_plh": pl[1], "stride_pls": pl[2], "stride_ob": out_strides[0], "stride_os": out_strides[1],
            "stride_oh": out_strides[2], "stride_lb": lse_strides[0], "stride_lh": lse_strides[1],
            "seqlen_q": p.seqlen_q, "heads_q": p.heads_q, "num_splits": splits, "HEAD_DIM": p.head_dim,
            "BLOCK_D": block_d(p.head_dim), "BLOCK_SPLITS": 1 << (splits - 1).bit_length(),
        }  # fmt: skip
        combine = Launch((p.batch * p.seqlen_q * p.heads_q,), 4, None, combine_args)
    return KVLaunches(main, combine, splits, partial_out, partial_lse)
