"""CPU backend of attention against a KV cache. An unquantized cache without rotary in the
call (what decoding on a CPU runs) goes to the C++ decode kernel (decode.py), one call for
the batch; the rest gathers each sequence's keys (dequantized) into the query's dtype, then
runs the family's CPU attention (PyTorch's CPU flash kernel or the blockwise path) on them.
Contract: reference.attention_kvcache_fwd."""

from __future__ import annotations

import torch

from openkernels.shared import replay

from ...core.cpu import attn_fwd, decode
from ..format import gather_kv
from ..reference import rotate

__all__ = ["attention_kvcache_fwd", "FORCE_PATH"]

# "decode" or "gather" to pin the path (tests); None: the decode kernel wherever it runs.
FORCE_PATH: str | None = None


def attention_kvcache_fwd(q, k_data, v_data, k_scale, k_zero, v_scale, v_zero, out, lse, cache_seqlens, block_table, rotary_cos,
            rotary_sin, *, seqlen_new, max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap,
            rotary_interleaved, bits, group_size, leftpad=None, k_residual=None, key_group=0) -> None:  # fmt: skip
    if leftpad is not None:  # the C++ kernel counts tokens from the pad (reference.py: slots filled)
        leftpad = torch.minimum(leftpad, cache_seqlens)
        cache_seqlens = cache_seqlens - leftpad
    if FORCE_PATH != "gather":
        why = decode.why_not(q, k_data, v_data, cache_seqlens, block_table, rotary_cos, bits=bits, key_group=key_group,
                             leftpad=leftpad)  # fmt: skip
        if why is None:
            decode.attend(q, k_data, v_data, out, lse, cache_seqlens, block_table, seqlen_new=seqlen_new, scale=scale,
                          window_left=window_left, window_right=window_right, alibi_slopes=alibi_slopes,
                          softcap=softcap, leftpad=leftpad)  # fmt: skip
            return
        if FORCE_PATH == "decode":
            raise ValueError(f"the CPU decode kernel does not run this call: {why}")
    sq = q.shape[1]
    replay.reads_host_values("cache_seqlens")  # values baked into a recording
    offsets = [0] * q.shape[0] if leftpad is None else leftpad.tolist()
    with torch.no_grad():
        for b, cached in enumerate(cache_seqlens.tolist()):
            length = cached + seqlen_new
            if length == 0:
                out[b].zero_()
                lse[b].fill_(float("-inf"))
                continue
            k, v = gather_kv((k_data, k_scale, k_zero), (v_data, v_scale, v_zero), b, length, block_table, bits=bits,
                             group_size=group_size, dtype=q.dtype, start=offsets[b], k_residual=k_residual,
                             key_group=key_group)  # fmt: skip
            qb = q[b]
            if rotary_cos is not None:
                pos = torch.arange(length - sq, length, device=q.device)
                qb = rotate(qb, pos, rotary_cos, rotary_sin, rotary_interleaved).to(q.dtype)
            attn_fwd(qb[None], k[None], v[None], out[b : b + 1], lse[b : b + 1], None, None, max_seqlen_q=sq,
                     max_seqlen_k=length, scale=scale, window_left=window_left, window_right=window_right,
                     alibi_slopes=None if alibi_slopes is None else alibi_slopes[b : b + 1],
                     softcap=softcap)  # fmt: skip
