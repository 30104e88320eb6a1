"""Tests of the ahead-of-time compile checker (openkernels.shared.dev.testing.aot).

Every kernel is compiled for all five targets (or those in OPENKERNELS_AOT_TARGETS) with
no GPU; the known-bad kernels must be reported (spills, shared memory over the limit,
compile errors) and the known-good ones must pass. The main cases compile in one batch
(module fixture) so the worker pool stays busy; run with -s to see the table with compile
seconds. The worker processes import this file again: keep its top level cheap.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("triton")

import triton
import triton.language as tl

from openkernels.shared.dev.testing import aot
from openkernels.shared.dev.testing.aot import (
    TARGETS,
    AotCase,
    AotReport,
    assert_clean,
    check_cases,
    compile_case,
    format_reports,
    targets_from_env,
)

pytestmark = pytest.mark.aot

# ---------------------------------------------------------------- kernels of these tests only
# Module-level, so the checker's worker processes can import them again (by module name,
# or from this file when pytest's importlib mode leaves the directory off sys.path).


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x + y, one BLOCK-wide chunk per program: cheap on every target."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)


@triton.jit
def rmsnorm_row_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    """RMSNorm with a whole row per program: each thread holds BLOCK / (32 or 64 x num_warps)
    fp32 values of x and of w live across the reduction. At 1024 with 4 warps that fits;
    a 4096-wide row on one warp does not fit NVIDIA's 255 registers, and on AMD it spills
    once an occupancy hint caps the VGPRs (a 65536-wide row on 4 warps overflows even the
    512 VGPRs of CDNA with no hint, but LLVM then needs 10-25 s per AMD target)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def matmul_tile_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One (BM, BN) tile of C = A @ B with a software-pipelined K loop: the pipeliner keeps
    about num_stages (BM + BN) x BK tiles in shared memory, so big tiles with many stages
    ask for more than any of the targets has."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc.to(c_ptr.dtype.element_ty))


# ---------------------------------------------------------------- cases

ALL = list(TARGETS)
# What the main batch compiles for: OPENKERNELS_AOT_TARGETS (a vendor's CI session sets its
# archs), all five by default.
UNDER_TEST = targets_from_env()
CUDA = ["sm_80", "sm_90"]

ADD_SIG = {"x_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32"}
RMS_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "eps": "fp32"}
MM_SIG = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16", "K": "i32"}

ADD = AotCase(add_kernel, ADD_SIG, {"BLOCK": 1024}, num_warps=4, label="add-1024")
RMS_SMALL = AotCase(rmsnorm_row_kernel, RMS_SIG, {"BLOCK": 1024}, num_warps=4, label="rmsnorm-1024")
# waves_per_eu=8 asks for 8 waves per SIMD: at most 64 VGPRs per lane on CDNA (CUDA ignores it).
RMS_SPILL = AotCase(
    rmsnorm_row_kernel,
    RMS_SIG,
    {"BLOCK": 4096},
    num_warps=1,
    options={"waves_per_eu": 8},
    label="rmsnorm-4096-spills",
)
# 128x128x128 fp16 tiles, 5 stages: 256-320 KiB of shared memory, over every target's limit.
# K is declared a multiple of 16, as the launcher would specialize it, so the loads are
# 16-byte vectors and the pipeliner keeps all stages.
DOT_HUGE = AotCase(
    matmul_tile_kernel,
    MM_SIG,
    {"BM": 128, "BN": 128, "BK": 128},
    num_warps=8,
    num_stages=5,
    attrs={"K": "D"},
    label="dot-128x128x128-s5",
)
# arange over a non-power-of-2 range does not compile.
ADD_BAD = AotCase(add_kernel, ADD_SIG, {"BLOCK": 1000}, label="add-1000")

