"""The gated down projection (fused.py): int4_linear of act(gate) * up on a gated MLP's stacked
gate / up output. The tensor-core GEMV's gated builds (int4_tc.cu, GATED) on the CPU
emulation and, on an sm_90 GPU, at the decode shapes; the composed path and the reference on
every device; Int4Linear.forward_gated's rules (addend, gradients, bad input) and its op under
torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from openkernels.quant import Int4Linear, ops
from openkernels.quant import cuda as G
from openkernels.quant import reference as R
from openkernels.quant.format import tile_codes
from openkernels.quant.fused import ACTS, gated_product
from openkernels.shared.platform import triton_interpreting

from .cases import FORMATS, make_weight, quantize

_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _sm90() -> bool:
    return torch.cuda.is_available() and G._arch(torch.device("cuda")).startswith("sm_90")


def _assert_gated_close(fused, unfused, h, weight, msg: str) -> None:
    """fused (the GEMV on act(gate) * up computed in its x loads) against unfused (the same
    GEMV on gated_product's h): each product value may round to a neighbouring 16-bit value
    (the GPU's exp against torch's), so |fused - unfused| <= u (|h| @ |W|^T) + 2 u |unfused|;
    NaN never passes."""
    assert not torch.isnan(fused).any(), f"{msg}: NaN in the output"
    w = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, weight.group_size, weight.kind,
                              torch.float64).to(fused.device)  # fmt: skip
    u = _UNIT[h.dtype]
    bound = u * (h.double().abs() @ w.abs().t()) + 2 * u * unfused.double().abs() + 1e-6
    excess = (fused.double() - unfused.double()).abs() - bound
    assert not (excess > 0).any(), (
        f"{msg}: {int((excess > 0).sum())} outputs out of bound, worst {excess.max():.3g}"
    )


def _weight(kind: str, symmetric: bool, n: int, k: int, sdtype, g, device="cpu"):
    weight = quantize(make_weight(n, k, heavy=True, generator=g), kind, symmetric, 128)
    return type(weight)(weight.qweight, weight.scales.to(sdtype), None if weight.zeros is None else
                        weight.zeros.to(sdtype), weight.group_size, weight.kind).to(device)  # fmt: skip


# (config, M, N, K): the register builds at each tile count, the split builds at 2 and 4 ranks.
_EMULATED = [
    ("tc-t1-u2", 1, 32, 256),
    ("tc-t2-u2", 5, 64, 384),
    ("tc-t4-u1", 8, 128, 256),
    ("tc-t1-u2-k2", 1, 32, 512),
    ("tc-t2-u2-k4", 3, 64, 1024),
]


_INT4 = [(k, s) for k, s in FORMATS if k == "int4"]  # NF4 has no gated build (it composes)


@pytest.mark.parametrize("kind,symmetric", _INT4, ids=[f"{k}{'-sym' if s else ''}" for k, s in _INT4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_emulated_gated_builds_match_the_gemv_on_the_product(kind, symmetric, dtype) -> None:
    """Every gated build (register and K-split, 1-8 rows, each activation, stored rows and tiled
    codes, with and without a bias) on the CPU emulation: within a rounding of each product
    value of the same config's GEMV on gated_product's h, two runs bitwise equal. Gate and up
    differ in scale, so a build that swapped them or skipped the activation fails."""
    if triton_interpreting():
        pytest.skip("the CUDA emulation, once, outside the interpreter")
    g = torch.Generator().manual_seed(7)
    for i, (config, m, n, k) in enumerate(_EMULATED):
        for act in ACTS:
            sdtype = (torch.bfloat16, torch.float16)[i % 2]
            weight = _weight(kind, symmetric, n, k, sdtype, g)
            gate_up = torch.cat([3 * torch.randn(m, k, generator=g), 0.5 + torch.randn(m, k, generator=g)], 1)
            gate_up = gate_up.to(dtype)
            bias = torch.randn(n, generator=g).to(dtype) if i % 2 else None
            codes = tile_codes(weight.qweight) if i in (1, 3) else weight.qweight
            parts = (codes, weight.scales, weight.zeros, bias)
            runs = []
            for _ in range(2):
                out = torch.full((m, n), float("nan"), dtype=dtype)
                assert G.gated_config(gate_up, *parts, out, 128, kind, act, config) == config
                G.int4_linear_gated_fwd(gate_up, *parts, out, 128, kind, act, config=config)
                runs.append(out)
            assert torch.equal(runs[0], runs[1]), "two runs differ"
            h = gated_product(gate_up, act)
            unfused = torch.empty(m, n, dtype=dtype)
            G.int4_linear_fwd(h, *parts, unfused, 128, kind, config=config)
            _assert_gated_close(
                runs[0], unfused, h, weight, f"{config} {act} {kind} sym={symmetric} {dtype} m={m}"
            )


def test_gated_config_takes_only_what_its_builds_run() -> None:
    """gated_config names a config only for up to 8 rows on a tensor-core build without a
    dependent launch or x split, int4, a known activation and an even, unit-stride gate_up; the
    CPU runs it only where a test names the config; the rest composes."""
    g = torch.Generator().manual_seed(3)
    weight = _weight("int4", False, 32, 256, torch.bfloat16, g)
    parts = (weight.qweight, weight.scales, weight.zeros, None)
    out = torch.empty(1, 32, dtype=torch.bfloat16)
    gate_up = torch.randn(1, 512, generator=g).to(torch.bfloat16)
    assert G.gated_config(gate_up, *parts, out, 128, "int4", "silu", "tc-t1-u2") == "tc-t1-u2"
    assert G.gated_config(gate_up, *parts, out, 128, "int4", "silu") is None  # CPU, unnamed
    assert G.gated_config(gate_up, *parts, out, 128, "int4", "relu", "tc-t1-u2") is None
    assert G.gated_config(gate_up, *parts, out, 128, "nf4", "silu", "tc-t1-u2") is None
    assert G.gated_config(gate_up, *parts, out, 128, "int4", "silu", "tc-t1-u2-p") is None
    assert G.gated_config(gate_up, *parts, out, 128, "int4", "silu", "mma") is None
    big = quantize(make_weight(16, 8192, generator=g), "int4", False, 128)
    big_parts = (big.qweight, big.scales.to(torch.bfloat16), None, None)
    eight = torch.randn(8, 2 * 8192, generator=g).to(torch.bfloat16)  # 8 x 8192 x 2 bytes: past 64 KB
    big_out = torch.empty(8, 16, dtype=torch.bfloat16)
    assert G.gated_config(eight, *big_parts, big_out, 128, "int4", "silu", "tc-t1-u2") is None
    assert G.gated_config(eight, *big_parts, big_out, 128, "int4", "silu", "tc-t1-u2-k2") == "tc-t1-u2-k2"
    nine = torch.randn(9, 512, generator=g).to(torch.bfloat16)
    assert G.gated_config(nine, *parts, torch.empty(9, 32, dtype=torch.bfloat16), 128, "int4", "silu",
                          "tc-t1-u2") is None  # fmt: skip
    assert G.gated_config(gate_up[:, :511], *parts, out, 128, "int4", "silu", "tc-t1-u2") is None
    wide = torch.randn(1, 1024, generator=g).to(torch.bfloat16)[:, ::2]
    assert G.gated_config(wide, *parts, out, 128, "int4", "silu", "tc-t1-u2") is None
    # composed where no build takes it: the same as the reference within the product's rounding
    G.int4_linear_gated_fwd(
        nine, *parts, got := torch.empty(9, 32, dtype=torch.bfloat16), 128, "int4", "silu"
    )
    ref = torch.empty_like(got)
    R.int4_linear_gated_fwd(nine, *parts, ref, 128, "int4", "silu")
    _assert_gated_close(got, ref, gated_product(nine, "silu"), weight, "composed")


@pytest.mark.parametrize("act", ACTS)
def test_forward_gated_is_forward_of_the_product(act) -> None:
    """Int4Linear.forward_gated(gu, act) on the CPU (composed): bit for bit forward(h) with h =
    gated_product(gu, act) at any leading shape, forward_add(h, r) with an addend (folded as
    the kernel's bias at one row); gradients flow through the composed path; bad input raises
    before any kernel runs."""
    if triton_interpreting():
        pytest.skip("module plumbing, once, outside the interpreter")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer = Int4Linear.from_linear(nn.Linear(256, 96, bias=False).to(dtype))
    with torch.no_grad():
        for shape in ((1, 1, 512), (1, 512), (3, 512), (2, 4, 512)):
            gu = torch.randn(shape, dtype=dtype)
            h = gated_product(gu, act)
            assert torch.equal(layer.forward_gated(gu, act), layer(h))
            r = torch.randn(*shape[:-1], 96, dtype=dtype)
            assert torch.equal(layer.forward_gated(gu, act, r), layer.forward_add(h, r))
    gu = torch.randn(2, 512, dtype=dtype, requires_grad=True)
    layer.forward_gated(gu, act).float().sum().backward()
    gu2 = gu.detach().clone().requires_grad_()
    layer(gated_product(gu2, act)).float().sum().backward()
    assert gu.grad is not None and torch.equal(gu.grad, gu2.grad)
    with pytest.raises(ValueError, match="act 'relu'"):
        layer.forward_gated(torch.randn(1, 512, dtype=dtype), "relu")
    with pytest.raises(ValueError, match="2 x in_features"):
        layer.forward_gated(torch.randn(1, 256, dtype=dtype), act)
    assert not layer.gated_fuses(torch.randn(1, 512, dtype=dtype), act)  # CPU: the activation goes first


def test_gated_op_under_torch_compile() -> None:
    """openkernels::int4_linear_gated traces whole (fullgraph) and gives the eager bits."""
    if triton_interpreting():
        pytest.skip("compile, once, outside the interpreter")
    torch.manual_seed(1)
    layer = Int4Linear.from_linear(nn.Linear(256, 64, bias=False).to(torch.bfloat16))
    gu = torch.randn(1, 512, dtype=torch.bfloat16)
    r = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer.forward_gated(gu, "silu", r)
        compiled = torch.compile(
            lambda a, b: layer.forward_gated(a, "silu", b), fullgraph=True, backend="aot_eager"
        )
        assert torch.equal(compiled(gu, r), want)
    assert "int4_linear_gated" in ops.FUSED_OPS


_GPU_SHAPES = [(1, 2048, 8192), (4, 2048, 8192), (1, 3072, 2048), (1, 16384, 2048), (8, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the gated builds run on sm_90 (the tensor-core GEMV's default)")
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiled"])
def test_gated_gemv_on_the_gpu_at_decode_shapes(tiled) -> None:
    """On an sm_90 GPU, the default route (gated_config's choice, split builds included) at the
    1B model's down projection and wider shapes, each activation, bf16 and fp16 x: within the
    product's rounding of the unfused GEMV on gated_product's h, bitwise on a second run."""
    g, cpu = torch.Generator(device="cuda").manual_seed(11), torch.Generator().manual_seed(11)
    for m, n, k in _GPU_SHAPES:
        base = quantize(make_weight(n, k, heavy=True, generator=cpu, device="cuda"), "int4", False, 128)
        for act in ACTS:
            for dtype in (torch.bfloat16, torch.float16):
                weight = type(base)(base.qweight, base.scales.to(dtype), base.zeros.to(dtype), 128, "int4")
                codes = tile_codes(weight.qweight) if tiled else weight.qweight
                gate_up = torch.randn(m, 2 * k, generator=g, device="cuda")
                gate_up = (gate_up * torch.tensor([3.0, 1.0], device="cuda").repeat_interleave(k)).to(dtype)
                parts = (codes, weight.scales, weight.zeros, None)
                out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
                config = G.gated_config(gate_up, *parts, out, 128, "int4", act)
                assert config is not None, (m, n, k)
                G.int4_linear_gated_fwd(gate_up, *parts, out, 128, "int4", act)
                again = torch.empty_like(out)
                G.int4_linear_gated_fwd(gate_up, *parts, again, 128, "int4", act)
                assert torch.equal(out, again)
                h = gated_product(gate_up, act)
                unfused = torch.empty_like(out)
                G.int4_linear_fwd(h, *parts, unfused, 128, "int4", config=config)
                _assert_gated_close(out, unfused, h, weight, f"{config} {act} {dtype} m={m} {n}x{k}")
    assert not G._broken, G._broken
