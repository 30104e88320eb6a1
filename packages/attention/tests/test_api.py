"""Public API behaviour: argument errors (before any kernel runs), dispatch and fallback,
meta tensors, double backward, and the Hugging Face attention function against torch's SDPA."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import openkernels.attention as A
from openkernels.attention.core import reference as R
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import failing_implementation, random_tensor
from openkernels.shared.dispatch import DispatchKey
from openkernels.shared.platform import triton_interpreting

from .cases import HEAD_DIMS, Case, Options, assert_attention_close, compare, recording_implementation

pytestmark = pytest.mark.skipif(triton_interpreting(), reason="API tests run once, outside the interpreter")

BF16 = torch.bfloat16
# A second device for mismatch errors: a GPU when there is one, else meta.
OTHER = "cuda:0" if torch.cuda.is_available() else "meta"


def _dense(q_shape=(2, 5, 4, 64), kv_shape=(2, 7, 2, 64), dtype=BF16):
    return random_tensor(q_shape, dtype), random_tensor(kv_shape, dtype), random_tensor(kv_shape, dtype)


def _cu(values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


# ---- bad input ---------------------------------------------------------------------------

# (name, call on (q, k, v) of _dense(), error type, message pattern)
_DENSE_ERRORS = [
    # head_dim
    ("head_dim-44", lambda q, k, v: A.attention(q[..., :44], k[..., :44], v[..., :44]), ValueError,
     r"head_dim 44 is not supported; supported: multiples of 8 up to 256"),
    ("head_dim-512", lambda q, k, v: A.attention(*(torch.cat([t] * 8, -1) for t in (q, k, v))), ValueError,
     "head_dim 512 is not supported"),
    ("head_dim-q-vs-k", lambda q, k, v: A.attention(q, k[..., :32], v[..., :32]), ValueError,
     "q has head_dim 64 but k and v have 32"),
    # heads
    ("heads-3-of-2", lambda q, k, v: A.attention(q[:, :, :3], k, v), ValueError,
     r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
    ("heads-2-of-4", lambda q, k, v: A.attention(q[:, :, :2], torch.cat([k, k], 2), torch.cat([v, v], 2)),
     ValueError, r"heads_q \(2\) must be a multiple of heads_kv \(4\)"),
    ("heads-kv-0", lambda q, k, v: A.attention(q, k[:, :, :0], v[:, :, :0]), ValueError,
     r"multiple of heads_kv \(0\)"),
    # dtypes
    ("dtype-k", lambda q, k, v: A.attention(q, k.half(), v), TypeError,
     "q, k, v must share a dtype, got q torch.bfloat16 and k torch.float16"),
    ("dtype-v", lambda q, k, v: A.attention(q, k, v.float()), TypeError, "and v torch.float32"),
    ("dtype-int", lambda q, k, v: A.attention(*(t.to(torch.int32) for t in (q, k, v))), TypeError,
     "dtype torch.int32 is not supported"),
    # devices
    ("device-k", lambda q, k, v: A.attention(q, k.to(OTHER), v), ValueError,
     f"q, k, v must be on one device, got q on cpu and k on {OTHER}"),
    ("device-v", lambda q, k, v: A.attention(q, k, v.to(OTHER)), ValueError, f"and v on {OTHER}"),
    # shapes
    ("batch", lambda q, k, v: A.attention(q, torch.cat([k, k[:1]]), torch.cat([v, v[:1]])), ValueError,
     "q has batch 2 but k has batch 3"),
    ("k-vs-v", lambda q, k, v: A.attention(q, k, v[:, :6]), ValueError,
     r"k and v must have the same shape, got \(2, 7, 2, 64\) and \(2, 6, 2, 64\)"),
    ("rank-q", lambda q, k, v: A.attention(q[0], k, v), ValueError,
     r"q must be 4D \(batch, seqlen, heads, head_dim\), got shape \(5, 4, 64\)"),
    ("rank-k", lambda q, k, v: A.attention(q, k[None], v[None]), ValueError, "k must be 4D"),
    ("not-a-tensor", lambda q, k, v: A.attention(q.float().numpy(), k, v), TypeError,
     "q must be a torch.Tensor, got ndarray"),
    # options
    ("causal-int", lambda q, k, v: A.attention(q, k, v, causal=1), TypeError, "causal must be a bool, got 1"),
    ("window-below-minus-1", lambda q, k, v: A.attention(q, k, v, window=(-2, 0)), ValueError,
     r"window must be a pair of ints >= -1 \(-1: unbounded side\), got \(-2, 0\)"),
    ("window-one-int", lambda q, k, v: A.attention(q, k, v, window=(3,)), ValueError, "window must be a pair"),
    ("window-float", lambda q, k, v: A.attention(q, k, v, window=(1.5, 2)), ValueError, "window must be a pair"),
    ("window-bool", lambda q, k, v: A.attention(q, k, v, window=(True, 2)), ValueError, "window must be a pair"),
    ("window-int", lambda q, k, v: A.attention(q, k, v, window=4), ValueError, "window must be a pair"),
    ("softcap-negative", lambda q, k, v: A.attention(q, k, v, softcap=-1.0), ValueError,
     r"softcap must be a finite float >= 0 \(0: off\), got -1.0"),
    ("softcap-inf", lambda q, k, v: A.attention(q, k, v, softcap=float("inf")), ValueError, "softcap must be"),
    ("softcap-nan", lambda q, k, v: A.attention(q, k, v, softcap=float("nan")), ValueError, "softcap must be"),
    ("softcap-str", lambda q, k, v: A.attention(q, k, v, softcap="30"), ValueError, "softcap must be"),
    ("scale-0", lambda q, k, v: A.attention(q, k, v, softmax_scale=0.0), ValueError,
     "softmax_scale must be a positive finite float or None, got 0.0"),
    ("scale-negative", lambda q, k, v: A.attention(q, k, v, softmax_scale=-0.1), ValueError, "softmax_scale must"),
    ("scale-nan", lambda q, k, v: A.attention(q, k, v, softmax_scale=float("nan")), ValueError,
     "softmax_scale must"),
    ("scale-inf", lambda q, k, v: A.attention(q, k, v, softmax_scale=float("inf")), ValueError,
     "softmax_scale must"),
    ("scale-bool", lambda q, k, v: A.attention(q, k, v, softmax_scale=True), ValueError, "softmax_scale must"),
    ("alibi-list", lambda q, k, v: A.attention(q, k, v, alibi_slopes=[0.5] * 4), TypeError,
     "alibi_slopes must be a torch.Tensor or None, got list"),
    ("alibi-dtype", lambda q, k, v: A.attention(q, k, v, alibi_slopes=torch.ones(4, dtype=BF16)), TypeError,
     "alibi_slopes must be float32, got torch.bfloat16"),
    ("alibi-shape", lambda q, k, v: A.attention(q, k, v, alibi_slopes=torch.ones(2)), ValueError,
     r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(2,\)"),
    ("alibi-batch", lambda q, k, v: A.attention(q, k, v, alibi_slopes=torch.ones(3, 4)), ValueError,
     r"alibi_slopes must have shape \(4,\) or \(2, 4\), got \(3, 4\)"),
    ("alibi-device", lambda q, k, v: A.attention(q, k, v, alibi_slopes=torch.ones(4, device=OTHER)), ValueError,
     f"alibi_slopes is on {OTHER} but q is on cpu"),
]  # fmt: skip


def _varlen(q, k, v, cu_q=(0, 3, 10), cu_k=(0, 7, 14), max_q=7, max_k=7, **kwargs):
    """attention_varlen on the dense inputs packed: q (10, 4, 64), k, v (14, 2, 64), two
    sequences of 3 and 7 queries; cu_seqlens given as tuples become int32 tensors."""
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    cu_q = _cu(cu_q) if isinstance(cu_q, (tuple, list)) else cu_q
    cu_k = _cu(cu_k) if isinstance(cu_k, (tuple, list)) else cu_k
    return A.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


_VARLEN_ERRORS = [
    ("rank-q", lambda q, k, v: A.attention_varlen(q, k[0], v[0], _cu([0, 7]), _cu([0, 7]), 7, 7), ValueError,
     r"q must be 3D \(tokens, heads, head_dim\), got shape \(2, 5, 4, 64\)"),
    ("head_dim", lambda q, k, v: _varlen(q[..., :44], k[..., :44], v[..., :44]), ValueError,
     "attention_varlen: head_dim 44 is not supported"),
    ("heads", lambda q, k, v: _varlen(q[:, :, :3], k, v), ValueError,
     r"heads_q \(3\) must be a multiple of heads_kv \(2\)"),
    ("dtype", lambda q, k, v: _varlen(q, k, v.half()), TypeError, "must share a dtype"),
    ("device", lambda q, k, v: _varlen(q, k.to(OTHER), v.to(OTHER)), ValueError, "must be on one device"),
    ("cu-int64", lambda q, k, v: _varlen(q, k, v, cu_q=_cu([0, 3, 10], torch.int64)), TypeError,
     "cu_seqlens_q must be int32, got torch.int64"),
    ("cu-k-float", lambda q, k, v: _varlen(q, k, v, cu_k=_cu([0, 7, 14], torch.float32)), TypeError,
     "cu_seqlens_k must be int32, got torch.float32"),
    ("cu-list", lambda q, k, v: A.attention_varlen(q.flatten(0, 1), k.flatten(0, 1),
     v.flatten(0, 1), [0, 3, 10], _cu([0, 7, 14]), 7, 7), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("cu-not-monotonic", lambda q, k, v: _varlen(q, k, v, cu_q=(0, 8, 5, 10), cu_k=(0, 7, 7, 14), max_q=8),
     ValueError, r"cu_seqlens_q must be non-decreasing, got \[0, 8, 5, 10\]"),
    ("cu-k-not-monotonic", lambda q, k, v: _varlen(q, k, v, cu_q=(0, 3, 3, 10), cu_k=(0, 9, 7, 14), max_k=9),
     ValueError, "cu_seqlens_k must be non-decreasing"),
    ("cu-not-from-0", lambda q, k, v: _varlen(q, k, v, cu_q=(1, 3, 10)), ValueError,
     r"cu_seqlens_q must start at 0 and end at the token count 10, got 1 \.\.\. 10"),
    ("cu-not-to-tokens", lambda q, k, v: _varlen(q, k, v, cu_q=(0, 3, 9)), ValueError,
     r"cu_seqlens_q must start at 0 and end at the token count 10, got 0 \.\.\. 9"),
    ("cu-k-past-tokens", lambda q, k, v: _varlen(q, k, v, cu_k=(0, 7, 15), max_k=8), ValueError,
     "cu_seqlens_k must start at 0 and end at the token count 14"),
    ("cu-device", lambda q, k, v: _varlen(q, k, v, cu_q=_cu([0, 3, 10], device=OTHER)), ValueError,
     f"cu_seqlens_q is on {OTHER} but q is on cpu"),
    ("cu-2d", lambda q, k, v: _varlen(q, k, v, cu_q=_cu([[0, 3, 10]])), ValueError,
     r"cu_seqlens_q must be 1D \(n_seqs \+ 1,\), got shape \(1, 3\)"),
    ("cu-empty", lambda q, k, v: _varlen(q, k, v, cu_q=_cu([])), ValueError, "cu_seqlens_q must be 1D"),
    ("cu-count", lambda q, k, v: _varlen(q, k, v, cu_k=(0, 7, 7, 14)), ValueError,
     "cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got 2 and 3"),
    ("max_seqlen-below", lambda q, k, v: _varlen(q, k, v, max_q=6), ValueError,
     r"max_seqlen 6 is below the longest sequence \(7\) in cu_seqlens_q"),
    ("max_seqlen-k-below", lambda q, k, v: _varlen(q, k, v, max_k=1), ValueError,
     r"max_seqlen 1 is below the longest sequence \(7\) in cu_seqlens_k"),
    ("max_seqlen-negative", lambda q, k, v: _varlen(q, k, v, max_q=-1), ValueError,
     "max_seqlen for cu_seqlens_q must be a Python int >= 0, got -1"),
    ("max_seqlen-float", lambda q, k, v: _varlen(q, k, v, max_k=7.0), ValueError,
     "max_seqlen for cu_seqlens_k must be a Python int >= 0, got 7.0"),
    ("alibi-seqs", lambda q, k, v: _varlen(q, k, v, alibi_slopes=torch.ones(3, 4)), ValueError,
     r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    ("window", lambda q, k, v: _varlen(q, k, v, window=(0, -3)), ValueError, "attention_varlen: window must"),
    ("softcap", lambda q, k, v: _varlen(q, k, v, softcap=-2.0), ValueError, "attention_varlen: softcap must"),
    ("scale", lambda q, k, v: _varlen(q, k, v, softmax_scale=-1.0), ValueError, "attention_varlen: softmax_scale"),
]  # fmt: skip


def _error_params():
    return [
        pytest.param(fn, call, error, match, id=f"{fn}-{name}")
        for fn, cases in (("attention", _DENSE_ERRORS), ("attention_varlen", _VARLEN_ERRORS))
        for name, call, error, match in cases
    ]


@pytest.mark.parametrize(("fn", "call", "error", "match"), _error_params())
def test_bad_input_is_a_clear_error_before_any_kernel(fn, call, error, match) -> None:
    # Every implementation raises AssertionError if reached (neither a ValueError nor a
    # TypeError): the error must come from the argument checks, before any kernel.
    with contextlib.ExitStack() as stack:
        for op in ("attention", "attention_backward"):
            for impl in dispatch.implementations(op):
                stack.enter_context(failing_implementation(op, impl.name, AssertionError(f"{impl.name} ran")))
        with pytest.raises(error, match=match) as caught:
            call(*_dense())
    assert str(caught.value).startswith(f"{fn}: "), "an error names the function it comes from"


def test_every_supported_head_dim_is_accepted() -> None:
    for d in HEAD_DIMS:
        q, k, v = _dense((1, 3, 2, d), (1, 4, 1, d))
        assert A.attention(q, k, v).shape == (1, 3, 2, d)


def test_options_accept_numbers_and_lists() -> None:
    # Python numbers of other types (numpy ints, a list window) are accepted as such.
    import numpy as np

    q, k, v = _dense()
    ref = A.attention(q, k, v, window=(3, 2), softmax_scale=0.25, softcap=5.0)
    got = A.attention(q, k, v, window=[np.int64(3), 2], softmax_scale=np.float32(0.25), softcap=5)
    assert torch.equal(ref, got)


# ---- return values, meta tensors, double backward -----------------------------------------


def test_return_lse_shapes_and_dtypes() -> None:
    q, k, v = _dense()
    out = A.attention(q, k, v)
    assert (
        isinstance(out, torch.Tensor) and out.shape == q.shape and out.dtype == BF16 and out.is_contiguous()
    )
    out, lse = A.attention(q, k, v, return_lse=True)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32 and lse.is_contiguous()
    _, lse = A.attention(*(t.double() for t in (q, k, v)), return_lse=True)
    assert lse.dtype == torch.float64
    out, lse = _varlen(q, k, v, return_lse=True)
    assert out.shape == (10, 4, 64) and lse.shape == (4, 10) and lse.dtype == torch.float32


def test_meta_tensors_use_the_fake() -> None:
    q, k, v = (t.to("meta").requires_grad_() for t in _dense())
    out, lse = A.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.device.type == "meta" and lse.shape == (2, 4, 5)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    cu = _cu([0, 5, 12], device="meta")
    q, k, v = (t.to("meta") for t in _dense((12, 4, 64), (12, 2, 64)))
    out, lse = A.attention_varlen(q, k, v, cu, cu, 7, 7, return_lse=True)
    assert out.shape == (12, 4, 64) and lse.shape == (4, 12)


def test_double_backward_is_a_clear_error() -> None:
    q, k, v = (t.double().requires_grad_() for t in _dense((1, 3, 2, 32), (1, 4, 1, 32)))
    out = A.attention(q, k, v)  # eager: the autograd.Function
    (g,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|double backward"):
        g.sum().backward()
    out, _ = torch.ops.openkernels.attention(q, k, v, None, None, 3, 4, 0.2, -1, -1, None, 0.0)  # library op
    (g,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward is not supported"):
        g.sum().backward()


# ---- dispatch ----------------------------------------------------------------------------


def test_explain_names_the_choice() -> None:
    q = torch.randn(1, 4, 2, 64)
    text = dispatch.explain("attention", q)
    assert "runs 'cpu'" in text and "reference" in text and "triton" in text
    bwd = dispatch.explain("attention_backward", q, q)
    assert "runs 'cpu'" in bwd


def test_float32_is_the_slower_path_on_gpus() -> None:
    # explain() on a GPU tensor shows the Triton rejection; the same predicate, here on a
    # CUDA key, must say that float32 (and float64) take a slower path.
    triton = next(i for i in dispatch.implementations("attention") if i.name == "triton")
    for dtype in (torch.float32, torch.float64):
        why = triton.supports(DispatchKey("cuda", "sm_90", dtype))
        assert why is not None and "slower path" in why and "float16 and bfloat16" in why
    assert "float16" not in (triton.supports(DispatchKey("cuda", "sm_90", BF16)) or "")


def test_softcap_takes_the_tanh_instruction_on_hopper_only() -> None:
    # HAS_SOFTCAP 2 compiles NVIDIA inline asm: never for ROCm, the interpreter or sm_80
    # (whose general backward configs spill with it); both the dense and the KV-cache plans.
    from openkernels.attention.core.triton import plan as dense_plan
    from openkernels.attention.core.triton.plan import softcap_flag

    assert [softcap_flag(30.0, a) for a in ("sm_90", "sm_90a", "sm_100")] == [2, 2, 2]
    assert [
        softcap_flag(30.0, a) for a in ("sm_80", "sm_86", "gfx942", "gfx950", "interpreter", "x86_64")
    ] == [1] * 6
    assert softcap_flag(0.0, "sm_90") == 0
    p = dense_plan.Problem(1, 64, 64, 2, 2, 64, False, 0.125, -1, -1, False, 30.0)
    strides = ((0, 128, 64),) * 4
    assert dense_plan.fwd(p, "sm_90", BF16, strides, (128, 64)).args["HAS_SOFTCAP"] == 2
    assert dense_plan.fwd(p, "gfx942", BF16, strides, (128, 64)).args["HAS_SOFTCAP"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_explain_float32_on_gpu_mentions_the_slower_path() -> None:
    q = torch.randn(1, 4, 2, 64, device="cuda")
    text = dispatch.explain("attention", q)
    assert "slower path" in text and "runs 'reference'" in text
    assert "runs 'triton'" in dispatch.explain("attention", q.to(BF16))


def test_forced_implementation_reaches_the_backward_on_another_thread() -> None:
    # Autograd runs CUDA backwards on its own device threads, where the caller's context
    # variables (dispatch.force, dispatch.strict) are not set: a backward run on another
    # thread here must still use the implementation the forward was forced to.
    q, k, v = (t.requires_grad_() for t in _dense())
    with dispatch.force("reference"):
        outs = [A.attention(q, k, v), torch.ops.openkernels.attention(q, k, v, None, None, 5, 7, 0.125, -1, -1,
                                                                      None, 0.0)[0]]  # fmt: skip
    for out in outs:
        grads = []
        with recording_implementation("attention_backward", "reference") as calls:
            thread = threading.Thread(
                target=lambda out=out, grads=grads: grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
            )
            thread.start()
            thread.join()
        assert len(grads) == 1 and len(calls) == 1, "the backward ran another implementation than the forward"


def test_failing_kernel_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENKERNELS_STRICT", "0")
    q, k, v = _dense()
    with (
        failing_implementation("attention", "cpu", RuntimeError("no launch")),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        first = A.attention(q, k, v, causal=True)
        second = A.attention(q, k, v, causal=True)
    fallbacks = [w for w in caught if issubclass(w.category, dispatch.KernelFallbackWarning)]
    assert len(fallbacks) == 1 and "no launch" in str(fallbacks[0].message)
    ref = R.attention_ref(q.double(), k.double(), v.double(), causal=True)
    assert_attention_close(
        first, ref, dtype=BF16, magnitude=float(v.abs().max()), terms=7 + 64, msg="fallback"
    )
    assert torch.equal(first, second)


def test_failing_kernel_raises_in_strict_mode() -> None:
    q, k, v = _dense()
    failing = failing_implementation("attention", "cpu", RuntimeError("no launch"))
    with failing, dispatch.strict(), pytest.raises(RuntimeError, match="no launch"):
        A.attention(q, k, v)


# ---- Hugging Face attention function -----------------------------------------------------


class _Attn(torch.nn.Module):
    """What transformers passes as `module`: an attention layer with is_causal."""

    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal


def _hf_inputs(b=2, hq=4, hkv=2, sq=19, sk=19, d=64, dtype=BF16):
    """SDPA layout: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D)."""
    return (random_tensor((b, hq, sq, d), dtype), random_tensor((b, hkv, sk, d), dtype),
            random_tensor((b, hkv, sk, d), dtype))  # fmt: skip


def _sdpa64(query, key, value, **kwargs) -> torch.Tensor:
    """torch's SDPA in float64, in the (B, S, H, D) layout hf_attention_forward returns."""
    args = [t.double() for t in (query, key, value)]
    mask = kwargs.pop("attn_mask", None)
    if mask is not None and mask.is_floating_point():
        mask = mask.double()
    out = F.scaled_dot_product_attention(
        *args, attn_mask=mask, enable_gqa=query.shape[1] != key.shape[1], **kwargs
    )
    return out.transpose(1, 2)


