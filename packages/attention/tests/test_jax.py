"""openkernels.attention.jax against the PyTorch reference (float64) on the same inputs, on
every JAX backend that runs here: forward and gradients under jax.jit (jax.vjp and jax.grad
of a loss), every option, GQA/MQA, seqlen_q != seqlen_k, odd lengths and rows without keys,
varlen with empty sequences, the gradient through lse, NaN, empty inputs, rotary, bad inputs.
Under the interpreter the JAX launches must give the PyTorch launcher's bits (same kernels,
same configs). Tolerances: cases.compare, the family's correctness criterion."""

from __future__ import annotations

import dataclasses

import pytest
import torch

jax = pytest.importorskip("jax")
jnp = jax.numpy

import openkernels.attention as A  # noqa: E402
import openkernels.attention.core.jax as AJC  # noqa: E402
import openkernels.attention.jax as AJ  # noqa: E402
from openkernels.attention.rotary import reference as RR  # noqa: E402
from openkernels.shared import dispatch  # noqa: E402
from openkernels.shared import jax as okjax  # noqa: E402
from openkernels.shared.dev.testing import assert_close, random_tensor  # noqa: E402
from openkernels.shared.dev.testing.jax import jax_backends, to_jax, to_torch  # noqa: E402

from .cases import (  # noqa: E402
    FEW_OPTIONS,
    INTERPRETING,
    SOFTCAP,
    Case,
    Options,
    Shape,
    assert_attention_close,
    compare,
    cu_seqlens,
    dense_case,
    nan_case,
    option_params,
    probabilities,
    varlen_case,
)
from .kvcache_cases import KVCall, Scenario, build, check_append, snapshot  # noqa: E402
from .kvcache_cases import compare as kv_compare  # noqa: E402
from .kvcache_cases import raw_bits as kv_bits  # noqa: E402

pytestmark = pytest.mark.parametrize("backend", jax_backends())

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
_DTYPE_IDS = {BF16: "bf16", F16: "fp16", F32: "fp32", F64: "fp64"}
# The interpreter runs every program in numpy: one small shape there (GQA, seqlen_q != seqlen_k,
# ragged blocks); elsewhere the shapes of test_correctness.
_SHAPES = (
    [Shape(2, 17, 23, 2, 1, 32)]
    if INTERPRETING
    else [Shape(2, 17, 17, 4, 2, 64), Shape(1, 17, 40, 2, 1, 32), Shape(2, 40, 23, 2, 2, 64)]
)
_LENS_Q = [0, 1, 17, 5, 3, 0, 6, 2]  # empty sequences (q and k, q only, k only), length 1
_LENS_K = [3, 1, 17, 9, 0, 0, 2, 11]


def _jax_fn(case: Case, traced_cu: bool = False):
    """The JAX call of a case: (q, k, v[, cu_q, cu_k]) -> (out, lse)."""
    kw = case.kwargs()
    slopes = kw.pop("alibi_slopes")
    kw["alibi_slopes"] = None if slopes is None else to_jax(slopes)
    if kw.get("dropout_p"):
        kw["generator"] = jax.random.key(case.seed)
    if not case.varlen:
        return lambda q, k, v: AJ.attention(q, k, v, return_lse=True, **kw)
    lens = (case.max_seqlen_q, case.max_seqlen_k)
    if traced_cu:  # cu_seqlens as jit arguments (tracers): no value checks
        return lambda q, k, v, cq, ck: AJ.attention_varlen(q, k, v, cq, ck, *lens, return_lse=True, **kw)
    cq, ck = to_jax(case.cu_seqlens_q), to_jax(case.cu_seqlens_k)
    return lambda q, k, v: AJ.attention_varlen(q, k, v, cq, ck, *lens, return_lse=True, **kw)


def _run(case: Case, backend: str, *, backward: bool = True, dout: torch.Tensor | None = None):
    """(out, lse, grads or None, dout) as torch tensors: forward and jax.vjp under jax.jit;
    lse is an aux output (its cotangent a symbolic zero)."""
    fn = _jax_fn(case)
    leaves = [to_jax(t) for t in (case.q, case.k, case.v)]
    with okjax.use_backend(backend):
        if not backward:
            out, lse = jax.jit(fn)(*leaves)
            return to_torch(out), to_torch(lse), None, None

        @jax.jit
        def fwd_bwd(q, k, v, g):
            out, vjp, lse = jax.vjp(fn, q, k, v, has_aux=True)
            return out, lse, vjp(g)

        if dout is None:
            dout = random_tensor(tuple(case.q.shape), case.dtype)
        out, lse, grads = fwd_bwd(*leaves, to_jax(dout))
    return to_torch(out), to_torch(lse), [to_torch(g) for g in grads], dout


def _check(case: Case, backend: str, msg: str = "", *, backward: bool = True) -> None:
    out, lse, grads, dout = _run(case, backend, backward=backward)
    compare(case, out, lse, grads, dout, f"{msg} {case.id}".strip())


# ---- attention against the reference -----------------------------------------------------


@pytest.mark.parametrize("options", option_params(FEW_OPTIONS))
def test_every_option_bf16(backend: str, options: Options) -> None:
    # One shape per combination, the shapes taking turns (each call compiles once).
    shape = _SHAPES[FEW_OPTIONS.index(options) % len(_SHAPES)]
    _check(dense_case(shape, options, BF16, "cpu"), backend)


@pytest.mark.parametrize("dtype", [F16, F32], ids=_DTYPE_IDS.get)
@pytest.mark.parametrize("options", option_params([Options(), FEW_OPTIONS[-3]]))
def test_fp16_fp32(backend: str, options: Options, dtype: torch.dtype) -> None:
    # float32 runs the jax.numpy composition on every backend (no kernel takes it).
    _check(dense_case(_SHAPES[0], options, dtype, "cpu"), backend)


