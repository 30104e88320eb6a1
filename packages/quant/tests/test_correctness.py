"""int4_linear and dequantize_int4 on every implementation against the float64 reference:
every format and group size, M from 1 to 4096, odd N and K, leading shapes, strided x, bias,
fp16 / bf16 / fp32 activations, gradients, and every path the Triton launcher can pick."""

from __future__ import annotations

import pytest
import torch

import openkernels.quant as Q
import openkernels.shared.dispatch as dispatch
from openkernels.quant import reference as R
from openkernels.shared.platform import triton_interpreting

from .cases import FORMATS, assert_linear_close, make_weight, quantize, rounds_weight, targets

INTERP = triton_interpreting()
# (M, N, K, group): odd N; K not a multiple of 128 where the group allows; whole-row groups.
SHAPES_SMALL = [(1, 40, 256, 128), (3, 33, 96, 32), (17, 70, 192, 64), (5, 24, 200, None), (1, 9, 64, None)]
SHAPES_FULL = [
    *SHAPES_SMALL,
    (64, 257, 384, 128),
    (130, 100, 640, 64),
    (1, 1000, 1024, 128),
    (600, 96, 256, 32),
    (4096, 48, 128, 64),  # the largest M
]
SHAPES = SHAPES_SMALL if INTERP else SHAPES_FULL
X_DTYPES = [torch.bfloat16, torch.float16] if INTERP else [torch.bfloat16, torch.float16, torch.float32]


def _supported(impl: str, dtype: torch.dtype) -> bool:
    return not (impl in ("triton", "gemv", "wgmma") and dtype == torch.float32)


