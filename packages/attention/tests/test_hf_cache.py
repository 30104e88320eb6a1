"""OpenKernelsCache: Hugging Face generate() and forward() decoding against openkernels' KV cache
(16-bit, int8, int4) through attn_implementation="openkernels", against transformers' own
DynamicCache + SDPA on a tiny random Llama. OpenKernelsStaticCache (the compileable variant):
the same tokens and logits eagerly, and a decode step under torch.compile (aot_eager, and
inductor where a C++ compiler is found) matching eager with one graph for every step.

Tolerances (logits, relative to the largest |logit| of the float32 unquantized run):
- float32, 16-bit cache: the CPU path is torch's attention on the cached tensors, so logits
  match DynamicCache + SDPA to float32 rounding (bound 1e-5; measured 0) and greedy tokens are
  identical.
- float32, int8/int4: the reference is the same model with a DynamicCache that stores
  dequantize_kv(quantize_kv(k)) (the cache format, simulated in float32): the kernel adds only
  float32 rounding (bound 1e-5; measured 0). Against the unquantized DynamicCache the format
  itself costs an error proportional to its rounding step, 1 / (2^bits - 1) of each token's
  range (round to nearest: at most half a step per element, carried about linearly to the
  logits). Measured here, in units of that step: max error 3.7 (int8: 1.4e-2) and 4.3 (int4:
  0.28), relative L2 error 3.0 (1.2e-2) and 2.9 (0.19). The bounds are 8 steps for the max
  per step (int8 3.1e-2, int4 0.53) and 5 for the relative L2 error (int8 2.0e-2, int4 0.33).
- bfloat16: the model's own bf16 rounding dominates. Against the float32 run of the same
  cache format, our error must stay within 2x transformers' bf16 SDPA + DynamicCache (the
  same format simulated in bf16) plus 1e-3 (measured ratios 0.89-1.04: max errors 2.0e-2,
  2.6e-2, 0.12 for 16-bit, int8, int4).
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import shutil
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import openkernels.attention as A  # noqa: E402
from openkernels.attention.core import cpu  # noqa: E402
from openkernels.attention.kvcache.cache import KVCache  # noqa: E402
from openkernels.attention.kvcache.format import FP8, QuantizedKV, dequantize_kv, quantize_fp8, quantize_kv  # noqa: E402

BATCH, PROMPT, NEW = 2, 11, 20
LAYERS = 2
_KV = {16: None, 8: "int8", 4: "int4"}
# transformers 5 names the forward's cache argument `cache` (`past_key_values` before).
CACHE_KW = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@pytest.fixture(scope="module")
def models() -> dict:
    """The same random weights twice: transformers' SDPA, and openkernels' attention. An
    initializer range of 0.1 gives attention scores of order 1 (0.02 leaves them near uniform,
    which would hide errors in the keys)."""
    A.register_with_transformers()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                         pad_token_id=0, initializer_range=0.1)  # fmt: skip
    ref = LlamaForCausalLM(copy.deepcopy(config)).eval()
    ref.set_attn_implementation("sdpa")
    ours = LlamaForCausalLM(copy.deepcopy(config)).eval()
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation("openkernels")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 256, (BATCH, PROMPT), generator=g)
    tokens = torch.randint(1, 256, (BATCH, NEW), generator=g)
    return {"ref": ref, "ours": ours, "prompt": prompt, "tokens": tokens}


def _as(model, dtype):
    return copy.deepcopy(model).to(dtype) if dtype != torch.float32 else model


class _FormatLayer(DynamicLayer):
    """DynamicLayer that stores keys and values as the int8/int4 cache format reads them back
    (quantize_kv then dequantize_kv into the model's dtype): the format, simulated."""

    def __init__(self, bits: int) -> None:
        super().__init__()
        self.bits = bits

    def update(self, key_states, value_states, *args, **kwargs):
        if self.bits == "fp8":  # (batch, heads, tokens, head_dim): heads where the format has them last
            key_states, value_states = (
                dequantize_kv(QuantizedKV.fp8(quantize_fp8(t.transpose(1, 2), torch.ones(t.shape[1])),
                                              torch.ones(t.shape[1])), t.dtype).transpose(1, 2)
                for t in (key_states, value_states)
            )  # fmt: skip
        elif self.bits != 16:
            key_states, value_states = (dequantize_kv(quantize_kv(t, self.bits), t.dtype)
                                        for t in (key_states, value_states))  # fmt: skip
        return super().update(key_states, value_states)


def _format_cache(bits: int) -> Cache:
    return Cache(layers=[_FormatLayer(bits) for _ in range(LAYERS)])


def _logits(model, cache, prompt, tokens) -> torch.Tensor:
    """Prefill the prompt, then decode `tokens` one by one (teacher forced, so both runs see the
    same inputs): float32 logits (batch, prompt + new, vocab), one row per position."""
    rows = []
    with torch.no_grad():
        out = model(prompt, use_cache=True, **{CACHE_KW: cache})
        rows.append(out.logits.float())
        for t in tokens.unbind(1):
            out = model(t[:, None], use_cache=True, **{CACHE_KW: cache})
            rows.append(out.logits.float())
    return torch.cat(rows, 1)


def _step_errors(x: torch.Tensor, ref: torch.Tensor, scale: float) -> torch.Tensor:
    """Max |x - ref| per step (the prefill, then each decode step) relative to `scale`."""
    err = (x - ref).abs().amax(dim=(0, 2)) / scale
    return torch.cat([err[:PROMPT].amax()[None], err[PROMPT:]])


def _generate(model, prompt, cache=None, **kwargs) -> torch.Tensor:
    extra = {} if cache is None else {CACHE_KW: cache}
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                          **extra, **kwargs)  # fmt: skip


