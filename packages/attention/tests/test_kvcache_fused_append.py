"""The static cache's one-op decode step (`openkernels::attention_kvcache_append`): the new
tokens' append inside the attention kernel, per-token rotary tables (transformers' position
embeddings) on q and the new keys, and the length counter advanced by the split combine.

Every implementation against the unfused sequence (the rotation, `kvcache_append_fwd`, then
`attention_kvcache_fwd`, all on the reference): the appended slots, every other slot untouched,
out and lse, the counter; batch 1 (the counter is the lengths' storage) and ragged batches,
GQA, left padding, one split and several, rows past one query block (the two-launch path);
then a kernelized decoder's steps through OpenKernelsStaticCache with the fused path taken,
against the same steps with the rotation done before the cache."""

from __future__ import annotations

import pytest
import torch

from openkernels.attention.kvcache import api as kvcache_api
from openkernels.attention.kvcache import reference as KR
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import poisoned_empty

from .cases import INTERPRETING, targets

TARGETS = targets()


def _rope(
    batch: int, positions: torch.Tensor, rotary_dim: int, dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (batch, n, rotary_dim) cos / sin with halves that differ (c1 != c2), so that a
    kernel reading one half for both would fail."""
    inv = 10000.0 ** (-torch.arange(0, rotary_dim, dtype=torch.float64) / rotary_dim)
    angles = positions.to(torch.float64)[..., None] * inv
    angles = angles.expand(batch, *angles.shape[-2:])
    return angles.cos().to(dtype).to(device).contiguous(), angles.sin().to(dtype).to(device).contiguous()


def _case(device, dtype, lengths, heads, head_dim, pads, rotary: bool, capacity: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch, (hq, hkv) = len(lengths), heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    k_cache, v_cache = randn(batch, capacity, hkv, head_dim), randn(batch, capacity, hkv, head_dim)
    # q, k_new, v_new as strided views of one projection, as kernelize's stacked q/k/v gives them.
    qkv = randn(batch, 1, (hq + 2 * hkv) * head_dim)
    q, k_new, v_new = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    q, k_new, v_new = (t.view(batch, 1, -1, head_dim) for t in (q, k_new, v_new))
    filled = torch.tensor([n + p for n, p in zip(lengths, pads)], dtype=torch.int32, device=device)
    leftpad = None if not any(pads) else torch.tensor(pads, dtype=torch.int32, device=device)
    cos = sin = None
    if rotary:
        cos, sin = _rope(batch, torch.tensor(lengths)[:, None], head_dim, dtype, device)
    return q, k_cache, v_cache, filled, k_new, v_new, cos, sin, leftpad


def _unfused(q, k_cache, v_cache, filled, k_new, v_new, cos, sin, leftpad, scale):
    """The reference's sequence on copies: rotate, append, attend."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    if cos is not None:
        q, k_new = KR.rotate_tokens(q, cos, sin), KR.rotate_tokens(k_new, cos, sin)
    d = q.shape[-1]
    KR.kvcache_append_fwd(k_cache, v_cache, None, None, None, None, k_new, v_new, filled, None, None, None,
                          rotary_interleaved=False, bits=16, group_size=d, leftpad=leftpad)  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    KR.attention_kvcache_fwd(q, k_cache, v_cache, None, None, None, None, out, lse, filled, None, None, None,
                             seqlen_new=1, max_seqlen_k=k_cache.shape[1], scale=scale, window_left=-1,
                             window_right=0, alibi_slopes=None, softcap=0.0, rotary_interleaved=False, bits=16,
                             group_size=d, leftpad=leftpad)  # fmt: skip
    return out, lse, k_cache, v_cache


_CASES = [
    # (name, lengths, heads, head_dim, pads, rotary)
    ("b1-gqa-rotary", (37,), (8, 2), 64, (0,), True),
    ("b1-plain", (16,), (4, 4), 64, (0,), False),
    ("ragged-leftpad-rotary", (5, 0, 40), (4, 2), 64, (3, 0, 1), True),
    ("gqa16-d128", (23, 61), (16, 1), 128, (0, 0), True),
    ("rows-past-a-block", (12,), (32, 1), 64, (0,), True),  # 32 rows: the two-launch path
]


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [None, 1, 3], ids=["default-splits", "1-split", "3-splits"])
@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_fused_append_matches_the_unfused_sequence(device, impl, dtype, splits, case, monkeypatch) -> None:
    name, lengths, heads, head_dim, pads, rotary = case
    if impl == "cpu" or (impl == "reference" and splits is not None):
        pytest.skip("the op's backends are Triton and the reference (the splits are Triton's)")
    if INTERPRETING and dtype == torch.float16 and name != "b1-gqa-rotary":
        pytest.skip("the interpreter runs float16 once")
    from openkernels.attention.kvcache import triton as launcher

    monkeypatch.setattr(launcher, "FORCE_SPLITS", splits)
    capacity = max(n + p for n, p in zip(lengths, pads)) + 3
    args = _case(device, dtype, lengths, heads, head_dim, pads, rotary, capacity, seed=len(name) + head_dim)
    q, k_cache, v_cache, filled, k_new, v_new, cos, sin, leftpad = args
    scale = head_dim**-0.5
    want_out, want_lse, want_k, want_v = _unfused(*args, scale)
    before = filled.clone()
    batch1 = len(lengths) == 1
    # Batch 1: the counter is the lengths' own storage (what the static cache passes).
    counter = filled.view(()) if batch1 else torch.tensor(100, dtype=torch.int32, device=device)
    with dispatch.force(impl), poisoned_empty():
        out, lse = kvcache_api._kvcache_append_call(
            q, k_cache, v_cache, filled.expand(1) if batch1 else filled, k_new, v_new, cos, sin, counter, True,
            scale, (-1, -1), 0.0, leftpad, None,
        )  # fmt: skip
    assert int(counter) == (int(before[0]) + 1 if batch1 else 101)
    if not batch1:
        assert torch.equal(filled, before), "the lengths passed beside the counter changed"
    assert not torch.isnan(out).any()
    # The stored keys may differ in the last bit of their float32 rotation (FMA): one ulp.
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    for got, want, what in ((k_cache, want_k, "k_cache"), (v_cache, want_v, "v_cache")):
        diff = (got.float() - want.float()).abs()
        assert torch.all(diff <= ulp * want.float().abs() + 1e-6), f"{name}: {what} differs by {diff.max()}"
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "case",
    [
        ("b1-128k-gqa-rotary", (131071,), (32, 8), 64, (0,), True),
        ("b2-128k-ragged-d128", (131070, 65537), (16, 2), 128, (0, 7), True),
    ],
    ids=lambda c: c[0],
)
def test_fused_append_at_128k_tokens_on_the_gpu(case) -> None:
    """The Triton fused op at the length users run (128K tokens, the split holding the new
    token far from the first), batch 1 with the counter as the lengths' storage and a ragged,
    left-padded batch: against the unfused sequence on the reference."""
    name, lengths, heads, head_dim, pads, rotary = case
    capacity = max(n + p for n, p in zip(lengths, pads)) + 2
    args = _case("cuda", torch.bfloat16, lengths, heads, head_dim, pads, rotary, capacity, seed=head_dim)
    q, k_cache, v_cache, filled, k_new, v_new, cos, sin, leftpad = args
    scale = head_dim**-0.5
    with dispatch.force("reference"):
        want_out, want_lse, want_k, want_v = _unfused(*args, scale)
    before = filled.clone()
    batch1 = len(lengths) == 1
    counter = filled.view(()) if batch1 else torch.tensor(7, dtype=torch.int32, device="cuda")
    with dispatch.force("triton"):
        out, lse = kvcache_api._kvcache_append_call(
            q, k_cache, v_cache, filled.expand(1) if batch1 else filled, k_new, v_new, cos, sin, counter, True,
            scale, (-1, -1), 0.0, leftpad, None,
        )  # fmt: skip
    assert int(counter) == (int(before[0]) + 1 if batch1 else 8)
    assert not torch.isnan(out).any()
    for got, want, what in ((k_cache, want_k, "k_cache"), (v_cache, want_v, "v_cache")):
        diff = (got.float() - want.float()).abs()
        assert torch.all(diff <= 2.0**-7 * want.float().abs() + 1e-6), (
            f"{name}: {what} differs by {diff.max()}"
        )
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


