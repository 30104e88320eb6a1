"""The normed projection (fused.py): int4_linear of x's RMSNorm on a pre-norm decoder's
un-normed hidden state. The tensor-core GEMV's normed builds (int4_tc.cu, NORM) on the CPU
emulation and, on an sm_90 GPU, at the decode shapes; the composed path and the reference;
Int4Linear.forward_normed's rules and its op under torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openkernels.quant import Int4Linear, ops
from openkernels.quant import cuda as G
from openkernels.quant import reference as R
from openkernels.quant.format import tile_codes
from openkernels.quant.fused import rms_normed
from openkernels.shared.platform import triton_interpreting

from .cases import FORMATS, make_weight, quantize

_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_INT4 = [(k, s) for k, s in FORMATS if k == "int4"]  # NF4 has no normed build (it composes)


def _sm90() -> bool:
    return torch.cuda.is_available() and G._arch(torch.device("cuda")).startswith("sm_90")


def _assert_normed_close(fused, unfused, normed, weight, msg: str) -> None:
    """fused (the GEMV normed in its x loads) against unfused (the same GEMV on rms_normed's
    output): each normed value may round to a neighbouring 16-bit value (the GPU's rsqrt and
    sum order against torch's), so |fused - unfused| <= 2 u (|normed| @ |W|^T) + 2 u |unfused|;
    NaN never passes."""
    assert not torch.isnan(fused).any(), f"{msg}: NaN in the output"
    w = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.kind,
                              torch.float64).to(fused.device)  # fmt: skip
    u = _UNIT[normed.dtype]
    bound = 2 * u * (normed.double().abs() @ w.abs().t()) + 2 * u * unfused.double().abs() + 1e-6
    excess = (fused.double() - unfused.double()).abs() - bound
    assert not (excess > 0).any(), (
        f"{msg}: {int((excess > 0).sum())} outputs out of bound, worst {excess.max():.3g}"
    )


# (config, M, N, K): the register builds at each tile count, 1-8 rows.
_EMULATED = [
    ("tc-t1-u2", 1, 32, 256),
    ("tc-t2-u2", 5, 64, 384),
    ("tc-t4-u1", 8, 128, 2048),
    ("tc-t1-u2", 3, 16, 128),
]


@pytest.mark.parametrize("kind,symmetric", _INT4, ids=[f"{k}{'-sym' if s else ''}" for k, s in _INT4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_emulated_normed_builds_match_the_gemv_on_the_norm(kind, symmetric, dtype) -> None:
    """Every normed build on the CPU emulation (1-8 rows whose scales differ by 100x, stored
    rows and tiled codes, Llama's offset 0 and Gemma's 1, with and without a bias): within a
    rounding of each normed value of the same config's GEMV on rms_normed's output, two runs
    bitwise equal. A build that skipped the weight, the offset or a row's own rstd fails."""
    if triton_interpreting():
        pytest.skip("the CUDA emulation, once, outside the interpreter")
    g = torch.Generator().manual_seed(5)
    for i, (config, m, n, k) in enumerate(_EMULATED):
        weight = quantize(make_weight(n, k, heavy=True, generator=g), kind, symmetric, 128)
        sdtype = (torch.bfloat16, torch.float16)[i % 2]
        zeros = None if weight.zeros is None else weight.zeros.to(sdtype)
        weight = type(weight)(weight.qweight, weight.scales.to(sdtype), zeros, 128, kind)
        x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]).to(dtype)
        norm_weight = (0.5 + torch.rand(k, generator=g)).to(dtype)
        offset = float(i % 2)
        bias = torch.randn(n, generator=g).to(dtype) if i % 2 else None
        codes = tile_codes(weight.qweight) if i == 1 else weight.qweight
        parts = (codes, weight.scales, weight.zeros, bias)
        runs = []
        for _ in range(2):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            assert G.normed_config(x, norm_weight, *parts, out, 128, kind, config) == config
            G.int4_linear_normed_fwd(x, norm_weight, 1e-5, offset, *parts, out, 128, kind, config=config)
            runs.append(out)
        assert torch.equal(runs[0], runs[1]), "two runs differ"
        normed = rms_normed(x, norm_weight, 1e-5, offset)
        unfused = torch.empty(m, n, dtype=dtype)
        G.int4_linear_fwd(normed, *parts, unfused, 128, kind, config=config)
        _assert_normed_close(
            runs[0], unfused, normed, weight, f"{config} {kind} sym={symmetric} {dtype} m={m}"
        )


