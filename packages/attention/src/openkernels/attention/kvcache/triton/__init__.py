"""Triton launchers of attention against a KV cache (contract: reference.py, kvcache_append_fwd and
attention_kvcache_fwd)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared.launch import PreparedLaunch, launch, prepare
from openkernels.shared.platform import device_info

from ...core.triton.configs import AttnConfig, block_d
from ..format import FP8
from . import plan
from .configs import kv_append_block_t, kv_append_keys_warps
from .kernels import (
    _attention_kvcache_combine_kernel,
    _attention_kvcache_fwd_kernel,
    _kvcache_append_fwd_kernel,
    _kvcache_append_keys_by_channel_kernel,
)

__all__ = ["kvcache_append_fwd", "attention_kvcache_fwd", "attention_kvcache_append_fwd", "FORCE_SPLITS"]

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
    """(page, token, head) strides of the scales: fp8's (heads_kv,) per-head scale has only the last."""
    if scale is None:
        return 0, 0, 0
    if scale.dim() == 1:
        return 0, 0, scale.stride(0)
    return scale.stride(0), scale.stride(1), scale.stride(2)


def _bytes(data: torch.Tensor) -> torch.Tensor:
    """fp8 data as its bytes: the kernels convert them themselves (sm_80 has no e4m3 type)."""
    return data.view(torch.uint8) if data.dtype == FP8 else data


def _page_size(data: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """A compile-time page size (0: contiguous, or one page per sequence: _row_table): page
    arithmetic becomes shifts or multiply-shifts, and a key block within one page reads one
    table entry."""
    return 0 if block_table is None or _row_table(block_table) else data.shape[1]


def _row_table(block_table: torch.Tensor | None) -> bool:
    """A one-column table (cache_batch_idx): each sequence's storage is one row, read with
    one scalar load per program instead of per-key page arithmetic."""
    return block_table is not None and block_table.shape[1] == 1


@functools.cache
def _fast_dequant(device: torch.device) -> bool:
    """The bit-trick dequantization is NVIDIA PTX (inline asm)."""
    return device.type == "cuda" and torch.version.hip is None


@functools.cache
def _fp8_native(device: torch.device) -> bool:
    """float8_e4m3fn converts in hardware: NVIDIA sm_89 and later."""
    return _fast_dequant(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _rotary(rotary_cos: torch.Tensor | None) -> tuple[int, int]:
    """(row stride, rot_half) of the cos/sin tables."""
    return (0, 0) if rotary_cos is None else (rotary_cos.stride(0), rotary_cos.shape[1])


def kvcache_append_fwd(k_data, v_data, k_scale, k_zero, v_scale, v_zero, k_new, v_new, cache_seqlens, block_table,
              rotary_cos, rotary_sin, *, rotary_interleaved, bits, group_size, leftpad=None, k_residual=None,
              key_group=0) -> None:  # fmt: skip
    batch, seqlen_new, heads_kv, head_dim = k_new.shape
    if seqlen_new == 0:
        return
    block_t = kv_append_block_t(head_dim)
    stride_ro, rot_half = _rotary(rotary_cos)
    fp8 = k_data.dtype == FP8
    k_data, v_data = _bytes(k_data), _bytes(v_data)
    if key_group:  # the keys by channel: every group the append touches, one program each
        launch(
            _kvcache_append_keys_by_channel_kernel, (triton.cdiv(seqlen_new, key_group) + 1, batch * heads_kv),
            k_new, k_data, k_scale, k_zero, k_residual, cache_seqlens, block_table, rotary_cos, rotary_sin,
            k_new.stride(0), k_new.stride(1), k_new.stride(2), *_side(k_data, block_table), k_scale.stride(0),
            k_scale.stride(1), k_scale.stride(2), k_residual.stride(0), k_residual.stride(1), k_residual.stride(2),
            0 if block_table is None else block_table.stride(0), stride_ro, seqlen_new, heads_kv, rot_half,
            HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), KEY_GROUP=key_group, BITS=bits,
            PAGE_SIZE=_page_size(k_data, block_table), HAS_ROTARY=rotary_cos is not None,
            INTERLEAVED=rotary_interleaved, num_warps=kv_append_keys_warps(head_dim, key_group),
        )  # fmt: skip
    launch(
        _kvcache_append_fwd_kernel, (triton.cdiv(seqlen_new, block_t), batch * heads_kv),
        k_new, v_new, k_data, v_data, k_scale, k_zero, v_scale, v_zero, cache_seqlens, block_table, rotary_cos,
        rotary_sin, leftpad, k_new.stride(0), k_new.stride(1), k_new.stride(2), v_new.stride(0), v_new.stride(1),
        v_new.stride(2), *_side(k_data, block_table), *_side(v_data, block_table), *_scale_strides(v_scale),
        0 if block_table is None else block_table.stride(0), stride_ro, seqlen_new, heads_kv, rot_half,
        HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), BLOCK_T=block_t, BITS=bits, GROUP=group_size,
        PAGE_SIZE=_page_size(k_data, block_table), HAS_ROTARY=rotary_cos is not None, INTERLEAVED=rotary_interleaved,
        HAS_LEFTPAD=leftpad is not None, ROW_TABLE=_row_table(block_table), FP8=fp8, SKIP_KEYS=key_group > 0,
        num_warps=4,
    )  # fmt: skip


