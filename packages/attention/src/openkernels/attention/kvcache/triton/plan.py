"""Launch plans of the KV-cache kernels (kernels.py): grid, config and every argument of one
launch but its pointers, as a pure function of the call's sizes, strides and options; shared
by the PyTorch launcher (__init__.py) and the JAX launch (../jax/launch.py), cached (every
argument hashable). `Launch`, `Strides` and the helpers are ../../core/triton/plan.py's."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ...core.triton.configs import AttnConfig, block_d
from ...core.triton.plan import Launch, Strides, cdiv, contiguous, scales, softcap_flag
from ..problem import KVProblem
from .configs import kv_config, kv_splits, lean_decode, lean_pays, short_decode_splits

__all__ = ["KVProblem", "KVLaunches", "kvcache", "contiguous", "COMBINE_SPLITS_TILE"]

# True: the combine kernel loads every split's partial in one tile where (splits, head_dim)
# has at most 4096 elements (32 per thread of its 4 warps), its loads issued together instead
# of one split's after the other's. The default since attention 0.8.10: H200, decode +
# combine as CUDA-graph replays (`benchmarks/studies/kvcache_combine_tile.py`, bf16 GQA 32/8),
# B1 S4096 D64 9.0 -> 7.4 us, B1 S32768 D64 25.6 -> 22.9, B1 S4096 D128 9.4 -> 8.9, B8 / B32
# S4096 D128 unchanged (5 and 2 splits); with the 1B step's 16 caches rotated past the L2
# (`kvcache_short_decode.py`) 10.3 -> 8.8 us per layer. False: the split loop.
COMBINE_SPLITS_TILE = True


@dataclass(frozen=True)
class KVLaunches:
    """The main launch, and with splits > 1 the combine launch and the float32 partials'
    shapes (out (B, Sq, Hq, splits, D), lse (B, Hq, Sq, splits))."""

    main: Launch
    combine: Launch | None
    splits: int
    partial_out: tuple[int, ...] | None
    partial_lse: tuple[int, ...] | None
    advanced: bool = False  # the combine adds seqlen_new to the length (KVProblem.advance)


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
    new_strides: tuple[Strides, Strides, tuple[int, int]] = ((0, 0, 0), (0, 0, 0), (0, 0)),
) -> KVLaunches:
    """`_attention_kvcache_fwd_kernel` (and the combine): strides of (q, k data, v data, the
    scales: (0, 0, 0) for a 16-bit cache), of out (B, Sq, Hq) and lse (B, Hq, Sq), of the
    block table's rows and the rotary tables' rows (0 when absent). config, num_splits:
    overrides (tuning, tests); else kv_config and kv_splits for sm_count SMs. fp8_native: the
    device converts float8_e4m3fn in hardware (CUDA sm_89+). key_strides: with keys by channel,
    the (page, group, head) strides of their scales and the (sequence, row, head) strides of
    their residual; a key block then lies in one group. new_strides: with p.fused_append, the
    (batch, token, head) strides of k_new and v_new and the (batch, token) strides of the
    per-token rotary tables (p.rot_tokens)."""
    group = p.heads_q // p.heads_kv
    lean = lean_decode(p.bits, p.group_size, p.head_dim, p.fp8, p.key_group, p.rot_half > 0,
                       p.alibi or p.softcap > 0 or p.window_left >= 0)  # fmt: skip
    rows = min(p.seqlen_q * group, 17)
    short = False
    if lean and config is None:
        one_warp = kv_config(p.head_dim, p.bits, rows, arch, p.fp8, lean)
        if one_warp.num_warps == 1:
            programs = cdiv(p.seqlen_q * group, one_warp.block_m) * p.batch * p.heads_kv
            short = not lean_pays(programs, cdiv(p.max_seqlen_k, one_warp.block_n), sm_count, p.head_dim)
            lean = not short
    cfg = config or kv_config(p.head_dim, p.bits, rows, arch, p.fp8, lean)
    if p.key_group and p.key_group % cfg.block_n:  # a key block must lie in one group (one row of scales)
        cfg = dataclasses.replace(cfg, block_n=p.key_group)
    if cfg.block_n % 16:  # the launcher rounds max_seqlen_k up to a multiple of 16
        raise ValueError(f"kvcache plan: block_n must be a multiple of 16, got {cfg.block_n}")
    m_blocks = cdiv(p.seqlen_q * group, cfg.block_m)
    if p.fused_append and (p.bits != 16 or p.page_size or m_blocks != 1):
        raise ValueError(
            "kvcache plan: the fused append takes a 16-bit contiguous cache and one block of query rows"
        )
    if p.rot_tokens and not (p.fused_append and p.seqlen_q == p.seqlen_new):
        raise ValueError(
            "kvcache plan: per-token rotary tables come with the fused append, one query per new token"
        )
    key_blocks = cdiv(p.max_seqlen_k, cfg.block_n)
    programs = m_blocks * p.batch * p.heads_kv
    if num_splits:
        splits = num_splits
    elif short:
        splits = short_decode_splits(programs, key_blocks, sm_count, cfg.num_warps)
    else:
        splits = kv_splits(programs, key_blocks, sm_count, cfg.num_warps, head_dim=p.head_dim)
    split_blocks = max(1, cdiv(key_blocks, splits))
    splits = max(1, cdiv(key_blocks, split_blocks))
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
        "HAS_SOFTCAP": softcap_flag(p.softcap, arch), "FAST_DEQUANT": fast_dequant, "SCALE_GATHER": scale_gather,
        "HAS_LEFTPAD": p.leftpad, "ROW_TABLE": p.row_table, "FP8": p.fp8, "FP8_NATIVE": p.fp8 and fp8_native,
        "stride_gb": key_strides[0][0], "stride_gg": key_strides[0][1], "stride_gh": key_strides[0][2],
        "stride_rb": key_strides[1][0], "stride_rs": key_strides[1][1], "stride_rh": key_strides[1][2],
        "KEY_GROUP": p.key_group,
        **dict(zip(("stride_knb", "stride_kns", "stride_knh", "stride_vnb", "stride_vns", "stride_vnh", "stride_cb",
                    "stride_ct"), (st for part in new_strides for st in part), strict=True)),
        "FUSED_APPEND": p.fused_append, "ROT_TOKENS": p.rot_tokens,
    }  # fmt: skip
    if p.rot_tokens:  # the per-token tables replace the position-indexed ones
        args["HAS_ROTARY"] = False
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
            "advance_by": p.seqlen_new if p.advance else 0, "ADVANCE": p.advance,
        }  # fmt: skip
        combine_args["SPLITS_TILE"] = (
            COMBINE_SPLITS_TILE and combine_args["BLOCK_SPLITS"] * block_d(p.head_dim) <= 4096
        )
        combine = Launch((p.batch * p.seqlen_q * p.heads_q,), 4, None, combine_args)
    return KVLaunches(main, combine, splits, partial_out, partial_lse, combine is not None and p.advance)
