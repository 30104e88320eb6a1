"""The CPU kernel's bfloat16 path (cpu/int4_linear.cpp, OK_BF16_DOT): bfloat16 x of
cpu.bf16_kernel_min_m() rows or more (4) on CPUs with AVX512-BF16, W dequantized to bfloat16 in
blocks and multiplied by vdpbf16ps.

Its results are judged by the error contract with the weight term (reference.linear_error_bound,
weight_rounded_to=bfloat16), which cpu.rounds_weight turns on for exactly the calls it takes; one
test builds a weight whose result is 2^-9 with exact weights and 0 with bfloat16 ones, so that the
path a call takes shows in its bits, and another compiles the library without AVX512-BF16.
"""

from __future__ import annotations

import platform

import pytest
import torch

from openkernels.quant import cpu
from openkernels.shared import cpu_build
from openkernels.shared.platform import triton_interpreting

from .test_cpu_backend import _assert_matches, _linear, _parts, library_without_bf16_path

pytestmark = [
    pytest.mark.skipif(not cpu_build.compiler_available(), reason="no C++ compiler"),
    pytest.mark.skipif(triton_interpreting(), reason="CPU kernels are tested in the main run"),
]

KINDS = [
    pytest.param(("int4", True), id="int4-zeros"),
    pytest.param(("int4", False), id="int4-sym"),
    pytest.param(("nf4", False), id="nf4"),
]
# (N, K, group): odd N; K past one 512-column block and not a multiple of it; a group not a multiple
# of 32 (the byte-by-byte dequantization); one group per row.
SHAPES = [(45, 640, 32), (61, 1088, 64), (25, 1664, 128), (19, 120, 40), (33, 200, 200)]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _path_probe(m: int, dtype: torch.dtype, kind: str, zeros: bool, bias: bool) -> tuple[torch.Tensor, ...]:
    """(x, qweight, scales, zeros, bias) whose every output is exactly 2^-9 with the weight in float32
    and exactly 0 with it rounded to bfloat16: x is 1 at column 0 (group 0) and column 32 (group 1),
    0 elsewhere; W there is 1 + 2^-9 (scale 1 + 2^-9, float16) and -1 (scale 1), 0 at every other
    column. 1 + 2^-9 rounds to 1 in bfloat16; every sum is exact either way."""
    n, k, gs = 25, 96, 32
    scales = torch.ones(k // gs, n, dtype=torch.float16)
    scales[0] = 1 + 2.0**-9
    if kind == "nf4":
        zero_code, one, minus_one = 7, 15, 0  # NF4[7] = 0, NF4[15] = 1, NF4[0] = -1
        z = None
    else:
        zero_code, one, minus_one = 8, 9, 7
        z = torch.full((k // gs, n), 8.0, dtype=torch.float16) if zeros else None
    codes = torch.full((n, k), zero_code, dtype=torch.uint8)
    codes[:, 0], codes[:, 32] = one, minus_one
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    x = torch.zeros(m, k, dtype=dtype)
    x[:, 0] = x[:, 32] = 1
    b = torch.zeros(n) if bias else None  # the kernel adds a zero bias in float32: still exact
    return x, qweight, scales, z, b


@pytest.mark.parametrize("kind_zeros", KINDS)
@pytest.mark.parametrize("m", [4, 7, 16, 33, 128])
def test_bf16_path_matches_reference(kind_zeros, m) -> None:
    kind, zeros = kind_zeros
    for i, (n, k, gs) in enumerate(SHAPES):
        scale_dtype = (torch.float16, torch.bfloat16)[i % 2]
        parts = _parts(n, k, gs, kind, zeros, scale_dtype)
        x = torch.randn(m, k).to(torch.bfloat16)
        bias = torch.randn(n) if (m + i) % 2 else None
        out = _linear(x, *parts, bias, gs, kind)
        _assert_matches(out, x, *parts, bias, gs, kind, msg=f"M={m} N={n} K={k} gs={gs}")


@pytest.mark.parametrize("kind_zeros", KINDS)
def test_bf16_path_strided_x(kind_zeros) -> None:
    """Rows of x a stride apart (an odd number of elements: rows start at any 2-byte boundary)."""
    kind, zeros = kind_zeros
    n, k, gs = 45, 640, 64
    parts = _parts(n, k, gs, kind, zeros)
    for m in (4, 16, 41):
        x = torch.randn(m, k + 13).to(torch.bfloat16)[:, 5 : 5 + k]
        assert x.stride() == (k + 13, 1)
        out = _linear(x, *parts, None, gs, kind)
        _assert_matches(out, x, *parts, None, gs, kind, msg=f"M={m}")


@pytest.mark.parametrize("kind_zeros", KINDS)
def test_bf16_path_is_where_rounds_weight_says(kind_zeros) -> None:
    """Every output is 2^-9 with exact weights, 0 with bfloat16 ones (_path_probe): the bits show
    the path each call took, and it must be the one cpu.rounds_weight names (which the tolerance of
    every other test follows). float32 x never rounds W."""
    kind, zeros = kind_zeros
    first = cpu.bf16_kernel_min_m()
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 33):
            for bias in (False, True):
                x, *parts, b = _path_probe(m, dtype, kind, zeros, bias)
                out = _linear(x, *parts, b, 32, kind)
                rounded = cpu.rounds_weight(m, dtype, bias)
                assert rounded == (dtype == torch.bfloat16 and first is not None and m >= first) or (
                    cpu.dequantizes_then_multiplies(m, dtype, bias)
                )
                want = torch.full_like(out, 0.0 if rounded else 2.0**-9)
                assert torch.equal(out, want), f"{dtype} M={m} bias={bias}: {out.unique().tolist()}"


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 flags")
def test_bf16_path_is_built_where_the_cpu_has_it() -> None:
    """On a CPU with AVX512-BF16 (and BW, VL) the -march=native build has the path, from M = 4;
    M = 1 keeps the GEMV."""
    if not {"avx512_bf16", "avx512bw", "avx512vl"} <= _cpu_flags():
        pytest.skip("no AVX512-BF16 here")
    assert cpu.bf16_kernel_min_m() == 4


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 flags")
def test_without_avx512_bf16(monkeypatch) -> None:
    """A build without AVX512-BF16 (-mno-avx512bf16: an AVX-512 CPU without it, as the AVX2 and
    plain builds of test_cpu_backend.test_portable_decoder) has no such path: bfloat16 x takes the
    float32 kernel with exact weights (or torch's GEMM on panels, where cpu.dequantizes_then_multiplies
    says so), within the contract, and the probe sees exact weights."""
    plain = library_without_bf16_path()
    monkeypatch.setattr(cpu, "_library", plain)
    assert cpu.bf16_kernel_min_m() is None
    for kind, zeros in (("int4", True), ("nf4", False)):
        for m, (n, k, gs) in ((16, SHAPES[1]), (33, SHAPES[3])):
            parts = _parts(n, k, gs, kind, zeros)
            x = torch.randn(m, k).to(torch.bfloat16)
            _assert_matches(
                _linear(x, *parts, None, gs, kind), x, *parts, None, gs, kind, msg=f"{kind} M={m}"
            )
        x, *parts, b = _path_probe(16, torch.bfloat16, kind, zeros, True)
        assert torch.equal(
            _linear(x, *parts, b, 32, kind), torch.full((16, 25), 2.0**-9, dtype=torch.bfloat16)
        )


def test_checker_catches_mistakes_on_the_bf16_path() -> None:
    """With the weight term in the tolerance, the comparison still sees a wrong code, scale, zero or
    group (M = 16, bfloat16 x: the vdpbf16ps path where it is built)."""
    n, k, gs, m = 45, 4096, 128, 16
    qweight, scales, zeros = _parts(n, k, gs, "int4", True)
    scales[7, 3] = 0.05  # the group that goes wrong: a scale that is not near 0 by chance
    x = torch.randn(m, k).to(torch.bfloat16)
    good = _linear(x, qweight, scales, zeros, None, gs, "int4")
    _assert_matches(good, x, qweight, scales, zeros, None, gs, "int4")
    wrong_code = qweight.clone()
    wrong_code[3, 7 * gs // 2] ^= 0x08  # one code of that group, 8 away (error / bound >= 1.7, 200 seeds)
    wrong_scale = scales.clone()
    wrong_scale[7, 3] = 0.04
    wrong_zero = zeros.clone()
    wrong_zero[7, 3] = (wrong_zero[7, 3] + 1) % 16
    shifted = torch.cat([scales[1:], scales[:1]])  # every group reads its neighbour's scales
    mistakes = {
        "code": _linear(x, wrong_code, scales, zeros, None, gs, "int4"),
        "scale": _linear(x, qweight, wrong_scale, zeros, None, gs, "int4"),
        "zero": _linear(x, qweight, scales, wrong_zero, None, gs, "int4"),
        "group": _linear(x, qweight, shifted, zeros, None, gs, "int4"),
    }
    for name, out in mistakes.items():
        with pytest.raises(AssertionError):
            _assert_matches(out, x, qweight, scales, zeros, None, gs, "int4", msg=name)
