"""quantize_int4 / quantize_nf4 (formats, errors, the clipping search), Int4Linear,
quantize_model, safetensors round trips, state-dict checks, torch.compile, opcheck and the
fallback when a kernel fails."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import openkernels.quant as Q
import openkernels.shared.dispatch as dispatch
from openkernels.quant import reference as R
from openkernels.quant.linear import Int4Linear, load_quantized, quantize_model, save_quantized
from openkernels.shared.dev.testing import failing_implementation, run_opcheck
from openkernels.shared.platform import triton_interpreting

from .cases import assert_linear_close, make_weight

pytestmark = pytest.mark.skipif(triton_interpreting(), reason="API tests run once, in the main run")


# ---- quantization ---------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128, None])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_codes_are_round_to_nearest(group, symmetric) -> None:
    w = make_weight(40, 256, heavy=True)
    q = Q.quantize_int4(w, group, symmetric)
    g = q.group_size
    codes = R.unpack_codes(q.qweight).reshape(40, 256 // g, g).double()
    s = q.scales.t().double().unsqueeze(-1)
    z = 8.0 if symmetric else q.zeros.t().double().unsqueeze(-1)
    want = torch.clamp(torch.round(w.reshape(40, 256 // g, g).double() / s) + z, 0, 15)
    # Round-to-nearest against the stored scale; ties may go either way in float32.
    assert (codes - want).abs().max() <= 1 and (codes != want).float().mean() < 1e-3
    w_hat = Q.dequantize_int4(q, torch.float64)
    step = s.expand(-1, -1, g).reshape(40, 256)
    inside = (w.double() - w_hat).abs() <= 0.5 * step * (1 + 1e-3)
    assert inside.float().mean() > (0.99 if symmetric else 0.999)  # only clamped values leave the grid


def test_nf4_levels_and_blocks() -> None:
    w = make_weight(16, 128)
    q = Q.quantize_nf4(w)
    assert q.kind == "nf4" and q.group_size == 64 and q.zeros is None
    absmax = w.reshape(16, 2, 64).abs().amax(-1).t()
    torch.testing.assert_close(q.scales.float(), absmax.half().float())
    w_hat = Q.dequantize_int4(q, torch.float64)
    levels = torch.tensor(Q.NF4_VALUES, dtype=torch.float64)
    normalized = (w_hat / q.scales.t().double().repeat_interleave(64, 1)).flatten()
    assert torch.isin(normalized.round(decimals=6), levels.round(decimals=6)).all()


@pytest.mark.parametrize("kind", ["int4", "int4-sym", "nf4"])
@pytest.mark.parametrize("heavy", [False, True], ids=["gaussian", "heavy-tailed"])
def test_clip_search_never_worse_and_helps(kind, heavy) -> None:
    gen = torch.Generator().manual_seed(0)
    w = make_weight(256, 1024, heavy=heavy, generator=gen)

    def err(q):
        return float((Q.dequantize_int4(q) - w).square().sum())

    def quant(**kw):
        if kind == "nf4":
            return Q.quantize_nf4(w, **kw)
        return Q.quantize_int4(w, 128, kind == "int4-sym", **kw)

    plain, searched = err(quant()), err(quant(search="clip"))
    assert searched <= plain
    # Squared-error ratios measured here (docs/ops/quant.md): Gaussian 0.74-0.89, heavy-tailed
    # 0.89-0.97 (outlier channels leave less to clip).
    assert searched < (0.98 if heavy else 0.95) * plain, (kind, searched / plain)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"weight": torch.zeros(4, 7)}, "even"),
        ({"weight": torch.zeros(4, 96), "group_size": 64}, "divide"),
        ({"weight": torch.zeros(4, 128), "group_size": 48}, "group_size"),
        ({"weight": torch.zeros(4, 128, dtype=torch.int32)}, "float"),
        ({"weight": torch.zeros(128)}, "2D"),
        ({"weight": torch.full((4, 128), float("nan"))}, "NaN"),
        ({"weight": torch.zeros(4, 128), "scale_dtype": torch.float32}, "scale_dtype"),
        ({"weight": torch.zeros(4, 128), "search": "gptq"}, "search"),
        ({"weight": torch.full((4, 128), 1e9)}, "bfloat16"),
    ],
)
def test_quantize_rejects_bad_input(kwargs, error) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        Q.quantize_int4(**kwargs)


@pytest.mark.parametrize("search", [None, "clip"])
def test_groups_that_do_not_hold_zero_stay_on_the_grid(search) -> None:
    """Asymmetric int4 stores the zero point as a code (0..15), so each group's range must
    hold 0: a group of [10, 11] once got zero 0, its codes clamped at 15 and came back ~1.0."""
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(6, 256, generator=gen)
    w[0] += 10.0  # far above 0
    w[1] = -w[1] - 3.0  # below 0
    w[2] = w[2] * 0.97 + 0.13  # just above 0
    w[3, :128] = 7.0  # a constant group beside an offset one
    w[4] = w[4] * 1e-3 + 1.0  # narrow and far: the step is the group's max / 15
    q = Q.quantize_int4(w, 64, search=search)
    assert q.zeros is not None and q.zeros.min() >= 0 and q.zeros.max() <= 15
    step = q.scales.t().double().repeat_interleave(64, dim=1)
    err = (Q.dequantize_int4(q, torch.float64) - w.double()).abs()
    if search is None:  # round to nearest: every value within half a step of its own
        assert (err <= 0.5 * step * (1 + 1e-3)).all(), err.max()
    else:  # the search keeps a group's squared error at most round to nearest's
        rtn = Q.dequantize_int4(Q.quantize_int4(w, 64), torch.float64) - w.double()
        group_sq = err.square().reshape(6, 4, 64).sum(-1)
        assert (group_sq <= rtn.square().reshape(6, 4, 64).sum(-1) * (1 + 1e-6)).all()


def test_all_zero_groups_and_bfloat16_scales() -> None:
    w = make_weight(8, 256)
    w[:, :128] = 0
    q = Q.quantize_int4(w, 128, scale_dtype=torch.bfloat16)
    assert q.scales.dtype == torch.bfloat16
    w_hat = Q.dequantize_int4(q)
    assert (w_hat[:, :128] == 0).all() and torch.isfinite(w_hat).all()


# ---- Int4Weight and int4_linear argument checks ----------------------------------------------


def test_int4_weight_checks_name_the_tensor() -> None:
    q = Q.quantize_int4(make_weight(16, 128), 64)
    with pytest.raises(TypeError, match="qweight"):
        Q.Int4Weight(q.qweight.to(torch.int32), q.scales, q.zeros, 64)
    with pytest.raises(ValueError, match="scales"):
        Q.Int4Weight(q.qweight, q.scales.t().contiguous(), q.zeros, 64)
    with pytest.raises(ValueError, match="zeros"):
        Q.Int4Weight(q.qweight, q.scales, q.zeros[:1], 64)
    with pytest.raises(ValueError, match="group_size"):
        Q.Int4Weight(q.qweight, q.scales, q.zeros, 48)
    with pytest.raises(ValueError, match="perm"):
        Q.Int4Weight(q.qweight, q.scales, q.zeros, 64, perm=torch.arange(5))


def test_int4_linear_rejects_bad_calls() -> None:
    q = Q.quantize_int4(make_weight(16, 128), 64)
    with pytest.raises(ValueError, match="in_features 128"):
        Q.int4_linear(torch.randn(2, 64), q)
    with pytest.raises(TypeError, match="float16, bfloat16"):
        Q.int4_linear(torch.zeros(2, 128, dtype=torch.int64), q)
    with pytest.raises(ValueError, match="bias"):
        Q.int4_linear(torch.randn(2, 128), q, torch.randn(15))
    with pytest.raises(TypeError, match="Int4Weight"):
        Q.int4_linear(torch.randn(2, 128), torch.randn(16, 128))


def test_act_order_perm_is_applied_to_x() -> None:
    gen = torch.Generator().manual_seed(5)
    w = make_weight(24, 128, generator=gen)
    perm = torch.randperm(128, generator=gen)
    q = Q.quantize_int4(w[:, perm], 32)  # W' = W[:, perm], y = x[..., perm] @ W'^T
    q = Q.Int4Weight(q.qweight, q.scales, q.zeros, 32, perm=perm)
    x = torch.randn(3, 128, generator=gen, dtype=torch.float64)
    want = x @ Q.dequantize_int4(q, torch.float64).t()  # dequantize undoes the perm
    torch.testing.assert_close(Q.int4_linear(x, q), want)


# ---- Int4Linear, quantize_model, safetensors ----------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.act = nn.GELU()
        self.down = nn.Linear(96, 64, bias=False)
        self.odd = nn.Linear(33, 8)
        self.lm_head = nn.Linear(64, 10)

    def forward(self, x):
        return self.lm_head(self.down(self.act(self.up(x))))


def test_from_linear_matches_dequantized_weight_and_keeps_bias() -> None:
    lin = nn.Linear(128, 40)
    mod = Int4Linear.from_linear(lin, group_size=64)
    x = torch.randn(2, 3, 128)
    assert_linear_close(mod(x).reshape(6, 40), x.reshape(6, 128), mod.weight, lin.bias, w_rounded=False)
    assert "group_size=64" in repr(mod)


def test_scales_default_to_the_weights_16_bit_dtype() -> None:
    """quant 0.10.6: scales (and zeros) in the weight's own 16-bit dtype unless asked, float16
    for float32 weights; an explicit scale_dtype wins."""
    for dtype, want in (
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float16),
    ):
        lin = nn.Linear(128, 32).to(dtype)
        mod = Int4Linear.from_linear(lin, group_size=64)
        assert mod.scales.dtype == want and mod.zeros.dtype == want, (dtype, mod.scales.dtype)
        assert (
            Int4Linear.from_linear(lin, group_size=64, scale_dtype=torch.float16).scales.dtype
            == torch.float16
        )
    model = _Tiny().to(torch.bfloat16)
    quantize_model(model, group_size=32, progress=False)
    assert model.up.scales.dtype == torch.bfloat16
    model = _Tiny().to(torch.bfloat16)
    quantize_model(model, group_size=32, progress=False, scale_dtype=torch.float16)
    assert model.up.scales.dtype == torch.float16
    nf4 = Int4Linear.from_linear(nn.Linear(128, 32).to(torch.bfloat16), group_size=64, kind="nf4")
    assert nf4.scales.dtype == torch.bfloat16


def test_quantize_model_report_and_skips() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    report = quantize_model(model, group_size=32, progress=False)
    assert isinstance(model.up, Int4Linear) and isinstance(model.down, Int4Linear)
    assert type(model.lm_head) is nn.Linear and type(model.odd) is nn.Linear
    assert dict(report.skipped) == {
        "odd": "in_features 33 is odd",
        "lm_head": "matches skip pattern 'lm_head'",
    }
    assert report.bytes_after < report.bytes_before / 3
    assert "quantized 2 linear layers" in str(report)


def test_quantize_model_progress_goes_to_stderr(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # no tqdm: the plain progress line
    quantize_model(_Tiny(), group_size=32, skip=("*head",), progress=True)
    assert "quantizing 2/2 linear layers" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["int4", "nf4"])
def test_safetensors_round_trip(tmp_path, kind) -> None:
    torch.manual_seed(1)
    model = _Tiny()
    quantize_model(model, group_size=32, kind=kind, progress=False)
    x = torch.randn(4, 64)
    want = model(x)
    path = tmp_path / "model.safetensors"
    save_quantized(model, path)
    fresh = _Tiny()
    load_quantized(fresh, path)
    assert isinstance(fresh.up, Int4Linear) and fresh.up.kind == kind
    torch.testing.assert_close(fresh(x), want, rtol=0, atol=0)


class _TiedHead(nn.Module):
    """An embedding and a 16-bit head that share one weight (a Llama with tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.up = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, 10, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.up(self.embed(ids)))


