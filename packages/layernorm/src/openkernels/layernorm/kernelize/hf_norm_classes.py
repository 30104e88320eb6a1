"""The transformers RMSNorm classes the kernels match, by the semantics of their forward."""

from __future__ import annotations

__all__ = ["GEMMA_STYLE_RMS_NORMS", "LLAMA_STYLE_RMS_NORMS"]

# weight * normalized(x).to(x.dtype), eps in `variance_epsilon`.
LLAMA_STYLE_RMS_NORMS = (
    "LlamaRMSNorm",
    "MistralRMSNorm",
    "MixtralRMSNorm",
    "Qwen2RMSNorm",
    "Qwen2MoeRMSNorm",
    "Qwen3RMSNorm",
    "Qwen3MoeRMSNorm",
)
# (normalized(x.float()) * (1 + weight.float())).to(x.dtype), eps in `eps`.
GEMMA_STYLE_RMS_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