@pytest.mark.parametrize("seqlens", [(1, 1), (1, 17), (17, 1), (40, 17)], ids=lambda s: f"q{s[0]}-k{s[1]}")
def test_odd_sequence_lengths(backend: str, seqlens: tuple[int, int]) -> None:
    # seqlen_q > seqlen_k with causal or a window leaves rows without a visible key: out 0,
    # lse -inf, gradients 0 and never NaN (compare checks all three).
    sq, sk = seqlens
    for options in (Options(causal=True, window=(5, 2)), Options(window=(5, 2))):
        _check(dense_case(Shape(2, sq, sk, 2, 1, 64), options, BF16, "cpu"), backend)


@pytest.mark.parametrize("heads", [(4, 1), (4, 2)], ids=["mqa", "gqa"])
def test_gqa(backend: str, heads: tuple[int, int]) -> None:
    # Per-sequence, per-head slopes tell the heads of a group apart.
    shape = Shape(1, 17, 17, *heads, 32)
    _check(dense_case(shape, Options(causal=True, alibi="batch"), BF16, "cpu"), backend)


@pytest.mark.parametrize("head_dim", [64, 96] if INTERPRETING else [32, 64, 96, 128, 192, 256])
def test_head_dims(backend: str, head_dim: int) -> None:
    # 96 and 192 pad the kernels' tiles to powers of two (masked).
    options = Options(causal=True, softcap=SOFTCAP)
    _check(dense_case(Shape(1, 17, 17, 1, 1, head_dim), options, BF16, "cpu"), backend)


def test_large_scores(backend: str) -> None:
    for options in (Options(), Options(causal=True, softcap=30.0)):
        _check(dense_case(Shape(1, 40, 40, 2, 1, 64), options, BF16, "cpu", scale=4.0), backend)


# ---- gradients through jax.grad ----------------------------------------------------------


def test_jax_grad_of_a_loss(backend: str) -> None:
    # jax.grad under jax.jit of a loss on the output: the same gradients as jax.vjp with
    # dout = d loss / d out, checked against the reference.
    case = dense_case(_SHAPES[0], Options(causal=True, window=(6, -1), alibi="heads"), BF16, "cpu")
    fn = _jax_fn(case)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v)[0].astype(jnp.float32) ** 2)

    leaves = [to_jax(t) for t in (case.q, case.k, case.v)]
    with okjax.use_backend(backend):
        out, _ = jax.jit(fn)(*leaves)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*leaves)
    dout = 2 * to_torch(out).float()  # d loss / d out, exact in float32
    _, lse, _, _ = _run(case, backend, backward=False)
    compare(case, to_torch(out), lse, [to_torch(g) for g in grads], dout, "jax.grad")


def _lse_magnitudes(case: Case, dlse: torch.Tensor) -> tuple[float, float]:
    """Bounds on the terms of dq and dk when dout = 0: dS = P dlse (times the softcap's
    derivative, at most 1), dq_i = scale dlse_i sum_j P_ij k_j, dk_j = scale sum_i P_ij
    dlse_i q_i (cases.py's magnitudes for this dS)."""
    q, k = case.q.detach().double(), case.k.detach().double()
    P = probabilities(case, q, k)
    group = q.shape[2] // k.shape[2]
    ka = k.abs().repeat_interleave(group, dim=2)
    w = dlse.double().abs().transpose(1, 2)[..., None]  # (B, Sq, Hq, 1)
    m_dq = case.scale * w * torch.einsum("bqhk,bkhd->bqhd", P, ka)
    m_dk = case.scale * torch.einsum("bqhk,bqhd->bkhd", P, w * q.abs())
    m_dk = m_dk.unflatten(2, (k.shape[2], group)).sum(3)
    return float(m_dq.max()), float(m_dk.max())


@pytest.mark.parametrize("dtype", [BF16, F32], ids=_DTYPE_IDS.get)
def test_gradient_through_lse(backend: str, dtype: torch.dtype) -> None:
    # d lse_i / d s_ij = P_ij: the lse's cotangent enters the backward as delta - dlse. No row
    # is empty here (the reference's lse gradient is NaN there; ours 0).
    case = dense_case(Shape(2, 17, 23, 2, 1, 32), Options(causal=True, softcap=SOFTCAP), dtype, "cpu")
    dlse = random_tensor((2, 2, 17), F32)
    dout = torch.zeros(case.q.shape, dtype=dtype) if dtype == BF16 else random_tensor(case.q.shape, dtype)
    fn = _jax_fn(case)
    with okjax.use_backend(backend):
        _, vjp = jax.vjp(jax.jit(fn), *(to_jax(t) for t in (case.q, case.k, case.v)))
        grads = [to_torch(g) for g in vjp((to_jax(dout), to_jax(dlse)))]
    leaves = [t.detach().double().requires_grad_() for t in (case.q, case.k, case.v)]
    out, lse = case.reference(*leaves)
    expected = torch.autograd.grad((out * dout.double()).sum() + (lse * dlse.double()).sum(), leaves)
    if dtype == F32:  # everything but the roundings of float32 sums
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            assert_close(g, e, dtype=F32, terms=40, term_scale=float(e.abs().max()) + 1, msg=name)
        return
    # bfloat16 with dout = 0: the half-precision dS meeting K and Q is the only rounding.
    m_dq, m_dk = _lse_magnitudes(case, dlse)
    assert_attention_close(grads[0], expected[0], dtype=BF16, magnitude=m_dq, terms=23 + 32, msg="dq")
    assert_attention_close(grads[1], expected[1], dtype=BF16, magnitude=m_dk, terms=17 * 2 + 32, msg="dk")
    assert (grads[2] == 0).all(), "dv does not depend on lse"


