"""Triton launchers of attention against a KV cache (contract: reference.py, kvcache_append_fwd and
attention_kvcache_fwd)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared.platform import device_info

from . import _scales
from .configs import AttnConfig, block_d, kv_append_block_t, kv_config, kv_splits
from .kvcache_kernels import (
    _attention_kvcache_combine_kernel,
    _attention_kvcache_fwd_kernel,
    _kvcache_append_fwd_kernel,
)

__all__ = ["kvcache_append_fwd", "attention_kvcache_fwd", "FORCE_SPLITS"]

# Pin the number of key splits (tests, tuning); None: kv_splits' heuristic.
FORCE_SPLITS: int | None = None


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so the split path runs in tests
    return torch.cuda.get_device_properties(device).multi_processor_count


def _side(data: torch.Tensor, block_table: torch.Tensor | None) -> tuple[int, int, int]:
    """(sequence-or-page, token, head) strides of a cache side."""
    return data.stride(0), data.stride(1), data.stride(2)


def _scale_strides(scale: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if scale is None else (scale.stride(0), scale.stride(1), scale.stride(2))


def _page_size(data: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """A compile-time page size (0: contiguous): page arithmetic becomes shifts or
    multiply-shifts, and a key block within one page reads one table entry."""
    return 0 if block_table is None else data.shape[1]


@functools.cache
def _fast_dequant(device: torch.device) -> bool:
    """The bit-trick dequantization is NVIDIA PTX (inline asm)."""
    return device.type == "cuda" and torch.version.hip is None


def _rotary(rotary_cos: torch.Tensor | None) -> tuple[int, int]:
    """(row stride, rot_half) of the cos/sin tables."""
    return (0, 0) if rotary_cos is None else (rotary_cos.stride(0), rotary_cos.shape[1])


def kvcache_append_fwd(k_data, v_data, k_scale, k_zero, v_scale, v_zero, k_new, v_new, cache_seqlens, block_table,
              rotary_cos, rotary_sin, *, rotary_interleaved, bits, group_size) -> None:  # fmt: skip
    batch, seqlen_new, heads_kv, head_dim = k_new.shape
    if seqlen_new == 0:
        return
    block_t = kv_append_block_t(head_dim)
    stride_ro, rot_half = _rotary(rotary_cos)
    _kvcache_append_fwd_kernel[(triton.cdiv(seqlen_new, block_t), batch * heads_kv)](
        k_new, v_new, k_data, v_data, k_scale, k_zero, v_scale, v_zero, cache_seqlens, block_table, rotary_cos,
        rotary_sin, k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1),
        v_new.stride(2), *_side(k_data, block_table), *_side(v_data, block_table), *_scale_strides(k_scale),
        0 if block_table is None else block_table.stride(0), stride_ro, seqlen_new, heads_kv, rot_half,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_T=block_t, BITS=bits, GROUP=group_size,
        PAGE_SIZE=_page_size(k_data, block_table), HAS_ROTARY=rotary_cos is not None, INTERLEAVED=rotary_interleaved,
        num_warps=4,
    )  # fmt: skip


@functools.cache
def _config(head_dim: int, bits: int, rows: int, device: torch.device) -> AttnConfig:
    return kv_config(head_dim, bits, rows, device_info(device).arch)


def attention_kvcache_fwd(q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens, block_table, rotary_cos,
            rotary_sin, *, seqlen_new, max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap,
            rotary_interleaved, bits, group_size, config: AttnConfig | None = None,
            num_splits: int | None = None, scale_gather: bool = False) -> None:  # fmt: skip
    """config, num_splits: override kv_config / kv_splits (tuning, tests). scale_gather: read
    grouped scales with one gathered load per element instead of a (keys, groups) load and a
    reshape (never ahead in the H200 sweeps of tune_kvcache.py; kept for them)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_data.shape[2]
    group = heads_q // heads_kv
    cfg = config or _config(head_dim, bits, min(seqlen_q * group, 17), q.device)
    m_blocks = triton.cdiv(seqlen_q * group, cfg.block_m)
    key_blocks = triton.cdiv(max_seqlen_k, cfg.block_n)
    splits = (
        num_splits or FORCE_SPLITS or kv_splits(m_blocks * batch * heads_kv, key_blocks, _sm_count(q.device))
    )
    split_blocks = max(1, triton.cdiv(key_blocks, splits))
    splits = max(1, triton.cdiv(key_blocks, split_blocks))
    if splits == 1:
        dst_o, dst_lse = out, lse
        o_strides = (*out.stride()[:3], 0)
        l_strides = (lse.stride(0), lse.stride(1), lse.stride(2), 0)
    else:  # float32 partials, merged below
        dst_o = torch.empty(
            (batch, seqlen_q, heads_q, splits, head_dim), dtype=torch.float32, device=q.device
        )
        dst_lse = torch.empty((batch, heads_q, seqlen_q, splits), dtype=torch.float32, device=q.device)
        o_strides = (dst_o.stride(0), dst_o.stride(1), dst_o.stride(2), dst_o.stride(3))
        l_strides = dst_lse.stride()
    if bits == 16:
        q_scale = 1.0
        qk_scale, cap_scale, cap_out = _scales(scale, softcap)
    else:  # the kernel multiplies q by softmax_scale before its float16 cast
        q_scale = scale
        qk_scale, cap_scale, cap_out = _scales(1.0, softcap)
    stride_ro, rot_half = _rotary(rotary_cos)
    _attention_kvcache_fwd_kernel[(m_blocks, batch * heads_kv, splits)](
        q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, dst_o, dst_lse, cache_seqlens, block_table,
        rotary_cos, rotary_sin, alibi_slopes, q.stride(0), q.stride(1), q.stride(2), *_side(k_data, block_table),
        *_side(v_data, block_table), *_scale_strides(k_scale), *o_strides, *l_strides,
        0 if block_table is None else block_table.stride(0), stride_ro, seqlen_q, seqlen_new, heads_kv, group,
        split_blocks * cfg.block_n, rot_half, q_scale, qk_scale, cap_scale, cap_out, window_left, window_right,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BITS=bits,
        GROUP=group_size, PAGE_SIZE=_page_size(k_data, block_table), HAS_ROTARY=rotary_cos is not None,
        INTERLEAVED=rotary_interleaved, HAS_WINDOW_LEFT=window_left >= 0, HAS_WINDOW_RIGHT=window_right >= 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap > 0, FAST_DEQUANT=_fast_dequant(q.device),
        SCALE_GATHER=scale_gather, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _attention_kvcache_combine_kernel[(batch * seqlen_q * heads_q,)](
            dst_o, dst_lse, out, lse, dst_o.stride(0), dst_o.stride(1), dst_o.stride(2), dst_o.stride(3),
            dst_lse.stride(0), dst_lse.stride(1), dst_lse.stride(2), *out.stride()[:3], lse.stride(0),
            lse.stride(1), seqlen_q, heads_q, splits, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
            BLOCK_SPLITS=triton.next_power_of_2(splits), num_warps=4,
        )  # fmt: skip
