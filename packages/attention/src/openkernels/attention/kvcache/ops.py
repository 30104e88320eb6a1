"""torch.library ops of attention against a KV cache, and their dispatch registrations.

  openkernels::kvcache_append(k_cache!, v_cache!, <scales!>, k_new, v_new, cache_seqlens,
                              block_table?, rotary_cos?, rotary_sin?, ...) -> ()
  openkernels::attention_kvcache(q, k_cache, v_cache, <scales>, cache_seqlens, block_table?,
                                 ..., seqlen_new, max_seqlen_k, <options>) -> (out, lse)
  openkernels::attention_kvcache_append(q, k_cache!, v_cache!, cache_seqlens, block_table?, k_new,
                                        v_new, token_cos?, token_sin?, advance!?, ...) -> (out, lse)
    (16-bit caches: the append, the attention and the length's advance in one call; the
    static cache's decode step)
Inference only (no autograd). A cache side is data plus, for int8/int4 (bits 8/4), float16
scale and zero (format.py); block_table pages it; keys by channel add k_residual and
key_group. The backend contract is in reference.py.
"""

from __future__ import annotations

import torch

from openkernels.shared import dispatch, opdef

from ..core.ops import alibi_layout, cpu_supports, triton_supports, unit_last
from ..core.reference import compute_dtype

__all__ = ["kvcache_append", "kvcache_forward", "kvcache_append_forward", "KVCACHE_APPEND", "ATTENTION_KVCACHE",
           "ATTENTION_KVCACHE_APPEND"]  # fmt: skip

_PKG = "openkernels.attention.kvcache"
_LIB = torch.library.Library("openkernels", "FRAGMENT")
_CACHE = "Tensor? k_scale, Tensor? k_zero, Tensor? v_scale, Tensor? v_zero"
_ROTARY = "Tensor? rotary_cos, Tensor? rotary_sin"


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
    """Write k_new/v_new (B, Sn, Hkv, D) into the cache from slot cache_seqlens[b] of sequence
    b's storage on (in place); with cache_leftpad its tokens (their rotary positions) count
    from slot min(cache_leftpad[b], cache_seqlens[b]) (reference.py); key_group > 0: keys by
    channel, with k_residual (format.py)."""
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
    out, lse = _outputs(q)
    if out.numel() == 0:
        return out, lse
    dispatch.run(
        "attention_kvcache", q, k_cache, v_cache, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens,
        block_table, rotary_cos, rotary_sin, seqlen_new=seqlen_new, max_seqlen_k=max_seqlen_k,
        scale=softmax_scale, window_left=window_left, window_right=window_right,
        alibi_slopes=alibi_layout(alibi_slopes, q.shape[0], q.shape[2]), softcap=softcap,
        rotary_interleaved=rotary_interleaved, bits=bits, group_size=group_size, leftpad=cache_leftpad,
        k_residual=k_residual, key_group=key_group,
    )  # fmt: skip
    return out, lse


def kvcache_append_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    token_cos: torch.Tensor | None,
    token_sin: torch.Tensor | None,
    advance: torch.Tensor | None,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    cache_leftpad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_new / v_new (B, Sn, Hkv, D) appended to the 16-bit cache, q (B, Sq, Hq, D) attended
    against it, then `advance` (an int32 tensor of one element) plus Sn; token_cos / token_sin
    (B or 1, Sn, R) rotate q and k_new per token first (Sq == Sn). Returns out (B, Sq, Hq, D)
    and lse (B, Hq, Sq) float32 (reference.attention_kvcache_append_fwd has the contract)."""
    q = unit_last(q)
    out, lse = _outputs(q)
    dispatch.run(
        "attention_kvcache_append", q, k_cache, v_cache, out, lse, cache_seqlens, block_table, unit_last(k_new),
        unit_last(v_new), token_cos, token_sin, advance, max_seqlen_k=max_seqlen_k, scale=softmax_scale,
        window_left=window_left, window_right=window_right,
        alibi_slopes=alibi_layout(alibi_slopes, q.shape[0], q.shape[2]), softcap=softcap, leftpad=cache_leftpad,
    )  # fmt: skip
    return out, lse


# Selection depends on the query tensor, and on a GPU on whether the call is plain (cudnn.py:
# `dispatch.explain("attention", q, k, v, out, lse, None, None, **options)` says so; with q


def _append_key(k_cache: torch.Tensor, v_cache, k_scale, k_zero, v_scale, v_zero, k_new: torch.Tensor, *args: object,
                **kwargs: object) -> dispatch.DispatchKey:  # fmt: skip
    return dispatch.key_for(k_new)


def _query_key(q: torch.Tensor, *args: object, **kwargs: object) -> dispatch.DispatchKey:
    return dispatch.key_for(q)


def _impls(entry: str, cpu: str | None) -> tuple[opdef.Impl, ...]:
    return opdef.standard_impls(
        _PKG, entry, triton_supports=triton_supports, cpu_supports=cpu_supports, cpu=cpu
    )


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) of an attention against the cache."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return out, torch.empty(
        (q.shape[0], q.shape[2], q.shape[1]), dtype=compute_dtype(q.dtype), device=q.device
    )


def _attention_kvcache_fake(q, *args):
    return _outputs(q)


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
        impls=_impls("kvcache_append_fwd", cpu=None),
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
        key=_query_key,
        impls=_impls("attention_kvcache_fwd", cpu="cpu"),
        tensor_args=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 21, 22),
    ),
)
ATTENTION_KVCACHE_APPEND = opdef.define(
    _LIB,
    opdef.OpDef(
        name="attention_kvcache_append",
        schema="(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? block_table, "
        "Tensor k_new, Tensor v_new, Tensor? token_cos, Tensor? token_sin, Tensor(c!)? advance, int max_seqlen_k, "
        "float softmax_scale, int window_left, int window_right, Tensor? alibi_slopes, float softcap, "
        "Tensor? cache_leftpad=None) -> (Tensor, Tensor)",
        forward=kvcache_append_forward,
        fake=_attention_kvcache_fake,
        key=_query_key,
        impls=_impls("attention_kvcache_append_fwd", cpu=None),
        tensor_args=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 16),
    ),
)
