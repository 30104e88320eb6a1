"""openkernels.layernorm.jax against the float64 PyTorch reference on the same inputs:
forward and gradients under jax.jit on every JAX backend that runs here, every option
(residual, prenorm, weight_offset, out_dtype, residual_dtype, no weight/bias), odd shapes,
NaN, empty inputs, float64, bad inputs."""

from __future__ import annotations

import pytest
import torch

jax = pytest.importorskip("jax")
jnp = jax.numpy

import openkernels.layernorm as L  # noqa: E402
import openkernels.layernorm.jax as LJ  # noqa: E402
from openkernels.layernorm.problem import BENCH_OPS, NORMS  # noqa: E402
from openkernels.shared import dispatch  # noqa: E402
from openkernels.shared import jax as okjax  # noqa: E402
from openkernels.shared.dev.testing import assert_close, random_tensor  # noqa: E402
from openkernels.shared.dev.testing.jax import jax_backends, to_jax, to_torch  # noqa: E402
from openkernels.shared.platform import triton_interpreting  # noqa: E402

from .cases import KERNEL_DTYPES, Options, all_options, gradient_term_scale, option_params  # noqa: E402

pytestmark = pytest.mark.parametrize("backend", jax_backends())

_ROLES = ("x", "weight", "bias", "residual")

# The interpreter runs every program in Python: a few options that between them set every
# flag, on small shapes. (3, 20000) takes the looped forward and backward kernels, (257, 64)
# gives the persistent backward programs several row blocks each.
_FEW = [
    Options(rms=True, residual=True, prenorm=True, weight_offset=1.0),
    Options(rms=False, bias=True, residual=True, prenorm=True, residual_fp32=True),
    Options(rms=False, weight=False, out_fp32=True),
    Options(rms=True, weight=False, residual=True),  # h stored for the backward only
    Options(rms=True, residual_fp32=True),  # h = x rounded to float32, no residual
]


def _shapes(backend: str) -> list[tuple[int, ...]]:
    if backend == "jnp":
        return [(1, 1), (7, 127), (5, 4097), (2, 3, 130), (257, 64), (33, 20000)]
    return [(1, 1), (7, 33), (2, 3, 64), (257, 64)]


def _fn(options: Options):
    """The JAX op with `options`, on a dict of the present inputs."""
    kw: dict = {"prenorm": options.prenorm}
    if options.out_fp32:
        kw["out_dtype"] = jnp.float32
    if options.residual_fp32:
        kw["residual_dtype"] = jnp.float32

    def fn(a: dict):
        if options.rms:
            return LJ.rms_norm(a["x"], a.get("weight"), 1e-6, residual=a.get("residual"),
                               weight_offset=options.weight_offset, **kw)  # fmt: skip
        return LJ.layer_norm(a["x"], a.get("weight"), a.get("bias"), 1e-5, residual=a.get("residual"), **kw)

    return fn


def _run_jax(backend: str, options: Options, inputs: dict, dy: torch.Tensor, dh: torch.Tensor | None):
    """(y, h or None, grads by role) of the jitted op and its VJP on the torch inputs."""
    present = {k: to_jax(v) for k, v in inputs.items() if v is not None}
    with okjax.use_backend(backend):
        out, vjp = jax.vjp(jax.jit(_fn(options)), present)
        (grads,) = vjp((to_jax(dy), to_jax(dh)) if options.prenorm else to_jax(dy))
    y, h = out if options.prenorm else (out, None)
    return to_torch(y), None if h is None else to_torch(h), {k: to_torch(g) for k, g in grads.items()}


