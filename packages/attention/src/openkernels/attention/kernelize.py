"""What `openkernels.shared.kernelize` does for this family.

- A Hugging Face transformers model gets attn_implementation "openkernels" (hf.py) through
  transformers' attention registry; unkernelize sets the previous one back. Other models
  are left as they are (the report says so).
- The attention blocks of Llama, Mistral, Qwen2 and Qwen3 get a forward that runs q / k / v
  as one matmul over the stacked weights (inference) and the rotary embedding of q and k as
  one fused kernel (`apply_rotary`) instead of transformers' seven elementwise passes; the
  rest (cache update, the registered attention function, o_proj) is transformers' own
  sequence. It is matched to transformers' forward signature of 5.24 (a `cache` argument):
  other versions keep their forward and the report says why.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from openkernels.shared.kernelize import KernelizeContext, ModelPatch, Swap, local_tensor
from openkernels.shared.stacked import DeferredNorm, stack, stackable, stacked_forward, stacked_normed_forward

from .hf import NAME, register_with_transformers

__all__ = ["replacements", "ROTARY_ATTENTIONS"]

# Forward = transformers' LlamaAttention.forward (+ q_norm / k_norm for Qwen3, + a sliding
# window for Mistral / Qwen2 / Qwen3), checked line by line against 5.24's sources.
ROTARY_ATTENTIONS = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
_QKV = ("q_proj", "k_proj", "v_proj")
_SIGNATURE = ("self", "hidden_states", "position_embeddings", "attention_mask", "cache", "kwargs")


def _set_attention(model: nn.Module, ctx: KernelizeContext) -> Callable[[], None] | None:
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or config is None:
        ctx.report.add_left("attention: not a transformers model (no attention registry)", "")
        return None
    register_with_transformers()
    model.set_attn_implementation(NAME)
    if config._attn_implementation != NAME:  # transformers refused (a model without the registry)
        ctx.report.add_left(f"attention: {type(model).__name__} does not take a registered attention", "")
        return None
    ctx.report.patched["attention.attn_implementation"] = f"{previous!r} -> {NAME!r}"

    def undo() -> None:
        model.set_attn_implementation(previous or "eager")

    return undo


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(batch, seqlen, heads, head_dim) q and k rotated; the fused kernel when this family
    has it, else transformers' formula."""
    try:
        from .rotary.api import apply_rotary
    except ImportError:
        apply_rotary = None
    if apply_rotary is not None:
        return apply_rotary(q, k, cos, sin)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = q.shape[-1] // 2

    def rotate(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def _rotary_attention_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    params = tuple(inspect.signature(type(module).forward).parameters)
    if params != _SIGNATURE:
        return f"forward{params[1:]} is not transformers 5.24's attention forward"
    return stackable([getattr(module, name) for name in _QKV])


def _rotary_attention_prepare(module: nn.Module, ctx: KernelizeContext) -> Callable[[], None] | None:
    return None if ctx.training else stack(module, _QKV)


def _sliding_window(module: nn.Module) -> int | None:
    if type(module).__name__.startswith("Mistral"):
        return getattr(module.config, "sliding_window", None)
    return getattr(module, "sliding_window", None)


def _local_rows(projection: nn.Module) -> int:
    """The output features this rank computes: a 16-bit layer's rows of its weight's local
    part (under tensor parallelism the parameters are DTensors of the full shape); a 4-bit
    layer's out_features (it is built from this rank's shard). Not a 4-bit layer's `weight`:
    that property builds the weight, a copy of the codes on every call where they are tiled
    (0.08 ms of a 1B decode step on an H100)."""
    weight = projection._parameters.get("weight")
    if weight is not None:
        return local_tensor(weight).shape[0]
    rows = getattr(projection, "out_features", None)
    return rows if isinstance(rows, int) else local_tensor(projection.weight).shape[0]


def _rotates_in_attention(module: nn.Module, cache) -> bool:
    """Whether q and k go unrotated to the cache: an OpenKernelsStaticCache's layer hands back
    a StaticCachedKV handle, which only this family's attention reads, and that attention then
    rotates, appends and attends in one kernel on a decode step (one launch fewer per layer)."""
    if cache is None or getattr(module.config, "_attn_implementation", None) != NAME:
        return False
    layers = getattr(cache, "layers", None)
    idx = getattr(module, "layer_idx", None)
    if not isinstance(layers, list) or not isinstance(idx, int) or not 0 <= idx < len(layers):
        return False
    from .kvcache import hf as cache_hf

    return type(layers[idx]) is cache_hf.OpenKernelsStaticLayer


def _rotary_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache=None,
    openkernels_input_norm: DeferredNorm | None = None,
    openkernels_residual: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention forward (q / k / v stacked, the fused rotary). From layernorm's
    decoder fusion (takes_decoder_norms): `openkernels_input_norm`, the layer's input norm not
    yet applied to hidden_states (a stacked 4-bit q / k / v GEMV computes it as it loads x:
    stacked_normed_forward); `openkernels_residual`, added to o_proj's output (a 4-bit o_proj
    takes it as its kernel's bias at one row: Int4Linear.forward_add)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    q_size, k_size = _local_rows(self.q_proj), _local_rows(self.k_proj)
    if openkernels_input_norm is not None:
        qkv = stacked_normed_forward(self, _QKV, hidden_states, openkernels_input_norm)
    else:
        qkv = stacked_forward(self, _QKV, hidden_states)
    q, k, v = qkv.split([q_size, k_size, qkv.shape[-1] - q_size - k_size], dim=-1)
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3: RMSNorm over head_dim before the rotation
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    deferred = _rotates_in_attention(self, cache)
    if not deferred:
        q, k = _rotary(q, k, cos, sin)
    query_states, key_states, value_states = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        if deferred:  # the handle's attention rotates q and the new keys (kvcache/hf.py)
            if not hasattr(type(key_states), "rotary"):
                raise TypeError(f"{type(cache).__name__}.update returned {type(key_states).__name__}, not the static "
                                "layer's handle")  # fmt: skip
            key_states.rotary = (cos, sin)
    eager = sys.modules[type(self).__module__].eager_attention_forward  # transformers' default
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager)
    extra = {}
    if type(self).__name__ != "LlamaAttention":
        extra["sliding_window"] = _sliding_window(self)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **extra, **kwargs,
    )  # fmt: skip
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if openkernels_residual is None:
        return self.o_proj(attn_output), attn_weights
    o_proj = self.o_proj
    forward_add = getattr(o_proj, "forward_add", None)
    if forward_add is not None and not (o_proj._forward_hooks or o_proj._forward_pre_hooks):
        return forward_add(attn_output, openkernels_residual), attn_weights
    return openkernels_residual + o_proj(attn_output), attn_weights


_rotary_attention_forward.takes_decoder_norms = True  # layernorm's decoder fusion defers its norms to it


def replacements() -> list[Swap | ModelPatch]:
    """The entry point `openkernels.kernelize` calls."""
    return [
        Swap("attention", "qkv_rotary", ROTARY_ATTENTIONS, _rotary_attention_forward,
             check=_rotary_attention_check, prepare=_rotary_attention_prepare),
        ModelPatch("attention", "attn_implementation", _set_attention),
    ]  # fmt: skip