_plans: dict[tuple, tuple[plan.KVLaunches, PreparedLaunch, PreparedLaunch | None]] = {}
_MAX_PLANS = 4096
# The tensor parameters of the decode kernels, in the order their launchers pass them.
_MAIN_TENSORS = ("q_ptr", "k_ptr", "v_ptr", "k_scale_ptr", "k_zero_ptr", "v_scale_ptr", "v_zero_ptr", "seqlens_ptr",
                 "block_table_ptr", "cos_ptr", "sin_ptr", "slopes_ptr", "leftpad_ptr", "res_ptr", "kn_ptr", "vn_ptr",
                 "o_ptr", "lse_ptr")  # fmt: skip
_COMBINE_TENSORS = ("part_o_ptr", "part_lse_ptr", "advance_ptr", "o_ptr", "lse_ptr")


def _plan(q, k_data, v_data, k_scale, v_scale, k_residual, key_group, out, lse, block_table, rotary_cos, seqlen_new,
          max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap, rotary_interleaved, bits, group_size,
          leftpad, config, num_splits, scale_gather, fused=None) -> plan.KVLaunches:  # fmt: skip
    """fused: (k_new, v_new, token_cos or None, advance or None) of the fused append."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    stride_ro, rot_half = _rotary(rotary_cos)
    new_strides = ((0, 0, 0), (0, 0, 0), (0, 0))
    if fused is not None:
        k_new, v_new, token_cos, _ = fused
        if token_cos is not None:
            rot_half = token_cos.shape[-1] // 2
            new_strides = (k_new.stride()[:3], v_new.stride()[:3],
                           (0 if token_cos.shape[0] == 1 else token_cos.stride(0), token_cos.stride(1)))  # fmt: skip
        else:
            new_strides = (k_new.stride()[:3], v_new.stride()[:3], (0, 0))
    problem = plan.KVProblem(
        batch, seqlen_q, heads_q, k_data.shape[2], head_dim, bits, group_size, seqlen_new, max_seqlen_k, scale,
        window_left, window_right, alibi_slopes is not None, softcap, _page_size(k_data, block_table), rot_half,
        rotary_interleaved, leftpad is not None, _row_table(block_table), k_data.dtype == FP8, key_group,
        fused is not None, fused is not None and fused[2] is not None, fused is not None and fused[3] is not None,
    )  # fmt: skip
    strides = (
        q.stride()[:3],
        _side(k_data, block_table),
        _side(v_data, block_table),
        _scale_strides(v_scale),  # per token (the keys' too unless by channel)
    )
    key_strides = ((0, 0, 0), (0, 0, 0))
    if key_group:
        key_strides = (k_scale.stride()[:3], k_residual.stride()[:3])
    return plan.kvcache(
        problem, device_info(q.device).arch, _sm_count(q.device), strides, out.stride()[:3], lse.stride(),
        (0 if block_table is None else block_table.stride(0), stride_ro), _fast_dequant(q.device), scale_gather,
        config, num_splits, _fp8_native(q.device), key_strides, new_strides,
    )  # fmt: skip


def _prepared(kv: plan.KVLaunches) -> tuple[PreparedLaunch, PreparedLaunch | None]:
    """The plan's main and combine launches: every argument fixed but the tensors, which each
    call keys and binds."""
    main = prepare(_attention_kvcache_fwd_kernel, _MAIN_TENSORS, num_warps=kv.main.num_warps,
                   num_stages=kv.main.num_stages, **kv.main.args)  # fmt: skip
    combine = None
    if kv.combine is not None:
        combine = prepare(_attention_kvcache_combine_kernel, _COMBINE_TENSORS, num_warps=kv.combine.num_warps,
                          **kv.combine.args)  # fmt: skip
    return main, combine


def attention_kvcache_fwd(q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens, block_table, rotary_cos,
            rotary_sin, *, seqlen_new, max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap,
            rotary_interleaved, bits, group_size, leftpad=None, k_residual=None, key_group=0,
            config: AttnConfig | None = None, num_splits: int | None = None,
            scale_gather: bool = False) -> None:  # fmt: skip
    """config, num_splits: override kv_config / kv_splits (tuning, tests). scale_gather: read
    grouped scales with one gathered load per element instead of a (keys, groups) load and a
    reshape (never ahead in the H200 sweeps of tune_kvcache.py; kept for them)."""
    # The plan depends on max_seqlen_k only through its number of key blocks (block_n is a
    # multiple of 16): rounded up, one cached plan serves 16 decode steps in a row. The key
    # is a plain tuple of what the plan reads (building the problem object costs more).
    max_k16 = -(-max_seqlen_k // 16) * 16
    key = (q.shape, q.stride(), k_data.dtype, k_data.shape, k_data.stride(), v_data.stride(),
           None if k_scale is None else k_scale.stride(), None if v_scale is None else v_scale.stride(),
           None if k_residual is None else k_residual.stride(), key_group, out.stride(), lse.stride(),
           None if block_table is None else (block_table.shape[1], block_table.stride(0)),
           None if rotary_cos is None else (rotary_cos.stride(0), rotary_cos.shape[1]), q.device, bits, group_size,
           seqlen_new, max_k16, scale, window_left, window_right, alibi_slopes is not None, softcap,
           rotary_interleaved, leftpad is not None, config, num_splits or FORCE_SPLITS, scale_gather)  # fmt: skip
    cached = _plans.get(key)
    if cached is None:
        kv = _plan(q, k_data, v_data, k_scale, v_scale, k_residual, key_group, out, lse, block_table, rotary_cos,
                   seqlen_new, max_k16, scale, window_left, window_right, alibi_slopes, softcap, rotary_interleaved,
                   bits, group_size, leftpad, config, num_splits or FORCE_SPLITS, scale_gather)  # fmt: skip
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        cached = _plans[key] = (kv, *_prepared(kv))
    kv, main, combine = cached
    dst_o, dst_lse = out, lse
    if kv.splits > 1:  # float32 partials, merged below
        dst_o = torch.empty(kv.partial_out, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(kv.partial_lse, dtype=torch.float32, device=q.device)
    if k_data.dtype == FP8:
        k_data, v_data = k_data.view(torch.uint8), v_data.view(torch.uint8)
    main(kv.main.grid, q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, cache_seqlens, block_table, rotary_cos,
         rotary_sin, alibi_slopes, leftpad, k_residual, None, None, dst_o, dst_lse)  # fmt: skip
    if combine is not None:
        combine(kv.combine.grid, dst_o, dst_lse, None, out, lse)


_fused_plans: dict[tuple, tuple[plan.KVLaunches, PreparedLaunch, PreparedLaunch | None]] = {}


def _rotate_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) rotated by per-token cos / sin (B or 1, S, R) in float32, rounded once."""
    from ..reference import rotate_tokens

    return rotate_tokens(x, cos, sin)


