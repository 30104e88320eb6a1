"""Learnable attention sinks (gpt-oss; FA4's learnable_sink): one logit per query head that
every row's softmax also normalizes over, with a zero value. The op folds them around the
kernels (core/ops.py), so every implementation runs them; each is checked here against the
float64 reference (core/reference.py, which appends the sink as one more key) forward and
backward, sinks' gradient included, and the JAX face against the same reference."""

from __future__ import annotations

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.core import reference as R
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import random_tensor, targets

# Worst |ours - float64 reference| over max(1, |reference|): the inputs' rounding and
# half-precision P (and dS) in the kernels' matmuls, over at most ~40 keys.
_TOL = {torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}

# (name, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, varlen)
_SHAPES = [
    ("gqa-causal", 2, 17, 23, 4, 2, 32, True, (-1, -1), False),
    ("full-odd-len", 1, 9, 9, 2, 2, 64, False, (-1, -1), False),
    # seqlen_q > seqlen_k, causal, bottom-right: the first rows see no key but their sink
    ("empty-rows", 1, 12, 5, 2, 1, 32, True, (-1, -1), False),
    ("window-varlen", 3, 11, 14, 4, 4, 32, False, (3, 2), True),
]


def _inputs(shape, dtype, noncontiguous: bool):
    _, b, sq, sk, hq, hkv, d, _, _, _ = shape
    if noncontiguous:  # (B, H, S, D) storage seen as (B, S, H, D)
        q = random_tensor((b, hq, sq, d), dtype).transpose(1, 2)
        k, v = (random_tensor((b, hkv, sk, d), dtype).transpose(1, 2) for _ in range(2))
    else:
        q, k, v = (
            random_tensor((b, sq, hq, d), dtype),
            random_tensor((b, sk, hkv, d), dtype),
            random_tensor((b, sk, hkv, d), dtype),
        )
    sinks = torch.rand(hq, dtype=torch.float32) * 2 + 1.5  # near each row's logsumexp: a sizeable share
    return q, k, v, sinks


def _call(fn, q, k, v, sinks, shape, **extra):
    """fn: A.attention (or R.attention_ref) on dense inputs, or its varlen form on the
    batch packed into one sequence each."""
    _, b, sq, sk, *_rest, causal, window, varlen = shape
    options = dict(causal=causal, window=window, sinks=sinks, return_lse=True, **extra)
    if not varlen:
        return fn(q, k, v, **options)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    packed = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    varlen_fn = A.attention_varlen if fn is A.attention else R.attention_varlen_ref
    return varlen_fn(*packed, cu_q, cu_k, sq, sk, **options)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: not finite"
    scale = max(1.0, float(want.abs().max()))
    err = float((got.double() - want).abs().max()) / scale
    assert err <= _TOL[dtype], f"{what}: error {err:.3g} of scale {scale:.3g} above {_TOL[dtype]}"


