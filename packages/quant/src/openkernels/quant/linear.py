"""nn.Module front end: Int4Linear, whole-model quantization, safetensors save and load.

Int4Linear keeps the weight's parts as buffers (qweight, scales, and zeros / perm when the
weight has them) plus an optional float bias parameter, so `state_dict()` round-trips and
`torch.compile(fullgraph=True)` traces straight into openkernels::int4_linear. Loading a state
dict checks every tensor's shape and dtype against the module's format and names the tensor
that does not match (torch's default would silently cast an int32 qweight to uint8).

Under tensor parallelism (transformers' tp_plan: DTensor weights, a ColwiseParallel /
RowwiseParallel forward hook on each layer) quantize_model quantizes each rank's shard and
hooks the Int4Linear the same way (_tp_layout, _quantize_shard).
"""

from __future__ import annotations

import fnmatch
import inspect
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from . import problem
from .api import gated_linear_parts, linear_parts, normed_linear_parts
from .format import (
    KINDS,
    LAYOUT_VERSIONS,
    LAYOUTS,
    Int4Weight,
    check_parts,
    check_perm_values,
    check_scale_values,
    codes_shape,
    layout_refusal,
    rows_of,
    tile_codes,
)
from .quantize import quantize_int4, quantize_nf4

__all__ = [
    "Int4Linear",
    "QuantizeReport",
    "quantize_model",
    "save_quantized",
    "load_quantized",
    "use_tiled_codes",
]

_FORMAT_KEY = "openkernels.quant"
# save_quantized's metadata: version 1 (every layer's codes in rows), version 2 (since quant
# 0.10.15: a layer may record "layout" and "layout_version"; written where a layer is tiled, so
# that a reader before it refuses the file instead of misreading the codes).
_FORMAT_VERSIONS = (1, 2)