def _check_hf(out, ref, value, msg) -> None:
    assert out.shape == ref.shape and out.dtype == value.dtype, f"{msg}: {out.shape} {out.dtype}"
    assert_attention_close(out, ref, dtype=value.dtype, magnitude=float(value.abs().max()),
                           terms=value.shape[2] + value.shape[3], msg=msg)  # fmt: skip


def _bottom_right_mask(sq, sk, *, causal=True, sliding_window=None) -> torch.Tensor:
    """Boolean (Sq, Sk) mask, True = attend: causal aligned bottom-right, transformers' window
    (a token sees itself and the sliding_window - 1 before it)."""
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    mask = j <= i if causal else torch.ones(sq, sk, dtype=torch.bool)
    if sliding_window:
        mask &= j > i - sliding_window
    return mask


def test_hf_causal_gqa_matches_sdpa() -> None:
    query, key, value = _hf_inputs()
    out, weights = A.hf_attention_forward(_Attn(), query, key, value, None)
    assert weights is None
    _check_hf(out, _sdpa64(query, key, value, is_causal=True), value, "causal")
    # is_causal given explicitly wins over the module's attribute.
    out, _ = A.hf_attention_forward(_Attn(is_causal=False), query, key, value, None, is_causal=True)
    _check_hf(out, _sdpa64(query, key, value, is_causal=True), value, "is_causal=True")


