"""torch.library ops of the rotary position embedding and their dispatch registrations.

  openkernels::apply_rotary(q, k, cos, sin) -> (q_out, k_out)
  openkernels::apply_rotary_backward(grad_q_out, grad_k_out, cos, sin) -> (grad_q, grad_k)
q (B, S, Hq, D), k (B, S, Hk, D); cos, sin (B or 1, S, R) or (S, R). Outputs contiguous, each
in its input's dtype; cos and sin get no gradient. Contract: reference.py.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch, opdef

from ..core.ops import cpu_supports, unit_last
from . import problem

__all__ = ["apply_rotary_forward", "apply_rotary_backward", "APPLY_ROTARY", "KERNEL_DTYPES", "MAX_HEAD_DIM"]

_PKG = "openkernels.attention.rotary"
KERNEL_DTYPES = tuple(getattr(torch, name) for name in problem.KERNEL_DTYPES)
MAX_HEAD_DIM = problem.MAX_HEAD_DIM
_LIB = torch.library.Library("openkernels", "FRAGMENT")


def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as (Bc, S, R) with a unit last stride: the backends' layout."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return unit_last(cos), unit_last(sin)


def _rotary(op: str, x_q: torch.Tensor, x_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    out_q = torch.empty(x_q.shape, dtype=x_q.dtype, device=x_q.device)
    out_k = torch.empty(x_k.shape, dtype=x_k.dtype, device=x_k.device)
    if out_q.numel() or out_k.numel():
        dispatch.run(op, unit_last(x_q), unit_last(x_k), *_rotary_tables(cos, sin), out_q, out_k)
    return out_q, out_k


def apply_rotary_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out), new contiguous tensors, with the best backend."""
    return _rotary("apply_rotary", q, k, cos, sin)


def apply_rotary_backward(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k): the transposed rotation of the output gradients."""
    return _rotary("apply_rotary_backward", grad_q_out, grad_k_out, cos, sin)


def _rotary_key(x_q: torch.Tensor, *args: object, **kwargs: object) -> dispatch.DispatchKey:
    """q (or its gradient) decides; `dispatch.explain("apply_rotary", q)` works."""
    if x_q.shape[-1] > MAX_HEAD_DIM:
        return dispatch.key_for(x_q, "wide-head")
    return dispatch.key_for(x_q)


def _rotary_triton_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"dtype {key.dtype}: the rotary kernel takes float16, bfloat16 and float32"
    if "wide-head" in key.features:
        return f"head_dim above {MAX_HEAD_DIM}: the kernel's tiles are checked up to that"
    return dispatch.triton_supports(key)


def _impls(entry: str) -> tuple[opdef.Impl, ...]:
    return opdef.standard_impls(
        _PKG, entry, triton_supports=_rotary_triton_supports, cpu_supports=cpu_supports
    )


def _no_table_grad(name: str, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{name}: cos and sin get no gradient; pass them detached (cos.requires_grad is "
                         f"{cos.requires_grad}, sin.requires_grad is {sin.requires_grad})")  # fmt: skip


def _rotary_fake(q, k, cos, sin):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k))


def _rotary_save(inputs: tuple, output: tuple) -> tuple[tuple, tuple]:
    _q, _k, cos, sin = inputs
    _no_table_grad("openkernels::apply_rotary", cos, sin)
    return (cos, sin), ()


def _rotary_grads(run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
    cos, sin = tensors
    grad_q, grad_k = run(grad_outputs[0], grad_outputs[1], cos, sin)
    return grad_q, grad_k, None, None


APPLY_ROTARY = opdef.define(
    _LIB,
    opdef.OpDef(
        name="apply_rotary",
        schema="(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        forward=apply_rotary_forward,
        fake=_rotary_fake,
        key=_rotary_key,
        impls=_impls("apply_rotary_fwd"),
        tensor_args=(0, 1, 2, 3),
        backward=opdef.BackwardDef(
            schema="(Tensor grad_q_out, Tensor grad_k_out, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
            compute=apply_rotary_backward,
            fake=lambda grad_q_out, grad_k_out, cos, sin: _rotary_fake(grad_q_out, grad_k_out, cos, sin),
            save=_rotary_save,
            grads=_rotary_grads,
            key=_rotary_key,
            impls=_impls("apply_rotary_bwd"),
        ),
    ),
)
