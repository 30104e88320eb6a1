"""Ahead-of-time compile checks of every activations kernel and launch config it can pick,
for sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles,
no register spills, no scratch, shared memory within the chip's limit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openkernels.activations.spec import SPECS, Act
from openkernels.activations.triton import configs, plan

pytestmark = pytest.mark.aot

_KERNELS = "openkernels.activations.triton.kernels"
_PTRS = {
    "unary_fwd": ("x_ptr", "out_ptr"),
    "unary_bwd": ("dy_ptr", "x_ptr", "dx_ptr"),
    "gated_fwd": ("x_ptr", "out_ptr"),
    "gated_bwd": ("dy_ptr", "x_ptr", "dx_ptr"),
}
_INTS = {
    "unary_fwd": ("n_rows", "n_cols", "stride_x", "stride_out"),
    "unary_bwd": ("n_rows", "n_cols", "stride_dy", "stride_x", "stride_dx"),
    "gated_fwd": ("n_rows", "n_cols", "stride_x", "stride_out"),
    "gated_bwd": ("n_rows", "n_cols", "stride_dy", "stride_x", "stride_dx"),
}
_NAMES = {
    "unary_fwd": "_activation_fwd_kernel",
    "unary_bwd": "_activation_bwd_kernel",
    "gated_fwd": "_gated_activation_fwd_kernel",
    "gated_bwd": "_gated_activation_bwd_kernel",
}
_TRITON_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _case(
    kind: str,
    cfg: configs.LaunchConfig,
    dtype: str,
    act: Act,
    *,
    even: bool,
    aligned: bool = True,
    int_type: str = "i32",
    act_first: bool = True,
):
    from openkernels.shared.dev.testing.aot import AotCase

    signature = {p: _TRITON_DTYPE[dtype] for p in _PTRS[kind]}
    signature.update({i: int_type for i in _INTS[kind]})
    constexprs = {"ACT": int(act), "BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols, "EVEN": even}
    if kind.startswith("gated"):
        constexprs["ACT_FIRST"] = act_first
    # Sizes and strides that are multiples of 16 are what Triton specializes on at launch
    # (the vectorized kernel); `aligned=False` checks the kernel odd shapes get.
    attrs = {i: "D" for i in _INTS[kind] if i != "n_rows"} if aligned else {}
    label = (
        f"{kind}-{act.name}-{dtype}-r{cfg.block_rows}c{cfg.block_cols}w{cfg.num_warps}"
        f"{'-even' if even else ''}{'' if aligned else '-unaligned'}{'-' + int_type if int_type != 'i32' else ''}"
        f"{'' if act_first else '-actlast'}"
    )
    return AotCase(
        f"{_KERNELS}:{_NAMES[kind]}",
        signature,
        constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        label=label,
        attrs=attrs,
    )


def cases_for(backend: str) -> list:
    """Every config `launch_config` can return, with the heaviest activation (exact GELU)
    in bf16 and fp32; every activation, dtype and variant on the widest config (marked
    `variant`: compiled for each vendor's reference target); odd-shape (unaligned) and
    int64-offset specializations."""
    all_configs = configs.all_configs(backend)
    widest = all_configs[-1]
    out = {}
    for kind in _NAMES:
        for cfg in all_configs:
            for dtype in ("bf16", "fp32"):
                c = _case(kind, cfg, dtype, Act.GELU, even=False)
                out[c.label] = c
        # Every activation, dtype and variant on the widest config: variants (checked on
        # sm_90 and gfx942, aot.REFERENCE_TARGETS), beside the configs' exact GELU above.
        for act in Act:
            for dtype in ("bf16", "fp16", "fp32"):
                for even in (False, True):
                    c = _case(kind, widest, dtype, act, even=even)
                    out.setdefault(c.label, dataclasses.replace(c, variant=True))
        extra = [
            _case(kind, all_configs[len(all_configs) // 2], "bf16", Act.GELU, even=False, aligned=False),
            _case(kind, widest, "bf16", Act.GELU, even=False, int_type="i64"),
        ]
        if kind.startswith("gated"):  # each code a gated op applies to the second half (mul_and_silu, glu)
            for act in sorted({s.act for s in SPECS.values() if s.gated and not s.act_first}):
                extra.append(dataclasses.replace(_case(kind, widest, "bf16", act, even=True, act_first=False),
                                                 variant=True))  # fmt: skip
        out.update({c.label: c for c in extra})
    return list(out.values())


def jax_cases_for(backend: str) -> list:
    """The kernels as the JAX front end compiles them: every integer a constant (JAX shapes
    are static), here for the (rows, cols) of the benchmark and odd shapes, through the
    same launch plan."""
    from openkernels.shared.dev.testing.aot import AotCase

    out = []
    for kind in _NAMES:
        gated = kind.startswith("gated")
        for rows, cols, dtype in (
            (16384, 8192, "bf16"),
            (4096, 4096, "fp16"),
            (127, 1000, "fp32"),
            (7, 13, "bf16"),
        ):
            cfg, _, even = plan.launch_plan(rows, cols, torch.bfloat16, backend)
            width = 2 * cols if gated and kind.endswith("bwd") else cols
            in_width = 2 * cols if gated else cols
            strides = {"stride_x": in_width, "stride_out": width, "stride_dy": cols, "stride_dx": width}
            constexprs = {"ACT": int(Act.GELU), "BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols, "EVEN": even,
                          "n_rows": rows, "n_cols": cols}  # fmt: skip
            constexprs.update({k: v for k, v in strides.items() if k in _INTS[kind]})
            if gated:
                constexprs["ACT_FIRST"] = True
            label = f"jax-{kind}-{dtype}-{rows}x{cols}-w{cfg.num_warps}"
            signature = {p: _TRITON_DTYPE[dtype] for p in _PTRS[kind]}
            out.append(AotCase(f"{_KERNELS}:{_NAMES[kind]}", signature, constexprs, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, label=label))  # fmt: skip
    return out


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_jax_specializations_compile_clean(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(jax_cases_for, vendor)


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_kernels_compile_clean_for_every_config(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(cases_for, vendor)
