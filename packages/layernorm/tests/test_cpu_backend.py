"""The CPU backend's entry points (cpu.norm_fwd / cpu.norm_bwd) against reference.py.

Every output is preallocated and filled with NaN, so an element the kernel does not write fails.
h (residual_out) must equal the reference's bit for bit: both add in float32 (float64 for float64 x)
and round once to h_dtype. The other outputs are compared with the reference run in float64 on the
same rounded numbers (h as float64, dy, weight, ...), with the tolerance of the output's dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from openkernels.layernorm import cpu, reference
from openkernels.shared import cpu_build
from openkernels.shared.dev.testing import assert_close, random_tensor
from openkernels.shared.dispatch import DispatchKey

pytestmark = pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler")

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def _nan(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, math.nan, dtype=dtype)


def _input(M: int, N: int, dtype: torch.dtype | None, pad: int = 0) -> torch.Tensor | None:
    """(M, N) with row stride N + pad (a slice of a wider tensor) when pad > 0; None for no dtype."""
    if dtype is None:
        return None
    t = random_tensor((M, N + pad), dtype)
    return t[:, :N] if pad else t


def _param(N: int, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A weight or bias (N,), or None for no dtype."""
    return None if dtype is None else random_tensor((N,), dtype)


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(F64)


def _sum_scale(rows: int) -> float:
    # dweight / dbias sum `rows` terms of size ~1 whose sum is ~sqrt(rows): the rounding error is relative
    # to the sum of magnitudes (~rows), so relative to the result it grows like sqrt(rows).
    return max(1.0, math.sqrt(rows))


def _h_ref(x, residual, h_dtype, rms):
    """h under the casting contract, from the reference itself (same float32 add as the kernel)."""
    M, N = x.shape
    acc = reference.stats_dtype(x.dtype)
    h = _nan((M, N), h_dtype)
    mean = None if rms else _nan((M,), acc)
    reference.norm_fwd(
        x, residual, None, None, _nan((M, N), x.dtype), h, mean, _nan((M,), acc),
        eps=1e-5, weight_offset=0.0, rms=rms, h_dtype=h_dtype,
    )  # fmt: skip
    return h


def _fwd64(h, weight, bias, *, eps, weight_offset, rms):
    """(out, mean, rstd) of the reference in float64 on the rounded h."""
    M, N = h.shape
    out, rstd = _nan((M, N), F64), _nan((M,), F64)
    mean = None if rms else _nan((M,), F64)
    reference.norm_fwd(
        h.to(F64), None, _f64(weight), _f64(bias),
        out, None, mean, rstd, eps=eps, weight_offset=weight_offset, rms=rms, h_dtype=F64,
    )  # fmt: skip
    return out, mean, rstd


