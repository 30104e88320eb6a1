"""The sm_90 cluster kernels (CUDA C++, cuda/norm_cluster.cu): their compile check for sm_90a
(no GPU: every kernel the library holds compiles without spills), their launch planning,
which calls they take, and their results against float64: on the CPU through the CUDA
emulation (the same source built against shared/cuda/cuda_emulation.h), on an sm_90 GPU at
the lengths they are for. The whole correctness suite also runs them there
(test_correctness's "cuda-cluster" target)."""

from __future__ import annotations

import ctypes
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from openkernels.layernorm import cuda as C
from openkernels.shared import cuda_build, dispatch
from openkernels.shared.dev.testing import assert_close, random_tensor
from openkernels.shared.dispatch import DispatchKey


@pytest.mark.aot
def test_every_cluster_kernel_compiles_for_sm_90a_without_spills() -> None:
    """CI's compile check (runs where the AOT targets include sm_90 and nvcc is installed, as
    on the CI image)."""
    from openkernels.shared.dev.testing.aot import targets_from_env

    if "sm_90" not in targets_from_env():
        pytest.skip("sm_90 is not among the AOT targets")
    if cuda_build.nvcc() is None:  # the CI image has nvcc (13.0): this skip is for other machines
        pytest.skip("no nvcc: the CUDA C++ compile check cannot run here")
    # The builds' nvcc runs side by side (one process each; cold, 15-20 s apiece). The pushed
    # forward's plain build: neither macro (cp.async staging, untrimmed passes). (The study
    # builds sp / sp2, measured slower on an H100 in layernorm 0.11.14, are no longer checked.)
    builds = ((C._SOURCE, ()), (C._PUSH_SOURCE, C.PUSH_DEFAULT_FLAGS), (C._PUSH_SOURCE, ()))
    with ThreadPoolExecutor(len(builds)) as pool:
        cluster, push, plain = pool.map(lambda b: cuda_build.ptxas_report(b[0], C.ARCH, b[1]), builds)
    reports = cluster + push
    assert len(plain) == 5 * len(C.PUSH_SHAPES), [r.name for r in plain]
    for r in plain:
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
        assert r.odd_descriptors <= 0, r
    kinds = (("fwd_cluster", C.SHORT_SHAPES + C.SHAPES), ("fwd_staged", C.SHORT_SHAPES + C.SHAPES),
             ("fwd_push", C.PUSH_SHAPES), ("bwd_cluster", C.BWD_SHAPES),
             ("bwd_staged", C.BWD_STAGED_SHAPES))  # fmt: skip
    for kind, shapes in kinds:
        kernels = [r for r in reports if f"norm_{kind}_kernel" in r.name]
        # 5 (row dtype, weight dtype) pairs x the shapes the host entries dispatch to (the pushed
        # forward twice: an instance for RMSNorm calls and one for the others).
        assert len(kernels) == (10 if kind == "fwd_push" else 5) * len(set(shapes)), [r.name for r in reports]
        for r in kernels:
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
            assert r.odd_descriptors <= 0, r  # an odd uniform register for a descriptor: illegal on the GPU
        for threads, vpt in shapes:
            assert any(f"Li{threads}ELi{vpt}E" in r.name for r in kernels), (kind, threads, vpt)