def test_normed_config_takes_only_what_its_builds_run() -> None:
    """normed_config names a config only for up to 8 rows on a tensor-core build with K unsplit,
    no dependent launch or x split, int4, a norm weight of x's dtype and K, aligned; the rest
    composes (the reference's result within the norm's rounding)."""
    g = torch.Generator().manual_seed(3)
    weight = quantize(make_weight(32, 256, generator=g), "int4", False, 128)
    weight = type(weight)(
        weight.qweight, weight.scales.to(torch.bfloat16), weight.zeros.to(torch.bfloat16), 128
    )
    parts = (weight.qweight, weight.scales, weight.zeros, None)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    nw = torch.ones(256, dtype=torch.bfloat16)
    assert G.normed_config(x, nw, *parts, out, 128, "int4", "tc-t1-u2") == "tc-t1-u2"
    assert G.normed_config(x, nw, *parts, out, 128, "int4") is None  # CPU, unnamed
    assert G.normed_config(x, nw, *parts, out, 128, "nf4", "tc-t1-u2") is None
    assert G.normed_config(x, nw, *parts, out, 128, "int4", "tc-t1-u2-k2") is None
    assert G.normed_config(x, nw, *parts, out, 128, "int4", "tc-t1-u2-p") is None
    assert G.normed_config(x, nw.float(), *parts, out, 128, "int4", "tc-t1-u2") is None
    assert (
        G.normed_config(x, torch.ones(257, dtype=torch.bfloat16)[1:], *parts, out, 128, "int4", "tc-t1-u2")
        is None
    )
    wide = quantize(make_weight(16, 16384, generator=g), "int4", False, 128)
    wide_x = torch.randn(1, 16384, generator=g).to(torch.bfloat16)
    wide_parts = (wide.qweight, wide.scales.to(torch.bfloat16), None, None)
    wide_out = torch.empty(1, 16, dtype=torch.bfloat16)
    wide_w = torch.ones(16384, dtype=torch.bfloat16)
    assert (
        G.normed_config(wide_x, wide_w, *wide_parts, wide_out, 128, "int4", "tc-t1-u2") is None
    )  # K past 8192
    nine = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    got = torch.empty(9, 32, dtype=torch.bfloat16)
    assert G.normed_config(nine, nw, *parts, got, 128, "int4", "tc-t1-u2") is None
    G.int4_linear_normed_fwd(nine, nw, 1e-6, 0.0, *parts, got, 128, "int4", config="tc-t1-u2")
    ref = torch.empty_like(got)
    R.int4_linear_normed_fwd(nine, nw, 1e-6, 0.0, *parts, ref, 128, "int4")
    _assert_normed_close(got, ref, rms_normed(nine, nw, 1e-6), weight, "composed")


