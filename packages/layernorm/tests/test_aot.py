"""Ahead-of-time compile checks of the layernorm kernels for every launch config they can
pick, for sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles,
no register spills, no scratch, shared memory within the chip's limit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openkernels.layernorm.triton import configs
from openkernels.shared.platform import triton_interpreting

pytestmark = pytest.mark.aot

_KERNELS = "openkernels.layernorm.triton.kernels"
_TRITON_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
_FWD_INTS = ("n_rows", "n_cols", "stride_x", "stride_res", "stride_out", "stride_res_out")
_BWD_INTS = ("n_rows", "n_cols", "stride_dy", "stride_h", "stride_dh_out", "stride_dh", "rows_per_program")
_FWD_KERNELS = {
    "tile": "_norm_fwd_kernel",
    "split": "_norm_fwd_split_kernel",
    "looped": "_norm_fwd_looped_kernel",
}

# The heaviest variant of each direction: every flag that adds live registers on.
_FWD_ALL = {
    "IS_RMS": False,
    "HAS_RESIDUAL": True,
    "STORE_RESIDUAL": True,
    "HAS_WEIGHT": True,
    "HAS_BIAS": True,
}
_BWD_ALL = {"IS_RMS": False, "HAS_WEIGHT": True, "HAS_DH_OUT": True, "WEIGHT_GRAD": True, "BIAS_GRAD": True}


def _case(direction: str, cfg: configs.NormConfig, dtype: str, flags: dict, *, aligned: bool = True,
          int_type: str = "i32", h_dtype: str | None = None, max_splits: int = 64, even: bool = False):  # fmt: skip
    from openkernels.shared.testing.aot import AotCase

    act, h = _TRITON_DTYPE[dtype], _TRITON_DTYPE[h_dtype or dtype]
    constexprs = dict(flags)
    if direction == "fwd":
        kernel = _FWD_KERNELS[cfg.mode]
        ptrs = {"x_ptr": act, "res_ptr": act, "w_ptr": act, "b_ptr": act, "out_ptr": act,
                "res_out_ptr": h, "mean_ptr": "*fp32", "rstd_ptr": "*fp32"}  # fmt: skip
        ints, floats = _FWD_INTS, ("eps", "weight_offset")
        constexprs["BLOCK_C"] = cfg.block_cols
        if cfg.mode == "tile":
            constexprs.update(
                EVEN_C=even, PERSISTENT=cfg.programs_per_sm > 0, PREFETCH=cfg.prefetch, BLOCK_R=cfg.block_rows
            )
        if cfg.mode == "split":
            ptrs.update(part_ptr="*fp32", arrived_ptr="*i32")
            ints = (*ints, "n_splits")
            constexprs["MAX_SPLITS"] = max_splits
    else:
        kernel = "_norm_bwd_kernel"
        ptrs = {"dy_ptr": act, "h_ptr": h, "w_ptr": act, "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                "dh_out_ptr": h, "dh_ptr": h, "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"}  # fmt: skip
        ints, floats = _BWD_INTS, ("weight_offset",)
        constexprs.update(LOOPED=cfg.looped, EVEN_C=even, PREFETCH=cfg.prefetch, BLOCK_R=cfg.block_rows,
                          BLOCK_C=cfg.block_cols)  # fmt: skip
    signature = {**ptrs, **{i: int_type for i in ints}, **{f: "fp32" for f in floats}}
    # Sizes and strides that are multiples of 16 are what Triton specializes on at launch
    # (the vectorized kernel); `aligned=False` checks the kernel odd shapes get.
    attrs = {i: "D" for i in ints if i.startswith(("n_cols", "stride"))} if aligned else {}
    flag_text = "".join(k[0] + k.split("_")[-1][0] for k, v in flags.items() if v)
    label = (
        f"{direction}-{cfg.mode}-{dtype}{'-h' + h_dtype if h_dtype else ''}-r{cfg.block_rows}c{cfg.block_cols}"
        f"w{cfg.num_warps}{'-p' + str(cfg.programs_per_sm) if cfg.programs_per_sm else ''}"
        f"{'-prefetch' if cfg.prefetch else ''}{'-even' if even else ''}"
        f"{'-s' + str(max_splits) if cfg.mode == 'split' else ''}-{flag_text}"
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


def _with_prefetch(cfg: configs.NormConfig, prefetch: bool) -> configs.NormConfig:
    """The config as picked, and its persistent, prefetching twin (the tuning sweep's other arm)."""
    if prefetch == cfg.prefetch:
        return cfg
    return dataclasses.replace(cfg, prefetch=prefetch, programs_per_sm=cfg.programs_per_sm or 1)


def cases_for(backend: str) -> list:
    """Every config `launch_config` can return, with and without prefetching for the tile
    kernels, every flag on, in bf16 and fp32; each flag alone on the widest config of each
    kernel; fp16 and a float32 residual stream there; odd-shape (unaligned) and int64-argument
    specializations; the split kernel for 1..64 splits."""
    out = {}
    for direction, every in (("fwd", _FWD_ALL), ("bwd", _BWD_ALL)):
        all_cfgs = configs.all_configs(backend, direction)
        tiles = [c for c in all_cfgs if c.mode == "tile"]
        for cfg in all_cfgs:
            for dtype in ("bf16", "fp32"):
                c = _case(direction, cfg, dtype, every)
                out[c.label] = c
            if cfg.mode == "tile":  # n_cols == BLOCK_C: the unmasked specialization
                c = _case(direction, cfg, "bf16", every, even=True)
                out[c.label] = c
        widest = [max(tiles, key=lambda c: c.block_cols)]
        widest += [next(c for c in all_cfgs if c.mode == mode) for mode in ("split", "looped") if
                   any(c.mode == mode for c in all_cfgs)]  # fmt: skip
        for cfg in widest:
            for flags in _flag_variants(direction):
                c = _case(direction, cfg, "bf16", flags)
                out[c.label] = c
            for c in (
                _case(direction, cfg, "fp16", every),
                _case(direction, cfg, "bf16", every, h_dtype="fp32"),
                _case(direction, cfg, "bf16", every, int_type="i64"),
                *([_case(direction, cfg, "bf16", every, aligned=False)] if cfg.mode != "tile" else []),
            ):
                out[c.label] = c
        # Unaligned rows (odd widths or strides) leave the tile at half the width.
        unaligned_tile = configs.launch_config(
            configs.MAX_TILE_COLS[direction] // 2, torch.float32, backend, direction, aligned=False
        )
        # The backward's tile is picked with prefetching at some widths and without at others.
        for prefetch in (False, True) if direction == "bwd" else (False,):
            cfg = _with_prefetch(unaligned_tile, prefetch)
            for c in (_case(direction, cfg, "bf16", every, aligned=False),
                      _case(direction, cfg, "fp32", every, aligned=False, h_dtype="fp32")):  # fmt: skip
                out[c.label] = c
    split = next(c for c in configs.all_configs(backend, "fwd") if c.mode == "split")
    for max_splits in (1, 2, 4, 8, 16, 32):
        c = _case("fwd", split, "bf16", _FWD_ALL, max_splits=max_splits)
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
