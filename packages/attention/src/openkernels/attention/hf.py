"""Hugging Face transformers attention function with SDPA's layout.

`hf_attention_forward` has the signature of transformers' attention-function registry
(`AttentionInterface`): query (batch, heads_q, seqlen_q, head_dim), key/value (batch,
heads_kv, seqlen_k, head_dim) -> (out (batch, seqlen_q, heads_q, head_dim), None). The
(B, H, S, D) inputs are read through transposed views (no copies). It runs the fused
kernel when the mask is causal or absent, with the module's attention dropout while it
trains (the op's own, drawn from torch's generator); an explicit attention_mask (padding)
goes to torch's SDPA, which takes arbitrary masks. Plain float32 attention on the CPU also
goes to SDPA (`_sdpa_is_faster`): the CPU backend runs the same aten kernel behind the op's
layout views. (On H100/H200, plain attention runs cuDNN's kernel through the attention op's
own dispatch, `cudnn.py`, for every caller.) A dispatch force / forbid turns the CPU rule off. `register_with_transformers()` makes
`attn_implementation="openkernels"` available.

With `OpenKernelsCache` (kvcache/hf.py) the key and value are `CachedKV` handles to a layer's
openkernels KV cache (16-bit, int8 or int4), the new tokens already appended: the queries
attend to it with `KVCache.attend` (attention_with_kvcache). That path is inference only and
takes no mask beyond the causal / sliding-window one it applies itself and a left padding
(a left-padded batch in generate(), passed on as cache_leftpad); a mask that hides any other
token raises NotImplementedError.

With `OpenKernelsStaticCache` (compileable) the key and value are `StaticCachedKV` handles: the
layer's preallocated storage, the new keys and values (not yet written) and the lengths
before them. One `attention_with_kvcache` call appends them and attends, so a compiled decode
step has no host read. transformers passes a materialized (batch, 1, new, max_seqlen) causal
mask with a static cache: eager calls check that it hides nothing beyond causality, the
window and a left padding (any other mask raises NotImplementedError); compiled calls cannot
read it on the host and trust it to be such a mask, taking each sequence's padding (its first
visible key) from it on the device. The padding goes on as cache_leftpad.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from openkernels.shared import dispatch
from openkernels.shared.platform import graph_capturing

from .core.api import attention
from .kvcache.api import (
    _kvcache_append_call,
    _kvcache_call,
    _kvcache_plan,
    attention_with_kvcache,
    check_token_rotary,
    fused_append_ready,
)
from .kvcache.cache import _call_signature, keep_plan, reusable_plan
from .kvcache.format import QuantizedKV
from .kvcache.hf import CachedKV, StaticCachedKV

__all__ = ["hf_attention_forward", "register_with_transformers", "NAME"]

NAME = "openkernels"


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (see the module docstring)."""
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", True))
    dropout = dropout if module is None or getattr(module, "training", False) else 0.0
    if isinstance(key, StaticCachedKV):
        out = _attend_static(query, key, value, attention_mask, dropout, scaling, bool(is_causal), sliding_window,
                             softcap)  # fmt: skip
        return out, None
    if isinstance(key, CachedKV):
        out = _attend_cached(query, key, value, attention_mask, dropout, scaling, bool(is_causal), sliding_window,
                             softcap)  # fmt: skip
        return out, None
    if attention_mask is not None:
        # Arbitrary masks (padding): SDPA, with K/V heads shared as GQA, its own dropout
        # included; SDPA has no softcap, so a capped model takes the same math written out.
        mask = attention_mask
        if softcap:
            out = _softcapped_attention(query, key, value, mask, dropout, scaling, float(softcap))
        else:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    if _sdpa_is_faster(query, key, is_causal, sliding_window, softcap):
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return out.transpose(1, 2), None
    # transformers' sliding window W lets a token see itself and the W - 1 before it.
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        causal=is_causal,  # aligned bottom-right: right for prefill and for decode with a cache
        softmax_scale=scaling, window=window, softcap=float(softcap or 0.0), dropout_p=float(dropout),
    )  # fmt: skip
    return out, None


def _sdpa_is_faster(query, key, is_causal, sliding_window, softcap) -> bool:
    """(B, H, S, D) query and key: would SDPA beat the op here? Plain float32 attention on
    the CPU, where the CPU backend runs the same aten flash kernel behind (B, S, H, D) views.
    (GPUs: the op's dispatch picks cuDNN itself where it is faster, cudnn.py.)"""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and not softcap
        and not sliding_window
        and (not is_causal or query.shape[2] == key.shape[2])  # SDPA's causal mask is top-left aligned
        and not dispatch.is_steered()  # a forced / forbidden implementation means: use dispatch
    )


