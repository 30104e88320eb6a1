"""Hugging Face transformers attention function with SDPA's layout.

`hf_attention_forward` has the signature of transformers' attention-function registry
(`AttentionInterface`): query (batch, heads_q, seqlen_q, head_dim), key/value (batch,
heads_kv, seqlen_k, head_dim) -> (out (batch, seqlen_q, heads_q, head_dim), None). The
(B, H, S, D) inputs are read through transposed views (no copies). It runs the fused
kernel when the mask is causal or absent; an explicit attention_mask (padding) or dropout
goes to torch's SDPA, which takes arbitrary masks. `register_with_transformers()` makes
`attn_implementation="openkernels"` available.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .api import attention

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
    if attention_mask is not None or dropout > 0:
        # Arbitrary masks (padding) and dropout: SDPA, with K/V heads shared as GQA. Without a
        # mask, causality and the window become one (as the fused path applies them); SDPA
        # has no softcap, so a capped model takes the same math written out.
        mask = attention_mask
        if mask is None and (is_causal or sliding_window):
            mask = _causal_window_mask(query.shape[2], key.shape[2], is_causal, sliding_window, query.device)
        if softcap:
            out = _softcapped_attention(query, key, value, mask, dropout, scaling, float(softcap))
        else:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    # transformers' sliding window W lets a token see itself and the W - 1 before it.
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        causal=is_causal,  # aligned bottom-right: right for prefill and for decode with a cache
        softmax_scale=scaling, window=window, softcap=float(softcap or 0.0),
    )  # fmt: skip
    return out, None


def _causal_window_mask(sq: int, sk: int, is_causal: bool, sliding_window: int | None, device):
    """(sq, sk) bool, True = attend: causal aligned bottom-right, transformers' sliding window."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    mask = j <= i if is_causal else torch.ones(sq, sk, dtype=torch.bool, device=device)
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