class Int4Linear(nn.Module):
    """y = x @ W^T + bias with a 4-bit W (format.py); x (..., in_features) float16 / bfloat16
    (GPU kernels) or float32 / float64, y (..., out_features) in x's dtype.

    `layout` (format.LAYOUTS): how the codes buffer `qweight` is stored. "rows" (N, K // 2),
    the default, is what every backend reads. "tiled" (N // 16, K // 128, 1024; out_features a
    multiple of 16, in_features of 128) is format.tile_codes' layout, which the tensor-core
    GEMV reads directly (NVIDIA sm_90, 1-16 rows of x, no autograd: decoding), 3-8% faster than
    the rows at one row (H100, docs/perf.md); every other call converts the codes to rows first
    (a pass over them per call, with one warning per layer shape). save_quantized records the
    layout; load_quantized restores it or converts to the one asked for."""

    # Each forward returns a new tensor: kernelize's swaps may write over it in place
    # (openkernels.shared.kernelize.output_is_private).
    fresh_output = True

    layout = "rows"  # instances set their own; this default covers modules pickled before it

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group_size: int | None = 128,
        kind: str = "int4",
        symmetric: bool = False,
        act_order: bool = False,
        scale_dtype: torch.dtype = torch.float16,
        bias_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        layout: str = "rows",
    ) -> None:
        super().__init__()
        group_size = problem.resolve_group_size(group_size, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.group_size, self.kind = group_size, kind
        groups = in_features // group_size if group_size else 0
        rows = torch.empty((out_features, in_features // 2), dtype=torch.uint8, device="meta")
        scales = torch.ones((groups, out_features), dtype=scale_dtype, device=device)
        zeros = None if symmetric or kind == "nf4" else torch.full_like(scales, 8.0)
        perm = torch.arange(in_features, device=device) if act_order else None
        meta = lambda t: None if t is None else t.to("meta")  # noqa: E731 - the checks read shapes only
        check_parts(rows, meta(scales), meta(zeros), group_size, kind, meta(perm), in_features=in_features,
                    where="Int4Linear")  # fmt: skip
        refusal = layout_refusal(layout, out_features, in_features)
        if refusal is not None:
            raise ValueError(f"Int4Linear: {refusal}")
        self.layout = layout
        qweight = torch.zeros(
            codes_shape(layout, out_features, in_features), dtype=torch.uint8, device=device
        )
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("perm", perm)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device)) if bias else None

    @classmethod
    def from_weight(
        cls, weight: Int4Weight, bias: Tensor | None = None, *, layout: str = "rows"
    ) -> Int4Linear:
        """Wrap an Int4Weight (and an optional (N,) bias, kept in its dtype); `layout`: how the
        module stores the codes (the class docstring; "tiled" converts them once, here)."""
        module = cls(weight.in_features, weight.out_features, bias is not None, group_size=weight.group_size,
                     kind=weight.kind, symmetric=weight.zeros is None, act_order=weight.perm is not None,
                     scale_dtype=weight.scales.dtype, device="meta", layout=layout)  # fmt: skip
        module.qweight, module.scales, module.zeros, module.perm = (
            tile_codes(weight.qweight) if layout == "tiled" else weight.qweight,
            weight.scales,
            weight.zeros,
            weight.perm,
        )
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return module

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group_size: int | None = 128,
        kind: str = "int4",
        symmetric: bool = False,
        search: str | None = None,
        scale_dtype: torch.dtype | None = None,
        layout: str = "rows",
    ) -> Int4Linear:
        """Quantize an nn.Linear's weight (on its device); the bias is copied unchanged. Scales
        (and zeros) in `scale_dtype`, by default the weight's dtype where it is 16-bit, else
        float16 (scale_dtype_for). `layout`: how the codes are stored (the class docstring)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        refusal = layout_refusal(layout, linear.out_features, linear.in_features)
        if refusal is not None:  # before the quantization's work
            raise ValueError(f"from_linear: {refusal}")
        q = _quantize_weight(linear.weight.detach(), group_size, kind, symmetric, search, scale_dtype)
        return cls.from_weight(q, linear.bias, layout=layout)

    @classmethod
    def stack_refusal(cls, layers: Sequence[Int4Linear]) -> str | None:
        """None when `concat_out(layers)` can stack the layers, else why not (kernelize then
        runs each projection on its own)."""
        first = layers[0]
        for layer in layers:
            if not isinstance(layer, Int4Linear):
                return f"expected Int4Linear layers, got {type(layer).__name__}"
            same = (layer.in_features, layer.group_size, layer.kind, layer.zeros is None, layer.scales.dtype,
                    layer.layout)  # fmt: skip
            if same != (
                first.in_features,
                first.group_size,
                first.kind,
                first.zeros is None,
                first.scales.dtype,
                first.layout,
            ):
                return "layers differ in in_features, group size, kind, symmetry, scale dtype or layout"
            if layer.perm is not None:
                return "act-order layers (perm) cannot be stacked"
            if (layer.bias is None) != (first.bias is None):
                return "only some layers have a bias"
        return None

    @classmethod
    def concat_out(cls, layers: Sequence[Int4Linear]) -> Int4Linear:
        """One layer whose output is the layers' outputs concatenated on the last dim (a new
        copy of their buffers): the stacked gate / up projection of a gated MLP.

        The layers must share in_features, group size, kind, symmetry, scale dtype and codes
        layout, and have no act-order permutation (each would reorder x its own way):
        `stack_refusal`. The result keeps their layout."""
        why = cls.stack_refusal(layers)
        if why is not None:
            raise (TypeError if why.startswith("expected") else ValueError)(f"concat_out: {why}")
        first = layers[0]
        zeros = None if first.zeros is None else torch.cat([layer.zeros for layer in layers], dim=1)
        weight = Int4Weight(
            torch.cat([rows_of(layer.qweight) for layer in layers]),
            torch.cat([layer.scales for layer in layers], dim=1),
            zeros,
            first.group_size,
            first.kind,
        )
        bias = None if first.bias is None else torch.cat([layer.bias.detach() for layer in layers])
        return cls.from_weight(weight, bias, layout=first.layout)

    def _apply(self, fn, recurse: bool = True):
        """nn.Module's dtype casts (`.float()`, `.half()`, `.to(dtype)`) convert every floating
        buffer; the scales and zeros are the weight's format (float16 / bfloat16, which the
        kernels, save_quantized and load_quantized take), not activations: they keep their
        dtype and follow only device moves. The bias casts as any parameter."""
        kept = {
            name: self._buffers[name] for name in ("scales", "zeros") if self._buffers.get(name) is not None
        }
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)  # from the original: no double rounding
        return self

    @property
    def weight(self) -> Int4Weight:
        """The packed weight as an Int4Weight (views of this module's buffers; with tiled codes
        a copy of them in the rows layout, which Int4Weight holds)."""
        return Int4Weight(
            rows_of(self.qweight), self.scales, self.zeros, self.group_size, self.kind, self.perm
        )

    def to_layout(self, layout: str) -> Int4Linear:
        """Store the codes in `layout` (format.LAYOUTS; the class docstring), converting them
        once; returns self. ValueError (the module unchanged) where the shape does not take it."""
        refusal = layout_refusal(layout, self.out_features, self.in_features)
        if refusal is not None:
            raise ValueError(f"to_layout: {refusal}")
        if layout != self.layout:
            self.qweight = tile_codes(self.qweight) if layout == "tiled" else rows_of(self.qweight)
            self.layout = layout
            self.qweight_tiled = None  # use_tiled_codes' second copy: the codes are now one or the other
        return self

    def use_tiled_codes(self, enable: bool = True) -> Int4Linear:
        """Keep a second copy of the codes in format.tile_codes' layout (a non-persistent buffer,
        `qweight_tiled`: not in the state dict, rebuilt when one is loaded), which the
        tensor-core GEMV reads 3-8% faster at one row of x (H100, docs/perf.md); calls it does
        not take read the stored rows. The codes' memory doubles (0.5 more byte per weight):
        `to_layout("tiled")` stores only the tiled codes instead. Layers whose out_features is a
        multiple of 16 and in_features of 128 only; a no-op on a layer that stores tiled codes."""
        if not enable or self.layout == "tiled":  # stored tiled: the calls read them already
            self.qweight_tiled = None
            return self
        refusal = layout_refusal("tiled", self.out_features, self.in_features)
        if refusal is not None:
            raise ValueError(f"use_tiled_codes: {refusal} ({self.extra_repr()})")
        self.register_buffer("qweight_tiled", tile_codes(self.qweight), persistent=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        return linear_parts(x, self.qweight, self.scales, self.zeros, self.bias, self.group_size, self.kind,
                            self.perm, getattr(self, "qweight_tiled", None))  # fmt: skip

    def forward_add(self, x: Tensor, addend: Tensor) -> Tensor:
        """addend + forward(x): x (..., in_features), addend broadcastable to the output
        (..., out_features). Where x is one row (a decode step at batch 1), the layer has no
        bias and the addend is one row of out_features in x's dtype, without gradients, the
        addend goes in as the kernel's bias: added in float32 to the row's sums before their
        one rounding (the separate add rounds twice), one launch fewer. kernelize's decoder
        layers add their MLP's residual this way."""
        if self._addend_as_bias(x, addend) and not (
            torch.is_grad_enabled() and (x.requires_grad or addend.requires_grad)
        ):
            out = linear_parts(x, self.qweight, self.scales, self.zeros, addend.reshape(-1), self.group_size,
                               self.kind, self.perm, getattr(self, "qweight_tiled", None))  # fmt: skip
            return out.reshape(torch.broadcast_shapes(out.shape, addend.shape))
        return addend + self.forward(x)

    def forward_gated(self, gate_up: Tensor, act: str, addend: Tensor | None = None) -> Tensor:
        """forward(act(gate) * up) (+ addend): a gated MLP's down projection on its stacked
        gate / up output, gate_up (..., 2 in_features) with gate first; act "silu", "gelu" or
        "gelu_tanh" (fused.ACTS), the product rounded to gate_up's dtype. On sm_90 at up to 8
        rows the tensor-core GEMV computes the product as it loads x (one launch instead of
        two; gated_fuses says where); elsewhere, with an act-order perm or where a gradient is
        needed, the product is computed first. `addend` as in forward_add (the decoder
        layer's residual: the kernel's bias at one row)."""
        from .fused import ACTS, gated_product

        if act not in ACTS:
            raise ValueError(f"forward_gated: act {act!r}, one of {ACTS}")
        if gate_up.shape[-1] != 2 * self.in_features:
            raise ValueError(
                f"forward_gated: gate_up's last dim is {gate_up.shape[-1]}, expected 2 x in_features = "
                f"{2 * self.in_features} ({self.extra_repr()})"
            )
        grads = torch.is_grad_enabled() and (
            gate_up.requires_grad
            or (addend is not None and addend.requires_grad)
            or (self.bias is not None and self.bias.requires_grad)
        )
        if grads or self.perm is not None:
            h = gated_product(gate_up, act)
            return self.forward(h) if addend is None else self.forward_add(h, addend)
        bias, add_after = self.bias, addend
        if addend is not None and self._addend_as_bias(gate_up, addend):
            bias, add_after = addend.reshape(-1), None
        out = gated_linear_parts(gate_up, self.qweight, self.scales, self.zeros, bias, self.group_size, self.kind,
                                 act, getattr(self, "qweight_tiled", None))  # fmt: skip
        if add_after is not None:
            return add_after + out
        return out if addend is None else out.reshape(torch.broadcast_shapes(out.shape, addend.shape))

    def gated_fuses(self, gate_up: Tensor, act: str) -> bool:
        """Whether forward_gated(gate_up, act) runs as one launch of the tensor-core GEMV here:
        CUDA, up to 8 rows, where the GEMV's gated build takes this layer's shape on this GPU.
        An eager call decides and remembers it on the module; a compiled one reads what the
        last eager call found (False before any), since the op's dispatch runs later."""
        rows = gate_up.numel() // max(gate_up.shape[-1], 1)
        if not gate_up.is_cuda or self.perm is not None or rows < 1:
            return False
        if torch.is_grad_enabled() and gate_up.requires_grad:
            return False  # forward_gated composes where a gradient is needed
        if torch.compiler.is_compiling():
            return rows <= 8 and self.__dict__.get("_openkernels_gated_fuses", False)
        from . import cuda

        # decided for one row (what up to 8 rows take too), also at a prefill's rows, so that a
        # compiled decode step after an eager prefill knows it
        one_row = gate_up.reshape(-1, gate_up.shape[-1])[:1]
        codes = getattr(self, "qweight_tiled", None)
        codes = self.qweight if codes is None else codes
        fuses = one_row.stride(-1) == 1 and cuda.takes_gated(
            one_row, codes, self.scales, self.zeros, self.bias, self.group_size, self.kind, act
        )
        self.__dict__["_openkernels_gated_fuses"] = fuses
        return fuses and rows <= 8

    def forward_normed(
        self, x: Tensor, norm_weight: Tensor, eps: float, weight_offset: float = 0.0
    ) -> Tensor:
        """forward(RMSNorm(x)): a pre-norm decoder's projection on its un-normed hidden state,
        RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * (norm_weight + weight_offset), computed in
        float32 and rounded once to x's dtype (fused.py). On sm_90 at up to 8 rows the
        tensor-core GEMV computes the norm as it loads x (one launch instead of two;
        normed_fuses says where); elsewhere, with an act-order perm or where a gradient is
        needed, the norm is computed first. norm_weight (in_features,) in x's dtype."""
        from .fused import rms_normed

        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"forward_normed: x's last dim is {x.shape[-1]}, expected {self.in_features} ({self.extra_repr()})"
            )
        if norm_weight.shape != (self.in_features,):
            raise ValueError(
                f"forward_normed: norm_weight has shape {tuple(norm_weight.shape)}, expected ({self.in_features},) "
                f"({self.extra_repr()})"
            )
        grads = torch.is_grad_enabled() and (
            x.requires_grad
            or norm_weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad)
        )
        if grads or self.perm is not None or norm_weight.dtype != x.dtype:
            return self.forward(rms_normed(x, norm_weight, eps, weight_offset))
        return normed_linear_parts(x, norm_weight.detach(), float(eps), float(weight_offset), self.qweight, self.scales,
                                   self.zeros, self.bias, self.group_size, self.kind,
                                   getattr(self, "qweight_tiled", None))  # fmt: skip

    def normed_fuses(self, x: Tensor, norm_weight: Tensor) -> bool:
        """Whether forward_normed(x, norm_weight, ...) runs as one launch of the tensor-core
        GEMV here: CUDA, up to 8 rows, norm_weight in x's dtype, where the GEMV's normed build
        takes this layer's shape on this GPU. An eager call decides and remembers it on the
        module; a compiled one reads what the last eager call found (False before any)."""
        rows = x.numel() // max(x.shape[-1], 1)
        if not x.is_cuda or self.perm is not None or rows < 1 or norm_weight.dtype != x.dtype:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or norm_weight.requires_grad):
            return False  # forward_normed composes where a gradient is needed
        if torch.compiler.is_compiling():
            return rows <= 8 and self.__dict__.get("_openkernels_normed_fuses", False)
        from . import cuda

        one_row = x.reshape(-1, x.shape[-1])[:1]  # one row's decision: as gated_fuses
        codes = getattr(self, "qweight_tiled", None)
        codes = self.qweight if codes is None else codes
        fuses = one_row.stride(-1) == 1 and cuda.takes_normed(
            one_row,
            norm_weight.detach(),
            codes,
            self.scales,
            self.zeros,
            self.bias,
            self.group_size,
            self.kind,
        )
        self.__dict__["_openkernels_normed_fuses"] = fuses
        return fuses and rows <= 8

    def _addend_as_bias(self, x: Tensor, addend: Tensor) -> bool:
        """forward_add's rule: one row of x, no bias, the addend one row of out_features in x's
        dtype and device."""
        return (
            self.bias is None
            and x.numel() == x.shape[-1]
            and addend.numel() == self.out_features
            and addend.shape[-1] == self.out_features
            and addend.dtype == x.dtype
            and addend.device == x.device
        )

    def extra_repr(self) -> str:
        zeros = "symmetric" if self.zeros is None else "zeros"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"kind={self.kind}, group_size={self.group_size}, {zeros}{', act_order' if self.perm is not None else ''}"
            f"{', layout=tiled' if self.layout == 'tiled' else ''}"
        )

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:  # fmt: skip
        for name in ("qweight", "scales", "zeros", "perm"):
            mine, key = getattr(self, name), prefix + name
            theirs = state_dict.get(key)
            if theirs is None:
                continue
            if mine is None:
                raise ValueError(
                    f"{key}: this Int4Linear has no {name} ({self.extra_repr()}), the state dict has one"
                )
            if (
                name == "qweight"
                and theirs.dtype == mine.dtype
                and theirs.shape != mine.shape
                and (
                    tuple(theirs.shape)
                    in {codes_shape(other, self.out_features, self.in_features) for other in LAYOUTS}
                )
            ):
                other = "tiled" if theirs.dim() == 3 else "rows"
                raise ValueError(
                    f"{key}: the state dict holds the codes in layout {other!r} {tuple(theirs.shape)}, this "
                    f"Int4Linear stores {self.layout!r} {tuple(mine.shape)} ({self.extra_repr()}); build it with "
                    f"layout={other!r} (or load_quantized, which reads the layout from the file), then to_layout()"
                )
            if theirs.dtype != mine.dtype or theirs.shape != mine.shape:
                raise ValueError(
                    f"{key}: expected {tuple(mine.shape)} {mine.dtype}, got {tuple(theirs.shape)} {theirs.dtype} "
                    f"({self.extra_repr()})"
                )
        check_perm_values(state_dict.get(prefix + "perm"), self.in_features, f"{prefix}perm")
        scales = state_dict.get(prefix + "scales")
        if scales is not None:
            check_scale_values(scales, f"{prefix}scales")
        zeros = state_dict.get(prefix + "zeros")
        # 0..15 from quantize_int4; 16 occurs in GPTQ v1 checkpoints (stored zero - 1 = 15).
        if zeros is not None and ((zeros < 0) | (zeros > 16) | (zeros != zeros.round())).any():
            raise ValueError(f"{prefix}zeros: values must be integers 0..16")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)  # fmt: skip
        if getattr(self, "qweight_tiled", None) is not None:  # the tiled copy follows the loaded codes
            self.qweight_tiled = tile_codes(self.qweight)