# ---- greedy generate: 16-bit cache, float32 ----------------------------------------------


def test_generate_float32_gives_the_dynamic_cache_tokens(models, monkeypatch) -> None:
    calls = []
    attend = KVCache.attend
    monkeypatch.setattr(
        KVCache, "attend", lambda self, *a, **k: calls.append(a[0].shape) or attend(self, *a, **k)
    )
    want = _generate(models["ref"], models["prompt"])
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, PROMPT + NEW)
    got = _generate(models["ours"], models["prompt"], cache)
    assert torch.equal(got, want)
    # Every layer attended through the cache: the prefill, then one query per step.
    assert calls[0] == (BATCH, PROMPT, 4, 32) and calls[-1] == (BATCH, 1, 4, 32)
    assert len(calls) == LAYERS * NEW
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is never fed back
    assert isinstance(cache, Cache) and isinstance(cache, A.OpenKernelsCache)


def test_float32_logits_match_the_dynamic_cache(models) -> None:
    p, t = models["prompt"], models["tokens"]
    want = _logits(models["ref"], DynamicCache(), p, t)
    got = _logits(models["ours"], A.OpenKernelsCache(models["ours"].config, BATCH, 64), p, t)
    assert (_step_errors(got, want, float(want.abs().max())) <= 1e-5).all()


# ---- int8 / int4: per-step logits --------------------------------------------------------


@pytest.fixture
def flash_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantized caches' attention (dequantized, then dense) on PyTorch's flash kernel, the
    reference model's SDPA: another kernel's float32 rounding (the C++ kernel of few rows,
    ~2e-7 per output) moves a value across a rounding boundary of the next layer's cached
    format now and then, a whole step of the format (logits ~1e-4 apart). Comparing to the
    format at float32 rounding needs the same dense kernel on both sides."""
    monkeypatch.setattr(cpu, "FORCE_PATH", "sdpa")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.usefixtures("flash_kernel")
def test_quantized_float32_logits(models, bits: int) -> None:
    p, t = models["prompt"], models["tokens"]
    exact = _logits(models["ref"], DynamicCache(), p, t)
    scale = float(exact.abs().max())
    fmt = _logits(models["ref"], _format_cache(bits), p, t)
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64, kv_dtype=_KV[bits])
    got = _logits(models["ours"], cache, p, t)
    # The storage really is the quantized format.
    kv = cache.layers[0].kv
    assert isinstance(kv.k, QuantizedKV) and kv.k.bits == bits and kv.k.data.dtype == torch.uint8
    # What the kernel computes: the format's keys and values, to float32 rounding.
    err = _step_errors(got, fmt, scale)
    assert (err <= 1e-5).all(), f"int{bits} vs the simulated format: {err.max():.2e}"
    # What the format costs against the unquantized cache (the module docstring's derivation).
    step = 1 / ((1 << bits) - 1)
    err = _step_errors(got, exact, scale)
    rel_l2 = float((got - exact).norm() / exact.norm())
    assert (err <= 8 * step).all(), f"int{bits}: per-step max error {err.tolist()} > {8 * step:.3g}"
    assert rel_l2 <= 5 * step, f"int{bits}: relative L2 error {rel_l2:.3g} > {5 * step:.3g}"
    assert err.max() > 0  # quantization did happen


@pytest.mark.usefixtures("flash_kernel")
def test_fp8_float32_logits(models) -> None:
    """kv_dtype="fp8" (scale 1.0 per head): the kernel computes the format's keys and values
    to float32 rounding; the format costs e4m3's 3 mantissa bits against the exact cache."""
    p, t = models["prompt"], models["tokens"]
    exact = _logits(models["ref"], DynamicCache(), p, t)
    scale = float(exact.abs().max())
    fmt = _logits(models["ref"], _format_cache("fp8"), p, t)
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64, kv_dtype="fp8")
    got = _logits(models["ours"], cache, p, t)
    kv = cache.layers[0].kv
    assert isinstance(kv.k, QuantizedKV) and kv.k.data.dtype == FP8 and kv.k_scale.tolist() == [1.0, 1.0]
    err = _step_errors(got, fmt, scale)
    assert (err <= 1e-5).all(), f"fp8 vs the simulated format: {err.max():.2e}"
    err = _step_errors(got, exact, scale)
    assert 0 < err.max() <= 8 * 2.0**-4, f"fp8: per-step max error {err.tolist()}"