@pytest.mark.parametrize(("device", "impl"), targets("attention", skip=("cudnn",)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", _SHAPES, ids=[s[0] for s in _SHAPES])
@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["", "dropout"])
def test_sinks_match_the_reference(device: str, impl: str, dtype: torch.dtype, shape, dropout: float) -> None:
    if impl == "triton" and dtype == torch.float32:
        pytest.skip("the Triton kernels take float16 and bfloat16")
    if dropout and dtype == torch.float16:
        pytest.skip("dropout: float32 and bfloat16 cover it")
    q, k, v, sinks = (t.to(device) for t in _inputs(shape, dtype, noncontiguous=shape[0] == "gqa-causal"))
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    # Dropout: the call draws its seed from a generator in this state, the reference takes it.
    generator = torch.Generator(device=device)
    kw, ref_kw = {}, {}
    if dropout:
        seed = torch.randint(
            -(2**31), 2**31, (2,), dtype=torch.int32, device=device, generator=generator.manual_seed(5)
        )
        kw = dict(dropout_p=dropout, generator=generator.manual_seed(5))
        ref_kw = dict(dropout_p=dropout, dropout_seed=seed)
    with dispatch.force(f"attention:{impl}", f"attention_backward:{impl}"):
        out, lse = _call(A.attention, *leaves, shape, **kw)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = _call(R.attention_ref, *ref_leaves, shape, **ref_kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    _close(out, ref, dtype, "out")
    _close(lse, ref_lse, torch.float32, "lse")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        _close(g, r, dtype, name)
    # The sinks matter: without them the output is another one.
    if dropout:
        kw["generator"] = generator.manual_seed(5)  # the same mask, without the sinks
    plain = _call(A.attention, q, k, v, None, shape, **kw)[0]
    assert float((plain.double() - ref).abs().max()) > 0.05 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("varlen", [False, True])
def test_sinks_keep_float64_exact(varlen: bool) -> None:
    """float64 q / k / v stay float64 through the sinks' fold (it took float32 products:
    5e-8 off the reference and a failing gradcheck) on the CPU path."""
    gen = torch.Generator().manual_seed(9)
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float32)
    if varlen:
        q, k, v = (torch.randn(7, 2, 16, dtype=torch.float64, generator=gen) for _ in range(3))
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)

        def call(q, k, v):
            return A.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True, sinks=sinks)

        want = R.attention_varlen_ref(q, k, v, cu, cu, causal=True, sinks=sinks)
    else:
        q, k, v = (torch.randn(1, 5, 2, 16, dtype=torch.float64, generator=gen) for _ in range(3))

        def call(q, k, v):
            return A.attention(q, k, v, causal=True, sinks=sinks)

        want = R.attention_ref(q, k, v, causal=True, sinks=sinks)
    torch.testing.assert_close(call(q, k, v), want, rtol=1e-12, atol=1e-12)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(call, inputs)


def test_sinks_bad_input_is_a_clear_error() -> None:
    q, k, v = (
        random_tensor((1, 4, 2, 32), torch.bfloat16),
        *(random_tensor((1, 4, 2, 32), torch.bfloat16),) * 2,
    )
    for sinks, error, match in (
        (torch.zeros(3), ValueError, r"sinks must have shape \(2,\)"),
        (torch.zeros(2, dtype=torch.bfloat16), TypeError, "sinks must be float32"),
        ([0.0, 0.0], TypeError, "sinks must be a torch.Tensor or None"),
    ):
        with pytest.raises(error, match=match):
            A.attention(q, k, v, sinks=sinks)


@pytest.mark.parametrize("shape", _SHAPES, ids=[s[0] for s in _SHAPES])
def test_jax_sinks_match_the_reference(shape) -> None:
    jax = pytest.importorskip("jax")
    import openkernels.attention.jax as AJ
    from openkernels.shared.dev.testing.jax import to_jax, to_torch

    q, k, v, sinks = _inputs(shape, torch.float32, noncontiguous=False)
    _, b, sq, sk, *_rest, causal, window, varlen = shape
    dout = torch.randn(q.shape, dtype=torch.float32)
    if varlen:
        cu_q = to_jax(torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32))
        cu_k = to_jax(torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32))

        def f(q, k, v, s):
            return AJ.attention_varlen(q, k, v, cu_q, cu_k, sq, sk, causal=causal, window=window, sinks=s)

        args = [to_jax(t.reshape(-1, *t.shape[2:])) for t in (q, k, v)]
        cot = to_jax(dout.reshape(-1, *dout.shape[2:]))
    else:

        def f(q, k, v, s):
            return AJ.attention(q, k, v, causal=causal, window=window, sinks=s)

        args, cot = [to_jax(t) for t in (q, k, v)], to_jax(dout)
    out, vjp = jax.vjp(f, *args, to_jax(sinks))
    grads = vjp(cot)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    ref = _call(R.attention_ref, *ref_leaves, shape)[0]
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double().reshape(ref.shape))
    _close(to_torch(out).reshape(ref.shape), ref, torch.float32, "jax out")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        _close(to_torch(g).reshape(r.shape), r, torch.float32, f"jax {name}")