def use_tiled_codes(model: nn.Module, enable: bool = True) -> int:
    """Int4Linear.use_tiled_codes on every int4 layer of `model` that takes it (out_features a
    multiple of 16, in_features of 128); returns how many layers changed. For decoding on sm_90:
    the codes' memory doubles."""
    changed = 0
    for module in model.modules():
        if isinstance(module, Int4Linear) and (
            not enable or layout_refusal("tiled", module.out_features, module.in_features) is None
        ):
            module.use_tiled_codes(enable)
            changed += 1
    return changed


def scale_dtype_for(weight: Tensor, scale_dtype: torch.dtype | None) -> torch.dtype:
    """`scale_dtype`, or where None the weight's own 16-bit dtype (float16 for any other): scales
    in the activations' dtype take the wgmma kernel's 16-bit dequantization (H100, quant 0.10.6:
    float16 scales with bfloat16 x made it 1.2-1.43x slower at 16-64 rows; docs/perf.md), and
    the quantization error is the same to 4 digits (bfloat16 keeps 8 bits of each scale,
    against the 4-bit step's error)."""
    if scale_dtype is not None:
        return scale_dtype
    return weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float16


def _quantize_weight(w: Tensor, group_size: int | None, kind: str, symmetric: bool, search: str | None,
                     scale_dtype: torch.dtype | None) -> Int4Weight:  # fmt: skip
    scale_dtype = scale_dtype_for(w, scale_dtype)
    if kind == "nf4":
        return quantize_nf4(w, group_size, search=search, scale_dtype=scale_dtype)
    if kind == "int4":
        return quantize_int4(w, group_size, symmetric, search=search, scale_dtype=scale_dtype)
    raise ValueError(f"kind must be 'int4' or 'nf4', got {kind!r}")