def test_keys_by_channel_float32_logits(models) -> None:
    """OpenKernelsCache(kv_dtype="int4", key_group=32): the storage is keys by channel, and
    the logits stay within int4's format error of the exact cache (per-step bound as for
    int4 per token); the static cache refuses it (it passes every left padding on)."""
    t = models["tokens"]
    p = torch.cat((models["prompt"], t), 1)  # 31 + 20 tokens: the decode fills the first group
    exact = _logits(models["ref"], DynamicCache(), p, t)
    scale = float(exact.abs().max())
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64, kv_dtype="int4", key_group=32)
    got = _logits(models["ours"], cache, p, t)
    kv = cache.layers[0].kv
    assert kv.k.key_group == 32 and kv.k.residual is not None
    assert kv.lengths == [PROMPT + 2 * NEW] * BATCH and not torch.isnan(kv.k.scale[:, 0]).any()
    step = 1 / 15
    err = (got - exact).abs().amax(dim=(0, 2)) / scale  # per position
    assert 0 < err.max() <= 8 * step, f"int4 keys by channel: per-step max error {err.tolist()}"
    with pytest.raises(ValueError, match="key_group"):
        A.OpenKernelsStaticCache(models["ours"].config, BATCH, 64, kv_dtype="int4", key_group=32)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_bfloat16_logits_within_transformers_own_bf16_error(models, bits: int) -> None:
    p, t = models["prompt"], models["tokens"]
    ref32 = _logits(models["ref"], _format_cache(bits), p, t)
    scale = float(ref32.abs().max())
    hf16 = _logits(_as(models["ref"], torch.bfloat16), _format_cache(bits), p, t)
    ours16 = _as(models["ours"], torch.bfloat16)
    got = _logits(ours16, A.OpenKernelsCache(ours16.config, BATCH, 64, kv_dtype=_KV[bits]), p, t)
    ours_err, hf_err = _step_errors(got, ref32, scale), _step_errors(hf16, ref32, scale)
    assert (ours_err <= 2 * hf_err.max() + 1e-3).all(), (
        f"bf16 int{bits}: ours {ours_err.max():.2e}, transformers {hf_err.max():.2e}"
    )


# ---- cache behaviour ---------------------------------------------------------------------


def _check_reuse_after_reset(model, cache, p, t, first: torch.Tensor, *, too_many: int) -> None:
    """What a reset cache must do, dynamic or static: the prompt and 3 tokens run again give
    `first` (their logits before the reset), a token dropped by crop(-1) is written over by the
    next one, and `too_many` more tokens are refused for the capacity."""
    assert torch.equal(_logits(model, cache, p, t[:, :3]), first)  # reused from scratch
    cache.crop(-1)
    again = _logits(model, cache, t[:, 2:3], t[:, :0])
    assert torch.equal(again[:, 0], first[:, -1])
    with pytest.raises(ValueError, match="capacity"):
        _logits(model, cache, torch.ones(BATCH, too_many, dtype=torch.long), t[:, :0])


def test_seq_length_reset_crop_and_reuse(models) -> None:
    model, p, t = models["ours"], models["prompt"], models["tokens"]
    cache = A.OpenKernelsCache(model.config, BATCH, 40, kv_dtype="int8")
    assert cache.get_seq_length() == 0 and cache.get_max_length() == 40 and cache.nbytes == 0
    first = _logits(model, cache, p, t[:, :3])
    assert cache.get_seq_length() == PROMPT + 3 and len(cache.layers) == LAYERS
    assert all(layer.get_seq_length() == PROMPT + 3 for layer in cache.layers)
    assert cache.get_mask_sizes(1, 0) == (PROMPT + 4, 0)
    assert cache.nbytes > 0
    cache.crop(-2)
    assert cache.get_seq_length() == PROMPT + 1
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes > 0  # storage kept
    _check_reuse_after_reset(model, cache, p, t, first, too_many=40)


def test_several_new_tokens_against_a_filled_cache(models) -> None:
    # transformers materializes the causal mask here (5 queries, 16 keys); it hides no cached
    # token, so the cache path takes it. Chunked prefill in generate() does the same.
    p, t = models["prompt"], models["tokens"]
    ids = torch.cat([p, t[:, :5]], 1)
    want = _logits(models["ref"], DynamicCache(), ids, t[:, 5:8])
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64)
    with torch.no_grad():
        first = models["ours"](p, use_cache=True, **{CACHE_KW: cache}).logits
    rest = _logits(models["ours"], cache, t[:, :5], t[:, 5:8])
    got = torch.cat([first, rest], 1)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    chunked = _generate(
        models["ours"], p, A.OpenKernelsCache(models["ours"].config, BATCH, 64), prefill_chunk_size=4
    )
    assert torch.equal(chunked, _generate(models["ref"], p))


def _mistral_pair(models, sliding_window: int):
    """A Mistral-style model (every layer windowed) with the test models' sizes, twice with
    the same random weights: transformers' SDPA, and openkernels' attention."""
    config = transformers.MistralConfig(
        **{**models["ours"].config.to_dict(), "sliding_window": sliding_window}
    )
    ref = transformers.MistralForCausalLM(copy.deepcopy(config)).eval()
    ref.set_attn_implementation("sdpa")
    ours = transformers.MistralForCausalLM(copy.deepcopy(config)).eval()
    ours.load_state_dict(ref.state_dict())
    ours.set_attn_implementation("openkernels")
    return ref, ours


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_sliding_window_model(models, static) -> None:
    # Mistral-style window on every layer: the cache keeps every token and the kernel applies
    # the window (transformers' W: a token sees itself and the W - 1 before it).
    ref, ours = _mistral_pair(models, sliding_window=6)
    p, t = models["prompt"], models["tokens"][:, :6]
    want = _logits(ref, DynamicCache(config=ref.config), p, t)
    cache = _static(ours) if static else A.OpenKernelsCache(ours.config, BATCH, 64)
    assert cache.is_sliding == [True] * LAYERS
    got = _logits(ours, cache, p, t)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    ref.config.sliding_window = None  # the window does change these logits
    assert not torch.allclose(_logits(ref, DynamicCache(), p, t), want, rtol=0, atol=1e-2)