def test_failed_fused_call_leaves_cache_and_counter() -> None:
    """A backend that fails after writing the slots and advancing the counter: the call
    raises, and the new slots and the counter are as they were."""
    if INTERPRETING:
        pytest.skip("the failure path runs once, outside the interpreter")
    import dataclasses

    from openkernels.shared import replay

    args = _case("cpu", torch.bfloat16, (9,), (4, 2), 64, (0,), True, 16, seed=3)
    q, k_cache, v_cache, filled, k_new, v_new, cos, sin, leftpad = args
    k0, v0, f0 = k_cache.clone(), v_cache.clone(), filled.clone()
    impls = dispatch._op("attention_kvcache_append").impls
    index = next(i for i, impl in enumerate(impls) if impl.name == "reference")
    original = impls[index]

    def broken(*a, **kw):
        original.fn(*a, **kw)  # writes the slots and advances, then fails
        raise RuntimeError("planted failure")

    impls[index] = dataclasses.replace(original, fn=broken)
    dispatch.changed()
    try:
        with replay.disabled(), dispatch.force("reference"), pytest.raises(RuntimeError, match="planted"):
            kvcache_api._kvcache_append_call(q, k_cache, v_cache, filled.expand(1), k_new, v_new, cos, sin,
                                             filled.view(()), True, 0.125, (-1, -1), 0.0, leftpad, None)  # fmt: skip
    finally:
        impls[index] = original
        dispatch.changed()
        dispatch.reset_failures()
    assert torch.equal(k_cache.view(torch.int16), k0.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), v0.view(torch.int16))
    assert torch.equal(filled, f0)


