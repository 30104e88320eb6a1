"""kernelize on Hugging Face architectures (small configs, random weights, CPU): outputs and
gradients against the unmodified model, generation, torch.compile, int4, undo, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")
for _family in ("activations", "layernorm", "attention", "quant"):
    pytest.importorskip(f"openkernels.{_family}")

from openkernels.shared.kernelize import (  # noqa: E402
    KernelizeReport,
    available_swaps,
    kernelize,
    kernelize_report,
    unkernelize,
)

VOCAB = 128
# Large enough init that greedy decoding has clear winners (no near-ties at fp32 noise).
COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.1
)
DECODER = dict(COMMON, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=256)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODER))


def _mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(**DECODER, sliding_window=8))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**DECODER))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DECODER, head_dim=32))


def _gemma2():
    cfg = transformers.Gemma2Config(**DECODER, head_dim=32, sliding_window=8, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0)  # fmt: skip
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3():
    cfg = transformers.Gemma3TextConfig(**DECODER, head_dim=32, sliding_window=8)
    return transformers.Gemma3ForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=256,
                                  initializer_range=0.1)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _bert():  # all-MiniLM-L6-v2's shape, smaller
    cfg = transformers.BertConfig(**COMMON, intermediate_size=256, max_position_embeddings=256)
    return transformers.BertModel(cfg, add_pooling_layer=False)


DECODERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma2": _gemma2,
            "gemma3": _gemma3, "gpt2": _gpt2}  # fmt: skip
MODELS = {**DECODERS, "bert": _bert}
# What each architecture must get swapped (report labels), beyond the attention patch.
EXPECTED = {
    "llama": {
        "layernorm.rms_norm": 5,
        "activations.gated_mlp": 2,
        "attention.qkv_rotary": 2,
        "layernorm.add_rms_norm(decoder layer)": 2,
    },
    "mistral": {
        "layernorm.rms_norm": 5,
        "activations.gated_mlp": 2,
        "attention.qkv_rotary": 2,
        "layernorm.add_rms_norm(decoder layer)": 2,
    },
    "qwen2": {
        "layernorm.rms_norm": 5,
        "activations.gated_mlp": 2,
        "attention.qkv_rotary": 2,
        "layernorm.add_rms_norm(decoder layer)": 2,
    },
    "qwen3": {
        "layernorm.rms_norm": 9,
        "activations.gated_mlp": 2,
        "attention.qkv_rotary": 2,
        "layernorm.add_rms_norm(decoder layer)": 2,
    },  # + q_norm / k_norm per layer
    "gemma2": {"layernorm.rms_norm(1 + w)": 9, "activations.gated_mlp": 2},
    "gemma3": {"layernorm.rms_norm(1 + w)": 13, "activations.gated_mlp": 2},
    "gpt2": {"layernorm.layer_norm": 5, "activations.activation": 2},
    "bert": {"layernorm.add_layer_norm": 4, "layernorm.layer_norm": 1, "activations.dense_act": 2},
}


def _model(arch: str, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[arch]().to(dtype).eval()


def _inputs(batch: int = 2, seq: int = 19) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _out(model, ids):
    out = model(ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_outputs_match_fp32_and_undo(arch):
    model, ids = _model(arch), _inputs()
    with torch.no_grad():
        ref = _out(model, ids)
        report = kernelize(model)
        got = _out(model, ids)
        assert kernelize_report(model) is report
        unkernelize(model)
        back = _out(model, ids)
    counts = {label: len(names) for label, names in report.swapped.items()}
    assert counts == EXPECTED[arch], str(report)
    assert report.patched["attention.attn_implementation"].endswith("'openkernels'")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(back, ref)  # unkernelize is exact
    assert all(not hasattr(type(m), "_openkernels_swap") for m in model.modules())


@pytest.mark.parametrize("arch", sorted(DECODERS))
def test_greedy_generation_identical_fp32(arch):
    model, ids = _model(arch), _inputs(batch=1, seq=7)
    kwargs = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        kernelize(model)
        got = model.generate(ids, **kwargs)
    assert got.shape == (1, 7 + 64)
    assert torch.equal(got, ref), f"first difference at {(got != ref).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "bert"])
def test_bf16_error_no_worse_than_transformers(arch):
    """In bf16 the kernelized model may differ from the unmodified one, but its distance to
    the float32 model must be of the size of transformers' own bf16 error."""
    ids = _inputs()
    with torch.no_grad():
        exact = _out(_model(arch), ids)
        hf = _model(arch, torch.bfloat16)
        hf_err = (_out(hf, ids).float() - exact).abs().max().item()
        kernelize(hf)
        ours_err = (_out(hf, ids).float() - exact).abs().max().item()
    assert hf_err > 0 and ours_err <= 1.5 * hf_err + 1e-3, (ours_err, hf_err)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gpt2", "bert"])
