"""What `openkernels.shared.kernelize` does for this family: a Hugging Face transformers
model gets attn_implementation "openkernels" (hf.py: the fused kernel for causal and
unmasked attention, SDPA for padding masks and dropout) through transformers' attention
registry; unkernelize sets the previous implementation back. Other models are left as
they are (the report says so).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from openkernels.shared.kernelize import KernelizeContext, ModelPatch

from .hf import NAME, register_with_transformers

__all__ = ["replacements"]


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


def replacements() -> list[ModelPatch]:
    """The entry point `openkernels.kernelize` calls."""
    return [ModelPatch("attention", "attn_implementation", _set_attention)]
