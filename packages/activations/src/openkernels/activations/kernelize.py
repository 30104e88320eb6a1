"""What `openkernels.shared.kernelize` swaps for this family: activation modules (torch's and
Hugging Face transformers') and the gated MLPs of Llama-style models.

A gated MLP computes down(act(gate(x)) * up(x)). The swap runs gate and up as one matmul
over the stacked weight [W_gate; W_up] (openkernels.shared.stacked) and the activation and
product as one fused `*_and_mul` kernel: one GEMM launch and one elementwise pass instead
of two and two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from openkernels.shared.kernelize import KernelizeContext, Swap, output_is_private
from openkernels.shared.stacked import (
    DeferredNorm,
    stack,
    stackable,
    stacked_forward,
    stacked_layer,
    stacked_normed_forward,
)

from .api import gelu, gelu_and_mul, gelu_quick, relu_squared, silu, silu_and_mul

__all__ = ["replacements", "GATED_MLPS", "DENSE_ACTS"]

_TORCH_ACT = "torch.nn.modules.activation"
_HF_ACT = "transformers.activations"

# Classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)).
GATED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP")

_GATE_UP = ("gate_proj", "up_proj")


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
    "gelu_tanh": functools.partial(gelu, approximate="tanh"),
    "gelu_quick": gelu_quick,
    "relu_squared": relu_squared,
}
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "gelu": gelu_and_mul,
    "gelu_tanh": lambda x: gelu_and_mul(x, approximate="tanh"),
}


_KIND = "_openkernels_activation"  # the fused function, found once at swap time (not per call)


# its name ("silu", ...), which a 4-bit down_proj's forward_gated takes
_KIND_NAME = "_openkernels_activation_name"


def _remember(module: nn.Module, table: dict[str, Callable], source: nn.Module) -> Callable[[], None]:
    kind = _act_kind(source)
    object.__setattr__(module, _KIND, table[kind])
    object.__setattr__(module, _KIND_NAME, kind)

    def forget() -> None:
        module.__dict__.pop(_KIND, None)
        module.__dict__.pop(_KIND_NAME, None)

    return forget


def _activation_prepare(module: nn.Module, ctx: KernelizeContext) -> Callable[[], None]:
    return _remember(module, _PLAIN, module)


def _activation_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.__dict__[_KIND](x)


def _activation_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    return None if _act_kind(module) else "an activation form without a fused kernel"


# ---------------------------------------------------------------------------- gated MLPs


def _gated_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    kind = _act_kind(module.act_fn)
    if kind not in _GATED:
        return f"act_fn {type(module.act_fn).__name__} has no fused *_and_mul kernel"
    return stackable([module.gate_proj, module.up_proj])


def _gated_prepare(mlp: nn.Module, ctx: KernelizeContext) -> Callable[[], None]:
    forget = _remember(mlp, _GATED, mlp.act_fn)
    if ctx.training:
        return forget  # training stacks per call, with gradients
    try:
        unstack = stack(mlp, _GATE_UP)
    except BaseException:  # a prepare that raises gets no undo step: clean up here
        forget()
        raise

    def undo() -> None:
        unstack()
        forget()

    return undo


def _gated_forward(
    self: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None, norm: DeferredNorm | None = None
) -> torch.Tensor:
    """down_proj(act(gate_proj(x)) * up_proj(x)), plus `residual` when given (the decoder
    layer's add, layernorm's decoder fusion): a 4-bit down_proj without hooks takes it as its
    kernel's bias at one row (Int4Linear.forward_add), any other adds it after. Where such a
    down_proj's GEMV computes act(gate) * up itself (Int4Linear.gated_fuses: a decode step on
    sm_90), the stacked gate / up output goes to it whole (forward_gated): one launch fewer.
    `norm` (the decoder fusion's post-attention norm, not yet applied to x): a stacked 4-bit
    gate / up GEMV computes it as it loads x (stacked_normed_forward), else it runs first."""
    if norm is not None:
        gate_up = stacked_normed_forward(self, _GATE_UP, x, norm)
    else:
        gate_up = stacked_forward(self, _GATE_UP, x)
    down = self.down_proj
    hooked = bool(down._forward_hooks or down._forward_pre_hooks)
    if not hooked and getattr(down, "forward_gated", None) is not None:
        kind = self.__dict__[_KIND_NAME]
        if down.gated_fuses(gate_up, kind):
            return down.forward_gated(gate_up, kind, residual)
    h = self.__dict__[_KIND](gate_up)
    if residual is None:
        return down(h)
    forward_add = getattr(down, "forward_add", None)
    if forward_add is not None and not hooked:
        return forward_add(h, residual)
    return residual + down(h)


def _prime_norm(mlp: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Let a stacked 4-bit gate / up layer decide, in an eager call, whether its GEMV takes the
    post-attention norm (Int4Linear.normed_fuses remembers it): a compiled decode step after an
    eager prefill reads that decision (the prefill's steps run the norm apart)."""
    fused = stacked_layer(mlp, _GATE_UP)
    if fused is not None and hasattr(fused, "normed_fuses"):
        fused.normed_fuses(x, weight)


_gated_forward.adds_residual = True  # decoder_fusion passes the residual in
_gated_forward.takes_decoder_norms = True  # ... and may defer the post-attention norm to it
_gated_forward.prime_norm = _prime_norm


# ---------------------------------------------------------------------------- dense + activation

# Classes whose forward is exactly intermediate_act_fn(dense(x)) (BERT-style encoders' FFN input).
DENSE_ACTS = ("BertIntermediate", "RobertaIntermediate", "XLMRobertaIntermediate", "ElectraIntermediate",
              "CamembertIntermediate", "MPNetIntermediate")  # fmt: skip


def _dense_act_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    act = getattr(module, "intermediate_act_fn", None)
    if not isinstance(act, nn.Module) or _act_kind(act) not in _PLAIN:
        return f"intermediate_act_fn {type(act).__name__} has no fused kernel"
    return None


def _dense_act_prepare(module: nn.Module, ctx: KernelizeContext) -> Callable[[], None]:
    return _remember(module, _PLAIN, module.intermediate_act_fn)


def _dense_act_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = self.dense(x)
    act = self.__dict__[_KIND]
    if (
        type(h) is torch.Tensor
        and h.is_contiguous()
        and not (h.requires_grad and torch.is_grad_enabled())
        and output_is_private(self.dense)
    ):
        # In place on the dense layer's fresh output, which nothing else holds: no second
        # activation-sized allocation (on the CPU its page faults cost as much as the pass).
        return act(h, out=h)
    return act(h)


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
        Swap(family, "dense_act", DENSE_ACTS, _dense_act_forward, check=_dense_act_check, prepare=_dense_act_prepare,
             covers_children=True),
        Swap(family, "activation", activations, _activation_forward, check=_activation_check,
             prepare=_activation_prepare),
    ]  # fmt: skip
