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
        # Arbitrary masks (padding) and dropout: SDPA, with K/V heads shared as GQA.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=is_causal and attention_mask is None and query.shape[2] > 1,
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


def register_with_transformers(name: str = NAME) -> None:
    """Register `hf_attention_forward` as `attn_implementation=name` in transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_attention_forward)
    try:  # the mask function a custom attention uses: SDPA's (None when no padding)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    except ImportError:  # older transformers build the mask themselves
        pass
