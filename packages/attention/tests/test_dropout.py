"""Attention dropout: every implementation against the float64 reference drawing the same
mask from the same seed (forward and backward, options, GQA, varlen, padded head_dim,
non-contiguous views (sinks with dropout: test_sinks.py), fp16/fp32), the mask's statistics and Philox's known answers,
determinism, argument errors, torch.compile and opcheck."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import openkernels.attention as A
from openkernels.attention.core import reference as R
from openkernels.attention.core.triton.kernels import _dropout_keep, _dropout_seed
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import random_tensor, run_opcheck

from .cases import (
    INTERPRETING,
    SOFTCAP,
    Case,
    Options,
    Shape,
    check_against_reference,
    compare,
    dense_case,
    option_params,
    option_shapes,
    run,
    runs_dtype,
    targets,
    varlen_case,
)

pytestmark = pytest.mark.parametrize(("device", "impl"), targets())

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
_OPTIONS = [
    Options(dropout=0.3),
    Options(causal=True, dropout=0.1),
    Options(window=(5, 3), alibi="batch", softcap=SOFTCAP, dropout=0.5),
]


def _only(impl: str, wanted: str) -> None:
    """Checks of the mask itself, which no implementation changes: run them once."""
    if impl != wanted:
        pytest.skip(f"independent of the implementation: runs under {wanted}")


@pytest.mark.parametrize("options", option_params(_OPTIONS))
def test_dropout_matches_reference(device: str, impl: str, options: Options) -> None:
    shapes = option_shapes(device)
    shapes.append(Shape(1, 19, 19, 4, 1, 32) if INTERPRETING else Shape(2, 70, 131, 8, 2, 64))  # GQA
    for shape in shapes:
        check_against_reference(dense_case(shape, options, BF16, device), impl)


def test_full_dropout_on_the_plain_configs(device: str, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """problem.FULL_DROPOUT_ON_PLAIN_CONFIGS (the default since attention 0.8.8, set here so
    the test keeps covering it if it is turned off): dropout alone in a full call on the fast
    path's plain configs (16-aligned lengths, D128 and D64), against the reference drawing the
    same mask; causal dropout keeps the override configs."""
    if INTERPRETING or device != "cuda":
        pytest.skip("the fast configs are the GPU's")
    from openkernels.attention.core import problem

    monkeypatch.setattr(problem, "FULL_DROPOUT_ON_PLAIN_CONFIGS", True)
    for head_dim in (64, 128):
        for options in (Options(dropout=0.1), Options(causal=True, dropout=0.1)):
            check_against_reference(
                dense_case(Shape(2, 192, 256, 4, 1, head_dim), options, BF16, device), impl
            )


@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
def test_dropout_dtypes(device: str, impl: str, dtype: torch.dtype) -> None:
    if not runs_dtype(impl, dtype):
        pytest.skip("the Triton kernels take float16 and bfloat16")
    check_against_reference(dense_case(Shape(2, 23, 29, 2, 1, 32), Options(causal=True, dropout=0.2), dtype, device),
                            impl)  # fmt: skip


def test_dropout_varlen_and_padded_head_dim(device: str, impl: str) -> None:
    options = Options(causal=True, dropout=0.25)
    check_against_reference(varlen_case([5, 0, 1, 19], [7, 3, 1, 23], 4, 2, 32, options, BF16, device), impl)
    check_against_reference(dense_case(Shape(1, 21, 21, 2, 2, 40), options, BF16, device), impl)


def test_dropout_non_contiguous(device: str, impl: str) -> None:
    # (B, H, S, D) tensors transposed to (B, S, H, D): strided views, no copies.
    case = dense_case(Shape(2, 33, 33, 4, 2, 64), Options(dropout=0.3), BF16, device)
    views = [
        t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        for t in (case.q, case.k, case.v)
    ]
    assert not views[0].is_contiguous()
    check_against_reference(Case(*views, case.options), impl)


def test_dropout_is_applied_and_follows_the_seed(device: str, impl: str) -> None:
    case = dense_case(Shape(2, 40, 40, 2, 1, 64), Options(dropout=0.3), BF16, device, grad=False)
    with dispatch.force(impl):
        plain, _ = case.call(dropout_p=0.0)
        first, _ = case.call()
        again, _ = case.call()
        other, _ = case.call(generator=torch.Generator(device=device).manual_seed(case.seed + 1))
        zero, _ = case.call(dropout_p=0.0)
    assert torch.equal(first, again), "the same seed must draw the same mask"
    assert not torch.equal(first, other), "another seed must draw another mask"
    assert torch.equal(plain, zero)
    # A dropped probability moves the output far beyond rounding.
    assert float((first.float() - plain.float()).abs().max()) > 0.1


def test_dropout_backward_is_deterministic(device: str, impl: str) -> None:
    case = dense_case(Shape(1, 48, 48, 4, 2, 64), Options(causal=True, dropout=0.2), BF16, device)
    dout = random_tensor(tuple(case.q.shape), BF16, device)
    first, second = run(case, impl, dout=dout), run(case, impl, dout=dout)
    assert torch.equal(first[0], second[0])
    for name, a, b in zip(("dq", "dk", "dv"), first[2], second[2]):
        assert torch.equal(a, b), f"{name} differs between two identical runs"


def test_default_generator_follows_manual_seed(device: str, impl: str) -> None:
    case = dense_case(Shape(1, 16, 16, 2, 2, 32), Options(), BF16, device, grad=False)
    with dispatch.force(impl):
        torch.manual_seed(7)
        a = A.attention(case.q, case.k, case.v, dropout_p=0.4)
        torch.manual_seed(7)
        b = A.attention(case.q, case.k, case.v, dropout_p=0.4)
        c = A.attention(case.q, case.k, case.v, dropout_p=0.4)  # the generator moved on
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_dropout_arguments(device: str, impl: str) -> None:
    _only(impl, "reference")
    q = torch.randn(1, 4, 2, 32, device=device)
    for bad in (1.0, -0.1, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="dropout_p must be a float in"):
            A.attention(q, q, q, dropout_p=bad)
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        A.attention(q, q, q, dropout_p=0.1, generator=7)
    if device == "cpu" and torch.cuda.is_available():
        with pytest.raises(ValueError, match="generator is on"):
            A.attention(q, q, q, dropout_p=0.1, generator=torch.Generator(device="cuda"))


def test_mask_keeps_one_minus_p(device: str, impl: str) -> None:
    _only(impl, "reference")
    seed = torch.tensor([12345, -678], dtype=torch.int32, device=device)
    for p in (0.1, 0.5, 0.9):
        keep = R.dropout_keep(seed, torch.arange(6, device=device), torch.arange(200, device=device), 333, p)
        n = keep.numel()
        # Within 5 standard deviations of a fair coin of 1 - p.
        assert abs(float(keep.float().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), p
        # Neighbouring keys, rows and heads draw independent words: no two rows alike.
        assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0], keep[1])


def test_philox_known_answers(device: str, impl: str) -> None:
    # Random123's known-answer vectors for Philox-4x32-10 (kat_vectors).
    _only(impl, "reference")
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]  # fmt: skip
    for counter, key, expected in cases:
        words = R.philox4x32(
            tuple(torch.tensor(x) for x in key), *(torch.tensor(c) for c in counter), rounds=10
        )
        assert tuple(int(w) for w in words) == expected


@triton.jit
def _keep_kernel(
    seed_ptr, out_ptr, head, drop_below, ROWS: tl.constexpr, COLS: tl.constexpr, KEYS_FIRST: tl.constexpr
):
    """The kernels' dropout mask of rows 0..ROWS - 1 and keys 0..COLS - 1 of one head, as int8
    (rows, keys), from the (keys, rows) tile when KEYS_FIRST."""
    k0, k1 = _dropout_seed(seed_ptr)
    rows = tl.arange(0, ROWS)
    keep = _dropout_keep(k0, k1, head, rows, 0, drop_below, COLS, KEYS_FIRST)
    i = rows[:, None]
    j = tl.arange(0, COLS)[None, :]
    if KEYS_FIRST:
        tl.store(out_ptr + i * COLS + j, tl.trans(keep).to(tl.int8))
    else:
        tl.store(out_ptr + i * COLS + j, keep.to(tl.int8))


def test_triton_philox_matches_reference(device: str, impl: str) -> None:
    _only(impl, "triton")
    seed = torch.tensor([-5, 987654321], dtype=torch.int32, device=device)
    for p, keys_first in ((0.3, False), (0.75, True)):
        out = torch.empty(16, 32, dtype=torch.int8, device=device)
        _keep_kernel[(1,)](seed, out, 11, R.dropout_threshold(p) - 2**31, 16, 32, keys_first)
        heads, rows = torch.tensor([11], device=device), torch.arange(16, device=device)
        expected = R.dropout_keep(seed, heads, rows, 32, p)
        assert torch.equal(out.bool(), expected[0]), f"keys_first={keys_first}"


def test_dropout_opcheck_and_compile(device: str, impl: str) -> None:
    case = dense_case(Shape(2, 17, 23, 2, 1, 32), Options(causal=True, dropout=0.3), BF16, device)
    args = (case.q, case.k, case.v, *case.library_args())
    with dispatch.force(impl), torch.autograd.set_multithreading_enabled(False):
        run_opcheck(torch.ops.openkernels.attention.default, args)
        out, lse = torch.ops.openkernels.attention(*args)
        compare(case, out, lse, None, None, "library op")
        # The library op under torch.compile takes the seed as an input: the same mask.
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda *a: torch.ops.openkernels.attention(*a), fullgraph=True, backend="aot_eager"
        )
        out_c, lse_c = compiled(*args)
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)
