"""The sm_90 cluster forward (CUDA C++, cuda/norm_cluster.cu): its compile check for sm_90a
(no GPU: every kernel the library holds compiles without spills), its launch planning, which
calls it takes, and, on an sm_90 GPU, its results against float64 at the lengths it is for.
The whole correctness suite also runs it there (test_correctness's "cuda-cluster" target)."""

from __future__ import annotations

import pytest
import torch

from openkernels.layernorm import cuda as C
from openkernels.shared import cuda_build, dispatch
from openkernels.shared.dev.testing import assert_close, random_tensor
from openkernels.shared.dispatch import DispatchKey


@pytest.mark.aot
def test_every_cluster_kernel_compiles_for_sm_90a_without_spills() -> None:
    """CI's compile check: nvcc is part of the CI machine; a missing one fails here rather
    than leave the kernels unchecked (runs where the AOT targets include sm_90)."""
    from openkernels.shared.dev.testing.aot import targets_from_env

    if "sm_90" not in targets_from_env():
        pytest.skip("sm_90 is not among the AOT targets")
    assert cuda_build.nvcc() is not None, "nvcc is needed for the CUDA C++ compile check"
    reports = cuda_build.ptxas_report(C._SOURCE, C.ARCH)
    kernels = [r for r in reports if "norm_fwd_cluster_kernel" in r.name]
    # 5 (row dtype, weight dtype) pairs x the shapes the host entry dispatches to.
    assert len(kernels) == 5 * len(C.SHAPES), [r.name for r in reports]
    for r in kernels:
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
    for threads, vpt in C.SHAPES:
        assert any(f"Li{threads}ELi{vpt}E" in r.name for r in kernels), (threads, vpt)


@pytest.mark.aot
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_the_library_builds_and_answers_without_a_gpu() -> None:
    """The shared library nvcc builds on first use loads on a machine without a GPU; its host
    entry answers with a status (no driver: cudaErrorInsufficientDriver) rather than crash,
    and refuses a cluster past 16 before touching the device."""
    from openkernels.shared.dev.testing.aot import targets_from_env

    if "sm_90" not in targets_from_env():
        pytest.skip("sm_90 is not among the AOT targets")
    lib = C._library()
    args = [1, 1, 256, 4, 1, 1, *[None] * 8, 4096, 4096, 0, 4096, 0, 1e-6, 0.0, 9, None]
    assert lib.ok_norm_fwd_cluster(0, *args) == 35
    args[4] = 17
    assert lib.ok_norm_fwd_cluster(0, *args) == -3


@pytest.mark.parametrize(
    ("n_cols", "dtype", "want"),
    [
        (2048, torch.bfloat16, (256, 4, 1)),
        (65536, torch.bfloat16, (256, 4, 8)),
        (65544, torch.bfloat16, (256, 8, 5)),
        (131072, torch.bfloat16, (256, 8, 8)),
        (262144, torch.bfloat16, (512, 8, 8)),
        (524288, torch.float16, (512, 16, 8)),
        (1048576, torch.bfloat16, (512, 16, 16)),
        (65536, torch.float32, (256, 8, 8)),
        (524288, torch.float32, (512, 16, 16)),
    ],
)
def test_cluster_config_takes_the_narrowest_chunk_that_stays_portable(n_cols, dtype, want) -> None:
    assert tuple(C.cluster_config(n_cols, dtype)) == want


def test_cluster_config_limits() -> None:
    assert C.cluster_config(16 * 65536 + 8, torch.bfloat16) is None  # past 16 of the widest chunks
    assert C.cluster_config(16 * 8192 + 8, torch.bfloat16, (256, 4)) is None
    assert tuple(C.cluster_config(16 * 8192, torch.bfloat16, (256, 4))) == (256, 4, 16)


def _call(n_rows=4, n_cols=4096, dtype=torch.bfloat16, *, residual=True, weight_dtype=None, bias=True,
          h_dtype=None, out_dtype=None, offset=0):  # fmt: skip
    """The forward's arguments on the CPU (unsupported_call reads only metadata and addresses)."""
    x = torch.empty(n_rows, n_cols + offset, dtype=dtype)[:, offset:]
    res = torch.empty(n_rows, n_cols, dtype=dtype) if residual else None
    w_dtype = weight_dtype or dtype
    w = torch.empty(n_cols, dtype=w_dtype)
    b = torch.empty(n_cols, dtype=w_dtype) if bias else None
    out = torch.empty(n_rows, n_cols, dtype=out_dtype or dtype)
    res_out = torch.empty(n_rows, n_cols, dtype=h_dtype or dtype) if residual else None
    stats = torch.empty(n_rows)
    return (x, res, w, b, out, res_out, stats, stats, h_dtype or dtype)


