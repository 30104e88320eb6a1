"""What `openkernels.shared.kernelize` does for this family: with quantize="int4" / "nf4",
the model's nn.Linear layers become Int4Linear (quantize_model), before the module swaps so
a fused MLP stacks the 4-bit gate / up projections. unkernelize puts the 16-bit layers
back (they are kept, so a kernelized model holds both until then).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from openkernels.shared.kernelize import KernelizeContext, ModelPatch

from .linear import Int4Linear, quantize_model

__all__ = ["replacements"]

_OPTIONS = ("group_size", "symmetric", "search", "skip", "scale_dtype", "progress", "layout")


def _quantize(model: nn.Module, ctx: KernelizeContext) -> Callable[[], None] | None:
    if ctx.quantize is None:
        return None
    options = dict(ctx.quantize)
    kind = options.pop("kind")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"kernelize: unknown quantize options {unknown}; known: {', '.join(_OPTIONS)}")
    options["skip"] = (*options.get("skip", ("lm_head",)), *ctx.skip)
    options.setdefault("progress", False)
    originals = {name: m for name, m in model.named_modules(remove_duplicate=False) if type(m) is nn.Linear}
    try:
        report = quantize_model(model, kind=kind, **options)
    except BaseException:  # no undo step yet: put back the layers quantized before the error
        _restore(model, originals)
        raise
    for name in report.quantized:
        ctx.report.add_swap(f"quant.{kind}_linear", name)
    for name, reason in report.skipped:
        ctx.report.add_left(f"Linear left in 16-bit: {reason}", name)
    ctx.report.patched["quant.quantize_model"] = (
        f"{len(report.quantized)} layers, {report.bytes_before / 2**20:.1f} -> {report.bytes_after / 2**20:.1f} MiB"
    )
    _reserve_graph_scratch(model)

    return lambda: _restore(model, {name: originals[name] for name in report.quantized})


def _reserve_graph_scratch(model: nn.Module) -> None:
    """Decode steps run in compiled graphs / CUDA graphs: reserve their split-K scratch now,
    outside any graph, on each CUDA device that holds a quantized layer (else every launch
    there allocates and zeroes its own)."""
    devices = {b.device for m in model.modules() if isinstance(m, Int4Linear) for b in m.buffers()}
    for device in devices:
        if device.type == "cuda":
            from .triton import reserve_graph_scratch

            reserve_graph_scratch(device)


def _restore(model: nn.Module, originals: dict[str, nn.Module]) -> None:
    """Put each original layer back where another (an Int4Linear) took its place."""
    for name, module in originals.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if getattr(parent, child) is not module:
            setattr(parent, child, module)


def replacements() -> list[ModelPatch]:
    """The entry point `openkernels.kernelize` calls."""
    return [ModelPatch("quant", "quantize_model", _quantize, stage="before", modes=("inference",))]
