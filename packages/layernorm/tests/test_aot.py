"""Ahead-of-time compile checks of the layernorm kernels for every launch config they can
pick, for sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles,
no register spills, no scratch, shared memory within the chip's limit."""

from __future__ import annotations

import pytest
import torch

from openkernels.layernorm.triton import configs
from openkernels.shared.platform import triton_interpreting

pytestmark = pytest.mark.aot

_KERNELS = "openkernels.layernorm.triton.kernels"
_TRITON_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
_FWD_INTS = ("n_rows", "n_cols", "stride_x", "stride_res", "stride_out", "stride_res_out")
_BWD_INTS = ("n_rows", "n_cols", "stride_dy", "stride_h", "stride_dh_out", "stride_dh", "rows_per_program")

# The heaviest variant of each direction: every flag that adds live registers on.
_FWD_ALL = {"IS_RMS": False, "HAS_RESIDUAL": True, "STORE_RESIDUAL": True, "HAS_WEIGHT": True, "HAS_BIAS": True}
_BWD_ALL = {"IS_RMS": False, "HAS_WEIGHT": True, "HAS_DH_OUT": True, "WEIGHT_GRAD": True, "BIAS_GRAD": True}


def _case(direction: str, cfg: configs.NormConfig, dtype: str, flags: dict, *, aligned: bool = True,
          int_type: str = "i32", h_dtype: str | None = None):  # fmt: skip
    from openkernels.shared.testing.aot import AotCase

    act, h = _TRITON_DTYPE[dtype], _TRITON_DTYPE[h_dtype or dtype]
    if direction == "fwd":
        ptrs = {"x_ptr": act, "res_ptr": act, "w_ptr": act, "b_ptr": act, "out_ptr": act,
                "res_out_ptr": h, "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}  # fmt: skip
        ints, floats, kernel = _FWD_INTS, ("eps", "weight_offset"), "_norm_fwd_kernel"
    else:
        ptrs = {"dy_ptr": act, "h_ptr": h, "w_ptr": act, "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                "dh_out_ptr": h, "dh_ptr": h, "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"}  # fmt: skip
        ints, floats, kernel = _BWD_INTS, ("weight_offset",), "_norm_bwd_kernel"
    signature = {**ptrs, **{i: int_type for i in ints}, **{f: "fp32" for f in floats}}
    constexprs = {**flags, "LOOPED": cfg.looped, "BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols}
    # Sizes and strides that are multiples of 16 are what Triton specializes on at launch
    # (the vectorized kernel); `aligned=False` checks the kernel odd shapes get.
    attrs = {i: "D" for i in ints if i.startswith(("n_cols", "stride"))} if aligned else {}
    flag_text = "".join(k[0] + k.split("_")[-1][0] for k, v in flags.items() if v)
    label = (
        f"{direction}-{dtype}{'-h' + h_dtype if h_dtype else ''}-r{cfg.block_rows}c{cfg.block_cols}"
        f"w{cfg.num_warps}{'-looped' if cfg.looped else ''}-{flag_text}"
        f"{'' if aligned else '-unaligned'}{'-' + int_type if int_type != 'i32' else ''}"
    )
    return AotCase(f"{_KERNELS}:{kernel}", signature, constexprs, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, label=label, attrs=attrs)  # fmt: skip


def _flag_variants(direction: str) -> list[dict]:
    """RMSNorm / LayerNorm with everything off, and each flag alone on."""
    every = _FWD_ALL if direction == "fwd" else _BWD_ALL
    out = []
    for rms in (True, False):
        base = {k: False for k in every} | {"IS_RMS": rms}
        out.append(base)
        for k in every:
            if k != "IS_RMS" and not (rms and k in ("HAS_BIAS", "BIAS_GRAD")):
                out.append(base | {k: True})
    return out


def cases_for(backend: str) -> list:
    """Every config `launch_config` can return with every flag on, in bf16 and fp32; each
    flag alone on the widest single-tile config and the looped one; a float32 residual
    stream; odd-shape (unaligned) and int64-argument specializations."""
    out = {}
    for direction, every in (("fwd", _FWD_ALL), ("bwd", _BWD_ALL)):
        all_cfgs = configs.all_configs(backend, direction)
        for cfg in all_cfgs:
            for dtype in ("bf16", "fp32"):
                c = _case(direction, cfg, dtype, every)
                out[c.label] = c
        widest_tile = max((c for c in all_cfgs if not c.looped), key=lambda c: c.block_cols)
        looped = next(c for c in all_cfgs if c.looped)
        # Unaligned rows (odd widths or strides) switch to the looped kernel at half the width.
        unaligned_tile = configs.launch_config(
            configs.MAX_TILE_COLS[direction] // 2, torch.float32, backend, direction, aligned=False
        )
        for c in (_case(direction, unaligned_tile, "bf16", every, aligned=False),
                  _case(direction, unaligned_tile, "fp32", every, aligned=False, h_dtype="fp32")):  # fmt: skip
            out[c.label] = c
        for cfg in (widest_tile, looped):
            for flags in _flag_variants(direction):
                c = _case(direction, cfg, "bf16", flags)
                out[c.label] = c
            for c in (
                _case(direction, cfg, "fp16", every),
                _case(direction, cfg, "bf16", every, h_dtype="fp32"),
                *([_case(direction, cfg, "bf16", every, aligned=False)] if cfg.looped else []),
                _case(direction, cfg, "bf16", every, int_type="i64"),
            ):
                out[c.label] = c
    return list(out.values())


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_kernels_compile_clean_for_every_config(vendor: str) -> None:
    if triton_interpreting():
        pytest.skip("compile-only checks need TRITON_INTERPRET unset")
    from openkernels.shared.testing.aot import assert_clean, check_cases, format_reports, targets_from_env

    prefix = "sm_" if vendor == "cuda" else "gfx"
    targets = [t for t in targets_from_env() if t.startswith(prefix)]
    if not targets:
        pytest.skip(f"no {vendor} targets in OPENKERNELS_AOT_TARGETS")
    cases = cases_for(vendor)
    reports = check_cases(cases, targets)
    print(format_reports(reports))
    assert_clean(reports)
    assert len(reports) == len(cases) * len(targets)
