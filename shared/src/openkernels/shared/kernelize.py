"""kernelize: swap a model's norms, activations, MLPs, attention and (optionally) linear
layers for openkernels kernels, per instance and reversibly.

Families offer their replacements through their manifest's `kernelize` target (a function
returning `Swap` and `ModelPatch` objects; openkernels.shared.manifest); only the installed
families take part. A package outside this repository may still offer one through the
entry-point group `openkernels.kernelize`.

A module is swapped by giving the instance a subclass of its own class whose `forward` is
the family's fused one: parameters, buffers, hooks, `state_dict` keys and `isinstance`
stay as they were, and `unkernelize` puts the original class back. Model-level changes
(transformers' attention registry, int4 linear layers) are patches with an undo step.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "ENTRY_POINT_GROUP",
    "KernelizeReport",
    "ModelPatch",
    "Swap",
    "available_swaps",
    "kernelize",
    "kernelize_report",
    "local_tensor",
    "output_is_private",
    "unkernelize",
]

ENTRY_POINT_GROUP = "openkernels.kernelize"
MODES = ("inference", "training")
QUANTIZE_KINDS = ("int4", "nf4")
_STATE = "_openkernels_kernelize"
# Class names that look like something a family could replace; listed as "left" when not swapped.
_CANDIDATE_WORDS = ("Norm", "Activation", "GELU", "SiLU", "MLP", "Attention")


@dataclass(frozen=True)
class Swap:
    """One module replacement a family offers.

    - `classes`: the classes it replaces, by bare `__name__` ("LlamaRMSNorm") or qualified
      `module.qualname` ("torch.nn.modules.normalization.LayerNorm"), matched exactly;
      subclasses are not matched, since their forward may differ.
    - `forward`: the fused forward, called as `forward(module, *args, **kwargs)`.
    - `check`: optional `check(module, ctx)` -> None when the instance can be swapped, else
      the reason it cannot (recorded in the report as "left").
    - `prepare`: optional `prepare(module, ctx)` -> undo callable or None, run once at swap
      time (fused weights, cached constants).
    - `modes`: the kernelize modes it applies in.
    - `covers_children`: the swapped forward no longer calls the module's children (a fused
      MLP computes its activation itself), so they are not swapped on their own.
    """

    family: str
    name: str
    classes: tuple[str, ...]
    forward: Callable[..., Any]
    check: Callable[[nn.Module, KernelizeContext], str | None] | None = None
    prepare: Callable[[nn.Module, KernelizeContext], Callable[[], None] | None] | None = None
    modes: tuple[str, ...] = MODES
    covers_children: bool = False


@dataclass(frozen=True)
class ModelPatch:
    """A model-level change (attention registry, quantized linear layers).

    apply(model, ctx) -> undo callable or None; it adds what it did to ctx.report.
    stage: "before" runs before the module swaps (quantization, so a fused MLP sees the int4
        layers), "after" once they are done.
    """

    family: str
    name: str
    apply: Callable[[nn.Module, KernelizeContext], Callable[[], None] | None]
    stage: str = "after"
    modes: tuple[str, ...] = MODES


@dataclass
class KernelizeReport:
    """What kernelize did: swaps and patches per replacement, and what it left and why."""

    mode: str
    families: list[str]
    swapped: dict[str, list[str]] = field(default_factory=dict)  # "family.name" -> module names
    patched: dict[str, str] = field(default_factory=dict)  # "family.name" -> what it did
    left: dict[str, list[str]] = field(default_factory=dict)  # reason -> module names

    def add_swap(self, label: str, module_name: str) -> None:
        self.swapped.setdefault(label, []).append(module_name or "<model>")

    def add_left(self, reason: str, module_name: str) -> None:
        self.left.setdefault(reason, []).append(module_name or "<model>")

    @property
    def num_swapped(self) -> int:
        return sum(len(v) for v in self.swapped.values())

    def __str__(self) -> str:
        lines = [f"kernelize ({self.mode}, families: {', '.join(self.families) or 'none'})"]
        for label, names in sorted(self.swapped.items()):
            lines.append(f"  swapped {len(names):4d} x {label:<32} {_examples(names)}")
        for label, what in sorted(self.patched.items()):
            lines.append(f"  patched        {label:<32} {what}")
        for reason, names in sorted(self.left.items()):
            lines.append(f"  left    {len(names):4d} x {reason}: {_examples(names)}")
        return "\n".join(lines)


def _examples(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... (+{len(names) - limit})" if len(names) > limit else "")


@dataclass
class KernelizeContext:
    """What a family's check / prepare / patch sees."""

    mode: str
    device: torch.device | None
    quantize: dict[str, Any] | None
    report: KernelizeReport
    skip: tuple[str, ...] = ()

    @property
    def training(self) -> bool:
        return self.mode == "training"


