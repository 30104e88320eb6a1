"""Stacked projections: linear layers that read the same input (q / k / v, gate / up) run as
one matmul over their stacked weights, for kernelize's fused modules.

In inference, `stack` builds the stacked weight once and points the layers' parameters at
its rows (no extra memory; a state_dict hook hands out independent copies, so savers that
refuse shared storage or treat it as tied weights see what they saw before). With gradients
enabled, or once the parameters were replaced (.to(), a cast, load_state_dict with assign),
`stacked_forward` stacks per call, so gradients reach the original parameters and results
never go stale. Under tensor parallelism (DTensor parameters) each rank stacks its own
shards. 4-bit layers stack through their class method `concat_out(layers)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .kernelize import local_tensor

__all__ = ["stack", "stackable", "stacked_forward"]


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
    if hasattr(type(first), "concat_out"):
        return None
    return f"{type(first).__name__} projections cannot be stacked"


def _stack_linears(layers: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    weights = [local_tensor(layer.weight) for layer in layers]
    biases = [local_tensor(layer.bias) for layer in layers]
    with torch.no_grad():
        weight = torch.cat(weights)
        bias = None if biases[0] is None else torch.cat(biases)
    if weights[0] is not layers[0].weight:  # DTensor: keep the distributed parameters as they are
        return weight, bias
    offset = 0
    for layer in layers:  # point each parameter at its rows of the stack
        n = layer.weight.shape[0]
        layer.weight.data = weight[offset : offset + n]
        if bias is not None:
            layer.bias.data = bias[offset : offset + n]
        offset += n
    return weight, bias


def stack(owner: nn.Module, names: Sequence[str]) -> Callable[[], None]:
    """Stack owner's projections `names` for inference; returns the undo step."""
    layers = [getattr(owner, name) for name in names]
    if type(layers[0]) is nn.Linear:
        fused: object = _stack_linears(layers)
    else:
        fused = type(layers[0]).concat_out(layers)
    key = _key(names)
    object.__setattr__(owner, key, fused)  # outside nn.Module's registry: not in state_dict

    def independent_copies(module, state_dict, prefix, local_metadata) -> None:
        for name in names:
            for part in ("weight", "bias"):
                full = f"{prefix}{name}.{part}"
                if full in state_dict and isinstance(state_dict[full], torch.Tensor):
                    state_dict[full] = state_dict[full].clone()

    hook = owner._register_state_dict_hook(independent_copies)

    def undo() -> None:
        hook.remove()
        owner.__dict__.pop(key, None)

    return undo


def _still_stacked(first: nn.Module, weight: torch.Tensor) -> bool:
    """False once .to() / a cast / a load replaced the parameters' storage."""
    if local_tensor(first.weight) is not first.weight:
        return True  # a DTensor's shards were copied at stack time
    return first.weight.data_ptr() == weight.data_ptr() and first.weight.dtype == weight.dtype


def stacked_forward(owner: nn.Module, names: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    """The projections' outputs concatenated on the last dim, with one matmul."""
    fused = owner.__dict__.get(_key(names))
    if isinstance(fused, nn.Module):
        return fused(x)
    layers = [getattr(owner, name) for name in names]
    grads = torch.is_grad_enabled() and any(p.requires_grad for layer in layers for p in layer.parameters())
    if (
        fused is not None
        and not grads
        and (torch.compiler.is_compiling() or _still_stacked(layers[0], fused[0]))
    ):
        return F.linear(x, fused[0], fused[1])
    bias = None if layers[0].bias is None else torch.cat([local_tensor(layer.bias) for layer in layers])
    return F.linear(x, torch.cat([local_tensor(layer.weight) for layer in layers]), bias)