def test_tied_weights_are_saved_once_and_loaded_into_both(tmp_path) -> None:
    """quant 0.10.18: safetensors refused the two keys of one tensor (save_quantized raised on
    any tied-embedding model whose lm_head stays in 16 bits, the default skip)."""
    torch.manual_seed(3)
    model = _TiedHead()
    quantize_model(model, group_size=32, progress=False)
    ids = torch.randint(0, 10, (2, 5))
    want = model(ids)
    path = tmp_path / "tied.safetensors"
    save_quantized(model, path)
    for fresh in (_TiedHead(), _untie(_TiedHead())):  # tied as saved, or not: both keys filled
        load_quantized(fresh, path)
        torch.testing.assert_close(fresh(ids), want, rtol=0, atol=0)
        assert torch.equal(fresh.lm_head.weight, model.embed.weight)


def _untie(model: _TiedHead) -> _TiedHead:
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    return model


def test_dtype_casts_keep_the_scales_format(tmp_path) -> None:
    """quant 0.10.18: model.float() made the scales float32; the CPU kernel refused them at the
    next call (dispatch then ran the reference for the rest of the process) and save_quantized
    wrote a file load_quantized refused. Scales and zeros now keep their dtype under casts."""
    torch.manual_seed(4)
    model = _Tiny().to(torch.bfloat16)
    quantize_model(model, group_size=32, progress=False)
    x = torch.randn(3, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no KernelFallbackWarning
        for cast in (nn.Module.float, nn.Module.half, nn.Module.double, lambda m: m.to(torch.bfloat16)):
            cast(model)
            assert model.up.scales.dtype == model.up.zeros.dtype == torch.bfloat16
            assert model.up.bias.dtype == model.lm_head.weight.dtype  # the bias casts as any parameter
            model(x.to(model.lm_head.weight.dtype))
    path = tmp_path / "cast.safetensors"
    model.float()
    save_quantized(model, path)
    load_quantized(_Tiny(), path)


def test_int4_weight_takes_any_strides_and_checks_its_perm() -> None:
    """A weight of transposed-copy scales ran into the CPU kernel's stride check at every call,
    and dispatch gave up on that kernel for the process (a 400x slower reference from then on
    for every call of that dtype): Int4Weight now holds contiguous copies."""
    weight = Q.quantize_int4(make_weight(32, 128), 32)
    odd = Q.Int4Weight(weight.qweight, weight.scales.t().contiguous().t(), weight.zeros, 32)
    assert odd.scales.is_contiguous() and torch.equal(odd.scales, weight.scales)
    x = torch.randn(2, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(Q.int4_linear(x, odd), Q.int4_linear(x, weight), rtol=0, atol=0)
    for perm in (torch.zeros(128, dtype=torch.long), torch.arange(128) + 1):
        with pytest.raises(ValueError, match="perm: not a permutation"):
            Q.Int4Weight(weight.qweight, weight.scales, weight.zeros, 32, perm=perm)


def test_shared_layers_and_single_layers_in_quantize_model() -> None:
    """One nn.Linear under two names is quantized once and replaced under both (the second
    name kept the 16-bit layer before, unreported); kernelize's undo puts it back under both.
    A bare nn.Linear is refused with the call that quantizes one layer."""
    from openkernels.shared.kernelize import kernelize, unkernelize

    shared = nn.Linear(64, 64)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = quantize_model(model, group_size=32, progress=False)
    assert report.quantized == ["0", "2"] and model[0] is model[2] and isinstance(model[0], Int4Linear)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = quantize_model(model, group_size=32, progress=False, skip=("2",))
    assert model[0] is shared and [name for name, _ in report.skipped] == ["0", "2"]
    kernelize(model, quantize={"kind": "int4", "group_size": 32})
    assert isinstance(model[0], Int4Linear) and model[0] is model[2]
    unkernelize(model)
    assert model[0] is shared and model[2] is shared
    with pytest.raises(TypeError, match=r"Int4Linear\.from_linear"):
        quantize_model(nn.Linear(64, 64))


def test_odd_arguments_get_clear_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="in_features 127 must be even"):
        Int4Linear(127, 8)
    with pytest.raises(ValueError, match="in_features must be positive"):
        Q.quantize_int4(torch.zeros(4, 0), 32)
    with pytest.raises(ValueError, match=r"group_size 32\.0"):
        Q.quantize_int4(torch.zeros(4, 64), 32.0)
    model = _Tiny()
    quantize_model(model, group_size=32, progress=False)
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    for version in ('"1"', "true"):
        key = next(iter(meta))
        bad = {key: meta[key].replace('"version": 1', f'"version": {version}')}
        save_file(load_file(str(path)), str(tmp_path / "bad.safetensors"), metadata=bad)
        with pytest.raises(ValueError, match="is not supported"):
            load_quantized(_Tiny(), tmp_path / "bad.safetensors")


def test_state_dict_with_wrong_tensors_is_rejected_by_name(tmp_path) -> None:
    model = _Tiny()
    quantize_model(model, group_size=32, progress=False)
    state = model.state_dict()
    fresh = _Tiny()
    quantize_model(fresh, group_size=32, progress=False)
    bad = dict(state, **{"up.qweight": state["up.qweight"].to(torch.int32)})
    with pytest.raises(ValueError, match=r"up\.qweight"):
        fresh.load_state_dict(bad)
    bad = dict(state, **{"down.scales": state["down.scales"][:1]})
    with pytest.raises(ValueError, match=r"down\.scales"):
        fresh.load_state_dict(bad)
    bad = dict(state, **{"up.zeros": state["up.zeros"] + 100})
    with pytest.raises(ValueError, match=r"up\.zeros"):
        fresh.load_state_dict(bad)
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="metadata"):
        load_quantized(_Tiny(), plain)


