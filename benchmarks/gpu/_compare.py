"""The error measure of the GPU correctness sweeps (check_attention_gpu.py, check_kvcache_gpu.py).
The scripts import it by its bare name."""

from __future__ import annotations

import torch


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| / (1 + |b|) in float64, `b` the reference: nan where `a` has a nan;
    infinities of the same sign on both sides count as equal."""
    a, b = a.double(), b.double()
    if torch.isnan(a).any():
        return float("nan")
    both_inf = torch.isinf(a) & torch.isinf(b) & (a == b)
    return float(((a - b).abs() / (1 + b.abs())).masked_fill(both_inf, 0).max())
