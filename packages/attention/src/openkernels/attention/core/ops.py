"""torch.library ops of the attention family and their dispatch registrations.

Library ops (one explicit schema each; op, fake, backward op, autograd, dispatch
registrations and eager fast paths from one `opdef` declaration each, at the end):
  openkernels::attention(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                         softmax_scale, window_left, window_right, alibi_slopes?, softcap,
                         dropout_p, dropout_seed?) -> (out, lse)
  openkernels::attention_backward(grad_out, q, k, v, out, lse, <the same options>)
      -> (grad_q, grad_k, grad_v)
Dense calls: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), lse (B, Hq, Sq). Varlen calls (the
cu_seqlens given, int32): q (Tq, Hq, D), k, v (Tk, Hkv, D), lse (Hq, Tq). out and the
gradients are contiguous, in the input dtype; lse is float32 (float64 for float64 inputs).
Causal is window_right = 0; -1 is an unbounded side. ALiBi slopes are not differentiated.
Dropout: dropout_p > 0 with dropout_seed, int32 (2,) on q's device (drawn per call by the
API); the backward regenerates the forward's mask from the same seed (reference.py).
The backend contract (attn_fwd / attn_bwd on 4D views) is in reference.py.

The KV-cache ops (openkernels::kvcache_append, openkernels::attention_kvcache) are in
../kvcache/ops.py, the rotary ops (openkernels::apply_rotary) in ../rotary/ops.py; both use
this module's helpers (unit_last, alibi_layout, the supports predicates).
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch, opdef

from . import cudnn, problem
from .gluon import supports as gluon_supports
from .problem import ATTENTION_HEAD_DIMS, HEAD_DIMS
from .reference import compute_dtype

__all__ = [
    "forward",
    "backward",
    "ATTENTION",
    "with_sinks",
    "fold_sinks",
    "unit_last",
    "alibi_layout",
    "triton_supports",
    "cpu_supports",
    "KERNEL_DTYPES",
    "HEAD_DIMS",
    "ATTENTION_HEAD_DIMS",
]

_PKG = "openkernels.attention.core"
KERNEL_DTYPES = tuple(getattr(torch, name) for name in problem.KERNEL_DTYPES)  # what the Triton kernels take

_LIB = torch.library.Library("openkernels", "FRAGMENT")
_OPTIONS = (
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
    "int window_left, int window_right, Tensor? alibi_slopes, float softcap, float dropout_p=0.0, Tensor? dropout_seed=None"
)


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels index any strides but need unit stride along head_dim."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _as_4d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.unsqueeze(0) if varlen else t


def alibi_layout(alibi_slopes: torch.Tensor | None, n_seqs: int, heads: int) -> torch.Tensor | None:
    """(n_seqs, heads) float32 contiguous, the backends' layout."""
    if alibi_slopes is None:
        return None
    return alibi_slopes.to(torch.float32).expand(n_seqs, heads).contiguous()


