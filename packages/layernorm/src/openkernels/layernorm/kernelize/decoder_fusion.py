"""The residual add before a decoder layer's post-attention norm, fused into the norm.

A pre-norm decoder layer (Llama and its kin in transformers) does

    h = residual + attention(input_layernorm(residual))
    out = h + mlp(post_attention_layernorm(h))

and the add of `h` is its own pass over the hidden state (one kernel launch per layer at
decode). `rms_norm(attn, w, eps, residual=residual, prenorm=True)` returns both the norm of
the sum and the sum itself (rounded to the residual's dtype first, as the add does), so the
swapped forward does the add and the norm in one call. The add after the MLP goes to
kernelize's gated MLP forward when the MLP has it (activations' swap): a 4-bit down_proj
takes it as its kernel's bias at one row (a decode step at batch 1), one launch fewer again.

With kernelize's attention and gated MLP (their forwards say `takes_decoder_norms`) a decode
step goes further: the input norm goes to the attention un-applied, and a stacked 4-bit
q / k / v GEMV computes it as it loads x (up to 8 rows); at one row, the attention's residual
goes into a 4-bit o_proj's kernel (its bias) and the post-attention norm to the MLP un-applied,
for the stacked 4-bit gate / up GEMV. Where a projection does not take its norm (not 4-bit, not
sm_90, more rows, ...) the norm module runs first, as without this: never a launch more at one
row.

A class is swapped only when its forward is, statement for statement, the template below
(checked on its source, so a transformers release that changes the layer is left alone with
a reason). At call time the fused path is taken only when the post-attention norm was itself
kernelized (not skipped, not left) and has no hooks; otherwise the layer's own forward runs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn

from openkernels.shared.kernelize import KernelizeContext
from openkernels.shared.stacked import DeferredNorm

from ..api import rms_norm
from .hf_norm_classes import GEMMA_STYLE_RMS_NORMS, LLAMA_STYLE_RMS_NORMS

__all__ = ["DECODER_LAYERS", "decoder_check", "decoder_forward"]

DECODER_LAYERS = (
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "MixtralDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen2MoeDecoderLayer",
    "Qwen3DecoderLayer",
    "Qwen3MoeDecoderLayer",
    "GemmaDecoderLayer",
)
# The layer's forward body, with its attention call reduced to "self.self_attn(...)" when it
# passes every parameter of the layer through under its own name (checked apart).
_TEMPLATE = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    "hidden_states, _ = self.self_attn(...)",
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)


# class -> (parameter names after hidden_states, their defaults), filled by decoder_check: a
# plain dict, so that torch.compile reads it instead of tracing the source check.
_SIGNATURES: dict[type, tuple[tuple[str, ...], dict[str, object]]] = {}


def _layer_signature(cls: type) -> tuple[tuple[str, ...], dict[str, object]] | str:
    """(parameter names after hidden_states, their defaults) of cls.forward when its body is
    the template, else why not."""
    if cls in _SIGNATURES:
        return _SIGNATURES[cls]
    forward = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return "its forward's source is not readable"
    params = list(inspect.signature(forward).parameters.values())
    named = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if params[1:2] == [] or params[1].name != "hidden_states" or params[-1].kind != params[-1].VAR_KEYWORD:
        return "its forward's signature is not (hidden_states, ..., **kwargs)"
    body = []
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # docstring
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            call = stmt.value
            if ast.unparse(call.func) == "self.self_attn" and _passes_through(call, named):
                targets = ast.unparse(stmt).split(" = ", 1)[0]  # unparsed alone, a tuple gets parentheses
                body.append(f"{targets} = self.self_attn(...)")
                continue
        body.append(ast.unparse(stmt))
    if tuple(body) != _TEMPLATE:
        return "its forward is not the pre-norm template this fusion was checked against"
    names = tuple(p.name for p in named)
    defaults = {p.name: p.default for p in named if p.default is not p.empty}
    _SIGNATURES[cls] = names, defaults
    return names, defaults


def _passes_through(call: ast.Call, named: list[inspect.Parameter]) -> bool:
    """The attention call takes hidden_states, every named parameter of the layer under its
    own name, and **kwargs: nothing else."""
    if call.args:
        return False
    passed = set()
    for kw in call.keywords:
        if kw.arg is None:
            if ast.unparse(kw.value) != "kwargs":
                return False
        elif not (isinstance(kw.value, ast.Name) and kw.value.id == kw.arg):
            return False
        else:
            passed.add(kw.arg)
    return passed == {"hidden_states", *(p.name for p in named)}


def _norm_args(norm: nn.Module) -> tuple[float, float] | None:
    """(eps, weight_offset) of a norm class whose semantics the kernels match, else None."""
    name = type(norm).__name__
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if name in LLAMA_STYLE_RMS_NORMS and hasattr(norm, "variance_epsilon"):
        return float(norm.variance_epsilon), 0.0
    if name in GEMMA_STYLE_RMS_NORMS and hasattr(norm, "eps"):
        return float(norm.eps), 1.0
    return None


def decoder_check(module: nn.Module, ctx: KernelizeContext) -> str | None:
    found = _layer_signature(type(module))
    if isinstance(found, str):
        return found
    for child in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
        if not isinstance(getattr(module, child, None), nn.Module):
            return f"no {child} module"
    if _norm_args(module.post_attention_layernorm) is None:
        return f"post_attention_layernorm is a {type(module.post_attention_layernorm).__name__}"
    return None


def _fused_norm_ready(norm: nn.Module) -> bool:
    """The norm was kernelized (so the user asked for these kernels there) and nothing
    watches its call."""
    return (
        getattr(type(norm), "_openkernels_swap", None) is not None
        and not norm._forward_hooks
        and not norm._forward_pre_hooks
    )


def decoder_forward(self: nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    norm = self.post_attention_layernorm
    if not _fused_norm_ready(norm):
        return self._openkernels_original_class.forward(self, hidden_states, *args, **kwargs)
    names, defaults = _SIGNATURES[self._openkernels_original_class]  # decoder_check put it there
    passed = dict(defaults)
    passed.update(zip(names, args))
    if "past_key_values" in kwargs and "cache" in names and "cache" not in kwargs:
        # transformers >= 5.24 renamed the cache argument and still takes the old name.
        kwargs = dict(kwargs)
        kwargs["cache"] = kwargs.pop("past_key_values")
    passed.update(kwargs)
    residual = hidden_states
    attention, mlp = self.self_attn, self.mlp
    rows = hidden_states.numel() // max(hidden_states.shape[-1], 1)
    # (any rows: the q / k / v layer decides, and remembers for compiled steps, at a prefill too)
    defers = getattr(type(attention).forward, "takes_decoder_norms", False) and not (
        attention._forward_hooks or attention._forward_pre_hooks
    )
    input_norm = self.input_layernorm
    input_args = _norm_args(input_norm) if defers and _fused_norm_ready(input_norm) else None
    if input_args is not None:  # the q / k / v projection normalizes (or runs the module first)
        passed["openkernels_input_norm"] = DeferredNorm(input_norm, input_norm.weight, *input_args)
    else:
        hidden_states = input_norm(hidden_states)
    eps, weight_offset = _norm_args(norm)
    if (
        defers
        and rows == 1
        and getattr(getattr(attention, "o_proj", None), "forward_add", None) is not None
        and getattr(type(mlp).forward, "takes_decoder_norms", False)
        and not (mlp._forward_hooks or mlp._forward_pre_hooks)
    ):
        # a 4-bit o_proj adds the residual in its kernel; the gate / up projection normalizes
        h, _ = attention(hidden_states=hidden_states, openkernels_residual=residual, **passed)
        return mlp(h, residual=h, norm=DeferredNorm(norm, norm.weight, eps, weight_offset))
    attended, _ = attention(hidden_states=hidden_states, **passed)
    prime = getattr(type(mlp).forward, "prime_norm", None)
    if defers and prime is not None and not torch.compiler.is_compiling():
        prime(mlp, attended, norm.weight)  # for compiled one-row steps after this eager one
    h_dtype = torch.promote_types(residual.dtype, attended.dtype)  # what `residual + attended` gives
    # Llama-style norms return the promotion of input and weight dtypes, Gemma's the input's.
    out_dtype = torch.promote_types(h_dtype, norm.weight.dtype) if weight_offset == 0.0 else h_dtype
    hidden_states, residual = rms_norm(
        attended,
        norm.weight,
        eps,
        residual=residual,
        prenorm=True,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
        residual_dtype=h_dtype,
    )
    if getattr(type(mlp).forward, "adds_residual", False) and not (
        mlp._forward_hooks or mlp._forward_pre_hooks
    ):
        return mlp(hidden_states, residual=residual)  # kernelize's gated MLP: added in its down_proj
    return residual + mlp(hidden_states)
