"""The Gluon Hopper kernels of attention (core/gluon): the dispatch predicate and `explain` on
the CPU; on an sm_90 GPU, forced, against the float64 reference: the forward (both consumer
schedules) with the family's backward, the backward after the default forward, and both
together; causal and full, GQA and MQA, odd lengths, fp16 / bf16, D64 / D128, SDPA-layout
views. Their compile check for sm_90 is in test_aot.py (aot_gluon_cases.py)."""

from __future__ import annotations

import os

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.core import cudnn, gluon
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import random_tensor

from .cases import Case, Options, Shape, check_against_reference, compare, dense_case, run

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(autouse=True)
def _fresh_selections():
    yield
    dispatch.changed()


def test_the_predicate_and_explain() -> None:
    key = dispatch.DispatchKey
    plain = frozenset({"plain"})
    assert "Hopper" in gluon.supports(key("cuda", "sm_80", torch.bfloat16, plain))
    assert "plain" in gluon.supports(key("cuda", "sm_90", torch.bfloat16))
    assert "NVIDIA" in gluon.supports(key("rocm", "gfx942", torch.bfloat16, plain))
    assert "NVIDIA" in gluon.supports(key("cpu", "avx2", torch.float32, plain))
    if gluon.gluon_hopper_available():
        assert gluon.supports(key("cuda", "sm_90", torch.bfloat16, plain)) is None
    text = dispatch.explain("attention", torch.randn(1, 4, 2, 64))
    assert "gluon: runs on cuda, not cpu [priority 15]" in text  # the forward: forced only
    q = torch.randn(1, 4, 2, 64)
    text = dispatch.explain("attention_backward", q, q, q, q, q, torch.empty(1, 2, 4), q, q, q, None, None,
                            max_seqlen_q=4, max_seqlen_k=4, scale=0.1, window_left=-1, window_right=0,
                            alibi_slopes=None, softcap=0.0)  # fmt: skip
    assert "gluon: runs on cuda, not cpu [priority 25]" in text  # the backward: above Triton (20)


def test_configs_fit_hopper_shared_memory() -> None:
    # 16-bit blocks within 227 KiB: forward Q (2 x 64 rows) and STAGES K and V blocks;
    # dK/dV K and V (2 x 64 keys) and STAGES Q and dO blocks; dQ Q and dO and STAGES K and V.
    limit = 227 * 1024
    for d in gluon.HEAD_DIMS:
        block_n, stages = gluon.config(d)
        assert (2 * gluon.ROWS + 2 * stages * block_n) * d * 2 <= limit
        q_rows, kv_stages, bwd_block_n, q_stages = gluon.bwd_config(d)
        assert (4 * gluon.ROWS + 2 * kv_stages * q_rows) * d * 2 <= limit
        assert (4 * gluon.ROWS + 2 * q_stages * bwd_block_n) * d * 2 <= limit


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        (Shape(2, 640, 640, 8, 8, 128), torch.bfloat16),
        (Shape(1, 1000, 1000, 4, 2, 128), torch.float16),
        (Shape(2, 777, 777, 8, 2, 64), torch.bfloat16),
        (Shape(1, 4096, 4096, 2, 1, 64), torch.float16),
        (Shape(1, 2048, 2048, 2, 2, 128), torch.bfloat16),
    ],
    ids=str,
)
@pytest.mark.parametrize("pingpong", [False, True], ids=["overlap", "pingpong"])
def test_forced_calls_match_the_reference(
    causal: bool, shape: Shape, dtype: torch.dtype, pingpong: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gluon, "PINGPONG", pingpong)  # both consumer schedules
    check_against_reference(dense_case(shape, Options(causal=causal), dtype, "cuda"), "attention:gluon")


