"""Stacked projections: linear layers that read the same input (q / k / v, gate / up) run as
one matmul over their stacked weights, for kernelize's fused modules.

In inference, `stack` builds the stacked weight once and points the layers' parameters at
its rows (no extra memory; a state_dict hook hands out independent copies, so savers that
refuse shared storage or treat it as tied weights see what they saw before). In-place
writes to the parameters (an optimizer step, `.copy_()`, `load_state_dict`) land in the
stack. With gradients enabled, or once a member was replaced (a parameter or its `.data`,
a whole projection module, `.to()`, a cast, load_state_dict with assign), `stacked_forward`
stacks per call, so gradients reach the original parameters and results never go stale.
Under tensor parallelism (DTensor parameters) each rank stacks a copy of its own shards;
4-bit layers stack through their class method `concat_out(layers)` (a copy too). A copy is
built again, once, when any of its members is replaced or written in place.

Freshness is checked per call from cheap identity marks of every member (the layer, and
each of its tensors' id, data_ptr and, for a copy, _version), a tuple compare.

`stacked_normed_forward` takes the input before a pre-norm decoder's RMSNorm (a `DeferredNorm`):
a stacked 4-bit layer whose GEMV computes the norm as it loads x (`normed_fuses`) runs both in
one launch; any other stack gets the norm module's output, as before.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .kernelize import local_tensor

__all__ = ["DeferredNorm", "stack", "stackable", "stacked_forward", "stacked_layer", "stacked_normed_forward"]


def _key(names: Sequence[str]) -> str:
    return "_openkernels_stacked_" + "_".join(names)


def stackable(layers: Sequence[nn.Module]) -> str | None:
    """None when the layers can run as one matmul, else the reason."""
    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers):
        return f"projections differ in type ({', '.join(type(layer).__name__ for layer in layers)})"
    if type(first) is nn.Linear:
        if any(layer.in_features != first.in_features for layer in layers):
            return "projections differ in in_features"
        if any(layer.weight.dtype != first.weight.dtype for layer in layers):
            return "projections differ in dtype"
        if any((layer.bias is None) != (first.bias is None) for layer in layers):
            return "only some projections have a bias"
        return None
    if hasattr(type(first), "concat_out"):  # 4-bit layers: their class says what it can stack
        refusal = getattr(type(first), "stack_refusal", None)
        return None if refusal is None else refusal(layers)
    return f"{type(first).__name__} projections cannot be stacked"


@dataclass(eq=False)
class _Stack:
    """A stacked weight and the marks of what it was built from."""

    fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module  # (weight, bias), or a concat_out layer
    views: bool  # the layers' parameters are views of its rows: in-place writes reach it
    marks: tuple[int, ...]
    refs: tuple[weakref.ref, ...]  # the marked objects: an id is only theirs while they live


def _members(layers: Sequence[nn.Module]) -> list:
    """The layers and their own parameters and buffers, in a fixed order."""
    found: list = []
    for layer in layers:
        found.append(layer)
        found += [t for t in (*layer._parameters.values(), *layer._buffers.values()) if t is not None]
    return found


def _marks(layers: Sequence[nn.Module], versions: bool) -> tuple[int, ...]:
    """Each layer's id; each of its tensors' id, data_ptr (changes with `.data =`, `.to()`, a
    cast) and, with `versions`, _version (bumped by in-place writes; a DTensor's data_ptr is 0).
    Reads the modules' dicts directly: nn.Module.__getattr__ costs ~1 us per name here."""
    marks: list[int] = []
    for layer in layers:
        marks.append(id(layer))
        for tensors in (layer._parameters, layer._buffers):
            for t in tensors.values():
                if t is not None:
                    marks += (id(t), t.data_ptr(), t._version if versions else 0)
    return tuple(marks)


def _stack_linears(
    layers: Sequence[nn.Linear], repoint: bool
) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, views): the stacked weight and bias; with `repoint`, the parameters
    become views of their rows (views=True), except DTensors, which stay as they are."""
    weights = [local_tensor(layer.weight) for layer in layers]
    biases = [local_tensor(layer.bias) for layer in layers]
    with torch.no_grad():
        weight = torch.cat(weights)
        bias = None if biases[0] is None else torch.cat(biases)
    if not repoint or weights[0] is not layers[0].weight:
        return weight, bias, False
    offset = 0
    for layer in layers:  # point each parameter at its rows of the stack
        n = layer.weight.shape[0]
        layer.weight.data = weight[offset : offset + n]
        if bias is not None:
            layer.bias.data = bias[offset : offset + n]
        offset += n
    return weight, bias, True


def _build(layers: Sequence[nn.Module], repoint: bool) -> _Stack:
    if type(layers[0]) is nn.Linear:
        weight, bias, views = _stack_linears(layers, repoint)
        fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module = (weight, bias)
    else:
        fused, views = type(layers[0]).concat_out(layers), False
    refs = tuple(weakref.ref(m) for m in _members(layers))
    return _Stack(fused, views, _marks(layers, versions=not views), refs)


def _own_storage(layers: Sequence[nn.Module], stacked: torch.Tensor) -> None:
    """Give parameters that are still rows of `stacked` their own storage again."""
    base = stacked.untyped_storage().data_ptr()
    for layer in layers:
        for p in layer._parameters.values():
            if p is not None and p.untyped_storage().data_ptr() == base:
                p.data = p.data.clone()


def stack(owner: nn.Module, names: Sequence[str]) -> Callable[[], None]:
    """Stack owner's projections `names` for inference; returns the undo step, which gives
    the parameters their own storage back."""
    key = _key(names)
    entry = _build([getattr(owner, name) for name in names], repoint=True)
    object.__setattr__(owner, key, entry)  # outside nn.Module's registry: not in state_dict

    def independent_copies(module, state_dict, prefix, local_metadata) -> None:
        for name in names:
            for part in ("weight", "bias"):
                full = f"{prefix}{name}.{part}"
                if full in state_dict and isinstance(state_dict[full], torch.Tensor):
                    state_dict[full] = state_dict[full].clone()

    hook = owner._register_state_dict_hook(independent_copies)

    def undo() -> None:
        hook.remove()
        current = owner.__dict__.pop(key, None)
        if current is not None and current.views:
            _own_storage([getattr(owner, name) for name in names], current.fused[0])

    return undo


def _fresh(entry: _Stack, layers: Sequence[nn.Module]) -> bool:
    return _marks(layers, not entry.views) == entry.marks and all(ref() is not None for ref in entry.refs)


def _run(fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module, x: torch.Tensor) -> torch.Tensor:
    return fused(x) if isinstance(fused, nn.Module) else F.linear(x, fused[0], fused[1])


def _unfused(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Stack per call (gradients reach the parameters), or run each projection when they no
    longer stack (a replaced module of another type)."""
    if type(layers[0]) is nn.Linear and stackable(layers) is None:
        bias = None if layers[0].bias is None else torch.cat([local_tensor(layer.bias) for layer in layers])
        return F.linear(x, torch.cat([local_tensor(layer.weight) for layer in layers]), bias)
    return torch.cat([layer(x) for layer in layers], dim=-1)