def test_backward_runs_on_the_forwards_backend(backend: str) -> None:
    # The vjp is built inside the block and called outside it: the backward still runs on
    # the forward's backend (the default here is "jnp").
    case = dense_case(Shape(1, 17, 17, 2, 1, 32), Options(causal=True), BF16, "cpu")
    with okjax.use_backend(backend):
        (out, lse), vjp = jax.vjp(_jax_fn(case), *(to_jax(t) for t in (case.q, case.k, case.v)))
    dout = random_tensor(tuple(case.q.shape), BF16)
    grads = vjp((to_jax(dout), jnp.zeros(lse.shape, lse.dtype)))
    compare(case, to_torch(out), to_torch(lse), [to_torch(g) for g in grads], dout, "outside the block")


# ---- varlen ------------------------------------------------------------------------------


@pytest.mark.parametrize("options", option_params(FEW_OPTIONS[:: 3 if INTERPRETING else 2]))
def test_varlen(backend: str, options: Options) -> None:
    _check(varlen_case(_LENS_Q, _LENS_K, 4, 2, 64, options, BF16, "cpu"), backend)


def test_varlen_fp32_and_traced_cu_seqlens(backend: str) -> None:
    # cu_seqlens as jit arguments (tracers): values unchecked, the same results.
    for dtype in (BF16, F32):
        case = varlen_case(_LENS_Q, _LENS_K, 2, 1, 32, Options(causal=True, alibi="batch", softcap=SOFTCAP), dtype,
                           "cpu")  # fmt: skip
        args = [to_jax(t) for t in (case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k)]
        with okjax.use_backend(backend):
            out, lse = jax.jit(_jax_fn(case, traced_cu=True))(*args)
        compare(case, to_torch(out), to_torch(lse), None, None, f"traced cu_seqlens {_DTYPE_IDS[dtype]}")


def test_varlen_matches_dense_batches(backend: str) -> None:
    options = Options(causal=True, alibi="batch")
    dense = dense_case(Shape(3, 11, 13, 2, 1, 32), options, BF16, "cpu")
    cu_q = torch.arange(0, 34, 11, dtype=torch.int32)
    cu_k = torch.arange(0, 40, 13, dtype=torch.int32)
    packed = Case(dense.q.flatten(0, 1), dense.k.flatten(0, 1), dense.v.flatten(0, 1), options, dense.alibi_slopes,
                  cu_q, cu_k, 11, 13)  # fmt: skip
    out, lse, _, _ = _run(dense, backend, backward=False)
    out_p, lse_p, _, _ = _run(packed, backend, backward=False)
    vmax = float(dense.v.detach().abs().max())
    assert_attention_close(
        out_p, out.flatten(0, 1).double(), dtype=BF16, magnitude=vmax, terms=13 + 32, msg="out"
    )
    assert_close(lse_p, lse.transpose(0, 1).flatten(1, 2).double(), dtype=F32, terms=13 + 32, msg="lse")


# ---- special values ----------------------------------------------------------------------


def test_nan_stays_in_its_rows(backend: str) -> None:
    for what, options in (("q", Options(causal=True)), ("k", Options()), ("v", Options())):
        case, expected = nan_case(what, options, BF16, "cpu")
        out, lse, _, _ = _run(case, backend, backward=False)
        assert torch.equal(torch.isnan(out), expected), f"NaN in {what}: wrong rows are NaN"
        compare(case, out, lse, None, None, f"NaN in {what}")


def test_empty_inputs(backend: str) -> None:
    for shape in (Shape(0, 5, 5, 2, 1, 32), Shape(2, 0, 5, 2, 1, 32), Shape(2, 5, 0, 2, 1, 32)):
        case = dense_case(shape, Options(causal=True), BF16, "cpu")
        out, lse, grads, _ = _run(case, backend)
        assert out.shape == case.q.shape and lse.shape == (shape.batch, 2, shape.seqlen_q)
        assert (out == 0).all() and torch.isneginf(lse).all()
        for g, x in zip(grads, (case.q, case.k, case.v)):
            assert g.shape == x.shape and (g == 0).all()
    case = varlen_case([0, 0], [0, 0], 2, 1, 32, Options(), BF16, "cpu")
    out, lse, grads, _ = _run(case, backend)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0) and all(g.numel() == 0 for g in grads)


def test_float64_with_x64(backend: str) -> None:
    case = dense_case(
        Shape(1, 4, 5, 2, 1, 32), Options(causal=True, window=(3, -1), alibi="heads"), F64, "cpu"
    )
    with jax.enable_x64(True):
        out, lse, grads, dout = _run(case, backend)
    assert out.dtype == F64 and lse.dtype == F64
    compare(case, out, lse, grads, dout, "float64")


# ---- dropout -----------------------------------------------------------------------------


def _jax_seeded(case: Case) -> Case:
    """The case with the Philox key JAX draws from jax.random.key(case.seed), for the reference."""
    words = AJC.dropout_seed("attention", case.options.dropout, jax.random.key(case.seed))
    return dataclasses.replace(case, seed_words=to_torch(words))


@pytest.mark.parametrize(
    "options",
    option_params([Options(causal=True, dropout=0.3), Options(window=(5, 3), alibi="batch", softcap=SOFTCAP,
                                                               dropout=0.5)]),
)  # fmt: skip
def test_dropout_matches_reference(backend: str, options: Options) -> None:
    for shape in _SHAPES:
        _check(_jax_seeded(dense_case(shape, options, BF16, "cpu")), backend)
    _check(_jax_seeded(varlen_case([5, 0, 1, 9], [7, 3, 1, 11], 2, 1, 32, options, BF16, "cpu")), backend)