def test_forward_normed_is_forward_of_the_norm() -> None:
    """Int4Linear.forward_normed on the CPU (composed): bit for bit forward(rms_normed(x)) at any
    leading shape, with Gemma's offset too; a float32 norm weight on bf16 x and gradients take
    the same composition; bad input raises before any kernel runs."""
    if triton_interpreting():
        pytest.skip("module plumbing, once, outside the interpreter")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer = Int4Linear.from_linear(nn.Linear(256, 96, bias=True).to(dtype))
    nw = (0.5 + torch.rand(256)).to(dtype)
    with torch.no_grad():
        for shape in ((1, 1, 256), (1, 256), (3, 256), (2, 4, 256)):
            x = torch.randn(shape, dtype=dtype) * 4
            for offset in (0.0, 1.0):
                want = layer(rms_normed(x, nw, 1e-6, offset))
                assert torch.equal(layer.forward_normed(x, nw, 1e-6, offset), want)
            assert torch.equal(
                layer.forward_normed(x, nw.float(), 1e-6), layer(rms_normed(x, nw.float(), 1e-6))
            )
    x = torch.randn(2, 256, dtype=dtype, requires_grad=True)
    layer.forward_normed(x, nw, 1e-6).float().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    layer(rms_normed(x2, nw, 1e-6)).float().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, x2.grad)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        layer.forward_normed(torch.randn(1, 256, dtype=dtype), torch.ones(128, dtype=dtype), 1e-6)
    with pytest.raises(ValueError):
        layer.forward_normed(torch.randn(1, 128, dtype=dtype), torch.ones(256, dtype=dtype), 1e-6)
    assert not layer.normed_fuses(torch.randn(1, 256, dtype=dtype), nw)  # CPU: the norm goes first


def test_normed_op_under_torch_compile() -> None:
    """openkernels::int4_linear_rmsnorm traces whole (fullgraph) and gives the eager bits."""
    if triton_interpreting():
        pytest.skip("compile, once, outside the interpreter")
    torch.manual_seed(1)
    layer = Int4Linear.from_linear(nn.Linear(256, 64, bias=False).to(torch.bfloat16))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    nw = torch.rand(256, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer.forward_normed(x, nw, 1e-5)
        compiled = torch.compile(
            lambda a: layer.forward_normed(a, nw, 1e-5), fullgraph=True, backend="aot_eager"
        )
        assert torch.equal(compiled(x), want)
    assert "int4_linear_rmsnorm" in ops.FUSED_OPS


_GPU_SHAPES = [(1, 3072, 2048), (1, 16384, 2048), (4, 2048, 2048), (8, 6144, 4096), (1, 28672, 8192)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the normed builds run on sm_90 (the tensor-core GEMV's default)")
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_normed_gemv_on_the_gpu_at_decode_shapes(tiled) -> None:
    """On an sm_90 GPU, normed_config's choice at the 1B model's q/k/v and gate/up shapes and
    wider ones, bf16 and fp16: within the norm's rounding of the unfused GEMV on rms_normed's
    output, bitwise on a second run."""
    g, cpu = torch.Generator(device="cuda").manual_seed(13), torch.Generator().manual_seed(13)
    for m, n, k in _GPU_SHAPES:
        base = quantize(make_weight(n, k, heavy=True, generator=cpu, device="cuda"), "int4", False, 128)
        for dtype in (torch.bfloat16, torch.float16):
            weight = type(base)(base.qweight, base.scales.to(dtype), base.zeros.to(dtype), 128, "int4")
            codes = tile_codes(weight.qweight) if tiled else weight.qweight
            x = (torch.randn(m, k, generator=g, device="cuda") * 5).to(dtype)
            nw = (0.5 + torch.rand(k, generator=g, device="cuda")).to(dtype)
            parts = (codes, weight.scales, weight.zeros, None)
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            config = G.normed_config(x, nw, *parts, out, 128, "int4")
            assert config is not None, (m, n, k)
            G.int4_linear_normed_fwd(x, nw, 1e-5, 0.0, *parts, out, 128, "int4")
            again = torch.empty_like(out)
            G.int4_linear_normed_fwd(x, nw, 1e-5, 0.0, *parts, again, 128, "int4")
            assert torch.equal(out, again)
            normed = rms_normed(x, nw, 1e-5)
            unfused = torch.empty_like(out)
            G.int4_linear_fwd(normed, *parts, unfused, 128, "int4", config=config)
            _assert_normed_close(out, unfused, normed, weight, f"{config} {dtype} m={m} {n}x{k}")
    assert not G._broken, G._broken