def test_training_gradients_match(arch):
    ids = _inputs()
    ref_model = _model(arch).train()
    model = copy.deepcopy(ref_model)
    for m in (ref_model, model):  # dropout off: compare the math, not the random masks
        for sub in m.modules():
            if isinstance(sub, torch.nn.Dropout):
                sub.p = 0.0
    report = kernelize(model, mode="training")
    assert report.num_swapped > 0
    _out(ref_model, ids).float().square().mean().backward()
    _out(model, ids).float().square().mean().backward()
    for (name, p_ref), (_, p) in zip(ref_model.named_parameters(), model.named_parameters(), strict=True):
        if p_ref.grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_inference_mode_with_gradients_still_reaches_parameters():
    """The stacked gate / up weight of inference mode is not used when gradients flow."""
    ids = _inputs()
    ref_model = _model("llama")
    model = copy.deepcopy(ref_model)
    kernelize(model)  # inference mode, but grad enabled below
    _out(ref_model, ids).square().mean().backward()
    _out(model, ids).square().mean().backward()
    gate = "model.layers.0.mlp.gate_proj.weight"
    g_ref = dict(ref_model.named_parameters())[gate].grad
    g = dict(model.named_parameters())[gate].grad
    assert g is not None
    torch.testing.assert_close(g, g_ref, rtol=1e-3, atol=1e-5)


def test_torch_compile():
    model, ids = _model("llama"), _inputs()
    with torch.no_grad():
        ref = _out(model, ids)
        kernelize(model)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
        got = _out(compiled, ids)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_int4_quantize_and_undo():
    model, ids = _model("llama"), _inputs()
    from openkernels.quant import Int4Linear, quantize_model

    quantized_ref = copy.deepcopy(model)
    quantize_model(quantized_ref, progress=False)  # same quantization, no swaps
    with torch.no_grad():
        ref = _out(model, ids)
        expect = _out(quantized_ref, ids)
        report = kernelize(model, quantize="int4")
        got = _out(model, ids)
        assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
        assert len(report.swapped["quant.int4_linear"]) == 14  # 7 per layer; lm_head skipped
        assert any("lm_head" in names for names in report.left.values())
        unkernelize(model)
        back = _out(model, ids)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    assert (got - ref).abs().max() > 0  # it really is 4-bit
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert torch.equal(back, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_decode_step_hands_norms_and_activation_to_the_projections(dtype, monkeypatch):
    """Where a 4-bit GEMV computes the activation or the norm itself (Int4Linear.gated_fuses /
    normed_fuses, forced here on the CPU, where the ops compose), a one-token step of the
    kernelized decoder hands the stacked q / k / v and gate / up layers their un-normed input
    with the norm (forward_normed), o_proj the residual (forward_add), the down_proj the stacked
    gate / up output (forward_gated): per layer, once each; the logits those of the step with
    every norm and activation in its own launch (the fuses forced False), within the
    roundings the fusions move. Two tokens keep the input norm's deferral and the gated down
    projection, and run the residual add and the post-attention norm as before."""
    from openkernels.quant import Int4Linear

    model, ids = _model("llama", dtype), _inputs(1, 1)
    calls = []
    for name in ("forward_gated", "forward_normed", "forward_add"):
        original = getattr(Int4Linear, name)

        def counted(self, *args, _name=name, _original=original):
            calls.append((_name, self.out_features))
            return _original(self, *args)

        monkeypatch.setattr(Int4Linear, name, counted)
    with torch.no_grad():
        kernelize(model, quantize="int4")
        monkeypatch.setattr(Int4Linear, "gated_fuses", lambda self, gate_up, act: False)
        monkeypatch.setattr(Int4Linear, "normed_fuses", lambda self, x, weight: False)
        unfused = _out(model, ids)
        calls.clear()
        monkeypatch.setattr(Int4Linear, "gated_fuses", lambda self, gate_up, act: True)
        monkeypatch.setattr(Int4Linear, "normed_fuses", lambda self, x, weight: True)
        fused = _out(model, ids)
        layer = model.model.layers[0]
        qkv = sum(getattr(layer.self_attn, p).out_features for p in ("q_proj", "k_proj", "v_proj"))
        per_layer = [("forward_normed", qkv), ("forward_add", layer.self_attn.o_proj.out_features),
                     ("forward_normed", 2 * layer.mlp.up_proj.out_features),
                     ("forward_gated", layer.mlp.down_proj.out_features)]  # fmt: skip
        assert calls == per_layer * len(model.model.layers), calls
        calls.clear()
        _out(model, _inputs(1, 2))
        assert [c[0] for c in calls] == ["forward_normed", "forward_gated"] * len(model.model.layers), calls
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["rows", "tiled"])
def test_int4_forward_never_builds_a_layer_weight(layout, monkeypatch):
    """The swapped modules' calls read a 4-bit layer's parts, never its `weight` property: that
    builds an Int4Weight, with tiled codes a copy of them (it was two copies a layer per decode
    step: the attention's q / k sizes)."""
    from openkernels.quant import Int4Linear

    model, ids = _model("llama"), _inputs(1, 5)
    with torch.no_grad():
        kernelize(model, quantize={"kind": "int4", "layout": layout})
        built = []
        weight = Int4Linear.weight
        monkeypatch.setattr(
            Int4Linear, "weight", property(lambda self: built.append(self) or weight.fget(self))
        )
        for _ in range(3):  # the first calls and the replayed ones
            _out(model, ids)
    assert built == []
    assert model.model.layers[0].self_attn.q_proj.layout == layout


