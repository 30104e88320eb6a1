"""Ahead-of-time compile checks of every quant kernel and launch config it can pick, for
sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles, no register
spills, no scratch, shared memory within the chip's limit. Signatures mirror the launcher
(triton/__init__.py): absent zeros / bias / NF4 table are the scales pointer, split-K
partials are float32, and sizes/strides that are multiples of 16 get the "D" attribute.

The JAX launcher (openkernels.quant.jax) specializes further: every integer argument is a
constexpr (jax-triton's convention) and the split-K scratch of an unsplit launch is None;
its cases come from the same launch plans (triton/plan.py) that launcher uses."""

from __future__ import annotations

import dataclasses
import re

import pytest

from openkernels.quant.triton import configs, plan

pytestmark = pytest.mark.aot

_KERNELS = "openkernels.quant.triton.kernels"
_T = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _pointers(
    x: str, scales: str, *, zeros: bool, nf4: bool, bias: bool, out: str, split: bool
) -> dict[str, str]:
    return {
        "x_ptr": _T[x], "qw_ptr": "*u8", "s_ptr": _T[scales], "z_ptr": _T[scales],
        "lut_ptr": "*fp32" if nf4 else _T[scales], "bias_ptr": "*fp32" if bias else _T[scales], "out_ptr": _T[out],
        "ws_ptr": "*fp32" if split else _T[out], "counter_ptr": "*i32" if split else _T[out],
    }  # fmt: skip


def _shuffles(family: str) -> bool:
    """Whether the launchers read NF4 levels by a warp shuffle on the family's GPUs (CUDA
    families compile the shuffle, CDNA the table gather), as plan.nf4_shuffle decides."""
    return plan.nf4_shuffle("rocm" if family == "cdna" else "cuda", interpreting=False)


def _linear_case(cfg: configs.LinearConfig, x: str = "bf16", scales: str = "fp16", *, zeros: bool = True,
                 nf4: bool = False, bias: bool = False, split: int = 1, group: int = 128, even_k: bool = True,
                 shuffle: bool = False):  # fmt: skip
    from openkernels.shared.dev.testing.aot import AotCase

    shuffle = shuffle and nf4  # as plan.linear_plan: int4 launches keep NF4_SHUFFLE off
    sig = _pointers(x, scales, zeros=zeros, nf4=nf4, bias=bias, out=x, split=split > 1)
    flags = dict(GROUP=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_ZEROS=zeros, NF4=nf4, HAS_BIAS=bias,
                 SPLIT_K=split, EVEN_K=even_k, NF4_SHUFFLE=shuffle)  # fmt: skip
    if cfg.path == "gemv":
        ints = ("N", "K", "k_per_split", "stride_qn", "stride_sg", "magic")
        kernel = "_int4_linear_gemv_fwd_kernel"
        flags["BLOCK_K"] = min(cfg.block_k, group)  # as plan.linear_plan: a GEMV step inside one group
    else:
        ints = ("M", "N", "K", "k_per_split", "stride_xm", "stride_qn", "stride_sg", "stride_om")
        kernel = "_int4_linear_fwd_kernel"
        flags.update(
            BLOCK_M=cfg.block_m, GROUP_N=cfg.group_n, BITCAST=True, SWAP_AB=cfg.swap_ab, UNROLL=cfg.unroll
        )
    sig.update({i: "i32" for i in ints})
    attrs = {i: "D" for i in ints if i != "M"} if even_k else {}
    label = (f"{cfg.path}{'' if cfg.swap_ab else '-xw'}-m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}-{x}-{scales}"
             f"{'-zeros' if zeros else '-sym'}{'-nf4' if nf4 else ''}{'-shuffle' if shuffle else ''}{'-bias' if bias else ''}-split{split}"
             f"-g{group}{'' if even_k else '-oddk'}")  # fmt: skip
    return AotCase(f"{_KERNELS}:{kernel}", sig, flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                   label=label, attrs=attrs)  # fmt: skip