def test_which_calls_the_cluster_kernel_takes() -> None:
    assert C.unsupported_call(*_call()) is None
    assert C.unsupported_call(*_call(dtype=torch.float32, weight_dtype=torch.float32)) is None
    assert C.unsupported_call(*_call(weight_dtype=torch.float32)) is None
    assert C.unsupported_call(*_call(residual=False, bias=False)) is None
    assert "vectors" in C.unsupported_call(*_call(n_cols=4100))
    assert "aligned" in C.unsupported_call(*_call(offset=4))  # rows starting 8 bytes in
    assert "different dtypes" in C.unsupported_call(*_call(h_dtype=torch.float32))
    assert "different dtypes" in C.unsupported_call(*_call(out_dtype=torch.float32))
    assert "weight or bias dtype" in C.unsupported_call(*_call(weight_dtype=torch.float16))
    assert "dtype" in C.unsupported_call(*_call(dtype=torch.float64))
    assert "longer than" in C.unsupported_call(*_call(n_rows=1, n_cols=2 * 1048576))


def test_dispatch_runs_the_cluster_kernel_only_when_forced() -> None:
    """Registered under Triton's priority until it is measured on the H200: usable on sm_90,
    picked only by name; refused with a reason elsewhere."""
    hopper = DispatchKey("cuda", "sm_90", torch.bfloat16)
    if C.supports(hopper) is None:
        assert dispatch.select("rms_norm", hopper)[0].name == "triton"
        with dispatch.force("cluster"):
            assert dispatch.select("rms_norm", hopper)[0].name == "cluster"
            assert dispatch.select("rms_norm_backward", hopper)[0].name == "triton"  # forward only
    assert "sm_90" in C.supports(DispatchKey("cuda", "sm_80", torch.bfloat16))
    assert "sm_90" in C.supports(DispatchKey("rocm", "gfx942", torch.bfloat16))
    assert "dtype" in C.supports(DispatchKey("cuda", "sm_90", torch.float64))


def _sm_90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm_90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_long_rows_against_float64(rms: bool, dtype: torch.dtype) -> None:
    """Every built shape at the row lengths it is picked for (and a ragged last chunk), with a
    residual stored, weight and bias, rows with a large mean (LayerNorm), a NaN row; two runs
    bitwise equal."""
    from openkernels.layernorm import reference as R

    cases = [(3, 65536, None), (2, 262144, None), (2, 262152, None), (1, 1048576, None), (5, 20000, (256, 4)),
             (3, 131072, (256, 8)), (2, 200000, (512, 8)), (2, 300000, (512, 16))]  # fmt: skip
    for m, n, shape in cases:
        cfg = C.cluster_config(n, dtype, shape)
        if cfg is None:
            continue
        x = random_tensor((m, n), dtype, "cuda") + (0.0 if rms else 5.0)
        r = random_tensor((m, n), dtype, "cuda")
        w = random_tensor((n,), dtype, "cuda")
        b = None if rms else random_tensor((n,), dtype, "cuda")
        x[m - 1, n // 3] = float("nan")
        runs = []
        for _ in range(2):
            y, h = torch.empty_like(x), torch.empty_like(x)
            mean = None if rms else torch.empty(m, device="cuda")
            rstd = torch.empty(m, device="cuda")
            assert C.unsupported_call(x, r, w, b, y, h, mean, rstd, dtype) is None
            C.norm_fwd(x, r, w, b, y, h, mean, rstd, eps=1e-6, weight_offset=0.5, rms=rms, h_dtype=dtype,
                       config=shape)  # fmt: skip
            runs.append((y, h, rstd, mean))
        assert not C._broken, C._broken
        for a, b_ in zip(runs[0], runs[1]):
            assert a is None or torch.equal(a.nan_to_num(7.0), b_.nan_to_num(7.0)), f"{m}x{n}: runs differ"
        y, h, rstd, mean = runs[0]
        want = [torch.empty(m, n, dtype=torch.float64) for _ in range(2)]
        want += [None if rms else torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.float64)]
        R.norm_fwd(x.double().cpu(), r.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(),
                   *want, eps=1e-6, weight_offset=0.5, rms=rms, h_dtype=dtype)  # fmt: skip
        msg = f"{m}x{n} {cfg}"
        assert torch.isnan(y[m - 1]).all(), f"{msg}: the NaN row"
        assert torch.isfinite(y[: m - 1]).all(), f"{msg}: the NaN spread"
        ok = slice(0, m - 1)
        assert_close(h[ok], want[1][ok], dtype=dtype, msg=f"{msg} h")
        assert_close(y[ok], want[0][ok], dtype=dtype, terms=n, msg=f"{msg} y")
        assert_close(rstd[ok], want[3][ok], dtype=torch.float32, terms=n, msg=f"{msg} rstd")
        if not rms:
            assert_close(
                mean[ok], want[2][ok], dtype=torch.float32, terms=n, term_scale=4.0, msg=f"{msg} mean"
            )