# ---------------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class _TPLayout:
    """How transformers' tp_plan shards one nn.Linear: its forward hook's style (reused on
    the Int4Linear) and mesh, and whether it is row-parallel (weight columns K sharded, the
    hook all-reduces the partial outputs and adds the bias once) or column-parallel (rows N
    sharded, each rank's output is its slice of the features)."""

    style: object
    mesh: object
    rowwise: bool


def _is_dtensor(t: Tensor | None) -> bool:
    return t is not None and type(t).__name__ == "DTensor"


def _tp_layout(name: str, linear: nn.Linear, group_size: int | None) -> _TPLayout | None:
    """None for a layer with plain parameters. For a DTensor weight: the layout, once each
    rank's shard is known to quantize exactly as the whole weight would (the same groups of
    K), else ValueError naming the layer and why. Every rank reaches the same verdict (it
    depends on global shapes only), so none is left quantized while another refuses."""
    weight = linear.weight
    if not _is_dtensor(weight):
        return None
    from torch.distributed.tensor import Replicate, Shard

    where = f"quantize_model: layer {name!r} (tensor-parallel, DTensor weight)"
    hint = "; pass its name in skip= to leave it in 16-bit"
    hook = linear.__dict__.get("forward")
    captured = inspect.getclosurevars(hook).nonlocals if inspect.isfunction(hook) else {}
    style, mesh = captured.get("self"), captured.get("mesh")
    style_name = f"{type(style).__module__}.{type(style).__name__}"
    # transformers 5.x installs its hook as the instance's forward (TensorParallelLayer.install_forward).
    if captured.get("module") is not linear or style_name not in (
        "transformers.distributed.tensor_parallel.ColwiseParallel",
        "transformers.distributed.tensor_parallel.RowwiseParallel",
    ):
        raise ValueError(f"{where}: its forward is not transformers' ColwiseParallel / RowwiseParallel hook, "
                         f"the only tensor-parallel layouts quantized per shard{hint}")  # fmt: skip
    rowwise = style_name.endswith("RowwiseParallel")
    placements = tuple(weight.placements)
    shard_dim = 1 if rowwise else 0
    if (
        mesh.ndim != 1
        or len(placements) != 1
        or not (isinstance(placements[0], Shard) and placements[0].dim % 2 == shard_dim)
    ):
        raise ValueError(f"{where}: weight placements {placements} on a {mesh.ndim}-D mesh; expected "
                         f"(Shard({shard_dim}),) on a 1-D mesh for {type(style).__name__}{hint}")  # fmt: skip
    # Layouts where the hook reads the module's in/out_features as global sizes are refused:
    # the Int4Linear holds this rank's shard and says its local sizes.
    if rowwise and style.input_layouts != Shard(-1):
        raise ValueError(f"{where}: RowwiseParallel with input layout {style.input_layouts!r}; "
                         f"only Shard(-1) is quantized per shard{hint}")  # fmt: skip
    if not rowwise and (style.output_layouts != Shard(-1) or not style.use_local_output):
        raise ValueError(f"{where}: ColwiseParallel with output layout {style.output_layouts!r}"
                         f"{'' if style.use_local_output else ' (DTensor output)'}; only a local Shard(-1) "
                         f"output is quantized per shard{hint}")  # fmt: skip
    bias = linear.bias
    if bias is not None and not (
        _is_dtensor(bias) and len(bias.placements) == 1
        and isinstance(bias.placements[0], Replicate if rowwise else Shard)
    ):  # fmt: skip
        got = tuple(bias.placements) if _is_dtensor(bias) else "a plain tensor"
        expected = "(Replicate(),)" if rowwise else "(Shard(dim=0),)"
        raise ValueError(f"{where}: bias is {got}, expected {expected} for {type(style).__name__}{hint}")
    k, ranks = linear.in_features, mesh.size()
    if rowwise:
        # DTensor's Shard splits like torch.chunk: every rank's columns must be whole groups
        # (then each group lies on one rank, as in the unsharded weight).
        columns = [len(c) for c in torch.arange(k).chunk(ranks)]
        columns += [0] * (ranks - len(columns))
        g = problem.resolve_group_size(group_size, k)
        if any(c == 0 or c % g for c in columns):
            whole = group_size in (None, -1)
            what = f"one group per row (group_size={group_size})" if whole else f"group_size {g}"
            fits = " or ".join(str(s) for s in (32, 64, 128) if all(c and c % s == 0 for c in columns))
            raise ValueError(f"{where}: row-parallel, its {ranks} ranks hold {columns} of its {k} input columns "
                             f"and {what} does not divide each rank's share (a group would straddle two ranks); "
                             f"{f'use group_size {fits}' if fits else 'no group size fits'}{hint}")  # fmt: skip
    return _TPLayout(style, mesh, rowwise)


