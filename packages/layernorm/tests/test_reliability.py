"""Reliability (issue 20, item 11): a NaN or inf weight_offset (or eps) gave all-NaN (or
all-zero) output without a word; the PyTorch and JAX front ends now both reject it."""

from __future__ import annotations

import math

import pytest
import torch

import openkernels.layernorm as L

NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("offset", NON_FINITE)
def test_non_finite_weight_offset_is_rejected(offset: float) -> None:
    x, w = torch.randn(4, 8), torch.ones(8)
    for call in (
        lambda: L.rms_norm(x, w, weight_offset=offset),
        lambda: L.rms_norm(x, w, residual=x, prenorm=True, weight_offset=offset),
    ):
        with pytest.raises(ValueError, match="rms_norm: weight_offset must be finite"):
            call()
    for module in (L.RMSNorm, L.AddRMSNorm):
        with pytest.raises(ValueError, match=f"{module.__name__}: weight_offset must be finite"):
            module(8, weight_offset=offset)


@pytest.mark.parametrize("fn", [L.rms_norm, L.layer_norm])
def test_non_finite_eps_is_rejected(fn) -> None:
    x = torch.randn(4, 8)
    for eps in NON_FINITE:
        with pytest.raises(ValueError, match="eps must be a non-negative float, not NaN or inf"):
            fn(x, torch.ones(8), eps=eps)


def test_finite_weight_offsets_still_run() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    for offset in (0.0, 1.0, -1e30, 1e30):
        y = L.rms_norm(x, w, weight_offset=offset)
        assert y.shape == x.shape and not y.isnan().any()


def test_jax_front_end_agrees() -> None:
    jax = pytest.importorskip("jax")
    import openkernels.layernorm.jax as LJ

    x, w = jax.numpy.ones((4, 8)), jax.numpy.ones((8,))
    for value in NON_FINITE:
        with pytest.raises(ValueError, match="rms_norm: weight_offset must be finite"):
            LJ.rms_norm(x, w, weight_offset=value)
        for fn in (LJ.rms_norm, LJ.layer_norm):
            with pytest.raises(ValueError, match="eps must be a non-negative float, not NaN or inf"):
                fn(x, w, eps=value)
