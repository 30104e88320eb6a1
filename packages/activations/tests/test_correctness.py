"""Every implementation against the float64 reference: forward, backward, odd shapes,
non-contiguous views, NaN and large values, all kernel dtypes."""

from __future__ import annotations

import pytest
import torch

from openkernels.shared import dispatch
from openkernels.shared.dev.testing import assert_close, noncontiguous_views, poisoned_empty, random_tensor

from .cases import KERNEL_DTYPES, VARIANTS, Variant, shapes, targets, variant_params

pytestmark = pytest.mark.parametrize(("device", "impl"), targets())


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("variant", variant_params())
def test_forward(device: str, impl: str, variant: Variant, dtype: torch.dtype) -> None:
    for shape in shapes(variant.gated):
        x = random_tensor(shape, dtype, device, scale=2.0)
        with dispatch.force(impl), poisoned_empty():
            out = variant(x)
        assert out.dtype == dtype and out.device == x.device
        assert_close(out, variant.ref(x.to(torch.float64)), dtype=dtype, msg=f"{variant.id} {shape}")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("variant", variant_params())
def test_backward(device: str, impl: str, variant: Variant, dtype: torch.dtype) -> None:
    for shape in shapes(variant.gated):
        x = random_tensor(shape, dtype, device, scale=2.0, requires_grad=True)
        with dispatch.force(impl), poisoned_empty():
            out = variant(x)
            grad_out = random_tensor(tuple(out.shape), dtype, device)
            (grad,) = torch.autograd.grad(out, x, grad_out)
        assert grad.dtype == dtype and grad.shape == x.shape
        assert_close(grad, variant.grad_ref(x, grad_out), dtype=dtype, msg=f"{variant.id} {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", variant_params())
def test_noncontiguous_views(device: str, impl: str, variant: Variant, dtype: torch.dtype) -> None:
    shape = (6, 2 * 9) if variant.gated else (6, 9)
    for layout, x in noncontiguous_views(shape, dtype, device):
        x = x.requires_grad_()
        with dispatch.force(impl), poisoned_empty():
            out = variant(x)
            grad_out = (
                random_tensor(tuple(out.shape), dtype, device).transpose(0, 1).contiguous().transpose(0, 1)
            )
            (grad,) = torch.autograd.grad(out, x, grad_out)
        assert_close(out, variant.ref(x.detach().to(torch.float64)), dtype=dtype, msg=f"{layout} fwd")
        assert_close(grad, variant.grad_ref(x, grad_out), dtype=dtype, msg=f"{layout} bwd")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("variant", variant_params())
def test_nan_and_large_values(device: str, impl: str, variant: Variant, dtype: torch.dtype) -> None:
    # Large enough to saturate every sigmoid/erf and overflow a naive exp, small enough
    # that relu^2 stays finite in the dtype (fp16 max 65504).
    big = 100.0 if dtype == torch.float16 else 1e4
    values = [float("nan"), -big, big, -30.0, 30.0, -0.0, 0.0, 1e-30]
    x = torch.tensor(values * 2, dtype=torch.float32).to(dtype).reshape(2, -1).to(device).requires_grad_()
    with dispatch.force(impl):
        out = variant(x)
        grad_out = torch.ones_like(out)
        (grad,) = torch.autograd.grad(out, x, grad_out)
    ref = variant.ref(x.detach().to(torch.float64)).to(dtype)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"NaN pattern {out} vs {ref}"
    assert_close(out, ref.to(torch.float64), dtype=dtype)
    grad_ref = variant.grad_ref(x, grad_out).to(dtype)
    assert torch.equal(torch.isnan(grad), torch.isnan(grad_ref)), f"NaN pattern {grad} vs {grad_ref}"
    assert_close(grad, grad_ref.to(torch.float64), dtype=dtype)


@pytest.mark.parametrize("variant", variant_params())
def test_empty(device: str, impl: str, variant: Variant) -> None:
    for shape in [(0, 8), (3, 0), (0, 0, 4)]:
        x = torch.empty(shape, device=device, requires_grad=True)
        with dispatch.force(impl):
            out = variant(x)
            (grad,) = torch.autograd.grad(out.sum(), x)
        expected = (*shape[:-1], shape[-1] // 2) if variant.gated else shape
        assert tuple(out.shape) == expected and grad.shape == x.shape


@pytest.mark.parametrize("variant", variant_params())
def test_out_argument(device: str, impl: str, variant: Variant) -> None:
    x = random_tensor((5, 2 * 33) if variant.gated else (5, 33), torch.bfloat16, device)
    out = torch.full((5, 33), float("nan"), dtype=torch.bfloat16, device=device)
    with dispatch.force(impl):
        result = variant(x, out=out)
    assert result is out
    assert_close(out, variant.ref(x.to(torch.float64)), dtype=torch.bfloat16)


@pytest.mark.parametrize("variant", [v for v in variant_params() if not v.values[0].gated])
def test_out_in_place(device: str, impl: str, variant: Variant) -> None:
    # out=x: every element read before it is written (kernelize runs BERT's intermediate
    # activation this way on the dense layer's fresh output).
    x = random_tensor((7, 1000), torch.bfloat16, device, scale=2.0)
    want = variant.ref(x.to(torch.float64))
    with dispatch.force(impl):
        result = variant(x, out=x)
    assert result is x
    assert_close(x, want, dtype=torch.bfloat16)


def test_float64_runs_on_reference(device: str, impl: str) -> None:
    # float64 is the reference's alone: forcing a kernel on it says why it cannot.
    x = random_tensor((4, 10), torch.float64, device)
    if impl == "reference":
        with dispatch.force(impl):
            assert_close(VARIANTS[5](x), VARIANTS[5].ref(x), dtype=torch.float64)
    else:
        with dispatch.force(impl), pytest.raises(dispatch.UnsupportedError, match="reference"):
            VARIANTS[5](x)
