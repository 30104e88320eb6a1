"""Public API behaviour: argument errors, the library ops (opcheck, torch.compile), modules as
drop-ins for torch.nn on loaded state dicts, dispatch and fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import openkernels.layernorm as L
from openkernels.layernorm import reference as R
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import assert_close, failing_implementation, random_tensor, run_opcheck
from openkernels.shared.platform import triton_interpreting

pytestmark = pytest.mark.skipif(triton_interpreting(), reason="API tests run once, outside the interpreter")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


# ---- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: L.rms_norm(x, torch.ones(7)), ValueError, r"weight must have shape \(8,\)"),
        (lambda x: L.layer_norm(x, None, torch.ones(3)), ValueError, r"bias must have shape \(8,\)"),
        (lambda x: L.rms_norm(x, residual=torch.ones(4, 9)), ValueError, "residual must have x's shape"),
        (lambda x: L.rms_norm(x.to(torch.int32)), TypeError, "int32"),
        (lambda x: L.layer_norm(x, torch.ones(8, dtype=torch.int64)), TypeError, "weight has dtype"),
        (lambda x: L.rms_norm(x, out_dtype=torch.int8), TypeError, "out_dtype must be a floating"),
        (lambda x: L.rms_norm(x, residual_dtype="float32"), TypeError, "residual_dtype must be"),
        (lambda x: L.rms_norm(x, weight_offset=1.0), ValueError, "weight_offset=1.0 scales a weight"),
        (lambda x: L.rms_norm(x, eps=-1.0), ValueError, "eps must be a non-negative"),
        (lambda x: L.rms_norm(x, residual=x.double()), TypeError, "residual has dtype"),
        (lambda x: L.rms_norm(x.double(), out_dtype=torch.float32), TypeError, "out_dtype"),
        (lambda x: L.rms_norm(x[0, 0]), ValueError, "at least one dim"),
        (lambda x: L.rms_norm(x.numpy()), TypeError, "x must be a torch.Tensor"),
        (lambda x: L.rms_norm(x, out=x.numpy()), TypeError, "out must be a torch.Tensor"),
        (lambda x: L.rms_norm(x, out=torch.empty(4, 7)), ValueError, r"out must have shape \(4, 8\)"),
        (lambda x: L.rms_norm(x, out=torch.empty(4, 8).half()), ValueError, "dtype torch.float32"),
        (lambda x: L.layer_norm(x, out=torch.empty(8, 4).t()), ValueError, "out must be contiguous"),
        (lambda x: L.rms_norm(x, prenorm=True, out=torch.empty(4, 8)), ValueError, "prenorm=True"),
        (lambda x: L.rms_norm(x, out=torch.empty(4, 8, requires_grad=True)), RuntimeError, "autograd"),
        (lambda x: L.rms_norm(x.requires_grad_(), out=torch.empty(4, 8)), RuntimeError, "autograd"),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(error, match=match):
        call(x)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_out_that_overlaps_an_input_is_rejected(rms: bool) -> None:
    # out=x and out=residual run in place; any other overlap would read written elements.
    buf = torch.randn(5, 8)
    before = buf.clone()
    x, shifted = buf[:4], buf[1:]
    residual = torch.randn(4, 8)
    norm = L.rms_norm if rms else L.layer_norm
    with pytest.raises(ValueError, match="must not share memory with x"):
        norm(x, residual=residual, out=shifted)
    with pytest.raises(ValueError, match="must not share memory with residual"):
        norm(residual, residual=x, out=shifted)
    weight = torch.ones(32)
    with pytest.raises(ValueError, match="must not share memory with weight"):
        norm(torch.randn(1, 32), weight, out=weight.view(1, 32))
    assert torch.equal(buf, before)  # nothing was written


def test_bad_input_fails_before_any_kernel_runs() -> None:
    x = torch.randn(4, 8)
    with failing_implementation("rms_norm", "cpu", AssertionError("kernel ran")), pytest.raises(ValueError):
        L.rms_norm(x, torch.ones(5))


# ---- library ops -----------------------------------------------------------------------


def _opcheck_cases(device: str):
    x = random_tensor((5, 33), torch.bfloat16, device, requires_grad=True)
    r = random_tensor((5, 33), torch.bfloat16, device, requires_grad=True)
    w = random_tensor((33,), torch.float32, device, requires_grad=True)
    b = random_tensor((33,), torch.float32, device, requires_grad=True)
    ops = torch.ops.openkernels
    return [
        (ops.rms_norm.default, (x, w, r, 1e-6, 1.0, True, None, torch.float32)),
        (ops.rms_norm.default, (x, None, None, 1e-6, 0.0, False, torch.float32, None)),
        (ops.layer_norm.default, (x, w, b, r, 1e-5, True, None, None)),
        (ops.layer_norm.default, (x, None, None, None, 1e-5, False, None, None)),
    ]


def test_opcheck(device: str) -> None:
    for op, args in _opcheck_cases(device):
        run_opcheck(op, args)


def test_backward_ops_opcheck(device: str) -> None:
    h = random_tensor((5, 33), torch.bfloat16, device)
    dy = random_tensor((5, 33), torch.bfloat16, device)
    w = random_tensor((33,), torch.float32, device)
    mean = torch.randn(5, device=device)
    rstd = torch.rand(5, device=device) + 0.5
    ops = torch.ops.openkernels
    run_opcheck(ops.rms_norm_backward.default, (dy, dy, h, w, rstd, 0.0, True))
    run_opcheck(ops.layer_norm_backward.default, (dy, None, h, w, mean, rstd, True, False))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_torch_compile_fullgraph(device: str, rms: bool) -> None:
    def block(x, r, w, b):
        if rms:
            y, h = L.rms_norm(x, w, residual=r, prenorm=True, residual_dtype=torch.float32)
        else:
            y, h = L.layer_norm(x, w, b, residual=r, prenorm=True, residual_dtype=torch.float32)
        return (y.float() * 2).sum() + h.sum()

    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    args = [
        random_tensor((6, 40), torch.bfloat16, device, requires_grad=True),
        random_tensor((6, 40), torch.bfloat16, device, requires_grad=True),
        random_tensor((40,), torch.bfloat16, device, requires_grad=True),
        random_tensor((40,), torch.bfloat16, device, requires_grad=True),
    ]
    eager = block(*args)
    grads = torch.autograd.grad(eager, args[:3])
    got = compiled(*args)
    got_grads = torch.autograd.grad(got, args[:3])
    assert_close(got, eager.double(), dtype=torch.float32, terms=240)
    for a, b in zip(got_grads, grads):
        assert torch.equal(a, b), "compiled and eager gradients differ"


def test_out_ops_opcheck(device: str) -> None:
    x = random_tensor((5, 33), torch.bfloat16, device)
    r = random_tensor((5, 33), torch.bfloat16, device)
    w = random_tensor((33,), torch.float32, device)
    out = torch.empty(5, 33, dtype=torch.float32, device=device)
    ops = torch.ops.openkernels
    run_opcheck(ops.rms_norm_out.default, (x, w, r, 1e-6, 0.0, torch.float32), {"out": out})
    run_opcheck(ops.layer_norm_out.default, (x, w, w, None, 1e-5, None), {"out": out})


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_torch_compile_out_in_place(device: str, rms: bool) -> None:
    # The post-norm swap of kernelize under torch.compile: the dense output normalized in place.
    def block(x, r, w, b):
        h = x * 2
        if rms:
            return L.rms_norm(h, w, residual=r, out=h)
        return L.layer_norm(h, w, b, residual=r, out=h)

    args = [random_tensor(s, torch.float32, device) for s in ((6, 40), (6, 40), (40,), (40,))]
    want = block(*args).clone()
    got = torch.compile(block, fullgraph=True, dynamic=False)(*args)
    assert torch.equal(got, want), "compiled and eager results differ"


def test_double_backward_is_a_clear_error() -> None:
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = L.rms_norm(x)
    (g,) = torch.autograd.grad(y.sum() * 0 + (y * y).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"double backward is not supported|once_differentiable"):
        g.sum().backward()
    compiled_path = torch.ops.openkernels.rms_norm(x, None, None, 1e-6, 0.0, False, None, None)[0]
    (g,) = torch.autograd.grad((compiled_path * compiled_path).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        g.sum().backward()


# ---- modules ---------------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [16, (4, 8)], ids=["int", "tuple"])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm_module_matches_torch(device: str, shape, affine: bool, eps) -> None:
    theirs = torch.nn.RMSNorm(shape, eps=eps, elementwise_affine=affine, device=device)
    ours = L.RMSNorm(shape, eps=eps, elementwise_affine=affine, device=device)
    if affine:
        theirs.weight.data = random_tensor(theirs.weight.shape, torch.float32, device)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert repr(ours) == repr(theirs)
    _same_module_outputs(ours, theirs, (3, 5, 16), device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_rmsnorm_default_eps_is_torchs_for_every_dtype(dtype: torch.dtype) -> None:
    """eps=None: torch takes the epsilon of the type it computes in (float32 for 16-bit x), not
    x's dtype's (bfloat16's 0.0078 made a row of RMS 0.05 come out ~2x too small), in the
    module and in kernelize's swap of nn.RMSNorm."""
    import copy

    from openkernels.shared.kernelize import kernelize

    theirs = torch.nn.RMSNorm(16).to(dtype)
    swapped = copy.deepcopy(theirs)
    kernelize(swapped)
    x = (torch.randn(4, 16, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    want = theirs(x)
    for module in (L.RMSNorm(16).to(dtype), swapped):
        assert_close(module(x), want, dtype=dtype)


def test_layer_norm_bias_gradient_keeps_its_own_dtype() -> None:
    """A float32 bias beside a bfloat16 weight: dbias was rounded to bfloat16 (the weight's
    dtype) before its cast back; it is the float32 sum of grad_out over the rows."""
    gen = torch.Generator().manual_seed(6)
    x, grad = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    for w_dtype, b_dtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        w = torch.randn(256, generator=gen).to(w_dtype).requires_grad_()
        b = torch.randn(256, generator=gen).to(b_dtype).requires_grad_()
        db = torch.autograd.grad(L.layer_norm(x, w, b), b, grad)[0]
        assert db.dtype == b_dtype
        torch.testing.assert_close(db, grad.double().sum(0).to(b_dtype), rtol=1e-5, atol=1e-5)


def test_compile_with_a_symbolic_weight_offset() -> None:
    """weight_offset's finiteness check traces on a SymFloat (math.isfinite did not)."""
    x, w = torch.randn(2, 8), torch.ones(8)
    torch.compile(lambda x: L.rms_norm(x), fullgraph=True, dynamic=True)(x)
    f = torch.compile(lambda x, offset: L.rms_norm(x, w, weight_offset=offset), fullgraph=True)
    f(x, 0.0)
    torch.testing.assert_close(f(x, 1.0), L.rms_norm(x, w, weight_offset=1.0))


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("shape", [16, (4, 4)], ids=["int", "tuple"])
def test_layernorm_module_matches_torch(device: str, shape, affine: bool, bias: bool) -> None:
    theirs = torch.nn.LayerNorm(shape, elementwise_affine=affine, bias=bias, device=device)
    ours = L.LayerNorm(shape, elementwise_affine=affine, bias=bias, device=device)
    for p in theirs.parameters():
        p.data = random_tensor(p.shape, torch.float32, device)
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    _same_module_outputs(ours, theirs, (3, 5, 16), device)


def _same_module_outputs(ours: torch.nn.Module, theirs: torch.nn.Module, shape, device: str) -> None:
    k = len(theirs.normalized_shape)
    x_shape = (*shape[:-1], *theirs.normalized_shape) if k > 1 else shape
    x = random_tensor(x_shape, torch.float32, device, requires_grad=True)
    y_ours, y_theirs = ours(x), theirs(x)
    assert y_ours.shape == y_theirs.shape
    assert_close(y_ours, y_theirs.double(), dtype=torch.float32, terms=16)
    dy = random_tensor(x_shape, torch.float32, device)
    g_ours = torch.autograd.grad(y_ours, [x, *ours.parameters()], dy)
    g_theirs = torch.autograd.grad(y_theirs, [x, *theirs.parameters()], dy)
    for a, b in zip(g_ours, g_theirs):
        assert_close(a, b.double(), dtype=torch.float32, terms=16 * 15, term_scale=float(b.abs().max()) * 10)


def test_module_rejects_wrong_trailing_shape() -> None:
    with pytest.raises(ValueError, match="normalized_shape"):
        L.RMSNorm((4, 8), elementwise_affine=False)(torch.randn(2, 8, 4))


def test_add_rmsnorm_module_is_the_unfused_sequence(device: str) -> None:
    norm = L.AddRMSNorm(64, eps=1e-6, device=device, weight_offset=1.0, residual_dtype=torch.float32)
    norm.weight.data = random_tensor((64,), torch.float32, device)
    x = random_tensor((9, 64), torch.bfloat16, device)
    r = random_tensor((9, 64), torch.bfloat16, device)
    y, h = norm(x, r)
    h_ref = x.double() + r.double()
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert_close(h, h_ref, dtype=torch.float32)
    y_ref = R.rms_norm_ref(h_ref, norm.weight.double(), 1e-6, weight_offset=1.0)
    assert_close(y, y_ref, dtype=torch.bfloat16, terms=64)
    y0, h0 = norm(x)  # no residual yet: the stream starts at x
    assert torch.equal(h0, x.float())
    assert_close(y0, R.rms_norm_ref(x.double(), norm.weight.double(), 1e-6, weight_offset=1.0),
                 dtype=torch.bfloat16, terms=64)  # fmt: skip


def test_add_layernorm_module(device: str) -> None:
    norm = L.AddLayerNorm((2, 32), device=device)
    x = random_tensor((3, 2, 32), torch.float32, device)
    r = random_tensor((3, 2, 32), torch.float32, device)
    y, h = norm(x, r)
    ref = torch.nn.functional.layer_norm(x + r, (2, 32), norm.weight, norm.bias)
    assert_close(y, ref.double(), dtype=torch.float32, terms=64)
    assert_close(h, (x + r).double(), dtype=torch.float32)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        norm(x, r[:2])


# ---- dispatch ----------------------------------------------------------------------------


def test_explain_names_the_choice() -> None:
    text = dispatch.explain("rms_norm", torch.randn(2, 8))
    assert "cpu" in text and "reference" in text


def test_failing_kernel_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    x = torch.randn(6, 40)
    w = torch.randn(40)
    failing = failing_implementation("layer_norm", "cpu", RuntimeError("no launch"))
    with failing, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = L.layer_norm(x, w)
        second = L.layer_norm(x, w)
    fallbacks = [w for w in caught if issubclass(w.category, dispatch.KernelFallbackWarning)]
    assert len(fallbacks) == 1
    ref = R.layer_norm_ref(x.double(), w.double())
    assert_close(first, ref, dtype=torch.float32, terms=40)
    assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU with > 12 GB")
def test_tensors_past_2_to_the_31_elements() -> None:
    n = 8192
    rows = 2**31 // n + 3  # the last rows sit past element 2^31: int64 offsets
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = L.rms_norm(x, w)
    tail = slice(rows - 4, rows)
    assert_close(y[tail], R.rms_norm_ref(x[tail].double(), w.double()), dtype=torch.bfloat16, terms=n)
    y = L.layer_norm(x, w)
    assert_close(y[tail], R.layer_norm_ref(x[tail].double(), w.double()), dtype=torch.bfloat16, terms=n)


def test_module_parameters_take_the_eager_path_and_replay() -> None:
    """A model's norm weight is an nn.Parameter: its calls run the kernels directly (no
    library op) and, from the second call of a shape on, replay; forward and backward equal
    the Python path's."""
    from openkernels.shared import replay

    w = torch.nn.Parameter(torch.randn(64, dtype=torch.float64).float())
    x = torch.randn(5, 64)
    with torch.no_grad():
        outs = [L.rms_norm(x, w, 1e-6) for _ in range(3)]
    with replay.disabled():
        want = L.rms_norm(x, w, 1e-6)
    assert all(torch.equal(o, want.detach()) for o in outs)
    assert replay.stats(L.rms_norm)["hits"] >= (1 if replay.available() else 0)
    grads = []
    for _ in range(3):
        w.grad = None
        L.rms_norm(x, w, 1e-6).sum().backward()
        grads.append(w.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads)
    torch.testing.assert_close(
        grads[0], torch.func.grad(lambda w: F.rms_norm(x, (64,), w, 1e-6).sum())(w.detach())
    )


def test_split_backward_only_where_a_row_of_programs_fits() -> None:
    """The split backward's programs of a row wait for each other: the plan takes it only when
    the row needs no more of them than the GPU has SMs (one program per SM always fits), and
    the looped kernel otherwise; a forced split config past that is refused, not launched."""
    from openkernels.layernorm.triton.configs import NormConfig
    from openkernels.layernorm.triton.plan import plan

    for rms in (True, False):
        wide = plan("bwd", 8, 262144, torch.bfloat16, "cuda", True, rms, 132)
        small = plan("bwd", 8, 262144, torch.bfloat16, "cuda", True, rms, 16)
        assert (wide.kernel, wide.config.mode) == ("_norm_bwd_split_kernel", "split")
        assert (small.kernel, small.config.mode) == ("_norm_bwd_kernel", "looped")
        assert small.programs == small.grid[0]
    forced = NormConfig(1, 4096, 8, "split", 2)
    with pytest.raises(ValueError, match="cannot run 64 splits"):
        plan("bwd", 8, 262144, torch.bfloat16, "cuda", True, True, 16, forced)