@pytest.mark.aot
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_the_library_builds_and_answers_without_a_gpu() -> None:
    """The shared library nvcc builds on first use loads on a machine without a GPU; its host
    entry answers with a status (no driver: cudaErrorInsufficientDriver) rather than crash,
    and refuses a cluster past 16 before touching the device."""
    from openkernels.shared.dev.testing.aot import targets_from_env

    if "sm_90" not in targets_from_env():
        pytest.skip("sm_90 is not among the AOT targets")
    if cuda_build.nvcc() is None:
        pytest.skip("no nvcc: the library cannot be built here")
    lib = C._library()
    args = [1, 1, 256, 4, 1, 1, *[None] * 8, 4096, 4096, 0, 4096, 0, 1e-6, 0.0, 9, 0]
    assert lib.ok_norm_fwd_cluster(0, *args) == 35
    args[4] = 17
    assert lib.ok_norm_fwd_cluster(0, *args) == -3
    bwd = [1, 1, 256, 2, 1, 1, *[None] * 9, 4, 4096, 4096, 4096, 0, 4096, 4, 0.0, 9, 0]
    assert lib.ok_norm_bwd_cluster(0, *bwd) == 35
    bwd[4] = 0
    assert lib.ok_norm_bwd_cluster(0, *bwd) == -3
    # The packed twins replay runs: the same answers from the same arguments in 64-bit slots.
    for name, values, doubles in (("ok_norm_fwd_cluster", [0, *args], (20, 21)),
                                  ("ok_norm_bwd_cluster", [0, *bwd], (23,))):  # fmt: skip
        packed = getattr(lib, name).packed
        assert packed, f"{name}_packed is not exported"
        run = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int64))(packed)
        slots = [struct.unpack("<q", struct.pack("<d", v))[0] if i in doubles else int(v or 0)
                 for i, v in enumerate(values)]  # fmt: skip
        assert len(slots) == len(getattr(lib, name).pointer)
        assert run((ctypes.c_int64 * len(slots))(*slots)) == -3
        slots[5] = 1
        assert run((ctypes.c_int64 * len(slots))(*slots)) == 35