FWD_CASES = [
    # id, (M, N), rms, x, residual, h_dtype, residual_out stored, out, weight, bias, weight_offset, pad
    ("rms-f32", (7, 127), True, F32, None, F32, False, F32, F32, None, 0.0, 0),
    ("ln-f32", (7, 127), False, F32, None, F32, False, F32, F32, F32, 0.0, 0),
    # float x read in place, one chunk: rows two at a time (fwd_short_pair), the odd last row alone
    ("ln-f32-pairs-strided", (10, 384), False, F32, None, F32, False, F32, F32, F32, 0.0, 3),
    ("ln-f32-pairs-odd-chunk", (9, 1024), False, F32, None, F32, False, F32, None, F32, 0.0, 0),
    ("ln-f64-pairs", (6, 384), False, F64, None, F64, False, F64, F64, None, 0.0, 0),
    ("rms-bf16-res-prenorm-strided", (33, 4097), True, BF16, BF16, BF16, True, BF16, BF16, None, 0.0, 5),
    ("rms-bf16-res-f32", (9, 300), True, BF16, F32, F32, True, F32, BF16, None, 0.0, 0),
    ("ln-f16-res-h-not-stored", (3, 4097), False, F16, F16, F16, False, F16, F16, F16, 0.0, 3),
    ("ln-bf16-h-f32", (5, 1000), False, BF16, None, F32, True, BF16, None, None, 0.0, 0),
    ("rms-f32-offset1", (6, 515), True, F32, None, F32, False, F32, BF16, None, 1.0, 0),
    ("rms-f32-res-h-bf16", (6, 515), True, F32, F32, BF16, True, BF16, F32, None, 0.0, 2),
    ("ln-bf16-out-f16", (4, 96), False, BF16, F16, BF16, True, F16, F32, BF16, 0.0, 0),
    ("ln-1x1", (1, 1), False, F32, None, F32, False, F32, None, None, 0.0, 0),
    ("rms-33x1", (33, 1), True, BF16, BF16, BF16, True, F32, F32, None, 0.0, 0),
    ("ln-no-affine", (9, 33), False, F32, F32, F32, True, F32, None, None, 0.0, 0),
    ("ln-bias-only", (9, 33), False, F16, None, F16, False, F32, None, F16, 0.0, 1),
    ("ln-f64", (5, 67), False, F64, F64, F64, True, F64, F64, F64, 0.0, 3),
    ("rms-f64", (5, 67), True, F64, F64, F64, True, F64, F64, None, 1.0, 0),
    ("rms-long-row", (2, 262144), True, BF16, BF16, BF16, True, BF16, BF16, None, 0.0, 0),
    ("ln-long-row", (2, 262144), False, F32, None, F32, False, F32, F32, F32, 0.0, 0),
    ("ln-many-rows", (515, 64), False, BF16, None, BF16, False, BF16, BF16, BF16, 0.0, 0),
    ("ln-empty", (0, 64), False, BF16, BF16, BF16, True, BF16, BF16, BF16, 0.0, 0),
    # 16-bit x, no residual, rows of several chunks: pass 2 converts x again (bfloat16: inside affine)
    ("ln-bf16-no-res-out-f32-strided", (5, 3000), False, BF16, None, BF16, False, F32, BF16, BF16, 0.0, 3),
    ("ln-bf16-no-res-stored", (3, 4097), False, BF16, None, BF16, True, BF16, F32, F32, 0.0, 0),
    ("rms-bf16-no-res-h-f32", (3, 2049), True, BF16, None, F32, True, F16, BF16, None, 1.0, 0),
    ("rms-f16-no-res-stored", (5, 2500), True, F16, None, F16, True, F16, F16, None, 0.0, 1),
]


@pytest.mark.parametrize(
    ("shape", "rms", "xd", "rd", "hd", "store_h", "od", "wd", "bd", "offset", "pad"),
    [pytest.param(*c[1:], id=c[0]) for c in FWD_CASES],
)
def test_forward(shape, rms, xd, rd, hd, store_h, od, wd, bd, offset, pad):
    M, N = shape
    acc = reference.stats_dtype(xd)
    eps = 1e-6 if rms else 1e-5
    x = _input(M, N, xd, pad)
    residual, weight, bias = _input(M, N, rd, pad), _param(N, wd), _param(N, bd)
    out, rstd = _nan((M, N), od), _nan((M,), acc)
    residual_out = _nan((M, N), hd) if store_h else None
    mean = None if rms else _nan((M,), acc)
    cpu.norm_fwd(
        x, residual, weight, bias, out, residual_out, mean, rstd,
        eps=eps, weight_offset=offset, rms=rms, h_dtype=hd,
    )  # fmt: skip
    h = _h_ref(x, residual, hd, rms)
    if residual_out is not None:
        assert torch.equal(residual_out, h), "residual_out differs from the reference's h"
    out64, mean64, rstd64 = _fwd64(h, weight, bias, eps=eps, weight_offset=offset, rms=rms)
    # Each row's statistics sum N terms in the accumulator (float32 for 16-bit and float32 rows
    # of one chunk since layernorm 0.11.1): their rounding reaches the outputs (1.4% of random
    # float32 LayerNorm rows of 384 failed the bare float32 tolerance, ~2e-6 off).
    assert_close(out, out64, dtype=od, terms=N, msg="out")
    assert_close(rstd, rstd64, dtype=acc, terms=N, msg="rstd")
    if mean is not None:
        assert_close(mean, mean64, dtype=acc, terms=N, term_scale=4.0, msg="mean")


