"""Faults and bad input (issue 20): load_quantized is atomic and its errors name the file, the
key and what was expected; NaN, infinite or negative scales are rejected by name wherever
scales come in (load_quantized, Int4Linear.load_state_dict, from_gptq, from_awq)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openkernels.quant.checkpoints import from_awq, from_gptq
from openkernels.quant.linear import Int4Linear, load_quantized, quantize_model, save_quantized

_KEY = "openkernels.quant"


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 64, bias=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(tensors, metadata) of a save_quantized file of _Tiny with up and down quantized."""
    torch.manual_seed(0)
    model = _Tiny()
    quantize_model(model, group_size=32, skip=("head",), progress=False)
    path = tmp_path_factory.mktemp("quant") / "good.safetensors"
    save_quantized(model, path)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[_KEY])
    return load_file(str(path)), meta


def _write(path, tensors, meta=None, raw=None):
    save_file(tensors, str(path), metadata={_KEY: raw if raw is not None else json.dumps(meta)})
    return path


def _snapshot(model: nn.Module):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return list(model.named_modules()), state


def _assert_unchanged(model: nn.Module, snapshot) -> None:
    modules, state = snapshot
    assert list(model.named_modules()) == modules  # the very same module objects
    now = model.state_dict()
    assert now.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(now[key], value), key


def _scale(tensors, key, value):
    scales = tensors[key].clone()
    scales[1, 2] = value
    return {**tensors, key: scales}


# A fault in the second quantized layer (down): before the fix, up was already Int4Linear with
# placeholder tensors when the error came.
@pytest.mark.parametrize(
    "change,match",
    [
        (lambda t: {**t, "down.qweight": t["down.qweight"].to(torch.int32)}, r"down\.qweight: expected"),
        (lambda t: {**t, "down.scales": t["down.scales"][:1]}, r"down\.scales: expected"),
        (lambda t: _scale(t, "down.scales", float("nan")), r"down\.scales must be finite"),
        (lambda t: {**t, "head.bias": torch.zeros(3)}, r"head\.bias"),
        (lambda t: {k: v for k, v in t.items() if k != "head.weight"}, r"missing head\.weight"),
        (lambda t: {k: v for k, v in t.items() if k != "down.zeros"}, r"missing down\.zeros"),
        (lambda t: {**t, "extra.weight": torch.zeros(2)}, r"unexpected extra\.weight"),
        (lambda t: {**t, "down.extra": torch.zeros(2)}, r"unexpected down\.extra"),
    ],
    ids=[
        "qweight",
        "scales-shape",
        "scales-nan",
        "bias-shape",
        "missing",
        "missing-int4",
        "unexpected",
        "unexpected-int4",
    ],
)
def test_load_quantized_is_atomic(tmp_path, saved, change, match) -> None:
    tensors, meta = saved
    path = _write(tmp_path / "bad.safetensors", change(tensors), meta)
    model = _Tiny()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        load_quantized(model, path)
    assert str(path) in str(info.value)
    _assert_unchanged(model, before)
    assert not any(isinstance(m, Int4Linear) for m in model.modules())


def test_load_quantized_good_file_still_loads(tmp_path, saved) -> None:
    tensors, meta = saved
    path = _write(tmp_path / "good.safetensors", tensors, meta)
    model = load_quantized(_Tiny(), path)
    assert isinstance(model.up, Int4Linear) and isinstance(model.down, Int4Linear)
    assert torch.equal(model.down.qweight, tensors["down.qweight"])
    # strict=False lets keys be missing, as torch's load_state_dict does
    partial = _write(
        tmp_path / "partial.safetensors", {k: v for k, v in tensors.items() if k != "head.bias"}, meta
    )
    load_quantized(_Tiny(), partial, strict=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.01], ids=["nan", "inf", "negative"])
def test_bad_scales_are_rejected_by_name(tmp_path, saved, value) -> None:
    tensors, meta = saved
    path = _write(tmp_path / "bad.safetensors", _scale(tensors, "up.scales", value), meta)
    with pytest.raises(ValueError, match=r"up\.scales must be finite and non-negative"):
        load_quantized(_Tiny(), path)
    layer = Int4Linear(64, 96, group_size=32)
    good = {k.removeprefix("up."): v for k, v in tensors.items() if k.startswith("up.")}
    with pytest.raises(ValueError, match=r"^scales must be finite and non-negative"):
        layer.load_state_dict(_scale(good, "scales", value))
    assert torch.equal(layer.scales, torch.ones_like(layer.scales))  # nothing was copied

    gen = torch.Generator().manual_seed(1)
    words = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen)  # noqa: E731
    scales = torch.rand(8, 64, generator=gen).half() * 0.01 + 0.001
    scales[3, 5] = value
    with pytest.raises(ValueError, match=r"from_gptq: scales must be finite and non-negative.*at \(3, 5\)"):
        from_gptq(words(32, 64), words(8, 8), scales)
    with pytest.raises(ValueError, match=r"from_awq: scales must be finite and non-negative.*at \(3, 5\)"):
        from_awq(words(256, 8), words(8, 8), scales)


def _meta_cases():
    def layer(change):
        def apply(meta):
            change(meta["layers"]["up"])
            return meta

        return apply

    return [
        ("not-json", None, "{not json", r"metadata 'openkernels\.quant' is not JSON .*expected"),
        ("no-layers", lambda m: {k: v for k, v in m.items() if k != "layers"}, None, r"has no 'layers'; expected an object"),
        ("layers-list", lambda m: {**m, "layers": list(m["layers"])}, None, r"'layers' must be an object.*got list"),
        ("no-group-size", layer(lambda d: d.pop("group_size")), None,
         r"layers\['up'\] has no 'group_size'; expected a positive integer"),
        ("scale-dtype", layer(lambda d: d.update(scale_dtype="nn")), None,
         r"layers\['up'\]\['scale_dtype'\] is 'nn'; expected 'float16' or 'bfloat16'"),
        ("in-features-str", layer(lambda d: d.update(in_features="64")), None,
         r"layers\['up'\]\['in_features'\] is '64'; expected a positive integer"),
        ("kind", layer(lambda d: d.update(kind="int3")), None, r"layers\['up'\]\['kind'\] is 'int3'; expected one of"),
        ("bias-str", layer(lambda d: d.update(bias="yes")), None, r"layers\['up'\]\['bias'\] is 'yes'; expected true"),
        ("group-size-odd", layer(lambda d: d.update(group_size=3)), None, r"layers\['up'\]: .*group_size 3"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "change,raw,match", [c[1:] for c in _meta_cases()], ids=[c[0] for c in _meta_cases()]
)
def test_metadata_errors_name_file_key_and_expectation(tmp_path, saved, change, raw, match) -> None:
    tensors, meta = saved
    path = _write(
        tmp_path / "meta.safetensors", tensors, None if raw else change(json.loads(json.dumps(meta))), raw
    )
    model = _Tiny()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=match) as info:
        load_quantized(model, path)
    assert str(info.value).startswith(f"{path}: metadata 'openkernels.quant'")
    _assert_unchanged(model, before)