def stacked_forward(owner: nn.Module, names: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """The projections' outputs concatenated on the last dim, with one matmul."""
    key = _key(names)
    entry = owner.__dict__.get(key)
    layers = [owner._modules[name] for name in names]
    grads = torch.is_grad_enabled() and any(
        p is not None and p.requires_grad for layer in layers for p in layer._parameters.values()
    )
    if entry is not None and not grads:
        if torch.compiler.is_compiling() or _fresh(entry, layers):
            return _run(entry.fused, x)
        if not entry.views and stackable(layers) is None:  # a copy: build it again, once
            entry = _build(layers, repoint=False)
            object.__setattr__(owner, key, entry)
            return _run(entry.fused, x)
    return _unfused(layers, x)


class DeferredNorm(NamedTuple):
    """An RMSNorm a decoder layer has not applied yet: `module` (its kernelized norm, what runs
    where the projection does not take it) and the norm's terms, x * rsqrt(mean(x^2) + eps) *
    (weight + weight_offset)."""

    module: nn.Module
    weight: torch.Tensor
    eps: float
    weight_offset: float


def stacked_normed_forward(
    owner: nn.Module, names: Sequence[str], x: torch.Tensor, norm: DeferredNorm
) -> torch.Tensor:
    """stacked_forward(owner, names, norm.module(x)), in one launch where the stack is one 4-bit
    layer whose GEMV takes the norm (Int4Linear.normed_fuses)."""
    entry = owner.__dict__.get(_key(names))
    fused = None if entry is None else entry.fused
    if isinstance(fused, nn.Module) and hasattr(fused, "normed_fuses") and fused.normed_fuses(x, norm.weight):
        layers = [owner._modules[name] for name in names]
        if torch.compiler.is_compiling() or _fresh(entry, layers):
            return fused.forward_normed(x, norm.weight, norm.eps, norm.weight_offset)
    return stacked_forward(owner, names, norm.module(x))


def stacked_layer(owner: nn.Module, names: Sequence[str]) -> nn.Module | None:
    """The stack's own layer (a 4-bit layer's concat_out) while it is fresh, else None."""
    entry = owner.__dict__.get(_key(names))
    if entry is None or not isinstance(entry.fused, nn.Module):
        return None
    return entry.fused if _fresh(entry, [owner._modules[name] for name in names]) else None
