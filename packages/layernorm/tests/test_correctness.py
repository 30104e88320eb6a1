"""Every implementation against the float64 reference: every option combination, forward
and backward, odd shapes, non-contiguous views, NaN, all kernel dtypes."""

from __future__ import annotations

import pytest
import torch

import openkernels.layernorm as L
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import (
    TOLERANCES,
    assert_close,
    noncontiguous_views,
    poisoned_empty,
    random_tensor,
)
from openkernels.shared.platform import triton_interpreting

from .cases import (
    KERNEL_DTYPES,
    Options,
    all_options,
    check_against_reference,
    option_params,
    rows_far_from_their_shift,
    shapes,
    targets,
)

pytestmark = pytest.mark.parametrize(("device", "impl"), targets())

_ALL = all_options()
# fp32 and fp16 run every combination but the out32+res32 ones on CPU; under the
# interpreter and on GPUs (a compile per combination and dtype) a few that between them
# set every flag.
_FEW = [
    Options(rms=True, residual=True, prenorm=True, weight_offset=1.0),
    Options(rms=False, bias=True, residual=True, prenorm=True, residual_fp32=True),
    Options(rms=False, weight=False, out_fp32=True),
]
_SUBSET = _FEW if triton_interpreting() else [o for o in _ALL if not (o.out_fp32 and o.residual_fp32)]