def test_state_dict_unchanged_and_saveable():
    safetensors = pytest.importorskip("safetensors.torch")
    model = _model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kernelize(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    safetensors.save(after)  # refuses tensors that share memory
    torch.save(after, io.BytesIO())


def test_cast_after_kernelize_stays_correct():
    """A dtype cast replaces the stacked parameters' storage; the fused MLP notices."""
    model, ids = _model("llama"), _inputs()
    kernelize(model)
    model.to(torch.float64)
    with torch.no_grad():
        got = _out(model, ids)
        unkernelize(model)
        ref = _out(model, ids)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_families_and_skip():
    model = _model("llama")
    report = kernelize(model, families=["layernorm"], skip=["model.layers.1.*"])
    # Layer 1 itself is not skipped, so its decoder swap lands, but with its norms skipped it
    # runs its own forward at call time (packages/layernorm/tests/test_decoder_fusion.py).
    assert set(report.swapped) == {"layernorm.rms_norm", "layernorm.add_rms_norm(decoder layer)"}
    assert len(report.swapped["layernorm.rms_norm"]) == 3  # layer 0's two + the final norm
    assert len(report.left["skipped by request"]) == 2
    assert model.config._attn_implementation != "openkernels"
    assert "swapped" in str(report) and "left" in str(report)


def test_plain_module_reports_no_attention_registry():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(3, 8)
    ref = model(x)
    report = kernelize(model)
    torch.testing.assert_close(model(x), ref)
    assert report.swapped == {"activations.activation": ["1"], "layernorm.layer_norm": ["2"]}
    assert any("not a transformers model" in reason for reason in report.left)


def test_available_swaps_lists_every_family():
    offered = available_swaps()
    assert {"activations", "layernorm", "attention", "quant"} <= set(offered)
    assert all(offered.values())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mode": "serve"}, ValueError, "mode must be one of"),
        ({"quantize": "int3"}, ValueError, "quantize must be"),
        ({"quantize": "int4", "mode": "training"}, ValueError, "no gradients"),
        ({"families": ["nope"]}, ValueError, "not installed"),
        ({"quantize": {"kind": "int4", "bits": 3}}, ValueError, "unknown quantize options"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    model = _model("llama")
    with pytest.raises(error, match=match):
        kernelize(model, **kwargs)
    assert kernelize_report(model) is None
    assert all(not hasattr(type(m), "_openkernels_swap") for m in model.modules())  # rolled back


def test_twice_and_undo_errors():
    model = _model("gpt2")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        kernelize(object())
    with pytest.raises(RuntimeError, match="not kernelized"):
        unkernelize(model)
    assert isinstance(kernelize(model), KernelizeReport)
    with pytest.raises(RuntimeError, match="already kernelized"):
        kernelize(model)


def test_in_place_swaps_leave_a_hooked_or_identity_dense_alone():
    """BertIntermediate's dense + activation and BertSelfOutput's dense + add + LayerNorm write
    over the dense layer's output when nothing else holds it: a forward hook keeping it (an
    activation cache) or an nn.Identity dense (the caller's own tensor) once saw it
    overwritten."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertIntermediate, BertSelfOutput

    cfg = BertConfig(hidden_size=16, intermediate_size=32)
    for cls, args in ((BertIntermediate, (torch.randn(2, 16),)), (BertSelfOutput, (torch.randn(2, 16), torch.randn(2, 16)))):  # fmt: skip
        module = cls(cfg).eval()
        want = module(*args)
        seen = []
        module.dense.register_forward_hook(lambda m, i, o, seen=seen: seen.append((o, o.clone())))
        kernelize(module)
        with torch.no_grad():
            got = module(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(*seen[-1]), cls.__name__
        unkernelize(module)
        if cls is BertSelfOutput:
            module.dense = torch.nn.Identity()
            hidden = args[0].clone()
            kernelize(module)
            with torch.no_grad():
                module(hidden, args[1])
            assert torch.equal(hidden, args[0])