def _n_seqs(q: torch.Tensor, cu_seqlens_q: torch.Tensor | None) -> int:
    return q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the best backend; returns (out, lse)."""
    varlen = cu_seqlens_q is not None
    q, k, v = unit_last(q), unit_last(k), unit_last(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, varlen), dtype=compute_dtype(q.dtype), device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[-3] == 0:  # no keys at all: every row is empty
        return out.zero_(), lse.fill_(float("-inf"))
    dispatch.run(
        "attention",
        _as_4d(q, varlen),
        _as_4d(k, varlen),
        _as_4d(v, varlen),
        _as_4d(out, varlen),
        lse.unsqueeze(0) if varlen else lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        alibi_slopes=alibi_layout(alibi_slopes, _n_seqs(q, cu_seqlens_q), q.shape[-2]),
        softcap=softcap,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    return out, lse


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_v), contiguous, in the inputs' dtype."""
    varlen = cu_seqlens_q is not None
    q, k, v, out, grad_out = (unit_last(t) for t in (q, k, v, out, grad_out))
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.shape[-3] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    dispatch.run(
        "attention_backward",
        _as_4d(grad_out, varlen),
        _as_4d(q, varlen),
        _as_4d(k, varlen),
        _as_4d(v, varlen),
        _as_4d(out, varlen),
        lse.unsqueeze(0) if varlen else lse,
        _as_4d(dq, varlen),
        _as_4d(dk, varlen),
        _as_4d(dv, varlen),
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        scale=softmax_scale,
        window_left=window_left,
        window_right=window_right,
        alibi_slopes=alibi_layout(alibi_slopes, _n_seqs(q, cu_seqlens_q), q.shape[-2]),
        softcap=softcap,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    return dq, dk, dv


# alone it explains a call that is not plain).
def _fwd_key(q: torch.Tensor, k=None, v=None, out=None, lse=None, cu_seqlens_q=None, *args: object,
             **kwargs: object) -> dispatch.DispatchKey:  # fmt: skip
    if q.is_cuda and k is not None and _plain(q, k, v, cu_seqlens_q, kwargs, out):
        return dispatch.key_for(q, "plain")
    return dispatch.key_for(q)


def _bwd_key(dout: torch.Tensor, q: torch.Tensor, k=None, v=None, out=None, lse=None, dq=None, dk=None, dv=None,
             cu_seqlens_q=None, *args: object, **kwargs: object) -> dispatch.DispatchKey:  # fmt: skip
    if q.is_cuda and k is not None and _plain(q, k, v, cu_seqlens_q, kwargs, dout, out, dq, dk, dv):
        return dispatch.key_for(q, "plain")
    return dispatch.key_for(q)


def _plain(q, k, v, cu_seqlens_q, options: dict, *tensors) -> bool:
    if options.get("dropout_p", 0.0) > 0:  # cuDNN's dropout draws another mask
        return False
    return cudnn.is_plain(q, k, v, cu_seqlens_q, options.get("alibi_slopes"), options.get("softcap", 0.0),
                          options.get("window_left", -1), options.get("window_right", -1), *tensors)  # fmt: skip


def triton_supports(key: dispatch.DispatchKey) -> str | None:
    if key.dtype not in KERNEL_DTYPES:
        return f"dtype {key.dtype}: the Triton kernels take float16 and bfloat16 (float32 runs a slower path)"
    return dispatch.triton_supports(key)


def cpu_supports(key: dispatch.DispatchKey) -> str | None:
    from .cpu import supports

    return supports(key)


def _impls(entry: str, supports, cpu: str | None = "cpu") -> tuple[opdef.Impl, ...]:
    """`cpu`: the family's module with the CPU kernel, None when the op has none of its own."""
    return opdef.standard_impls(_PKG, entry, triton_supports=supports, cpu_supports=cpu_supports, cpu=cpu)


def _with_cudnn(entry: str, supports) -> tuple[opdef.Impl, ...]:
    """attention's implementations: cuDNN ahead of the Triton kernels where it runs (cudnn.py)."""
    return (*_impls(entry, triton_supports), opdef.Impl("cudnn", f"{_PKG}.cudnn:{entry}", ("cuda",), 30,
                                                         supports))  # fmt: skip


# The Hopper kernels in Gluon (gluon/). The forward stays below the Triton kernels' priority
# (20): on the H200 it ran 0.60-0.80x cuDNN's (which plain calls get), so only
# `dispatch.force("attention:gluon")` picks it. The backward is the default for plain calls
# on sm_90 (25: above Triton, below cuDNN's 30, whose backward runs only when
# nondeterminism is allowed): behind cuDNN's forward it made forward+backward 1.01-1.11x
# the Triton backward's at the ten study shapes (2026-12-05, docs/perf.md).
_GLUON_FWD_PRIORITY, _GLUON_BWD_PRIORITY = 15, 25
_GLUON_FWD = opdef.Impl("gluon", f"{_PKG}.gluon:attn_fwd", ("cuda",), _GLUON_FWD_PRIORITY, gluon_supports)
_GLUON_BWD = opdef.Impl("gluon", f"{_PKG}.gluon:attn_bwd", ("cuda",), _GLUON_BWD_PRIORITY, gluon_supports)


# ---- openkernels::attention ------------------------------------------------------------


def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q is not None), dtype=compute_dtype(q.dtype), device=q.device)
    return out, lse


def _attention_backward_fake(grad_out, q, k, v, *args):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _attention_save(inputs: tuple, output: tuple) -> tuple[tuple, tuple]:
    q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, dropout_p, seed = inputs
    out, lse = output
    return (q, k, v, out, lse, cu_q, cu_k, alibi, seed), (
        max_q,
        max_k,
        scale,
        left,
        right,
        softcap,
        dropout_p,
    )


def _attention_grads(
    run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]
) -> tuple:
    q, k, v, out, lse, cu_q, cu_k, alibi, seed = tensors
    max_q, max_k, scale, left, right, softcap, dropout_p = values
    dq, dk, dv = run(grad_outputs[0], q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap,
                     dropout_p, seed)  # fmt: skip
    return dq, dk, dv, *(None,) * 11