def test_hf_bidirectional_with_scaling_matches_sdpa() -> None:
    query, key, value = _hf_inputs(hkv=1, sq=7, sk=23)
    out, _ = A.hf_attention_forward(_Attn(is_causal=False), query, key, value, None, scaling=0.3)
    _check_hf(out, _sdpa64(query, key, value, scale=0.3), value, "bidirectional scaling=0.3")


def test_hf_decode_with_cache_is_aligned_bottom_right() -> None:
    # A few new tokens against a longer cache: each sees the whole prefix and itself.
    query, key, value = _hf_inputs(sq=3, sk=20)
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, None)
    _check_hf(out, _sdpa64(query, key, value, attn_mask=_bottom_right_mask(3, 20)), value, "decode")


def test_hf_sliding_window_matches_sdpa_with_its_mask() -> None:
    query, key, value = _hf_inputs(sq=23, sk=23)
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, None, sliding_window=5)
    mask = _bottom_right_mask(23, 23, sliding_window=5)
    _check_hf(out, _sdpa64(query, key, value, attn_mask=mask), value, "sliding_window=5")


def test_hf_softcap_matches_the_reference() -> None:
    query, key, value = _hf_inputs()
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, None, softcap=2.0, scaling=0.3)
    ref = R.attention_ref(*(t.double().transpose(1, 2) for t in (query, key, value)), causal=True, softcap=2.0,
                          softmax_scale=0.3)  # fmt: skip
    _check_hf(out, ref, value, "softcap")


