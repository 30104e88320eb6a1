"""Triton launchers of the rotary position embedding (contract: rotary/reference.py, apply_rotary_fwd
and apply_rotary_bwd)."""

from __future__ import annotations

import torch

from openkernels.shared.launch import launch as direct_launch
from openkernels.shared.platform import device_info

from . import plan
from .configs import RotaryConfig
from .kernels import _apply_rotary_kernel

__all__ = ["apply_rotary_fwd", "apply_rotary_bwd"]


def _table_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch, token) strides of a (Bc, S, R) table; batch 0 when it broadcasts (Bc = 1)."""
    return 0 if t.shape[0] == 1 else t.stride(0), t.stride(1)


def _launch(x_q, x_k, cos, sin, out_q, out_k, backward: bool, config: RotaryConfig | None) -> None:
    launch = plan.rotary(
        tuple(x_q.shape), x_k.shape[2], cos.shape[-1], (x_q.stride()[:3], x_k.stride()[:3]),
        (_table_strides(cos), _table_strides(sin)), backward, device_info(x_q.device).arch, config,
    )  # fmt: skip
    direct_launch(_apply_rotary_kernel, launch.grid, q_ptr=x_q, k_ptr=x_k, cos_ptr=cos, sin_ptr=sin, qo_ptr=out_q, ko_ptr=out_k,
                                      num_warps=launch.num_warps, **launch.args)  # fmt: skip


def apply_rotary_fwd(q, k, cos, sin, q_out, k_out, *, config: RotaryConfig | None = None) -> None:
    """config: overrides rotary_config (tests)."""
    _launch(q, k, cos, sin, q_out, k_out, False, config)


def apply_rotary_bwd(
    grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, *, config: RotaryConfig | None = None
) -> None:
    _launch(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, True, config)
