"""Ahead-of-time compile checks of the layernorm kernels for every launch config they can
pick, for sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles,
no register spills, no scratch, shared memory within the chip's limit."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from openkernels.layernorm.triton import configs

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
          int_type: str = "i32", h_dtype: str | None = None, max_splits: int = 64, even: bool = False,
          narrow: bool = False):  # fmt: skip
    from openkernels.shared.dev.testing.aot import AotCase

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
            # NARROW: PTX, CUDA only, RMSNorm's forward only (plan.py); ONE_PASS: LayerNorm's
            # chunk statistics in one reduction.
            constexprs.update(MAX_SPLITS=max_splits, NARROW=narrow and flags["IS_RMS"], ONE_PASS=cfg.one_pass)
    else:
        kernel = "_norm_bwd_split_kernel" if cfg.mode == "split" else "_norm_bwd_kernel"
        ptrs = {"dy_ptr": act, "h_ptr": h, "w_ptr": act, "mean_ptr": "*fp32", "rstd_ptr": "*fp32",
                "dh_out_ptr": h, "dh_ptr": h, "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"}  # fmt: skip
        ints, floats = _BWD_INTS, ("weight_offset",)
        if cfg.mode == "split":
            ptrs.update(part_ptr="*fp32", arrived_ptr="*i32")
            ints = (*ints, "n_splits")
            constexprs.update(BLOCK_C=cfg.block_cols, MAX_SPLITS=max_splits, NARROW=narrow)
        else:
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
        f"{'-s' + str(max_splits) if cfg.mode == 'split' else ''}{'-1p' if cfg.one_pass else ''}-{flag_text}"
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
    specializations; the split kernel for 1..64 splits. Each flag alone and fp16 are marked
    `variant` (compiled for each vendor's reference target, aot.REFERENCE_TARGETS)."""
    case = functools.partial(_case, narrow=backend == "cuda")  # as plan.py sets it
    out = {}
    for direction, every in (("fwd", _FWD_ALL), ("bwd", _BWD_ALL)):
        # The split backward picks its chunk per thread by dtype: each config in the dtypes
        # that pick it (the others in bf16 and fp32).
        picked = {d: configs.all_configs(backend, direction, t) for d, t in (("bf16", torch.bfloat16),
                                                                            ("fp32", torch.float32))}  # fmt: skip
        all_cfgs = picked["bf16"]
        tiles = [c for c in all_cfgs if c.mode == "tile"]
        for cfg in {*picked["bf16"], *picked["fp32"]}:
            for dtype in ("bf16", "fp32"):
                # The backward's split and tile configs depend on the dtype: each in the
                # dtypes that pick it (a 16-bit tile spills with float32 rows).
                if cfg.mode == "looped" or direction == "fwd" or cfg in picked[dtype]:
                    c = case(direction, cfg, dtype, every)
                    out[c.label] = c
                if cfg.mode == "split" and cfg in picked[dtype]:  # RMSNorm's flags too (a residual, no bias)
                    rms_flags = {k: v and k not in ("HAS_BIAS", "BIAS_GRAD") for k, v in every.items()}
                    c = case(direction, cfg, dtype, rms_flags | {"IS_RMS": True})
                    out[c.label] = c
            if cfg.mode == "tile":  # n_cols == BLOCK_C: the unmasked specialization
                c = case(direction, cfg, "bf16", every, even=True)
                out[c.label] = c
        widest = [max(tiles, key=lambda c: c.block_cols)]
        widest += [next(c for c in all_cfgs if c.mode == mode) for mode in ("split", "looped") if
                   any(c.mode == mode for c in all_cfgs)]  # fmt: skip
        for cfg in widest:
            # Each flag alone and fp16: variants, compiled for each vendor's reference target
            # (aot.REFERENCE_TARGETS); every flag on, in bf16 and fp32, stays on every target.
            for flags in _flag_variants(direction):
                c = case(direction, cfg, "bf16", flags)
                out.setdefault(c.label, dataclasses.replace(c, variant=True))
            wide_h = cfg  # a float32 h makes the backward pick the float32 config
            if direction == "bwd" and cfg.mode != "looped":
                wide_h = next(
                    c for c in picked["fp32"] if c.mode == cfg.mode and c.block_cols == cfg.block_cols
                )
            for c in (
                dataclasses.replace(case(direction, cfg, "fp16", every), variant=True),
                case(direction, wide_h, "bf16", every, h_dtype="fp32"),
                case(direction, cfg, "bf16", every, int_type="i64"),
                *([case(direction, cfg, "bf16", every, aligned=False)] if cfg.mode != "tile" else []),
            ):
                out[c.label] = c
        if direction == "fwd":
            # LayerNorm's one-pass split forward (configs.SPLIT_FWD_ONE_PASS, off by default):
            # each LayerNorm flag alone, fp16, a float32 residual stream, int64 arguments, and
            # the unaligned config (32 per thread on a 4096-column chunk).
            for cfg in [c for c in all_cfgs if c.mode == "split" and c.one_pass]:
                for flags in _flag_variants(direction):
                    if not flags["IS_RMS"]:
                        c = case(direction, cfg, "bf16", flags)
                        out.setdefault(c.label, dataclasses.replace(c, variant=True))
                for c in (dataclasses.replace(case(direction, cfg, "fp16", every), variant=True),
                          case(direction, cfg, "bf16", every, h_dtype="fp32"),
                          case(direction, cfg, "bf16", every, int_type="i64")):  # fmt: skip
                    out[c.label] = c
            unaligned = configs.launch_config(65536, torch.bfloat16, backend, "fwd", aligned=False, rms=False,
                                              one_pass=True)  # fmt: skip
            c = case("fwd", unaligned, "bf16", every, aligned=False)
            out[c.label] = c
        if direction == "bwd":  # unaligned rows past the tile: the split backward's own configs
            for dtype, t in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                for rms in (True, False):
                    cfg = configs.launch_config(65536, t, backend, "bwd", aligned=False, rms=rms)
                    c = case("bwd", cfg, dtype, every, aligned=False)
                    out[c.label] = c
        # Unaligned rows (odd widths or strides) leave the tile at half the width.
        unaligned_tile = configs.launch_config(
            configs.MAX_TILE_COLS[direction] // 2, torch.float32, backend, direction, aligned=False
        )
        # The backward's tile is picked with prefetching at some widths and without at others.
        for prefetch in (False, True) if direction == "bwd" else (False,):
            cfg = _with_prefetch(unaligned_tile, prefetch)
            narrow = configs.launch_config(cfg.block_cols, torch.bfloat16, backend, direction, aligned=False)
            for c in (case(direction, _with_prefetch(narrow, prefetch), "bf16", every, aligned=False),
                      case(direction, cfg, "fp32", every, aligned=False, h_dtype="fp32")):  # fmt: skip
                out[c.label] = c
    from openkernels.shared.dev.testing.aot import AotCase

    for dtype in ("fp32", "bf16", "fp16"):  # the dweight/dbias reduction, into each parameter dtype
        for even in (False, True):
            c = AotCase(f"{_KERNELS}:_sum_parts_kernel", {"part_ptr": "*fp32", "out_ptr": _TRITON_DTYPE[dtype],
                        "n_parts": "i32", "n_cols": "i32"},
                        {"BLOCK_P": configs.SUM_BLOCK_P, "BLOCK_C": configs.SUM_BLOCK_C, "EVEN_P": even},
                        num_warps=configs.SUM_WARPS, label=f"sum-parts-{dtype}{'-even' if even else ''}")  # fmt: skip
            out[c.label] = c
    split = next(c for c in configs.all_configs(backend, "fwd") if c.mode == "split")
    for max_splits in (1, 2, 4, 8, 16, 32):
        c = case("fwd", split, "bf16", _FWD_ALL, max_splits=max_splits)
        out[c.label] = c
    return list(out.values())


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_kernels_compile_clean_for_every_config(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(cases_for, vendor)


# ---- the persistent backward grid fits in one wave ---------------------------------------

_REGISTERS_PER_SM = 65536  # sm_80 and sm_90
_THREADS_PER_SM = 2048


def _grid_cases() -> list[tuple]:
    """(AotCase, config) of every backward tile config a CUDA call can pick: row widths up to
    the tile's limit, aligned or not, 16-bit or float32 rows (and a float32 h under bf16 dy),
    RMSNorm and LayerNorm, every flag that adds registers on."""
    out = {}
    for aligned in (True, False):
        limit = configs.MAX_TILE_COLS["bwd"] // (1 if aligned else 2)
        for k in range(2, limit.bit_length()):
            for dtype, h_dtype, wider in (("bf16", None, torch.bfloat16), ("fp16", None, torch.float16),
                                          ("fp32", None, torch.float32), ("bf16", "fp32", torch.float32)):  # fmt: skip
                for rms in (True, False):
                    cfg = configs.launch_config(1 << k, wider, "cuda", "bwd", aligned, rms)
                    flags = {**_BWD_ALL, "IS_RMS": rms, "BIAS_GRAD": not rms}
                    c = _case("bwd", cfg, dtype, flags, aligned=aligned, h_dtype=h_dtype)
                    out[(c.label, cfg.programs_per_sm)] = (c, cfg)
    return list(out.values())


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_backward_grid_fits_one_wave(target: str) -> None:
    """The tile backward's persistent grid (programs_per_sm programs per SM, each over a run
    of rows) must be resident at once: registers (allocated in steps of 8 per thread), threads
    and shared memory of programs_per_sm programs within one SM. A grid that asks for more
    runs the rest as a second wave over the first's tail: layernorm 0.11.4's 2048-column tile
    (96 registers, 8 programs where 5 fit) ran at 0.56 of copy on an H100, 0.82-0.85 once
    sized to fit (benchmarks/studies/norm_bwd_occupancy.py)."""
    from openkernels.shared.dev.testing.aot import check_cases, targets_from_env

    if target not in targets_from_env():
        pytest.skip(f"{target} is not in OPENKERNELS_AOT_TARGETS")
    cases = _grid_cases()
    reports = check_cases([c for c, _ in cases], [target])
    problems = []
    for (case, cfg), report in zip(cases, reports):
        if not report.ok:
            problems.append(f"{case.label} on {target}: {'; '.join(report.problems)}")
            continue
        threads = 32 * cfg.num_warps * cfg.programs_per_sm
        registers = -(-report.registers // 8) * 8 * threads
        shared = (report.shared_bytes or 0) * cfg.programs_per_sm
        if registers > _REGISTERS_PER_SM or threads > _THREADS_PER_SM or shared > report.shared_limit:
            problems.append(f"{case.label} x {cfg.programs_per_sm} per SM on {target}: {report.registers} registers, "
                            f"{threads} threads, {shared} B shared")  # fmt: skip
    assert not problems, "persistent backward grids that do not fit on an SM:\n" + "\n".join(problems)


# ---- the JAX specialization: every integer and float argument a constexpr -------------------

_PTR = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "int32": "*i32"}
# SMs / CUs of the chips the persistent grids are sized for (H100/H200, MI300X).
_SM_COUNT = {"cuda": 132, "rocm": 304}
# (rows, cols): the benchmark grid, split and looped rows, and odd (unaligned) widths.
_JAX_FWD_SHAPES = ((32768, 2048), (8192, 8192), (4096, 16384), (1024, 65536), (256, 262144),
                   (8, 2**20 + 16), (4097, 1000), (77, 12001))  # fmt: skip
_JAX_BWD_SHAPES = ((32768, 2048), (8192, 8192), (4096, 16384), (4097, 1000), (77, 12001))


def _jax_case(launch, dtypes: dict, label: str):
    """An AotCase of a `plan.Launch`: pointers typed by the arrays' roles."""
    from openkernels.shared.dev.testing.aot import AotCase

    signature = {p: _PTR[dtypes[role]] for p, role in launch.inputs}
    signature.update({p: _PTR[dt] for p, _, dt in launch.outputs})
    shown = ("BLOCK_R", "BLOCK_C", "PERSISTENT", "PREFETCH", "LOOPED", "n_splits")
    mode = "-".join(f"{k}{v}" for k, v in launch.constants if k in shown)
    return AotCase(
        f"{_KERNELS}:{launch.kernel}",
        signature,
        dict(launch.constants),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        label=f"{label}-{launch.kernel}-{mode}-w{launch.num_warps}",
    )


def jax_cases_for(vendor: str) -> list:
    """The launches openkernels.layernorm.jax makes on the benchmark shapes, long and odd
    rows: LayerNorm with every flag and RMSNorm with a residual stream and weight_offset,
    in bf16; fp32 and a float32 residual stream on one shape."""
    from openkernels.layernorm.triton.plan import bwd_launch, fwd_launch

    sm = _SM_COUNT[vendor]
    out = {}
    variants = [("bfloat16", "bfloat16", shape) for shape in _JAX_FWD_SHAPES]
    variants += [("float32", "float32", (16384, 4096)), ("bfloat16", "float32", (16384, 4096))]
    for dtype, h_dtype, (rows, cols) in variants:
        for rms in (True, False):
            launch = fwd_launch(rows, cols, dtype=dtype, out_dtype=dtype, h_dtype=h_dtype, rms=rms,
                                has_residual=True, store_residual=True, has_weight=True, has_bias=not rms,
                                eps=1e-6, weight_offset=1.0 if rms else 0.0, vendor=vendor,
                                sm_count=sm)  # fmt: skip
            roles = dict.fromkeys(("x", "residual", "weight", "bias"), dtype)
            label = f"jax-fwd-{'rms' if rms else 'ln'}-{dtype}-h{h_dtype}-{rows}x{cols}"
            out[label] = _jax_case(launch, roles, label)
            if (rows, cols) not in _JAX_BWD_SHAPES:
                continue
            launch = bwd_launch(rows, cols, h_dtype=h_dtype, rms=rms, has_weight=True, has_dh_out=True,
                                weight_grad=True, bias_grad=not rms, weight_offset=1.0 if rms else 0.0,
                                vendor=vendor, sm_count=sm)  # fmt: skip
            roles = {"dy": dtype, "h": h_dtype, "weight": dtype, "mean": "float32", "rstd": "float32",
                     "dh_out": h_dtype}  # fmt: skip
            label = f"jax-bwd-{'rms' if rms else 'ln'}-{dtype}-h{h_dtype}-{rows}x{cols}"
            out[label] = _jax_case(launch, roles, label)
    return list(out.values())


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_jax_specializations_compile_clean(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(jax_cases_for, vendor)


def test_forward_launcher_argument_order_matches_the_kernels() -> None:
    """The launcher passes the tile and looped kernels' runtime arguments positionally, in
    _FWD_ARG_NAMES's order, and the split kernel's by those names: a reordered kernel
    signature must fail here, not bind eps to a stride."""
    import inspect

    from openkernels.layernorm import triton as launchers
    from openkernels.layernorm.triton import kernels

    names = launchers._FWD_ARG_NAMES
    for kernel in (kernels._norm_fwd_kernel, kernels._norm_fwd_looped_kernel):
        params = list(inspect.signature(kernel.fn).parameters)
        assert tuple(params[: len(names)]) == names, kernel.fn.__name__
    assert set(names) <= set(inspect.signature(kernels._norm_fwd_split_kernel.fn).parameters)
