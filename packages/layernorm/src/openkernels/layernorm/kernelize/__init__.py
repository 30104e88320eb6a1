"""What `openkernels.shared.kernelize` swaps for this family: torch's LayerNorm and RMSNorm,
the RMSNorm classes of Hugging Face transformers models, and their pre-norm decoder layers'
residual add before the post-attention norm (decoder_fusion).

Classes are matched by name, each one checked against its transformers source: the
Llama-style norms normalize in float32, round to the input dtype, then multiply by the
weight (output dtype: the promotion of input and weight); Gemma's multiply by (1 + weight)
in float32 and return the input dtype. The fused kernels keep float32 through the weight
multiply (one rounding fewer).
"""

from __future__ import annotations

import torch
from torch import nn

from openkernels.shared.kernelize import KernelizeContext, Swap, output_is_private

from ..api import layer_norm, rms_norm, torch_default_eps
from .decoder_fusion import DECODER_LAYERS, decoder_check, decoder_forward
from .hf_norm_classes import GEMMA_STYLE_RMS_NORMS, LLAMA_STYLE_RMS_NORMS

__all__ = ["replacements", "LLAMA_STYLE_RMS_NORMS", "GEMMA_STYLE_RMS_NORMS", "POST_NORM_OUTPUTS"]

# Post-norm block outputs, forward(h, input_tensor) = LayerNorm(dropout(dense(h)) + input_tensor):
# the residual add fuses into the norm (one pass over the hidden state instead of two).
POST_NORM_OUTPUTS = ("BertSelfOutput", "BertOutput", "RobertaSelfOutput", "RobertaOutput")


def _needs_1d_weight(module: nn.Module, ctx: KernelizeContext) -> str | None:
    weight = getattr(module, "weight", None)
    if weight is not None and weight.dim() != 1:
        return f"weight of shape {tuple(weight.shape)}: only the last dim is normalized"
    return None


def _layer_norm_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    if len(module.normalized_shape) != 1:
        return f"normalized_shape {tuple(module.normalized_shape)}: only the last dim is normalized"
    return None


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return layer_norm(x, self.weight, self.bias, self.eps)


def _torch_rms_norm_forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    eps = torch_default_eps(x.dtype) if self.eps is None else self.eps
    return rms_norm(x, self.weight, eps)


def _llama_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out_dtype = torch.promote_types(x.dtype, self.weight.dtype)
    return rms_norm(x, self.weight, self.variance_epsilon, out_dtype=out_dtype)


def _gemma_rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps, weight_offset=1.0)


def _post_norm_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    norm = getattr(module, "LayerNorm", None)
    if type(norm) is not nn.LayerNorm:
        return "its LayerNorm is not a torch LayerNorm"
    return _layer_norm_check(norm, ctx)


def _post_norm_forward(
    self: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor
) -> torch.Tensor:
    h = self.dropout(self.dense(hidden_states))
    norm = self.LayerNorm
    tensors = (h, input_tensor, norm.weight, norm.bias)
    if (
        type(h) is torch.Tensor
        and h.is_contiguous()
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))
        and output_is_private(self.dense, self.dropout)
    ):
        # In place on the dense layer's fresh output, which nothing else holds: no second
        # hidden-sized allocation (on the CPU its page faults cost about as much as the pass).
        return layer_norm(h, norm.weight, norm.bias, norm.eps, residual=input_tensor, out=h)
    return layer_norm(h, norm.weight, norm.bias, norm.eps, residual=input_tensor)


def replacements() -> list[Swap]:
    """The entry point `openkernels.kernelize` calls."""
    family = "layernorm"
    return [
        Swap(family, "add_rms_norm(decoder layer)", DECODER_LAYERS, decoder_forward, check=decoder_check),
        Swap(
            family,
            "add_layer_norm",
            POST_NORM_OUTPUTS,
            _post_norm_forward,
            check=_post_norm_check,
            covers_children=True,
        ),
        Swap(
            family,
            "layer_norm",
            ("torch.nn.modules.normalization.LayerNorm",),
            _layer_norm_forward,
            check=_layer_norm_check,
        ),
        Swap(
            family,
            "rms_norm",
            ("torch.nn.modules.normalization.RMSNorm",),
            _torch_rms_norm_forward,
            check=_layer_norm_check,
        ),
        Swap(family, "rms_norm", LLAMA_STYLE_RMS_NORMS, _llama_rms_norm_forward, check=_needs_1d_weight),
        Swap(
            family, "rms_norm(1 + w)", GEMMA_STYLE_RMS_NORMS, _gemma_rms_norm_forward, check=_needs_1d_weight
        ),
    ]
