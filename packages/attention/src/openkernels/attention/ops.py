"""torch.library ops of the attention family and their dispatch registrations.

Library ops (one explicit schema each; op, fake, backward op, autograd, dispatch
registrations and eager fast paths from one `opdef` declaration each, at the end):
  openkernels::attention(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
                         softmax_scale, window_left, window_right, alibi_slopes?, softcap)
      -> (out, lse)
  openkernels::attention_backward(grad_out, q, k, v, out, lse, <the same options>)
      -> (grad_q, grad_k, grad_v)
Dense calls: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), lse (B, Hq, Sq). Varlen calls (the
cu_seqlens given, int32): q (Tq, Hq, D), k, v (Tk, Hkv, D), lse (Hq, Tq). out and the
gradients are contiguous, in the input dtype; lse is float32 (float64 for float64 inputs).
Causal is window_right = 0; -1 is an unbounded side. ALiBi slopes are not differentiated.
The backend contract (attn_fwd / attn_bwd on 4D views) is in reference.py.

The rotary ops (openkernels::apply_rotary) are in rotary/ops.py.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch, opdef

from . import cudnn, problem
from .problem import ATTENTION_HEAD_DIMS, HEAD_DIMS
from .reference import compute_dtype

__all__ = [
    "forward",
    "backward",
    "kvcache_append",
    "kvcache_forward",
    "ATTENTION",
    "KVCACHE_APPEND",
    "ATTENTION_KVCACHE",
    "KERNEL_DTYPES",
    "HEAD_DIMS",
    "ATTENTION_HEAD_DIMS",
]

_PKG = "openkernels.attention"
KERNEL_DTYPES = tuple(getattr(torch, name) for name in problem.KERNEL_DTYPES)  # what the Triton kernels take

_LIB = torch.library.Library("openkernels", "FRAGMENT")
_OPTIONS = (
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, "
    "int window_left, int window_right, Tensor? alibi_slopes, float softcap"
)
# Attention against a KV cache (inference only: no autograd). A cache side is data plus, for
# int8/int4 (bits 8/4), float16 scale and zero (kvformat.py); block_table pages it; keys by
# channel add k_residual and key_group.
_CACHE = "Tensor? k_scale, Tensor? k_zero, Tensor? v_scale, Tensor? v_zero"
_ROTARY = "Tensor? rotary_cos, Tensor? rotary_sin"


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """Kernels index any strides but need unit stride along head_dim."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def _as_4d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.unsqueeze(0) if varlen else t


def _slopes(alibi_slopes: torch.Tensor | None, n_seqs: int, heads: int) -> torch.Tensor | None:
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
        alibi_slopes=_slopes(alibi_slopes, _n_seqs(q, cu_seqlens_q), q.shape[-2]),
        softcap=softcap,
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
        alibi_slopes=_slopes(alibi_slopes, _n_seqs(q, cu_seqlens_q), q.shape[-2]),
        softcap=softcap,
    )
    return dq, dk, dv


def kvcache_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
    bits: int,
    group_size: int,
    cache_leftpad: torch.Tensor | None = None,
    k_residual: torch.Tensor | None = None,
    key_group: int = 0,
) -> None:
    """Write k_new/v_new (B, Sn, Hkv, D) into the cache at cache_seqlens (in place), from slot
    cache_leftpad[b] of sequence b's storage on (reference.py); key_group > 0: keys by
    channel, with k_residual (kvformat.py)."""
    if k_new.numel() == 0:
        return
    dispatch.run(
        "kvcache_append", k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, unit_last(k_new), unit_last(v_new),
        cache_seqlens, block_table, rotary_cos, rotary_sin, rotary_interleaved=rotary_interleaved, bits=bits,
        group_size=group_size, leftpad=cache_leftpad, k_residual=k_residual, key_group=key_group,
    )  # fmt: skip