def test_dropout_errors_and_the_pytorch_bits(backend: str) -> None:
    q = jnp.zeros((1, 4, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs generator"):
        AJ.attention(q, q, q, dropout_p=0.1)
    with pytest.raises(TypeError, match=r"generator must be a jax\.random key"):
        AJ.attention(q, q, q, dropout_p=0.1, generator="seed")
    with pytest.raises(ValueError, match="dropout_p must be a float in"):
        AJ.attention(q, q, q, dropout_p=1.0, generator=jax.random.key(0))
    if backend != "interpret":
        return
    # The same Philox key: the JAX launches give the PyTorch kernels' bits.
    case = _jax_seeded(dense_case(Shape(1, 19, 21, 2, 1, 32), Options(causal=True, dropout=0.3), BF16, "cpu"))
    dout = random_tensor(tuple(case.q.shape), case.dtype)
    out, lse, grads, _ = _run(case, backend, dout=dout)
    with dispatch.force("triton"):
        out_t, lse_t = torch.ops.openkernels.attention(case.q, case.k, case.v, *case.library_args())
        grads_t = torch.autograd.grad(out_t, (case.q, case.k, case.v), dout)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_t):
        assert torch.equal(a, b), f"{name} differs from PyTorch"


# ---- the same kernels as PyTorch ---------------------------------------------------------


def test_interpreter_gives_the_pytorch_kernels_bits(backend: str) -> None:
    if backend != "interpret":
        pytest.skip("the kernel backends only")
    cases = [
        dense_case(
            Shape(2, 17, 23, 4, 2, 32), Options(causal=True, alibi="batch", softcap=SOFTCAP), BF16, "cpu"
        ),
        varlen_case([5, 0, 7], [3, 2, 9], 2, 1, 64, Options(window=(4, 2)), F16, "cpu"),
    ]
    for case in cases:
        dout = random_tensor(tuple(case.q.shape), case.dtype)
        out, lse, grads, _ = _run(case, backend, dout=dout)
        with dispatch.force("triton"):
            out_t, lse_t = case.call()
            grads_t = torch.autograd.grad(out_t, (case.q, case.k, case.v), dout)
        assert torch.equal(out, out_t) and torch.equal(lse, lse_t), f"{case.id}: forward differs from PyTorch"
        for name, a, b in zip(("dq", "dk", "dv"), grads, grads_t):
            assert torch.equal(a, b), f"{case.id}: {name} differs from PyTorch"


# ---- rotary ------------------------------------------------------------------------------

# (batch, seqlen, heads_q, heads_k, head_dim, rot_dim, table lead dims)
_ROTARY_SHAPES = [
    (2, 1, 3, 1, 64, 64, (2,)),  # decode, MQA
    (2, 7, 3, 1, 96, 96, ()),  # (S, R) tables
    (1, 33, 4, 2, 128, 64, (1,)),  # partial rotary, (1, S, R) tables
    (1, 5, 2, 1, 80, 32, (1,)),  # Phi-2
]


def _rotary_check(got, want, dtype, magnitude: float, msg: str) -> None:
    # test_rotary's bound: one rounding to the dtype plus float32 products and a sum.
    assert_close(got, want.double(), dtype=dtype, terms=2, term_scale=magnitude, msg=msg)


def _largest(*ts: torch.Tensor) -> float:
    return max(float(t.double().nan_to_num(0.0, 0.0, 0.0).abs().max()) if t.numel() else 0.0 for t in ts)


@pytest.mark.parametrize("shape", _ROTARY_SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=_DTYPE_IDS.get)
def test_rotary_matches_reference(backend: str, shape: tuple, dtype: torch.dtype) -> None:
    b, s, hq, hk, d, r, lead = shape
    q, k, gq = (
        random_tensor((b, s, hq, d), dtype),
        random_tensor((b, s, hk, d), dtype),
        random_tensor((b, s, hq, d), dtype),
    )
    gk = random_tensor((b, s, hk, d), dtype)
    cos, sin = random_tensor((*lead, s, r), dtype), random_tensor((*lead, s, r), dtype)
    with okjax.use_backend(backend):

        @jax.jit
        def fwd_bwd(q, k, gq, gk):
            out, vjp = jax.vjp(lambda a, c: AJ.apply_rotary(a, c, to_jax(cos), to_jax(sin)), q, k)
            return out, vjp((gq, gk))

        out, grads = fwd_bwd(*(to_jax(t) for t in (q, k, gq, gk)))
    leaves = [t.double().requires_grad_() for t in (q, k)]
    ref = RR.apply_rotary_ref(*leaves, cos.double(), sin.double())
    ref_grads = torch.autograd.grad(ref, leaves, (gq.double(), gk.double()))
    magnitude = max(_largest(q, k), 1.0) * _largest(cos, sin) * 2
    for name, got, want in zip(("q_out", "k_out"), out, ref):
        assert to_torch(got).dtype == dtype
        _rotary_check(to_torch(got), want, dtype, magnitude, name)
    grad_magnitude = max(_largest(gq, gk), 1.0) * _largest(cos, sin) * 2
    for name, got, want in zip(("dq", "dk"), grads, ref_grads):
        _rotary_check(to_torch(got), want, dtype, grad_magnitude, name)


@pytest.mark.parametrize(("dtype", "table"), [(BF16, F32), (F16, BF16), (F32, BF16)], ids=str)
def test_rotary_table_dtypes_and_jax_grad(backend: str, dtype: torch.dtype, table: torch.dtype) -> None:
    q, k = random_tensor((2, 7, 3, 64), dtype), random_tensor((2, 7, 1, 64), dtype)
    cos, sin = random_tensor((2, 7, 64), table), random_tensor((2, 7, 64), table)
    args = [to_jax(t) for t in (q, k, cos, sin)]
    with okjax.use_backend(backend):
        out = jax.jit(AJ.apply_rotary)(*args)

        def loss(q, k):
            a, b = AJ.apply_rotary(q, k, args[2], args[3])
            return jnp.sum(a.astype(jnp.float32)) + 2 * jnp.sum(b.astype(jnp.float32))

        dq, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(args[0], args[1])
    ref = RR.apply_rotary_ref(q.double(), k.double(), cos.double(), sin.double())
    magnitude = max(_largest(q, k), 1.0) * _largest(cos, sin) * 2
    for name, got, want in zip(("q_out", "k_out"), out, ref):
        _rotary_check(to_torch(got), want, dtype, magnitude, name)
    leaves = [t.double().requires_grad_() for t in (q, k)]
    ref_q, ref_k = RR.apply_rotary_ref(*leaves, cos.double(), sin.double())
    expected = torch.autograd.grad(ref_q.sum() + 2 * ref_k.sum(), leaves)
    for name, got, want in zip(("dq", "dk"), (dq, dk), expected):
        _rotary_check(to_torch(got), want, dtype, 2 * _largest(cos, sin) * 2, name)


def test_rotary_empty_and_wide_heads(backend: str) -> None:
    cos, sin = jnp.ones((3, 8)), jnp.zeros((3, 8))
    with okjax.use_backend(backend):
        q_out, k_out = AJ.apply_rotary(jnp.ones((0, 3, 2, 64), jnp.bfloat16), jnp.ones((0, 3, 1, 64), jnp.bfloat16),
                                       cos, sin)  # fmt: skip
        assert q_out.shape == (0, 3, 2, 64) and k_out.shape == (0, 3, 1, 64)
        # head_dim above the kernel's widest tile: the jax.numpy composition
        q = random_tensor((1, 3, 1, 520), BF16)
        wide = AJ.apply_rotary(to_jax(q), to_jax(q), cos, sin)
    ref = RR.apply_rotary_ref(
        q.double(), q.double(), torch.ones(3, 8, dtype=F64), torch.zeros(3, 8, dtype=F64)
    )
    _rotary_check(to_torch(wide[0]), ref[0], BF16, _largest(q), "wide head")


def test_tables_and_slopes_get_no_gradient(backend: str) -> None:
    q, k = jnp.ones((1, 3, 2, 64), jnp.bfloat16), jnp.ones((1, 3, 1, 64), jnp.bfloat16)
    cos, sin = jnp.ones((3, 64)), jnp.zeros((3, 64))
    with okjax.use_backend(backend):
        with pytest.raises(ValueError, match="cos and sin get no gradient"):
            jax.grad(lambda c: jnp.sum(AJ.apply_rotary(q, k, c, sin)[0].astype(jnp.float32)))(cos)
        with pytest.raises(ValueError, match="alibi_slopes gets no gradient"):
            jax.grad(lambda s: jnp.sum(AJ.attention(q, k, k, alibi_slopes=s).astype(jnp.float32)))(
                jnp.ones(2)
            )
        # Constant tables and slopes (or stop_gradient'ed ones) are fine.
        jax.grad(
            lambda c: jnp.sum(AJ.apply_rotary(q, k, jax.lax.stop_gradient(c), sin)[0].astype(jnp.float32))
        )(cos)


# ---- bad inputs --------------------------------------------------------------------------


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel was launched for a bad call")


def test_bad_attention_inputs(backend: str, monkeypatch) -> None:
    monkeypatch.setattr(okjax, "launch", _no_kernel)
    x = jnp.ones((1, 4, 2, 32), jnp.bfloat16)
    kv = jnp.ones((1, 4, 1, 32), jnp.bfloat16)
    kv2 = jnp.ones((2, 4, 1, 32), jnp.bfloat16)
    ok = (x, kv, kv)
    bad = [
        (TypeError, r"q must be a jax\.Array", (torch.ones(1, 4, 2, 32), kv, kv), {}),
        (TypeError, "dtype int32 is not supported", tuple(a.astype(jnp.int32) for a in ok), {}),
        (TypeError, "must share a dtype", (x, kv.astype(jnp.float16), kv), {}),
        (ValueError, "must be 4D", (x[0], kv, kv), {}),
        (ValueError, "k and v must have the same shape", (x, kv, kv[:, :3]), {}),
        (ValueError, "head_dim 48 is not supported", (jnp.ones((1, 4, 2, 48), jnp.bfloat16),) * 3, {}),
        (ValueError, "must be a multiple of heads_kv", (jnp.ones((1, 4, 3, 32), jnp.bfloat16), x, x), {}),
        (ValueError, "q has batch 1 but k has batch 2", (x, kv2, kv2), {}),
        (TypeError, "causal must be a bool", ok, {"causal": 1}),
        (ValueError, "softmax_scale must be", ok, {"softmax_scale": -1.0}),
        (ValueError, "window must be a pair", ok, {"window": (1,)}),
        (ValueError, "softcap must be", ok, {"softcap": float("inf")}),
        (TypeError, "alibi_slopes must be float32", ok, {"alibi_slopes": jnp.ones(2, jnp.bfloat16)}),
        (ValueError, r"alibi_slopes must have shape \(2,\)", ok, {"alibi_slopes": jnp.ones(3)}),
        (TypeError, "alibi_slopes must be a jax.Array", ok, {"alibi_slopes": torch.ones(2)}),
    ]
    with okjax.use_backend(backend):
        for error, match, args, kwargs in bad:
            with pytest.raises(error, match=match):
                AJ.attention(*args, **kwargs)


def test_bad_varlen_inputs(backend: str, monkeypatch) -> None:
    monkeypatch.setattr(okjax, "launch", _no_kernel)
    q, kv = jnp.ones((7, 2, 32), jnp.bfloat16), jnp.ones((9, 1, 32), jnp.bfloat16)
    cq, ck = jnp.array([0, 3, 7], jnp.int32), jnp.array([0, 4, 9], jnp.int32)
    bad = [
        (TypeError, "cu_seqlens_q must be int32", (cq.astype(jnp.uint8), ck, 4, 5)),
        (TypeError, "cu_seqlens_k must be a jax.Array", (cq, torch.tensor([0, 4, 9]), 4, 5)),
        (ValueError, r"must be 1D \(n_seqs \+ 1,\)", (cq[None], ck, 4, 5)),
        (
            ValueError,
            "must start at 0 and end at the token count 7",
            (jnp.array([0, 3, 6], jnp.int32), ck, 4, 5),
        ),
        (
            ValueError,
            "must be non-decreasing",
            (cq, jnp.array([0, 10, 9], jnp.int32), 4, 10),
        ),
        (ValueError, "below the longest sequence", (cq, ck, 3, 5)),
        (ValueError, "must be a Python int", (cq, ck, jnp.int32(4), 5)),
        (ValueError, "same number of sequences", (cq, jnp.array([0, 9], jnp.int32), 4, 9)),
    ]
    with okjax.use_backend(backend):
        for error, match, (cu_q, cu_k, max_q, max_k) in bad:
            with pytest.raises(error, match=match):
                AJ.attention_varlen(q, kv, kv, cu_q, cu_k, max_q, max_k)
        with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(2, 2\)"):
            AJ.attention_varlen(q, kv, kv, cq, ck, 4, 5, alibi_slopes=jnp.ones((3, 2)))
        with pytest.raises(ValueError, match="must be 3D"):
            AJ.attention_varlen(q[None], kv, kv, cq, ck, 4, 5)


def test_bad_rotary_inputs(backend: str, monkeypatch) -> None:
    monkeypatch.setattr(okjax, "launch", _no_kernel)
    q, k = jnp.ones((2, 5, 2, 64), jnp.bfloat16), jnp.ones((2, 5, 1, 64), jnp.bfloat16)
    t = jnp.ones((5, 64))
    bad = [
        (TypeError, r"q must be a jax\.Array", (torch.ones(2, 5, 2, 64), k, t, t)),
        (ValueError, "k must be 4D", (q, k[0], t, t)),
        (TypeError, "cos has dtype int32", (q, k, t.astype(jnp.int32), t)),
        (TypeError, "q and k must share a dtype", (q, k.astype(jnp.float16), t, t)),
        (ValueError, "must share batch, seqlen and head_dim", (q, k[:, :4], t, t)),
        (ValueError, "cos and sin must have one shape", (q, k, t, t[:, :32])),
        (ValueError, r"cos and sin must be \(2 or 1, 5, rotary_dim\)", (q, k, t[:4], t[:4])),
        (ValueError, "must be even and in 2..head_dim", (q, k, t[:, :7], t[:, :7])),
    ]
    with okjax.use_backend(backend):
        for error, match, args in bad:
            with pytest.raises(error, match=match):
                AJ.apply_rotary(*args)


def test_cu_seqlens_helper_matches_the_pytorch_api(backend: str) -> None:
    # The same packed call through both front ends raises the same error for a bad max_seqlen.
    lens = [3, 4]
    q = random_tensor((7, 2, 32), BF16)
    cu = cu_seqlens(lens, "cpu")
    with pytest.raises(ValueError, match="below the longest sequence") as torch_err:
        A.attention_varlen(q, q[:, :1], q[:, :1], cu, cu, 3, 4)
    with okjax.use_backend(backend), pytest.raises(ValueError, match="below the longest sequence") as jax_err:
        AJ.attention_varlen(to_jax(q), to_jax(q[:, :1]), to_jax(q[:, :1]), to_jax(cu), to_jax(cu), 3, 4)
    assert str(torch_err.value) == str(jax_err.value)


# ---- attention_with_kvcache --------------------------------------------------------------

_KV_SCENARIOS = [
    Scenario("decode", (5, 0, 17)),  # an empty sequence
    Scenario("paged-gqa-rotary-alibi", (5, 0, 40), seqlen_q=3, page=16, heads=(4, 2), rotary="halves",
             alibi="batch"),
    Scenario("prefill-interleaved-window-softcap", (3, 9), seqlen_q=7, rotary="interleaved", rotary_dim=32,
             window=(4, -1), softcap=SOFTCAP, fmt="fp16"),
    Scenario("no-append", (3, 9), seqlen_q=2, append=False, causal=False, softmax_scale=0.3),
    Scenario("fp32-paged-padded-table", (3, 20), seqlen_q=2, fmt="fp32", page=16, pad_table=True),
]  # fmt: skip


def _kv_run(call: KVCall, backend: str, *, jit: bool = True):
    """(out, lse, the call with the returned caches) as torch tensors."""
    kw = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v) for k, v in call.kwargs().items()}

    def fn(q, k_cache, v_cache, seqlens):
        return AJ.attention_with_kvcache(q, k_cache, v_cache, seqlens, return_lse=True, **kw)

    args = [to_jax(t) for t in (call.q, call.k_cache, call.v_cache, call.cache_seqlens)]
    with okjax.use_backend(backend):
        out, lse, k_cache, v_cache = (jax.jit(fn) if jit else fn)(*args)
    return (
        to_torch(out),
        to_torch(lse),
        dataclasses.replace(call, k_cache=to_torch(k_cache), v_cache=to_torch(v_cache)),
    )