BWD_CASES = [
    # id, (M, N), rms, dy, h, dh, dh_out, weight, dweight, dbias, weight_offset, pad
    ("rms-f32", (7, 127), True, F32, F32, F32, None, F32, True, False, 0.0, 0),
    ("ln-f32-dh_out", (7, 127), False, F32, F32, F32, F32, F32, True, True, 0.0, 0),
    ("ln-bf16-strided", (33, 4097), False, BF16, BF16, BF16, BF16, BF16, True, True, 0.0, 5),
    ("rms-dy-f32-h-bf16-offset1", (9, 300), True, F32, BF16, F32, BF16, BF16, True, False, 1.0, 2),
    ("ln-f16", (3, 4097), False, F16, F16, F16, F16, F16, True, True, 0.0, 0),
    ("ln-no-weight-dbias-only", (6, 515), False, F32, BF16, BF16, None, None, False, True, 0.0, 0),
    ("rms-no-weight-no-sums", (6, 515), True, BF16, BF16, F16, F32, None, False, False, 0.0, 1),
    ("ln-dh-f16-from-bf16", (4, 96), False, BF16, F32, F16, F16, F32, True, True, 0.0, 0),
    ("ln-1x1", (1, 1), False, F32, F32, F32, None, F32, True, True, 0.0, 0),
    # N == 1: RMSNorm's dh = rstd g (1 - xhat^2) is all cancellation (ill-conditioned in float32), so the
    # one-column case runs LayerNorm, whose dh is exactly dh_out.
    ("ln-33x1", (33, 1), False, BF16, BF16, F32, BF16, F32, True, True, 0.0, 0),
    ("ln-f64", (5, 67), False, F64, F64, F64, F64, F64, True, True, 0.0, 3),
    ("rms-f64", (5, 67), True, F64, F64, F64, None, F64, True, False, 1.0, 0),
    ("ln-long-row", (2, 262144), False, BF16, BF16, BF16, None, BF16, True, True, 0.0, 0),
    ("rms-many-rows", (515, 64), True, F32, BF16, BF16, None, F32, True, False, 0.0, 0),
    ("ln-empty", (0, 64), False, BF16, BF16, BF16, BF16, BF16, True, True, 0.0, 0),
]


@pytest.mark.parametrize(
    ("shape", "rms", "dyd", "hd", "dhd", "dod", "wd", "want_dw", "want_db", "offset", "pad"),
    [pytest.param(*c[1:], id=c[0]) for c in BWD_CASES],
)
def test_backward(shape, rms, dyd, hd, dhd, dod, wd, want_dw, want_db, offset, pad):
    M, N = shape
    acc = reference.stats_dtype(hd)
    h = _input(M, N, hd, pad)
    dy = _input(M, N, dyd, pad)
    dh_out, weight = _input(M, N, dod, pad), _param(N, wd)
    _, mean64, rstd64 = _fwd64(h, None, None, eps=1e-5, weight_offset=0.0, rms=rms)
    mean = None if mean64 is None else mean64.to(acc)  # what a forward saves
    rstd = rstd64.to(acc)
    dh = _nan((M, N), dhd)
    dweight = _nan((N,), acc) if want_dw else None
    dbias = _nan((N,), acc) if want_db else None
    cpu.norm_bwd(dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias, weight_offset=offset, rms=rms)

    dh64, dw64, db64 = _nan((M, N), F64), _nan((N,), F64), _nan((N,), F64)
    reference.norm_bwd(
        dy.to(F64), h.to(F64), _f64(weight), _f64(mean), rstd.to(F64), _f64(dh_out), dh64, dw64, db64,
        weight_offset=offset, rms=rms,
    )  # fmt: skip
    assert_close(dh, dh64, dtype=dhd, msg="dh")
    if dweight is not None:
        assert_close(dweight, dw64, dtype=acc, scale=_sum_scale(M), msg="dweight")
    if dbias is not None:
        assert_close(dbias, db64, dtype=acc, scale=_sum_scale(M), msg="dbias")


def test_layer_norm_statistics_large_mean():
    """Rows far from zero (mean 1000, std 1e-3): the variance comes from centered sums, so rstd keeps
    float32 accuracy (E[h^2] - E[h]^2 would lose every digit). y itself is not checked: the float32
    mean is off by up to half an ulp of 1000, which the contract's y = (h - mean) * rstd inherits."""
    M, N = 4, 5000
    x = (torch.randn(M, N, dtype=F64) * 1e-3 + 1000).to(F32)
    mean, rstd = _nan((M,), F32), _nan((M,), F32)
    cpu.norm_fwd(x, None, None, None, _nan((M, N), F32), None, mean, rstd,
                 eps=1e-12, weight_offset=0.0, rms=False, h_dtype=F32)  # fmt: skip
    _, mean64, rstd64 = _fwd64(x, None, None, eps=1e-12, weight_offset=0.0, rms=False)
    assert_close(mean, mean64, dtype=F32)
    assert_close(rstd, rstd64, dtype=F32)


