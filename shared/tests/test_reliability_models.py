"""Faults and changes after kernelize on a small Llama-style model (issue 20): stacked q / k / v
and gate / up weights never go stale, whatever member changes and however; a failed kernelize
(inside quantization or in a fused MLP's prepare) and unkernelize leave the model as it was,
storage included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
for _family in ("activations", "layernorm", "attention", "quant"):
    pytest.importorskip(f"openkernels.{_family}")

from openkernels.quant.linear import Int4Linear, quantize_model  # noqa: E402
from openkernels.shared import stacked  # noqa: E402
from openkernels.shared.kernelize import kernelize, unkernelize  # noqa: E402

HIDDEN, INTER = 64, 128
_STACKED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _llama(bias: bool = False) -> nn.Module:
    """Two layers, head_dim 32; `bias`: q / k / v with biases (Qwen2-style)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   initializer_range=0.1, attention_bias=bias)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _new(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.1


def _layer(model: nn.Module) -> nn.Module:
    return model.model.layers[1]


class _Scaled(nn.Module):
    """A projection of another type (an adapter around a linear layer): no longer stackable."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return 2 * self.linear(x)


def _optimizer_step(model: nn.Module) -> None:
    params = list(model.parameters())
    for p in params:
        p.grad = _new(*p.shape)
    torch.optim.SGD(params, lr=0.5).step()


# Each change is applied to the kernelized model and to an untouched twin.
CHANGES = {
    "replace later parameter": lambda m: setattr(_layer(m).mlp.up_proj, "weight", nn.Parameter(_new(INTER, HIDDEN))),
    "replace first parameter": lambda m: setattr(_layer(m).self_attn.q_proj, "weight",
                                                 nn.Parameter(_new(HIDDEN, HIDDEN))),
    "assign .data": lambda m: setattr(_layer(m).self_attn.k_proj.weight, "data", _new(32, HIDDEN)),
    "load_state_dict assign": lambda m: m.load_state_dict({"model.layers.1.self_attn.v_proj.weight": _new(32, HIDDEN)},
                                                          strict=False, assign=True),
    "replace module": lambda m: setattr(_layer(m).mlp, "up_proj", nn.Linear(HIDDEN, INTER, bias=False)),
    "replace module, other type": lambda m: setattr(_layer(m).mlp, "up_proj", _Scaled(_layer(m).mlp.up_proj)),
    "in-place copy_": lambda m: _layer(m).mlp.up_proj.weight.detach().copy_(_new(INTER, HIDDEN)),
    "optimizer step": _optimizer_step,
    ".to() and back": lambda m: m.to(torch.float64).to(torch.float32),
}  # fmt: skip


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_stacked_weights_follow_every_member(change) -> None:
    reference, model = _llama(), _llama()
    kernelize(model)
    torch.manual_seed(3)  # nn.Linear's own init in "replace module"
    CHANGES[change](reference)
    torch.manual_seed(3)
    CHANGES[change](model)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-4)


def test_stacked_bias_follows() -> None:
    reference, model = _llama(bias=True), _llama(bias=True)
    kernelize(model)
    for m in (reference, model):
        _layer(m).self_attn.k_proj.bias = nn.Parameter(_new(32))
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-4)


def test_in_place_writes_keep_the_one_matmul() -> None:
    """Optimizer steps write into the stack itself: the stacked weight is still the one used."""
    model = _llama()
    kernelize(model)
    _optimizer_step(model)
    mlp = _layer(model).mlp
    entry = mlp.__dict__[stacked._key(("gate_proj", "up_proj"))]
    assert stacked._fresh(entry, [mlp.gate_proj, mlp.up_proj])


@pytest.mark.parametrize("change", ["in-place scales", "replace module"])
def test_int4_stack_follows_its_members(change) -> None:
    reference, model = _llama(), _llama()
    quantize_model(reference, group_size=32, progress=False)
    kernelize(model, quantize={"kind": "int4", "group_size": 32})
    replacement = Int4Linear.from_linear(nn.Linear(HIDDEN, INTER, bias=False), group_size=32)
    for m in (reference, model):
        mlp = _layer(m).mlp
        if change == "in-place scales":
            mlp.up_proj.scales.mul_(2)
        else:
            mlp.up_proj = copy.deepcopy(replacement)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-4)


def _own_storage(model: nn.Module) -> list[str]:
    """Names of stacked projections' parameters that do not own exactly their storage."""
    return [
        name
        for name, p in model.named_parameters()
        if name.split(".")[-2] in _STACKED and p.untyped_storage().nbytes() != p.numel() * p.element_size()
    ]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert now.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(now[key], value, rtol=0, atol=0, equal_nan=True, msg=key)


def test_unkernelize_restores_storage() -> None:
    model = _llama()
    state = _state(model)
    kernelize(model)
    assert _own_storage(model)  # kernelize points them at one stacked tensor
    unkernelize(model)
    assert _own_storage(model) == []
    _assert_same_state(model, state)
    assert not any(k.startswith("_openkernels") for m in model.modules() for k in m.__dict__)


def test_failed_prepare_rolls_back_storage_and_attributes(monkeypatch) -> None:
    """Layer 1's gate / up are int4 layers whose stacking fails (concat_out raises):
    kernelize fails after layer 0's stacks and layer 1's attention stack were built."""
    model = _llama()
    for name in ("gate_proj", "up_proj"):
        setattr(_layer(model).mlp, name, Int4Linear(HIDDEN, INTER, False, group_size=32))

    def fail(cls, layers):
        raise ValueError("stacking failed")

    monkeypatch.setattr(Int4Linear, "concat_out", classmethod(fail))
    state = _state(model)
    modules = list(model.named_modules())
    with pytest.raises(ValueError, match="stacking failed"):
        kernelize(model)
    assert list(model.named_modules()) == modules
    assert all(not hasattr(type(m), "_openkernels_swap") for m in model.modules())
    assert not any(k.startswith("_openkernels") for m in model.modules() for k in m.__dict__)
    assert _own_storage(model) == []
    _assert_same_state(model, state)


def test_act_order_projections_are_not_stacked() -> None:
    """Act-order int4 gate / up cannot share one matmul (each permutes x its own way):
    stackable() says so, and kernelize leaves such an MLP as it is instead of failing."""
    from openkernels.shared.stacked import stackable

    layers = [Int4Linear(HIDDEN, INTER, False, group_size=32, act_order=True) for _ in range(2)]
    assert "act-order" in stackable(layers)
    assert stackable([Int4Linear(HIDDEN, INTER, False, group_size=32) for _ in range(2)]) is None


def test_failed_quantization_rolls_back_and_names_the_layer() -> None:
    model = _llama()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 4] = float("nan")
    state = _state(model)
    modules = list(model.named_modules())
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj'.*NaN"):
        kernelize(model, quantize="int4")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert list(model.named_modules()) == modules
    _assert_same_state(model, state)