@pytest.mark.parametrize("scenario", _KV_SCENARIOS, ids=lambda s: s.name)
def test_kvcache_matches_reference(backend: str, scenario: Scenario) -> None:
    # The poisoned cache (NaN wherever no token is) must stay out of the output; the append
    # writes the new tokens (rotated) and nothing else. XLA may fuse the rotation's
    # multiply-adds: one float32 ulp (fma=True).
    call = build(scenario, "cpu")
    before = snapshot(call)
    for jit in (True, False):  # eager: the lengths are known and checked
        out, lse, after = _kv_run(call, backend, jit=jit)
        check_append(after, before, fma=True, msg=f"jit={jit}")
        kv_compare(after, out, lse, device="cpu", msg=f"jit={jit}")
    assert torch.equal(kv_bits(call.k_cache), kv_bits(before[0])), "the input cache was changed"


def test_kvcache_split_keys(backend: str, monkeypatch) -> None:
    # Forced splits: float32 partials merged by the combine kernel (some splits empty).
    from openkernels.attention.kvcache import triton as launcher

    monkeypatch.setattr(launcher, "FORCE_SPLITS", 3)
    call = build(Scenario("split", (50, 0, 70), seqlen_q=2, heads=(4, 1), alibi="heads"), "cpu")
    out, lse, after = _kv_run(call, backend)
    kv_compare(after, out, lse, device="cpu", msg="3 splits")


