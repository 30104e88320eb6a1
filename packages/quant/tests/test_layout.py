"""The codes' stored layout (Int4Linear(layout=...), format.LAYOUTS): "tiled" layers give the
rows layers' outputs, convert once and both ways, refuse shapes they cannot hold before
changing anything, stack, save their layout and its version into the file and load it back
(or convert to the layout asked for); on sm_90 the tensor-core GEMV reads them directly."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from openkernels.quant import cuda as G
from openkernels.quant import format, ops
from openkernels.quant.linear import Int4Linear, load_quantized, quantize_model, save_quantized
from openkernels.shared.platform import triton_interpreting

from .cases import SM90, assert_linear_close

pytestmark = pytest.mark.skipif(triton_interpreting(), reason="layout tests run once, in the main run")


def _pair(out_features=64, in_features=256, kind="int4", bias=True, seed=0):
    """(rows layer, tiled layer) quantized from one nn.Linear."""
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    rows = Int4Linear.from_linear(linear, group_size=128, kind=kind)
    tiled = Int4Linear.from_linear(linear, group_size=128, kind=kind, layout="tiled")
    return rows, tiled


@pytest.mark.parametrize("kind", ["int4", "nf4"])
def test_tiled_layer_gives_the_rows_output_and_warns_once(kind) -> None:
    rows, tiled = _pair(kind=kind)
    assert rows.layout == "rows" and tiled.layout == "tiled"
    assert tiled.qweight.shape == (4, 2, 1024) and tiled.qweight.dtype == torch.uint8
    assert torch.equal(format.untile_codes(tiled.qweight), rows.qweight)
    assert torch.equal(tiled.weight.qweight, rows.qweight)  # Int4Weight holds rows
    assert "layout=tiled" in repr(tiled) and "layout" not in repr(rows)
    ops._untiled_warned.clear()
    x = torch.randn(3, 256)
    with pytest.warns(UserWarning, match="'tiled' layout"):
        out = tiled(x)
    assert torch.equal(out, rows(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiled(torch.randn(5, 256))  # the same layer shape and device: no second warning
    # Autograd through the converted codes: the same gradient as the rows layer.
    xg = torch.randn(2, 256, requires_grad=True)
    xr = xg.detach().clone().requires_grad_(True)
    tiled(xg).sum().backward()
    rows(xr).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def test_tiled_layer_compiles_without_a_graph_break() -> None:
    """torch.compile(fullgraph=True) traces a tiled layer into the library op with the tiled
    codes (its fake shape from the tiled codes; the op picks the path when it runs)."""
    rows, tiled = _pair(kind="int4")
    x = torch.randn(4, 256)
    compiled = torch.compile(tiled, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(compiled(x), rows(x))


def test_to_layout_converts_both_ways_and_refuses_before_changing() -> None:
    rows, tiled = _pair()
    codes = rows.qweight.clone()
    assert rows.to_layout("tiled") is rows
    assert rows.layout == "tiled" and torch.equal(rows.qweight, tiled.qweight)
    assert rows.to_layout("rows").layout == "rows" and torch.equal(rows.qweight, codes)
    assert "qweight" in dict(rows.named_buffers())
    odd = Int4Linear.from_linear(nn.Linear(256, 40), group_size=128)
    before = odd.qweight.clone()
    with pytest.raises(ValueError, match="multiple of 16"):
        odd.to_layout("tiled")
    assert odd.layout == "rows" and torch.equal(odd.qweight, before)
    with pytest.raises(ValueError, match="layout must be one of"):
        odd.to_layout("columns")
    with pytest.raises(ValueError, match="in_features of 128"):
        Int4Linear(192, 64, group_size=64, layout="tiled")
    with pytest.raises(ValueError, match="multiple of 16"):
        Int4Linear.from_linear(nn.Linear(256, 40), layout="tiled")
    # use_tiled_codes' second copy goes away once the codes are stored tiled
    layer = _pair()[0].use_tiled_codes()
    assert layer.to_layout("tiled").qweight_tiled is None and layer.use_tiled_codes().qweight_tiled is None


def test_state_dict_of_another_layout_is_refused_with_the_way_out() -> None:
    rows, tiled = _pair()
    with pytest.raises(ValueError, match=r"layout 'rows'.*to_layout"):
        tiled.load_state_dict(rows.state_dict())
    with pytest.raises(ValueError, match="layout 'tiled'"):
        rows.load_state_dict(tiled.state_dict())
    fresh = Int4Linear(256, 64, layout="tiled")
    fresh.load_state_dict(tiled.state_dict())
    assert torch.equal(fresh.qweight, tiled.qweight)


def test_tiled_layers_stack_as_the_rows_do() -> None:
    a_rows, a = _pair(seed=1)
    b_rows, b = _pair(out_features=32, seed=2)
    stacked = Int4Linear.concat_out([a, b])
    assert stacked.layout == "tiled" and stacked.qweight.shape == (6, 2, 1024)
    want = Int4Linear.concat_out([a_rows, b_rows])
    assert torch.equal(format.untile_codes(stacked.qweight), want.qweight)
    assert "layout" in Int4Linear.stack_refusal([a, b_rows])


def test_quantize_model_and_files_keep_the_layout(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(128, 40))
    with pytest.raises(ValueError, match=r"layer '2'.*multiple of 16"):
        quantize_model(model, layout="tiled", skip=(), progress=False)
    assert all(type(m) is not Int4Linear for m in model.modules()), "a refused call changed the model"
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 48))
    quantize_model(model, layout="tiled", skip=("2",), progress=False)
    assert model[0].layout == "tiled" and type(model[2]) is nn.Linear
    x = torch.randn(2, 256)
    ops._untiled_warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(x)
    path = tmp_path / "tiled.safetensors"
    save_quantized(model, path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        info = json.loads(f.metadata()["openkernels.quant"])
    assert info["version"] == 2
    assert info["layers"]["0"]["layout"] == "tiled" and info["layers"]["0"]["layout_version"] == 1
    for asked, expected in ((None, "tiled"), ("rows", "rows"), ("tiled", "tiled")):
        fresh = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 48))
        load_quantized(fresh, path, layout=asked)
        assert fresh[0].layout == expected
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(fresh(x), want), asked
    # A rows file stays version 1 and converts on load; a layout the file's layers cannot take
    # is refused before the model changes.
    rows_path = tmp_path / "rows.safetensors"
    model[0].to_layout("rows")
    save_quantized(model, rows_path)
    with safe_open(str(rows_path), framework="pt") as f:
        assert json.loads(f.metadata()["openkernels.quant"])["version"] == 1
    fresh = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 48))
    load_quantized(fresh, rows_path, layout="tiled")
    assert fresh[0].layout == "tiled"
    narrow_q = nn.Sequential(Int4Linear.from_linear(nn.Linear(256, 40)))
    narrow_path = tmp_path / "narrow.safetensors"
    save_quantized(narrow_q, narrow_path)
    target = nn.Sequential(nn.Linear(256, 40))
    with pytest.raises(ValueError, match=r"layer '0'.*multiple of 16"):
        load_quantized(target, narrow_path, layout="tiled")
    assert type(target[0]) is nn.Linear


def test_files_with_an_unknown_layout_or_version_are_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = nn.Sequential(_pair()[1])
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        info = json.loads(f.metadata()["openkernels.quant"])
    tensors = load_file(str(path))
    for change, message in (
        (lambda i: i["layers"]["0"].update(layout_version=2), "version 2"),
        (lambda i: i["layers"]["0"].update(layout="columns"), "'layout'"),
        (lambda i: i.update(version=3), "format version 3"),
    ):
        bad = json.loads(json.dumps(info))
        change(bad)
        bad_path = tmp_path / "bad.safetensors"
        save_file(tensors, str(bad_path), metadata={"openkernels.quant": json.dumps(bad)})
        target = nn.Sequential(nn.Linear(256, 64))
        with pytest.raises(ValueError, match=message):
            load_quantized(target, bad_path)
        assert type(target[0]) is nn.Linear


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("kind", ["int4", "nf4"])
def test_tiled_layer_on_the_gpu(kind) -> None:
    """On sm_90 a tiled layer's calls run a kernel that reads the tiled codes (no warning): the
    tensor-core GEMV at 1-16 rows, the Gluon wgmma kernel from 32 rows at 4096 x 4096; each
    bitwise the same launcher's output on the rows (replayed calls included), and within the
    contract. Under autograd the forward reads them too and the backward converts them: the
    rows layer's output and gradient."""
    from openkernels.quant import gluon

    torch.manual_seed(7)
    linear = nn.Linear(4096, 4096, dtype=torch.bfloat16)
    rows = Int4Linear.from_linear(linear, kind=kind).cuda()
    tiled = Int4Linear.from_linear(linear, kind=kind, layout="tiled").cuda()
    ops._untiled_warned.clear()
    parts = (tiled.scales, tiled.zeros, tiled.bias, 128, kind)
    cases = ((1, "gemv"), (9, "gemv"), (16, "gemv"), (32, "wgmma"), (200, "wgmma"))
    # Four calls of each: from the third the eager replay launches the recorded kernels (the
    # wgmma kernel's 4-D tensor map re-encoded per call).
    for (m, runner), _ in ((case, call) for case in cases for call in range(4)):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert ops.tiled_runner(x, tiled.qweight, *parts) == runner, m
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = tiled(x)
            want = torch.empty_like(out)
            if runner == "gemv":
                config = G.tiled_config(m, 4096, 4096, 128, "sm_90", scales_in_x_dtype=True, kind=kind)
                G.int4_linear_fwd(
                    x, rows.qweight, rows.scales, rows.zeros, rows.bias, want, 128, kind, config=config
                )
            else:
                gluon.int4_linear_fwd(x, rows.qweight, rows.scales, rows.zeros, rows.bias, want, 128, kind)
        assert torch.equal(out, want), f"m={m} {runner}"
        assert_linear_close(out, x, rows.weight, rows.bias, w_rounded=True, msg=f"tiled m={m}")
    # Under autograd the op's forward (grad mode off) reads the tiled codes; the backward
    # converts them: the rows layer's output and gradient, no warning.
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = tiled(x)
        out.float().sum().backward()
    want = rows(xr)
    want.float().sum().backward()
    assert torch.equal(out, want) and torch.equal(x.grad, xr.grad)
    # A call no kernel reads tiled codes for (Triton's rows: few rows of NF4 at a small shape)
    # converts them, with one warning for the layer's shape.
    small = Int4Linear.from_linear(
        nn.Linear(2048, 2048, dtype=torch.bfloat16), kind=kind, layout="tiled"
    ).cuda()
    x = torch.randn(20, 2048, device="cuda", dtype=torch.bfloat16)
    if ops.tiled_runner(x, small.qweight, small.scales, small.zeros, small.bias, 128, kind) is None:
        with pytest.warns(UserWarning, match="'tiled' layout"):
            small(x)
