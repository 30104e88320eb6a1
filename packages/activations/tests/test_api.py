"""Public API: argument errors, modules, torch.compile, opcheck, dispatch, large offsets."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import openkernels.activations as A
from openkernels.activations import reference as R
from openkernels.activations.spec import SPECS
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import assert_close, failing_implementation, random_tensor, run_opcheck

from .cases import VARIANTS, Variant, variant_params

GATED = [v for v in VARIANTS if v.gated]


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.id) for v in GATED])
def test_gated_odd_last_dim_is_rejected(variant: Variant) -> None:
    with pytest.raises(ValueError, match="even last dim"):
        variant(torch.randn(4, 7))
    with pytest.raises(ValueError, match="even last dim"):
        variant(torch.tensor(1.0))


@pytest.mark.parametrize("variant", variant_params())
def test_integer_dtype_is_rejected(variant: Variant) -> None:
    with pytest.raises(TypeError, match=r"dtype torch\.int32; supported"):
        variant(torch.ones(4, 8, dtype=torch.int32))


@pytest.mark.parametrize("variant", variant_params())
def test_mismatched_out_is_rejected(variant: Variant) -> None:
    x = torch.randn(4, 8)
    good = (4, 4) if variant.gated else (4, 8)
    with pytest.raises(ValueError, match="out must have shape"):
        variant(x, out=torch.empty(4, 3))
    with pytest.raises(ValueError, match="out must have shape"):
        variant(x, out=torch.empty(good, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        variant(x, out=torch.empty(good[::-1]).t())
    with pytest.raises(ValueError, match="is on meta"):
        variant(x, out=torch.empty(good, device="meta"))
    with pytest.raises(RuntimeError, match="autograd"):
        variant(x.requires_grad_(), out=torch.empty(good))


def test_out_overlapping_input_is_rejected() -> None:
    # out=x itself is in place (test_correctness); any other overlap is refused.
    buf = torch.randn(9)
    with pytest.raises(ValueError, match="share memory"):
        A.silu(buf[1:], out=buf[:-1])
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="share memory"):
        A.silu_and_mul(x, out=x.view(-1)[:16].view(4, 4))  # the first rows' memory


def test_bad_approximate_is_rejected() -> None:
    with pytest.raises(ValueError, match="approximate"):
        A.gelu(torch.randn(3), "fast")
    with pytest.raises(ValueError, match="approximate"):
        A.GeluAndMul("erf")


def test_not_a_tensor_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        A.silu([1.0, 2.0])


def test_modules_match_functions() -> None:
    x = random_tensor((3, 16))
    pairs = [
        (A.Silu(), A.silu(x)),
        (A.Gelu("tanh"), A.gelu(x, "tanh")),
        (A.GeluQuick(), A.gelu_quick(x)),
        (A.ReluSquared(), A.relu_squared(x)),
        (A.SiluAndMul(), A.silu_and_mul(x)),
        (A.GeluAndMul(), A.gelu_and_mul(x)),
        (A.MulAndSilu(), A.mul_and_silu(x)),
        (A.Glu(), A.glu(x)),
    ]
    for module, expected in pairs:
        assert torch.equal(module(x), expected), module
    assert "tanh" in repr(A.Gelu("tanh"))


def test_every_op_has_a_function_a_module_and_a_reference() -> None:
    modules = {
        cls.__name__ for cls in vars(A).values() if isinstance(cls, type) and issubclass(cls, torch.nn.Module)
    }
    for name in SPECS:
        assert name in A.__all__ and callable(getattr(A, name)) and getattr(A, name).__doc__
        assert callable(getattr(R, f"{name}_ref")) and f"{name}_ref" in R.__all__
    assert len(modules) == len(SPECS) and set(modules) <= set(A.__all__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_glu_is_torch_glu(dtype: torch.dtype) -> None:
    x = random_tensor((5, 3, 2 * 37), dtype, scale=4.0)
    assert_close(A.glu(x), F.glu(x.double(), dim=-1), dtype=dtype)
    assert torch.equal(A.Glu()(x), A.glu(x))
    xg = x.double().requires_grad_()
    grad_out = random_tensor((5, 3, 37), torch.float64)
    (expected,) = torch.autograd.grad(F.glu(xg, dim=-1), xg, grad_out)
    x = x.requires_grad_()
    (grad,) = torch.autograd.grad(A.glu(x), x, grad_out.to(dtype))
    assert_close(grad, expected, dtype=dtype)


def test_library_path_matches_fast_path() -> None:
    # Eager no-grad calls skip torch.library; both paths must be bit-identical.
    x = random_tensor((8, 64), torch.bfloat16)
    for v in VARIANTS:
        assert torch.equal(v(x), v.library_op(x, *v.args())), v.id


def test_meta_tensors_use_the_fake() -> None:
    x = torch.empty(2, 5, 12, device="meta")
    assert A.silu_and_mul(x).shape == (2, 5, 6)
    assert A.gelu(x, "tanh").shape == (2, 5, 12)


def test_double_backward_says_unsupported() -> None:
    x = random_tensor((4, 8), requires_grad=True)
    (g,) = torch.autograd.grad(A.silu(x).sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        g.sum().backward()


@pytest.mark.parametrize("variant", variant_params())
def test_torch_compile_fullgraph(variant: Variant) -> None:
    torch._dynamo.reset()
    x = random_tensor((6, 20), requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return variant(t * 2.0) + 1.0

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    (grad_eager,) = torch.autograd.grad(fn(x).sum(), x)
    assert torch.equal(out, fn(x))
    assert torch.equal(grad, grad_eager)


def test_torch_compile_inductor() -> None:
    torch._dynamo.reset()
    x = random_tensor((6, 20))
    compiled = torch.compile(lambda t: A.silu_and_mul(t) * 3.0, fullgraph=True)
    assert_close(compiled(x), R.silu_and_mul_ref(x.double()) * 3.0, dtype=torch.float32)


@pytest.mark.parametrize("variant", variant_params())
def test_opcheck(variant: Variant) -> None:
    x = random_tensor((4, 10), requires_grad=True)
    extra = variant.args()
    run_opcheck(variant.library_op, (x, *extra))
    out = torch.empty((4, 5) if variant.gated else (4, 10))
    out_op = getattr(torch.ops.openkernels, f"{variant.op}_out").default
    run_opcheck(out_op, (x.detach(), *extra), {"out": out})
    bwd_op = getattr(torch.ops.openkernels, f"{variant.op}_backward").default
    run_opcheck(bwd_op, (random_tensor(tuple(out.shape)), x.detach(), *extra))


def test_explain_names_the_choice() -> None:
    from openkernels.shared.layout import as_rows

    x = random_tensor((4, 8))
    text = dispatch.explain("silu_and_mul", as_rows(x), torch.empty(4, 4), 0)
    assert "runs" in text and "reference" in text and "triton" in text


def test_failing_kernel_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    x = random_tensor((4, 8))
    with failing_implementation("gelu_quick", "cpu", RuntimeError("simulated compile failure")):
        with pytest.warns(dispatch.KernelFallbackWarning, match="simulated compile failure"):
            first = A.gelu_quick(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = A.gelu_quick(x)
        assert "failed earlier" in dispatch.explain("gelu_quick", x, torch.empty_like(x), 3)
    assert_close(first, R.gelu_quick_ref(x.double()), dtype=torch.float32)
    assert torch.equal(first, second)


def test_failing_kernel_raises_in_strict_mode() -> None:
    x = random_tensor((4, 8))
    with failing_implementation("gelu_quick", "cpu", RuntimeError("simulated")), pytest.raises(RuntimeError):
        A.gelu_quick(x)


@pytest.mark.slow
def test_offsets_past_int32(devices: list[str]) -> None:
    """Rows whose element offsets pass 2^31 must be computed, not wrapped around."""
    for device in devices:
        if device == "cpu" and _free_gib() < 14:
            pytest.skip("needs ~14 GiB of free memory")
        d = 4096
        rows = (2**31) // (2 * d) + 3
        x = torch.empty((rows, 2 * d), dtype=torch.bfloat16, device=device)
        tail = random_tensor((5, 2 * d), torch.bfloat16, device)
        x[-5:] = tail
        out = A.silu_and_mul(x)
        assert_close(out[-5:], R.silu_and_mul_ref(tail.double()), dtype=torch.bfloat16)
        del x, out


def _free_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        return info.get("MemAvailable", 0) / 2**20
    except OSError:
        return 0.0


def test_self_checks_pass_on_this_machine() -> None:
    from openkernels.activations.bench import checks

    results = checks("cpu", torch.float32)
    assert results and all(c.ok for c in results), [c for c in results if not c.ok]
    assert {c.implementation for c in results} >= {"reference"}
