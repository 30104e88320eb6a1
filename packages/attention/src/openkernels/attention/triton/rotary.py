"""Triton launchers of the rotary position embedding (contract: reference.py, apply_rotary_fwd
and apply_rotary_bwd)."""

from __future__ import annotations

import functools

import torch
import triton

from openkernels.shared.platform import device_info

from .configs import RotaryConfig, rotary_blocks, rotary_config
from .rotary_kernels import _apply_rotary_kernel

__all__ = ["apply_rotary_fwd", "apply_rotary_bwd"]


@functools.cache
def _config(head_dim: int, rot_dim: int, heads_q: int, heads_k: int, device: torch.device) -> RotaryConfig:
    return rotary_config(head_dim, rot_dim, heads_q, heads_k, device_info(device).arch)


def _table_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a (Bc, S, R) table; batch 0 when it broadcasts (Bc = 1)."""
    return 0 if t.shape[0] == 1 else t.stride(0), t.stride(1)


def _launch(x_q, x_k, cos, sin, out_q, out_k, backward: bool, config: RotaryConfig | None) -> None:
    batch, seqlen, heads_q, head_dim = x_q.shape
    heads_k, rot_dim = x_k.shape[2], cos.shape[-1]
    cfg = config or _config(head_dim, rot_dim, heads_q, heads_k, x_q.device)
    block_half, block_pass = rotary_blocks(head_dim, rot_dim)
    tokens = batch * seqlen
    _apply_rotary_kernel[(triton.cdiv(tokens, cfg.block_t),)](
        x_q, x_k, cos, sin, out_q, out_k, *x_q.stride()[:3], *x_k.stride()[:3], *_table_strides(cos),
        *_table_strides(sin), tokens, seqlen, heads_q, heads_k,
        HEAD_DIM=head_dim, ROT_HALF=rot_dim // 2, BLOCK_T=cfg.block_t, BLOCK_HQ=cfg.block_hq, BLOCK_HK=cfg.block_hk,
        BLOCK_HALF=block_half, BLOCK_PASS=block_pass, BACKWARD=backward, num_warps=cfg.num_warps,
    )  # fmt: skip


def apply_rotary_fwd(q, k, cos, sin, q_out, k_out, *, config: RotaryConfig | None = None) -> None:
    """config: overrides rotary_config (tests)."""
    _launch(q, k, cos, sin, q_out, k_out, False, config)


def apply_rotary_bwd(
    grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, *, config: RotaryConfig | None = None
) -> None:
    _launch(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, True, config)
