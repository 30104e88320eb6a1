"""The decoder-layer swap that fuses the residual add before the post-attention norm
(openkernels.layernorm.decoder_fusion): taken where it should be, equal to the layer's own
forward, and out of the way where the user kept the norm (skip, hooks) or transformers
changed the layer."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openkernels.layernorm.kernelize import decoder_fusion  # noqa: E402
from openkernels.shared.kernelize import kernelize  # noqa: E402

LABEL = "layernorm.add_rms_norm(decoder layer)"
CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(dtype).eval()


def _gemma():
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**CONFIG, head_dim=16)).eval()


def _ids(seq=13):
    return torch.randint(0, CONFIG["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(3))


class _PrenormCalls:
    """Counts rms_norm calls that fuse a residual (the fused path's signature)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = decoder_fusion.rms_norm

        def counting(*args, **kwargs):
            self.count += bool(kwargs.get("prenorm"))
            return real(*args, **kwargs)

        monkeypatch.setattr(decoder_fusion, "rms_norm", counting)


@pytest.mark.parametrize("build", [_llama, _gemma], ids=["llama", "gemma"])
def test_fused_layer_matches_and_is_taken(build, monkeypatch):
    model, ids = build(), _ids()
    unfused = copy.deepcopy(model)
    with torch.no_grad():
        ref = model(ids).logits
        report = kernelize(model)
        kernelize(unfused, skip=["model.layers.?"])  # the layers themselves left
        calls = _PrenormCalls(monkeypatch)
        got = model(ids).logits
        plain = unfused(ids).logits
    assert len(report.swapped[LABEL]) == CONFIG["num_hidden_layers"], str(report)
    assert calls.count == CONFIG["num_hidden_layers"]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_bf16_residual_stream_rounds_like_the_add():
    """In bf16 the fused sum is rounded to bf16 before it is normalized and carried on, as
    the layer's `residual + hidden_states` is: equal to the unfused kernelized model up to
    the norm's last rounding."""
    model, ids = _llama(torch.bfloat16), _ids()
    unfused = copy.deepcopy(model)
    with torch.no_grad():
        exact = _llama()(ids).logits
        kernelize(model)
        kernelize(unfused, skip=["model.layers.?"])
        got, plain = model(ids).logits.float(), unfused(ids).logits.float()
    assert (got - exact).abs().max() <= 1.5 * (plain - exact).abs().max() + 1e-3
    torch.testing.assert_close(got, plain, rtol=0.05, atol=0.05)


def test_kept_norm_runs_the_layers_own_forward(monkeypatch):
    """A skipped post-attention norm, or one with a hook, is called as the model wrote it."""
    model, ids = _llama(), _ids()
    with torch.no_grad():
        ref = model(ids).logits
        report = kernelize(model, skip=["model.layers.0.post_attention_layernorm"])
        assert LABEL in report.swapped
        seen = []
        model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.append(1))
        calls = _PrenormCalls(monkeypatch)
        got = model(ids).logits
    assert calls.count == 0  # layer 0: norm skipped; layer 1: hooked
    assert seen == [1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_positional_arguments_and_old_cache_name():
    """A layer called directly, its arguments by position and the cache by its pre-5.24 name,
    gives what the layer's own forward gives."""
    model = _llama()
    kernelize(model)
    layer = model.model.layers[0]
    original = layer._openkernels_original_class
    x = torch.randn(1, 5, CONFIG["hidden_size"])
    position_ids = torch.arange(5)[None]
    cos_sin = model.model.rotary_emb(x, position_ids=position_ids)
    names, _ = decoder_fusion._SIGNATURES[original]
    positional = [None] * names.index("position_embeddings") + [cos_sin]
    with torch.no_grad():
        ref = original.forward(layer, x, *positional)
        got = layer(x, *positional)
        cache_name = "cache" if "cache" in names else "past_key_values"
        kwargs = {"position_embeddings": cos_sin, "past_key_values": None}
        if cache_name == "cache":
            got_old_name = layer(x, **kwargs)
            torch.testing.assert_close(got_old_name, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_changed_layer_is_left_with_the_reason():
    """A layer class of a listed name whose forward is not the checked template stays."""

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + 0.5 * hidden_states  # not the template's add
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states

    model, ids = _llama(), _ids()
    base = transformers.models.llama.modeling_llama.LlamaDecoderLayer
    changed = type("LlamaDecoderLayer", (base,), {"forward": forward, "__module__": __name__})
    for layer in model.model.layers:
        layer.__class__ = changed
    with torch.no_grad():
        ref = model(ids).logits
        report = kernelize(model)
        got = model(ids).logits
    assert LABEL not in report.swapped
    reasons = [r for r in report.left if r.startswith("LlamaDecoderLayer")]
    assert reasons and "template" in reasons[0], str(report)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_training_gradients_through_the_fused_norm():
    model, ids = _llama(), _ids()
    ref_model = copy.deepcopy(model).train()
    model.train()
    report = kernelize(model, mode="training")
    assert LABEL in report.swapped
    ref_model(ids).logits.square().mean().backward()
    model(ids).logits.square().mean().backward()
    for (name, p_ref), (_, p) in zip(ref_model.named_parameters(), model.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_layer_on_cuda_bf16():
    """On the GPU in bf16 (the kernels the decode step runs): as close to the float32 model
    as the unfused kernelized model is."""
    ids = _ids(seq=37).cuda()
    model = _llama(torch.bfloat16).cuda()
    unfused = copy.deepcopy(model)
    with torch.no_grad():
        exact = _llama().cuda()(ids).logits
        report = kernelize(model)
        kernelize(unfused, skip=["model.layers.?"])
        got, plain = model(ids).logits.float(), unfused(ids).logits.float()
    assert LABEL in report.swapped
    assert torch.isfinite(got).all()
    assert (got - exact).abs().max() <= 1.5 * (plain - exact).abs().max() + 1e-3


def test_mixed_dtypes_promote_as_the_add_does():
    """A float32 residual stream with bfloat16 attention output (a hook casts it): the sum and
    the norm come out in float32, as `residual + hidden_states` and the norm give them."""
    model = _llama()
    kernelize(model)
    layer = model.model.layers[0]
    layer.self_attn.register_forward_hook(lambda m, i, out: (out[0].bfloat16(), out[1]))
    original = layer._openkernels_original_class
    x = torch.randn(2, 5, CONFIG["hidden_size"])
    cos_sin = model.model.rotary_emb(x, position_ids=torch.arange(5)[None])
    with torch.no_grad():
        ref = original.forward(layer, x, position_embeddings=cos_sin)
        got = layer(x, position_embeddings=cos_sin)
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