def test_beam_search_reorders_the_cache(models) -> None:
    kwargs = {"num_beams": 2, "max_new_tokens": 8}
    p = models["prompt"]
    want = models["ref"].generate(p, attention_mask=torch.ones_like(p), do_sample=False, **kwargs)
    cache = A.OpenKernelsCache(models["ours"].config, 2 * BATCH, PROMPT + 8)
    got = models["ours"].generate(
        p, attention_mask=torch.ones_like(p), do_sample=False, **{CACHE_KW: cache}, **kwargs
    )
    assert torch.equal(got, want)


def test_left_padded_batch_gives_transformers_tokens(models) -> None:
    """A left-padded batch: generate() hides each sequence's padding with its mask; the cache
    path turns that mask into attention_with_kvcache's cache_leftpad. The tokens are the sdpa
    model's with the same padded batch and mask, and each sequence's are what it gets alone."""
    p = models["prompt"].clone()
    mask = torch.ones_like(p)
    p[0, :3], mask[0, :3] = 0, 0  # sequence 0 is left-padded by 3 tokens (pad_token_id 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = models["ref"].generate(p, **kwargs)
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, PROMPT + NEW)
    got = models["ours"].generate(p, **kwargs, **{CACHE_KW: cache})
    assert torch.equal(got, want)
    alone = _generate(models["ref"], p[:1, 3:])
    assert torch.equal(got[0, 3:], alone[0])


def test_left_padded_batch_with_a_sliding_window(models) -> None:
    """Padding and a window together: the mask's first visible key may be the window's start,
    not the padding's end; both hide the same keys."""
    ref, ours = _mistral_pair(models, sliding_window=6)
    p = models["prompt"].clone()
    mask = torch.ones_like(p)
    p[1, :4], mask[1, :4] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    cache = A.OpenKernelsCache(ours.config, BATCH, PROMPT + 8)
    assert torch.equal(ours.generate(p, **kwargs, **{CACHE_KW: cache}), ref.generate(p, **kwargs))


def test_masks_other_than_left_padding_are_refused(models) -> None:
    p = models["prompt"]
    mask = torch.ones_like(p)
    mask[0, 4] = 0  # a hole in the middle of sequence 0
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64)
    with pytest.raises(NotImplementedError, match="other than a left padding"):
        models["ours"].generate(
            p, attention_mask=mask, max_new_tokens=2, do_sample=False, **{CACHE_KW: cache}
        )


def test_torch_compile_is_not_required(models, monkeypatch) -> None:
    # Not a compileable cache: generate() does not try to compile even where it would (asked to
    # compile on every device here), and nothing reaches torch.compile.
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)
    cache = A.OpenKernelsCache(models["ours"].config, BATCH, 64, kv_dtype="int4")
    assert not cache.is_compileable
    config = transformers.CompileConfig()
    config._compile_all_devices = True
    out = _generate(models["ours"], models["prompt"], cache, compile_config=config)
    assert out.shape == (BATCH, PROMPT + NEW)


def test_errors(models) -> None:
    ours, ref, p = models["ours"], models["ref"], models["prompt"]
    with pytest.raises(ValueError, match="batch_size=3"):
        _logits(ours, A.OpenKernelsCache(ours.config, 3, 64), p, p[:, :0])
    with pytest.raises(ValueError, match="kv_dtype"):
        A.OpenKernelsCache(ours.config, BATCH, 64, kv_dtype="int2")
    with pytest.raises(TypeError, match="model's dtype"):
        _logits(ours, A.OpenKernelsCache(ours.config, BATCH, 64, kv_dtype=torch.bfloat16), p, p[:, :0])
    # A model on another attention implementation meets the handle, not tensors: it says so.
    with pytest.raises(AttributeError, match="attn_implementation='openkernels'"):
        _logits(ref, A.OpenKernelsCache(ref.config, BATCH, 64), p, p[:, :0])
    with pytest.raises(RuntimeError, match="no_grad"):
        ours(p, use_cache=True, **{CACHE_KW: A.OpenKernelsCache(ours.config, BATCH, 64)})


def test_package_imports_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import openkernels.attention as A\n"
        "assert 'OpenKernelsCache' in A.__all__ and 'OpenKernelsStaticCache' in A.__all__\n"
        "try:\n    A.OpenKernelsCache(None, 1, 16)\nexcept ImportError as e:\n    print('ImportError', e)\n"
        "try:\n    A.OpenKernelsStaticCache(None, 1, 16)\nexcept ImportError as e:\n    print('Static', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "ImportError OpenKernelsCache needs Hugging Face transformers" in run.stdout
    assert "Static OpenKernelsCache needs Hugging Face transformers" in run.stdout


# ---- OpenKernelsStaticCache: compileable ------------------------------------------------


def _static(model, bits: int = 16, max_seqlen: int = 64, batch: int = BATCH):
    return A.OpenKernelsStaticCache(model.config, batch, max_seqlen, kv_dtype=_KV[bits])


def _greedy(model, cache, prompt, steps: int) -> torch.Tensor:
    """A manual prefill + decode loop: the greedy tokens (batch, steps)."""
    out, tokens = None, []
    with torch.no_grad():
        out = model(prompt, use_cache=True, **{CACHE_KW: cache})
        for _ in range(steps):
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            out = model(tokens[-1], use_cache=True, **{CACHE_KW: cache})
    return torch.cat(tokens, 1)