def _check_handle(cache_name: str, query, key, value, dropout: float, new_tokens: int) -> None:
    """What both caches' handles require: key and value are the handle, no dropout, and the
    queries are the tokens the update just brought."""
    if value is not key:
        raise TypeError(f"hf_attention_forward: with {cache_name}, key and value must be the handle its update "
                        "returned")  # fmt: skip
    if dropout > 0:
        raise NotImplementedError(f"hf_attention_forward: {cache_name} is for inference; attention dropout (a module "
                                  "in training mode) is not supported")  # fmt: skip
    if query.shape[2] != new_tokens:
        raise ValueError(f"hf_attention_forward: {query.shape[2]} queries but the cache's update brought "
                         f"{new_tokens} new tokens; the queries must be those tokens")  # fmt: skip


def _attend_cached(
    query, key: CachedKV, value, attention_mask, dropout, scaling, is_causal, sliding_window, softcap
):
    """query (B, Hq, Sq, D) against the KV cache behind `key` (an OpenKernelsCache layer's handle,
    its Sq new tokens already appended) -> (B, Sq, Hq, D)."""
    _check_handle("OpenKernelsCache", query, key, value, dropout, key.new_tokens)
    cache = key.cache
    leftpad = None
    if attention_mask is not None:
        leftpad = _check_cache_mask(attention_mask, query.shape[2], max(cache.lengths), is_causal, sliding_window,
                                    left_padding=True)  # fmt: skip
    # transformers' sliding window W lets a token see itself and the W - 1 before it; queries sit
    # at the last Sq cached positions (bottom-right), each seeing the whole prefix.
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    return cache.attend(query.transpose(1, 2), causal=is_causal, softmax_scale=scaling, window=window,
                        softcap=float(softcap or 0.0), cache_leftpad=leftpad)  # fmt: skip


def _attend_static(
    query, key: StaticCachedKV, value, attention_mask, dropout, scaling, is_causal, sliding_window, softcap
):
    """query (B, Hq, Sq, D) against an OpenKernelsStaticCache layer: its new keys and values
    (B, Hkv, Sq, D) appended at the lengths before them and attended in one
    attention_with_kvcache call -> (B, Sq, Hq, D). No host read while compiling.

    A left-padded batch: the mask's first visible key of each sequence is its padding's end,
    passed on as cache_leftpad (computed on the device while compiling, where the mask is
    trusted to be transformers' causal one with a left padding; checked with one host read
    in eager calls). A prefill brings the padding itself, so its keys are appended first and
    attended after (cache_leftpad counts cached tokens); a decode step does both in one call.
    Inside a CUDA-graph capture, as while compiling: no host reads, the mask trusted."""
    _check_handle("OpenKernelsStaticCache", query, key, value, dropout, key.k_new.shape[2])
    layer = key.layer
    pad = None
    compiling = torch.compiler.is_compiling()
    tracing = compiling or graph_capturing(query.device)  # no host reads
    if attention_mask is not None:
        if compiling:  # (the compiler merges the layers' identical computations itself)
            pad = _leftpad_of(attention_mask)
        elif tracing:  # a captured step: the first layer's pad serves the others
            pad = _once_per_step(attention_mask, layer, ("leftpad",), lambda: _leftpad_of(attention_mask))
        else:
            options = ("check", query.shape[2], layer.max_seqlen, bool(is_causal), sliding_window)
            pad = _once_per_step(
                attention_mask, layer, options,
                lambda: _check_cache_mask(attention_mask, query.shape[2], layer.max_seqlen, is_causal, sliding_window,
                                          past=key.cache_seqlens[:1], name="OpenKernelsStaticCache",
                                          left_padding=True),
            )  # fmt: skip
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    options = dict(causal=is_causal, softmax_scale=scaling, window=window, softcap=float(softcap or 0.0))
    k_new, v_new = key.k_new.transpose(1, 2), key.v_new.transpose(1, 2)
    new = k_new.shape[1]
    q = query.transpose(1, 2)
    if key.rotary is not None:  # q and k_new came unrotated (kernelize's attention forward)
        cos, sin = key.rotary
        if compiling:  # what the layer's eager calls (the prefill, at least) found
            ready = getattr(layer, "fused_ready", False)
        else:
            ready = layer.fused_ready = fused_append_ready(q, layer.k_cache, new)
        if new == 1 and ready:  # a decode step
            return _attend_fused(q, key, layer, k_new, v_new, cos, sin, pad, options, tracing, compiling)
        from .rotary.api import apply_rotary

        if not tracing:
            check_token_rotary("OpenKernelsStaticCache", cos, sin, k_new)
        q, k_new = apply_rotary(q, k_new, cos, sin)
        query = q.transpose(1, 2)
    if pad is None:
        plan = host = None
        if not tracing:
            # The lengths the layer counts on the host (checked against the capacity by its
            # update): no device read here either; and the argument checks once per signature.
            host = layer.host_lengths_after(new)
            sig = _call_signature(q, k_new, v_new, options)
            plan = reusable_plan(layer.plans, sig, layer.k_cache, layer.v_cache, None)
            if plan is None:
                plan = _kvcache_plan("attention_with_kvcache", q, layer.k_cache, layer.v_cache, key.cache_seqlens,
                                     k_new, v_new, None, is_causal, scaling, window, None, options["softcap"], None,
                                     None, False, None, None, None)  # fmt: skip
                keep_plan(layer.plans, sig, plan)
        out, _ = _kvcache_call(
            q, layer.k_cache, layer.v_cache, key.cache_seqlens, k_new, v_new, None, is_causal, scaling, window, None,
            options["softcap"], None, None, False, host, check=not tracing, plan=plan,
        )  # fmt: skip
    else:
        seqlens = key.cache_seqlens
        if query.shape[2] > 1:  # the padding may be among the new tokens: append, then attend
            _append(layer, k_new, v_new, seqlens)
            seqlens, k_new, v_new = seqlens + new, None, None
        # A mask that hides every key gives the capacity: the kernels clamp the pad to the
        # cached tokens themselves (no launch per layer in a captured step); a checked call
        # takes it clamped, as the public function requires.
        if not tracing:
            pad = torch.minimum(pad, seqlens)
        out = attention_with_kvcache(query.transpose(1, 2), layer.k_cache, layer.v_cache, seqlens, k_new=k_new,
                                     v_new=v_new, cache_leftpad=pad, check=not tracing,
                                     **options)  # fmt: skip
    layer.advance(new)  # after the calls that read the lengths before it (update)
    return out


