"""Triton launchers of the attention family (see reference.py for the backend contract)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared.launch import launch as direct_launch
from openkernels.shared.platform import device_info

from . import configs, plan
from .configs import AttnConfig
from .kernels import (
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _attn_bwd_group_sum_kernel,
    _attn_bwd_preprocess_kernel,
    _attn_fwd_kernel,
)

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "bwd_delta",
]


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


def _arch(device: torch.device) -> str:
    return device_info(device).arch


def _bshd(t: torch.Tensor, varlen: bool) -> plan.Strides:
    """(batch, seq, head) strides; varlen packs every sequence on dim 1 of a batch of one."""
    return 0 if varlen else t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    return 0 if varlen else lse.stride(0), lse.stride(1)


def _problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, window_left, window_right, alibi_slopes,
             softcap, dropout_p) -> plan.Problem:  # fmt: skip
    varlen = cu_seqlens_q is not None
    return plan.Problem(
        n_seqs=cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0],
        seqlen_q=max_seqlen_q if varlen else q.shape[1],
        seqlen_k=max_seqlen_k if varlen else k.shape[1],
        heads_q=q.shape[2], heads_kv=k.shape[2], head_dim=q.shape[3], varlen=varlen, scale=scale,
        window_left=window_left, window_right=window_right, alibi=alibi_slopes is not None, softcap=softcap,
        dropout=dropout_p,
    )  # fmt: skip


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
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    config: AttnConfig | None = None,
) -> None:
    p = _problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, window_left, window_right, alibi_slopes,
                 softcap, dropout_p)  # fmt: skip
    strides = tuple(_bshd(t, p.varlen) for t in (q, k, v, out))
    launch = plan.fwd(p, _arch(q.device), q.dtype, strides, _lse_strides(lse, p.varlen), config)
    direct_launch(
        _attn_fwd_kernel, launch.grid,
        q_ptr=q, k_ptr=k, v_ptr=v, cu_q_ptr=cu_seqlens_q, cu_k_ptr=cu_seqlens_k, slopes_ptr=alibi_slopes,
        seed_ptr=dropout_seed, o_ptr=out, lse_ptr=lse, USE_TMA=_tma_ok(launch.config, k, v), num_warps=launch.num_warps,
        num_stages=launch.num_stages, **launch.args,
    )  # fmt: skip


def _group_sum(part: torch.Tensor, grad: torch.Tensor, p: plan.Problem, varlen: bool) -> None:
    """GQA: grad (one head per K/V head, any strides) = part (float32, contiguous, one head
    per query head) summed over each group, by a kernel (an aten sum would be a second pass in
    float32 and a copy, and keeps the call from replaying)."""
    batch, seqlen = 1 if varlen else grad.shape[0], grad.shape[-3]  # varlen: every token on dim -3
    block_d = configs.block_d(p.head_dim)
    block_r = configs.group_sum_block_rows(block_d)
    stride_b, stride_s, stride_h = _bshd(grad, varlen)
    direct_launch(_attn_bwd_group_sum_kernel, (triton.cdiv(seqlen * p.heads_kv, block_r), batch), part_ptr=part,
                  grad_ptr=grad, stride_gb=stride_b, stride_gs=stride_s, stride_gh=stride_h, seqlen=seqlen,
                  heads_kv=p.heads_kv, GROUP=p.group, HEAD_DIM=p.head_dim, BLOCK_D=block_d, BLOCK_R=block_r,
                  num_warps=4)  # fmt: skip


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
              p: plan.Problem) -> torch.Tensor:  # fmt: skip
    """delta = rowsum(out * dout) per query row, float32, laid out as lse (the backward's
    first kernel; the Gluon backward takes it too)."""
    delta = torch.empty_like(lse)
    pre = plan.preprocess(p, (_bshd(out, p.varlen), _bshd(dout, p.varlen)), _lse_strides(lse, p.varlen))
    direct_launch(_attn_bwd_preprocess_kernel, pre.grid, o_ptr=out, do_ptr=dout, cu_q_ptr=cu_seqlens_q, delta_ptr=delta,
                  num_warps=pre.num_warps, **pre.args)  # fmt: skip
    return delta


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
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    configs: tuple[AttnConfig, AttnConfig] | None = None,
) -> None:
    p = _problem(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale, window_left, window_right, alibi_slopes,
                 softcap, dropout_p)  # fmt: skip
    varlen, arch = p.varlen, _arch(q.device)
    lse_strides = _lse_strides(lse, varlen)
    strides_aligned = plan.aligned(*(t.stride()[:-1] for t in (dout, q, k, v, dq, dk, dv)))
    dkdv_cfg, dq_cfg = configs or (None, None)
    delta = bwd_delta(out, dout, lse, cu_seqlens_q, p)
    # GQA: each query head's dK/dV share lands in float32 buffers with one head per query
    # head, summed over each group in a fixed order below (deterministic).
    if p.group == 1:
        dk_part, dv_part = dk, dv
    else:
        dk_part = torch.empty((*k.shape[:2], p.heads_q, p.head_dim), dtype=torch.float32, device=k.device)
        dv_part = torch.empty_like(dk_part)
    common = dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=dout, lse_ptr=lse, delta_ptr=delta, cu_q_ptr=cu_seqlens_q,
                  cu_k_ptr=cu_seqlens_k, slopes_ptr=alibi_slopes, seed_ptr=dropout_seed)  # fmt: skip
    base = tuple(_bshd(t, varlen) for t in (q, k, v, dout))
    kv = plan.bwd("dkdv", p, arch, q.dtype, (*base, _bshd(dk_part, varlen), _bshd(dv_part, varlen)), lse_strides,
                  strides_aligned, dkdv_cfg)  # fmt: skip
    direct_launch(_attn_bwd_dkdv_kernel, kv.grid, **common, dk_ptr=dk_part, dv_ptr=dv_part, num_warps=kv.num_warps,
                                   num_stages=kv.num_stages, **kv.args)  # fmt: skip
    if p.group > 1:
        for part, grad in ((dk_part, dk), (dv_part, dv)):
            _group_sum(part, grad, p, varlen)
    qd = plan.bwd("dq", p, arch, q.dtype, (*base, _bshd(dq, varlen)), lse_strides, strides_aligned, dq_cfg)
    direct_launch(_attn_bwd_dq_kernel, qd.grid, **common, dq_ptr=dq, num_warps=qd.num_warps, num_stages=qd.num_stages,
                                 **qd.args)  # fmt: skip
