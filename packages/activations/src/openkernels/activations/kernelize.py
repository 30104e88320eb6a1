"""What `openkernels.shared.kernelize` swaps for this family: activation modules (torch's and
Hugging Face transformers') and the gated MLPs of Llama-style models.

A gated MLP computes down(act(gate(x)) * up(x)). The swap runs gate and up as one matmul
over the stacked weight [W_gate; W_up] and the activation and product as one fused
`*_and_mul` kernel: one GEMM launch and one elementwise pass instead of two and two.
In inference mode the stacked weight is built once and the gate / up parameters become
views of it (no extra memory; a state_dict hook hands out independent copies, so saving
works as before). With gradients enabled the stack is rebuilt per call, so gradients
reach the original parameters. 4-bit layers (openkernels.quant) stack through their
`concat_out` class method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openkernels.shared.kernelize import KernelizeContext, Swap, local_tensor

from .api import gelu, gelu_and_mul, gelu_quick, relu_squared, silu, silu_and_mul

__all__ = ["replacements", "GATED_MLPS"]

_TORCH_ACT = "torch.nn.modules.activation"
_HF_ACT = "transformers.activations"

# Classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)).
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP")

_FUSED = "_openkernels_gate_up"  # (weight, bias) or a stacked module, set outside nn.Module's registry


def _act_kind(act: nn.Module) -> str | None:
    """The fused activation a module computes: "silu", "gelu", "gelu_tanh", "gelu_quick",
    "relu_squared", or None when there is none."""
    cls = type(act)
    name = f"{cls.__module__}.{cls.__name__}"
    if name in (f"{_TORCH_ACT}.SiLU", f"{_HF_ACT}.SiLUActivation"):
        return "silu"
    if name == f"{_TORCH_ACT}.GELU":
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if name == f"{_HF_ACT}.GELUActivation":
        return "gelu"  # F.gelu or its erf form written out
    if name in (f"{_HF_ACT}.NewGELUActivation", f"{_HF_ACT}.FastGELUActivation", f"{_HF_ACT}.GELUTanh"):
        return "gelu_tanh"  # three spellings of the tanh approximation
    if name == f"{_HF_ACT}.QuickGELUActivation":
        return "gelu_quick"
    if name == f"{_HF_ACT}.ReLUSquaredActivation":
        return "relu_squared"
    return None


_PLAIN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu,
    "gelu": gelu,
    "gelu_tanh": lambda x: gelu(x, approximate="tanh"),
    "gelu_quick": gelu_quick,
    "relu_squared": relu_squared,
}
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu": gelu_and_mul,
    "gelu_tanh": lambda x: gelu_and_mul(x, approximate="tanh"),
}


def _activation_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _PLAIN[_act_kind(self)](x)


def _activation_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    return None if _act_kind(module) else "an activation form without a fused kernel"


# ---------------------------------------------------------------------------- gated MLPs


def _stackable(gate: nn.Module, up: nn.Module) -> str | None:
    if type(gate) is not type(up):
        return f"gate_proj and up_proj differ in type ({type(gate).__name__}, {type(up).__name__})"
    if type(gate) is nn.Linear:
        if gate.in_features != up.in_features or gate.weight.dtype != up.weight.dtype:
            return "gate_proj and up_proj differ in in_features or dtype"
        if (gate.bias is None) != (up.bias is None):
            return "only one of gate_proj and up_proj has a bias"
        return None
    if hasattr(type(gate), "concat_out"):
        return None
    return f"{type(gate).__name__} projections cannot be stacked"


def _gated_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    kind = _act_kind(module.act_fn)
    if kind not in _GATED:
        return f"act_fn {type(module.act_fn).__name__} has no fused *_and_mul kernel"
    return _stackable(module.gate_proj, module.up_proj)


def _stack_linear(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack gate / up into one weight (and bias) and point the parameters at its halves."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if local_tensor(gate.weight) is not gate.weight:
        # Tensor parallel: stack this rank's shards, leave the DTensor parameters alone.
        bias = None if gate.bias is None else torch.cat([local_tensor(gate.bias), local_tensor(up.bias)])
        return torch.cat([local_tensor(gate.weight), local_tensor(up.weight)]).detach(), bias
    n = gate.out_features
    with torch.no_grad():
        weight = torch.cat([gate.weight, up.weight])
        gate.weight.data, up.weight.data = weight[:n], weight[n:]
        bias = None
        if gate.bias is not None:
            bias = torch.cat([gate.bias, up.bias])
            gate.bias.data, up.bias.data = bias[:n], bias[n:]
    return weight, bias


def _still_stacked(mlp: nn.Module, fused: tuple[torch.Tensor, torch.Tensor | None]) -> bool:
    """False once .to() / a cast / load replaced the parameters' storage."""
    return (
        mlp.gate_proj.weight.data_ptr() == fused[0].data_ptr()
        and mlp.gate_proj.weight.dtype == fused[0].dtype
    )