def _helper_cases(shuffle: bool) -> list:
    from openkernels.shared.dev.testing.aot import AotCase

    cases = []
    for out in ("bf16", "fp16", "fp32"):
        for nf4, zeros in ((False, True), (False, False), (True, False)):
            sig = {"qw_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "lut_ptr": "*fp32" if nf4 else "*fp16",
                   "out_ptr": _T[out], "N": "i32", "K": "i32", "stride_qn": "i32", "stride_sg": "i32",
                   "stride_on": "i32"}  # fmt: skip
            for group in (32, 128, 200):
                cases.append(AotCase(f"{_KERNELS}:_dequantize_int4_fwd_kernel", sig,
                                     dict(GROUP=group, BLOCK_N=64, BLOCK_K=256, HAS_ZEROS=zeros, NF4=nf4,
                                          NF4_SHUFFLE=nf4 and shuffle), num_warps=8,
                                     label=f"dequant-{out}-g{group}{'-nf4' if nf4 else ''}"
                                           f"{'-shuffle' if nf4 and shuffle else ''}{'-zeros' if zeros else ''}"))  # fmt: skip
    return cases


def cases_for(family: str) -> list:
    """Every config the table can return for an arch family (bf16, fp16 scales, zeros, split
    and not), every format and dtype variant on the M=1 and M=16 configs, odd K, and the
    helper kernels; NF4 as the family's launches read its levels (_shuffles)."""
    shuffle = _shuffles(family)
    out = {}
    for cfg in configs.all_configs(family):
        if cfg.path == "dequant":
            continue
        for split in (1, 4) if cfg.block_m <= 64 else (1,):  # the table splits K up to M = 64
            c = _linear_case(cfg, split=split, group=128)
            out[c.label] = c
    for m in (1, 16):
        cfg = configs.linear_config(m, 4096, 4096, 128, family, 132)
        for x in ("bf16", "fp16"):
            for scales in ("fp16", "bf16"):
                for zeros, nf4 in ((True, False), (False, False), (False, True)):
                    for bias in (False, True):
                        c = _linear_case(cfg, x, scales, zeros=zeros, nf4=nf4, bias=bias, shuffle=shuffle)
                        # Each format with bf16 x and scales and a bias on every target; the
                        # other dtypes and no bias are variants (each vendor's reference target).
                        heaviest = x == "bf16" and scales == "bf16" and bias
                        out.setdefault(c.label, c if heaviest else dataclasses.replace(c, variant=True))
        # (group, K): groups of 32 / 64, one group per row (K a power of two, and an odd
        # K = 200 that leaves a masked tail).
        for group, k in ((32, 4096), (64, 4096), (4096, 4096), (200, 200)):
            cfg = configs.linear_config(m, 4096, k, group, family, 132)
            c = _linear_case(cfg, group=configs.kernel_group(group, k), even_k=k % cfg.block_k == 0)
            out[c.label] = c
    # The GEMV on every family: the table picks it on CUDA only, a forced config runs it anywhere.
    gemv = configs.LinearConfig("gemv", 1, 128, 128, 8, 1)
    for zeros, nf4 in ((True, False), (False, True)):
        for split in (1, 4):
            c = _linear_case(gemv, zeros=zeros, nf4=nf4, split=split, shuffle=shuffle)
            out[c.label] = c
    out.update({c.label: c for c in _helper_cases(shuffle)})
    return list(out.values())


_SIZES = (4096, 4096)  # (N, K) of the JAX cases, the table's reference shape