def test_kvcache_gives_the_pytorch_kernels_bits(backend: str, monkeypatch) -> None:
    if backend != "interpret":
        pytest.skip("the kernel backends only")
    from openkernels.attention.kvcache import triton as launcher

    for splits in (None, 3):
        monkeypatch.setattr(launcher, "FORCE_SPLITS", splits)
        # No k_new: the append differs in implementation (a scatter here), the attention not.
        # A contiguous cache as long as the longest sequence: JAX plans the splits for the
        # capacity, PyTorch for the longest sequence (72 keys: 3 blocks of 32 to split).
        scenario = Scenario("bits", (40, 72), seqlen_q=3, append=False, heads=(4, 2), rotary="halves",
                            window=(50, -1), softcap=SOFTCAP)  # fmt: skip
        call = build(scenario, "cpu")
        out, lse, _ = _kv_run(call, backend)
        with dispatch.force("triton"):
            out_t, lse_t = call.call()
        assert torch.equal(out, out_t) and torch.equal(lse, lse_t), f"splits {splits}: differs from PyTorch"


@pytest.mark.parametrize("rows_indexed", [False, True], ids=["contiguous", "cache_batch_idx"])
def test_kvcache_leftpad_and_batch_idx_match_pytorch(backend: str, rows_indexed: bool) -> None:
    """cache_leftpad (and cache_batch_idx picking rows of a larger cache): the same output,
    lse and written caches as PyTorch's reference on the same inputs; NaN in the padding and
    in the rows no sequence uses stays out."""
    torch.manual_seed(0)
    batch, rows, cap, hq, hkv, d, sq = 3, 5, 24, 4, 2, 64, 2
    k_cache = torch.randn(rows if rows_indexed else batch, cap, hkv, d, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    pads = torch.tensor([0, 2, 5], dtype=torch.int32)
    seqlens = torch.tensor([6, 9, 12], dtype=torch.int32)  # counting the padding
    idx = torch.tensor([4, 0, 2], dtype=torch.int32) if rows_indexed else None
    for b in range(batch):
        row = b if idx is None else int(idx[b])
        k_cache[row, : pads[b]] = float("nan")
        v_cache[row, : pads[b]] = float("nan")
    if rows_indexed:
        k_cache[[1, 3]] = float("nan")
        v_cache[[1, 3]] = float("nan")
    q = torch.randn(batch, sq, hq, d, dtype=BF16)
    k_new, v_new = torch.randn(batch, sq, hkv, d, dtype=BF16), torch.randn(batch, sq, hkv, d, dtype=BF16)
    cos, sin = torch.randn(64, 16), torch.randn(64, 16)
    kw = dict(k_new=k_new, v_new=v_new, cache_leftpad=pads, cache_batch_idx=idx, rotary_cos=cos, rotary_sin=sin,
              return_lse=True)  # fmt: skip
    kt, vt = k_cache.clone(), v_cache.clone()
    with dispatch.force("reference"):
        want_out, want_lse = A.attention_with_kvcache(q, kt, vt, seqlens, **kw)
    jkw = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}

    def fn(q, k_cache, v_cache, seqlens):
        return AJ.attention_with_kvcache(q, k_cache, v_cache, seqlens, **jkw)

    args = [to_jax(t) for t in (q, k_cache, v_cache, seqlens)]
    with okjax.use_backend(backend):
        for jit in (False, True):
            out, lse, kj, vj = (jax.jit(fn) if jit else fn)(*args)
            torch.testing.assert_close(to_torch(out).float(), want_out.float(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(to_torch(lse), want_lse, atol=2e-3, rtol=2e-3)
            for got, want in ((to_torch(kj), kt), (to_torch(vj), vt)):  # NaN where NaN was: equal_nan
                torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2, equal_nan=True)
            assert not torch.isnan(to_torch(out)).any(), f"jit={jit}: NaN reached the output"


def test_kvcache_leftpad_and_batch_idx_errors(backend: str, monkeypatch) -> None:
    monkeypatch.setattr(okjax, "launch", _no_kernel)
    q = jnp.ones((2, 1, 2, 64), jnp.bfloat16)
    cache = jnp.ones((3, 16, 1, 64), jnp.bfloat16)
    lens = jnp.array([3, 7], jnp.int32)
    bad = [
        (TypeError, r"cache_leftpad must be an int32 jax.Array of shape \(2,\)", {"cache_leftpad": jnp.zeros((3,), jnp.int32)}),
        (ValueError, r"cache_leftpad\[1\] = 8 must lie in 0..cache_seqlens\[1\] = 7",
         {"cache_leftpad": jnp.array([0, 8], jnp.int32), "cache_batch_idx": jnp.array([0, 1], jnp.int32)}),
        (ValueError, r"cache_batch_idx\[0\] = 3 is not a row of the cache \(0..2\)",
         {"cache_batch_idx": jnp.array([3, 1], jnp.int32)}),
        (ValueError, "the cache has batch 3 but q has 2", {}),
        (ValueError, r"cache_batch_idx\[1\] = 0 names a row another sequence also appends to",
         {"cache_batch_idx": jnp.array([0, 0], jnp.int32), "k_new": q[:, :, :1], "v_new": q[:, :, :1]}),
        (ValueError, "applies to contiguous caches", {"cache_leftpad": jnp.zeros((2,), jnp.int32),
                                                      "block_table": jnp.zeros((2, 1), jnp.int32)}),
    ]  # fmt: skip
    with okjax.use_backend(backend):
        for error, match, kwargs in bad:
            with pytest.raises(error, match=match):
                AJ.attention_with_kvcache(q, cache, cache, lens, **kwargs)


def test_bad_kvcache_inputs(backend: str, monkeypatch) -> None:
    monkeypatch.setattr(okjax, "launch", _no_kernel)
    q = jnp.ones((2, 1, 2, 64), jnp.bfloat16)
    cache = jnp.ones((2, 8, 1, 64), jnp.bfloat16)
    lens = jnp.array([3, 7], jnp.int32)
    new = jnp.ones((2, 1, 1, 64), jnp.bfloat16)
    paged = jnp.ones((2, 16, 1, 64), jnp.bfloat16)
    from openkernels.attention.kvcache.format import quantize_kv

    quantized = quantize_kv(torch.ones(2, 8, 1, 64), 8)
    bad = [
        (TypeError, "quantized caches are not supported", (q, quantized, quantized, lens), {}),
        (TypeError, "k_cache must have q's dtype", (q, cache.astype(jnp.float16), cache, lens), {}),
        (ValueError, "head_dim 48 is not supported", (jnp.ones((2, 1, 2, 48), jnp.bfloat16), cache, cache, lens), {}),
        (TypeError, "cache_seqlens must be an int32", (q, cache, cache, lens.astype(jnp.uint32)), {}),
        (ValueError, "k_new and v_new must be given together", (q, cache, cache, lens), {"k_new": new}),
        (ValueError, "outside the cache's capacity of 8 tokens", (q, cache, cache, lens + 1), {"k_new": new, "v_new": new}),
        (ValueError, "block_table must have 2 rows", (q, cache, cache, lens), {"block_table": jnp.zeros((1, 1), jnp.int32)}),
        (ValueError, "page size", (q, cache, cache, lens), {"block_table": jnp.zeros((2, 1), jnp.int32)}),
        (ValueError, r"block_table\[1, 0\] = 5 is not a page", (q, paged, paged, lens),
         {"block_table": jnp.array([[0], [5]], jnp.int32)}),
        (ValueError, r"block_table\[0, 0\] = 0 receives new tokens but is also block_table\[1, 0\]",
         (q, paged, paged, lens), {"block_table": jnp.array([[0], [0]], jnp.int32), "k_new": new, "v_new": new}),
        (TypeError, "check must be a bool", (q, cache, cache, lens), {"check": 1}),
        (TypeError, "rotary_interleaved must be a bool", (q, cache, cache, lens), {"rotary_interleaved": 1}),
        (ValueError, "rotary_cos and rotary_sin must be given together", (q, cache, cache, lens),
         {"rotary_cos": jnp.ones((8, 32))}),
    ]  # fmt: skip
    with okjax.use_backend(backend):
        for error, match, args, kwargs in bad:
            with pytest.raises(error, match=match):
                AJ.attention_with_kvcache(*args, **kwargs)


# ---- API surface and benchmark cases -----------------------------------------------------


def test_pytorch_api_names_match(backend: str) -> None:
    # Same names, positional order and defaults as the PyTorch functions.
    import inspect

    for name in ("attention", "attention_varlen", "apply_rotary", "attention_with_kvcache"):
        ours, theirs = inspect.signature(getattr(AJ, name)), inspect.signature(getattr(A, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ], name


def test_benchmark_cases_run(backend: str) -> None:
    from openkernels.attention.core.bench import jax_cases
    from openkernels.attention.rotary.bench import jax_cases as rotary_jax_cases

    cases = jax_cases(shapes=((1, 2, 16, 32),), dtype=F32) + rotary_jax_cases(
        shapes=((1, 5, 2, 1, 64, 32),), dtype=F32
    )
    assert {(c.op, c.direction) for c in cases} == {
        (op, d) for op in ("causal", "full") for d in ("fwd", "fwd+bwd")
    } | {("apply_rotary", d) for d in ("fwd", "bwd")}
    assert len(cases) == 6 and all(c.flops for c in cases[:4])
    for case in cases:
        s = case.make_inputs(torch.device("cpu"))
        with okjax.use_backend(backend):
            got = jax.tree_util.tree_leaves(jax.jit(case.jax_fn)({k: to_jax(v) for k, v in s.items()}))
        want = case.torch_fn(s)
        want = [want] if isinstance(want, torch.Tensor) else list(want)
        assert len(got) == len(want), case.label
        for g, w in zip(got, want):
            # Two float32 implementations of 16-key softmax sums and 32-element dot products.
            w = w.detach().double()
            assert_close(to_torch(g), w, dtype=F32, terms=48, term_scale=float(w.abs().max()), msg=case.label)