def _quantize_shard(linear: nn.Linear, layout: _TPLayout, group_size: int | None, kind: str, symmetric: bool,
                    search: str | None, scale_dtype: torch.dtype | None) -> Int4Linear:  # fmt: skip
    """An Int4Linear of this rank's shard, hooked by the linear's own tensor-parallel style.

    transformers' `_hf_quantized_needs_local_tp` path runs it on plain local tensors: a
    column-parallel layer takes the replicated x and returns its slice of the features; a
    row-parallel one takes its slice of x, its partial output is all-reduced (a DTensor
    Partial -> Replicate) and the bias, kept as the replicated DTensor it was, is added once
    after that. A column-parallel bias is this rank's slice, a plain tensor, so a stacked
    q/k/v or gate/up can concatenate it."""
    q = _quantize_weight(linear.weight.to_local().detach(), group_size, kind, symmetric, search, scale_dtype)
    bias = linear.bias
    module = Int4Linear.from_weight(q, bias if layout.rowwise or bias is None else bias.to_local())
    module._hf_quantized_needs_local_tp = True
    layout.style.install_forward(module, layout.mesh)
    module._is_hooked = True
    return module


@dataclass
class QuantizeReport:
    """What quantize_model did: module names quantized, (name, reason) skipped, bytes of the
    weights before and after."""

    quantized: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self) -> str:
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else float("nan")
        lines = [f"quantized {len(self.quantized)} linear layers: {self.bytes_before / 2**20:.1f} MiB -> "
                 f"{self.bytes_after / 2**20:.1f} MiB of weights ({ratio:.2f}x smaller)"]  # fmt: skip
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _progress(items: list, enabled: bool) -> Iterable:
    if not enabled or not items:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _text_progress(items)
    return tqdm(items, desc="quantizing", unit="layer")


