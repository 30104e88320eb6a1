"""CPU kernels on outputs large enough for streaming stores (kStreamFrom in cpu/activations.cpp).

Streaming stores write whole 64-byte lines; the partial lines at the ends of each row take ordinary
stores. Unary rows of an odd width start at every alignment; the gated forward writes into an `out`
one element off a line. Every element must match, bit for bit, the same rows computed in calls under
the threshold (ordinary stores only); every 7th row is also checked against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

from openkernels.shared import dispatch
from openkernels.shared.dev.testing import assert_close, poisoned_empty, random_tensor

from .cases import Variant

STREAM_FROM = 32 << 20  # bytes of output, as kStreamFrom
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


def _rows_over_threshold(d: int, dtype: torch.dtype) -> int:
    return STREAM_FROM // (d * dtype.itemsize) + 1


def _check(variant: Variant, run, x: torch.Tensor, grad_out: torch.Tensor, dtype: torch.dtype) -> None:
    """run(x, grad_out) -> (out, grad), once over all rows, then in quarters (under the threshold)."""
    out, grad = run(x, grad_out)
    some = slice(None, None, 7)
    assert_close(out[some], variant.ref(x[some].to(torch.float64)), dtype=dtype, msg="fwd")
    assert_close(grad[some], variant.grad_ref(x[some], grad_out[some]), dtype=dtype, msg="bwd")
    step = x.shape[0] // 4 + 1
    parts = [run(x[i : i + step], grad_out[i : i + step]) for i in range(0, x.shape[0], step)]
    assert torch.equal(out, torch.cat([p[0] for p in parts])), "fwd differs from ordinary stores"
    assert torch.equal(grad, torch.cat([p[1] for p in parts])), "bwd differs from ordinary stores"


@pytest.mark.parametrize("dtype", DTYPES)
def test_unary_large_output(dtype: torch.dtype) -> None:
    variant, d = Variant("gelu", "none"), 2053  # gelu: computed (float32) and looked up (bfloat16)
    rows = _rows_over_threshold(d, dtype)
    x = random_tensor((rows, d + 3), dtype, scale=2.0)[:, 1 : d + 1]  # row stride 2056
    grad_out = random_tensor((rows, d), dtype)

    def run(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().requires_grad_()
        with dispatch.force("cpu"), poisoned_empty():
            out = variant(x)
            (grad,) = torch.autograd.grad(out, x, grad_out)
        return out.detach(), grad

    _check(variant, run, x, grad_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_large_output(dtype: torch.dtype) -> None:
    # d a whole number of lines: both halves of grad_in share an alignment, which their streaming needs.
    variant, d = Variant("silu_and_mul"), 2048
    rows = _rows_over_threshold(d, dtype)
    x = random_tensor((rows, 2 * d + 5), dtype, scale=2.0)[:, 3 : 2 * d + 3]
    grad_out = random_tensor((rows, d), dtype)
    backward = torch.ops.openkernels.silu_and_mul_backward

    def run(x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with dispatch.force("cpu"), poisoned_empty():
            out = torch.empty(x.shape[0] * d + 1, dtype=dtype)[1:].view(x.shape[0], d)  # off a line
            variant(x, out=out)
            return out, backward(grad_out, x)

    _check(variant, run, x, grad_out, dtype)