@dataclass
class _State:
    report: KernelizeReport
    undo: list[Callable[[], None]]


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a DTensor (tensor parallelism: the shard a column-parallel layer
    multiplies with); any other tensor unchanged. Differentiable."""
    if t is not None and type(t).__name__ == "DTensor":
        return t.to_local()
    return t


def output_is_private(producer: nn.Module, *passers: nn.Module) -> bool:
    """Whether a swapped forward may overwrite what `producer` returned (then passed through
    `passers`, such as an eval-mode dropout) in place: the producer is a linear layer (an
    nn.Linear, or a module whose class sets `fresh_output = True`, as Int4Linear does), whose
    output is a new tensor, and no forward hook (the module's own or a global one) could have
    kept a reference to it. An nn.Identity dense, or a hook caching activations, would see its
    tensor overwritten."""
    from torch.nn.modules import module as torch_module

    if not (isinstance(producer, nn.Linear) or getattr(type(producer), "fresh_output", False)):
        return False
    if torch_module._global_forward_hooks:
        return False
    return not any(m._forward_hooks for m in (producer, *passers))


# ---------------------------------------------------------------------------- discovery


def _family_modules() -> dict[str, Callable[[], Iterable[Swap | ModelPatch]]]:
    """family name -> its replacements() function: the family manifests', then those of
    the `openkernels.kernelize` entry points of other packages."""
    from . import manifest

    found: dict[str, Callable[[], Iterable[Swap | ModelPatch]]] = {}
    for name, family in manifest.families().items():
        if family.kernelize is not None:
            found[name] = manifest.resolve(family.kernelize)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        try:
            found[ep.name] = ep.load()
        except ImportError:  # an entry point left behind by an uninstalled family
            continue
    return dict(sorted(found.items()))


def available_swaps(families: Iterable[str] | None = None) -> dict[str, list[Swap | ModelPatch]]:
    """The replacements each installed family offers, {family: [Swap | ModelPatch, ...]}.

    families: names to keep (None = every installed family); an unknown name is an error.
    """
    installed = _family_modules()
    if families is None:
        chosen = list(installed)
    else:
        chosen = list(dict.fromkeys(families))
        unknown = [f for f in chosen if f not in installed]
        if unknown:
            raise ValueError(
                f"kernelize: families {unknown} are not installed (installed: {', '.join(installed) or 'none'})"
            )
    return {name: list(installed[name]()) for name in chosen}


# ---------------------------------------------------------------------------- swapping

_SWAPPED_CLASSES: dict[tuple[type, str], type] = {}


def _swapped_class(cls: type, swap: Swap) -> type:
    """A subclass of cls with the swap's forward (one per class and swap, so torch.compile
    and isinstance see stable types)."""
    key = (cls, f"{swap.family}.{swap.name}")
    if key not in _SWAPPED_CLASSES:
        attrs = {
            "forward": swap.forward,
            "_openkernels_original_class": cls,
            "_openkernels_swap": key[1],
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        _SWAPPED_CLASSES[key] = type(cls.__name__, (cls,), attrs)
    return _SWAPPED_CLASSES[key]


def _swap_module(module: nn.Module, swap: Swap, ctx: KernelizeContext) -> Callable[[], None]:
    undo_prepare = swap.prepare(module, ctx) if swap.prepare else None
    original = type(module)
    module.__class__ = _swapped_class(original, swap)

    def undo() -> None:
        module.__class__ = original
        if undo_prepare is not None:
            undo_prepare()

    return undo


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or fnmatch.fnmatchcase(name, s) for s in skip)


def _normalize_quantize(quantize: str | dict[str, Any] | None, mode: str) -> dict[str, Any] | None:
    if quantize is None:
        return None
    options = {"kind": quantize} if isinstance(quantize, str) else dict(quantize)
    if not isinstance(options, dict) or options.get("kind", "int4") not in QUANTIZE_KINDS:
        raise ValueError(f"kernelize: quantize must be None, one of {QUANTIZE_KINDS} or a dict with 'kind'")
    options.setdefault("kind", "int4")
    if mode == "training":
        raise ValueError("kernelize: quantize is for mode='inference' (4-bit weights have no gradients)")
    return options


def kernelize(
    model: nn.Module,
    *,
    mode: str = "inference",
    device: torch.device | str | None = None,
    families: Iterable[str] | None = None,
    quantize: str | dict[str, Any] | None = None,
    skip: Iterable[str] = (),
) -> KernelizeReport:
    """Swap the model's norms, activations, MLPs and attention for openkernels kernels.

    model: any nn.Module; Hugging Face transformers models get attention through
        transformers' attention registry (attn_implementation "openkernels").
    mode: "inference" (fused weights where that saves a pass; gradients still correct if
        enabled) or "training" (only swaps with a backward; no quantization).
    device: move the model there first (None: leave it where it is). Kernelize after any
        .to() / dtype cast: fused weights follow the parameters at kernelize time.
    families: installed family names to use (None: all).
    quantize: None, "int4" / "nf4", or a dict of openkernels.quant.quantize_model options
        ({"kind": "int4", "group_size": 128, "skip": ("lm_head",)}): linear layers become
        4-bit weight-only layers (inference only). Needs openkernels-quant.
    skip: module names or glob patterns ("model.layers.0.*") left untouched.
    Returns a KernelizeReport (also kept on the model); `unkernelize(model)` undoes it all.
    Kernelizing a kernelized model is an error (unkernelize first).
    """
    if mode not in MODES:
        raise ValueError(f"kernelize: mode must be one of {MODES}, got {mode!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize: model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, _STATE, None) is not None:
        raise RuntimeError("kernelize: this model is already kernelized; call unkernelize(model) first")
    options = _normalize_quantize(quantize, mode)
    offered = available_swaps(families)
    if options is not None and "quant" not in offered:
        raise ValueError(
            "kernelize: quantize needs the openkernels-quant family (pip install openkernels-quant)"
        )
    if device is not None:
        device = torch.device(device)
        model.to(device)
    report = KernelizeReport(mode=mode, families=list(offered))
    ctx = KernelizeContext(mode=mode, device=device, quantize=options, report=report, skip=tuple(skip))
    undo: list[Callable[[], None]] = []
    patches = [
        p for items in offered.values() for p in items if isinstance(p, ModelPatch) and mode in p.modes
    ]
    swaps = [s for items in offered.values() for s in items if isinstance(s, Swap) and mode in s.modes]
    try:
        for patch in (p for p in patches if p.stage == "before"):
            _apply_patch(model, patch, ctx, undo)
        _apply_swaps(model, swaps, ctx, undo)
        for patch in (p for p in patches if p.stage != "before"):
            _apply_patch(model, patch, ctx, undo)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    object.__setattr__(model, _STATE, _State(report, undo))
    return report


def _apply_patch(model: nn.Module, patch: ModelPatch, ctx: KernelizeContext, undo: list) -> None:
    step = patch.apply(model, ctx)
    if step is not None:
        undo.append(step)


def _apply_swaps(model: nn.Module, swaps: list[Swap], ctx: KernelizeContext, undo: list) -> None:
    by_class: dict[str, list[Swap]] = {}
    for swap in swaps:
        for cls_name in swap.classes:
            by_class.setdefault(cls_name, []).append(swap)
    covered: list[str] = []  # prefixes of modules whose children a fused forward replaced
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in covered):
            continue
        cls = type(module)
        cls_name = cls.__name__
        offered = by_class.get(f"{cls.__module__}.{cls.__qualname__}", []) + by_class.get(cls_name, [])
        if _skipped(name, ctx.skip):
            if offered:
                ctx.report.add_left("skipped by request", name)
            continue
        if not offered:
            if any(word in cls_name for word in _CANDIDATE_WORDS) and not _has_children_swappable(module):
                ctx.report.add_left(f"no openkernels replacement for {cls_name}", name)
            continue
        reasons = []
        for swap in offered:
            reason = swap.check(module, ctx) if swap.check else None
            if reason is None:
                undo.append(_swap_module(module, swap, ctx))
                ctx.report.add_swap(f"{swap.family}.{swap.name}", name)
                if swap.covers_children:
                    covered.append(f"{name}." if name else "")
                break
            reasons.append(reason)
        else:
            ctx.report.add_left(f"{cls_name}: {'; '.join(reasons)}", name)


def _has_children_swappable(module: nn.Module) -> bool:
    """Containers (an attention block holding projections) are not themselves 'left'."""
    return any(True for _ in module.children())


def unkernelize(model: nn.Module) -> KernelizeReport:
    """Undo kernelize: original classes, attention implementation and linear layers back.
    Returns the report of the kernelize call it undid."""
    state = getattr(model, _STATE, None)
    if state is None:
        raise RuntimeError("unkernelize: this model was not kernelized")
    for step in reversed(state.undo):
        step()
    object.__delattr__(model, _STATE)
    return state.report


def kernelize_report(model: nn.Module) -> KernelizeReport | None:
    """The report of the kernelize call in effect on model, or None."""
    state = getattr(model, _STATE, None)
    return None if state is None else state.report


# `from openkernels.shared import kernelize` gives this module: calling it runs kernelize().
from . import _make_callable  # noqa: E402  (the end of the module: everything above is defined)

_make_callable(__name__)
