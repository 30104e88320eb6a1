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