def _independent_copies(module, state_dict, prefix, local_metadata) -> None:
    """state_dict hook: the stacked views become their own tensors, so savers that refuse
    shared storage (safetensors) or treat it as tied weights see what they saw before."""
    for key in (
        f"{prefix}gate_proj.weight",
        f"{prefix}up_proj.weight",
        f"{prefix}gate_proj.bias",
        f"{prefix}up_proj.bias",
    ):
        if key in state_dict:
            state_dict[key] = state_dict[key].clone()


def _gated_prepare(mlp: nn.Module, ctx: KernelizeContext) -> Callable[[], None] | None:
    if ctx.training:
        return None  # the stack is built per call, with gradients
    if type(mlp.gate_proj) is nn.Linear:
        fused: object = _stack_linear(mlp)
    else:
        fused = type(mlp.gate_proj).concat_out([mlp.gate_proj, mlp.up_proj])
    object.__setattr__(mlp, _FUSED, fused)
    hook = mlp._register_state_dict_hook(_independent_copies)

    def undo() -> None:
        hook.remove()
        mlp.__dict__.pop(_FUSED, None)

    return undo


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    fused = self.__dict__.get(_FUSED)
    grads = torch.is_grad_enabled() and any(p.requires_grad for p in self.gate_proj.parameters())
    if isinstance(fused, nn.Module):
        h = fused(x)
    elif fused is not None and not grads and (torch.compiler.is_compiling() or _still_stacked(self, fused)):
        h = F.linear(x, fused[0], fused[1])
    else:  # training, or the parameters moved since kernelize: stack per call
        gate, up = self.gate_proj, self.up_proj
        bias = None if gate.bias is None else torch.cat([local_tensor(gate.bias), local_tensor(up.bias)])
        h = F.linear(x, torch.cat([local_tensor(gate.weight), local_tensor(up.weight)]), bias)
    return self.down_proj(_GATED[_act_kind(self.act_fn)](h))


def replacements() -> list[Swap]:
    """The entry point `openkernels.kernelize` calls."""
    family = "activations"
    activations = (
        f"{_TORCH_ACT}.SiLU",
        f"{_TORCH_ACT}.GELU",
        f"{_HF_ACT}.SiLUActivation",
        f"{_HF_ACT}.GELUActivation",
        f"{_HF_ACT}.NewGELUActivation",
        f"{_HF_ACT}.FastGELUActivation",
        f"{_HF_ACT}.GELUTanh",
        f"{_HF_ACT}.QuickGELUActivation",
        f"{_HF_ACT}.ReLUSquaredActivation",
    )
    return [
        Swap(family, "gated_mlp", GATED_MLPS, _gated_forward, check=_gated_check, prepare=_gated_prepare,
             covers_children=True),
        Swap(family, "activation", activations, _activation_forward, check=_activation_check),
    ]  # fmt: skip