def _jax_linear_case(family: str, m: int, x: str, scales: str, kind: str, zeros: bool, bias: str | None,
                     k: int = 4096, group: int = 128):  # fmt: skip
    """The JAX launch of int4_linear for (M, 4096, k): every integer a constexpr, unread
    inputs the scales, an unsplit launch's scratch None, as openkernels.quant.jax does."""
    from openkernels.shared.dev.testing.aot import AotCase

    n = _SIZES[0]
    cfg = configs.linear_config(m, n, k, group, family, 132)
    p = plan.linear_plan(cfg, m, n, k, group, kind, has_zeros=zeros, has_bias=bias is not None, bitcast=True,
                         shuffle=_shuffles(family))  # fmt: skip
    inputs, outputs, absent = p.pointers()
    types = {"x_ptr": _T[x], "qw_ptr": "*u8", "s_ptr": _T[scales], "z_ptr": _T[scales], "lut_ptr": "*fp32",
             "bias_ptr": _T[bias or "fp32"], "out_ptr": _T[x], "ws_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
    types.update(dict.fromkeys(p.stand_ins(), _T[scales]))
    sig = {name: types[name] for name in (*inputs, *outputs)}
    constexprs = {**p.int_args(k, k // 2, n, n), **dict.fromkeys(absent), **p.flags}
    label = (f"jax-{cfg.path}-m{m}-k{k}-g{group}-bm{cfg.block_m}k{cfg.block_k}-split{p.splits}-{x}-{scales}-{kind}"
             f"{'-shuffle' if p.flags['NF4_SHUFFLE'] else ''}"
             f"{'-zeros' if zeros else ''}{f'-bias{bias}' if bias else ''}")  # fmt: skip
    return AotCase(f"{_KERNELS}:{p.kernel}", sig, constexprs, num_warps=p.num_warps, num_stages=p.num_stages,
                   label=label)  # fmt: skip


def _jax_dequant_case(family: str, out: str, kind: str, zeros: bool):
    from openkernels.shared.dev.testing.aot import AotCase

    n, k = _SIZES
    p = plan.dequant_plan(n, k, 128, kind, has_zeros=zeros, shuffle=_shuffles(family))
    inputs, outputs, absent = p.pointers()
    types = {"qw_ptr": "*u8", "s_ptr": "*bf16", "z_ptr": "*bf16", "lut_ptr": "*fp32", "out_ptr": _T[out]}
    types.update(dict.fromkeys(p.stand_ins(), "*bf16"))
    constexprs = {**p.int_args(k // 2, n, k), **dict.fromkeys(absent), **p.flags}
    return AotCase(f"{_KERNELS}:{p.kernel}", {name: types[name] for name in (*inputs, *outputs)}, constexprs,
                   num_warps=p.num_warps,
                   label=f"jax-dequant-{out}-{kind}{'-shuffle' if p.flags['NF4_SHUFFLE'] else ''}"
                         f"{'-zeros' if zeros else ''}")  # fmt: skip


def jax_cases_for(family: str) -> list:
    """A few JAX specializations per arch family: M = 1 and 16 (split K), 128 (no split,
    Hopper's unrolled tiles), a whole-row group with odd K (masked tail), and the dequantize
    kernel of the large-M path (int4, and NF4 by the family's level lookup)."""
    return [
        _jax_linear_case(family, 1, "bf16", "fp16", "int4", True, None),
        _jax_linear_case(family, 1, "bf16", "bf16", "nf4", False, None, group=64),
        _jax_linear_case(family, 16, "fp16", "bf16", "nf4", False, "bf16"),
        _jax_linear_case(family, 128, "bf16", "bf16", "int4", False, "fp32"),
        _jax_linear_case(family, 16, "bf16", "fp16", "int4", True, "fp32", k=200, group=200),
        _jax_dequant_case(family, "bf16", "int4", True),
        _jax_dequant_case(family, "bf16", "nf4", False),
    ]


# The configs of an arch family run only on its archs: Hopper's tiles on sm_90 (they would
# spill with sm_80's register-operand MMA), Ampere's on sm_80, CDNA's on every gfx target.
FAMILY_TARGETS = {"hopper": ("sm_90",), "ampere": ("sm_80",), "cdna": ("gfx90a", "gfx942", "gfx950")}


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_kernels_compile_clean_for_every_config(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(cases_for, vendor, target_groups=FAMILY_TARGETS)


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_jax_specializations_compile_clean(vendor: str) -> None:
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(jax_cases_for, vendor, target_groups=FAMILY_TARGETS)


# ---- NF4 levels by warp shuffle (issue 24): the variants the CUDA launches run -------------

_NF4_SHAPES = (  # (M, N, K, group): the study's shapes (GEMV and tiled), a whole-row odd K
    (1, 8192, 8192, 64),
    (1, 28672, 8192, 128),
    (4, 8192, 8192, 64),
    (16, 28672, 8192, 128),
    (16, 4096, 200, 200),
)


def _nf4_launch_case(family: str, m: int, n: int, k: int, group: int, x: str = "bf16", scales: str = "fp16",
                     bias: str | None = None, gather: bool = False):  # fmt: skip
    """The PyTorch launch of int4_linear for an NF4 weight, straight from plan.linear_plan: its
    constexprs, stand-ins, the output in place of an unsplit launch's scratch, and "D" on the
    integers a launch specializes (multiples of 16). gather: LinearConfig.nf4_gather."""
    from dataclasses import replace

    from openkernels.shared.dev.testing.aot import AotCase

    cfg = replace(configs.linear_config(m, n, k, group, family, 132, "nf4"), nf4_gather=gather)
    p = plan.linear_plan(cfg, m, n, k, group, "nf4", has_zeros=False, has_bias=bias is not None, bitcast=True,
                         shuffle=_shuffles(family))  # fmt: skip
    inputs, outputs, absent = p.pointers()
    types = {"x_ptr": _T[x], "qw_ptr": "*u8", "s_ptr": _T[scales], "lut_ptr": "*fp32", "bias_ptr": _T[bias or "fp32"],
             "out_ptr": _T[x], "ws_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
    types.update(dict.fromkeys(p.stand_ins(), _T[scales]))
    types.update(dict.fromkeys(absent, _T[x]))
    ints = p.int_args(k, k // 2, n, n)
    sig = {**{name: types[name] for name in (*inputs, *outputs, *absent)}, **dict.fromkeys(ints, "i32")}
    attrs = {name: "D" for name, value in ints.items() if value % 16 == 0}
    label = (f"nf4-{cfg.path}-m{m}-{n}x{k}-g{group}-split{p.splits}-{x}-{scales}{f'-bias{bias}' if bias else ''}"
             f"{'-shuffle' if p.flags['NF4_SHUFFLE'] else '-gather'}")  # fmt: skip
    return AotCase(f"{_KERNELS}:{p.kernel}", sig, p.flags, num_warps=p.num_warps, num_stages=p.num_stages,
                   label=label, attrs=attrs)  # fmt: skip


def nf4_shuffle_cases(family: str) -> list:
    """The NF4 launches of a CUDA family with levels by warp shuffle: the table's M = 1 GEMV
    (split 16) and tiled M = 4 / 16 configs at the study's shapes, bf16 and fp16 x, a bias,
    a masked tail; the dequantize kernel. Plus the gather the A/B override still runs there."""
    from openkernels.shared.dev.testing.aot import AotCase

    cases = [_nf4_launch_case(family, *shape) for shape in _NF4_SHAPES]
    cases += [_nf4_launch_case(family, 1, 8192, 8192, 64, "fp16", "bf16", "bf16"),
              _nf4_launch_case(family, 16, 8192, 8192, 64, "fp16", "fp16", "fp32")]  # fmt: skip
    assert all(c.constexprs["NF4_SHUFFLE"] for c in cases), f"{family}: a launch without the shuffle"
    cases += [_nf4_launch_case(family, m, 8192, 8192, 64, gather=True) for m in (1, 16)]
    for out in ("bf16", "fp16", "fp32"):
        p = plan.dequant_plan(8192, 8192, 64, "nf4", has_zeros=False, shuffle=_shuffles(family))
        sig = {"qw_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "lut_ptr": "*fp32", "out_ptr": _T[out],
               **dict.fromkeys(("N", "K", "stride_qn", "stride_sg", "stride_on"), "i32")}  # fmt: skip
        cases.append(AotCase(f"{_KERNELS}:{p.kernel}", sig, p.flags, num_warps=p.num_warps,
                             label=f"nf4-dequant-{out}-shuffle", attrs={}))  # fmt: skip
    return cases


def test_nf4_shuffle_compiles_clean_for_cuda() -> None:
    """Every NF4 launch the CUDA families run takes its levels by warp shuffle (inline PTX)
    and compiles for sm_80 / sm_90 with no spills and no scratch."""
    from openkernels.shared.dev.testing.aot import check_vendor

    check_vendor(nf4_shuffle_cases, "cuda", target_groups={"hopper": ("sm_90",), "ampere": ("sm_80",)})


def test_nf4_lookup_by_platform() -> None:
    """NVIDIA launches shuffle, ROCm and the interpreter gather, int4 never sets the flag, and
    LinearConfig.nf4_gather overrides the shuffle."""
    assert plan.nf4_shuffle("cuda", interpreting=False)
    assert not plan.nf4_shuffle("cuda", interpreting=True)
    assert not plan.nf4_shuffle("rocm", interpreting=False)
    assert not plan.nf4_shuffle("cpu", interpreting=True)
    for family in ("hopper", "ampere", "cdna"):
        for m in (1, 16):
            cfg = configs.linear_config(m, 4096, 4096, 64, family, 132, "nf4")
            for kind in ("int4", "nf4"):
                p = plan.linear_plan(cfg, m, 4096, 4096, 64, kind, has_zeros=kind == "int4", has_bias=False,
                                     bitcast=True, shuffle=_shuffles(family))  # fmt: skip
                assert p.flags["NF4_SHUFFLE"] == (kind == "nf4" and family != "cdna"), (family, m, kind)
        d = plan.dequant_plan(4096, 4096, 64, "nf4", has_zeros=False, shuffle=_shuffles(family))
        assert d.flags["NF4_SHUFFLE"] == (family != "cdna")
    cfg = configs.LinearConfig("gemv", 1, 128, 64, 8, 1, 16, nf4_gather=True)
    p = plan.linear_plan(
        cfg, 1, 4096, 4096, 64, "nf4", has_zeros=False, has_bias=False, bitcast=True, shuffle=True
    )
    assert not p.flags["NF4_SHUFFLE"]


def _ptx(case, arch: int) -> str:
    """The PTX of an AotCase for sm_<arch>, compiled in this process into a throw-away cache."""
    import os
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from openkernels.quant.triton import kernels

    fn = getattr(kernels, case.kernel.rpartition(":")[2])
    constexprs = dict(case.constexprs)
    signature = {name: "constexpr" if name in constexprs else case.signature[name] for name in fn.arg_names}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    descs = {
        **{n: "D" for n, t in signature.items() if t.startswith("*")},
        **(case.attrs or {}),
    }  # as the AOT check
    attrs = {(fn.arg_names.index(n),): backend.parse_attr(d) for n, d in descs.items()}
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="openkernels-quant-ptx-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp
        try:
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            kernel = triton.compile(src, target=target,
                                    options={"num_warps": case.num_warps, "num_stages": case.num_stages})  # fmt: skip
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    return kernel.asm["ptx"]


@pytest.mark.parametrize("m", [1, 16], ids=["gemv", "tiled"])
def test_nf4_shuffle_replaces_the_gather_in_ptx(m: int) -> None:
    """The shuffle variant reads each level by shfl.sync.idx from a lane-indexed register
    (%laneid read once) and issues fewer reads of global memory (loads, and the tiled
    kernel's cp.async copies, which its pipeline makes of the gathers too) than the gather
    variant; the gather variant has no indexed shuffle (its reductions use shfl.sync.bfly)."""
    from openkernels.shared.platform import triton_interpreting

    if triton_interpreting():
        pytest.skip("compile-only checks need TRITON_INTERPRET unset")
    shuffle = _ptx(_nf4_launch_case("hopper", m, 8192, 8192, 64), 90)
    gather = _ptx(_nf4_launch_case("hopper", m, 8192, 8192, 64, gather=True), 90)
    assert shuffle.count("%laneid") >= 1 and shuffle.count("shfl.sync.idx.b32") >= 8
    assert "shfl.sync.idx" not in gather
    reads = [
        len(re.findall(r"\b(?:ld\.global|cp\.async\.c[ag]\.shared\.global)\b", ptx))
        for ptx in (shuffle, gather)
    ]
    assert reads[0] + 16 <= reads[1], f"reads of global memory: shuffle {reads[0]}, gather {reads[1]}"


# ---- the Gluon Hopper kernel (issue 24): sm_90 only ------------------------------------------


def test_gluon_wgmma_compiles_clean_for_sm90() -> None:
    """Every config the wgmma launcher picks and the study sweeps, every dtype / format
    variant: compiles for sm_90a with no spills and no scratch, shared memory within 227 KiB."""
    from openkernels.shared.dev.testing.aot import check_vendor

    from .aot_gluon_cases import cases_for as gluon_cases_for

    check_vendor(gluon_cases_for, "cuda", target_groups={"hopper": ("sm_90",)})


def gluon_compile(case):
    """The compiled Gluon AotCase for sm_90a (in this process, a throw-away cache) and the
    ptxas -v log."""
    import contextlib
    import importlib
    import io
    import os
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    module, _, name = case.kernel.rpartition(":")
    fn = getattr(importlib.import_module(module), name)
    signature = {n: "constexpr" if n in case.constexprs else case.signature[n] for n in fn.arg_names}
    old = os.environ.get("TRITON_CACHE_DIR")
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="openkernels-quant-ptx-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp
        try:
            src = GluonASTSource(fn=fn, signature=signature, constexprs=dict(case.constexprs), attrs={})
            with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(log):
                triton.knobs.nvidia.dump_ptxas_log = True
                kernel = triton.compile(
                    src, target=GPUTarget("cuda", 90, 32), options={"num_warps": case.num_warps}
                )
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    return kernel, log.getvalue()


def sass_of(kernel) -> str:
    """nvdisasm's listing of a compiled kernel's cubin (the wheel's nvdisasm)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    with tempfile.TemporaryDirectory(prefix="openkernels-quant-sass-") as tmp:
        cubin = Path(tmp, "k.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip


def _sass_instructions(sass: str) -> list[tuple[bool, str]]:
    """(is an instruction, text) per line: instructions without their predicate, labels."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if m:
            out.append((True, re.sub(r"^@!?U?P\w+\s+", "", m.group(1))))
        elif re.match(r"\.L_x_\d+:", line.strip()):
            out.append((False, line.strip()[:-1]))
    return out


def a_register_hazards(sass: str, trips: int = 3) -> tuple[list[str], list[list[int]]]:
    """Writes, by any non-wgmma instruction, to a register holding the A operand of a wgmma
    group that has not retired (PTX: undefined behaviour), over `trips` passes of the loop
    that holds the first HGMMA; and the A-register sets of that loop's groups. A group ends
    at the HGMMA marked gsb0; WARPGROUP.DEPBAR.LE gsb0, n retires all but the last n."""
    ins = _sass_instructions(sass)
    labels = {text: i for i, (real, text) in enumerate(ins) if not real}
    first = next(i for i, (real, text) in enumerate(ins) if real and text.startswith("HGMMA"))
    for end in range(first, len(ins)):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", ins[end][1])
        if ins[end][0] and m and labels[m.group(1)] < first:
            start = labels[m.group(1)]
            break
    loop = [text for real, text in ins[start : end + 1] if real]
    pending: list[set[int]] = []
    current: set[int] = set()
    groups: list[list[int]] = []
    hazards = []
    for trip in range(trips):
        for text in loop:
            op, _, rest = text.partition(" ")
            if op.startswith("HGMMA"):
                a = re.fullmatch(r"R(\d+)", rest.split(",")[1].strip())
                if a:
                    current |= set(
                        range(int(a.group(1)), int(a.group(1)) + 4)
                    )  # 4 registers per m64k16 fragment
                if "gsb0" in rest:
                    pending.append(current)
                    if trip == 0:
                        groups.append(sorted(current))
                    current = set()
            elif op.startswith("WARPGROUP.DEPBAR"):
                keep = int(rest.split(",")[-1], 0)
                del pending[: max(0, len(pending) - keep)]
            else:
                dst = re.fullmatch(r"R(\d+)", rest.split(",")[0].strip())
                if dst:
                    width = 4 if ".128" in op else 2 if ".64" in op else 1
                    written = set(range(int(dst.group(1)), int(dst.group(1)) + width))
                    if any(written & g for g in pending):
                        hazards.append(f"trip {trip}: {text}")
    return hazards, groups


def _wgmma_configs() -> list:
    from openkernels.quant import gluon

    split = [gluon.WgmmaConfig(128, 64, 128, 3, 2, 2), gluon.WgmmaConfig(16, 64, 128, 3, 2, 4)]
    return list(
        dict.fromkeys(
            [
                *gluon.all_configs(),
                *(c for m in (16, 64, 128) for c in gluon.sweep_configs(m)),
                *split,
                *gluon.PERSISTENT_STUDY,
            ]
        )
    )


@pytest.mark.parametrize("cfg", _wgmma_configs(), ids=str)
def test_gluon_wgmma_overlaps_in_ptx(cfg) -> None:
    """Every config the launcher picks or the study sweeps. The PTX: two K steps per loop trip
    and a tail step, each issuing its wgmma asynchronously and waiting with one group
    outstanding (the dequantization of the next step runs under the product), one final wait
    for none; the codes read from shared memory as 16-byte words, no layout conversion
    through shared memory before the epilogue (no st.shared / stmatrix); a CTA-wide bar.sync
    between each wait and the refill's TMA (the compiler's shared-memory hazard barrier: with
    two warpgroups (128-row weight tiles, 8 warps) each waits for its own wgmma only, and the
    barrier is what keeps the other's reads of the stage before the refill). ptxas: no wgmma
    serialization advisory. The SASS: the two steps' A operands in disjoint registers, and no
    instruction writes a register of a wgmma group's A operand before the wait that retires it."""
    from openkernels.quant import gluon
    from openkernels.shared.platform import triton_interpreting

    from .aot_gluon_cases import wgmma_case

    if triton_interpreting():
        pytest.skip("compile-only checks need TRITON_INTERPRET unset")
    kernel, log = gluon_compile(wgmma_case(cfg))
    ptx = kernel.asm["ptx"]
    steps = cfg.block_k // 16
    assert ptx.count("wgmma.mma_async") == 3 * steps
    assert ptx.count("wgmma.wait_group.sync.aligned 1") == 3
    assert ptx.count("wgmma.wait_group.sync.aligned 0") == 1
    body = ptx[ptx.index("mbarrier.try_wait") : ptx.index("wgmma.wait_group.sync.aligned 0")]
    assert "st.shared" not in body and "stmatrix" not in body
    # The codes as 16-byte words: each thread reads its two rows' BLOCK_K / 2 bytes per step.
    assert body.count("ld.shared.v4.b32") == body.count("ld.shared") == 3 * 2 * (cfg.block_k // 2) // 16
    for part in body.split("wgmma.wait_group.sync.aligned 1")[1:]:
        if "cp.async.bulk.tensor" in part:
            assert part.index("bar.sync") < part.index("cp.async.bulk.tensor")
    assert "C7515" not in log and "serialized" not in log, log  # ptxas would serialize the wgmma
    assert int(kernel.metadata.shared) <= gluon.SMEM_LIMIT
    hazards, groups = a_register_hazards(sass_of(kernel))
    assert len(groups) == 2 and not set(groups[0]) & set(groups[1]), groups
    assert not hazards, hazards[:5]