def _padding_masks(b, sq, sk):
    """transformers' 4D masks for right padding (the last 4 keys of sequence 0 are padding),
    causal included: boolean (True = attend) and additive float."""
    keep = torch.ones(b, sk, dtype=torch.bool)
    keep[0, -4:] = False
    allowed = _bottom_right_mask(sq, sk)[None, None] & keep[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return {"bool": allowed, "float": additive.to(BF16)}


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_hf_padding_mask_matches_sdpa(kind: str) -> None:
    query, key, value = _hf_inputs()
    mask = _padding_masks(2, 19, 19)[kind]
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, mask)
    assert out.is_contiguous()
    _check_hf(out, _sdpa64(query, key, value, attn_mask=mask), value, f"{kind} padding mask")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_hf_padding_mask_keeps_the_softcap(kind: str) -> None:
    # Gemma 2 style: softcap with a padded batch. SDPA has no softcap, so the mask path must
    # not just call it (explicit math in float64 here: cap, then mask, then softmax).
    query, key, value = _hf_inputs()
    mask = _padding_masks(2, 19, 19)[kind]
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, mask, softcap=2.0, scaling=0.3)
    q64, k64, v64 = (t.double() for t in (query, key, value))
    k64, v64 = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    s = 2.0 * torch.tanh(q64 @ k64.transpose(-1, -2) * 0.3 / 2.0)
    s = s.masked_fill(~mask, float("-inf")) if kind == "bool" else s + mask.double()
    ref = (torch.softmax(s, -1) @ v64).transpose(1, 2)
    _check_hf(out, ref, value, f"softcap with a {kind} padding mask")