def _attend_fused(
    q, key: StaticCachedKV, layer, k_new, v_new, cos, sin, pad, options, tracing, compiling=False
):
    """`_attend_static`'s one-op path (kvcache.api.fused_append_ready): q (B, Sq, Hq, D) and
    k_new unrotated, rotated by the per-token cos / sin, k_new / v_new appended, attended, and
    the layer's device length advanced, in one call (on CUDA one attention launch and its
    split combine). Eager calls check the arguments once per signature (the layer's plans).
    Compiled: the length advances after the op (an add the compiler schedules), not in it: at
    batch 1 the lengths the op reads are the length itself, which a compiled graph may not
    also hand to the op as a tensor it mutates."""
    plan = host = None
    if not tracing:
        host = layer.host_lengths_after(k_new.shape[1])
        inner = _call_signature(q, k_new, v_new, options)
        sig = None if inner is None else ("fused", inner, cos.shape, cos.stride(), cos.dtype, pad is not None)
        plan = reusable_plan(layer.plans, sig, layer.k_cache, layer.v_cache, None)
        if plan is None:
            plan = _kvcache_plan("attention_with_kvcache", q, layer.k_cache, layer.v_cache, key.cache_seqlens,
                                 k_new, v_new, None, options["causal"], options["softmax_scale"], options["window"],
                                 None, options["softcap"], None, None, False, None, None, pad)  # fmt: skip
            check_token_rotary("OpenKernelsStaticCache", cos, key.rotary[1], k_new)
            keep_plan(layer.plans, sig, plan)
        if pad is not None:
            pad = torch.minimum(pad, key.cache_seqlens)
    # The length itself when it is the lengths' storage (batch 1) or a counter beside a copy.
    out, _ = _kvcache_append_call(
        q, layer.k_cache, layer.v_cache, key.cache_seqlens, k_new, v_new, cos, sin,
        None if compiling else layer.cumulative_length, options["causal"], options["softmax_scale"],
        options["window"], options["softcap"], pad, host, check=not tracing, plan=plan,
    )  # fmt: skip
    layer.advance(k_new.shape[1], on_device=compiling)
    return out


class _StepMemo(threading.local):
    """What a forward's first attention layer made of its mask, per options: transformers
    builds the mask once per forward and hands the same tensor to every layer, so the other
    layers take the first one's result instead of redoing it (a static-cache decode step of a
    16-layer model: 15 fewer mask checks, each a host read in eager calls or 6-8 small kernels
    in a captured CUDA graph). Per thread."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[weakref.ref, weakref.ref, int, Any]] = {}


_STEP_MEMO = _StepMemo()


def _once_per_step(mask: torch.Tensor, layer: Any, options: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), or the value it gave for this mask and options earlier in this forward. A
    forward ends where the layer that computed the value asks again (the next step), so a
    value never outlives its forward (nor, captured, its CUDA graph); another mask object, the
    same mask changed in place or other options compute again. Layer and mask are held weakly
    (a dropped cache is freed)."""
    entry = _STEP_MEMO.entries.get(options)
    if entry is not None:
        owner, ref, version, value = entry
        if owner() is not layer and ref() is mask and version == mask._version:
            return value
    value = compute()
    _STEP_MEMO.entries[options] = (weakref.ref(layer), weakref.ref(mask), mask._version, value)
    return value