def _text_progress(items: list) -> Iterable:
    for i, item in enumerate(items, 1):
        yield item
        print(
            f"\rquantizing {i}/{len(items)} linear layers",
            end="" if i < len(items) else "\n",
            file=sys.stderr,
        )


def _skip_reason(name: str, module: nn.Linear, skip: tuple[str, ...], group_size: int | None) -> str | None:
    for pattern in skip:
        if fnmatch.fnmatchcase(name, pattern) or name.split(".")[-1] == pattern:
            return f"matches skip pattern {pattern!r}"
    k = module.in_features
    if k % 2:
        return f"in_features {k} is odd"
    g = problem.resolve_group_size(group_size, k)
    if k % g:
        return f"group_size {g} does not divide in_features {k}"
    return None


def quantize_model(
    model: nn.Module,
    *,
    group_size: int | None = 128,
    kind: str = "int4",
    symmetric: bool = False,
    search: str | None = None,
    skip: Iterable[str] = ("lm_head",),
    scale_dtype: torch.dtype | None = None,
    progress: bool = True,
    layout: str = "rows",
) -> QuantizeReport:
    """Replace every nn.Linear of `model` (in place) by an Int4Linear.

    `skip`: module names or glob patterns over qualified names ("lm_head", "*.gate") left in
    16-bit; layers whose in_features the group size does not divide are skipped too. Each
    weight is quantized on its current device. Returns a QuantizeReport. A weight that cannot
    be quantized (NaN, infinity) raises naming its layer; the layers before it stay quantized
    (their 16-bit weights are freed as it goes; kernelize(quantize=...) keeps them and puts
    them back). `scale_dtype`: the scales' (and zeros') dtype; None (the default since quant
    0.10.6; float16 before) takes each weight's own 16-bit dtype, float16 for any other.

    Tensor parallelism (transformers' tp_plan="auto": DTensor weights): each rank quantizes
    its own shard, which gives the unsharded weight's codes, scales and zeros sliced, and the
    Int4Linear keeps the layer's tensor-parallel hook (the row-parallel all-reduce). A
    row-parallel layer whose rank shares of K the group size does not divide (or a
    whole-row group), and a sharded layer of another layout, raise ValueError naming it
    before any layer changes. Bytes in the report are this rank's.

    `layout`: how every new layer stores its codes (Int4Linear's docstring). "tiled" raises
    ValueError before any layer changes where a layer's shape cannot hold it (out_features not
    a multiple of 16, in_features of 128; `skip` them) or the layer is sharded.
    """
    skip = tuple(skip)
    if type(model) is nn.Linear:
        raise TypeError(
            "quantize_model: replaces the nn.Linear layers inside a model; for one layer use "
            "Int4Linear.from_linear(layer, ...)"
        )
    codes_layout = layout  # (the loop below names the tensor-parallel layouts `layout`)
    report = QuantizeReport()
    todo: dict[str, _TPLayout | None] = {}
    # A layer registered under several names (shared weights) is quantized once and replaced
    # under each of them; it is skipped if any of its names is.
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) is nn.Linear:
            aliases.setdefault(id(module), []).append(name)
    for names in aliases.values():
        name, module = names[0], model.get_submodule(names[0])
        reason = next(filter(None, (_skip_reason(n, module, skip, group_size) for n in names)), None)
        if len(names) > 1 and reason:
            reason += f" (the layer is shared by {', '.join(names)})"
        if reason:
            report.skipped.extend((n, reason) for n in names)
            continue
        todo[name] = _tp_layout(name, module, group_size)  # refuses before anything changes
        refusal = layout_refusal(codes_layout, module.out_features, module.in_features)
        if refusal is None and codes_layout != "rows" and todo[name] is not None:
            refusal = f"layout {codes_layout!r} under tensor parallelism is not supported (sharded codes: rows only)"
        if refusal is not None:
            raise ValueError(f"quantize_model: layer {name!r}: {refusal}")
    for name in _progress(list(todo), progress):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        layout = todo[name]
        try:
            if layout is None:
                quantized = Int4Linear.from_linear(linear, group_size=group_size, kind=kind, symmetric=symmetric,
                                                   search=search, scale_dtype=scale_dtype, layout=codes_layout)  # fmt: skip
            else:
                quantized = _quantize_shard(linear, layout, group_size, kind, symmetric, search, scale_dtype)
        except (ValueError, TypeError) as error:  # bad weights (NaN, ...): say which layer
            raise type(error)(f"quantize_model: layer {name!r}: {error}") from error
        weight = linear.weight.to_local() if layout is not None else linear.weight
        report.bytes_before += weight.numel() * weight.element_size()
        report.bytes_after += quantized.weight.nbytes()
        for alias in aliases[id(linear)]:
            alias_parent, _, alias_child = alias.rpartition(".")
            setattr(model.get_submodule(alias_parent), alias_child, quantized)
            report.quantized.append(alias)
    return report