def test_hf_reads_the_sdpa_layout_without_copies() -> None:
    query, key, value = _hf_inputs()
    with recording_implementation("attention", "cpu") as calls:
        A.hf_attention_forward(_Attn(), query, key, value, None)
    (args,) = calls
    for name, x, seen in zip(("query", "key", "value"), (query, key, value), args[:3]):
        assert seen.data_ptr() == x.data_ptr() and seen.stride() == x.transpose(1, 2).stride(), name


def test_hf_dropout_only_in_training() -> None:
    query, key, value = _hf_inputs()
    module = _Attn().eval()
    out, _ = A.hf_attention_forward(module, query, key, value, None, dropout=0.5)
    assert torch.equal(out, A.hf_attention_forward(module, query, key, value, None)[0])
    module.train()
    torch.manual_seed(0)
    dropped, _ = A.hf_attention_forward(module, query, key, value, None, dropout=0.5)
    assert dropped.shape == out.shape and not torch.equal(dropped, out)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_hf_dropout_runs_the_op_with_causality_and_window(softcap) -> None:
    # Training with dropout and no mask from transformers runs the op's own dropout (its seed
    # drawn from torch's generator): causality (aligned bottom-right) and the window apply.
    query, key, value = _hf_inputs(sq=7, sk=20)
    module = _Attn().train()
    torch.manual_seed(1)
    out, _ = A.hf_attention_forward(
        module, query, key, value, None, dropout=0.3, sliding_window=6, softcap=softcap
    )
    torch.manual_seed(1)
    ref = A.attention(*(t.transpose(1, 2) for t in (query, key, value)), causal=True, window=(5, -1),
                      softcap=float(softcap or 0.0), dropout_p=0.3)  # fmt: skip
    assert torch.equal(out, ref)
    poisoned = value.clone()
    poisoned[:, :, ~_bottom_right_mask(7, 20, sliding_window=6).any(0)] = 1e4  # keys no query may see
    torch.manual_seed(1)
    again, _ = A.hf_attention_forward(module, query, key, poisoned, None, dropout=0.3, sliding_window=6,
                                      softcap=softcap)  # fmt: skip
    assert torch.equal(out, again), "a key outside the causal window reached the output"
    torch.manual_seed(1)
    redrawn, _ = A.hf_attention_forward(module, query, key, value, None, dropout=0.3, softcap=softcap)
    assert not torch.equal(out, redrawn), "the window made no difference: the test cannot fail"


def test_hf_gradients_flow() -> None:
    query, key, value = (t.requires_grad_() for t in _hf_inputs())
    out, _ = A.hf_attention_forward(_Attn(), query, key, value, None, sliding_window=6)
    dout = random_tensor(tuple(out.shape), BF16)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    # The same call in the (B, S, H, D) layout through the shared reference comparison.
    case = Case(*(t.transpose(1, 2) for t in (query, key, value)), Options(causal=True, window=(5, -1)))
    _, lse = case.call()
    compare(case, out, lse, [g.transpose(1, 2) for g in grads], dout, "hf gradients")


def test_register_with_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            A.register_with_transformers()
        pytest.skip("transformers is not installed: registering raises ImportError, as it should")
    from transformers import AttentionInterface

    A.register_with_transformers()
    assert AttentionInterface()["openkernels"] is A.hf_attention_forward