@pytest.mark.parametrize(("device", "impl"), targets())
@pytest.mark.parametrize(("kind", "symmetric"), FORMATS, ids=["int4", "int4-sym", "nf4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, (s[0], s[1], s[2], s[3] or "row"))))
@pytest.mark.parametrize("dtype", X_DTYPES, ids=str)
def test_linear_matches_reference(device, impl, kind, symmetric, shape, dtype) -> None:
    m, n, k, group = shape
    if not _supported(impl, dtype):
        pytest.skip("the GPU kernels take float16 / bfloat16 activations")
    gen = torch.Generator().manual_seed(hash((m, n, k, kind, symmetric)) % 2**31)
    weight = quantize(make_weight(n, k, heavy=True, generator=gen), kind, symmetric, group).to(device)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device) if m % 2 else None
    with dispatch.force(impl):
        out = Q.int4_linear(x, weight, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    rounded = rounds_weight(impl, kind, m, n, k, weight.group_size, device, dtype, bias is not None)
    assert_linear_close(out, x, weight, bias, w_rounded=rounded, msg=f"{impl} {kind} {shape}")


@pytest.mark.parametrize(("device", "impl"), targets())
def test_leading_shape_strided_x_and_fp16_scales(device, impl) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = Q.quantize_int4(make_weight(48, 128, generator=gen), 64, scale_dtype=torch.bfloat16).to(device)
    base = torch.randn(2, 3, 256, generator=gen).to(device, torch.bfloat16)
    x = base[..., ::2]  # (2, 3, 128) with column stride 2
    with dispatch.force(impl):
        out = Q.int4_linear(x, weight)
    assert out.shape == (2, 3, 48)
    rounded = rounds_weight(impl, "int4", 6, 48, 128, 64, device, torch.bfloat16, False)
    assert_linear_close(out.reshape(6, 48), x.reshape(6, 128), weight, None, w_rounded=rounded, msg=impl)


@pytest.mark.parametrize(("device", "impl"), targets())
def test_nan_in_x_propagates(device, impl) -> None:
    weight = Q.quantize_int4(make_weight(16, 64), 32).to(device)
    x = torch.randn(2, 64).to(device, torch.bfloat16)
    x[1, 5] = float("nan")
    with dispatch.force(impl):
        out = Q.int4_linear(x, weight)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()


@pytest.mark.parametrize(("device", "impl"), targets("dequantize_int4"))
@pytest.mark.parametrize(("kind", "symmetric"), FORMATS, ids=["int4", "int4-sym", "nf4"])
@pytest.mark.parametrize("group", [32, 128, None], ids=["g32", "g128", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_matches_reference(device, impl, kind, symmetric, group, dtype) -> None:
    w = make_weight(37, 256, heavy=True)
    weight = quantize(w, kind, symmetric, group).to(device)
    with dispatch.force(impl):
        got = Q.dequantize_int4(weight, dtype)
    with dispatch.force("reference"):
        want = Q.dequantize_int4(weight, torch.float64)
    # Each element is one product of two float16-exact values rounded once.
    torch.testing.assert_close(got.double().cpu(), want.to(dtype).double().cpu(), rtol=0, atol=0)


@pytest.mark.parametrize(("device", "impl"), targets())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gradients_match_dequantized_linear(device, impl, dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = Q.quantize_int4(make_weight(24, 64, generator=gen), 32).to(device)
    x = torch.randn(2, 5, 64, generator=gen).to(device, dtype).requires_grad_()
    bias = torch.randn(24, generator=gen).to(device).requires_grad_()
    grad = torch.randn(2, 5, 24, generator=gen).to(device, dtype)
    with dispatch.force(impl):
        Q.int4_linear(x, weight, bias).backward(grad)
    w = Q.dequantize_int4(weight.to("cpu"), torch.float64)
    want_x = grad.double().cpu() @ w
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    rss = ((grad.double().cpu() ** 2) @ (w * w)).sqrt()
    assert ((x.grad.double().cpu() - want_x).abs() <= u * want_x.abs() + 4 * u * rss + 1e-6).all()
    torch.testing.assert_close(
        bias.grad.double().cpu(), grad.double().sum((0, 1)).cpu(), rtol=1e-5, atol=1e-4
    )


# ---- every path and config the Triton launcher can take ---------------------------------------


# Triton runs on a GPU, and on CPU tensors under TRITON_INTERPRET=1; elsewhere (test-cpu's
# first run) the tests below do not exist, rather than being generated as skipped ones.
TRITON_TARGETS = [t for t in targets() if t.values[1] == "triton"]


def _forced_configs():
    from openkernels.quant.triton.configs import LinearConfig

    return [
        LinearConfig("gemv", 1, 16, 64, 4, 1, 1),
        LinearConfig("gemv", 1, 8, 128, 2, 1, 3),  # split K, uneven split
        LinearConfig("tiled", 16, 32, 32, 4, 1, 1),
        LinearConfig("tiled", 16, 16, 64, 4, 2, 2),  # split K
        LinearConfig("tiled", 32, 64, 32, 4, 2, 1, group_n=2),  # several bands of M
        LinearConfig("tiled", 16, 32, 64, 4, 2, 2, swap_ab=False),  # x @ W^T, split K
        LinearConfig("tiled", 16, 32, 128, 4, 2, 2, unroll=4),  # 4 sub-steps of 32, uneven K
        LinearConfig("tiled", 32, 16, 32, 4, 2, 1, group_n=2, swap_ab=False),
        LinearConfig("dequant"),
    ]


@pytest.mark.parametrize(("device", "impl"), TRITON_TARGETS)
@pytest.mark.parametrize("config", range(9), ids=["gemv", "gemv-split", "tiled", "tiled-split", "tiled-bands",
                                                  "tiled-xw-split", "tiled-xw-bands", "tiled-unroll", "dequant"])  # fmt: skip
@pytest.mark.parametrize(("kind", "symmetric"), FORMATS, ids=["int4", "int4-sym", "nf4"])
def test_every_triton_path(device, impl, config, kind, symmetric) -> None:
    from openkernels.quant.triton import int4_linear_fwd

    cfg = _forced_configs()[config]
    m = 1 if cfg.path == "gemv" else 37
    gen = torch.Generator().manual_seed(config)
    for n, k, group in ((45, 256, 64), (30, 192, None)):
        weight = quantize(make_weight(n, k, heavy=True, generator=gen), kind, symmetric, group).to(device)
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(device)
        out = torch.empty(m, n, dtype=x.dtype, device=device)
        int4_linear_fwd(x, weight.qweight, weight.scales, weight.zeros, bias, out, weight.group_size, kind,
                        config=cfg)  # fmt: skip
        w_rounded = cfg.path == "dequant" or (cfg.path == "tiled" and kind == "nf4")
        assert_linear_close(out, x, weight, bias, w_rounded=w_rounded, msg=f"{cfg} {kind} {n}x{k}")


if not TRITON_TARGETS:
    del test_every_triton_path


def test_config_table_paths() -> None:
    from openkernels.quant.triton.configs import linear_config

    assert linear_config(1, 8192, 8192, 128, "hopper", 132).path == "gemv"
    assert linear_config(1, 8192, 8192, 64, "hopper", 132, "nf4").path == "gemv"
    assert linear_config(1, 8192, 8192, 64, "hopper", 132, "nf4").split_k == 16
    assert linear_config(1, 8192, 8192, 128, "hopper", 132, words=False).path == "tiled"
    assert linear_config(1, 8192, 8196, 128, "hopper", 132).path == "tiled"  # K % 8 != 0
    assert linear_config(1, 8192, 8192, 128, "cdna", 304).path == "tiled"
    assert linear_config(16, 8192, 8192, 128, "hopper", 132).path == "tiled"
    assert linear_config(4096, 8192, 8192, 128, "hopper", 132).path == "dequant"
    for m in (2, 16, 100, 500):
        for group in (32, 64, 128, 200):
            cfg = linear_config(m, 1000, 400 if group == 200 else 4096, group, "hopper", 132)
            if cfg.path == "tiled":
                assert group % (cfg.block_k // cfg.unroll) == 0 or group in (200,), (m, group, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERP, reason="needs a CUDA device")
@pytest.mark.parametrize("reserved", [False, True], ids=["temporaries", "reserved"])
def test_cuda_graph_replay_and_split_k_reuse(reserved) -> None:
    """Decode runs layers in CUDA graphs: the split-K scratch and counters must survive capture
    and repeated replays (each replay leaves the counters at 0 for the next). reserved: the
    capture uses the scratch reserve_graph_scratch made (its partials, NaN before, get
    written), not temporaries."""
    from openkernels.quant import triton as QT

    device = torch.device("cuda", torch.cuda.current_device())
    QT._graph_scratch.pop(device.index, None)
    if reserved:
        QT.reserve_graph_scratch(device)
        QT._graph_scratch[device.index][0].fill_(float("nan"))
    gen = torch.Generator().manual_seed(7)
    weight = Q.quantize_int4(make_weight(512, 1024, generator=gen), 128).to("cuda")
    x = torch.randn(1, 1024, generator=gen).to("cuda", torch.bfloat16)
    Q.int4_linear(x, weight)  # warm-up: compile, plan, scratch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        Q.int4_linear(x, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = Q.int4_linear(x, weight)
    for _ in range(3):
        x.copy_(torch.randn(1, 1024, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert_linear_close(out, x, weight, None, w_rounded=False, msg="graph replay")
    if reserved:
        ws, counters = QT._graph_scratch[device.index]
        assert not torch.isnan(ws[:512]).all(), "the capture did not use the reserved scratch"
        assert int(counters.abs().sum()) == 0, "counters not reset"
    QT._graph_scratch.pop(device.index, None)


@pytest.mark.parametrize(("device", "impl"), targets())
@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_act_order_checkpoint_through_every_implementation(device, impl, checkpoint_format) -> None:
    """A GPTQ act-order checkpoint (zeros up to 16 in v1) through int4_linear equals the
    checkpoint's own x @ W^T: the import's perm and zeros reach every kernel."""
    from .test_checkpoints import _gptq_case, gptq_weight

    qweight, qzeros, scales, g_idx, _, _ = _gptq_case(256, 40, 64, True, seed=3)
    weight = Q.from_gptq(qweight, qzeros, scales, g_idx, checkpoint_format=checkpoint_format).to(device)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    with dispatch.force(impl):
        out = Q.int4_linear(x, weight)
    w = gptq_weight(qweight, qzeros, scales, g_idx, checkpoint_format).double()
    ref = x.double().cpu() @ w.t()
    bound = R.linear_error_bound(x.double().cpu(), w, ref, torch.bfloat16)
    assert ((out.double().cpu() - ref).abs() <= bound).all()