def attention_kvcache_append_fwd(q, k_data, v_data, out, lse, cache_seqlens, block_table, k_new, v_new, token_cos,
                                 token_sin, advance, *, max_seqlen_k, scale, window_left, window_right, alibi_slopes,
                                 softcap, leftpad=None) -> None:  # fmt: skip
    """The append of k_new / v_new in the attention kernel, the length's advance in the split
    combine (reference.attention_kvcache_append_fwd has the contract). Where the kernel does not
    take the call (a paged cache, more than one block of query rows): the append kernel, then
    the attention, as attention_with_kvcache runs them."""
    _, seqlen_q, heads_q, head_dim = q.shape
    seqlen_new = k_new.shape[1]
    max_k16 = -(-max_seqlen_k // 16) * 16
    key = (q.shape, q.stride(), k_data.dtype, k_data.shape, k_data.stride(), v_data.stride(), k_new.stride(),
           v_new.stride(), None if token_cos is None else (token_cos.shape, token_cos.stride()), out.stride(),
           lse.stride(), None if block_table is None else (block_table.shape[1], block_table.stride(0)), q.device,
           seqlen_new, max_k16, scale, window_left, window_right, alibi_slopes is not None, softcap,
           leftpad is not None, advance is not None, FORCE_SPLITS)  # fmt: skip
    cached = _fused_plans.get(key)
    if cached is None:
        kv = None
        fits = _page_size(k_data, block_table) == 0 and seqlen_q * (heads_q // k_data.shape[2]) <= 16
        if fits:
            kv = _plan(q, k_data, v_data, None, None, None, 0, out, lse, block_table, None, seqlen_new, max_k16,
                       scale, window_left, window_right, alibi_slopes, softcap, False, 16, head_dim, leftpad, None,
                       FORCE_SPLITS, False, fused=(k_new, v_new, token_cos, advance))  # fmt: skip
            if kv.main.grid[0] != 1:
                kv = None
        if len(_fused_plans) >= _MAX_PLANS:
            _fused_plans.clear()
        cached = _fused_plans[key] = (kv, *(_prepared(kv) if kv is not None else (None, None)))
    kv, main, combine = cached
    if kv is None:  # the two launches (rotated first where the tables are per token)
        if token_cos is not None:
            q, k_new = _rotate_tokens(q, token_cos, token_sin), _rotate_tokens(k_new, token_cos, token_sin)
        kvcache_append_fwd(k_data, v_data, None, None, None, None, k_new, v_new, cache_seqlens, block_table, None,
                           None, rotary_interleaved=False, bits=16, group_size=head_dim, leftpad=leftpad)  # fmt: skip
        attention_kvcache_fwd(q, k_data, v_data, None, None, None, None, out, lse, cache_seqlens, block_table, None,
                              None, seqlen_new=seqlen_new, max_seqlen_k=max_seqlen_k, scale=scale,
                              window_left=window_left, window_right=window_right, alibi_slopes=alibi_slopes,
                              softcap=softcap, rotary_interleaved=False, bits=16, group_size=head_dim,
                              leftpad=leftpad)  # fmt: skip
        if advance is not None:
            advance.add_(seqlen_new)
        return
    dst_o, dst_lse = out, lse
    if kv.splits > 1:
        dst_o = torch.empty(kv.partial_out, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(kv.partial_lse, dtype=torch.float32, device=q.device)
    main(kv.main.grid, q, k_data, v_data, None, None, None, None, cache_seqlens, block_table, token_cos, token_sin,
         alibi_slopes, leftpad, None, k_new, v_new, dst_o, dst_lse)  # fmt: skip
    if combine is not None:
        combine(kv.combine.grid, dst_o, dst_lse, advance, out, lse)
    if advance is not None and not kv.advanced:
        advance.add_(seqlen_new)
