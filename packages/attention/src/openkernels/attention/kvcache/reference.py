"""Reference attention against a KV cache: the append and the attention, per sequence, in
float32 through ../core/reference.py's attention.

Semantics (attention_with_kvcache; every backend follows them):
  append   k_new/v_new (B, Sn, Hkv, D) are written at positions cache_seqlens[b] + t of
           sequence b (rotary applied to k_new first), quantized when the cache is.
  keys     sequence b attends its first L_b = cache_seqlens[b] + Sn cache positions; query i
           of Sq sits at position L_b - Sq + i (bottom-right, as in `attention`), which is
           also its rotary position. A row that sees no key gives 0 and lse -inf.
  rotary   cos, sin (seqlen_ro, R / 2), R <= D even: the first R elements of each head rotate
           in float32, in halves (x[:R/2], x[R/2:R]) or interleaved pairs (x[2j], x[2j+1]);
           q is rounded back to its dtype, k_new is stored (or quantized) from float32.
  dequant  a quantized cache is read as code * scale + zero (format.py) in float32; an
           fp8 cache as code * scale, with one scale per KV head.
Kernels may round more: Triton's quantized path dequantizes to float16 and meets it with
q * softmax_scale rounded (and clamped) to float16, P in float16 (tests/kvcache_cases.py
bounds the difference).

Backend entry points:
  kvcache_append_fwd(k_data, v_data, k_scale, k_zero, v_scale, v_zero, k_new, v_new, cache_seqlens,
            block_table, rotary_cos, rotary_sin, *, rotary_interleaved, bits, group_size, leftpad)
  attention_kvcache_fwd(q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens,
          block_table, rotary_cos, rotary_sin, *, seqlen_new, scale, window_left,
          window_right, alibi_slopes, softcap, rotary_interleaved, bits, group_size, leftpad)
q, out (B, Sq, Hq, D); lse (B, Hq, Sq) float32; cache sides as in format.py, (B, S_cap,
Hkv, ·) or paged (P, page, Hkv, ·) with block_table (B, max_pages) int32; cache_seqlens
int32 (B,) (before the append: attention_kvcache_fwd adds seqlen_new); max_seqlen_k: a bound on every
cache_seqlens[b] + seqlen_new (for planning splits); scale/zero None for bits == 16; an fp8
cache (data float8_e4m3fn, bits 8) has scale float32 (Hkv,) and zero None;
alibi_slopes float32 (B, Hq) contiguous or None; leftpad int32 (B,) or None: the API's
cache_leftpad, with cache_seqlens counting storage slots, the padding included (FlashAttention's
convention): sequence b holds cache_seqlens[b] - p tokens, token t at slot p + t of its
storage, p = min(leftpad[b], cache_seqlens[b]) (the clamp: a mask that hides every key, in
hf.py). The callers check every other bound first.
"""

from __future__ import annotations

import torch

from openkernels.shared import replay

from ..core.reference import attend, compute_dtype
from .format import FP8, gather_kv, quantize_channels, quantize_fp8, quantize_unchecked, unpack_codes

__all__ = ["kvcache_append_fwd", "attention_kvcache_fwd", "attention_kvcache_append_fwd", "keys_by_channel",
           "rotate", "rotate_tokens", "token_spans"]  # fmt: skip


def rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """Rotary embedding of x (S, H, D) at `positions` (S,), float32 result."""
    half = cos.shape[-1]
    c = cos[positions].to(torch.float32)[:, None, :]
    s = sin[positions].to(torch.float32)[:, None, :]
    x = x.to(torch.float32).clone()
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2].clone(), x[..., 1 : 2 * half : 2].clone()
        x[..., 0 : 2 * half : 2] = x1 * c - x2 * s
        x[..., 1 : 2 * half : 2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., :half].clone(), x[..., half : 2 * half].clone()
        x[..., :half] = x1 * c - x2 * s
        x[..., half : 2 * half] = x2 * c + x1 * s
    return x