# ---- torch.compile, opcheck, fallback -------------------------------------------------------------


def test_compile_fullgraph_over_int4_linear() -> None:
    torch._dynamo.reset()
    mod = Int4Linear.from_linear(nn.Linear(128, 48), group_size=64)
    x = torch.randn(5, 128)
    compiled = torch.compile(mod, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), mod(x))
    xg = x.clone().requires_grad_()
    compiled(xg).sum().backward()
    xe = x.clone().requires_grad_()
    mod(xe).sum().backward()
    torch.testing.assert_close(xg.grad, xe.grad)


def test_opcheck() -> None:
    q = Q.quantize_int4(make_weight(24, 64), 32)
    x = torch.randn(3, 64, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    run_opcheck(
        torch.ops.openkernels.int4_linear.default, (x, q.qweight, q.scales, q.zeros, bias, 32, "int4")
    )
    run_opcheck(torch.ops.openkernels.dequantize_int4.default,
                (q.qweight, q.scales, None, 32, "int4", torch.float32))  # fmt: skip


def test_failing_kernel_falls_back_with_one_warning(monkeypatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    q = Q.quantize_int4(make_weight(16, 64), 32)
    x = torch.randn(2, 64)
    with (
        failing_implementation("int4_linear", "cpu", RuntimeError("no compiler")),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        out = Q.int4_linear(x, q)
        Q.int4_linear(x, q)
    assert sum(issubclass(w.category, dispatch.KernelFallbackWarning) for w in caught) == 1
    torch.testing.assert_close(out, x @ Q.dequantize_int4(q).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_forward_add_folds_one_row_into_the_kernels_bias(device) -> None:
    """Int4Linear.forward_add(x, r) = r + forward(x): at one row of x (a decode step) r goes in
    as the kernel's bias (bit for bit the layer with that bias), elsewhere the add follows
    (bit for bit r + forward(x)); a layer with a bias of its own, or gradients, add after."""
    if triton_interpreting():
        pytest.skip("module plumbing, once, outside the interpreter")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    dense = nn.Linear(256, 384, bias=False).to(device, dtype)
    layer = Int4Linear.from_linear(dense)
    with_bias = Int4Linear.from_linear(nn.Linear(256, 384).to(device, dtype))
    with torch.no_grad():
        for shape in ((1, 1, 256), (1, 256), (3, 256), (2, 1, 256)):
            x = torch.randn(shape, device=device, dtype=dtype)
            r = torch.randn(*shape[:-1], 384, device=device, dtype=dtype)
            got = layer.forward_add(x, r)
            assert got.shape == r.shape
            if x.numel() == 256:  # the bias path: the same bits as a layer whose bias is r
                want = Q.linear_parts(x, layer.qweight, layer.scales, layer.zeros, r.reshape(-1), layer.group_size,
                                      layer.kind).reshape(r.shape)  # fmt: skip
                assert torch.equal(got, want)
                unfused = r + layer(x)  # two roundings against one
                assert (got.float() - unfused.float()).abs().max() <= 2**-6 * unfused.float().abs().max()
            else:
                assert torch.equal(got, r + layer(x))
            x1 = torch.randn(1, 256, device=device, dtype=dtype)
            r1 = torch.randn(1, 384, device=device, dtype=dtype)
            assert torch.equal(with_bias.forward_add(x1, r1), r1 + with_bias(x1))
    x = torch.randn(1, 256, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(1, 384, device=device, dtype=dtype, requires_grad=True)
    out = layer.forward_add(x, r)
    out.float().sum().backward()
    assert r.grad is not None and torch.equal(r.grad, torch.ones_like(r))