def _check(backend: str, options: Options, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Forward outputs and the VJP of (dy, dh) against the float64 reference, with the
    tolerances of tests/cases.py:check_against_reference (same reasons)."""
    msg = f"{options.id} {dtype} {shape} {backend}"
    inputs = options.make(shape, dtype, "cpu")
    out_dtype, h_dtype = options.out_dtype(dtype), options.h_dtype(dtype)
    dy = random_tensor(shape, out_dtype)
    dh = random_tensor(shape, h_dtype) if options.prenorm else None
    y, h, grads = _run_jax(backend, options, inputs, dy, dh)
    y_ref, h_ref, leaves = options.reference(inputs, dtype)
    n, rows = shape[-1], y_ref.numel() // shape[-1]
    assert y.dtype == out_dtype, f"{msg}: y dtype {y.dtype}"
    y_scale = float(y_ref.detach().abs().max())
    assert_close(y, y_ref, dtype=out_dtype, terms=n, term_scale=y_scale, msg=f"{msg} y")
    loss_ref = (y_ref * dy.double()).sum()
    if options.prenorm:
        assert h is not None and h.dtype == h_dtype, f"{msg}: h dtype"
        assert_close(h, h_ref, dtype=h_dtype, msg=f"{msg} h")
        loss_ref = loss_ref + (h_ref * dh.double()).sum()
    wanted = [k for k in _ROLES if inputs[k] is not None]
    assert sorted(grads) == sorted(wanted)
    grads_ref = dict(zip(wanted, torch.autograd.grad(loss_ref, [leaves[k] for k in wanted])))
    scale = gradient_term_scale(options, inputs, y_ref, dy)
    for k in wanted:
        assert grads[k].dtype == inputs[k].dtype, f"{msg}: d{k} dtype {grads[k].dtype}"
        # dx sums n products per row, cancelling from terms of size rstd * |g|; dweight and
        # dbias sum over the rows.
        terms = n if k in ("x", "residual") else rows
        assert_close(
            grads[k], grads_ref[k], dtype=grads[k].dtype, terms=terms, term_scale=scale, msg=f"{msg} d{k}"
        )


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("options", option_params(_FEW))
def test_forward_and_vjp(backend: str, options: Options, dtype: torch.dtype) -> None:
    for shape in _shapes(backend):
        _check(backend, options, dtype, shape)


@pytest.mark.parametrize("options", option_params(all_options()))
def test_every_option_bf16(backend: str, options: Options) -> None:
    if backend != "jnp" and options not in _FEW:
        pytest.skip("the interpreter and GPUs run the few combinations that set every flag")
    _check(backend, options, torch.bfloat16, (7, 130))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_looped_kernels(backend: str, rms: bool) -> None:
    # Rows past the tile widths: the looped forward and backward kernels.
    options = Options(rms=rms, bias=not rms, residual=True, prenorm=True)
    _check(backend, options, torch.bfloat16, (3, 20000))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_jax_grad_of_a_loss(backend: str, rms: bool) -> None:
    options = Options(rms=rms, bias=not rms, residual=True, weight_offset=1.0 if rms else 0.0)
    inputs = options.make((9, 48), torch.float32, "cpu")
    present = {k: to_jax(v) for k, v in inputs.items() if v is not None}
    fn = _fn(options)
    with okjax.use_backend(backend):
        grads = jax.jit(jax.grad(lambda a: jnp.sum(fn(a) ** 2)))(present)
    y_ref, _, leaves = options.reference(inputs, torch.float32)
    wanted = [k for k in _ROLES if inputs[k] is not None]
    expected = torch.autograd.grad((y_ref**2).sum(), [leaves[k] for k in wanted])
    scale = gradient_term_scale(options, inputs, y_ref, 2 * y_ref.detach())
    for k, g_ref in zip(wanted, expected):
        terms = 48 if k in ("x", "residual") else 9
        assert_close(to_torch(grads[k]), g_ref, dtype=torch.float32, terms=terms, term_scale=scale, msg=k)


def test_backward_runs_where_the_forward_ran(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The VJP is traced after the use_backend block ends; it must still launch the kernels.
    launched: list[str] = []
    real = okjax.launch

    def counting(kernel, **kw):
        launched.append(getattr(kernel, "fn", kernel).__name__)
        return real(kernel, **kw)

    monkeypatch.setattr(okjax, "launch", counting)
    x = to_jax(random_tensor((5, 24), torch.float32))
    with okjax.use_backend(backend):
        _, vjp = jax.vjp(lambda a: LJ.rms_norm(a), x)
    (dx,) = vjp(jnp.ones_like(x))
    assert dx.shape == x.shape
    assert launched == ([] if backend == "jnp" else ["_norm_fwd_kernel", "_norm_bwd_kernel"])


def test_only_wanted_gradients_are_computed(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Differentiating x alone skips the weight/bias partial sums; a loss of h alone makes
    # y's cotangent zero and h's the only one (no dh_out read when h is unused).
    launches: list[dict] = []
    real = okjax.launch

    def recording(kernel, **kw):
        launches.append(dict(kw["constants"], kernel=getattr(kernel, "fn", kernel).__name__))
        return real(kernel, **kw)

    monkeypatch.setattr(okjax, "launch", recording)
    x, r = (to_jax(random_tensor((6, 40), torch.float32)) for _ in range(2))
    w, b = to_jax(1 + 0.5 * random_tensor((40,))), to_jax(random_tensor((40,)))

    def ln(x, w, b, r):
        return LJ.layer_norm(x, w, b, residual=r, prenorm=True)

    with okjax.use_backend(backend):
        dx = jax.jit(jax.grad(lambda x: jnp.sum(ln(x, w, b, r)[0] ** 2)))(x)
        g_h = jax.jit(jax.grad(lambda *a: jnp.sum(ln(*a)[1]), argnums=(0, 1, 2, 3)))(x, w, b, r)
    assert dx.shape == x.shape
    # h = x + r: d sum(h) / dx = d / dr = 1; y is unused, so weight and bias get 0.
    for g, want in zip(g_h, (1.0, 0.0, 0.0, 1.0)):
        assert bool((g == want).all()), g
    if backend != "jnp":
        bwd = [c for c in launches if c["kernel"] == "_norm_bwd_kernel"]
        assert [(c["WEIGHT_GRAD"], c["BIAS_GRAD"], c["HAS_DH_OUT"]) for c in bwd] == [
            (False, False, False),
            (True, True, True),
        ]


@pytest.mark.skipif(not triton_interpreting(), reason="compares with the PyTorch Triton path")
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_same_bits_as_the_pytorch_kernels(backend: str, rms: bool) -> None:
    # Same kernels and launch plans as the PyTorch path: identical results on the same inputs.
    if backend == "jnp":
        pytest.skip("the jnp composition is not the kernel")
    options = Options(rms=rms, bias=not rms, residual=True, prenorm=True)
    inputs = options.make((37, 96), torch.bfloat16, "cpu")
    dy, dh = random_tensor((37, 96), torch.bfloat16), random_tensor((37, 96), torch.bfloat16)
    y, h, grads = _run_jax(backend, options, inputs, dy, dh)
    with dispatch.force("triton"):
        y_t, h_t = options.call(inputs, torch.bfloat16)
        wanted = [k for k in _ROLES if inputs[k] is not None]
        grads_t = torch.autograd.grad([y_t, h_t], [inputs[k] for k in wanted], [dy, dh])
    assert torch.equal(y, y_t) and torch.equal(h, h_t)
    for k, g in zip(wanted, grads_t):
        assert torch.equal(grads[k], g), f"d{k}"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_nan_stays_in_its_row(backend: str, rms: bool, dtype: torch.dtype) -> None:
    options = Options(rms=rms)
    inputs = options.make((4, 33), dtype, "cpu")
    x = inputs["x"].detach().clone()
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    inputs["x"] = x.requires_grad_()
    y, _, grads = _run_jax(backend, options, inputs, random_tensor((4, 33), dtype), None)
    assert torch.isnan(y[1]).all(), "a NaN in a row must make the whole row NaN"
    assert not torch.isfinite(y[2, 7]), "an inf input came out finite"
    assert torch.isnan(grads["x"][1]).all(), "a NaN row's gradient must be NaN"
    assert torch.isfinite(grads["x"][[0, 3]]).all(), "a NaN spread into another row's gradient"
    y_ref, _, _ = options.reference({**inputs, "x": x[[0, 3]]}, dtype)
    assert_close(y[[0, 3]], y_ref, dtype=dtype, terms=33, msg="finite rows")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_empty(backend: str, rms: bool) -> None:
    options = Options(rms=rms, bias=not rms, residual=True, prenorm=True)
    for shape in [(0, 8), (2, 0, 8)]:
        inputs = options.make(shape, torch.float32, "cpu")
        y, h, grads = _run_jax(backend, options, inputs, torch.ones(shape), torch.ones(shape))
        assert y.shape == shape and h.shape == shape
        for k, g in grads.items():
            assert g.shape == inputs[k].shape and bool((g == 0).all()), k


def test_float64_with_x64(backend: str) -> None:
    with jax.enable_x64(True):
        for options in (
            Options(rms=True, residual=True, prenorm=True, weight_offset=1.0),
            Options(rms=False, bias=True, residual=True, prenorm=True),
        ):
            _check(backend, options, torch.float64, (5, 12))


def _bad_calls() -> list:
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    return [
        (TypeError, r"x must be a jax\.Array", lambda: LJ.rms_norm(torch.ones(4, 8))),
        (TypeError, "x has dtype int32; supported", lambda: LJ.layer_norm(jnp.ones((4, 8), jnp.int32))),
        (ValueError, "at least one dim", lambda: LJ.rms_norm(jnp.float32(1.0))),
        (ValueError, r"weight must have shape \(8,\)", lambda: LJ.rms_norm(x, jnp.ones((7,)))),
        (TypeError, "weight has dtype int32", lambda: LJ.rms_norm(x, jnp.ones((8,), jnp.int32))),
        (TypeError, r"bias must be a jax\.Array", lambda: LJ.layer_norm(x, w, [1.0] * 8)),
        (ValueError, "residual must have x's shape", lambda: LJ.rms_norm(x, w, residual=jnp.ones((4, 9)))),
        (ValueError, "eps must be a non-negative float", lambda: LJ.rms_norm(x, w, -1.0)),
        (ValueError, "eps must be a non-negative", lambda: jax.jit(lambda e: LJ.rms_norm(x, w, e))(1e-6)),
        (TypeError, "weight_offset must be a float", lambda: LJ.rms_norm(x, w, weight_offset=True)),
        (ValueError, "weight is None", lambda: LJ.rms_norm(x, weight_offset=1.0)),
        (TypeError, "out_dtype must be a floating JAX", lambda: LJ.rms_norm(x, out_dtype=jnp.int32)),
        (TypeError, "out_dtype must be a floating JAX", lambda: LJ.rms_norm(x, out_dtype=torch.float32)),
        (TypeError, "residual_dtype=float64 is not", lambda: LJ.layer_norm(x, residual_dtype="float64")),
    ]  # fmt: skip


def test_bad_inputs_raise_before_any_kernel(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were checked")

    monkeypatch.setattr(LJ, "_forward", no_kernel)
    with okjax.use_backend(backend):
        for error, pattern, call in _bad_calls():
            with pytest.raises(error, match=pattern):
                call()


def test_benchmark_cases_run(backend: str) -> None:
    from openkernels.layernorm.bench import jax_cases

    cases = jax_cases(shapes=((5, 64),), dtype=torch.float32)
    assert {(c.op, c.direction) for c in cases} == {(op, d) for op in BENCH_OPS for d in ("fwd", "fwd+bwd")}
    for case in cases:
        s = case.make_inputs(torch.device("cpu"))
        with okjax.use_backend(backend):
            got = jax.jit(case.jax_fn)({k: to_jax(v) for k, v in s.items()})
        want = case.torch_fn(s)
        got, want = jax.tree_util.tree_leaves(got), [want] if isinstance(want, torch.Tensor) else list(want)
        assert len(got) == len(want), case.label
        for g, w in zip(got, want):
            # Two float32 implementations of 64-term row sums (and 5-row weight sums).
            assert_close(to_torch(g), w.detach().double(), dtype=torch.float32, terms=64, msg=case.label)


def test_pytorch_api_names_match(backend: str) -> None:
    # Same names, positional order and defaults as the PyTorch functions, but out= (JAX
    # arrays are immutable: there is nothing to write into).
    import inspect

    for name in NORMS:
        ours, theirs = inspect.signature(getattr(LJ, name)), inspect.signature(getattr(L, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values() if p.name != "out"
        ]