def test_token_rotary_tables_are_checked() -> None:
    if INTERPRETING:
        pytest.skip("argument checks run before any kernel: once, outside the interpreter")
    k_new = torch.zeros(2, 1, 2, 64)
    good = torch.zeros(2, 1, 64)
    kvcache_api.check_token_rotary("t", good, good, k_new)
    kvcache_api.check_token_rotary("t", good[:1], good[:1], k_new)
    for cos, sin, err in (
        (torch.zeros(2, 1, 63), torch.zeros(2, 1, 63), ValueError),  # odd rotary_dim
        (torch.zeros(2, 1, 66), torch.zeros(2, 1, 66), ValueError),  # wider than head_dim
        (torch.zeros(2, 2, 64), torch.zeros(2, 2, 64), ValueError),  # not one row per new token
        (good, torch.zeros(2, 1, 32), ValueError),  # shapes differ
        (torch.zeros(2, 1, 64, dtype=torch.int32), good, TypeError),
        (torch.zeros(2, 1, 128)[..., ::2], torch.zeros(2, 1, 128)[..., ::2], ValueError),  # strides
    ):
        with pytest.raises(err):
            kvcache_api.check_token_rotary("t", cos, sin, k_new)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_kernelized_decode_steps_through_the_fused_path(arch: str, padded: bool, monkeypatch) -> None:
    """kernelize's attention forward leaves q and k unrotated for an OpenKernelsStaticCache and
    the static path rotates, appends, attends and advances in one op: the same logits, step by
    step, as the same model rotating before the cache (the path taken on the CPU and while
    compiling), and the same lengths. The fused op's reference runs here (the CPU); the GPU
    check runs its Triton kernel."""
    if INTERPRETING:
        pytest.skip("transformers models on the CPU backends, once, outside the interpreter")
    transformers = pytest.importorskip("transformers")
    import openkernels.attention as A
    from openkernels.attention import hf as attention_hf
    from openkernels.attention import kernelize as attention_kernelize
    from openkernels.shared.kernelize import kernelize

    common = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0)  # fmt: skip
    config = {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32)),
        "mistral": lambda: transformers.MistralForCausalLM(
            transformers.MistralConfig(**common, sliding_window=8)
        ),
    }
    torch.manual_seed(0)
    model = config[arch]().eval()
    kernelize(model)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 128, (2, 9), generator=gen)
    mask = torch.ones_like(prompt)
    if padded:
        prompt[0, :3], mask[0, :3] = 0, 0
    tokens = torch.randint(1, 128, (2, 12), generator=gen)

    def decode(fused: bool):
        fused_calls = []
        with monkeypatch.context() as m:
            if fused:
                original = attention_hf._attend_fused

                def counted(*args, **kwargs):
                    fused_calls.append(1)
                    return original(*args, **kwargs)

                m.setattr(attention_hf, "fused_append_ready", lambda q, k_cache, new: True)
                m.setattr(attention_hf, "_attend_fused", counted)
            else:
                m.setattr(attention_kernelize, "_rotates_in_attention", lambda module, cache: False)
            cache = A.OpenKernelsStaticCache(model.config, 2, 32)
            rows, am = [], mask.clone()
            with torch.no_grad():
                rows.append(model(prompt, attention_mask=am, cache=cache, use_cache=True).logits)
                for t in tokens.unbind(1):
                    am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
                    rows.append(model(t[:, None], attention_mask=am, cache=cache, use_cache=True).logits)
        return torch.cat(rows, 1), int(cache.get_seq_length()), len(fused_calls)

    want, want_len, _ = decode(fused=False)
    got, got_len, calls = decode(fused=True)
    assert calls == 2 * tokens.shape[1], "the decode steps did not take the fused path"
    assert got_len == want_len == prompt.shape[1] + tokens.shape[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "cuda-graph", "compiled"])
