"""Forward+backward calls of the activations replay (shared.replay's C++ graph node): outputs
and gradients equal the Python path's bit for bit."""

from __future__ import annotations

import pytest
import torch

import openkernels.activations as A
from openkernels.shared.dev.testing.replayed import check_replayed_backward

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
CASES = {
    "silu": (A.silu, {}),
    "gelu": (A.gelu, {}),
    "gelu tanh": (A.gelu, {"approximate": "tanh"}),
    "gelu_quick": (A.gelu_quick, {}),
    "relu_squared": (A.relu_squared, {}),
    "silu_and_mul": (A.silu_and_mul, {}),
    "gelu_and_mul": (A.gelu_and_mul, {}),
    "mul_and_silu": (A.mul_and_silu, {}),
    "glu": (A.glu, {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_replays_as_the_python_path(case: str, dtype: torch.dtype, device: str) -> None:
    fn, kwargs = CASES[case]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    check_replayed_backward(fn, (x.requires_grad_(),), kwargs)