_BWD_SHAPES = [
    (Shape(2, 640, 640, 8, 8, 128), torch.bfloat16),
    (Shape(1, 1000, 1000, 8, 1, 128), torch.float16),  # MQA: one key/value head for 8 query heads
    (Shape(2, 777, 777, 8, 2, 64), torch.bfloat16),
    (Shape(1, 2048, 2048, 2, 2, 64), torch.float16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("shape", "dtype"), _BWD_SHAPES, ids=str)
@pytest.mark.parametrize("forward", ["default", "gluon"])
def test_forced_backward_matches_the_reference(
    causal: bool, shape: Shape, dtype: torch.dtype, forward: str
) -> None:
    # The backward from the default forward's out and lse (cuDNN's here), and with the Gluon forward.
    with dispatch.force("attention_backward:gluon"):
        impl = "attention:gluon" if forward == "gluon" else "attention_backward:gluon"
        check_against_reference(dense_case(shape, Options(causal=causal), dtype, "cuda"), impl)


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_backward_is_deterministic() -> None:
    # The default backward of plain calls on sm_90: two identical runs, bitwise equal gradients
    # (GQA's dK/dV summed over the group, dQ over key blocks, in a fixed order).
    for causal in (False, True):
        case = dense_case(Shape(2, 1030, 1030, 8, 2, 128), Options(causal=causal), torch.bfloat16, "cuda")
        dout = random_tensor(tuple(case.q.shape), torch.bfloat16, "cuda")
        first = run(case, "attention_backward:gluon", dout=dout)
        second = run(case, "attention_backward:gluon", dout=dout)
        for name, a, b in zip(("dq", "dk", "dv"), first[2], second[2]):
            assert torch.equal(a, b), f"causal={causal}: {name} differs between two identical runs"


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_backward_over_more_keys() -> None:
    with dispatch.force("attention_backward:gluon"):
        check_against_reference(dense_case(Shape(1, 512, 901, 4, 2, 128), Options(), torch.bfloat16, "cuda"),
                                "attention:gluon")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_full_attention_over_more_keys() -> None:
    # Sk > Sq and not a multiple of the key block: the last block is masked, its rows zero-filled.
    check_against_reference(dense_case(Shape(1, 512, 901, 4, 4, 128), Options(), torch.bfloat16, "cuda"),
                            "attention:gluon")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_explain_names_it_when_forced() -> None:
    q = random_tensor((1, 512, 4, 128), torch.bfloat16, "cuda")
    out, lse = torch.empty_like(q), torch.empty(1, 4, 512, device="cuda")
    opts = dict(max_seqlen_q=512, max_seqlen_k=512, scale=0.1, window_left=-1, window_right=0, alibi_slopes=None,
                softcap=0.0)  # fmt: skip
    with dispatch.force("attention:gluon"):
        assert "-> gluon" in dispatch.explain("attention", q, q, q, out, lse, None, None, **opts)
    assert "-> gluon" not in dispatch.explain("attention", q, q, q, out, lse, None, None, **opts)
    grads = (torch.empty_like(q),) * 3
    with dispatch.force("attention_backward:gluon"):
        text = dispatch.explain("attention_backward", q, q, q, q, out, lse, *grads, None, None, **opts)
        assert "-> gluon" in text
    # The backward is the default for plain calls (unless cuDNN's may run: nondeterministic).
    if not os.environ.get(cudnn.NONDETERMINISTIC_ENV):
        text = dispatch.explain("attention_backward", q, q, q, q, out, lse, *grads, None, None, **opts)
        assert "-> gluon" in text, text


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_sdpa_layout_views_and_nan() -> None:
    b, s, h, d = 2, 512, 4, 128
    q, k, v = (
        random_tensor((b, h, s, d), torch.bfloat16, "cuda").transpose(1, 2).requires_grad_() for _ in range(3)
    )
    out, lse, grads, dout = run(Case(q, k, v, Options(causal=True)), "attention:gluon")
    compare(Case(q, k, v, Options(causal=True)), out, lse, grads, dout, "bhsd views")
    # A NaN in one sequence's value stays in that sequence (blocks never read the next one).
    v2 = v.detach().clone()
    v2[1, 100, 2, 5] = float("nan")
    with dispatch.force("attention:gluon"):
        out2 = A.attention(q.detach(), k.detach(), v2, causal=False)
        out2 = out2[0] if isinstance(out2, tuple) else out2
    assert not out2[0].isnan().any() and out2[1, :, 2, 5].isnan().all()


def test_outputs_the_kernels_cannot_index_get_a_packed_stand_in() -> None:
    # The kernels store rows at head stride D: an SDPA-layout output (a (B, S, H, D) view of
    # (B, H, S, D)) is written through a packed stand-in and copied, never indexed as it is.
    sdpa = torch.empty(2, 3, 5, 64).transpose(1, 2)
    assert not gluon._packs_heads(torch.empty_like(sdpa))  # why not empty_like: it keeps the strides
    stand_in = gluon._output(sdpa)
    assert stand_in is not sdpa and stand_in.shape == sdpa.shape and gluon._packs_heads(stand_in)
    packed = torch.empty(2, 5, 3, 64)
    assert gluon._output(packed) is packed
    gluon._check_layouts({"out": packed}, {"lse": torch.empty(2, 3, 5)})
    with pytest.raises(ValueError, match="dq: each token's heads must be contiguous"):
        gluon._check_layouts({"dq": sdpa}, {})
    with pytest.raises(ValueError, match="delta: expected unit stride"):
        gluon._check_layouts({}, {"delta": torch.empty(2, 5, 3).transpose(1, 2)})


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
def test_entries_write_outputs_of_any_layout() -> None:
    # attn_fwd / attn_bwd called as dispatch calls them, with SDPA-layout outputs: the same
    # bits as with packed ones.
    b, s, h, d = 1, 640, 4, 128
    q, k, v, dout = (random_tensor((b, s, h, d), torch.bfloat16, "cuda") for _ in range(4))
    opts = dict(max_seqlen_q=s, max_seqlen_k=s, scale=d**-0.5, window_left=-1, window_right=0, alibi_slopes=None,
                softcap=0.0)  # fmt: skip

    def fwd_bwd(make):
        out, lse = make(), torch.empty(b, h, s, device="cuda")
        gluon.attn_fwd(q, k, v, out, lse, None, None, **opts)
        grads = [make() for _ in range(3)]
        gluon.attn_bwd(dout, q, k, v, out, lse, *grads, None, None, **opts)
        return [out, lse, *grads]

    packed = fwd_bwd(lambda: torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda"))
    sdpa = fwd_bwd(lambda: torch.empty(b, h, s, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2))
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), packed, sdpa):
        assert not x.isnan().any(), name
        assert torch.equal(x, y), name
