"""layout.as_rows, platform detection and the testing helpers themselves."""

from __future__ import annotations

import pytest
import torch

from openkernels.shared.dev.testing import (
    TOLERANCES,
    assert_close,
    noncontiguous_views,
    poisoned_empty,
    random_tensor,
)
from openkernels.shared.layout import as_rows
from openkernels.shared.platform import device_info


def test_as_rows_keeps_views_when_possible() -> None:
    base = torch.randn(4, 6, 20)
    sliced = base[..., 3:13]
    rows = as_rows(sliced)
    assert rows.shape == (24, 10) and rows.data_ptr() == sliced.data_ptr() and rows.stride() == (20, 1)
    t = torch.randn(10, 4).t()
    rows = as_rows(t)
    assert rows.is_contiguous() and torch.equal(rows, t)
    assert as_rows(torch.tensor(3.0)).shape == (1, 1)
    assert as_rows(torch.empty(0, 5)).shape == (0, 5)


def test_cpu_device_info() -> None:
    info = device_info("cpu")
    assert info.backend == "cpu" and info.arch in ("avx512", "avx2", "neon", "generic")


def test_assert_close_catches_errors_and_nan() -> None:
    ref = torch.randn(100, dtype=torch.float64)
    assert_close(ref.float(), ref, dtype=torch.float32)
    with pytest.raises(AssertionError):
        assert_close((ref * (1 + 10 * TOLERANCES[torch.float32].rtol)).float(), ref, dtype=torch.float32)
    bad = ref.float().clone()
    bad[7] = float("nan")
    with pytest.raises(AssertionError, match="NaN where the reference is not"):
        assert_close(bad, ref, dtype=torch.float32)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:5].float(), ref, dtype=torch.float32)


def test_random_tensor_is_fresh_and_nonzero() -> None:
    a, b = random_tensor((64,)), random_tensor((64,))
    assert not torch.equal(a, b) and a.abs().sum() > 0


def test_noncontiguous_views_are_noncontiguous() -> None:
    views = dict(noncontiguous_views((6, 9)))
    assert set(views) == {"col-slice", "row-step", "transposed"}
    for name, view in views.items():
        assert view.shape == (6, 9) and not view.is_contiguous(), name


def test_poisoned_empty_fills_nan() -> None:
    with poisoned_empty():
        assert torch.isnan(torch.empty(16)).all()
    assert not torch.are_deterministic_algorithms_enabled()