def test_static_greedy_tokens_match_the_dynamic_cache(models) -> None:
    ref, ours, p = models["ref"], models["ours"], models["prompt"]
    cache = _static(ours)
    assert cache.is_compileable and isinstance(cache, Cache) and isinstance(cache, A.OpenKernelsStaticCache)
    assert torch.equal(_greedy(ours, cache, p, NEW), _greedy(ref, DynamicCache(), p, NEW))
    assert int(cache.get_seq_length()) == PROMPT + NEW
    want = _generate(ref, p)
    with warnings.catch_warnings():  # past_key_values= is transformers 5's deprecated name of cache=
        warnings.simplefilter("ignore", FutureWarning)
        got = _generate(ours, p, past_key_values=_static(ours, max_seqlen=PROMPT + NEW))
    assert torch.equal(got, want)  # on CPU generate() runs it eagerly (no auto-compile)
    # Chunked prefill (several new tokens against a filled cache: transformers' mask is checked and
    # accepted) and a cache initialized ahead of time (transformers' early_initialization).
    cache = _static(ours)
    cache.early_initialization(BATCH, 2, 32, torch.float32, torch.device("cpu"))
    assert torch.equal(_generate(ours, p, cache, prefill_chunk_size=4), want)
    # Beam search reorders the rows in place.
    kwargs = {"num_beams": 2, "max_new_tokens": 6, "do_sample": False}
    beams = ref.generate(p, attention_mask=torch.ones_like(p), **kwargs)
    cache = _static(ours, batch=2 * BATCH, max_seqlen=PROMPT + 6)
    assert torch.equal(
        ours.generate(p, attention_mask=torch.ones_like(p), **{CACHE_KW: cache}, **kwargs), beams
    )


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_static_logits_equal_the_dynamic_openkernels_cache(models, bits: int) -> None:
    # Same storage format, same append and attention kernels: the same logits.
    ours, p, t = models["ours"], models["prompt"], models["tokens"]
    want = _logits(ours, A.OpenKernelsCache(ours.config, BATCH, 64, kv_dtype=_KV[bits]), p, t)
    cache = _static(ours, bits)
    got = _logits(ours, cache, p, t)
    assert (_step_errors(got, want, float(want.abs().max())) <= 1e-5).all()
    layer = cache.layers[0]
    if bits == 16:
        assert type(layer.k_cache) is torch.Tensor and layer.k_cache.shape == (BATCH, 64, 2, 32)
    else:
        assert isinstance(layer.k_cache, QuantizedKV) and layer.k_cache.bits == bits
        assert layer.k_cache.data.shape == (BATCH, 64, 2, 32 * bits // 8)
    # Every storage tensor and the length keep a static address (CUDA graphs mutate them in place).
    parts = [layer.cumulative_length]
    for side in (layer.k_cache, layer.v_cache):
        parts += [side.data, side.scale, side.zero] if isinstance(side, QuantizedKV) else [side]
    assert all(hasattr(x, "_dynamo_static_input_type") for x in parts)
    assert layer.cumulative_length.dtype == torch.int32 and layer.cumulative_length.dim() == 0


def _compiled_decode(model, backend: str, bits: int, steps: int = 8) -> None:
    """Prefill eagerly (as generate() does), then `steps` decode steps through
    torch.compile(model.forward): the logits of eager, the length advancing, one graph."""
    import torch._dynamo
    import torch._dynamo.testing

    p, t = model["prompt"], model["tokens"][:, :steps]
    model = model["ours"]
    want = _logits(model, _static(model, bits, max_seqlen=PROMPT + steps), p, t)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    step = torch.compile(model.forward, backend=counter, fullgraph=False)
    cache = _static(model, bits, max_seqlen=PROMPT + steps)
    try:
        with torch.no_grad():
            rows = [model(p, use_cache=True, **{CACHE_KW: cache}).logits]
            for i, token in enumerate(t.unbind(1)):
                rows.append(step(input_ids=token[:, None], use_cache=True, **{CACHE_KW: cache}).logits)
                assert [int(layer.get_seq_length()) for layer in cache.layers] == [PROMPT + i + 1] * LAYERS
    finally:
        torch._dynamo.reset()
    got = torch.cat(rows, 1)
    err = _step_errors(got, want, float(want.abs().max()))
    assert (err <= 1e-5).all(), f"{backend} int{bits}: {err.tolist()}"
    # One graph for every step: no graph break, no recompile as the length grows.
    assert counter.frame_count == 1, f"{backend}: {counter.frame_count} graphs"


@pytest.mark.parametrize("bits", [16, 4])
def test_static_decode_under_torch_compile_aot_eager(models, bits: int) -> None:
    _compiled_decode(models, "aot_eager", bits)


@pytest.mark.skipif(
    not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")),
    reason="inductor on CPU needs a C++ compiler",
)
def test_static_decode_under_torch_compile_inductor(models) -> None:
    _compiled_decode(models, "inductor", 8)  # ~20 s of inductor compile on one CPU core


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", [16, 4])
def test_static_decode_step_captures_in_a_cuda_graph(models, bits: int) -> None:
    """An eager decode step captured by torch.cuda.graph (no torch.compile): no host read of
    the cache length while capturing, the length advancing on the device at each replay, and
    the logits of the uncaptured eager loop, step by step."""
    steps = 6
    ours = copy.deepcopy(models["ours"]).to("cuda", torch.bfloat16)
    p, t = models["prompt"].cuda(), models["tokens"][:, :steps].cuda()
    want = _logits(ours, _static(ours, bits, max_seqlen=PROMPT + steps), p, t)
    cache = _static(ours, bits, max_seqlen=PROMPT + steps)
    token = t[:, :1].clone()
    with torch.no_grad():
        rows = [ours(p, use_cache=True, **{CACHE_KW: cache}).logits.float()]
        rows.append(ours(token, use_cache=True, **{CACHE_KW: cache}).logits.float())  # step 1 eagerly
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # recorded, not run: the length stays at PROMPT + 1
            logits = ours(token, use_cache=True, **{CACHE_KW: cache}).logits
    for i in range(1, steps):
        token.copy_(t[:, i : i + 1])
        graph.replay()
        rows.append(logits.float().clone())
        assert [int(layer.get_seq_length()) for layer in cache.layers] == [PROMPT + i + 1] * LAYERS
    got = torch.cat(rows, 1)
    err = _step_errors(got, want, float(want.abs().max()))
    assert (err <= 1e-5).all(), f"int{bits}: {err.tolist()}"


def test_static_generate_auto_compiles(models) -> None:
    # generate() compiles the decode step by itself for a compileable cache (on CUDA; asked to
    # compile on every device here): the same tokens as eager, one graph.
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = copy.deepcopy(models["ours"])  # generate() keeps the compiled call on the model
    want = _generate(model, models["prompt"], _static(model, 8, PROMPT + NEW))
    config = transformers.CompileConfig(backend="aot_eager", mode=None, fullgraph=True)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    cache = _static(model, 8, PROMPT + NEW)
    try:
        got = _generate(model, models["prompt"], cache, compile_config=config)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert hasattr(model, "_compiled_call") and graphs == 1
    assert torch.equal(got, want)
    assert int(cache.get_seq_length()) == PROMPT + NEW - 1


def test_static_seq_length_reset_crop(models) -> None:
    model, p, t = models["ours"], models["prompt"], models["tokens"]
    cache = _static(model, 4, max_seqlen=40)
    assert cache.get_seq_length() == 0 and cache.get_max_length() == 40 and cache.nbytes == 0
    assert cache.get_mask_sizes(1, 0) == (40, 0) and cache.get_max_cache_shape() == 40
    first = _logits(model, cache, p, t[:, :3])
    length = cache.get_seq_length()
    assert isinstance(length, torch.Tensor) and int(length) == PROMPT + 3  # on the device: no host read
    assert all(int(layer.get_seq_length()) == PROMPT + 3 for layer in cache.layers)
    assert cache.get_mask_sizes(5, 1) == (40, 0) and cache.nbytes > 0
    storage = [layer.k_cache.data.data_ptr() for layer in cache.layers] + [length.data_ptr()]
    cache.crop(-2)
    assert int(cache.get_seq_length()) == PROMPT + 1
    cache.crop(0)
    assert int(cache.get_seq_length()) == PROMPT + 1
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    cache.crop(-100)  # stops at 0
    assert int(cache.get_seq_length()) == 0
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and cache.nbytes > 0  # storage kept ...
    assert [layer.k_cache.data.data_ptr() for layer in cache.layers] + [
        cache.get_seq_length().data_ptr()
    ] == storage  # ... at the same addresses
    _check_reuse_after_reset(model, cache, p, t, first, too_many=30)
    assert int(cache.get_seq_length()) == PROMPT + 3  # the eager call checked the capacity first


def test_static_left_padded_batch_gives_transformers_tokens(models) -> None:
    """A left-padded batch through generate() with the static cache (eager): the prefill
    appends the padding and hides it with cache_leftpad; decode steps hide it too. Tokens
    equal to the sdpa model's on the same padded batch, and sequence 0's to its own alone."""
    p = models["prompt"].clone()
    mask = torch.ones_like(p)
    p[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    want = models["ref"].generate(p, **kwargs)
    want_logits = models["ref"].generate(p, **kwargs, output_logits=True, return_dict_in_generate=True).logits
    for bits in (16, 4):
        got = models["ours"].generate(p, **kwargs, **{CACHE_KW: _static(models["ours"], bits)})
        if bits == 16:
            assert torch.equal(got, want)
            assert torch.equal(got[0, 3:], _generate(models["ref"], p[:1, 3:])[0])
            logits = models["ours"].generate(p, **kwargs, **{CACHE_KW: _static(models["ours"])}, output_logits=True,
                                             return_dict_in_generate=True).logits  # fmt: skip
            torch.testing.assert_close(torch.stack(logits), torch.stack(want_logits), rtol=1e-4, atol=1e-4)
        else:  # int4 keys and values: the tokens may differ after a while, not the prompt
            assert torch.equal(got[:, :PROMPT], want[:, :PROMPT]) and got.shape == want.shape


def test_static_mask_is_checked_once_per_forward(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers hands every layer the same mask tensor: the first layer's check (a host
    read in eager calls) serves the others in that forward, and each forward checks again (a
    left-padded batch, so the check's padding is what every layer attends with)."""
    from openkernels.attention import hf

    calls = []
    real = hf._check_cache_mask
    monkeypatch.setattr(hf, "_check_cache_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = models["prompt"].clone()
    mask = torch.ones_like(p)
    p[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    got = models["ours"].generate(p, **kwargs, **{CACHE_KW: _static(models["ours"])})
    assert torch.equal(got, models["ref"].generate(p, **kwargs))
    assert LAYERS > 1 and len(calls) == NEW  # the prefill and NEW - 1 steps: one check each


def test_once_per_step_reuses_a_value_within_one_forward_only() -> None:
    from openkernels.attention import hf

    class Layer:
        pass

    layers, mask, computed = [Layer(), Layer(), Layer()], torch.zeros(2, 1, 1, 4), []

    def run(layer, m=mask, options=("o",)):
        return hf._once_per_step(m, layer, options, lambda: computed.append(1) or len(computed))

    assert [run(layer) for layer in layers] == [1, 1, 1]  # one forward: computed by the first layer
    assert [run(layer) for layer in layers] == [2, 2, 2]  # the first layer again: the next forward
    assert run(layers[1], options=("other",)) == 3 and run(layers[2]) == 2  # per options
    other = mask.clone()
    assert run(layers[1], m=other) == 4  # another mask object
    other.add_(1)
    assert run(layers[2], m=other) == 5  # the same mask, changed in place
    assert run(Layer(), m=other) == 5  # any other layer of that forward
    owner, third = Layer(), torch.ones(1)
    watch = weakref.ref(owner)
    assert run(owner, m=third) == 6
    del owner
    gc.collect()
    assert watch() is None  # the memo keeps no layer (and no cache storage) alive


def test_static_left_padding_under_torch_compile(models) -> None:
    """Compiled, the mask is not read on the host: the padding's end comes from it on the
    device. A manual padded prefill then compiled decode steps (aot_eager) give the eager
    steps' logits (which see the padding hidden: with it visible they differ)."""
    ours, p = models["ours"], models["prompt"].clone()
    mask = torch.ones_like(p)
    p[1, :5], mask[1, :5] = 0, 0
    steps = 4

    def run(step_fn) -> torch.Tensor:
        cache = _static(ours)
        m = mask.clone()
        with torch.no_grad():
            out = ours(p, attention_mask=m, use_cache=True, **{CACHE_KW: cache})
            tokens, logits = [], []
            for i in range(steps):
                tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                position = torch.full((p.shape[0], 1), p.shape[1] + i) - (1 - mask).sum(1, keepdim=True)
                out = step_fn(tokens[-1], m, position, cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1)

    def eager_step(t, m, pos, cache):
        return ours(t, attention_mask=m, position_ids=pos, use_cache=True, **{CACHE_KW: cache})

    torch._dynamo.reset()
    compiled = torch.compile(eager_step, backend="aot_eager")
    want = run(eager_step)
    torch.testing.assert_close(run(compiled), want, rtol=1e-5, atol=1e-5)


def test_static_errors(models) -> None:
    ours, ref, p = models["ours"], models["ref"], models["prompt"]
    with pytest.raises(ValueError, match="batch_size=3"):
        _logits(ours, _static(ours, batch=3), p, p[:, :0])
    with pytest.raises(ValueError, match="kv_dtype"):
        A.OpenKernelsStaticCache(ours.config, BATCH, 64, kv_dtype="int2")
    with pytest.raises(ValueError, match="max_seqlen"):
        A.OpenKernelsStaticCache(ours.config, BATCH, 0)
    with pytest.raises(AttributeError, match="attn_implementation='openkernels'"):
        _logits(ref, _static(ref), p, p[:, :0])
    with pytest.raises(RuntimeError, match="no_grad"):
        ours(p, use_cache=True, **{CACHE_KW: _static(ours)})
    with pytest.raises(NotImplementedError, match="batch size is fixed"):
        _static(ours).batch_repeat_interleave(2)
    # A mask that hides a token in the middle is refused, and the failed call leaves every
    # layer's length where it was (the attention advances it only after its call).
    cache = _static(ours)
    with torch.no_grad():
        ours(p, use_cache=True, **{CACHE_KW: cache})
        held = [int(layer.cumulative_length) for layer in cache.layers]
        mask = torch.ones(p.shape[0], PROMPT + 1, dtype=torch.long)
        mask[:, PROMPT // 2] = 0
        with pytest.raises(NotImplementedError, match="hide tokens"):
            ours(p[:, -1:], attention_mask=mask, use_cache=True, **{CACHE_KW: cache})
    assert [int(layer.cumulative_length) for layer in cache.layers] == held == [PROMPT] * LAYERS


def _host_reads(fn) -> tuple[int, int]:
    """(device values read by int() / .item() / bool(), attention_with_kvcache length checks
    that read cache_seqlens on the host) while fn() runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from openkernels.attention.kvcache import api

    counts = [0, 0]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[0] += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    real = api.check_lengths

    def counting(*args):
        counts[1] += 1
        return real(*args)

    api.check_lengths = counting
    try:
        with Reads():
            fn()
    finally:
        api.check_lengths = real
    return counts[0], counts[1]


@pytest.mark.parametrize("bits", [16, 4])
def test_static_eager_decode_counts_lengths_on_the_host(models, bits: int, monkeypatch) -> None:
    """An eager decode step reads no layer's length from the device: each layer counts it on
    the host (a read per layer and step would stall the host on the GPU). What is left is the
    mask's check, once per forward. The arguments are checked once per layer and signature
    (prefill, decode). The logits stay those of the layer that reads."""
    from openkernels.attention import hf as attn_hf

    model, p, t = models["ours"], models["prompt"], models["tokens"][:, :4]
    want = _logits(model, _static(model, bits, max_seqlen=PROMPT + 4), p, t)
    cache = _static(model, bits, max_seqlen=PROMPT + 4)
    rows, reads, plans = [], [], []
    real_plan = attn_hf._kvcache_plan
    monkeypatch.setattr(attn_hf, "_kvcache_plan", lambda *a: plans.append(1) or real_plan(*a))
    with torch.no_grad():
        rows.append(model(p, use_cache=True, **{CACHE_KW: cache}).logits)
        for token in t.unbind(1):

            def step(token=token):
                rows.append(model(token[:, None], use_cache=True, **{CACHE_KW: cache}).logits)

            reads.append(_host_reads(step))
        # Full: the next token is refused before anything changes, from the host's count.
        with pytest.raises(ValueError, match="capacity"):
            model(t[:, :1], use_cache=True, **{CACHE_KW: cache})
    assert all(length_checks == 0 for _, length_checks in reads), reads
    assert all(values < LAYERS for values, _ in reads), reads  # per forward, not per layer
    assert len(plans) == 2 * LAYERS  # the prefill's and the decode steps' signatures, per layer
    assert [int(layer.cumulative_length) for layer in cache.layers] == [PROMPT + 4] * LAYERS
    err = _step_errors(torch.cat(rows, 1), want, float(want.abs().max()))
    assert (err <= 1e-5).all(), err.tolist()


def test_static_host_count_stops_after_a_captured_or_compiled_call(models, monkeypatch) -> None:
    """A captured (or compiled) call advances the length without Python: from the first one on,
    each eager call reads the length from the device (here moved behind the host's back, as
    graph replays move it) and the capacity check sees the true value."""
    from openkernels.attention import hf as attn_hf
    from openkernels.attention.kvcache import hf as kv_hf

    model, p, t = models["ours"], models["prompt"], models["tokens"]
    cache = _static(model, max_seqlen=PROMPT + 4)
    with torch.no_grad():
        model(p, use_cache=True, **{CACHE_KW: cache})
        with monkeypatch.context() as patch:  # one step as under a CUDA-graph capture
            for module in (attn_hf, kv_hf):
                patch.setattr(module, "graph_capturing", lambda device: True)
            model(t[:, :1], use_cache=True, **{CACHE_KW: cache})
        assert all(layer._host_length is None and not layer._host_counts for layer in cache.layers)
        for layer in cache.layers:
            layer.cumulative_length.add_(2)  # two replays the host never saw
        with pytest.raises(ValueError, match=f"{PROMPT + 3} cached tokens"):
            model(t[:, :2], use_cache=True, **{CACHE_KW: cache})
        reads, _ = _host_reads(lambda: model(t[:, :1], use_cache=True, **{CACHE_KW: cache}))
    assert reads >= LAYERS  # every layer read its length
    assert [int(layer.cumulative_length) for layer in cache.layers] == [PROMPT + 4] * LAYERS
    cache.reset()  # the count stays off: a reset does not bring it back
    assert all(layer._host_length is None for layer in cache.layers)


def test_sdpa_route_only_for_plain_float32_on_the_cpu():
    """hf.py hands plain float32 CPU attention to SDPA and keeps everything else (GPUs: the
    attention op's own dispatch picks cuDNN where it is faster, test_cudnn.py), and stands
    back when dispatch is steered."""
    from types import SimpleNamespace

    from openkernels.attention import hf
    from openkernels.shared import dispatch

    def tensor(s, d=64, dtype=torch.float32, cuda=False):
        device = SimpleNamespace(index=0, type="cuda" if cuda else "cpu")
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(2, 8, s, d), device=device)

    q, k = tensor(128), tensor(128)
    assert hf._sdpa_is_faster(q, k, True, None, None)
    assert not hf._sdpa_is_faster(tensor(1), k, True, None, None)  # decode: bottom-right causal
    assert hf._sdpa_is_faster(tensor(1), k, False, None, None)
    assert not hf._sdpa_is_faster(q, k, True, 64, None)  # sliding window
    assert not hf._sdpa_is_faster(q, k, True, None, 30.0)  # softcap
    assert not hf._sdpa_is_faster(tensor(128, dtype=torch.bfloat16), k, True, None, None)
    assert not hf._sdpa_is_faster(tensor(128, dtype=torch.bfloat16, cuda=True), k, True, None, None)
    with dispatch.force("cpu"):
        assert not hf._sdpa_is_faster(q, k, True, None, None)


@pytest.mark.parametrize("kwargs", [{}, [], None], ids=["dict", "short-list", "none"])
def test_layers_when_transformers_gives_no_per_layer_kwargs(models, monkeypatch, kwargs) -> None:
    """transformers 5.17's get_layer_types_and_kwargs returned no per-layer kwargs: the cache
    still has one layer per decoder layer (it had none, and decode raised IndexError)."""
    import transformers.cache_utils as cu

    config = models["ours"].config
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs",
                        lambda c: (["full_attention"] * c.num_hidden_layers, kwargs), raising=False)  # fmt: skip
    cache = A.OpenKernelsCache(config, BATCH, 64)
    assert len(cache.layers) == config.num_hidden_layers
    p, t = models["prompt"], models["tokens"]
    want = _logits(models["ref"], DynamicCache(), p, t)
    got = _logits(models["ours"], cache, p, t)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
