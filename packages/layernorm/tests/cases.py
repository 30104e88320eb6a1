"""Option combinations, shapes and implementations the layernorm tests run over, and the
float64 reference comparison they share."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import openkernels.layernorm as L
from openkernels.layernorm import reference as R
from openkernels.shared.dev import testing
from openkernels.shared.dev.testing import assert_close, random_tensor
from openkernels.shared.platform import triton_interpreting

KERNEL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class Options:
    """One combination of the public API's options."""

    rms: bool
    weight: bool = True
    bias: bool = False
    residual: bool = False
    prenorm: bool = False
    weight_offset: float = 0.0
    out_fp32: bool = False  # out_dtype=float32
    residual_fp32: bool = False  # residual_dtype=float32

    @property
    def id(self) -> str:
        parts = ["rms" if self.rms else "ln"]
        parts += [name for name in ("weight", "bias", "residual", "prenorm") if getattr(self, name)]
        if self.weight_offset:
            parts.append(f"offset{self.weight_offset:g}")
        if self.out_fp32:
            parts.append("out32")
        if self.residual_fp32:
            parts.append("res32")
        return "-".join(parts)

    def make(self, shape: tuple[int, ...], dtype: torch.dtype, device: str, *, grad: bool = True) -> dict:
        """Fresh random inputs: x, residual, weight, bias (None where the options say so)."""
        n = shape[-1]
        return {
            "x": random_tensor(shape, dtype, device, requires_grad=grad),
            "residual": random_tensor(shape, dtype, device, requires_grad=grad) if self.residual else None,
            # Weights around 1 (as trained norms are) so that every term matters.
            "weight": (1 + 0.5 * random_tensor((n,), dtype, device)).detach().requires_grad_(grad)
            if self.weight
            else None,
            "bias": random_tensor((n,), dtype, device, requires_grad=grad) if self.bias else None,
        }

    def kwargs(self, dtype: torch.dtype) -> dict:
        kw: dict = {"prenorm": self.prenorm}
        if self.out_fp32:
            kw["out_dtype"] = torch.float32
        if self.residual_fp32:
            kw["residual_dtype"] = torch.float32
        if self.rms:
            kw["weight_offset"] = self.weight_offset
        return kw

    def h_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.residual_fp32 else dtype

    def call(self, inputs: dict, dtype: torch.dtype):
        """The public function; returns (y, h or None)."""
        kw = self.kwargs(dtype)
        if self.rms:
            out = L.rms_norm(inputs["x"], inputs["weight"], 1e-6, residual=inputs["residual"], **kw)
        else:
            out = L.layer_norm(
                inputs["x"], inputs["weight"], inputs["bias"], 1e-5, residual=inputs["residual"], **kw
            )
        return out if self.prenorm else (out, None)

    def reference(self, inputs: dict, dtype: torch.dtype):
        """The float64 reference on copies of the inputs; h rounded to the dtype the kernel
        rounds it to, then everything in float64. Returns (y, h or None, leaves)."""
        leaves = {
            k: (v.detach().to(torch.float64).requires_grad_(v.requires_grad) if v is not None else None)
            for k, v in inputs.items()
        }
        kw = self.kwargs(dtype)
        kw.pop("out_dtype", None)
        h_dtype = self.h_dtype(dtype)
        # Round h as the kernel does, then let the float64 math run on the rounded values.
        x, r = leaves["x"], leaves["residual"]
        h = x if r is None else x + r
        h = h + (h.to(h_dtype).to(torch.float64) - h).detach()  # straight-through rounding
        kw["residual_dtype"] = torch.float64
        if self.rms:
            out = R.rms_norm_ref(h, leaves["weight"], 1e-6, **kw)
        else:
            out = R.layer_norm_ref(h, leaves["weight"], leaves["bias"], 1e-5, **kw)
        y, h_out = out if self.prenorm else (out, None)
        return y, h_out, leaves

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.out_fp32 else dtype


def all_options() -> list[Options]:
    """Every combination of the options (weight_offset only with a weight, bias only on LN)."""
    out = []
    for rms, weight, bias, residual, prenorm, out32, res32 in itertools.product(*[(False, True)] * 7):
        if rms and bias:
            continue
        offsets = (0.0, 1.0) if rms and weight else (0.0,)
        for offset in offsets:
            out.append(Options(rms, weight, bias, residual, prenorm, offset, out32, res32))
    return out


def option_params(options: list[Options]) -> list:
    return [pytest.param(o, id=o.id) for o in options]


def targets():
    """(device, implementation) params of every test that runs all implementations."""
    return testing.targets("rms_norm")