def test_kernelized_decode_on_cuda_takes_one_attention_launch(mode: str, monkeypatch) -> None:
    """On CUDA the fused path is the default for a kernelized bf16 decoder with a static cache:
    logits within bf16 rounding of the unfused path's, step by step, eager, replayed from a
    CUDA graph (where the length advances on the device, in the combine) and compiled
    (torch.compile fullgraph, inductor: the op in the graph, the length's add beside it)."""
    captured = mode == "cuda-graph"
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    transformers = pytest.importorskip("transformers")
    import openkernels.attention as A
    from openkernels.attention import hf as attention_hf
    from openkernels.attention import kernelize as attention_kernelize
    from openkernels.shared.kernelize import kernelize

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, intermediate_size=512, max_position_embeddings=512,
                                   initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    kernelize(model)
    prompt = torch.randint(1, 256, (1, 200), device="cuda")
    tokens = torch.randint(1, 256, (1, 8), device="cuda")

    def decode(fused: bool):
        calls = []
        with monkeypatch.context() as m:
            if fused and mode != "compiled":  # (dynamo would guard on the counter: a recompile per step)
                original = attention_hf._attend_fused
                m.setattr(attention_hf, "_attend_fused", lambda *a, **k: calls.append(1) or original(*a, **k))
            elif not fused:
                m.setattr(attention_kernelize, "_rotates_in_attention", lambda module, cache: False)
            cache = A.OpenKernelsStaticCache(model.config, 1, 256)
            token = torch.zeros(1, 1, dtype=torch.long, device="cuda")
            rows = []
            with torch.no_grad():
                model(prompt, cache=cache, use_cache=True)

                def step():
                    return model(token, cache=cache, use_cache=True).logits

                if captured:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):  # warm-up steps, then the graph
                        token.copy_(tokens[:, :1])
                        rows.append(step().float().clone())
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):  # recorded, not run: the length stays
                        logits = step()
                    for t in tokens.unbind(1)[1:]:
                        token.copy_(t[:, None])
                        graph.replay()
                        rows.append(logits.float().clone())
                else:
                    if mode == "compiled":
                        compiled = torch.compile(model, fullgraph=True, dynamic=False)

                        def step():
                            return compiled(input_ids=token, cache=cache, use_cache=True).logits

                    for t in tokens.unbind(1):
                        token.copy_(t[:, None])
                        rows.append(step().float().clone())
            length = int(cache.get_seq_length())
            if (
                fused and mode == "compiled"
            ):  # the compiled step takes the op where the prefill found it ready
                calls = [1] * all(getattr(layer, "fused_ready", False) for layer in cache.layers)
        return torch.cat(rows, 1), length, len(calls)

    want, want_len, _ = decode(fused=False)
    got, got_len, calls = decode(fused=True)
    assert calls >= (1 if mode == "compiled" else 2), "the fused path was not taken"  # compiled: traced once
    assert got_len == want_len
    assert torch.isfinite(got).all()
    scale = want.abs().max()
    assert (got - want).abs().max() <= 2e-2 * scale, float((got - want).abs().max() / scale)


@pytest.mark.parametrize(
    ("fused", "backend"),
    [(False, "aot_eager"), (True, "aot_eager"), (True, "inductor")],
    ids=["unfused-aot_eager", "fused-aot_eager", "fused-inductor"],
)
def test_kernelized_static_decode_compiles_fullgraph(fused: bool, backend: str, monkeypatch) -> None:
    """The unrotated q / k handed to the static cache (with cos / sin on its handle) trace in one
    graph: torch.compile(fullgraph=True) of a kernelized decoder's step gives the eager step's
    logits and lengths, with the fused op in the graph (its reference here: the readiness the
    prefill found is forced; on CUDA it is the Triton backend's) or with the rotation first."""
    if INTERPRETING:
        pytest.skip("torch.compile on the CPU backends, once, outside the interpreter")
    transformers = pytest.importorskip("transformers")
    import openkernels.attention as A
    from openkernels.attention import hf as attention_hf
    from openkernels.shared.kernelize import kernelize

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                                   initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    kernelize(model)
    compiled_cache, eager_cache = (A.OpenKernelsStaticCache(model.config, 1, 64) for _ in range(2))
    prompt = torch.randint(1, 128, (1, 9))
    calls = []
    with torch.no_grad():
        model(prompt, cache=eager_cache, use_cache=True)
        if fused:  # the prefill records the layers' readiness for the compiled steps
            original = attention_hf._attend_fused
            monkeypatch.setattr(attention_hf, "fused_append_ready", lambda q, k_cache, new: True)
            monkeypatch.setattr(attention_hf, "_attend_fused", lambda *a: calls.append(1) or original(*a))
        model(prompt, cache=compiled_cache, use_cache=True)
        step = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
        for t in range(3):
            token = torch.tensor([[5 + t]])
            got = step(input_ids=token, cache=compiled_cache, use_cache=True).logits
            want = model(input_ids=token, cache=eager_cache, use_cache=True).logits if not fused else None
            if fused:
                with monkeypatch.context() as m:  # the eager reference: the unfused path
                    m.setattr(attention_hf, "fused_append_ready", lambda q, k_cache, new: False)
                    want = model(input_ids=token, cache=eager_cache, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(compiled_cache.get_seq_length()) == int(eager_cache.get_seq_length()) == 12
    assert bool(calls) == fused, "the compiled step did not take the fused op"