def _leftpad_of(mask: torch.Tensor) -> torch.Tensor:
    """int32 (B,): each sequence's first key that any of its queries sees (the mask's width
    when none), from a (B, 1, Sq, Sk) boolean or additive mask, on the device."""
    visible = mask if mask.dtype == torch.bool else mask == 0
    seen = visible[:, 0].any(-2)
    return torch.where(seen.any(-1), seen.to(torch.int32).argmax(-1), mask.shape[-1]).to(torch.int32)


def _append(layer, k_new: torch.Tensor, v_new: torch.Tensor, cache_seqlens: torch.Tensor) -> None:
    """Write k_new, v_new (B, S, Hkv, D) into a static layer's storage at cache_seqlens."""
    k, v = layer.k_cache, layer.v_cache
    if isinstance(k, QuantizedKV):
        parts, bits, group = (k.data, v.data, k.scale, k.zero, v.scale, v.zero), k.bits, k.group_size
    else:
        parts, bits, group = (k, v, None, None, None, None), 16, k.shape[-1]
    torch.ops.openkernels.kvcache_append(
        *parts, k_new, v_new, cache_seqlens, None, None, None, False, bits, group
    )


def _check_cache_mask(
    mask,
    sq: int,
    sk: int,
    is_causal: bool,
    sliding_window: int | None,
    past=None,
    name: str = "OpenKernelsCache",
    left_padding: bool = False,
) -> torch.Tensor | None:
    """The cache path applies causality and the window itself, and every sequence sees all its
    cached tokens: a mask is accepted only when it says exactly that (transformers materializes
    such a mask when several new tokens meet a non-empty cache, and for every step with a static
    cache, whose mask spans its whole capacity sk with the queries at `past`), or, with
    left_padding, that and each sequence's first pad[b] tokens hidden (a left-padded batch in
    generate()): then it returns pad, int32 (batch,) on the mask's device (None when nothing is
    padded), for attention_with_kvcache's cache_leftpad. One device-to-host read."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and tuple(mask.shape[-2:]) == (sq, sk):
        visible = mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 = attend
        want = _causal_window_mask(sq, sk, is_causal, sliding_window, mask.device, past)
        pad = None
        if left_padding and mask.shape[1] == 1:
            # pad[b]: the first key any query of sequence b sees. Past a sliding window that
            # may be later than the padding's end; hiding the keys before it then hides
            # nothing the window did not: the same key set, the same result.
            seen = visible[:, 0].any(-2).to(torch.int32)  # (B, sk)
            pad = torch.where(seen.any(-1), seen.argmax(-1).to(torch.int32), sk).to(torch.int32)
            want = want & (torch.arange(sk, device=mask.device) >= pad[:, None])[:, None, None, :]
        if torch.equal(visible, want.expand_as(visible)):
            return pad if pad is not None and bool(pad.any()) else None
    raise NotImplementedError(
        f"hf_attention_forward: {name} does not support attention masks that hide tokens "
        f"({'other than a left padding' if left_padding else 'any padding, e.g. a left-padded batch'}): every sequence "
        "must see all its tokens. Generate such prompts one at a time, or use transformers' DynamicCache."
    )


def _causal_window_mask(sq: int, sk: int, is_causal: bool, sliding_window: int | None, device, past=None):
    """(sq, sk) bool, True = attend: the queries are positions past .. past + sq - 1 (default
    sk - sq: aligned bottom-right) and see keys up to the last of them (causal: up to their
    own), within transformers' sliding window. past: an int or a (1,) tensor on `device`."""
    past = sk - sq if past is None else past
    i = torch.arange(sq, device=device)[:, None] + past
    j = torch.arange(sk, device=device)[None, :]
    mask = j <= i if is_causal else (j < past + sq).expand(sq, sk)
    if sliding_window:
        mask = mask & (j > i - sliding_window)
    return mask


def _softcapped_attention(query, key, value, mask, dropout, scaling, softcap) -> torch.Tensor:
    """SDPA's math with scores capped before the mask (float32 scores); rows that see no key
    give 0. (B, H, S, D) in and out."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout > 0:
        p = F.dropout(p, dropout)
    return torch.matmul(p.to(value.dtype), value)


def register_with_transformers(name: str = NAME) -> None:
    """Register `hf_attention_forward` as `attn_implementation=name` in transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention_forward)
    try:  # the mask function a custom attention uses: SDPA's (None when no padding)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    except ImportError:  # older transformers build the mask themselves
        pass
