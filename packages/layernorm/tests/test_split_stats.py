"""The split forward's one-pass LayerNorm chunk statistics (kernels._chunk_stats_one_pass, the
split kernel's ONE_PASS), mirrored in torch: shifted sums about each chunk's first entry, the
second pass about the first pass's mean when the shift lies more than 4 standard deviations
from it, then the kernel's Chan merge of the chunks. Run in float32 (the kernel's arithmetic,
summed in torch's order rather than the GPU's tree) and in float64, on rows chosen to make
the shift cancel, against the float64 two-pass statistics of the same numbers. The kernel
itself runs in test_correctness.py (the interpreter: one chunk per row; GPUs: three)."""

from __future__ import annotations

import pytest
import torch

from openkernels.shared.dev.testing import assert_close

from .cases import rows_far_from_their_shift

CHUNK = 8192  # the split forward's chunk (configs.SPLIT_COLS)
EPS = 1e-5


def _chunk_stats(h: torch.Tensor, guard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, M2) of each row of h (rows, count) in h's dtype, as _chunk_stats_one_pass."""
    count = h.shape[-1]
    shift = h[:, :1]
    d = h - shift
    s1, s2 = d.sum(-1), (d * d).sum(-1)
    delta = s1 / count
    mean, m2 = shift[:, 0] + delta, s2 - s1 * delta
    if guard:
        far = delta * delta * count > 16.0 * m2
        d = h - mean[:, None]
        t1, t2 = d.sum(-1), (d * d).sum(-1)
        delta = t1 / count
        mean = torch.where(far, mean + delta, mean)
        m2 = torch.where(far, t2 - t1 * delta, m2)
    return mean, torch.where(torch.isnan(m2), m2, m2.clamp(min=0.0))


def _split_stats(h: torch.Tensor, guard: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) of each row of h (rows, n): per-chunk one-pass statistics merged as the
    split kernel merges them (Chan et al.), in h's dtype."""
    n = h.shape[-1]
    parts = [_chunk_stats(c, guard) for c in h.split(CHUNK, dim=-1)]
    means = torch.stack([p[0] for p in parts], -1)
    m2s = torch.stack([p[1] for p in parts], -1)
    counts = torch.tensor([c.shape[-1] for c in h.split(CHUNK, dim=-1)], dtype=h.dtype)
    mean = (counts * means).sum(-1) / n
    spread = means - mean[:, None]
    var = (m2s + counts * spread * spread).sum(-1) / n
    return mean, torch.rsqrt(var.clamp(min=0.0) + EPS)


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """cases.rows_far_from_their_shift over 2.5 chunks, rounded to dtype, as float32 (the
    kernel's h; in bfloat16, whose ulp at 1000 is 4, the large-mean rows round to nearly
    constant ones)."""
    rows = rows_far_from_their_shift(2 * CHUNK + CHUNK // 2, CHUNK, torch.Generator().manual_seed(25))
    return rows.to(dtype).to(torch.float32)


def _want(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 two-pass (mean, rstd) of h's numbers."""
    h64 = h.double()
    mean = h64.mean(-1)
    return mean, torch.rsqrt((h64 - mean[:, None]).square().mean(-1) + EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_pass_statistics_against_float64(dtype: torch.dtype) -> None:
    h = _rows(dtype)
    n = h.shape[-1]
    want_mean, want_rstd = _want(h)
    # The formula itself, in float64: the float64 two-pass to float64 rounding.
    mean64, rstd64 = _split_stats(h.double())
    assert_close(mean64, want_mean, dtype=torch.float64, terms=n, msg="float64 mean")
    assert_close(rstd64, want_rstd, dtype=torch.float64, terms=n, msg="float64 rstd")
    # In float32, with the tolerances the kernel's statistics get (test_every_kernel_path,
    # test_split_forward_rows_far_from_their_shift): rstd float32's for n summed terms, the
    # mean's n terms bounded by max|h|.
    # (Row 0's rstd is off by ~8e-6 in float32, one-pass or not: the merge's chunk means are
    # rounded to ulps of 1000, and count * spread^2 picks up count * (3e-5)^2 against M2 of
    # count * 1e-4.)
    mean, rstd = _split_stats(h)
    for row in range(h.shape[0]):
        row_scale = float(h[row].abs().max())
        assert_close(mean[row], want_mean[row], dtype=torch.float32, terms=n, term_scale=row_scale,
                     msg=f"row {row} mean")  # fmt: skip
        assert_close(rstd[row], want_rstd[row], dtype=torch.float32, terms=n, msg=f"row {row} rstd")


def test_without_the_second_pass_an_outlier_shift_loses_the_variance() -> None:
    """The rows above bite: without the second pass, an outlier at each chunk's start (row 1)
    leaves M2 to the cancellation of count * (mean - K)^2 ~ count^2 * var against itself."""
    h = _rows(torch.float32)
    _, want_rstd = _want(h)
    _, rstd = _split_stats(h, guard=False)
    rel = ((rstd.double() - want_rstd) / want_rstd).abs()
    assert float(rel[1]) > 1e-4, f"row 1 kept its variance without the second pass ({float(rel[1]):.2g})"
    # A large mean with a small spread takes no second pass (d = h - K is exact: Sterbenz).
    assert torch.equal(rstd[0], _split_stats(h)[1][0])


def test_nan_and_inf_propagate() -> None:
    """A NaN anywhere, or an inf off the shift or as the shift, leaves the chunk's M2 NaN
    (the second pass's test is false on NaN; the clamp keeps it), so the row's rstd is NaN."""
    h = torch.randn(4, 100)
    h[0, 17] = float("nan")
    h[1, 0] = float("nan")
    h[2, 17] = float("inf")
    h[3, 0] = float("-inf")
    _, m2 = _chunk_stats(h, guard=True)
    assert torch.isnan(m2).all(), m2
    _, rstd = _split_stats(h)
    assert torch.isnan(rstd).all(), rstd
