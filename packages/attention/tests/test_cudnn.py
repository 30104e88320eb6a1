"""The cuDNN implementation of attention (cudnn.py): which calls are plain (checked on the
CPU, where the rules are plain Python), the dispatch predicate and `explain`; on an sm_90
GPU, plain calls against the float64 reference (forward and backward, GQA, causal and full,
non-contiguous views), that dispatch picks cuDNN for them and the Triton kernels for the
rest, and that either backward takes the other forward's log-sum-exp."""

from __future__ import annotations

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.core import cudnn
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import random_tensor

from .cases import Case, Options, Shape, check_against_reference, compare, dense_case, run

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _qkv(sq=512, sk=512, hq=4, hkv=4, d=128, dtype=torch.bfloat16, device="cpu"):
    return (random_tensor((2, sq, hq, d), dtype, device), random_tensor((2, sk, hkv, d), dtype, device),
            random_tensor((2, sk, hkv, d), dtype, device))  # fmt: skip


def _allow_nondeterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's backward allowed; dispatch forgets selections made before (and after the test)."""
    monkeypatch.setenv(cudnn.NONDETERMINISTIC_ENV, "1")
    dispatch.changed()


@pytest.fixture(autouse=True)
def _fresh_selections():
    yield
    dispatch.changed()


def _plain(q, k, v, *, cu=None, alibi=None, softcap=0.0, window=(-1, -1)) -> bool:
    return cudnn.is_plain(q, k, v, cu, alibi, softcap, window[0], window[1])


def test_which_calls_are_plain() -> None:
    q, k, v = _qkv()
    assert _plain(q, k, v) and _plain(q, k, v, window=(-1, 0))  # full and causal
    assert _plain(*_qkv(hkv=2)) and _plain(*_qkv(d=64)) and _plain(*_qkv(dtype=torch.float16))
    assert _plain(*_qkv(sk=700))  # full attention over more keys
    assert not _plain(*_qkv(sk=700), window=(-1, 0))  # causal, unequal lengths: aligned differently
    assert not _plain(*_qkv(sq=511, sk=511))  # short: the replayable Triton kernels
    assert not _plain(*_qkv(d=96)) and not _plain(*_qkv(dtype=torch.float32))
    assert not _plain(q, k, v, window=(8, 0)) and not _plain(q, k, v, softcap=30.0)
    assert not _plain(q, k, v, alibi=torch.ones(4)) and not _plain(
        q, k, v, cu=torch.zeros(3, dtype=torch.int32)
    )
    wide = random_tensor((2, 512, 4, 132), torch.bfloat16)[..., 4:]  # strides of 132: not multiples of 8
    assert not _plain(wide, k, v)
    bhsd = random_tensor((2, 4, 512, 128), torch.bfloat16).transpose(1, 2)  # SDPA's layout: aligned
    assert _plain(bhsd, k, v)


def test_the_backward_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    # cuDNN's backward is not deterministic: the default backward stays a deterministic one.
    key = dispatch.DispatchKey("cuda", "sm_90", torch.bfloat16, frozenset({"plain"}))
    if cudnn.supports(key) is not None:
        pytest.skip("this torch has no cuDNN attention")
    monkeypatch.delenv(cudnn.NONDETERMINISTIC_ENV, raising=False)
    assert "not deterministic" in cudnn.supports_backward(key)
    monkeypatch.setenv(cudnn.NONDETERMINISTIC_ENV, "1")
    assert cudnn.supports_backward(key) is None


def test_the_predicate_and_explain() -> None:
    key = dispatch.DispatchKey
    plain = frozenset({"plain"})
    if cudnn._FWD is not None and torch.backends.cudnn.is_available():
        assert cudnn.supports(key("cuda", "sm_90", torch.bfloat16, plain)) is None
    assert "sm_80" in cudnn.supports(key("cuda", "sm_80", torch.bfloat16, plain))
    assert "plain" in cudnn.supports(key("cuda", "sm_90", torch.bfloat16))
    assert "NVIDIA" in cudnn.supports(key("rocm", "gfx942", torch.bfloat16, plain))
    text = dispatch.explain("attention", torch.randn(1, 4, 2, 64))
    assert "cudnn: runs on cuda, not cpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("heads", "d", "dtype"), [((8, 8), 128, torch.bfloat16), ((8, 2), 64, torch.float16)]
)
def test_plain_calls_match_the_reference(
    causal: bool, heads: tuple[int, int], d: int, dtype, monkeypatch
) -> None:
    _allow_nondeterministic(monkeypatch)  # cuDNN's backward too
    shape = Shape(2, 640, 640, heads[0], heads[1], d)
    check_against_reference(dense_case(shape, Options(causal=causal), dtype, "cuda"), "cudnn")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_dispatch_picks_cudnn_for_plain_calls_only() -> None:
    q, k, v = _qkv(device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 512, device="cuda")
    opts = dict(max_seqlen_q=512, max_seqlen_k=512, scale=0.1, window_left=-1, window_right=0, alibi_slopes=None,
                softcap=0.0)  # fmt: skip
    assert "-> cudnn" in dispatch.explain("attention", q, k, v, out, lse, None, None, **opts)
    assert "-> triton" in dispatch.explain(
        "attention", q, k, v, out, lse, None, None, **{**opts, "softcap": 20.0}
    )
    assert "-> triton" in dispatch.explain(
        "attention", q[:, :64], k[:, :64], v[:, :64], out, lse, None, None, **opts
    )


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_each_backward_takes_the_other_forwards_lse(monkeypatch: pytest.MonkeyPatch) -> None:
    # A forced forward and an unforced backward may differ: their lse must mean the same.
    _allow_nondeterministic(monkeypatch)
    case = dense_case(Shape(1, 512, 512, 4, 4, 128), Options(causal=True), torch.bfloat16, "cuda")
    for fwd, bwd in (("cudnn", "triton"), ("triton", "cudnn")):
        with dispatch.force(f"attention:{fwd}", f"attention_backward:{bwd}"):
            out, lse = case.call()
            dout = random_tensor(tuple(out.shape), out.dtype, "cuda")
            grads = torch.autograd.grad(out, (case.q, case.k, case.v), dout)
        compare(case, out, lse, grads, dout, f"{fwd} forward, {bwd} backward")


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_sdpa_layout_views(monkeypatch: pytest.MonkeyPatch) -> None:
    _allow_nondeterministic(monkeypatch)
    b, s, h, d = 2, 512, 4, 128
    q, k, v = (
        random_tensor((b, h, s, d), torch.bfloat16, "cuda").transpose(1, 2).requires_grad_() for _ in range(3)
    )
    out, lse, grads, dout = run(Case(q, k, v, Options(causal=True)), "cudnn")
    compare(Case(q, k, v, Options(causal=True)), out, lse, grads, dout, "bhsd views")
    assert out.is_contiguous() and all(g.is_contiguous() for g in grads)
    assert A.attention(q, k, v, causal=True).shape == (b, s, h, d)