@pytest.mark.parametrize(
    ("n_cols", "dtype", "want"),
    [
        (2048, torch.bfloat16, (128, 2, 1)),
        (4000, torch.bfloat16, (256, 2, 1)),
        (8192, torch.float16, (256, 4, 1)),
        (5000, torch.float32, (256, 8, 1)),
        (16384, torch.bfloat16, (256, 4, 2)),
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
def test_cluster_config_one_cta_for_short_rows_else_the_narrowest_portable_cluster(
    n_cols, dtype, want
) -> None:
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
    """Registered under Triton's priority (the default forward is "push", then Triton): usable
    on sm_90, picked only by name; refused with a reason elsewhere."""
    hopper = DispatchKey("cuda", "sm_90", torch.bfloat16)
    if C.supports(hopper) is None:
        names = [impl.name for impl in dispatch.select("rms_norm", hopper)]
        assert names.index("triton") < names.index("cluster"), names
        with dispatch.force("cluster"):
            assert dispatch.select("rms_norm", hopper)[0].name == "cluster"
            assert dispatch.select("rms_norm_backward", hopper)[0].name == "cluster"
    assert "sm_90" in C.supports(DispatchKey("cuda", "sm_80", torch.bfloat16))
    assert "sm_90" in C.supports(DispatchKey("rocm", "gfx942", torch.bfloat16))
    assert "dtype" in C.supports(DispatchKey("cuda", "sm_90", torch.float64))


def _sm_90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The CPU runs the kernels built for the emulation (cuda_emulation.h: threads as fibers, a CTA
# per OS thread), on small rows that still take clusters of several CTAs; sm_90 the real ones.
DEVICES = [pytest.param("cpu", id="emulated")]
if _sm_90():
    DEVICES.append(pytest.param("cuda", id="cuda", marks=pytest.mark.gpu))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["registers", "staged", "push", "push-plain"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_against_float64(rms: bool, dtype: torch.dtype, kind: str, device: str) -> None:
    """Every built shape at the row lengths it is picked for (one CTA per short row, clusters
    for long ones, a ragged last chunk), with a residual stored, weight and bias, rows with a
    large mean (LayerNorm) and one with an outlier first element and a ramp, a NaN row; two runs bitwise
    equal. The chunk held in registers,
    and staged in shared memory (cp.async: the emulation fills shared memory with NaN bytes
    and copies only at the wait, so a read before it fails), and the pushed kernel (staged,
    per-warp statistics stored into every CTA by st.async, counted on mbarriers; its chunk
    staged by one bulk copy, which in the emulation lands only at a wait or, on alternate
    launches, at once; bfloat16 pairs by shift and mask, LayerNorm in one pass), also in its
    plain build (cp.async staging, untrimmed passes)."""
    from openkernels.layernorm import reference as R

    cases = [(300, 2048, None), (64, 4096, None), (7, 8192, None), (5, 1000, (128, 2)), (3, 65536, None),
             (2, 262144, None), (2, 262152, None), (1, 1048576, None), (5, 20000, (256, 4)), (3, 131072, (256, 8)),
             (2, 200000, (512, 8)), (2, 300000, (512, 16))]  # fmt: skip
    if device == "cpu":  # one CTA, clusters of 3 and 5 with a ragged last chunk, a 32768-element chunk
        cases = [(3, 1000, (128, 2)), (2, 5000, (128, 2)), (2, 9800, (128, 2)), (2, 40000, (512, 8))]
    push = {"push": True, "push-plain": "plain"}.get(kind, False)
    if push:  # its own shapes: the lengths push_config routes, ragged chunks, one CTA
        cases = [
            (3, 32768, (256, 8)),
            (3, 65536, (256, 4)),
            (2, 131072, (256, 8)),
            (2, 262144, (512, 8)),
            (2, 262152, (512, 8)),
            (5, 20000, (256, 4)),
            (2, 200000, (512, 8)),
            (2, 262144, (256, 8)),
            (2, 100000, (256, 4)),
        ]  # fmt: skip  (the last two: clusters of 16, 13)
        if device == "cpu":  # 65544: the third CTA holds one vector, its 15 other warps none, and
            # their parts (48 in all) are merged after others in the same lane (as 262152 on the GPU)
            # 16384: two full CTAs, every warp's part of one count (the equal-count merge)
            cases = [(2, 2000, (256, 4)), (2, 20000, (256, 4)), (2, 40000, (512, 8)), (2, 65544, (512, 8)),
                     (2, 16384, (256, 4))]  # fmt: skip
    for m, n, shape in cases:
        cfg = C.cluster_config(n, dtype, shape)
        staged = kind != "registers"
        if cfg is None or (staged and C.staged_bytes(cfg, True) > C.MAX_STAGED_BYTES):
            continue
        x = random_tensor((m, n), dtype, device) + (0.0 if rms else 5.0)
        r = random_tensor((m, n), dtype, device)
        w = random_tensor((n,), dtype, device)
        b = None if rms else random_tensor((n,), dtype, device)
        x[m - 1, n // 3] = float("nan")
        if not rms:  # an outlier first element: the default build's warp shift is far from its mean there
            x[0, 0] = 3000.0
            # and a ramp along the row: the warps' means differ, so the merge of their parts
            # carries most of the variance (the equal-count merge's between-part term)
            x[0] += torch.linspace(-40.0, 40.0, n, device=device).to(dtype)
        runs = []
        for _ in range(2):
            y, h = torch.empty_like(x), torch.empty_like(x)
            mean = None if rms else torch.empty(m, device=device)
            rstd = torch.empty(m, device=device)
            assert C.unsupported_call(x, r, w, b, y, h, mean, rstd, dtype) is None
            C.norm_fwd(x, r, w, b, y, h, mean, rstd, eps=1e-6, weight_offset=0.5, rms=rms, h_dtype=dtype,
                       config=shape, staged=staged, push=push)  # fmt: skip
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


def test_push_config_routes_the_lengths_it_measured_faster_at() -> None:
    """The default forward on sm_90 ("push", above Triton) runs the pushed kernel for 16-bit
    rows of 32768-262144 columns (32768-65536 with a residual) on portable clusters, and hands
    every other call to Triton; explain names where a call goes."""
    bf16 = torch.bfloat16
    assert C.push_config(65536, bf16, False) == C.ClusterConfig(256, 8, 4)
    assert C.push_config(32768, torch.float16, False) == C.ClusterConfig(256, 8, 2)
    assert C.push_config(262144, bf16, False) == C.ClusterConfig(512, 8, 8)
    assert C.push_config(200000, bf16, False) == C.ClusterConfig(512, 8, 7)
    assert C.push_config(65536, bf16, True) == C.ClusterConfig(256, 4, 8)
    for n, residual, dtype in ((16384, False, bf16), (524288, False, bf16), (131072, True, bf16),
                               (65536, False, torch.float32)):  # fmt: skip
        assert C.push_config(n, dtype, residual) is None, (n, residual, dtype)
    for n in (32768, 65536, 131072, 262144):
        for residual in (False, True):
            cfg = C.push_config(n, bf16, residual)
            if cfg is not None:
                assert (
                    cfg.cluster <= C.PORTABLE_CLUSTER
                    and (cfg.threads, cfg.vectors_per_thread) in C.PUSH_SHAPES
                )
    key = DispatchKey("cuda", "sm_90", bf16)
    if C.push_supports(key) is None:
        assert dispatch.select("rms_norm", key)[0].name == "push"
        assert dispatch.select("rms_norm_backward", key)[0].name == "triton"
    assert "sm_90" in C.push_supports(DispatchKey("cuda", "sm_80", bf16))
    assert "bfloat16" in C.push_supports(DispatchKey("cuda", "sm_90", torch.float32))
    assert C._explain_push(torch.empty(2, 65536, dtype=bf16)) is None  # CPU tensors: no note


def test_non_portable_clusters_are_routed_only_where_the_device_schedules_them(monkeypatch) -> None:
    """RMSNorm calls take clusters of 9-16 CTAs where they measured faster (past 131072 columns,
    with a residual past 65536), LayerNorm calls without a residual too (past 131072 columns),
    both up to 524288 columns, once the device says it schedules them (asked once per device
    and kernel; the emulation schedules up to 16); else the portable launch (or Triton)."""
    bf16 = torch.bfloat16
    assert C.push_config(262144, bf16, False, wide=True) == C.ClusterConfig(256, 8, 16)
    assert C.push_config(200000, bf16, False, wide=True) == C.ClusterConfig(256, 8, 13)
    assert C.push_config(131072, bf16, False, wide=True) == C.ClusterConfig(256, 8, 8)
    assert C.push_config(131072, bf16, True, wide=True) == C.ClusterConfig(256, 4, 16)
    assert C.push_config(100000, bf16, True, wide=True) == C.ClusterConfig(256, 4, 13)
    assert C.push_config(262144, bf16, True, wide=True) == C.ClusterConfig(256, 8, 16)
    assert C.push_config(262152, bf16, False, wide=True) == C.ClusterConfig(512, 8, 9)
    assert C.push_config(524288, bf16, False, wide=True) == C.ClusterConfig(512, 8, 16)
    assert C.push_config(524288, bf16, False) is None  # 32768 per CTA: 16 CTAs, not portable
    for n, residual in ((16384, False), (524296, False), (262152, True), (16384, True)):
        assert C.push_config(n, bf16, residual, wide=True) is None, (n, residual)
    x, w = torch.empty(2, 262144, dtype=bf16), torch.empty(262144, dtype=bf16)
    C._wide_fits.clear()
    for rms_only in (True, False):  # the RMSNorm instance and the other one
        assert C.wide_clusters_fit(x, w, C.ClusterConfig(256, 8, 16), False, rms_only)
        past_16 = C.ClusterConfig(256, 8, 17)
        assert not C.wide_clusters_fit(x, w, past_16, False, rms_only)  # the entry refuses
    assert C._push_route(x, False, w, rms_only=True) == C.ClusterConfig(256, 8, 16)
    assert C._push_route(x, False, w, rms_only=False) == C.ClusterConfig(256, 8, 16)  # LayerNorm too
    assert C._push_route(x, True, w, rms_only=False) is None  # LayerNorm with a residual: Triton

    class Rows:  # x seen as a GPU call's rows (explain notes only those), on a part that schedules 16
        is_cuda, shape, dtype, device = True, x.shape, x.dtype, x.device

    monkeypatch.setattr(C, "wide_clusters_fit", lambda *args: True)

    note = C._explain_push(Rows(), w)  # a public call's arguments: RMSNorm's route (LayerNorm's the same)
    assert "clusters of 16 (non-portable" in note and "LayerNorm" not in note, note
    note = C._explain_push(Rows(), w, residual=x)  # with a residual: LayerNorm's beside it
    assert "clusters of 16 (non-portable" in note and "LayerNorm calls: handed on to 'triton'" in note, note
    launcher = dict(eps=1e-6, weight_offset=0.0, h_dtype=bf16)
    note = C._explain_push(
        Rows(), None, w, w, x, None, None, None, rms=False, **launcher
    )  # LayerNorm's launch
    assert note.endswith("clusters of 16 (non-portable: this device schedules them))"), note
    note = C._explain_push(Rows(), x, w, w, x, x, None, None, rms=False, **launcher)  # with a residual
    assert note.startswith("handed on to 'triton'"), note
    note = C._explain_push(Rows(), None, w, None, x, None, None, None, rms=True, **launcher)
    assert note.endswith("clusters of 16 (non-portable: this device schedules them))"), note
    C._wide_fits.clear()
    monkeypatch.setattr(C, "wide_clusters_fit", lambda *args: False)  # a part that cannot schedule 16
    assert C._push_route(x, False, w, rms_only=True) == C.ClusterConfig(512, 8, 8)
    assert C._push_route(x, False, w, rms_only=False) == C.ClusterConfig(512, 8, 8)
    assert C._push_route(x, True, w, rms_only=True) is None  # with a residual: Triton
    wider = torch.empty(2, 524288, dtype=bf16)
    assert C._push_route(wider, False, None, rms_only=True) is None  # no portable launch: Triton


def test_a_refused_non_portable_launch_falls_back_to_portable_clusters(monkeypatch) -> None:
    """A device that refuses a cluster of 9-16 CTAs it had said it schedules: one warning, this
    call and every later one on portable clusters (the pushed kernel still runs), the result
    right; the cluster kernels stay on."""
    from openkernels.layernorm import reference as R

    lib = C._load(torch.device("cpu"), True)
    launch = lib.ok_norm_fwd_push
    clusters = []

    def refusing(*args):  # status 1 (invalid value) for a non-portable cluster, as a driver may answer
        clusters.append(args[5])
        return 1 if args[5] > C.PORTABLE_CLUSTER else launch(*args)

    monkeypatch.setattr(lib, "ok_norm_fwd_push", refusing)
    monkeypatch.setattr(C, "_wide_refused", set())
    m, n, dtype = 2, 140000, torch.bfloat16
    x, w = random_tensor((m, n), dtype, "cpu"), random_tensor((n,), dtype, "cpu")
    y, rstd = torch.empty_like(x), torch.empty(m)
    with pytest.warns(RuntimeWarning, match="portable clusters"):
        C.push_norm_fwd(
            x, None, w, None, y, None, None, rstd, eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype
        )
    assert clusters == [9, 5] and not C._broken, (clusters, C._broken)
    want = [torch.empty(m, n, dtype=torch.float64) for _ in range(2)] + [
        None,
        torch.empty(m, dtype=torch.float64),
    ]
    R.norm_fwd(
        x.double(), None, w.double(), None, *want, eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype
    )
    assert_close(y, want[0], dtype=dtype, terms=n, msg="y")
    assert C._push_route(x, False, w, rms_only=True) == C.ClusterConfig(512, 8, 5)
    C.push_norm_fwd(
        x, None, w, None, y, None, None, rstd, eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype
    )
    assert clusters == [9, 5, 5]


@pytest.mark.parametrize(
    "n,residual,rms", [(32768, False, True), (32768, True, True), (140000, False, True), (70000, True, True),
                       (140000, False, False), (270000, False, True)],
    ids=["plain", "residual", "plain-wide", "residual-wide", "layernorm-wide", "plain-past-262144"],
)  # fmt: skip
def test_the_default_launcher_runs_the_pushed_kernel_emulated(n: int, residual: bool, rms: bool) -> None:
    """cuda.push_norm_fwd (dispatch "push") on rows push_config routes: the pushed kernel, under
    the emulation here (2 rows of 32768 bf16 columns: clusters of 2, of 4 with a residual; of
    140000 (RMSNorm and LayerNorm) and, with a residual, 70000: non-portable clusters of 9, a
    ragged last CTA; 270000: 9 CTAs of 32768 columns)."""
    from openkernels.layernorm import reference as R

    m, dtype = 2, torch.bfloat16
    x, w = random_tensor((m, n), dtype, "cpu"), random_tensor((n,), dtype, "cpu")
    b = None if rms else random_tensor((n,), dtype, "cpu")
    r = random_tensor((m, n), dtype, "cpu") if residual else None
    y, h, rstd = torch.empty_like(x), torch.empty_like(x) if residual else None, torch.empty(m)
    mean = None if rms else torch.empty(m)
    cfg = C._push_route(x, residual, w, rms_only=rms)
    assert cfg is not None and (cfg.cluster == 9) == (n > 65536), cfg
    C.push_norm_fwd(x, r, w, b, y, h, mean, rstd, eps=1e-6, weight_offset=0.0, rms=rms, h_dtype=dtype)
    assert not C._broken, C._broken
    want = [torch.empty(m, n, dtype=torch.float64) for _ in range(2)] + [
        None if rms else torch.empty(m, dtype=torch.float64),
        torch.empty(m, dtype=torch.float64),
    ]
    R.norm_fwd(x.double(), None if r is None else r.double(), w.double(), None if b is None else b.double(),
               *want, eps=1e-6, weight_offset=0.0, rms=rms, h_dtype=dtype)  # fmt: skip
    assert_close(y, want[0], dtype=dtype, terms=n, msg="y")
    assert_close(rstd, want[3], dtype=torch.float32, terms=n, msg="rstd")
    if not rms:
        assert_close(mean, want[2], dtype=torch.float32, terms=n, msg="mean")
    if residual:
        assert_close(h, want[1], dtype=dtype, msg="h")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm_90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize(
    "n,residual", [(262144, False), (200000, False), (100000, True), (262144, True), (524288, False), (300000, False)]
)  # fmt: skip
def test_the_public_op_pushed_on_non_portable_clusters(n: int, residual: bool) -> None:
    """rms_norm on rows the default routes to clusters of 9-16 CTAs where this GPU schedules
    them (explain names the cluster): y and h against float64, two calls bitwise equal."""
    import openkernels.layernorm as LN
    from openkernels.layernorm import reference as R

    dtype = torch.bfloat16
    x, w = random_tensor((3, n), dtype, "cuda"), random_tensor((n,), dtype, "cuda")
    r = random_tensor((3, n), dtype, "cuda") if residual else None
    cfg = C._push_route(x, residual, w, rms_only=True)
    assert cfg is not None
    note = dispatch.explain("rms_norm", x, w, residual=r)
    assert f"clusters of {cfg.cluster}" in note, note
    print(torch.cuda.get_device_name(), n, residual, cfg)  # the route, for the device log (-s)
    runs = [LN.rms_norm(x, w, 1e-6, residual=r, prenorm=True) if residual else LN.rms_norm(x, w, 1e-6)
            for _ in range(2)]  # fmt: skip
    assert not C._broken, C._broken
    y, h = runs[0] if residual else (runs[0], None)
    assert torch.equal(y, runs[1][0] if residual else runs[1])
    want = [torch.empty(3, n, dtype=torch.float64) for _ in range(2)] + [
        None,
        torch.empty(3, dtype=torch.float64),
    ]
    R.norm_fwd(x.double().cpu(), None if r is None else r.double().cpu(), w.double().cpu(), None, *want,
               eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype)  # fmt: skip
    assert_close(y, want[0], dtype=dtype, terms=n, msg="y")
    if residual:
        assert_close(h, want[1], dtype=dtype, msg="h")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm_90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("n", [262144, 200000, 524288])
def test_layer_norm_pushed_on_non_portable_clusters(n: int) -> None:
    """layer_norm on rows the default routes to clusters of 9-16 CTAs where this GPU schedules
    them (layernorm 0.11.14): y, mean and rstd against float64, rows with a large mean among
    them, two calls bitwise equal."""
    import openkernels.layernorm as LN
    from openkernels.layernorm import reference as R

    dtype = torch.bfloat16
    x, w, b = (random_tensor(s, dtype, "cuda") for s in ((3, n), (n,), (n,)))
    x[1] += 50.0  # a large mean: the centring must not cancel
    cfg = C._push_route(x, False, w, rms_only=False)
    assert cfg is not None
    print(torch.cuda.get_device_name(), n, cfg)  # the route, for the device log (-s)
    runs = [LN.layer_norm(x, w, b, 1e-5) for _ in range(2)]
    assert not C._broken, C._broken
    assert torch.equal(runs[0], runs[1])
    want = [torch.empty(3, n, dtype=torch.float64), None, torch.empty(3, dtype=torch.float64),
            torch.empty(3, dtype=torch.float64)]  # fmt: skip
    R.norm_fwd(x.double().cpu(), None, w.double().cpu(), b.double().cpu(), *want, eps=1e-5, weight_offset=0.0,
               rms=False, h_dtype=dtype)  # fmt: skip
    assert_close(runs[0], want[0], dtype=dtype, terms=n, msg="y")


def test_backward_config_and_calls() -> None:
    assert tuple(C.cluster_config(65536, torch.bfloat16, shapes=C.BWD_SHAPES)) == (512, 2, 8)
    assert tuple(C.cluster_config(16384, torch.bfloat16, shapes=C.BWD_SHAPES)) == (256, 2, 4)
    assert tuple(C.cluster_config(131072, torch.bfloat16, shapes=C.BWD_SHAPES)) == (512, 2, 16)
    assert C.cluster_config(131080, torch.bfloat16, shapes=C.BWD_SHAPES) is None
    m, n = 4, 4096
    dy, h, dh_out, dh = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(4))
    w, stats = torch.empty(n, dtype=torch.bfloat16), torch.empty(m)
    dw = torch.empty(n)
    assert C.unsupported_bwd_call(dy, h, w, stats, stats, dh_out, dh, dw, dw) is None
    assert C.unsupported_bwd_call(dy, h, w.float(), None, stats, None, dh, dw, None) is None
    assert "different dtypes" in C.unsupported_bwd_call(dy.float(), h, w, None, stats, None, dh, dw, None)
    assert "weight dtype" in C.unsupported_bwd_call(dy, h, w.half(), None, stats, None, dh, dw, None)
    odd = torch.empty(m, n + 8, dtype=torch.bfloat16)[:, 4 : n + 4]
    assert "aligned" in C.unsupported_bwd_call(odd, h, w, None, stats, None, dh, dw, None)
    assert tuple(C.cluster_config(262144, torch.bfloat16, shapes=C.BWD_STAGED_SHAPES)) == (512, 4, 16)
    long = torch.empty(1, 262152, dtype=torch.bfloat16)
    assert "backward" in C.unsupported_bwd_call(long, long, None, None, stats, None, long, None, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staged", [False, True], ids=["registers", "staged"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backward_against_float64(rms: bool, dtype: torch.dtype, staged: bool, device: str) -> None:
    """dh, dweight and dbias of every backward shape against float64: runs of rows per
    cluster (more rows than clusters), a ragged last chunk, dh_out, a float32 weight; two
    runs bitwise equal (fixed-order sums). Staged: the two-row cp.async pipeline (in the
    emulation a copy lands only at its wait_group, so reading a stage early fails)."""
    from openkernels.layernorm import reference as R

    cases = [(4096, 16384, None, dtype), (300, 65536, None, dtype), (7, 131072, None, dtype),
             (33, 20000, (256, 2), dtype), (64, 40000, (512, 2), torch.float32)]  # fmt: skip
    if staged:
        cases += [(40, 262144, None, dtype), (50, 100000, (256, 4), dtype)]
    if device == "cpu":  # 2 clusters of 3 CTAs for 9 rows (runs of 5 and 4: both slot parities)
        cases = [(9, 10000, (256, 2), dtype), (5, 3000, (256, 2), torch.float32)]
        if staged:  # a run of one row, and 4-vector chunks
            cases += [(3, 20000, (256, 4), dtype)]
    shapes = C.BWD_STAGED_SHAPES if staged else C.BWD_SHAPES
    for m, n, shape, w_dtype in cases:
        cfg = C.cluster_config(n, dtype, shape, shapes)
        if cfg is None:
            continue
        h = random_tensor((m, n), dtype, device) + (0.0 if rms else 3.0)
        dy, dh_out = random_tensor((m, n), dtype, device), random_tensor((m, n), dtype, device)
        w = random_tensor((n,), w_dtype, device)
        hd = h.double().cpu()
        mean = torch.zeros(m, dtype=torch.float64) if rms else hd.mean(-1)
        rstd = ((hd - mean[:, None]).square().mean(-1) + 1e-6).rsqrt()
        mean_d = None if rms else mean.float().to(device)
        runs = []
        for _ in range(2):
            got = [torch.empty_like(h), torch.empty(n, device=device, dtype=w_dtype)]
            got.append(None if rms else torch.empty(n, device=device, dtype=w_dtype))
            assert C.unsupported_bwd_call(dy, h, w, mean_d, rstd.float().to(device), dh_out, *got) is None
            C.norm_bwd(
                dy,
                h,
                w,
                mean_d,
                rstd.float().to(device),
                dh_out,
                *got,
                weight_offset=0.5,
                rms=rms,
                config=shape,
                staged=staged,
                ctas_per_sm=1 if n == 20000 else None,
            )
            runs.append(got)
        assert not C._broken, C._broken
        for a, b in zip(*runs):
            assert a is None or torch.equal(a, b), f"{m}x{n}: runs differ"
        got = runs[0]
        want = [torch.empty(m, n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)]
        want.append(None if rms else torch.empty(n, dtype=torch.float64))
        R.norm_bwd(dy.double().cpu(), hd, w.double().cpu(), None if rms else mean, rstd, dh_out.double().cpu(),
                   *want, weight_offset=0.5, rms=rms)  # fmt: skip
        scale = float(rstd.max()) * float(dy.abs().max()) * 2.0
        msg = f"{m}x{n} {cfg}"
        assert_close(got[0], want[0], dtype=dtype, terms=n, term_scale=scale, msg=f"{msg} dh")
        assert_close(got[1], want[1], dtype=w_dtype, terms=m, term_scale=scale * 4, msg=f"{msg} dw")
        if not rms:
            assert_close(got[2], want[2], dtype=w_dtype, terms=m, term_scale=scale, msg=f"{msg} db")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize(
    ("residual", "store", "weight", "bias"),
    [
        (False, False, False, False),
        (False, True, True, False),
        (False, False, True, True),  # LayerNorm's common call: weight and bias, no residual
        (True, False, False, True),
        (True, True, True, True),
    ],
)
@pytest.mark.parametrize("kind", ["registers", "staged", "push", "push-plain"])
def test_forward_flags_emulated(
    rms: bool, residual: bool, store: bool, weight: bool, bias: bool, kind: str
) -> None:
    """Each optional input and output of the forward on or off (the stream stored without a
    residual is x itself), on a row split over a cluster of 3, against float64."""
    from openkernels.layernorm import reference as R

    if rms and bias:
        pytest.skip("RMSNorm has no bias")
    push = {"push": True, "push-plain": "plain"}.get(kind, False)
    m, n, dtype = 3, 20000 if push else 5000, torch.bfloat16  # clusters of 3 (push: 8192 per CTA)
    x = random_tensor((m, n), dtype, "cpu")
    r = random_tensor((m, n), dtype, "cpu") if residual else None
    w = random_tensor((n,), dtype, "cpu") if weight else None
    b = random_tensor((n,), dtype, "cpu") if bias else None
    y = torch.empty_like(x)
    h = torch.empty_like(x) if store else None
    mean = None if rms else torch.empty(m)
    rstd = torch.empty(m)
    assert C.unsupported_call(x, r, w, b, y, h, mean, rstd, dtype) is None
    C.norm_fwd(
        x,
        r,
        w,
        b,
        y,
        h,
        mean,
        rstd,
        eps=1e-6,
        weight_offset=0.0,
        rms=rms,
        h_dtype=dtype,
        config=(256, 4) if push else (128, 2),
        staged=kind != "registers",
        push=push,
    )
    want = [torch.empty(m, n, dtype=torch.float64) for _ in range(2)]
    want += [None if rms else torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.float64)]
    double = [None if t is None else t.double() for t in (x, r, w, b)]
    R.norm_fwd(*double, *want, eps=1e-6, weight_offset=0.0, rms=rms, h_dtype=dtype)
    assert_close(y, want[0], dtype=dtype, terms=n, msg="y")
    if store:
        assert_close(h, want[1], dtype=dtype, msg="h")
    assert_close(rstd, want[3], dtype=torch.float32, terms=n, msg="rstd")
