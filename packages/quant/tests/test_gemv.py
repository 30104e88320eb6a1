"""The CUDA C++ batch-1 GEMV (cuda/int4_gemv.cu): its compile check for sm_80 and sm_90 (no
GPU: every kernel compiles without spills), which calls it takes, and its results within the
error contract: on the CPU through the CUDA emulation (the same source built against
shared/cuda/cuda_emulation.h), on a GPU at the decode shapes. The whole correctness suite
also runs it on GPUs (test_correctness's "cuda-gemv" target). The persistent GEMV (config
"persistent...") is checked alike: every (rows, depth) built, grids that do not divide the
blocks, K past one CTA-wide step; the persistent tensor-core kernel (config
"mma-persistent...") alike for 1-16 rows of x, and the tensor-core GEMV (config "tc...", W as
the A operand) for every shape built."""

from __future__ import annotations

import functools
import re
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from openkernels.quant import cuda as G
from openkernels.quant.format import tile_codes, untile_codes
from openkernels.shared import cuda_build, dispatch
from openkernels.shared.dispatch import DispatchKey

from .cases import FORMATS, assert_linear_close, make_weight, quantize


@functools.cache
def _ptxas_builds() -> dict[str, list[Future]]:
    """The builds' ptxas reports for each asked arch, every nvcc run side by side (one process
    each; cold, 20-45 s apiece): the first arch's test starts them all, so the runs share the
    two cores instead of three with a tail each. The NF4 build with the register lookup in its
    kernels (TC_NF4_LOOKUP "registers", a study's variant) on sm_90 only, the
    reference target of variants (shared.dev.testing.aot)."""
    from openkernels.shared.dev.testing.aot import targets_from_env

    builds = ((G._SOURCE, ()), (G._TC_SOURCE, ()), (G._TC_SOURCE, ("-DOK_TC_NF4",)))
    registers = (G._TC_SOURCE, ("-DOK_TC_NF4", "-DOK_TC_NF4_REGISTERS"))
    archs = [a for a in ("sm_80", "sm_90") if a in targets_from_env()]
    per_arch = {a: builds + ((registers,) if a == "sm_90" else ()) for a in archs}
    with ThreadPoolExecutor(sum(len(b) for b in per_arch.values())) as pool:
        return {
            a: [pool.submit(cuda_build.ptxas_report, src, a, flags) for src, flags in per_arch[a]]
            for a in archs
        }


@pytest.mark.aot
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_compiles_without_spills(arch: str) -> None:
    from openkernels.shared.dev.testing.aot import targets_from_env

    if arch not in targets_from_env():
        pytest.skip(f"{arch} is not among the AOT targets")
    if cuda_build.nvcc() is None:  # the CI image has nvcc (13.0): this skip is for other machines
        pytest.skip("no nvcc: the CUDA C++ compile check cannot run here")
    report, tc_all, *nf4_builds = (future.result() for future in _ptxas_builds()[arch])
    kernels = [r for r in report if "int4_gemv_kernel" in r.name]
    assert len(kernels) == 4 * len(G.ROWS) * 3, [r.name for r in kernels]  # dtype pairs x rows x kinds
    mma = [r for r in report if "int4_mma_kernel" in r.name]
    assert len(mma) == 4 * 2, [r.name for r in mma]  # dtype pairs x (zeros, symmetric)
    persistent = [r for r in report if "int4_gemv_persistent_kernel" in r.name]
    # dtype pairs x (rows, depth) x kinds x (x in registers or not)
    assert len(persistent) == 4 * len(G.PERSISTENT_SHAPES) * 3 * 2, [r.name for r in persistent]
    mma_persistent = [r for r in report if "int4_mma_persistent_kernel" in r.name]
    # dtype pairs x (zeros, symmetric) x (columns, depth)
    assert len(mma_persistent) == 4 * 2 * len(G.MMA_PERSISTENT_SHAPES), [r.name for r in mma_persistent]
    # tc_all: int4_tc.cu, the tensor-core GEMV's own library
    tc = [r for r in tc_all if "int4_tc_kernel" in r.name]
    # dtype pairs x shapes x (one n8 tile of x with PDL or without, two tiles without, the x split,
    # the gated build: act(gate) * up in the x loads, the normed build: x's RMSNorm in them)
    assert len(tc) == 4 * len(G.TC_SHAPES) * 6, [r.name for r in tc_all]
    ring = [r for r in tc_all if "int4_tc_ring_kernel" in r.name]  # sm_80: empty bodies (no bulk copies)
    assert len(ring) == 4 * len(G.TCR_SHAPES), [r.name for r in tc_all]
    split = [r for r in tc_all if "int4_tc_split_kernel" in r.name]  # sm_80: empty bodies (no clusters)
    assert len(split) == 4 * len(G.TC_SHAPES) * 3, [r.name for r in tc_all]  # PDL or not, gated
    assert len(tc_all) == len(tc) + len(ring) + len(split), [r.name for r in tc_all]
    tc += ring + split
    for r in kernels + mma + persistent + mma_persistent + tc:
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
        assert r.odd_descriptors <= 0, r  # an odd uniform register for a descriptor: illegal on the GPU
    x_split = [r for r in tc if re.search(r"int4_tc_kernel.*ELb0ELi2ELi0EE", r.name)]
    # the one-tile builds, with a prologue (gated, normed) or without, stay within two CTAs per SM
    prologue = [r for r in tc if re.search(r"int4_tc_kernel\w*?Li\dELi1ELi\dELb0ELi1ELi[012]EE", r.name)]
    assert len(prologue) == 4 * len(G.TC_SHAPES) * 3 and all(r.registers <= 128 for r in prologue), prologue
    assert len(x_split) == 4 * len(G.TC_SHAPES), [r.name for r in tc]
    assert all(r.registers <= 128 for r in x_split), x_split  # two CTAs per SM, as the one-tile builds
    # The NF4 builds (-DOK_TC_NF4, the table in shared memory; on sm_90 also the register
    # lookup): the register, two-tile, x-split and split kernels, no dependent launch, ring or
    # gated build; their one-tile builds within two CTAs per SM, as int4's.
    assert len(nf4_builds) == (2 if arch == "sm_90" else 1)
    for nf4 in nf4_builds:
        assert len(nf4) == 4 * len(G.TC_SHAPES) * 4, [r.name for r in nf4]
        pdl = r"int4_tc_kernel\w*?Li\d+ELi\d+ELi\d+ELb1E"  # <T, S, TILES, NB, UNROLL, PDL = true, ...>
        assert not [r for r in nf4 if "ring" in r.name or re.search(pdl, r.name)], nf4
        for r in nf4:
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
        one_tile = [r for r in nf4 if re.search(r"int4_tc_kernel\w*?Li\dELi1ELi\dELb0", r.name)]
        assert len(one_tile) == 4 * len(G.TC_SHAPES) * 2 and all(r.registers <= 128 for r in one_tile), (
            one_tile
        )
    for r in persistent:  # 2 CTAs of 256 threads per SM where the shape's default says so
        rows, depth = (int(v) for v in re.search(r"Li(\d+)ELi(\d+)ELi\d+ELb", r.name).groups())
        assert G.PERSISTENT_SHAPES[(rows, depth)] == 1 or r.registers <= 128, r