@pytest.mark.parametrize("dtype", [F32, F64], ids=str)
def test_short_rows_in_pairs_match_rows_alone(dtype):
    """Short LayerNorm rows of x read in place run two at a time: each row's outputs (y, mean, rstd)
    are bitwise the same whichever row it is paired with, or alone (an odd count's last row): x and
    x[1:] pair every row differently. A row far from its first value takes the second pass."""
    M, N = 9, 384
    x = random_tensor((M, N), dtype)
    x[4] += 1e4 * torch.linspace(0, 1, N, dtype=dtype)  # first value far from the mean
    weight, bias = random_tensor((N,), dtype), random_tensor((N,), dtype)
    outs = []
    for rows in (x, x[1:], x[3:4]):
        m = rows.shape[0]
        out, mean, rstd = _nan((m, N), dtype), _nan((m,), dtype), _nan((m,), dtype)
        cpu.norm_fwd(rows, None, weight, bias, out, None, mean, rstd,
                     eps=1e-5, weight_offset=0.0, rms=False, h_dtype=dtype)  # fmt: skip
        outs.append((out, mean, rstd))
    for whole, shifted, alone in zip(*outs):
        assert not whole.isnan().any()
        assert torch.equal(whole[1:], shifted)
        assert torch.equal(whole[3:4], alone)
    _, mean64, rstd64 = _fwd64(x, weight, bias, eps=1e-5, weight_offset=0.0, rms=False)
    assert_close(outs[0][1], mean64, dtype=dtype)
    assert_close(outs[0][2], rstd64, dtype=dtype)


def test_backward_deterministic():
    """dweight / dbias: per-thread partials over a static row partition, added in a fixed order."""
    M, N = 1031, 700
    h, dy = random_tensor((M, N), BF16), random_tensor((M, N), F32)
    weight, mean, rstd = random_tensor((N,)), random_tensor((M,)), torch.rand(M) + 0.5
    results = []
    for _ in range(2):
        dh, dw, db = _nan((M, N), BF16), _nan((N,), F32), _nan((N,), F32)
        cpu.norm_bwd(dy, h, weight, mean, rstd, None, dh, dw, db, weight_offset=0.0, rms=False)
        results.append((dh, dw, db))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_streaming_stores_match(dtype):
    """Outputs of 32 MB or more (kStreamFrom) take streaming stores on whole 64-byte lines; rows of an odd
    width start at every alignment. The same rows computed in smaller calls (ordinary stores) must match
    bit for bit; a few rows are also checked against the reference."""
    N = 4099
    M = (32 << 20) // (N * dtype.itemsize) + 1
    x, residual = random_tensor((M, N), dtype), random_tensor((M, N), dtype)
    weight = random_tensor((N,), dtype)

    def fwd(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        m = x[rows].shape[0]
        out, ro = _nan((m, N), dtype), _nan((m, N), dtype)
        cpu.norm_fwd(
            x[rows], residual[rows], weight, None, out, ro, None, _nan((m,), F32),
            eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype,
        )  # fmt: skip
        return out, ro

    def bwd(rows: slice) -> torch.Tensor:
        m = x[rows].shape[0]
        dh = _nan((m, N), dtype)
        dy, h = residual[rows], x[rows]
        cpu.norm_bwd(dy, h, weight, None, rstd[rows], None, dh, None, None, weight_offset=0.0, rms=True)
        return dh

    rstd = torch.rand(M) + 0.5
    out, ro = fwd(slice(None))
    dh = bwd(slice(None))
    step = M // 4 + 1
    parts = [(fwd(slice(i, i + step)), bwd(slice(i, i + step))) for i in range(0, M, step)]
    assert torch.equal(out, torch.cat([p[0][0] for p in parts]))
    assert torch.equal(ro, torch.cat([p[0][1] for p in parts]))
    assert torch.equal(dh, torch.cat([p[1] for p in parts]))
    some = slice(None, None, 257)
    out64, _, _ = _fwd64(ro[some], weight, None, eps=1e-6, weight_offset=0.0, rms=True)
    assert_close(out[some], out64, dtype=dtype)


def test_empty_rows_zero_sums():
    """M == 0: dweight / dbias are sums over no rows, zeros, as the reference."""
    dw, db = _nan((5,), F32), _nan((5,), F32)
    empty = torch.empty(0, 5)
    cpu.norm_bwd(empty, empty, None, torch.empty(0), torch.empty(0), None, torch.empty(0, 5), dw, db,
                 weight_offset=0.0, rms=False)  # fmt: skip
    assert torch.equal(dw, torch.zeros(5)) and torch.equal(db, torch.zeros(5))


def test_supports():
    for dtype in (F32, BF16, F16, F64):
        assert cpu.supports(DispatchKey("cpu", "x86_64", dtype)) is None
    assert isinstance(cpu.supports(DispatchKey("cpu", "x86_64", torch.int32)), str)


def _fwd_args(**change):
    M, N = 4, 8
    args = dict(
        x=torch.randn(M, N), residual=None, weight=None, bias=None, out=torch.empty(M, N),
        residual_out=None, mean=torch.empty(M), rstd=torch.empty(M),
    )  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param({"x": torch.randn(8, 4).t()}, ValueError, id="column-stride"),
        pytest.param({"residual": torch.randn(4, 9)}, ValueError, id="residual-shape"),
        pytest.param({"residual": torch.randn(4, 8, dtype=F64)}, TypeError, id="f64-residual-f32-x"),
        pytest.param({"out": torch.empty(8, 4).t()}, ValueError, id="out-not-contiguous"),
        pytest.param({"rstd": torch.empty(4, dtype=BF16)}, TypeError, id="rstd-dtype"),
        pytest.param({"weight": torch.randn(7)}, ValueError, id="weight-shape"),
        pytest.param({"x": torch.ones(4, 8, dtype=torch.int32)}, TypeError, id="int-x"),
    ],
)
def test_forward_rejects(change, error):
    with pytest.raises(error):
        cpu.norm_fwd(**_fwd_args(**change), eps=1e-5, weight_offset=0.0, rms=False, h_dtype=F32)


