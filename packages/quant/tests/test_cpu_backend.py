"""The CPU backend (cpu/int4_linear.cpp), called directly, against reference.py.

Weights are mostly random parts (random bytes, so every one of the 16 codes in both nibbles; zeros
drawn from 0..15; scales of either sign), fresh on every call; one test quantizes real weights.
Each output is compared with the float64 product of x and the dequantized weight, within the
family's error contract, reference.linear_error_bound:

    |ours - ref| <= u |ref| + 4 sqrt(K) 2^-24 sum_k |x_k w_k|   (+ 2^-25 for float16 outputs)

u is the output dtype's unit roundoff (float32 2^-24, bfloat16 2^-8, float16 2^-11): the kernel
rounds its float32 sum once; the second term is the float32 summation, whose order differs from any
other (a random walk, sqrt(K)); the last, float16's subnormal spacing / 2. NaN must match NaN and
infinities must match. Outputs start as NaN, so an element the kernel skips fails.
"""

from __future__ import annotations

import functools
import math
import platform

import pytest
import torch

from openkernels.quant import cpu, reference
from openkernels.quant.quantize import quantize_int4, quantize_nf4
from openkernels.shared import cpu_build
from openkernels.shared.dispatch import DispatchKey
from openkernels.shared.platform import triton_interpreting

DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
]
SCALE_DTYPES = [pytest.param(torch.float16, id="s16"), pytest.param(torch.bfloat16, id="sbf16")]
# (kind for the kernel, has zeros)
KINDS = [
    pytest.param(("int4", True), id="int4-zeros"),
    pytest.param(("int4", False), id="int4-sym"),
    pytest.param(("nf4", False), id="nf4"),
]
# in_features per group size (None: one group per row): multiples of 32, and not (200: a partial block)
SHAPES_K = {32: (96, 4096), 64: (64, 192), 128: (128, 4096), None: (200, 96)}

pytestmark = [
    pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler"),
    pytest.mark.skipif(triton_interpreting(), reason="CPU kernels are tested in the main run"),
]


def _parts(
    n: int, k: int, group_size: int, kind: str, zeros: bool, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random (qweight, scales, zeros) in format.py's layout."""
    groups = k // group_size
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = (torch.randn(groups, n) * 0.03).to(scale_dtype)
    z = torch.randint(0, 16, (groups, n)).to(scale_dtype) if zeros and kind == "int4" else None
    return qweight, scales, z


def _linear(x, qweight, scales, zeros, bias, group_size, kind):
    out = torch.full((x.shape[0], qweight.shape[0]), float("nan"), dtype=x.dtype)
    cpu.int4_linear_fwd(x, qweight, scales, zeros, bias, out, group_size, kind)
    return out


def _assert_matches(out, x, qweight, scales, zeros, bias, group_size, kind, msg=""):
    """out against the float64 reference within the error contract (module docstring)."""
    xd = x.double()
    w = reference.dequantize_int4_ref(qweight, scales, zeros, group_size, kind, torch.float64)
    ref = xd @ w.t()
    if bias is not None:
        ref = ref + bias.double()
    # The dequantize-then-GEMM path rounds W to x's dtype before the products.
    rounded = cpu.rounds_weight(x.shape[0], x.dtype, bias is not None)
    tol = reference.linear_error_bound(xd, w, ref, out.dtype, weight_rounded_to=x.dtype if rounded else None,
                                       abs_sum=_gemv_abs_sum(xd, qweight, scales, zeros, group_size, kind))  # fmt: skip
    if bias is not None:  # the bias joins the float32 sum
        tol = tol + 4 * math.sqrt(max(x.shape[1], 1)) * 2.0**-24 * bias.double().abs()
    if out.dtype == torch.float16:
        tol = tol + 2.0**-25
    got = out.double()
    assert got.shape == ref.shape, msg
    both_nan = torch.isnan(got) & torch.isnan(ref)
    same_inf = torch.isinf(ref) & (got == ref)
    ok = both_nan | same_inf | ((got - ref).abs() <= tol)
    if not ok.all():
        first = tuple(int(i) for i in (~ok).nonzero()[0])
        ratio = ((got - ref).abs() / tol).nan_to_num(float("inf"))[~ok].max()
        raise AssertionError(
            f"{msg}: {int((~ok).sum())} of {ok.numel()} outside tolerance, first at {first}: "
            f"got {got[first].item()}, ref {ref[first].item()}, tol {tol[first].item():.3g}; worst |err| / tol {ratio:.3g}"
        )


def _gemv_abs_sum(xd, qweight, scales, zeros, group_size, kind):
    """What the int4 GEMV (x of at most 6 rows) accumulates in place of sum_k |x_k w_k|: it
    multiplies x by the codes and takes zero * scale * sum(x) off per group, so its float32
    error follows sum_k |x_k| s (|q_k| + |z|) (reference.linear_error_bound's abs_sum; a
    bound without it failed at K = 10, group 2). None on the other paths."""
    if kind != "int4" or xd.shape[0] > 6:
        return None
    k = xd.shape[1]
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).reshape(qweight.shape[0], -1)[:, :k].double()
    s = scales.double().repeat_interleave(group_size, 0)[:k].t()
    z = 8.0 if zeros is None else zeros.double().repeat_interleave(group_size, 0)[:k].t()
    return xd.abs() @ (s.abs() * (q + torch.as_tensor(z).abs())).t()