ATTENTION = opdef.define(
    _LIB,
    opdef.OpDef(
        name="attention",
        schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}) -> (Tensor, Tensor)",
        forward=forward,
        fake=_attention_fake,
        key=_fwd_key,
        impls=(*_with_cudnn("attn_fwd", cudnn.supports), _GLUON_FWD),
        tensor_args=(0, 1, 2, 3, 4, 10, 13),
        backward=opdef.BackwardDef(
            schema=f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}) "
            "-> (Tensor, Tensor, Tensor)",
            compute=backward,
            fake=_attention_backward_fake,
            save=_attention_save,
            grads=_attention_grads,
            key=_bwd_key,
            impls=(*_with_cudnn("attn_bwd", cudnn.supports_backward), _GLUON_BWD),
            non_differentiable=(1,),
        ),
    ),
)


# ---- learnable sinks: folded around the op ---------------------------------------------
# A sink is one more key per query head, logit sinks[h] and value 0 (reference.py). With L
# the row's logsumexp over its keys and share = sigmoid(L - sink), the sink's complement:
# out' = out * share, L' = logaddexp(L, sink), so every backend's kernels serve unchanged.
# The backward is the op's own on (dout * share, out', L): its probabilities are the plain
# ones, P = exp(s - L), and its delta rowsum(dout * share * out') = share^2 rowsum(dout *
# out), which makes dS = P (share dout.v - share^2 delta) = P' (dout.v - rowsum(dout * out'))
# with P' = share P, the softmax over keys and sink; whether a backend takes P from L or
# from the scores, and its delta from the out it is given. d sink = -sum over rows of
# (1 - share) rowsum(dout * out').


def _per_head(sinks: torch.Tensor, varlen: bool) -> torch.Tensor:
    """sinks (H,) laid out as lse: (B, H, S) dense, (H, T) varlen."""
    return sinks[:, None] if varlen else sinks[None, :, None]


def _per_row(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    """lse-shaped x as out's rows: (B, S, H, 1) dense, (T, H, 1) varlen."""
    return (x.transpose(0, 1) if varlen else x.transpose(1, 2)).unsqueeze(-1)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, varlen: bool):
    """(out', lse', share) of a call with sinks from (out, lse) of the call without them;
    share = sigmoid(lse - sink) (lse's layout and dtype: float32, float64 for float64 inputs),
    the keys' part of each row. The products run in share's dtype."""
    sink = _per_head(sinks, varlen)
    share = torch.sigmoid(lse - sink)
    folded = out.to(share.dtype) * _per_row(share, varlen)
    return folded.to(out.dtype), torch.logaddexp(lse, sink), share


class _WithSinks(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, dropout_p, seed
    ):
        out, plain_lse = forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, dropout_p,
                                 seed)  # fmt: skip
        out, lse, share = fold_sinks(out, plain_lse, sinks, cu_q is not None)
        ctx.save_for_backward(q, k, v, out, plain_lse, share, cu_q, cu_k, alibi, seed)
        ctx.options = (max_q, max_k, scale, left, right, softcap, dropout_p)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, plain_lse, share, cu_q, cu_k, alibi, seed = ctx.saved_tensors
        max_q, max_k, scale, left, right, softcap, dropout_p = ctx.options
        varlen = cu_q is not None
        dout = torch.zeros_like(out) if dout is None else dout
        scaled = (dout.to(share.dtype) * _per_row(share, varlen)).to(out.dtype)
        dq, dk, dv = backward(scaled, q, k, v, out, plain_lse, cu_q, cu_k, max_q, max_k, scale, left, right, alibi,
                              softcap, dropout_p, seed)  # fmt: skip
        delta = (dout.to(share.dtype) * out.to(share.dtype)).sum(-1)  # (B, S, H) or (T, H)
        delta = delta.transpose(0, 1) if varlen else delta.transpose(1, 2)  # as lse
        dsink = -((1 - share) * delta)
        dsink = dsink.sum(dim=1) if varlen else dsink.sum(dim=(0, 2))
        return dq, dk, dv, dsink, *(None,) * 11


def with_sinks(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, sinks, dropout_p=0.0,
               seed=None):  # fmt: skip
    """openkernels::attention with learnable sinks (float32 (heads_q,)): (out, lse) of the
    softmax over the keys and the sink; differentiable in q, k, v and sinks."""
    return _WithSinks.apply(q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, dropout_p,
                            seed)  # fmt: skip