def test_backward_rejects():
    M, N = 4, 8
    h = torch.randn(M, N)
    with pytest.raises(ValueError):  # LayerNorm needs the mean
        cpu.norm_bwd(h, h, None, None, torch.ones(M), None, torch.empty(M, N), None, None,
                     weight_offset=0.0, rms=False)  # fmt: skip
    with pytest.raises(ValueError):  # dh must be contiguous
        cpu.norm_bwd(h, h, None, None, torch.ones(M), None, torch.empty(N, M).t(), None, None,
                     weight_offset=0.0, rms=True)  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_fresh_output_huge_pages(dtype):
    """A large output whose pages were never touched gets MADV_HUGEPAGE on its 2 MiB aligned interior
    (prepare_output). The output is a view that starts at an odd offset inside a larger fresh buffer
    whose ends alone were written: the results match a call on a touched output, and the bytes around
    the view are left as they were."""
    M, N = 3, (12 << 20) // 3 // dtype.itemsize + 7  # about 12 MB, rows of an odd width
    x, residual = random_tensor((M, N), dtype), random_tensor((M, N), dtype)
    weight = random_tensor((N,), dtype)
    pad = 4099  # elements before and after the view
    buf = torch.empty(M * N + 2 * pad, dtype=dtype)  # fresh pages (glibc mmaps an allocation this large)
    buf[: 2 * pad] = 7.0
    buf[-2 * pad :] = 7.0
    outs = []
    for fresh in (True, False):
        out = buf[pad : pad + M * N].view(M, N) if fresh else _nan((M, N), dtype)
        ro, rstd = _nan((M, N), dtype), _nan((M,), F32)
        cpu.norm_fwd(
            x, residual, weight, None, out, ro, None, rstd, eps=1e-6, weight_offset=0.0, rms=True, h_dtype=dtype
        )  # fmt: skip
        dh = torch.empty((M, N), dtype=dtype) if fresh else _nan((M, N), dtype)
        cpu.norm_bwd(residual, ro, weight, None, rstd, None, dh, None, None, weight_offset=0.0, rms=True)
        outs.append((out.clone(), ro, rstd, dh))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert bool((buf[:pad] == 7.0).all()) and bool((buf[-pad:] == 7.0).all())
