"""shared.cuda_build: the CUDA emulation runs a kernel's threads, warps' shuffles, shared
memory and a cluster's exchange on the CPU (a toy kernel), and ptxas reports per kernel."""

from __future__ import annotations

import ctypes
import pathlib

import pytest
import torch

from openkernels.shared import cuda_build

TOY = pathlib.Path(__file__).with_name("data") / "toy_cluster.cu"


@pytest.mark.parametrize(("ctas", "cluster"), [(1, 1), (6, 3), (8, 4)])
def test_the_emulation_runs_shuffles_shared_memory_and_cluster_exchange(ctas: int, cluster: int) -> None:
    lib = cuda_build.load_emulated(TOY, name="openkernels_toy_cluster")
    lib.toy_cluster_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    x = torch.randint(0, 100, (ctas, 64)).float()  # integers: every summation order is exact
    out = torch.full((ctas,), float("nan"))
    assert lib.toy_cluster_launch(x.data_ptr(), out.data_ptr(), ctas, cluster) == 0
    want = x.sum(1).view(-1, cluster).sum(1).repeat_interleave(cluster)
    torch.testing.assert_close(out, want)


def test_a_launch_the_emulation_cannot_run_is_refused() -> None:
    lib = cuda_build.load_emulated(TOY, name="openkernels_toy_cluster")
    lib.toy_cluster_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    out = torch.empty(5)
    assert lib.toy_cluster_launch(out.data_ptr(), out.data_ptr(), 5, 2) != 0  # 5 CTAs, clusters of 2


@pytest.mark.aot
def test_ptxas_reports_the_toy_kernel() -> None:
    if cuda_build.nvcc() is None:
        pytest.skip("no nvcc")
    (report,) = cuda_build.ptxas_report(TOY, "sm_90a")
    assert "toy_cluster_sum" in report.name and report.registers > 0 and report.spill_stores == 0
    assert report.odd_descriptors == (-1 if cuda_build.cuobjdump() is None else 0)


def test_odd_descriptor_registers_are_counted_per_function() -> None:
    """The SASS check behind KernelReport.odd_descriptors: quant's withdrawn ring kernel had
    `LDGSTS.E.BYPASS.128 [R11+UR0], desc[UR1][R18.64]`, an illegal instruction on the H100."""
    sass = """
        Function : good_kernel
        /*0010*/   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/   LDGSTS.E.BYPASS.128 [R11+UR0], desc[UR8][R18.64] ;
        Function : bad_kernel
        /*0010*/   LDGSTS.E.BYPASS.128 [R11+UR0], desc[UR1][R18.64] ;
        /*0020*/   LDG.E R4, desc[UR6][R2.64] ;
        /*0030*/   STG.E desc[UR13][R2.64], R4 ;
    """
    assert cuda_build.count_odd_descriptors(sass) == {"good_kernel": 0, "bad_kernel": 2}


@pytest.mark.aot
def test_ptxas_reports_are_kept_under_a_key_of_what_decides_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cuda_build.nvcc() is None:
        pytest.skip("no nvcc")
    monkeypatch.setenv("OPENKERNELS_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "src" / "toy_cluster.cu"
    source.parent.mkdir()
    source.write_bytes(TOY.read_bytes())
    first = cuda_build.ptxas_report(source, "sm_90a")
    assert len(list((tmp_path / "cache" / "ptxas").glob("*.json"))) == 1

    def no_compiler(*args, **kwargs):
        raise AssertionError("nvcc ran for a kept report")

    with monkeypatch.context() as m:
        m.setattr(cuda_build.subprocess, "run", no_compiler)
        assert cuda_build.ptxas_report(source, "sm_90a") == first
    # Another arch, other flags, a changed source or a changed file beside it: compiled again.
    cuda_build.ptxas_report(source, "sm_90")
    with pytest.raises(cuda_build.CudaBuildError, match="cluster"):  # no clusters before sm_90: not kept
        cuda_build.ptxas_report(source, "sm_80")
    cuda_build.ptxas_report(source, "sm_90a", ["-DOK_UNUSED=1"])
    source.write_text(source.read_text() + "\n// edited\n")
    cuda_build.ptxas_report(source, "sm_90a")
    (source.parent / "helper.h").write_text("// a header the source may include\n")
    cuda_build.ptxas_report(source, "sm_90a")
    assert len(list((tmp_path / "cache" / "ptxas").glob("*.json"))) == 5
    # A torn entry is compiled again, not trusted.
    for entry in (tmp_path / "cache" / "ptxas").glob("*.json"):
        entry.write_text("[{")
    assert cuda_build.ptxas_report(source, "sm_90a") == cuda_build.ptxas_report(
        source, "sm_90a", use_cache=False
    )
