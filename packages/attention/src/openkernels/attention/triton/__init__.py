"""Triton launchers of the attention family (see reference.py for the backend contract)."""

from __future__ import annotations

import functools
import math

import torch
import triton

from openkernels.shared.platform import device_info

from .configs import AttnConfig, block_d, launch_config, preprocess_block_m
from .kernels import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel, _attn_fwd_kernel
from .rotary import apply_rotary_bwd, apply_rotary_fwd

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "kvcache_append_fwd",
    "attention_kvcache_fwd",
    "apply_rotary_fwd",
    "apply_rotary_bwd",
]

LOG2E = 1.0 / math.log(2.0)


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def _tma_ok(cfg: AttnConfig, *tensors: torch.Tensor) -> bool:
    """The copy engine needs 16-byte aligned bases and row strides."""
    if not cfg.tma or not _has_tma(tensors[0].device):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            return False
    _ensure_allocator()
    return True


def _alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Kernels that build tensor descriptors on the device need scratch memory from an
    allocator; install a torch one unless the caller set theirs."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_alloc)


@functools.cache
def _config(
    head_dim: int, dtype: torch.dtype, device: torch.device, direction: str, general: bool
) -> AttnConfig:
    return launch_config(head_dim, dtype, device_info(device).arch, direction, general)


def _general(varlen, seqlen_q, seqlen_k, window_left, window_right, alibi_slopes, softcap, *tensors) -> bool:
    """Whether a call is off the fast path (configs._TABLE): a window other than causal,
    varlen, ALiBi, softcap, or sequence lengths or strides that are not multiples of 16."""
    return (
        varlen
        or window_left >= 0
        or window_right > 0
        or alibi_slopes is not None
        or softcap > 0
        or seqlen_q % 16 != 0
        or seqlen_k % 16 != 0
        or any(st % 16 for t in tensors for st in t.stride()[:-1])
    )


def _bshd(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides; varlen packs every sequence on dim 1 of a batch of one."""
    return 0 if varlen else t.stride(0), t.stride(1), t.stride(2)


def _scales(scale: float, softcap: float) -> tuple[float, float, float]:
    """(qk_scale, cap_scale, cap_out): log2-unit score = qk * qk_scale, or with a softcap
    softcap * tanh(qk * scale / softcap) * log2(e) = tanh(qk * cap_scale) * cap_out."""
    if softcap > 0:
        return scale * LOG2E, scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0, 0.0


def _common(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, window_left, window_right, alibi_slopes, softcap):
    varlen = cu_seqlens_q is not None
    n_seqs = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    seqlen_q = max_seqlen_q if varlen else q.shape[1]
    seqlen_k = max_seqlen_k if varlen else k.shape[1]
    heads_q, heads_kv = q.shape[2], k.shape[2]
    flags = dict(
        HEAD_DIM=q.shape[3], BLOCK_D=block_d(q.shape[3]), IS_VARLEN=varlen,
        HAS_WINDOW_LEFT=window_left >= 0, HAS_WINDOW_RIGHT=window_right >= 0,
        HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap > 0,
    )  # fmt: skip
    return varlen, n_seqs, seqlen_q, seqlen_k, heads_q, heads_q // heads_kv, flags


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    config: AttnConfig | None = None,
) -> None:
    varlen, n_seqs, seqlen_q, seqlen_k, heads_q, group, flags = _common(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, window_left, window_right, alibi_slopes, softcap
    )
    general = _general(
        varlen, seqlen_q, seqlen_k, window_left, window_right, alibi_slopes, softcap, q, k, v, out
    )
    cfg = config or _config(q.shape[3], q.dtype, q.device, "fwd", general)
    qk_scale, cap_scale, cap_out = _scales(scale, softcap)
    grid = (triton.cdiv(seqlen_q, cfg.block_m), n_seqs * heads_q)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        *_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(out, varlen),
        0 if varlen else lse.stride(0), lse.stride(1),
        seqlen_q, seqlen_k, heads_q, group, qk_scale, cap_scale, cap_out, window_left, window_right,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_TMA=_tma_ok(cfg, k, v), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **flags,
    )  # fmt: skip


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    *,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    configs: tuple[AttnConfig, AttnConfig] | None = None,
) -> None:
    varlen, n_seqs, seqlen_q, seqlen_k, heads_q, group, flags = _common(
        q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, window_left, window_right, alibi_slopes, softcap
    )
    head_dim = q.shape[3]
    general = _general(
        varlen,
        seqlen_q,
        seqlen_k,
        window_left,
        window_right,
        alibi_slopes,
        softcap,
        dout,
        q,
        k,
        v,
        dq,
        dk,
        dv,
    )
    dkdv_cfg, dq_cfg = configs or (
        _config(head_dim, q.dtype, q.device, "dkdv", general),
        _config(head_dim, q.dtype, q.device, "dq", general),
    )
    qk_scale, cap_scale, cap_out = _scales(scale, softcap)
    lse_strides = (0 if varlen else lse.stride(0), lse.stride(1))
    delta = torch.empty_like(lse)
    pre_block = preprocess_block_m(head_dim)
    _attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_block), n_seqs * heads_q)](
        out, dout, delta, cu_seqlens_q, *_bshd(out, varlen), *_bshd(dout, varlen), *lse_strides,
        seqlen_q, heads_q, HEAD_DIM=head_dim, BLOCK_D=flags["BLOCK_D"], BLOCK_M=pre_block,
        IS_VARLEN=varlen, num_warps=4,
    )  # fmt: skip
    shared = (
        *lse_strides, seqlen_q, seqlen_k, heads_q, group, qk_scale, scale, cap_scale, cap_out, window_left,
        window_right,
    )  # fmt: skip
    # GQA: each query head's dK/dV share lands in float32 buffers with one head per query
    # head, summed over each group in a fixed order below (deterministic).
    if group == 1:
        dk_part, dv_part = dk, dv
    else:
        dk_part = torch.empty((*k.shape[:2], heads_q, head_dim), dtype=torch.float32, device=k.device)
        dv_part = torch.empty_like(dk_part)
    _attn_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, dkdv_cfg.block_n), n_seqs * heads_q)](
        q, k, v, dout, lse, delta, dk_part, dv_part, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        *_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(dout, varlen), *_bshd(dk_part, varlen),
        *_bshd(dv_part, varlen), *shared,
        BLOCK_M=dkdv_cfg.block_m, BLOCK_N=dkdv_cfg.block_n, num_warps=dkdv_cfg.num_warps,
        num_stages=dkdv_cfg.num_stages, **flags,
    )  # fmt: skip
    if group > 1:
        heads_kv = heads_q // group
        for part, grad in ((dk_part, dk), (dv_part, dv)):
            grad.copy_(part.view(*part.shape[:2], heads_kv, group, head_dim).sum(dim=3))
    _attn_bwd_dq_kernel[(triton.cdiv(seqlen_q, dq_cfg.block_m), n_seqs * heads_q)](
        q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        *_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(dout, varlen), *_bshd(dq, varlen),
        *shared,
        BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages,
        **flags,
    )  # fmt: skip


from .kvcache import attention_kvcache_fwd, kvcache_append_fwd  # noqa: E402 - uses _scales above
