"""Forward+backward calls of attention replay (shared.replay's C++ graph node): outputs and
gradients equal the Python path's bit for bit."""

from __future__ import annotations

import pytest
import torch

import openkernels.attention as K
from openkernels.shared.testing.replayed import check_replayed_backward

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
CASES = {
    "full": {},
    "causal": {"causal": True},
    "window softcap": {"window": (8, 0), "softcap": 20.0},
    "lse": {"causal": True, "return_lse": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_replays_as_the_python_path(case: str, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(3)

    def make(s: int, h: int) -> torch.Tensor:
        return torch.randn(2, s, h, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()

    kwargs = CASES[case]
    grads = None
    if kwargs.get("return_lse"):  # the log-sum-exp gets no gradient

        def grads(outs: tuple) -> list:
            return [torch.ones_like(outs[0]), None]

    check_replayed_backward(K.attention, (make(17, 4), make(23, 2), make(23, 2)), kwargs, grads)