@functools.cache
def library_without_bf16_path() -> cpu_build.KernelLibrary:
    """The kernel library built without AVX512-BF16 (x86: where the default build has it)."""
    return cpu_build.KernelLibrary(
        cpu._SOURCE,
        name="openkernels_quant_nobf16",
        signatures=cpu._SIGNATURES,
        extra_flags=("-mno-avx512bf16",),
    )


def _bias(n: int, i: int) -> torch.Tensor | None:
    """No bias, or one in a rotating dtype (the backend converts any float dtype)."""
    dtypes = (None, torch.float32, torch.bfloat16, torch.float64)
    dtype = dtypes[i % len(dtypes)]
    return None if dtype is None else torch.randn(n).to(dtype)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("kind_zeros", KINDS)
def test_linear_matches_reference(kind_zeros, group_size, m, dtype, scale_dtype) -> None:
    kind, zeros = kind_zeros
    i = 0
    for k in SHAPES_K[group_size]:
        gs = k if group_size is None else group_size
        for n in (1, 45, 130):
            parts = _parts(n, k, gs, kind, zeros, scale_dtype)
            x = torch.randn(m, k).to(dtype)
            bias = _bias(n, i)
            i += 1
            out = _linear(x, *parts, bias, gs, kind)
            _assert_matches(out, x, *parts, bias, gs, kind, msg=f"N={n} K={k} gs={gs}")