def _run(device: str, impl: str, options: Options, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    inputs = options.make(shape, dtype, device)
    with dispatch.force(impl), poisoned_empty():
        y, h = options.call(inputs, dtype)
        check_against_reference(options, inputs, dtype, y, h, f"{options.id} {dtype} {shape}")


@pytest.mark.parametrize("options", option_params(_ALL))
def test_every_option_bf16(device: str, impl: str, options: Options) -> None:
    for shape in shapes(device):
        _run(device, impl, options, torch.bfloat16, shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("options", option_params(_SUBSET))
def test_options_fp32_fp16(device: str, impl: str, options: Options, dtype: torch.dtype) -> None:
    if device != "cpu" and options not in _FEW:
        pytest.skip("on GPUs fp32/fp16 run the few combinations that set every flag")
    for shape in shapes(device):
        _run(device, impl, options, dtype, shape)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_noncontiguous_views(device: str, impl: str, rms: bool, dtype: torch.dtype) -> None:
    options = Options(rms=rms, bias=not rms, residual=True, prenorm=True)
    for layout, x in noncontiguous_views((6, 9), dtype, device):
        inputs = options.make((6, 9), dtype, device)
        # x and the residual both in the odd layout; the kernels read them through strides.
        inputs["x"] = x.requires_grad_()
        inputs["residual"] = random_tensor((9, 6), dtype, device).t().requires_grad_()
        with dispatch.force(impl), poisoned_empty():
            y, h = options.call(inputs, dtype)
            check_against_reference(options, inputs, dtype, y, h, f"{layout}")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_row_slices_read_in_place(device: str, impl: str, rms: bool) -> None:
    # A slice of wider rows (row stride > N) is the layout a fused QKV or MLP output gives.
    options = Options(rms=rms, residual=True, prenorm=True)
    wide = random_tensor((37, 300), torch.bfloat16, device)
    inputs = options.make((37, 100), torch.bfloat16, device)
    inputs["x"] = wide[:, 50:150].requires_grad_()
    with dispatch.force(impl), poisoned_empty():
        y, h = options.call(inputs, torch.bfloat16)
        check_against_reference(options, inputs, torch.bfloat16, y, h, "row slice")


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_nan_stays_in_its_row(device: str, impl: str, rms: bool, dtype: torch.dtype) -> None:
    options = Options(rms=rms)
    inputs = options.make((4, 33), dtype, device, grad=False)
    x = inputs["x"].clone()
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    inputs["x"] = x
    with dispatch.force(impl):
        y, _ = options.call(inputs, dtype)
    # A NaN spreads over its row and only its row; an inf never comes out finite (rms
    # leaves the row's finite entries at inf * 0 = 0 or NaN, depending on rsqrt(inf)).
    assert torch.isnan(y[1]).all(), "a NaN in a row must make the whole row NaN"
    assert not torch.isfinite(y[2, 7]), "an inf input came out finite"
    y_ref, _, _ = options.reference({**inputs, "x": x[[0, 3]]}, dtype)
    assert_close(y[[0, 3]], y_ref, dtype=dtype, terms=33, msg="finite rows")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_large_offsets_and_constant_rows(device: str, impl: str, rms: bool) -> None:
    # A large mean on a small spread: LayerNorm must not lose the spread (E[x^2] - E[x]^2
    # would), and constant rows normalize to the bias exactly.
    options = Options(rms=rms, bias=not rms)
    inputs = options.make((5, 20000 if not triton_interpreting() else 3000), torch.float32, device)
    x = inputs["x"].detach() * 0.01 + 300.0
    x[0] = 2.5
    inputs["x"] = x.requires_grad_()
    # float32 holds the mean 300 to ulp(300) = 3e-5, which the rstd of 100 amplifies: a
    # conditioning of |h| * rstd. E[x^2] - E[x]^2 would lose the variance entirely instead.
    conditioning = 300.0 * 100.0
    with dispatch.force(impl), poisoned_empty():
        y, h = options.call(inputs, torch.float32)
        check_against_reference(
            options, inputs, torch.float32, y, h, "offset rows", conditioning=conditioning
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["x", "x+residual"])
@pytest.mark.parametrize("cols", [384, 1000])
def test_short_rows_far_from_their_first_value(
    device: str, impl: str, cols: int, residual: bool, dtype: torch.dtype
) -> None:
    # Short rows are summed in one pass about their first value on the CPU (with a residual:
    # while x + residual is added; bfloat16: while it is converted); a first value far from the
    # row's mean (an outlier, a row that jumps) must not cost the variance its digits.
    options = Options(rms=False, bias=True, residual=residual)
    inputs = options.make((7, cols), dtype, device)
    if residual:  # zero on the rows set below (h = x exactly there), random on rows 0 and 6
        r = inputs["residual"].detach().clone()
        r[1:6] = 0.0
        inputs["residual"] = r.requires_grad_()
    x = inputs["x"].detach().clone()
    x[1, 0] = 1.0e4  # an outlier first
    x[2, 1:] = x[2, 1:] * 0.01
    x[2, 0] = -50.0
    x[3] = 7.0  # constant
    x[4, 0] = 1.0e15
    x[5, 1:] = 1.0e-3 * x[5, 1:]
    x[5, 0] = 1.0
    inputs["x"] = x.requires_grad_()
    with dispatch.force(impl), poisoned_empty():
        y, h = options.call(inputs, dtype)
        # No conditioning allowance: the rows are summed about their mean, as every other row.
        check_against_reference(options, inputs, dtype, y, h, "rows far from their first value")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_empty(device: str, impl: str, rms: bool) -> None:
    options = Options(rms=rms, bias=not rms, residual=True, prenorm=True)
    for shape in [(0, 8), (2, 0, 8)]:
        inputs = options.make(shape, torch.float32, device)
        with dispatch.force(impl):
            y, h = options.call(inputs, torch.float32)
            assert y.shape == shape and h.shape == shape
            grads = torch.autograd.grad((y.sum() + h.sum()), [v for v in inputs.values() if v is not None])
        for g, v in zip(grads, [v for v in inputs.values() if v is not None]):
            assert g.shape == v.shape and (g.numel() == 0 or bool((g == 0).all()))


def test_weight_grad_is_deterministic(device: str, impl: str) -> None:
    options = Options(rms=False, bias=True)
    inputs = options.make((513, 96), torch.bfloat16, device)
    dy = random_tensor((513, 96), torch.bfloat16, device)
    results = []
    with dispatch.force(impl):
        for _ in range(2):
            y, _ = options.call(inputs, torch.bfloat16)
            results.append(torch.autograd.grad(y, [inputs["weight"], inputs["bias"]], dy))
    for a, b in zip(*results):
        assert torch.equal(a, b), "weight/bias gradients differ between two identical runs"


def test_float64_runs_on_cpu_and_reference_only(device: str, impl: str) -> None:
    options = Options(rms=True, residual=True, prenorm=True)
    inputs = options.make((4, 10), torch.float64, device)
    if impl in ("triton", "cluster"):  # GPU kernels: float64 is refused with the reason
        with dispatch.force(impl), pytest.raises(dispatch.UnsupportedError, match=r"reference|float64"):
            options.call(inputs, torch.float64)
        return
    with dispatch.force(impl):
        y, h = options.call(inputs, torch.float64)
        check_against_reference(options, inputs, torch.float64, y, h, "float64")


def test_gradcheck_float64(device: str, impl: str) -> None:
    if impl in ("triton", "cluster"):
        pytest.skip("float64 runs on the CPU kernel and the reference (gradcheck needs float64)")
    import openkernels.layernorm as L

    x = random_tensor((3, 11), torch.float64, device, requires_grad=True)
    r = random_tensor((3, 11), torch.float64, device, requires_grad=True)
    w = random_tensor((11,), torch.float64, device, requires_grad=True)
    b = random_tensor((11,), torch.float64, device, requires_grad=True)
    with dispatch.force(impl):
        assert torch.autograd.gradcheck(
            lambda x, r, w: L.rms_norm(x, w, residual=r, prenorm=True, weight_offset=1.0), (x, r, w)
        )
        assert torch.autograd.gradcheck(
            lambda x, r, w, b: L.layer_norm(x, w, b, residual=r, prenorm=True), (x, r, w, b)
        )
        assert torch.autograd.gradcheck(lambda x: L.layer_norm(x), (x,))


def _kernel_paths(device: str) -> list:
    """Every Triton kernel and launch option a config can pick, on shapes that exercise it."""
    from openkernels.layernorm.triton.configs import NormConfig

    splits = 1 if device == "cpu" else 3  # the interpreter runs programs one by one
    return [
        ("fwd", NormConfig(1, 64, 2, "tile"), (37, 50)),
        ("fwd", NormConfig(2, 64, 2, "tile"), (37, 64)),  # n == BLOCK_C: no column mask
        ("fwd", NormConfig(1, 64, 2, "tile", programs_per_sm=1, prefetch=True), (37, 64)),
        ("fwd", NormConfig(4, 64, 2, "tile", programs_per_sm=1), (37, 50)),
        ("fwd", NormConfig(2, 64, 2, "tile", programs_per_sm=1, prefetch=True), (37, 50)),
        ("fwd", NormConfig(1, 128, 4, "split"), (5, 128 * splits - 3)),
        ("fwd", NormConfig(1, 128, 4, "split", one_pass=True), (5, 128 * splits - 3)),
        ("fwd", NormConfig(1, 64, 2, "looped"), (5, 200)),
        ("bwd", NormConfig(1, 64, 2, "tile", programs_per_sm=2), (37, 50)),
        ("bwd", NormConfig(2, 64, 2, "tile", programs_per_sm=1, prefetch=True), (37, 64)),
        ("bwd", NormConfig(4, 64, 2, "tile", programs_per_sm=1, prefetch=True), (37, 50)),
        ("bwd", NormConfig(1, 64, 2, "tile", programs_per_sm=0, prefetch=True), (37, 50)),
        ("bwd", NormConfig(1, 64, 2, "looped", programs_per_sm=1), (5, 200)),
        # Split backward: runs of rows per program (2 programs per SM on the interpreter's 4).
        ("bwd", NormConfig(1, 128, 4, "split", programs_per_sm=2), (37, 128 * splits - 3)),
        ("bwd", NormConfig(1, 128, 4, "split", programs_per_sm=1), (3, 128 * splits - 3)),
    ]


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_nan_spreads_on_every_forward_path(device: str, impl: str, rms: bool) -> None:
    """Each forward kernel and launch option: a NaN makes its whole row NaN and no other.
    (The split kernel's variance clamp once dropped the NaN on CUDA, whose max returns the
    other operand: RMSNorm rows came out finite. The interpreter's max keeps NaN either way,
    so the test bites on GPUs.)"""
    if impl != "triton":
        pytest.skip("launch configs belong to the Triton kernels")
    from openkernels.layernorm import triton as T

    for direction, cfg, (m, n) in _kernel_paths(device):
        if direction != "fwd":
            continue
        x = random_tensor((m, n), torch.bfloat16, device)
        x[1, n - 2] = float("nan")
        w = random_tensor((n,), torch.bfloat16, device)
        b = None if rms else random_tensor((n,), torch.bfloat16, device)
        out, rstd = torch.empty(m, n, dtype=torch.bfloat16, device=device), torch.empty(m, device=device)
        mean = None if rms else torch.empty(m, device=device)
        T.norm_fwd(x, None, w, b, out, None, mean, rstd, eps=1e-6, weight_offset=0.0, rms=rms,
                   h_dtype=torch.bfloat16, config=cfg)  # fmt: skip
        assert torch.isnan(out[1]).all(), f"{cfg}: a NaN in a row must make the whole row NaN"
        assert torch.isfinite(out[[0, *range(2, m)]]).all(), f"{cfg}: the NaN spread to other rows"


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_every_kernel_path(device: str, impl: str, rms: bool) -> None:
    if impl != "triton":
        pytest.skip("launch configs belong to the Triton kernels")
    from openkernels.layernorm import reference as R
    from openkernels.layernorm import triton as T

    for direction, cfg, (m, n) in _kernel_paths(device):
        msg = f"{direction} {cfg}"
        x = random_tensor((m, n), torch.bfloat16, device)
        r = random_tensor((m, n), torch.bfloat16, device)
        w = random_tensor((n,), torch.bfloat16, device)
        b = None if rms else random_tensor((n,), torch.bfloat16, device)
        h = (x.float() + r.float()).to(torch.bfloat16)
        if direction == "fwd":
            got = [torch.empty(m, n, dtype=torch.bfloat16, device=device) for _ in range(2)]
            got += [None if rms else torch.empty(m, device=device), torch.empty(m, device=device)]
            T.norm_fwd(
                x, r, w, b, *got, eps=1e-6, weight_offset=0.5, rms=rms, h_dtype=torch.bfloat16, config=cfg
            )
            want = [torch.empty(m, n, dtype=torch.float64) for _ in range(2)]
            want += [
                None if rms else torch.empty(m, dtype=torch.float64),
                torch.empty(m, dtype=torch.float64),
            ]
            R.norm_fwd(x.double().cpu(), r.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(),
                       *want, eps=1e-6, weight_offset=0.5, rms=rms, h_dtype=torch.bfloat16)  # fmt: skip
            assert_close(got[1], want[1], dtype=torch.bfloat16, msg=f"{msg} h")
            assert_close(got[0], want[0], dtype=torch.bfloat16, terms=n, msg=f"{msg} y")
            assert_close(got[3], want[3], dtype=torch.float32, terms=n, msg=f"{msg} rstd")
            if not rms:
                assert_close(got[2], want[2], dtype=torch.float32, terms=n, term_scale=4.0, msg=f"{msg} mean")
        else:
            hd = h.double().cpu()
            mean = torch.zeros(m, dtype=torch.float64) if rms else hd.mean(-1)
            rstd = ((hd - mean[:, None]).square().mean(-1) + 1e-6).rsqrt()
            dy = random_tensor((m, n), torch.bfloat16, device)
            dh_out = random_tensor((m, n), torch.bfloat16, device)
            got = [torch.empty(m, n, dtype=torch.bfloat16, device=device), torch.empty(n, device=device)]
            got.append(None if rms else torch.empty(n, device=device))
            T.norm_bwd(dy, h, w, None if rms else mean.float().to(device), rstd.float().to(device), dh_out,
                       *got, weight_offset=0.5, rms=rms, config=cfg)  # fmt: skip
            want = [torch.empty(m, n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)]
            want.append(None if rms else torch.empty(n, dtype=torch.float64))
            R.norm_bwd(dy.double().cpu(), hd, w.double().cpu(), None if rms else mean, rstd,
                       dh_out.double().cpu(), *want, weight_offset=0.5, rms=rms)  # fmt: skip
            scale = float(rstd.max()) * float(dy.abs().max()) * 2.0
            assert_close(got[0], want[0], dtype=torch.bfloat16, terms=n, term_scale=scale, msg=f"{msg} dh")
            assert_close(got[1], want[1], dtype=torch.float32, terms=m, term_scale=scale * 4, msg=f"{msg} dw")
            if not rms:
                assert_close(got[2], want[2], dtype=torch.float32, terms=m, term_scale=scale, msg=f"{msg} db")


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize(
    ("dtype", "h_dtype", "residual"),
    [
        (torch.float32, torch.float32, False),
        (torch.bfloat16, torch.bfloat16, False),
        (torch.bfloat16, torch.float32, True),
    ],
    ids=["fp32", "bf16", "bf16+residual-h32"],
)
def test_split_forward_rows_far_from_their_shift(
    device: str, impl: str, dtype: torch.dtype, h_dtype: torch.dtype, residual: bool, one_pass: bool
) -> None:
    """LayerNorm's split forward, one-pass chunk statistics (ONE_PASS) and two-pass, on rows
    that make a shift by the chunk's first entry cancel, against float64 statistics of the
    same h. bfloat16 rounds 1000 + N(0, 1e-2) to a nearly constant row (its ulp at 1000 is
    4); with a bfloat16 residual into a float32 stream h is 1000 + N(0, 1e-2) again (x
    carries the offset, the residual the spread). One chunk per row under the interpreter,
    three on a GPU."""
    if impl != "triton":
        pytest.skip("launch configs belong to the Triton kernels")
    from openkernels.layernorm import triton as T
    from openkernels.layernorm.triton.configs import NormConfig

    chunk = 1024
    n = chunk * (1 if device == "cpu" else 3) - 3
    cfg = NormConfig(1, chunk, 4, "split", one_pass=one_pass)
    target = rows_far_from_their_shift(n, chunk)
    x = target.to(dtype)
    r = (target - x.double()).to(dtype) if residual else None
    m = x.shape[0]
    h = x.float() if r is None else x.float() + r.float()
    h = h.to(h_dtype).double()  # the kernel's h: x (+ residual) in float32, rounded once
    want_mean = h.mean(-1)
    want_rstd = ((h - want_mean[:, None]).square().mean(-1) + 1e-5).rsqrt()
    y = torch.empty(m, n, dtype=dtype, device=device)
    mean, rstd = torch.empty(m, device=device), torch.empty(m, device=device)
    T.norm_fwd(x.to(device), None if r is None else r.to(device), None, None, y, None, mean, rstd, eps=1e-5,
               weight_offset=0.0, rms=False, h_dtype=h_dtype, config=cfg)  # fmt: skip
    # y = (h - mean) * rstd with the kernel's own statistics, to the output dtype's tolerance
    # (with float64's, y would inherit the float32 mean's half ulp of 1000 times rstd, the
    # conditioning test_large_offsets_and_constant_rows allows for).
    want_y = (h - mean.double().cpu()[:, None]) * rstd.double().cpu()[:, None]
    # The chunk means are float32 and the merge counts their rounding as spread: an error e in
    # a chunk's mean adds count * e^2 to M2, (e * rstd)^2 of the variance, half that of rstd.
    # One pass (K + s1 / count, then the merge's sum) keeps the mean within ~2 half-ulps,
    # two passes (sum h / count) within a few more; it matters where |mean| * rstd is large
    # (row 0: 1000 * 100).
    ulps = 2 if one_pass else 4
    for row in range(m):
        msg = f"{cfg} row {row}"
        # rstd to float32's tolerance for a sum of n terms, plus the chunk means' rounding;
        # the mean: n terms of up to max|h|.
        spread = (ulps * 2.0**-24 * float(want_mean[row].abs() * want_rstd[row])) ** 2 / 2
        scale = 1 + spread / TOLERANCES[torch.float32].rtol
        assert_close(rstd[row], want_rstd[row], dtype=torch.float32, scale=scale, terms=n, msg=f"{msg} rstd")
        top = float(h[row].abs().max())
        assert_close(
            mean[row], want_mean[row], dtype=torch.float32, terms=n, term_scale=top, msg=f"{msg} mean"
        )
        assert_close(y[row], want_y[row], dtype=dtype, msg=f"{msg} y")


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_split_launches_leave_their_counters_at_zero(device: str, impl: str, rms: bool) -> None:
    """The split kernels' arrival counters are zeroed once, when the launcher makes them, and
    kept (replayed launches name them): each launch must leave them at 0, or the next one
    on the stream would read a row's partial sums before they are written (or, on a GPU,
    wait for ever). Two launches of each direction on the same buffer, bitwise equal."""
    if impl != "triton":
        pytest.skip("launch configs belong to the Triton kernels")
    from openkernels.layernorm import triton as T
    from openkernels.layernorm.triton.configs import NormConfig

    splits = 1 if device == "cpu" else 3
    m, n = 7, 128 * splits - 5
    x, dy = (random_tensor((m, n), torch.bfloat16, device) for _ in range(2))
    w = random_tensor((n,), torch.bfloat16, device)
    b = None if rms else random_tensor((n,), torch.bfloat16, device)
    fwd_cfg, bwd_cfg = NormConfig(1, 128, 4, "split"), NormConfig(1, 128, 4, "split", programs_per_sm=2)
    runs = []
    for _ in range(2):
        y, rstd = torch.empty_like(x), torch.empty(m, device=device)
        mean = None if rms else torch.empty(m, device=device)
        T.norm_fwd(x, None, w, b, y, None, mean, rstd, eps=1e-6, weight_offset=0.0, rms=rms,
                   h_dtype=torch.bfloat16, config=fwd_cfg)  # fmt: skip
        counters = T._arrival_counters(x.device, m)
        assert int(counters.abs().sum()) == 0, "the split forward left a counter set"
        dh, dw = torch.empty_like(x), torch.empty(n, device=device)
        db = None if rms else torch.empty(n, device=device)
        T.norm_bwd(dy, x, w, mean, rstd, None, dh, dw, db, weight_offset=0.0, rms=rms, config=bwd_cfg)
        assert int(counters.abs().sum()) == 0, "the split backward left a counter set"
        assert T._arrival_counters(x.device, m) is counters, "the counters are made once per stream"
        runs.append([t for t in (y, rstd, mean, dh, dw, db) if t is not None])
    for first, second in zip(*runs):
        assert torch.equal(first, second)


@pytest.mark.parametrize("target", ["new", "x", "residual"])
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_out(device: str, impl: str, rms: bool, target: str) -> None:
    # out= writes y into a given tensor; out=x and out=residual run in place (kernelize runs
    # BERT's post-attention and output norms into the dense layer's fresh output).
    options = Options(rms=rms, bias=not rms, residual=True)
    for shape in shapes(device):
        inputs = options.make(shape, torch.bfloat16, device, grad=False)
        want, _, _ = options.reference(inputs, torch.bfloat16)
        out = {"new": torch.empty(shape, dtype=torch.bfloat16, device=device), "x": inputs["x"],
               "residual": inputs["residual"]}[target]  # fmt: skip
        kw = {"residual": inputs["residual"], "out": out}
        with dispatch.force(impl):
            if rms:
                result = L.rms_norm(inputs["x"], inputs["weight"], 1e-6, **kw)
            else:
                result = L.layer_norm(inputs["x"], inputs["weight"], inputs["bias"], 1e-5, **kw)
        assert result is out
        assert_close(out, want, dtype=torch.bfloat16, msg=f"out={target} {shape}")