def _call(n=64, k=1024, group=128, *, m=1, dtype=torch.bfloat16, sdtype=torch.float16, zeros=True, offset=0,
          tiled=False):  # fmt: skip
    x = torch.empty(m, k + offset, dtype=dtype)[:, offset:]
    qweight = (
        torch.empty(n // 16, k // 128, 1024, dtype=torch.uint8)
        if tiled
        else torch.empty(n, k // 2, dtype=torch.uint8)
    )
    scales = torch.empty(k // group, n, dtype=sdtype)
    z = torch.empty_like(scales) if zeros else None
    out = torch.empty(m, n, dtype=dtype)
    return x, qweight, scales, z, None, out, group, "int4"


def test_which_calls_the_gemv_takes() -> None:
    assert G.unsupported_call(*_call()) is None
    assert G.unsupported_call(*_call(n=36)) is None  # 4 rows per CTA
    assert G.unsupported_call(*_call(m=2)) is None  # the tensor-core kernel
    assert G.unsupported_call(*_call(m=16)) is None
    assert "rows of x" in G.unsupported_call(*_call(m=17))
    assert "multiple of 32" in G.unsupported_call(*_call(m=2, n=40))
    assert "multiple of 128" in G.unsupported_call(*_call(m=2, k=1056, group=32))
    nf4 = list(_call(m=2))
    nf4[-1] = "nf4"
    assert "NF4" in G.unsupported_call(*nf4)
    assert "multiple of 32" in G.unsupported_call(*_call(k=1024, group=16))
    assert "multiple of 4" in G.unsupported_call(*_call(n=66))
    assert "aligned" in G.unsupported_call(*_call(offset=4))
    assert "dtypes" in G.unsupported_call(*_call(dtype=torch.float32))
    assert (
        G.gemv_rows(64) == 8
        and G.gemv_rows(36) == 4
        and G.gemv_rows(64, 4) == 4
        and G.gemv_rows(36, 8) is None
    )


def test_persistent_configs() -> None:
    assert G.persistent_config(8) is None and G.persistent_config("mma") is None
    assert G.persistent_config("persistent") == G.PersistentConfig(4, 2, None, None)
    assert G.persistent_config("persistent-r8-d1-c1") == G.PersistentConfig(8, 1, 1, None)
    assert G.persistent_config("persistent-r2-d4-g3") == G.PersistentConfig(2, 4, None, 3)
    for name in G.PERSISTENT_CONFIGS:
        assert G.persistent_config(name) is not None
    for bad in ("persistent-r8-d2", "persistent-r3", "persistent-c0", "persistent-x"):
        with pytest.raises(ValueError):
            G.persistent_config(bad)
    assert G.PersistentConfig(4, 2).grid_for(2048, 132) == 264  # 2 CTAs per SM
    assert G.PersistentConfig(8, 1).grid_for(1024, 132) == 132
    assert G.PersistentConfig(4, 2, 3).grid_for(100, 132) == 100  # never more CTAs than blocks
    assert G.PersistentConfig(4, 2, None, 5).grid_for(100, 132) == 5
    assert G.unsupported_call(*_call(n=36), "persistent") is None
    assert "multiple of 8" in G.unsupported_call(*_call(n=36), "persistent-r8-d1")
    assert G.unsupported_call(*_call(n=38), "persistent-r2-d4") is None
    assert "rows of x" in G.unsupported_call(*_call(m=2), "persistent")
    assert "multiple of 32" in G.unsupported_call(*_call(k=1024, group=16), "persistent")


def test_mma_persistent_configs() -> None:
    assert G.mma_persistent_config("mma") is None and G.mma_persistent_config("persistent") is None
    assert G.mma_persistent_config("mma-persistent") == G.MmaPersistentConfig(32, 8, None, None)
    assert G.mma_persistent_config("mma-persistent-n64") == G.MmaPersistentConfig(64, 4, None, None)
    assert G.mma_persistent_config("mma-persistent-n32-d4-c2") == G.MmaPersistentConfig(32, 4, 2, None)
    assert G.mma_persistent_config("mma-persistent-n64-d2-g3") == G.MmaPersistentConfig(64, 2, None, 3)
    for name in G.MMA_PERSISTENT_CONFIGS:
        assert G.mma_persistent_config(name) is not None
    for bad in ("n48", "d3", "c0", "g0", "x"):
        with pytest.raises(ValueError):
            G.mma_persistent_config(f"mma-persistent-{bad}")
    assert G.MmaPersistentConfig(32, 8).grid_for(256, 132) == 132  # one CTA per SM
    assert G.MmaPersistentConfig(32, 4, 2).grid_for(256, 132) == 256
    assert G.MmaPersistentConfig(64, 4, 2).grid_for(100, 132) == 100  # never more CTAs than tiles
    assert G.MmaPersistentConfig(64, 2, None, 5).grid_for(100, 132) == 5
    assert G.unsupported_call(*_call(m=16, n=96), "mma-persistent") is None
    assert G.unsupported_call(*_call(m=1, n=96), "mma-persistent") is None
    assert "multiple of 64" in G.unsupported_call(*_call(m=16, n=96), "mma-persistent-n64")
    assert "multiple of 128" in G.unsupported_call(*_call(m=2, k=1056, group=32), "mma-persistent")
    assert "rows of x" in G.unsupported_call(*_call(m=17), "mma-persistent")
    nf4 = list(_call(m=2))
    nf4[-1] = "nf4"
    assert "NF4" in G.unsupported_call(*nf4, "mma-persistent")
    misaligned = list(_call(m=2, n=128))
    misaligned[2] = torch.empty(8, 132, dtype=torch.float16)[:, 4:]  # rows start 8 bytes in
    assert "aligned" in G.unsupported_call(*misaligned, "mma-persistent-n64")
    assert G.unsupported_call(*misaligned, "mma-persistent-n32") is None


def test_dispatch_puts_the_gemv_first_and_routes_by_shape() -> None:
    """ "gemv" is above wgmma and Triton; its launcher runs the tensor-core GEMV only where it
    measured fastest (sm_90, up to 8 rows of x; 9-16 rows with the one-round kernel) and hands
    every other call on."""
    key = DispatchKey("cuda", "sm_90", torch.bfloat16, frozenset({"int4"}))
    if G.supports(key) is None:
        chosen = [impl.name for impl in dispatch.select("int4_linear", key)]
        assert chosen[0] == "gemv" and chosen.index("triton") > 0, chosen
    assert G.default_tc(1, 8192, 8192, 128, "sm_90") is not None
    assert G.default_tc(8, 28672, 8192, 64, "sm_90") is not None
    assert G.default_tc(9, 8192, 8192, 128, "sm_90") is None  # M > 8: wgmma or Triton
    assert G.default_tc(1, 8192, 8192, 128, "sm_80") is None  # not measured there
    assert G.default_tc(1, 8192, 8224, 32, "sm_90") is None  # K not a multiple of 128
    assert G.default_tc(1, 2048, 2048, 128, "sm_90") == "tc-t1-u2"  # the 1B model's shapes
    assert G.default_tc(4, 16384, 2048, 128, "sm_90") == "tc-t4-u1"
    assert G.default_tc(1, 2048, 8192, 128, "sm_90") == "tc-t1-u2-k2"  # the down projection: K split
    assert G.default_tc(8, 2048, 8192, 128, "sm_90") == "tc-t1-u2-k2"
    assert G.default_tc(1, 4096, 8192, 128, "sm_90") == "tc-t2-u2-k2"
    assert G.default_tc(4, 8192, 8192, 128, "sm_90") == "tc-t4-u1-k2"
    assert G.default_tc(1, 8192 + 32, 8192, 128, "sm_90") == "tc-t2-u2"  # N not a multiple of 64
    assert G.default_tc(1, 28672, 8192, 128, "sm_90") == "tc-t4-u1"
    assert G.default_tc(1, 8192, 2048, 128, "sm_90") == "tc-t2-u2"  # K = 2048: no split
    assert G.default_tc(1, 8192, 1024, 128, "sm_90") is None  # K below 2048: not measured
    # 9-16 rows: the two-tile tensor-core GEMV, t1-u2 to N = 2048 and t4-u1 from 8192; between
    # them the one-round kernel where wgmma would hand the call to Triton, else wgmma.
    assert G.default_config(4, 16384, 2048, 128, "sm_90") == G.default_tc(4, 16384, 2048, 128, "sm_90")
    assert G.default_config(16, 2048, 2048, 128, "sm_90") == "tc-t1-u2"
    assert G.default_config(9, 2048, 8192, 128, "sm_90") == "tc-t1-u2"
    assert G.default_config(16, 16384, 2048, 128, "sm_90") == "tc-t4-u1"
    assert G.default_config(16, 8192, 8192, 128, "sm_90") == "tc-t4-u1"
    assert G.default_config(16, 28672, 8192, 128, "sm_90") == "tc-t4-u1"  # float16 scales, bfloat16 x
    assert G.default_config(16, 28672, 8192, 128, "sm_90", scales_in_x_dtype=True) is None  # wgmma's
    assert G.default_config(16, 8192, 8192, 128, "sm_90", scales_in_x_dtype=True) == "tc-t4-u1"  # not wgmma's
    # wgmma takes 16 rows and more: 9-15 stay here (they went on to Triton before quant 0.10.15)
    assert G.default_config(12, 28672, 8192, 128, "sm_90", scales_in_x_dtype=True) == "tc-t4-u1"
    assert G.default_config(16, 4096, 8192, 128, "sm_90") == "mma"  # wgmma hands this one on
    assert G.default_config(16, 8192 + 32, 8192, 128, "sm_90") == "mma"  # N not of 64
    assert G.default_config(17, 2048, 2048, 128, "sm_90") is None
    assert G.default_config(16, 2048, 2048, 128, "sm_80") is None
    assert not G.TC_XSPLIT_DEFAULT  # forced only until timed on a GPU


def test_the_x_split_default_routes_the_two_tile_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """TC_XSPLIT_DEFAULT on: 9-16 rows go to the x-split build of the config they took, and
    1-8 rows and the calls handed on do not change."""
    monkeypatch.setattr(G, "TC_XSPLIT_DEFAULT", True)
    assert G.default_config(16, 2048, 2048, 128, "sm_90") == "tc-t1-u2-x2"
    assert G.default_config(9, 8192, 8192, 128, "sm_90") == "tc-t4-u1-x2"
    assert G.default_config(16, 28672, 8192, 128, "sm_90", scales_in_x_dtype=True) is None  # wgmma's
    assert G.default_config(16, 4096, 8192, 128, "sm_90") == "mma"
    assert G.default_config(8, 8192, 8192, 128, "sm_90") == "tc-t4-u1-k2"
    for m, n in ((16, 2048), (9, 8192)):
        config = G.default_config(m, n, 8192, 128, "sm_90")
        assert G.unsupported_call(*_call(m=m, n=n, k=8192), config) is None, config
    assert G.default_config(16, 8192, 1024, 128, "sm_90") is None
    assert "sm_80" in G.supports(DispatchKey("cuda", "sm_75", torch.bfloat16))
    assert "NVIDIA" in G.supports(DispatchKey("rocm", "gfx942", torch.bfloat16))
    assert "bfloat16" in G.supports(DispatchKey("cuda", "sm_90", torch.float32))


DEVICES = [pytest.param("cpu", id="emulated")]
if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))


def _check_mma_cases(cases, symmetric: bool, dtype: torch.dtype, device: str, g, *,
                     scale_dtypes=(torch.float16, torch.bfloat16), kind: str = "int4") -> None:  # fmt: skip
    """int4 (zeros or symmetric) or NF4 (`kind`) through the tensor-core kernels, each case (M,
    N, K, group or None for the whole row, bias dtype, config) with each of `scale_dtypes`
    (None: bfloat16 for odd M, float16 for even): within the error contract against float64
    (W rounded to x's dtype unless the kernel scales whole 128-code groups of int4 after the
    MMA: the tc GEMV; NF4's levels are rounded in every kernel), two runs bitwise equal."""
    for m, n, k, group, bias_dtype, config in cases:
        chosen = scale_dtypes or ((torch.bfloat16 if m % 2 else torch.float16),)
        for sdtype in chosen:
            weight = quantize(
                make_weight(n, k, heavy=True, generator=g, device=device), kind, symmetric, group
            )
            weight = type(weight)(weight.qweight, weight.scales.to(sdtype), None if weight.zeros is None else
                                  weight.zeros.to(sdtype), weight.group_size, weight.kind).to(device)  # fmt: skip
            size = weight.group_size
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype).to(device)
            codes = (
                tile_codes(weight.qweight) if str(config).startswith("tcr") else weight.qweight
            )  # the ring's
            args = (x, codes, weight.scales, weight.zeros, bias)
            runs = []
            for _ in range(2):
                out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
                assert G.unsupported_call(*args, out, size, kind, config) is None
                G.int4_linear_fwd(*args, out, size, kind, config=config)
                runs.append(out)
            assert not G._broken, G._broken
            assert torch.equal(runs[0], runs[1]), "two runs differ"
            rounded = kind == "nf4" or not (str(config).startswith("tc") and size % 128 == 0)
            msg = f"{config} {kind} sym={symmetric} m={m} {n}x{k} g{size} {dtype} scales {sdtype} bias {bias_dtype}"
            assert_linear_close(runs[0], x, weight, bias, w_rounded=rounded, msg=msg)