@pytest.mark.parametrize("kind_zeros", KINDS)
@pytest.mark.parametrize("fast_gemm", [True, False], ids=["bf16-gemm", "no-bf16-gemm"])
def test_dequantize_then_multiply_path(monkeypatch, kind_zeros, fast_gemm) -> None:
    """bfloat16 x of DEQUANTIZE_MATMUL_MIN_M rows or more, without a bias, goes to the
    dequantize-then-GEMM path where the CPU's bf16 GEMM is fast (forced here either way) and the
    library has no vdpbf16ps path (taken away here; test_cpu_bf16 tests that path): W in panels
    (32 rows here, so 130 rows take five, the last one partial), each column range of the
    output written once; with a bias, fewer rows or no fast GEMM, the kernel."""
    kind, zeros = kind_zeros
    monkeypatch.setattr(cpu, "_fast_bf16_gemm", lambda: fast_gemm)
    monkeypatch.setattr(cpu, "_amx_tiles", lambda: False)
    if cpu.bf16_kernel_min_m() is not None:  # the kernel's own path runs instead
        assert not cpu.dequantizes_then_multiplies(cpu.DEQUANTIZE_MATMUL_MIN_M, torch.bfloat16, False)
        monkeypatch.setattr(cpu, "_library", library_without_bf16_path())
    assert cpu.bf16_kernel_min_m() is None
    monkeypatch.setattr(cpu, "PANEL_ROWS", 32)
    n, k, gs = 130, 256, 64
    m = cpu.DEQUANTIZE_MATMUL_MIN_M
    parts = _parts(n, k, gs, kind, zeros)
    for rows, bias in ((m, None), (m + 5, None), (m, torch.randn(n)), (m - 1, None)):
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert cpu.dequantizes_then_multiplies(rows, x.dtype, bias is not None) == (
            fast_gemm and bias is None and rows >= m
        )
        _assert_matches(_linear(x, *parts, bias, gs, kind), x, *parts, bias, gs, kind, msg=f"M={rows}")
    assert not cpu.dequantizes_then_multiplies(m, torch.float32, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind_zeros", KINDS)
def test_row_counts_across_schedules(kind_zeros, dtype) -> None:
    """M around the switch from decoding in registers (M <= 6) to the dequantized-block kernel, and
    around its 8- and 16-row tiles."""
    kind, zeros = kind_zeros
    n, k, gs = 77, 320, 64
    for m in (1, 2, 4, 5, 6, 7, 8, 9, 15, 16, 24, 31):
        parts = _parts(n, k, gs, kind, zeros)
        x = torch.randn(m, k).to(dtype)
        bias = _bias(n, m)
        _assert_matches(_linear(x, *parts, bias, gs, kind), x, *parts, bias, gs, kind, msg=f"M={m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_noncontiguous_x(m, dtype) -> None:
    """x a column slice of a wider buffer: row stride K + 13, unit column stride."""
    n, k, gs = 45, 256, 32
    for kind, zeros in (("int4", True), ("nf4", False)):
        parts = _parts(n, k, gs, kind, zeros)
        x = torch.randn(m, k + 13).to(dtype)[:, 5 : 5 + k]
        assert x.stride() == (k + 13, 1)
        out = _linear(x, *parts, None, gs, kind)
        _assert_matches(out, x, *parts, None, gs, kind, msg=kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows(dtype) -> None:
    """More rows than one staging pass (256), and few blocks of W rows (rows of x split too)."""
    for n, k, gs in ((5, 128, 32), (130, 256, 128)):
        m = 300
        for kind, zeros in (("int4", True), ("nf4", False)):
            parts = _parts(n, k, gs, kind, zeros)
            x = torch.randn(m, k).to(dtype)
            bias = torch.randn(n)
            _assert_matches(_linear(x, *parts, bias, gs, kind), x, *parts, bias, gs, kind, msg=f"N={n}")


@pytest.mark.parametrize("kind_zeros", KINDS)
def test_group_sizes_not_multiples_of_32(kind_zeros) -> None:
    """Any even group size that divides K: the partial 32-column block of each group is padded."""
    kind, zeros = kind_zeros
    for k, gs in ((10, 2), (60, 6), (120, 40), (200, 200), (136, 68)):
        for m in (1, 4, 9):
            parts = _parts(19, k, gs, kind, zeros)
            x = torch.randn(m, k)
            _assert_matches(
                _linear(x, *parts, None, gs, kind), x, *parts, None, gs, kind, msg=f"K={k} gs={gs}"
            )


@pytest.mark.parametrize("kind", ["int4", "int4-sym", "nf4"])
def test_quantized_weights(kind) -> None:
    """End to end from a float weight through quantize.py."""
    for gs, m in ((64, 1), (None, 33)):
        w = torch.randn(96, 256)
        if kind == "nf4":
            q = quantize_nf4(w, gs)
        else:
            q = quantize_int4(w, gs, symmetric=kind == "int4-sym", scale_dtype=torch.bfloat16)
        x = torch.randn(m, 256).to(torch.bfloat16)
        parts = (q.qweight, q.scales, q.zeros)
        out = _linear(x, *parts, None, q.group_size, q.kind)
        _assert_matches(out, x, *parts, None, q.group_size, q.kind, msg=f"gs={gs}")


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind_zeros", KINDS)
def test_dequantize_is_exact(kind_zeros, dtype, scale_dtype) -> None:
    """(code - zero) * scale or NF4[code] * scale in float32, rounded once: bit for bit the reference."""
    kind, zeros = kind_zeros
    for n, k, gs in ((1, 64, 32), (45, 4096, 128), (130, 200, 200), (7, 60, 6)):
        parts = _parts(n, k, gs, kind, zeros, scale_dtype)
        out = torch.full((n, k), float("nan"), dtype=dtype)
        cpu.dequantize_int4_fwd(*parts, out, gs, kind)
        expected = reference.dequantize_int4_ref(*parts, gs, kind, dtype)
        assert torch.equal(out, expected), f"N={n} K={k} gs={gs}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("kind_zeros", KINDS)
def test_nan_propagates(kind_zeros, m, dtype) -> None:
    """A NaN in a row of x makes that row's outputs NaN; a NaN scale, its column's; the rest match."""
    kind, zeros = kind_zeros
    n, k, gs = 45, 256, 64
    qweight, scales, z = _parts(n, k, gs, kind, zeros)
    x = torch.randn(m, k).to(dtype)
    x[m - 1, 77] = float("nan")
    scales[2, 10] = float("nan")
    out = _linear(x, qweight, scales, z, None, gs, kind)
    assert torch.isnan(out[m - 1]).all() and torch.isnan(out[:, 10]).all()
    assert int(torch.isnan(out).sum()) == n + m - 1
    _assert_matches(out, x, qweight, scales, z, None, gs, kind)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("kind_zeros", KINDS)
def test_infinity_as_the_reference(kind_zeros, m) -> None:
    """An infinite x gives its row +-inf, or NaN where its weight is 0, exactly as the reference."""
    kind, zeros = kind_zeros
    parts = _parts(30, 128, 32, kind, zeros)
    x = torch.randn(m, 128)
    x[0, 5] = float("inf")
    out = _linear(x, *parts, None, 32, kind)
    assert not torch.isfinite(out[0]).any() and torch.isfinite(out[1:]).all()
    _assert_matches(out, x, *parts, None, 32, kind)


@pytest.mark.parametrize("m", [1, 17])
def test_results_do_not_depend_on_threads(m) -> None:
    """Work split between 2 threads gives the same bits as 1 (each output sums in a fixed order)."""
    previous = torch.get_num_threads()
    for kind, zeros in (("int4", True), ("nf4", False)):
        parts = _parts(130, 4096, 128, kind, zeros)
        x = torch.randn(m, 4096).to(torch.bfloat16)
        outs = []
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                outs.append(_linear(x, *parts, None, 128, kind))
        finally:
            torch.set_num_threads(previous)
        assert torch.equal(outs[0], outs[1]), kind


def test_empty_and_zero_width() -> None:
    qweight, scales, zeros = _parts(6, 64, 32, "int4", True)
    out = torch.empty(0, 6)
    cpu.int4_linear_fwd(torch.empty(0, 64), qweight, scales, zeros, None, out, 32, "int4")
    # K = 0: the sum is empty, the output is the bias
    bias = torch.randn(6)
    empty_q, empty_s = torch.empty(6, 0, dtype=torch.uint8), torch.empty(0, 6, dtype=torch.float16)
    out = _linear(torch.empty(3, 0), empty_q, empty_s, None, bias, 32, "int4")
    assert torch.equal(out, bias.expand(3, 6))


def _bad_calls():
    q, s, z = _parts(8, 64, 32, "int4", True)
    x, out = torch.randn(2, 64), torch.empty(2, 8)

    def lin(x=x, q=q, s=s, z=z, bias=None, out=out, gs=32, kind="int4"):
        return lambda: cpu.int4_linear_fwd(x, q, s, z, bias, out, gs, kind)

    def deq(q=q, s=s, z=z, out=None, gs=32, kind="int4"):
        out = torch.empty(8, 64) if out is None else out
        return lambda: cpu.dequantize_int4_fwd(q, s, z, out, gs, kind)

    return {
        "kind": lin(kind="int8"),
        "qweight dtype": lin(q=q.to(torch.int32)),
        "qweight 1D": lin(q=q.flatten()),
        "qweight column stride": lin(q=torch.randint(0, 255, (32, 8), dtype=torch.uint8).t()),
        "odd group size": lin(gs=3),
        "group size does not divide K": lin(gs=48),
        "group size not an int": lin(gs=32.0),
        "scales dtype": lin(s=s.float()),
        "scales shape": lin(s=s[:1]),
        "zeros dtype": lin(z=z.to(torch.bfloat16)),
        "zeros shape": lin(z=z[:, :4]),
        "nf4 with zeros": lin(kind="nf4"),
        "x float64": lin(x=x.double(), out=out.double()),
        "x width": lin(x=torch.randn(2, 32)),
        "x column stride": lin(x=torch.randn(64, 2).t()),
        "x 1D": lin(x=torch.randn(64)),
        "out dtype": lin(out=torch.empty(2, 8, dtype=torch.bfloat16)),
        "out shape": lin(out=torch.empty(2, 9)),
        "out not contiguous": lin(out=torch.empty(8, 2).t()),
        "bias shape": lin(bias=torch.randn(9)),
        "bias integer": lin(bias=torch.ones(8, dtype=torch.int64)),
        "dequantize out float64": deq(out=torch.empty(8, 64, dtype=torch.float64)),
        "dequantize out shape": deq(out=torch.empty(8, 32)),
        "dequantize kind": deq(kind="fp4"),
    }


@pytest.mark.parametrize("m", [1, 17])
def test_any_float_zeros_as_the_reference(m) -> None:
    """Zeros outside format.py's integers 0..15 (a GPTQ v1 zero of 16, fractions, negatives, NaN) are
    used as the reference uses them: the dequantization matches bit for bit, the product within bound."""
    n, k, gs = 24, 128, 32
    qweight, scales, _ = _parts(n, k, gs, "int4", False)
    zeros = torch.randint(0, 17, (k // gs, n)).half()
    zeros[0, :4] = torch.tensor([16.0, 7.5, -1.0, 100.25])
    zeros[1, 5] = float("nan")
    x = torch.randn(m, k)
    out = _linear(x, qweight, scales, zeros, None, gs, "int4")
    assert torch.isnan(out[:, 5]).all() and not torch.isnan(out[:, :5]).any()
    _assert_matches(out, x, qweight, scales, zeros, None, gs, "int4")
    w = torch.empty(n, k)
    cpu.dequantize_int4_fwd(qweight, scales, zeros, w, gs, "int4")
    expected = reference.dequantize_int4_ref(qweight, scales, zeros, gs)
    assert torch.equal(w.nan_to_num(7.0), expected.nan_to_num(7.0))


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_raise(case) -> None:
    with pytest.raises(ValueError):
        _bad_calls()[case]()


def test_supports() -> None:
    assert "reference" in cpu.supports(DispatchKey("cpu", platform.machine(), torch.float64))
    assert cpu.supports(DispatchKey("cpu", platform.machine(), torch.int8)) is not None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu.supports(DispatchKey("cpu", platform.machine(), dtype)) is None


def test_checker_catches_layout_mistakes() -> None:
    """The comparison is tight enough to see a swapped nibble order, a zero off by one in a single
    group, or a missing bias, even in bfloat16."""
    n, k, gs, m = 45, 4096, 128, 17
    qweight, scales, zeros = _parts(n, k, gs, "int4", True)
    scales[7, 3] = 0.05  # the group whose zero goes wrong: a scale that is not near 0 by chance
    x = torch.randn(m, k).to(torch.bfloat16)
    bias = torch.randn(n)
    good = _linear(x, qweight, scales, zeros, bias, gs, "int4")
    _assert_matches(good, x, qweight, scales, zeros, bias, gs, "int4")
    swapped = (qweight >> 4) | (qweight << 4)
    wrong_zero = zeros.clone()
    wrong_zero[7, 3] = (wrong_zero[7, 3] + 1) % 16
    mistakes = {
        "nibble order": _linear(x, swapped, scales, zeros, bias, gs, "int4"),
        "zero": _linear(x, qweight, scales, wrong_zero, bias, gs, "int4"),
        "bias": _linear(x, qweight, scales, zeros, None, gs, "int4"),
    }
    for name, out in mistakes.items():
        with pytest.raises(AssertionError):
            _assert_matches(out, x, qweight, scales, zeros, bias, gs, "int4", msg=name)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 flags")
def test_portable_decoder(monkeypatch) -> None:
    """The plain-C++ decoder (what aarch64 and pre-AVX2 x86 compile) gives the same results."""
    portable = cpu_build.KernelLibrary(
        cpu._SOURCE, name="openkernels_quant_portable", signatures=cpu._SIGNATURES, extra_flags=("-mno-avx2",)
    )
    monkeypatch.setattr(cpu, "_library", portable)
    for kind, zeros in (("int4", True), ("int4", False), ("nf4", False)):
        for m, k, gs in ((1, 200, 200), (3, 256, 64), (17, 96, 32)):
            parts = _parts(45, k, gs, kind, zeros)
            x = torch.randn(m, k).to(torch.bfloat16)
            _assert_matches(
                _linear(x, *parts, None, gs, kind), x, *parts, None, gs, kind, msg=f"{kind} M={m}"
            )
            out = torch.empty(45, k)
            cpu.dequantize_int4_fwd(*parts, out, gs, kind)
            assert torch.equal(out, reference.dequantize_int4_ref(*parts, gs, kind))