def _layer_meta(module: Int4Linear) -> dict:
    meta = {
        "in_features": module.in_features, "out_features": module.out_features, "group_size": module.group_size,
        "kind": module.kind, "symmetric": module.zeros is None, "act_order": module.perm is not None,
        "bias": module.bias is not None, "scale_dtype": str(module.scales.dtype).removeprefix("torch."),
    }  # fmt: skip
    if module.layout != "rows":
        meta.update(layout=module.layout, layout_version=LAYOUT_VERSIONS[module.layout])
    return meta


def save_quantized(model: nn.Module, path: str | Path) -> None:
    """Write the model's state dict to a safetensors file, with the Int4Linear layers' formats
    in its metadata (their codes' layout and its version included) so load_quantized can
    rebuild them on an unquantized model."""
    from safetensors.torch import save_file

    layers = {name: _layer_meta(m) for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    tensors, tied = _untied(model.state_dict())
    version = 2 if any("layout" in layer for layer in layers.values()) else 1
    info = {"version": version, "layers": layers}
    if tied:
        info["tied"] = tied
    save_file(tensors, str(path), metadata={_FORMAT_KEY: json.dumps(info)})


def _untied(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict with each tensor stored once, and {dropped key: the key that holds its
    tensor}: tied weights (a Llama's embed_tokens and lm_head, when lm_head stays in 16 bits)
    are one tensor under two keys, which safetensors refuses to write twice."""
    tensors: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    holders: dict[tuple, str] = {}
    for key, value in state.items():
        same = (
            (value.device, value.dtype, value.data_ptr(), tuple(value.shape), value.stride())
            if value.numel()
            else None
        )
        if same is not None and same in holders:
            tied[key] = holders[same]
            continue
        if same is not None:
            holders[same] = key
        tensors[key] = value.detach().contiguous()
    return tensors, tied


# save_quantized's format of one layer: key -> (check, what is expected).
_LAYER_FIELDS = {
    "in_features": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "out_features": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "group_size": (lambda v: type(v) is int and v > 0, "a positive integer"),
    "kind": (lambda v: v in KINDS, f"one of {list(KINDS)}"),
    "symmetric": (lambda v: type(v) is bool, "true or false"),
    "act_order": (lambda v: type(v) is bool, "true or false"),
    "bias": (lambda v: type(v) is bool, "true or false"),
    "scale_dtype": (lambda v: v in ("float16", "bfloat16"), "'float16' or 'bfloat16'"),
}
# ... and the optional ones (format version 2): absent means rows.
_OPTIONAL_FIELDS = {
    "layout": (lambda v: v in LAYOUTS, f"one of {list(LAYOUTS)}"),
    "layout_version": (lambda v: type(v) is int, "an integer"),
}


def _read_layers(path: str | Path) -> dict[str, dict]:
    """The layer formats in a save_quantized file's metadata; ValueError naming the file, the
    key and what was expected when they are not what save_quantized writes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = (f.metadata() or {}).get(_FORMAT_KEY)
    if meta is None:
        raise ValueError(f"{path}: no {_FORMAT_KEY} metadata; was it written by save_quantized?")
    where = f"{path}: metadata {_FORMAT_KEY!r}"
    expected = "an object {layer name: {in_features, out_features, group_size, ...}}"
    try:
        info = json.loads(meta)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not JSON ({error}); expected what save_quantized writes") from error
    if not isinstance(info, dict):
        raise ValueError(f"{where} must be an object with 'version' and 'layers', got {type(info).__name__}")
    if type(info.get("version")) is not int or info["version"] not in _FORMAT_VERSIONS:  # not "1", not true
        raise ValueError(
            f"{path}: format version {info.get('version')!r} is not supported (integers "
            f"{', '.join(map(str, _FORMAT_VERSIONS))})"
        )
    if "layers" not in info:
        raise ValueError(f"{where} has no 'layers'; expected {expected}")
    layers = info["layers"]
    if not isinstance(layers, dict):
        raise ValueError(f"{where}: 'layers' must be {expected}, got {type(layers).__name__}")
    for name, layer in layers.items():
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: layers[{name!r}] must be an object, got {type(layer).__name__}")
        for key, (ok, what) in _LAYER_FIELDS.items():
            if key not in layer:
                raise ValueError(f"{where}: layers[{name!r}] has no {key!r}; expected {what}")
            if not ok(layer[key]):
                raise ValueError(f"{where}: layers[{name!r}][{key!r}] is {layer[key]!r}; expected {what}")
        for key, (ok, what) in _OPTIONAL_FIELDS.items():
            if key in layer and not ok(layer[key]):
                raise ValueError(f"{where}: layers[{name!r}][{key!r}] is {layer[key]!r}; expected {what}")
        layout = layer.get("layout", "rows")
        if layer.get("layout_version", LAYOUT_VERSIONS[layout]) != LAYOUT_VERSIONS[layout]:
            raise ValueError(
                f"{where}: layers[{name!r}] stores layout {layout!r} version {layer['layout_version']}; this "
                f"openkernels-quant reads version {LAYOUT_VERSIONS[layout]}"
            )
    return layers


def _read_tied(path: str | Path) -> dict[str, str]:
    """save_quantized's {key: key holding the same tensor} (tied weights), {} when absent."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        tied = json.loads((f.metadata() or {})[_FORMAT_KEY]).get("tied", {})  # _read_layers checked the rest
    if not isinstance(tied, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
    ):
        raise ValueError(
            f"{path}: metadata {_FORMAT_KEY!r}: 'tied' must be an object {{key: key}}, got {tied!r}"
        )
    return tied


def _within(path: str, names: dict[str, Int4Linear]) -> bool:
    """Whether module `path` is one of `names` or inside one."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in names for i in range(1, len(parts) + 1))


def _check_state(model: nn.Module, new: dict[str, Int4Linear], state: dict[str, Tensor], strict: bool,
                 path: str | Path) -> None:  # fmt: skip
    """Raise what model.load_state_dict(state, strict) would once `new` replaced its layers,
    before anything changes: the new layers load their tensors (checked by Int4Linear), the
    others' keys and shapes are compared."""
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    for name, module in new.items():
        try:
            module._load_from_state_dict(state, f"{name}.", {}, strict, missing, unexpected, errors)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from error
    theirs = {k for k in state if not _within(k.rpartition(".")[0], new)}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if _within(prefix, new):
            continue
        buffers = {k: b for k, b in module._buffers.items() if k not in module._non_persistent_buffers_set}
        for local, mine in {**module._parameters, **buffers}.items():
            key = f"{prefix}.{local}" if prefix else local
            if mine is None:
                continue
            if key not in state:
                missing.append(key)
            elif state[key].shape != mine.shape:
                errors.append(f"{key} has shape {tuple(state[key].shape)}, the model's {tuple(mine.shape)}")
            theirs.discard(key)
    problems = errors
    if strict and missing:
        problems.append(f"missing {', '.join(missing)}")
    if strict and (unexpected or theirs):
        problems.append(f"unexpected {', '.join(unexpected + sorted(theirs))}")
    if problems:
        raise ValueError(f"{path}: the state dict does not fit the model: {'; '.join(problems)}")


def load_quantized(model: nn.Module, path: str | Path, *, device: torch.device | str | None = None,
                   strict: bool = True, layout: str | None = None) -> nn.Module:  # fmt: skip
    """Load a file written by save_quantized into `model` (built unquantized, e.g. from its
    config): the layers recorded as Int4Linear replace the model's linear layers and the state
    dict is loaded, the Int4Linear buffers' shapes and dtypes checked (and scales finite and
    non-negative), every other tensor's shape (load_state_dict casts those, and the bias, to
    the model's dtypes). Tied weights saved once (save_quantized's "tied") fill both keys. `layout`: how the layers store their codes (Int4Linear's docstring); None
    keeps each layer's recorded layout (rows in files before quant 0.10.15), "rows" or "tiled"
    converts every layer to it once, after loading (a layer whose shape the tiled layout
    cannot hold raises). All of it (the metadata, every tensor's key, shape and dtype, the
    scales, the layout asked for) is checked before the model changes: on an error the model is
    left as it was. Returns the model."""
    from safetensors.torch import load_file

    new: dict[str, Int4Linear] = {}
    layers = _read_layers(path)
    if layout is not None:
        for name, layer in layers.items():
            refusal = layout_refusal(layout, layer["out_features"], layer["in_features"])
            if refusal is not None:
                raise ValueError(f"{path}: layer {name!r}: {refusal}")
    for name, layer in layers.items():
        try:
            old = model.get_submodule(name)
        except AttributeError as error:
            raise ValueError(f"{path}: layer {name!r} is not in the model") from error
        if not isinstance(old, (nn.Linear, Int4Linear)) or (old.in_features, old.out_features) != (
            layer["in_features"], layer["out_features"]):  # fmt: skip
            raise ValueError(f"{path}: layer {name!r} is {old}, expected a linear layer "
                             f"{layer['in_features']} -> {layer['out_features']}")  # fmt: skip
        bias_dtype = old.bias.dtype if isinstance(old, nn.Linear) and old.bias is not None else torch.float32
        try:
            new[name] = Int4Linear(layer["in_features"], layer["out_features"], layer["bias"],
                                   group_size=layer["group_size"], kind=layer["kind"], symmetric=layer["symmetric"],
                                   act_order=layer["act_order"], scale_dtype=getattr(torch, layer["scale_dtype"]),
                                   bias_dtype=bias_dtype, device=device,
                                   layout=layer.get("layout", "rows"))  # fmt: skip
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}: metadata {_FORMAT_KEY!r}: layers[{name!r}]: {error}") from error
    state = load_file(str(path), device=str(device) if device is not None else "cpu")
    for key, holder in _read_tied(path).items():
        if holder not in state:
            raise ValueError(
                f"{path}: metadata {_FORMAT_KEY!r}: 'tied' names {key!r} as {holder!r}, which the file lacks"
            )
        state[key] = state[holder]
    _check_state(model, new, state, strict, path)
    replaced = {}
    for name, module in new.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        replaced[name] = getattr(parent, child)
        setattr(parent, child, module)
    try:
        model.load_state_dict(state, strict=strict)
    except BaseException:  # what _check_state did not foresee: at least the layers go back
        for name, module in replaced.items():
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, module)
        raise
    if device is not None:
        model.to(device)
    if layout is not None:
        for module in new.values():
            module.to_layout(layout)
    return model