def _check_gemv_cases(cases, kind: str, symmetric: bool, dtype: torch.dtype, device: str, g) -> None:
    """One row of x through the GEMV forced to each case's config, (N, K, group, config, bias
    dtype), with float16 and bfloat16 scales: within the error contract against float64 on
    heavy-tailed weights, two runs bitwise equal."""
    for n, k, group, config, bias_dtype in cases:
        for sdtype in (torch.float16, torch.bfloat16):
            w = make_weight(n, k, heavy=True, generator=g, device=device)
            weight = quantize(w, kind, symmetric, group)
            weight = type(weight)(weight.qweight, weight.scales.to(sdtype), None if weight.zeros is None else
                                  weight.zeros.to(sdtype), weight.group_size, weight.kind).to(device)  # fmt: skip
            x = torch.randn(1, k, generator=g).to(dtype).to(device)
            bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype).to(device)
            args = (x, weight.qweight, weight.scales, weight.zeros, bias)
            runs = []
            for _ in range(2):
                out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
                assert G.unsupported_call(*args, out, group, kind, config) is None
                G.int4_linear_fwd(*args, out, group, kind, config=config)
                runs.append(out)
            assert not G._broken, G._broken
            assert torch.equal(runs[0], runs[1]), "two runs differ"
            msg = f"config={config} {kind} sym={symmetric} {n}x{k} g{group} {dtype} scales {sdtype} bias {bias_dtype}"
            # Unforced, the call takes the default route: NF4 on the tensor-core GEMV (sm_90)
            # rounds its levels to x's dtype.
            tc = config is None and str(G.default_config(1, n, k, group, G._arch(x.device)) or "").startswith(
                "tc"
            )
            assert_linear_close(runs[0], x, weight, bias, w_rounded=tc and kind == "nf4", msg=msg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "symmetric"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_within_the_error_contract(kind: str, symmetric: bool, dtype: torch.dtype, device: str) -> None:
    """Every kernel (rows per CTA 4 and 8, both scale dtypes, bias dtypes) against float64 on
    heavy-tailed weights; K past one CTA-wide step and ragged; two runs bitwise equal."""
    g = torch.Generator().manual_seed(3)
    if device == "cpu":
        cases = [(40, 1024, 64, 8, torch.float32), (36, 800, 32, 4, None), (64, 512, 128, 4, torch.bfloat16)]
    else:
        cases = [(8192, 8192, 128, None, None), (28672, 8192, 128, None, torch.float32),
                 (8192, 28672, 128, 4, torch.bfloat16), (4100, 4096, 64, 4, None)]  # fmt: skip
    _check_gemv_cases(cases, kind, symmetric, dtype, device, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_within_the_error_contract(
    symmetric: bool, dtype: torch.dtype, device: str
) -> None:
    """1-16 rows of x on the tensor-core kernel (W rounded to x's dtype: the contract's weight
    term), both scale dtypes, bias dtypes, K split over the CTA's warps; two runs bitwise equal."""
    g = torch.Generator().manual_seed(5)
    if device == "cpu":
        cases = [(1, 64, 512, 128, None), (2, 32, 1024, 64, torch.float32), (16, 64, 256, 32, torch.bfloat16),
                 (5, 32, 1152, 128, None)]  # fmt: skip
    else:
        cases = [(m, n, 8192, 128, None) for m in (1, 2, 8, 16) for n in (8192, 28672)]
        cases += [(16, 4096, 4096, 32, torch.float32), (3, 8192, 28672, 64, torch.bfloat16)]
    _check_mma_cases([(*case, "mma") for case in cases], symmetric, dtype, device, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "symmetric"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_persistent_gemv_within_the_error_contract(
    kind: str, symmetric: bool, dtype: torch.dtype, device: str
) -> None:
    """The persistent GEMV, every (rows, depth) built, against float64 on heavy-tailed weights:
    odd N and K, grids that do not divide the blocks (CTAs with one block more than others,
    a grid of one), K under one warp's chunks and past one CTA-wide step (x read per item),
    both scale dtypes, bias dtypes; two runs bitwise equal."""
    g = torch.Generator().manual_seed(7)
    if device == "cpu":  # (N, K, group, config, bias): the emulation has 2 "SMs"
        cases = [(44, 1056, 32, "persistent-g3", torch.float32), (38, 800, 32, "persistent-r2-d4", None),
                 (24, 8224, 32, "persistent-r8-d1", torch.bfloat16), (20, 96, 32, "persistent-r4-d1-g1", None),
                 (36, 16448, 64, "persistent-r4-d2-c3", torch.float16), (8, 8192, 128, "persistent", None)]  # fmt: skip
    else:
        cases = [(n, 8192, 128, c, None) for n in (8192, 28672) for c in G.PERSISTENT_CONFIGS]
        cases += [(8192, 28672, 128, "persistent", torch.bfloat16), (4100, 4096, 64, "persistent-r2-d4", None),
                  (4104, 12352, 32, "persistent-r8-d1", torch.float32)]  # fmt: skip
    _check_gemv_cases(cases, kind, symmetric, dtype, device, g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_persistent_within_the_error_contract(symmetric: bool, dtype: torch.dtype, device: str) -> None:
    """The persistent tensor-core kernel, every (columns, depth) built, against float64 (W
    rounded to x's dtype): 1, 2, 5 and 16 rows of x, tiles that the grid does not divide (a
    grid of one; CTAs with one tile more than others), K of an odd number of 128-code chunks
    (warps with no chunk in a step; one step: x kept for every tile), both scale dtypes, bias
    dtypes; two runs bitwise equal."""
    g = torch.Generator().manual_seed(11)
    if device == "cpu":  # (M, N, K, group, config, bias): the emulation has 2 "SMs"
        cases = [(2, 96, 1152, 128, "mma-persistent", torch.float32),
                 (5, 192, 384, 64, "mma-persistent-n64-d2", None),
                 (16, 64, 2176, 32, "mma-persistent-n32-d4-g1", torch.bfloat16),
                 (16, 320, 1024, 128, "mma-persistent-n64-d4-g2", torch.float16),
                 (1, 96, 256, 128, "mma-persistent-n32-d4-c1", None)]  # fmt: skip
    else:
        shapes = [(m, n) for m in (2, 16) for n in (8192, 28672)]
        cases = [(m, n, 8192, 128, c, None) for m, n in shapes for c in G.MMA_PERSISTENT_CONFIGS]
        cases += [(16, 4096, 4096, 32, "mma-persistent", torch.float32),
                  (3, 8192, 28672, 64, "mma-persistent-n64", torch.bfloat16)]  # fmt: skip
    _check_mma_cases([(m, n, k, group, bias, config) for m, n, k, group, config, bias in cases], symmetric, dtype,
                     device, g)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_gemv_within_the_error_contract(symmetric: bool, dtype: torch.dtype, device: str) -> None:
    """The tensor-core GEMV (W as the A operand), every shape built, against float64: 1-16 rows
    of x (one n8 tile to 8 rows, two past it; rows of the last tile past M), groups of 128 and the whole row (the scale after the
    MMA: W not rounded) and 32 / 64 (the scale in the pairs: W rounded to x's dtype), K of an
    odd number of chunks (warps with fewer chunks than others, or none), both scale dtypes,
    bias dtypes; two runs bitwise equal."""
    g = torch.Generator().manual_seed(13)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(1, 64, 1152, 128, None, "tc-t1-u2"), (8, 64, 256, 32, None, "tc-t1-u2"),
                 (3, 32, 384, 64, torch.float32, "tc-t2-u2"), (1, 128, 4096, None, torch.float16, "tc-t2-u2"),
                 (5, 64, 2176, 128, torch.bfloat16, "tc-t4-u1"), (2, 128, 1152, 64, None, "tc-t4-u1"),
                 (9, 32, 1152, 128, torch.float32, "tc-t1-u2"), (16, 64, 384, None, None, "tc-t2-u2"),
                 (13, 64, 640, 32, torch.bfloat16, "tc-t4-u1")]  # fmt: skip
    else:
        cases = [
            (m, n, 8192, 128, None, c) for c in G.TC_CONFIGS for m, n in ((1, 28672), (8, 8192), (16, 8192))
        ]
        cases += [
            (5, 4096, 4096, 32, torch.float32, "tc-t2-u2"),
            (3, 8192, 28672, 64, torch.bfloat16, "tc-t4-u1"),
            (11, 4096, 4096, 64, torch.float16, "tc-t1-u2"),
        ]
    assert {c[-1] for c in cases} == set(G.TC_CONFIGS)
    _check_mma_cases(cases, symmetric, dtype, device, g, scale_dtypes=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_k_tensor_core_gemv_within_the_error_contract(
    symmetric: bool, dtype: torch.dtype, device: str
) -> None:
    """The tensor-core GEMV with K split over a cluster ("tc-...-k<splits>"), every shape and
    split size, against float64: K not a multiple of the splits' chunks (a short last rank),
    more ranks than chunks (ranks with nothing to add), 1-8 rows of x, groups of 32 / 64 /
    128 and the whole row, both scale dtypes, bias dtypes; two runs bitwise equal (rank 0 adds
    the ranks' totals in rank order)."""
    if device == "cuda" and not G._arch(torch.device("cuda")).startswith("sm_90"):
        pytest.skip("thread-block clusters: sm_90")
    g = torch.Generator().manual_seed(19)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(1, 32, 1152, 128, None, "tc-t1-u2-k2"), (8, 16, 640, 32, torch.float32, "tc-t1-u2-k4"),
                 (3, 32, 384, 64, None, "tc-t1-u2-k8"), (1, 64, 2176, None, torch.float16, "tc-t2-u2-k2"),
                 (5, 64, 1024, 128, torch.bfloat16, "tc-t2-u2-k4"), (2, 128, 1152, 64, None, "tc-t4-u1-k2")]  # fmt: skip
    else:
        cases = [
            (m, n, k, 128, None, c)
            for c in G.TC_SPLIT_CONFIGS
            for m, n, k in ((1, 2048, 8192), (8, 4096, 2048))
        ]
        cases += [(5, 2048, 8192, 32, torch.float32, "tc-t1-u2-k4"), (3, 16384, 2048, 64, torch.bfloat16, "tc-t4-u1-k2"),
                  (1, 2048, 1152, 128, None, "tc-t1-u2-k8")]  # fmt: skip
    assert {c[-1] for c in cases} == set(G.TC_SPLIT_CONFIGS)
    _check_mma_cases(cases, symmetric, dtype, device, g, scale_dtypes=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_x_split_tensor_core_gemv_gives_the_two_tile_result_bit_for_bit(
    symmetric: bool, dtype: torch.dtype, device: str
) -> None:
    """The x-split tensor-core GEMV ("tc-...-x2": each n8 tile of x in its own CTA, two CTAs per
    tile of W), every shape built, 9-16 rows of x (a second tile of 1-8 rows), groups of 32 /
    64 / 128 and the whole row, K of an odd number of chunks, both scale dtypes, bias dtypes:
    within the error contract against float64, and bitwise the unsplit build's output (one CTA
    with both n8 tiles adds every row's products in the same order)."""
    g = torch.Generator().manual_seed(31)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(9, 32, 1152, 128, torch.float32, "tc-t1-u2-x2"), (16, 64, 384, None, None, "tc-t2-u2-x2"),
                 (13, 64, 640, 32, torch.bfloat16, "tc-t4-u1-x2"), (12, 16, 2176, 64, torch.float16, "tc-t1-u2-x2")]  # fmt: skip
    else:
        cases = [(m, n, 8192, 128, None, c) for c in G.TC_XSPLIT_CONFIGS for m, n in ((16, 8192), (9, 28672))]
        cases += [
            (11, 4096, 4096, 64, torch.float16, "tc-t1-u2-x2"),
            (14, 2048, 8192, 32, None, "tc-t2-u2-x2"),
        ]
    assert {c[-1] for c in cases} == set(G.TC_XSPLIT_CONFIGS)
    _check_mma_cases(cases, symmetric, dtype, device, g, scale_dtypes=None)
    for m, n, k, group, bias_dtype, config in cases:
        weight = quantize(make_weight(n, k, generator=g, device=device), "int4", symmetric, group).to(device)
        scales = weight.scales.to(dtype)
        zeros = None if symmetric else weight.zeros.to(dtype)
        bias = None if bias_dtype is None else torch.randn(n, generator=g).to(device=device, dtype=bias_dtype)
        x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
        outs = []
        for name in (config, config.removesuffix("-x2")):
            out = torch.empty(m, n, device=device, dtype=dtype)
            G.int4_linear_fwd(
                x, weight.qweight, scales, zeros, bias, out, weight.group_size, "int4", config=name
            )
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), (m, n, k, group, config)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lookup", ["shared", "registers"])
def test_nf4_tensor_core_gemv_within_the_error_contract(
    dtype: torch.dtype, device: str, lookup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NF4 on the tensor-core GEMV (its OK_TC_NF4 build: the levels read from
    a table of pairs in shared memory, or with `lookup` "registers" looked up in registers by
    byte permutes), every register build (one and two n8 tiles, the x split, K split over a
    cluster), 1-16 rows of x, groups of 32 / 64 (the scale in the pairs) and 128 / the whole
    row (after the MMA), K of an odd number of chunks, both scale dtypes, bias dtypes: within
    the error contract against float64 (the levels rounded to x's dtype), two runs bitwise
    equal. Every one of the 16 levels occurs in each case's codes."""
    monkeypatch.setattr(G, "TC_NF4_LOOKUP", lookup)
    split_ok = device == "cpu" or G._arch(torch.device("cuda")).startswith("sm_90")
    g = torch.Generator().manual_seed(37)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(1, 64, 1152, 128, None, "tc-t1-u2"), (8, 64, 256, 32, torch.float32, "tc-t1-u2"),
                 (3, 32, 384, 64, None, "tc-t2-u2"), (16, 128, 1152, None, torch.float16, "tc-t2-u2"),
                 (5, 64, 2176, 128, torch.bfloat16, "tc-t4-u1"), (13, 64, 640, 32, None, "tc-t4-u1"),
                 (12, 32, 1152, 128, torch.float32, "tc-t1-u2-x2"), (9, 64, 384, 64, None, "tc-t2-u2-x2"),
                 (16, 64, 640, None, torch.bfloat16, "tc-t4-u1-x2"), (1, 32, 1152, 128, None, "tc-t1-u2-k2"),
                 (8, 16, 640, 32, torch.float32, "tc-t1-u2-k4"), (2, 128, 1152, 64, None, "tc-t4-u1-k2")]  # fmt: skip
    else:
        cases = [
            (m, n, 8192, 128, None, c) for c in G.TC_CONFIGS for m, n in ((1, 28672), (8, 8192), (16, 8192))
        ]
        cases += [
            (m, n, 8192, 128, None, c) for c in G.TC_XSPLIT_CONFIGS for m, n in ((16, 8192), (9, 28672))
        ]
        cases += [(m, 2048, 8192, 128, None, c) for c in G.TC_SPLIT_CONFIGS for m in (1, 8)]
        cases += [(5, 4096, 4096, 32, torch.float32, "tc-t2-u2"), (3, 8192, 28672, 64, torch.bfloat16, "tc-t4-u1"),
                  (11, 4096, 4096, 64, torch.float16, "tc-t1-u2"), (1, 2048, 8192, 32, None, "tc-t1-u2-k2")]  # fmt: skip
    if not split_ok:
        cases = [c for c in cases if G.tc_config(c[-1]).splits == 1]
    _check_mma_cases(cases, True, dtype, device, g, kind="nf4")


def test_nf4_tables_of_the_tensor_core_gemv_are_the_levels() -> None:
    """int4_mma_common.cuh's Nf4Table words are format.NF4_VALUES rounded to bfloat16 and
    float16: the low bytes of levels 4j .. 4j + 3 in kLowJ, the high bytes in kHighJ."""
    from openkernels.quant.format import NF4_VALUES

    text = G._TC_SOURCE.with_name("int4_mma_common.cuh").read_text()
    for name, dtype in (("__nv_bfloat16", torch.bfloat16), ("__half", torch.float16)):
        body = re.search(r"struct Nf4Table<" + re.escape(name) + r"> \{(.*?)\};", text, re.S).group(1)
        words = {k: int(v, 16) for k, v in re.findall(r"(k(?:Low|High)\d) = 0x([0-9A-F]+)u", body)}
        bits = [int(v) & 0xFFFF for v in torch.tensor(NF4_VALUES).to(dtype).view(torch.int16).tolist()]
        for j in range(4):
            assert words[f"kLow{j}"] == sum((bits[4 * j + i] & 0xFF) << (8 * i) for i in range(4)), (name, j)
            assert words[f"kHigh{j}"] == sum((bits[4 * j + i] >> 8) << (8 * i) for i in range(4)), (name, j)


def test_nf4_routes_to_the_tensor_core_gemv() -> None:
    """NF4 of 1-16 rows on sm_90 takes the tensor-core GEMV: up to 8 rows int4's config, 9-16
    rows a register build for every N a tile divides (the one-round kernel and wgmma, int4's
    choices there, do not take NF4 at these rows); the dependent-launch and ring builds refuse it."""
    assert G.default_config(1, 8192, 8192, 128, "sm_90", kind="nf4") == G.default_config(
        1, 8192, 8192, 128, "sm_90"
    )
    assert G.default_config(16, 28672, 8192, 128, "sm_90", kind="nf4") == "tc-t4-u1"
    assert G.default_config(16, 4096, 8192, 128, "sm_90", kind="nf4") == "tc-t2-u2"
    assert G.default_config(12, 4112, 8192, 128, "sm_90", kind="nf4") == "tc-t1-u2"
    assert G.default_config(12, 2048, 8192, 128, "sm_90", kind="nf4") == "tc-t1-u2"
    assert G.default_config(16, 4104, 8192, 128, "sm_90", kind="nf4") is None  # no tile divides N
    assert G.default_config(16, 8192, 8192, 128, "sm_80", kind="nf4") is None
    assert G.default_config(16, 4096, 8192, 128, "sm_90") == "mma"  # int4 keeps its choice
    for m, n in ((16, 28672), (9, 4096), (1, 8192)):
        config = G.default_config(m, n, 8192, 128, "sm_90", kind="nf4")
        x, qweight, scales, _, bias, out, group, _ = _call(m=m, n=n, k=8192)
        assert G.unsupported_call(x, qweight, scales, None, bias, out, group, "nf4", config) is None, config


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
def test_tiled_codes_give_the_rows_result_bit_for_bit(symmetric: bool, device: str) -> None:
    """format.tile_codes' layout through the tensor-core GEMV (unsplit and split builds, every
    shape, 1-8 rows of x and 9-16 on the unsplit two-tile builds, int4 and NF4, groups 32 / 128
    / the whole row, K of an odd number of chunks) gives the same bits as the stored rows, and
    within the error contract; the round trip restores the codes; calls the tiled codes cannot
    take (9-16 rows split over a cluster, the x split, -p, other kernels, a K that is not the
    codes') raise before any launch instead of reading them as rows."""
    if device == "cuda" and not G._arch(torch.device("cuda")).startswith("sm_90"):
        pytest.skip("the split builds need thread-block clusters: sm_90")
    g = torch.Generator().manual_seed(29)
    cases = [(1, 64, 1152, 128, "tc-t1-u2"), (8, 64, 640, 32, "tc-t2-u2"), (3, 128, 2176, None, "tc-t4-u1"),
             (1, 32, 1152, 128, "tc-t1-u2-k2"), (5, 64, 1024, 128, "tc-t2-u2-k4"), (2, 128, 1152, 64, "tc-t4-u1-k2"),
             (16, 64, 1152, 128, "tc-t4-u1"), (11, 32, 640, 32, "tc-t1-u2"), (9, 64, 1024, None, "tc-t2-u2")]  # fmt: skip
    if device == "cuda":
        cases += [
            (1, 8192, 8192, 128, "tc-t4-u1-k2"),
            (4, 28672, 8192, 128, "tc-t4-u1"),
            (1, 2048, 8192, 128, "tc-t1-u2-k2"),
            (16, 8192, 8192, 128, "tc-t4-u1"),
        ]
    kinds = ["int4", "nf4"] if not symmetric else ["int4"]  # NF4 is symmetric by its levels
    for (m, n, k, group, config), kind in ((case, kind) for case in cases for kind in kinds):
        weight = quantize(
            make_weight(n, k, heavy=True, generator=g, device=device), kind, symmetric, group
        ).to(device)
        tiled = tile_codes(weight.qweight)
        assert tiled.shape == (n // 16, k // 128, 1024)
        assert torch.equal(untile_codes(tiled), weight.qweight)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
        outs = []
        for codes in (weight.qweight, tiled):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
            args = (x, codes, weight.scales, weight.zeros, None, out, weight.group_size, kind)
            assert G.unsupported_call(*args, config) is None
            G.int4_linear_fwd(*args, config=config)
            outs.append(out)
        assert not G._broken, G._broken
        assert torch.equal(outs[0], outs[1]), (
            f"{config} {kind} m={m} {n}x{k}: tiled codes differ from the rows"
        )
        assert_linear_close(
            outs[1], x, weight, None, w_rounded=weight.group_size % 128 != 0 or kind == "nf4",
            msg=f"{config} {kind} tiled",
        )  # fmt: skip
    weight = quantize(make_weight(64, 256, generator=g), "int4", False, 128).to(device)
    tiled = tile_codes(weight.qweight)
    for m, k, config in (
        (9, 256, "tc-t1-u2-k2"),
        (12, 256, "tc-t1-u2-x2"),
        (1, 256, "tc-t1-u2-p"),
        (1, 256, "mma"),
        (1, 256, 8),
        (1, 384, "tc"),
    ):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
        out = torch.zeros(m, 64, dtype=torch.bfloat16, device=device)
        with pytest.raises(ValueError, match="tiled codes"):
            G.int4_linear_fwd(x, tiled, weight.scales, weight.zeros, None, out, 128, "int4", config=config)
        assert not out.any(), "a refused call wrote its output"
    with pytest.raises(ValueError, match="multiple of 16"):
        tile_codes(weight.qweight[:8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dependent_launch_tensor_core_gemv_within_the_error_contract(dtype: torch.dtype, device: str) -> None:
    """The tensor-core GEMV launched as a programmatic dependent ("-p": its codes, scales and
    zeros fetched into L2 before it waits for the kernel before it), every config timed on a
    GPU, against float64: the split and unsplit builds, 1-8 rows, groups of 32 / 128 and the
    whole row, K over several trips and over ranks with no chunks, zeros and symmetric (through
    both scale dtypes); two runs bitwise equal. In the emulation the prefetch and the wait are
    no-ops: this checks that the prologue leaves the product alone (and, on a GPU, the launch)."""
    if device == "cuda" and not G._arch(torch.device("cuda")).startswith("sm_90"):
        pytest.skip("programmatic dependent launch: sm_90")
    g = torch.Generator().manual_seed(29)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(1, 16, 2176, 128, None, "tc-t1-u2-p"), (8, 32, 512, 32, torch.float32, "tc-t2-u2-p"),
                 (3, 64, 1152, None, None, "tc-t4-u1-p"), (1, 32, 384, 128, torch.bfloat16, "tc-t1-u2-k2-p"),
                 (5, 64, 1024, 32, None, "tc-t2-u2-k2-p"), (2, 128, 256, 128, torch.float16, "tc-t4-u1-k2-p")]  # fmt: skip
    else:
        cases = [(m, n, 8192, 128, None, c) for c in G.TC_PDL_CONFIGS for m, n in ((1, 8192), (8, 2048))]
    assert {c[-1] for c in cases} == set(G.TC_PDL_CONFIGS)
    for symmetric in (False, True):
        _check_mma_cases(cases, symmetric, dtype, device, g, scale_dtypes=None)


@pytest.mark.parametrize("config", ["tc-t1-u2", "tc-t1-u2-k2", "tc-t2-u2-k4-p"])
def test_tensor_core_gemv_replays_from_cpp(config: str) -> None:
    """A replayable body around the tensor-core GEMV (register, split and dependent-launch
    builds, the emulated library): from its third call the recorded launch replays through the
    entry's packed twin (ok_int4_tc_packed), bitwise the direct call's output on each new x and
    output."""
    from openkernels.shared import replay

    before = replay.mode()
    replay.set_mode("cpu")
    try:
        python_runs = []

        @replay.replayable
        def linear(x, qweight, scales, zeros):
            python_runs.append(1)
            out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
            G.int4_linear_fwd(x, qweight, scales, zeros, None, out, 128, "int4", config=config)
            return out

        g = torch.Generator().manual_seed(23)
        weight = quantize(make_weight(64, 1024, generator=g), "int4", False, 128)
        scales, zeros = weight.scales.to(torch.float16), weight.zeros.to(torch.float16)
        for _ in range(5):
            x = torch.randn(3, 1024, generator=g).to(torch.bfloat16)
            direct = torch.empty(3, 64, dtype=torch.bfloat16)
            G.int4_linear_fwd(x, weight.qweight, scales, zeros, None, direct, 128, "int4", config=config)
            assert torch.equal(linear(x, weight.qweight, scales, zeros), direct)
        assert len(python_runs) == 2, python_runs  # calls 3-5 replayed
    finally:
        replay.set_mode({"off": "0", "cpu": "cpu", "all": "all"}[before])


def test_int4_and_nf4_builds_replay_apart() -> None:
    """One replayable body calling the tensor-core GEMV for int4 and then for NF4 (two builds of
    int4_tc.cu with the same entry names): each recorded launch replays through its own
    library, bitwise the direct calls' outputs."""
    from openkernels.shared import replay

    before = replay.mode()
    replay.set_mode("cpu")
    try:
        g = torch.Generator().manual_seed(41)
        w = make_weight(64, 1024, generator=g)
        int4, nf4 = quantize(w, "int4", False, 128), quantize(w, "nf4", True, 128)
        parts = (int4.qweight, int4.scales, int4.zeros, nf4.qweight, nf4.scales)

        def both(x, qi, si, zi, qn, sn):
            outs = []
            for q, s, z, kind in ((qi, si, zi, "int4"), (qn, sn, None, "nf4")):
                out = torch.empty(x.shape[0], 64, dtype=x.dtype)
                G.int4_linear_fwd(x, q, s, z, None, out, 128, kind, config="tc-t1-u2-k2")
                outs.append(out)
            return tuple(outs)

        body = replay.replayable(both)
        for _ in range(5):
            x = torch.randn(2, 1024, generator=g).to(torch.bfloat16)
            direct = both(x, *parts)
            replayed = body(x, *parts)
            assert torch.equal(replayed[0], direct[0]) and torch.equal(replayed[1], direct[1])
            assert not torch.equal(direct[0], direct[1])
        assert replay.stats(body)["hits"] == 3, replay.stats(body)  # calls 3-5 replayed
    finally:
        replay.set_mode({"off": "0", "cpu": "cpu", "all": "all"}[before])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_fed_tensor_core_gemv_within_the_error_contract(
    symmetric: bool, dtype: torch.dtype, device: str
) -> None:
    """The tensor-core GEMV fed by a producer warp's ring of bulk copies ("tcr"), every shape
    built, against float64: K over more stages than the ring holds (stages refilled after the
    consumers free them), a last stage of fewer chunks than warps, a single short stage,
    groups of 128 and the whole row, 1-8 rows of x, both scale dtypes, bias dtypes, on tiled
    codes (its only layout since quant 0.10.7); two runs bitwise equal. In the emulation a
    bulk copy lands only at a wait on its barrier, so a consumer that reads a stage before
    waiting for it reads NaN bytes."""
    g = torch.Generator().manual_seed(17)
    if device == "cpu":  # (M, N, K, group, bias, config)
        cases = [(1, 32, 5504, 128, None, "tcr-t1-s4"), (8, 32, 3072, None, None, "tcr-t2-s4"),
                 (3, 64, 1152, 128, torch.float32, "tcr-t2-s4"), (2, 64, 4096, None, torch.float16, "tcr-t4-s2"),
                 (5, 64, 640, 128, torch.bfloat16, "tcr-t4-s2"), (2, 16, 9216, 128, None, "tcr-t1-s8")]  # fmt: skip
    else:
        cases = [(m, n, 8192, 128, None, c) for c in G.TCR_CONFIGS for m, n in ((1, 28672), (8, 8192))]
        cases += [(5, 4096, 4096, None, torch.float32, "tcr-t2-s4"), (1, 2048, 2048, 128, None, "tcr-t1-s4"),
                  (3, 8192, 28672, 128, torch.bfloat16, "tcr-t4-s2")]  # fmt: skip
    assert {c[-1] for c in cases} == set(G.TCR_CONFIGS)
    _check_mma_cases(cases, symmetric, dtype, device, g, scale_dtypes=None)


def test_tcr_configs() -> None:
    assert G.tcr_config("tc-t2-u2") is None and G.tcr_config(4) is None
    assert G.tcr_config("tcr") == G.TcRingConfig(2, 4)
    assert G.tcr_config("tcr-t4-s2") == G.TcRingConfig(4, 2)
    for bad in ("tcr-t3-s4", "tcr-t2-u2", "tcr-x", "tcr-t1-s6"):
        with pytest.raises(ValueError):
            G.tcr_config(bad)
    x, qweight, scales, zeros, bias, out, group, kind = _call(n=64, k=1024, tiled=True)
    assert G.unsupported_call(x, qweight, scales, zeros, bias, out, group, kind, "tcr-t2-s4") is None
    assert "tiled codes only" in G.unsupported_call(*_call(n=64, k=1024), "tcr-t2-s4")
    assert "multiple of 128" in G.unsupported_call(*_call(n=64, k=1024, group=64, tiled=True), "tcr-t1-s4")
    assert "multiple of 64" in G.unsupported_call(*_call(n=32, k=1024, tiled=True), "tcr-t4-s2")
    assert "NF4" in G.unsupported_call(x, qweight, scales, None, bias, out, group, "nf4", "tcr")
    wide = torch.empty(64, 3, dtype=torch.float16)[:, :2]  # scale rows 6 bytes apart
    assert "aligned" in G.unsupported_call(x, qweight, wide.t(), None, bias, out, group, kind, "tcr-t1-s4")


def test_tc_configs() -> None:
    assert G.tc_config("mma") is None and G.tc_config(4) is None
    assert G.tc_config("tc") == G.TcConfig(2, 2)
    assert G.tc_config("tc-t4-u1") == G.TcConfig(4, 1)
    assert G.tc_config("tc-t1-u2") == G.TcConfig(1, 2)
    assert G.tc_config("tc-t1-u2-k4") == G.TcConfig(1, 2, 4)
    assert G.tc_config("tc-k2") == G.TcConfig(2, 2, 2)
    assert G.tc_config("tc-t4-u1-k2-p") == G.TcConfig(4, 1, 2, True)
    assert G.tc_config("tc-p") == G.TcConfig(2, 2, 1, True)
    assert all(G.tc_config(c).splits > 1 for c in G.TC_SPLIT_CONFIGS)
    assert all(G.tc_config(c).pdl for c in G.TC_PDL_CONFIGS)
    assert G.tc_config("tc-t4-u1-x2") == G.TcConfig(4, 1, 1, False, 2)
    assert all(G.tc_config(c).xtiles == 2 for c in G.TC_XSPLIT_CONFIGS)
    bad_configs = ("tc-t3-u2", "tc-t2-d4", "tc-x", "tc-t2-u4", "tc-t1-u2-k3", "tc-t1-u2-k16", "tc-t3-u2-k2",
                   "tc-t1-u2-p-k2", "tc-t1-u2-pp", "tc-t1-u2-x3", "tc-t1-u2-k2-x2", "tc-t1-u2-x2-p",
                   "tc-t1-u2-x2-k2")  # fmt: skip
    for bad in bad_configs:
        with pytest.raises(ValueError):
            G.tc_config(bad)
    x, qweight, scales, zeros, bias, out, group, kind = _call(n=48, k=1024)
    assert G.unsupported_call(x, qweight, scales, zeros, bias, out, group, kind, "tc-t1-u2") is None
    assert "multiple of 32" in G.unsupported_call(
        x, qweight, scales, zeros, bias, out, group, kind, "tc-t2-u2"
    )
    assert (
        G.unsupported_call(x, qweight, scales, None, bias, out, group, "nf4", "tc-t1-u2") is None
    )  # its NF4 build
    assert "NF4" in G.unsupported_call(x, qweight, scales, None, bias, out, group, "nf4", "tc-t1-u2-p")
    assert "NF4" in G.unsupported_call(x, qweight, scales, None, bias, out, group, "nf4", "tc-t1-u2-k2-p")
    assert G.unsupported_call(*_call(m=16, n=64, k=1024), "tc-t1-u2") is None  # two n8 tiles of x
    assert "up to 16" in G.unsupported_call(*_call(m=17, n=64, k=1024), "tc-t1-u2")
    for config in ("tc-t1-u2-k2", "tc-t1-u2-p", "tcr-t1-s4"):  # one n8 tile only
        assert "up to 8" in G.unsupported_call(
            *_call(m=9, n=64, k=1024, tiled=config.startswith("tcr")), config
        )
    assert "multiple of 128" in G.unsupported_call(*_call(n=64, k=1056, group=32), "tc-t1-u2")
    assert G.unsupported_call(*_call(m=9, n=64, k=1024), "tc-t1-u2-x2") is None
    assert "9-16" in G.unsupported_call(*_call(m=8, n=64, k=1024), "tc-t1-u2-x2")
    assert "without -p or -x2" in G.unsupported_call(*_call(m=12, n=64, k=1024, tiled=True), "tc-t1-u2-x2")


def test_the_launchers_say_where_they_route_a_call() -> None:
    """dispatch.explain's per-call note: the gemv launcher's route is None off CUDA (its CPU
    tensors run the emulation as asked); wgmma's names the Triton launcher for calls it does
    not take."""
    from openkernels.quant import gluon

    args = _call(m=4, n=64, k=1024)
    impls = {impl.name: impl for impl in dispatch.implementations("int4_linear")}
    assert impls["gemv"].fn.route(*args) is None
    assert "Triton launcher" in impls["wgmma"].fn.route(*args) and "rows of x" in gluon._route(*args)


def test_int4_linear_keeps_tiled_codes_for_the_tensor_core_gemv() -> None:
    """Int4Linear.use_tiled_codes: a non-persistent tiled copy of the codes (not in the state
    dict, rebuilt when one is loaded, dropped on request), refused for layers the tiled layout
    cannot hold; off sm_90 (here the CPU) the stored rows run and the output does not change.
    The routing: cuda.tiled_config is the default tc config without -p or -x2 (1-16 rows, int4
    and NF4), None elsewhere; tiled codes handed to the op where no kernel reads them are converted to rows;
    the op's fake tensor gets N from the tiled shape."""
    from openkernels.quant import Int4Linear, ops, use_tiled_codes

    g = torch.Generator().manual_seed(31)
    layer = Int4Linear.from_linear(torch.nn.Linear(256, 64, bias=True), group_size=128)
    x = torch.randn(3, 256, generator=g)
    before = layer(x)
    assert layer.use_tiled_codes() is layer
    assert torch.equal(layer.qweight_tiled, tile_codes(layer.qweight))
    assert "qweight_tiled" not in layer.state_dict()
    assert torch.equal(layer(x), before)
    other = Int4Linear.from_linear(torch.nn.Linear(256, 64, bias=True), group_size=128)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer.qweight_tiled, tile_codes(other.qweight)), "the tiled copy kept the old codes"
    layer.use_tiled_codes(False)
    assert layer.qweight_tiled is None and torch.equal(layer(x), other(x))
    with pytest.raises(ValueError, match="out_features a multiple of 16"):
        Int4Linear.from_linear(torch.nn.Linear(256, 40), group_size=128).use_tiled_codes()
    nf4 = Int4Linear.from_linear(torch.nn.Linear(256, 64), group_size=128, kind="nf4").use_tiled_codes()
    assert nf4.qweight_tiled.shape == (4, 2, 1024)
    model = torch.nn.Sequential(
        layer, torch.nn.ReLU(), Int4Linear.from_linear(torch.nn.Linear(64, 48), group_size=64)
    )
    assert use_tiled_codes(model) == 1  # the second layer's in_features (64) is not a multiple of 128
    assert G.tiled_config(1, 8192, 8192, 128, "sm_90") == G.default_tc(1, 8192, 8192, 128, "sm_90")
    assert G.tiled_config(9, 8192, 8192, 128, "sm_90") == "tc-t4-u1"  # two n8 tiles of x
    assert G.tiled_config(1, 8192, 8192, 128, "sm_90", kind="nf4") == G.default_config(
        1, 8192, 8192, 128, "sm_90", kind="nf4"
    )
    assert G.tiled_config(32, 8192, 8192, 128, "sm_90") is None
    assert G.tiled_config(1, 8192, 8192, 128, "sm_80") is None
    tiled = tile_codes(layer.qweight)
    # The op on tiled codes no kernel reads for this call (the CPU): converted to rows, the rows' result.
    xb = x.to(torch.bfloat16)
    assert torch.equal(
        ops.INT4_LINEAR(xb, tiled, layer.scales, layer.zeros, None, 128, "int4"),
        ops.INT4_LINEAR(xb, layer.qweight, layer.scales, layer.zeros, None, 128, "int4"),
    )
    meta = [t.to("meta") for t in (x.to(torch.bfloat16), tiled, layer.scales, layer.zeros)]
    assert ops.INT4_LINEAR.library(*meta, None, 128, "int4").shape == (3, 64)