def rotate_tokens(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) rotated by per-token tables cos, sin (B or 1, S, R) as apply_rotary
    rotates (halves c1, c2 and s1, s2 each on their own half), in float32, rounded once to
    x's dtype."""
    half = cos.shape[-1] // 2
    c = cos.to(torch.float32)[:, :, None, :]
    s = sin.to(torch.float32)[:, :, None, :]
    xf = x.to(torch.float32)
    x1, x2 = xf[..., :half], xf[..., half : 2 * half]
    rotated = torch.cat(
        (x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), dim=-1
    )
    return torch.cat((rotated, xf[..., 2 * half :]), dim=-1).to(x.dtype)


def token_spans(cache_seqlens: torch.Tensor, leftpad: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(tokens, first slot) of each sequence, host ints, from the backends' cache_seqlens (storage
    slots filled) and leftpad (see the contract above). One device-to-host read each."""
    filled = cache_seqlens.tolist()
    if leftpad is None:
        return filled, [0] * len(filled)
    pads = [min(p, f) for p, f in zip(leftpad.tolist(), filled)]
    return [f - p for f, p in zip(filled, pads)], pads


def _cache_index(b: int, positions: torch.Tensor, block_table: torch.Tensor | None, page: int):
    """Index of sequence b's storage `positions` into a (B, S, ...) or (P, page, ...) tensor."""
    if block_table is None:
        return torch.full_like(positions, b), positions
    return block_table[b, positions // page].long(), positions % page


def kvcache_append_fwd(k_data, v_data, k_scale, k_zero, v_scale, v_zero, k_new, v_new, cache_seqlens, block_table,
              rotary_cos, rotary_sin, *, rotary_interleaved, bits, group_size, leftpad=None, k_residual=None,
              key_group=0) -> None:  # fmt: skip
    replay.reads_host_values("cache_seqlens")  # values baked into a recording
    lengths, offsets = token_spans(cache_seqlens, leftpad)
    for b, start in enumerate(lengths):
        pos = torch.arange(start, start + k_new.shape[1], device=k_new.device)
        idx = _cache_index(b, pos + offsets[b], block_table, k_data.shape[1])
        k = k_new[b].to(torch.float32)
        if rotary_cos is not None:
            k = rotate(k, pos, rotary_cos, rotary_sin, rotary_interleaved)
        sides = [(v_new[b], v_data, v_scale, v_zero)]
        if key_group:
            _append_keys_by_channel(
                k, b, start, k_data, k_scale, k_zero, k_residual, block_table, bits, key_group
            )
        else:
            sides.insert(0, (k, k_data, k_scale, k_zero))
        for x, data, sc, zr in sides:
            if bits == 16:
                data[idx] = x.to(data.dtype)
            elif data.dtype == FP8:  # the per-head scale stays as the cache was made
                data[idx] = quantize_fp8(x, sc)
            else:
                qx = quantize_unchecked(x, bits, group_size)
                data[idx], sc[idx], zr[idx] = qx.data, qx.scale, qx.zero


def _append_keys_by_channel(
    k, b, start, k_data, k_scale, k_zero, k_residual, block_table, bits, key_group
) -> None:
    """Keys k (n, Hkv, D) float32 of sequence b at positions start..start+n-1, by channel:
    rounded to float16, each group they fill quantized together with the residual rows
    before it, the rest written to the residual."""
    g, page = key_group, k_data.shape[1]
    k = k.to(torch.float16)
    end = start + k.shape[0]
    for first in range(start // g * g, end, g):
        last = min(first + g, end)
        rows = (k_residual[b, : start - first], k[max(first, start) - start : last - start])
        if last - first < g:  # incomplete: waits in the residual
            k_residual[b, max(first, start) - first : last - first] = rows[1]
            continue
        codes, sc, zr = quantize_channels(torch.cat(rows) if start > first else rows[1], bits)
        k_data[_cache_index(b, torch.arange(first, last, device=k.device), block_table, page)] = codes
        if block_table is None:
            at = (b, first // g)
        else:
            at = (int(block_table[b, first // page]), first % page // g)
        k_scale[at], k_zero[at] = sc, zr


def keys_by_channel(k: torch.Tensor, bits: int, key_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys k (..., S, Hkv, D), S a multiple of key_group, as a cache quantized by channel holds
    their full groups: rounded to float16, each group quantized as _append_keys_by_channel does,
    read back as code * scale + zero in float32. Returns (keys, code step), both (..., S, Hkv, D):
    what the tests check a cache's keys against and what the error studies measure, in one place."""
    groups = k.to(torch.float16).unflatten(-3, (-1, key_group))  # (..., S / g, g, Hkv, D)
    codes, scale, zero = quantize_channels(groups, bits)
    scale, zero = scale.to(torch.float32).unsqueeze(-3), zero.to(torch.float32).unsqueeze(-3)
    keys = unpack_codes(codes, bits).to(torch.float32) * scale + zero
    return keys.flatten(-4, -3), scale.expand_as(keys).flatten(-4, -3)


def attention_kvcache_fwd(q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens, block_table, rotary_cos,
            rotary_sin, *, seqlen_new, max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap,
            rotary_interleaved, bits, group_size, leftpad=None, k_residual=None, key_group=0) -> None:  # fmt: skip
    sq = q.shape[1]
    acc = compute_dtype(q.dtype)
    replay.reads_host_values("cache_seqlens")  # values baked into a recording
    lengths, offsets = token_spans(cache_seqlens, leftpad)
    with torch.no_grad():
        for b, cached in enumerate(lengths):
            length = cached + seqlen_new
            k, v = gather_kv((k_data, k_scale, k_zero), (v_data, v_scale, v_zero), b, length, block_table, bits=bits,
                             group_size=group_size, dtype=acc, start=offsets[b], k_residual=k_residual,
                             key_group=key_group)  # fmt: skip
            qb = q[b]
            if rotary_cos is not None:
                pos = torch.arange(length - sq, length, device=q.device)
                qb = rotate(qb, pos, rotary_cos, rotary_sin, rotary_interleaved).to(q.dtype)
            slopes = None if alibi_slopes is None else alibi_slopes[b]
            o, row_lse = attend(qb.to(acc), k, v, slopes, scale=scale, window_left=window_left,
                                 window_right=window_right, softcap=softcap)  # fmt: skip
            out[b].copy_(o)
            lse[b].copy_(row_lse)


def attention_kvcache_append_fwd(q, k_data, v_data, out, lse, cache_seqlens, block_table, k_new, v_new, token_cos,
                                 token_sin, advance, *, max_seqlen_k, scale, window_left, window_right, alibi_slopes,
                                 softcap, leftpad=None) -> None:  # fmt: skip
    """A 16-bit cache's append, attention and length advance in one call (the static cache's
    decode step; the Triton backend runs them in one or two launches): q and k_new rotated by
    the per-token tables token_cos / token_sin (B or 1, Sn, R) when given (query i and new
    token i share row i: Sq == Sn), k_new / v_new appended as kvcache_append_fwd appends
    them, the attention as attention_kvcache_fwd's with seqlen_new = Sn, then `advance` (an
    int32 tensor of one element, or None; it may be cache_seqlens itself) plus Sn."""
    if token_cos is not None:
        q, k_new = rotate_tokens(q, token_cos, token_sin), rotate_tokens(k_new, token_cos, token_sin)
    head_dim = q.shape[-1]
    kvcache_append_fwd(k_data, v_data, None, None, None, None, k_new, v_new, cache_seqlens, block_table, None, None,
                       rotary_interleaved=False, bits=16, group_size=head_dim, leftpad=leftpad)  # fmt: skip
    attention_kvcache_fwd(q, k_data, v_data, None, None, None, None, out, lse, cache_seqlens, block_table, None, None,
                          seqlen_new=k_new.shape[1], max_seqlen_k=max_seqlen_k, scale=scale, window_left=window_left,
                          window_right=window_right, alibi_slopes=alibi_slopes, softcap=softcap,
                          rotary_interleaved=False, bits=16, group_size=head_dim, leftpad=leftpad)  # fmt: skip
    if advance is not None:
        advance.add_(k_new.shape[1])