BATCH = [ADD, RMS_SMALL, RMS_SPILL, DOT_HUGE, ADD_BAD]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A fresh result cache: these tests must see real compiles, not a user's cache."""
    path = tmp_path_factory.mktemp("okcache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENKERNELS_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def reports(cache_dir) -> dict[tuple[str, str], AotReport]:
    found = check_cases(BATCH, UNDER_TEST)
    print("\n" + format_reports(found))
    assert len(found) == len(BATCH) * len(UNDER_TEST)
    return {(r.label, r.target): r for r in found}


@pytest.mark.parametrize("target", UNDER_TEST)
def test_clean_kernels_pass(reports, target: str) -> None:
    for label in ("add-1024", "rmsnorm-1024"):
        r = reports[label, target]
        assert r.ok, r.problems
        assert r.error is None and not r.cached
        assert r.registers and r.registers > 0
        assert r.scratch_bytes == 0
        assert r.shared_bytes is not None and r.shared_bytes <= r.shared_limit
        if target in CUDA:
            assert (r.spill_stores, r.spill_loads, r.spilled_vgprs) == (0, 0, None)
        else:
            assert (r.spill_stores, r.spilled_vgprs) == (None, 0)
    assert_clean([reports["add-1024", target], reports["rmsnorm-1024", target]])


@pytest.mark.parametrize("target", UNDER_TEST)
def test_spilling_kernel_is_reported(reports, target: str) -> None:
    r = reports["rmsnorm-4096-spills", target]
    assert not r.ok
    assert any(p.startswith("spills") for p in r.problems), r.problems
    assert any(p.startswith("scratch") for p in r.problems), r.problems
    assert r.scratch_bytes and r.scratch_bytes > 0
    if target in CUDA:
        assert r.spill_stores and r.spill_stores > 0 and r.spill_loads and r.spill_loads > 0
    else:
        assert r.spilled_vgprs and r.spilled_vgprs > 0 and r.spill_stores is None
    with pytest.raises(AssertionError, match=f"rmsnorm-4096-spills on {target}: spills"):
        assert_clean([r])


@pytest.mark.parametrize("target", UNDER_TEST)
def test_shared_memory_over_limit_is_reported(reports, target: str) -> None:
    r = reports["dot-128x128x128-s5", target]
    assert r.shared_bytes is not None and r.shared_bytes > r.shared_limit
    assert any(p.startswith("shared memory") and target in p for p in r.problems), r.problems
    assert not r.ok


@pytest.mark.parametrize("target", UNDER_TEST)
def test_compile_error_is_a_failed_report(reports, target: str) -> None:
    r = reports["add-1000", target]
    assert not r.ok and r.error is not None
    assert "power of 2" in r.problems[0] and r.problems[0].startswith("compile error")
    assert r.registers is None and r.shared_bytes is None


def test_assert_clean_lists_every_failure(reports) -> None:
    with pytest.raises(AssertionError) as info:
        assert_clean(list(reports.values()))
    text = str(info.value)
    assert text.startswith(f"{3 * len(UNDER_TEST)} of {len(reports)} AOT checks failed")
    for target in UNDER_TEST:
        for label in ("rmsnorm-4096-spills", "dot-128x128x128-s5", "add-1000"):
            assert f"{label} on {target}:" in text
        assert f"add-1024 on {target}" not in text


def test_broken_references_are_failed_reports(cache_dir) -> None:
    missing = AotCase(f"{__file__}:no_such_kernel", ADD_SIG, {"BLOCK": 64}, label="missing")
    untyped = AotCase(add_kernel, {"x_ptr": "*fp32"}, {"BLOCK": 64}, label="untyped")
    typo = AotCase(add_kernel, {**ADD_SIG, "m": "i32"}, {"BLOCK": 64}, label="typo")
    found = check_cases([missing, untyped, typo], ["gfx942"])
    assert [r.ok for r in found] == [False, False, False]
    assert "no_such_kernel" in found[0].problems[0]
    assert "no type in signature" in found[1].problems[0]
    assert "has no argument(s) ['m']" in found[2].problems[0]


def test_unknown_targets_error_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENKERNELS_AOT_TARGETS", raising=False)
    assert targets_from_env() == ALL
    monkeypatch.setenv("OPENKERNELS_AOT_TARGETS", " sm_90, gfx942 ,")
    assert targets_from_env() == ["sm_90", "gfx942"]
    monkeypatch.setenv("OPENKERNELS_AOT_TARGETS", "sm_90,sm_75")
    with pytest.raises(
        ValueError, match=r"unknown AOT target\(s\) 'sm_75' in OPENKERNELS_AOT_TARGETS.*gfx950"
    ):
        targets_from_env()
    with pytest.raises(ValueError, match="'gfx1100'"):
        check_cases([ADD], ["sm_90", "gfx1100"])
    with pytest.raises(ValueError, match="'sm_100'"):
        compile_case(ADD, "sm_100")


def test_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process decides once whether it interprets (platform.triton_interpreting is cached).
    monkeypatch.setattr(aot, "triton_interpreting", lambda: True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        check_cases([ADD], ["sm_90"])


def test_cache_hit_returns_the_same_report(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_CACHE", str(tmp_path))
    case = AotCase(add_kernel, ADD_SIG, {"BLOCK": 256}, num_warps=2, label="add-256")
    first = check_cases([case], ["sm_90", "gfx950"])
    assert len(list((tmp_path / "aot").glob("*.json"))) == 2
    second = check_cases([case], ["sm_90", "gfx950"])
    assert [r.cached for r in first] == [False, False]
    assert [r.cached for r in second] == [True, True]
    for a, b in zip(first, second, strict=True):
        a.cached = b.cached = False
        assert a == b  # every field, compile_seconds included
    # compile_case shares the cache; another constant is another kernel.
    assert compile_case(case, "sm_90").cached
    other = AotCase(add_kernel, ADD_SIG, {"BLOCK": 512}, num_warps=2)
    assert not compile_case(other, "sm_90").cached


def test_cases_pickle_by_reference() -> None:
    back = pickle.loads(pickle.dumps(DOT_HUGE))
    assert back.kernel == f"{__name__}:matmul_tile_kernel"
    assert back.jit_function() is matmul_tile_kernel
    assert (back.label, back.constexprs, back.attrs) == (DOT_HUGE.label, DOT_HUGE.constexprs, DOT_HUGE.attrs)


def test_local_kernel_compiles_in_process(cache_dir) -> None:
    @triton.jit
    def scale_kernel(x_ptr, n, BLOCK: tl.constexpr = 128):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    case = AotCase(scale_kernel, {"x_ptr": "*fp32", "n": "i32"})  # BLOCK from its default
    with pytest.raises(TypeError, match="module-level"):
        pickle.dumps(case)
    (r,) = check_cases([case], ["gfx90a"])
    assert r.ok, r.problems
    assert r.label == "scale_kernel[]w4s1"


def test_variants_compile_for_each_vendors_reference_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `variant` case goes to sm_90 / gfx942 when the run includes them, to every asked
    target otherwise, and everywhere with OPENKERNELS_AOT_VARIANTS=all; others go everywhere."""
    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    base = AotCase(add_kernel, sig, {"BLOCK": 1024}, label="base")
    variant = AotCase(add_kernel, sig, {"BLOCK": 512}, label="variant", variant=True)
    every = list(TARGETS)
    monkeypatch.delenv(aot.VARIANTS_ENV, raising=False)
    monkeypatch.delenv(aot.TARGETS_ENV, raising=False)
    jobs = aot.job_list([base, variant], every)
    assert [t for c, t in jobs if c is base] == every
    assert [t for c, t in jobs if c is variant] == ["sm_90", "gfx942"]
    # One target at a time (the families' per-target tests): still only the reference targets.
    assert [t for t in every if aot.job_list([variant], [t])] == ["sm_90", "gfx942"]
    # A run without the reference target checks the variant where it can.
    monkeypatch.setenv(aot.TARGETS_ENV, "sm_80,gfx90a")
    assert [t for _, t in aot.job_list([variant], ["sm_80", "gfx90a"])] == ["sm_80", "gfx90a"]
    monkeypatch.setenv(aot.TARGETS_ENV, "sm_80,sm_90")
    assert [t for _, t in aot.job_list([variant], ["sm_80", "sm_90"])] == ["sm_90"]
    monkeypatch.setenv(aot.VARIANTS_ENV, "all")
    assert [t for _, t in aot.job_list([variant], ["sm_80", "sm_90"])] == ["sm_80", "sm_90"]