def kvcache_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    k_zero: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    v_zero: torch.Tensor | None,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    seqlen_new: int,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    rotary_interleaved: bool,
    bits: int,
    group_size: int,
    cache_leftpad: torch.Tensor | None = None,
    k_residual: torch.Tensor | None = None,
    key_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, Sq, Hq, D) against the cache (the append already done); returns
    out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) float32."""
    q = unit_last(q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=compute_dtype(q.dtype), device=q.device)
    if out.numel() == 0:
        return out, lse
    dispatch.run(
        "attention_kvcache", q, k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens,
        block_table, rotary_cos, rotary_sin, seqlen_new=seqlen_new, max_seqlen_k=max_seqlen_k,
        scale=softmax_scale, window_left=window_left, window_right=window_right,
        alibi_slopes=_slopes(alibi_slopes, q.shape[0], q.shape[2]), softcap=softcap,
        rotary_interleaved=rotary_interleaved, bits=bits, group_size=group_size, leftpad=cache_leftpad,
        k_residual=k_residual, key_group=key_group,
    )  # fmt: skip
    return out, lse


# Selection depends on the query tensor, and on a GPU on whether the call is plain (cudnn.py:
# `dispatch.explain("attention", q, k, v, out, lse, None, None, **options)` says so; with q
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
    return cudnn.is_plain(q, k, v, cu_seqlens_q, options.get("alibi_slopes"), options.get("softcap", 0.0),
                          options.get("window_left", -1), options.get("window_right", -1), *tensors)  # fmt: skip


def _append_key(k_cache: torch.Tensor, v_cache, k_scale, k_zero, v_scale, v_zero, k_new: torch.Tensor, *args: object,
                **kwargs: object) -> dispatch.DispatchKey:  # fmt: skip
    return dispatch.key_for(k_new)


def _triton_supports(key: dispatch.DispatchKey) -> str | None:
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
    return (*_impls(entry, _triton_supports), opdef.Impl("cudnn", f"{_PKG}.cudnn:{entry}", ("cuda",), 30,
                                                         supports))  # fmt: skip


# ---- openkernels::attention ------------------------------------------------------------


def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *args):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, cu_seqlens_q is not None), dtype=compute_dtype(q.dtype), device=q.device)
    return out, lse


def _attention_backward_fake(grad_out, q, k, v, *args):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _attention_save(inputs: tuple, output: tuple) -> tuple[tuple, tuple]:
    q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap = inputs
    out, lse = output
    return (q, k, v, out, lse, cu_q, cu_k, alibi), (max_q, max_k, scale, left, right, softcap)


def _attention_grads(
    run, tensors: tuple, values: tuple, grad_outputs: tuple, needs: tuple[bool, ...]
) -> tuple:
    q, k, v, out, lse, cu_q, cu_k, alibi = tensors
    max_q, max_k, scale, left, right, softcap = values
    dq, dk, dv = run(
        grad_outputs[0], q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


ATTENTION = opdef.define(
    _LIB,
    opdef.OpDef(
        name="attention",
        schema=f"(Tensor q, Tensor k, Tensor v, {_OPTIONS}) -> (Tensor, Tensor)",
        forward=forward,
        fake=_attention_fake,
        key=_fwd_key,
        impls=_with_cudnn("attn_fwd", cudnn.supports),
        tensor_args=(0, 1, 2, 3, 4, 10),
        backward=opdef.BackwardDef(
            schema=f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {_OPTIONS}) "
            "-> (Tensor, Tensor, Tensor)",
            compute=backward,
            fake=_attention_backward_fake,
            save=_attention_save,
            grads=_attention_grads,
            key=_bwd_key,
            impls=_with_cudnn("attn_bwd", cudnn.supports_backward),
            non_differentiable=(1,),
        ),
    ),
)


# ---- openkernels::kvcache_append / attention_kvcache -------------------------------------


def _attention_kvcache_fake(q, *args):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(
        (q.shape[0], q.shape[2], q.shape[1]), dtype=compute_dtype(q.dtype), device=q.device
    )


# The cache ops: append has no CPU kernel of its own (the reference's indexed writes are it).
KVCACHE_APPEND = opdef.define(
    _LIB,
    opdef.OpDef(
        name="kvcache_append",
        schema="(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? k_zero, "
        "Tensor(e!)? v_scale, Tensor(f!)? v_zero, Tensor k_new, Tensor v_new, Tensor cache_seqlens, "
        f"Tensor? block_table, {_ROTARY}, bool rotary_interleaved, int bits, int group_size, "
        "Tensor? cache_leftpad=None, Tensor(g!)? k_residual=None, int key_group=0) -> ()",
        forward=kvcache_append,
        fake=lambda *args: None,
        key=_append_key,
        impls=_impls("kvcache_append_fwd", _triton_supports, cpu=None),
        tensor_args=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16),
    ),
)
ATTENTION_KVCACHE = opdef.define(
    _LIB,
    opdef.OpDef(
        name="attention_kvcache",
        schema=f"(Tensor q, Tensor k_cache, Tensor v_cache, {_CACHE}, Tensor cache_seqlens, Tensor? block_table, "
        f"{_ROTARY}, int seqlen_new, int max_seqlen_k, float softmax_scale, int window_left, int window_right, "
        "Tensor? alibi_slopes, float softcap, bool rotary_interleaved, int bits, int group_size, "
        "Tensor? cache_leftpad=None, Tensor? k_residual=None, int key_group=0) -> (Tensor, Tensor)",
        forward=kvcache_forward,
        fake=_attention_kvcache_fake,
        key=_fwd_key,
        impls=_impls("attention_kvcache_fwd", _triton_supports, cpu="cpu.kvcache"),
        tensor_args=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 21, 22),
    ),
)