def shapes(device: str) -> list[tuple[int, ...]]:
    """Odd shapes; small ones under the interpreter, which runs each program in Python.
    (33, 20000) and (2, 70000) take the looped kernels there (the split kernels on a GPU);
    (257, 64) gives backward programs several row blocks each. On a GPU every shape is a
    compile per option combination, so three shapes cover the tile, the multi-row tile and
    the split kernels."""
    if triton_interpreting():
        return [(1, 1), (7, 33), (2, 3, 64), (257, 64), (3, 20000)]
    if device != "cpu":
        return [(1, 1), (257, 127), (33, 20000)]
    return [(1, 1), (7, 127), (5, 4097), (2, 3, 130), (257, 64), (33, 20000), (2, 70000)]


def check_against_reference(
    options: Options, inputs: dict, dtype: torch.dtype, y, h, msg: str, *, conditioning: float = 1.0
) -> None:
    """Forward outputs and all gradients of sum(y * dy) + sum(h * dh) against float64.

    conditioning: how much the inputs amplify float32 rounding beyond the usual (rows with
    a large mean: ulp(|h|) * rstd instead of ulp(|y|)); it scales the summed-term bound."""
    y_ref, h_ref, leaves = options.reference(inputs, dtype)
    n = y.shape[-1]
    out_dtype = options.out_dtype(dtype)
    assert y.dtype == out_dtype, f"{msg}: out dtype {y.dtype}"
    y_scale = conditioning * float(y_ref.abs().nan_to_num(0.0, 0.0, 0.0).max()) if y_ref.numel() else 0.0
    assert_close(y, y_ref, dtype=out_dtype, terms=n, term_scale=y_scale, msg=f"{msg} y")
    if options.prenorm:
        assert h is not None and h.dtype == options.h_dtype(dtype)
        assert_close(h, h_ref, dtype=h.dtype, msg=f"{msg} h")
    wanted = [k for k, v in inputs.items() if v is not None and v.requires_grad]
    if not wanted:
        return
    dy = random_tensor(tuple(y.shape), out_dtype, str(y.device))
    loss = (y.float() * dy.float()).sum()
    loss_ref = (y_ref * dy.double()).sum()
    if h is not None:
        dh = random_tensor(tuple(h.shape), h.dtype, str(h.device))
        loss = loss + (h.float() * dh.float()).sum()
        loss_ref = loss_ref + (h_ref * dh.double()).sum()
    grads = torch.autograd.grad(loss, [inputs[k] for k in wanted])
    grads_ref = torch.autograd.grad(loss_ref, [leaves[k] for k in wanted])
    rows = y.numel() // max(n, 1)
    scale = conditioning * gradient_term_scale(options, inputs, y_ref, dy)
    for name, g, g_ref in zip(wanted, grads, grads_ref):
        assert g.dtype == inputs[name].dtype, f"{msg}: d{name} dtype {g.dtype}"
        # dx = rstd * (g - xhat * mean(g * xhat) [- mean(g)]) sums n products per row and
        # cancels down from terms of size rstd * |g|; dweight / dbias sum over the rows.
        terms = n if name in ("x", "residual") else rows
        assert_close(g, g_ref, dtype=g.dtype, terms=terms, term_scale=scale, msg=f"{msg} d{name}")


def gradient_term_scale(options: Options, inputs: dict, y_ref: torch.Tensor, dy: torch.Tensor) -> float:
    """A bound on the products the backward sums: max rstd * max|dy * (w + offset)|, times
    max|h - mean| for the weight gradient's dy * xhat terms."""
    if y_ref.numel() == 0:
        return 0.0
    x = inputs["x"].detach().double()
    h = x if inputs["residual"] is None else x + inputs["residual"].detach().double()
    centered = h if options.rms else h - h.mean(-1, keepdim=True)
    rstd = (centered.square().mean(-1) + 1e-6).rsqrt().nan_to_num(0.0, 0.0, 0.0)
    g = dy.double().abs().nan_to_num(0.0, 0.0, 0.0)
    if inputs["weight"] is not None:
        g = g * (inputs["weight"].detach().double() + options.weight_offset).abs()
    spread = float(centered.abs().nan_to_num(0.0, 0.0, 0.0).max())
    return float(rstd.max() * g.max()) * max(1.0, spread)


def rows_far_from_their_shift(n: int, chunk: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """float64 rows of n entries on which the split forward's one-pass shift (each chunk's
    first entry) cancels: 1000 + N(0, 1e-2); N(0, 1) with an outlier (1e4) first in every
    chunk; 1000 + N(0, 1e-2) with 1100 first in every chunk; N(0, 1) after a first entry of
    1e15; a constant row; N(0, 1)."""
    rows = torch.randn(6, n, dtype=torch.float64, generator=generator)
    rows[0] = 1000.0 + 1e-2 * rows[0]
    rows[1, ::chunk] = 1.0e4
    rows[2] = 1000.0 + 1e-2 * rows[2]
    rows[2, ::chunk] = 1100.0
    rows[3, 0] = 1.0e15
    rows[4] = 7.0
    return rows
