"""Every implementation against the float64 reference: every option combination, forward
(out and lse) and backward, odd sequence lengths, GQA/MQA, every head_dim, varlen with
empty and length-1 sequences, non-contiguous views, NaN, empty inputs, determinism,
torch.compile and opcheck."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import openkernels.attention as A
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import assert_close, poisoned_empty, random_tensor, run_opcheck

from .cases import (
    FEW_OPTIONS,
    HEAD_DIMS,
    INTERPRETING,
    PADDED_HEAD_DIMS,
    SCALE,
    SOFTCAP,
    WINDOWS,
    Case,
    Options,
    Shape,
    all_options,
    assert_attention_close,
    check_against_reference,
    compare,
    cu_seqlens,
    dense_case,
    nan_case,
    option_params,
    option_shapes,
    recording_implementation,
    run,
    runs_dtype,
    targets,
    varlen_case,
)

pytestmark = pytest.mark.parametrize(("device", "impl"), targets())

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
# The interpreter runs a dozen combinations; everything else runs every combination.
_OPTIONS = FEW_OPTIONS if INTERPRETING else all_options()
_DTYPE_IDS = {BF16: "bf16", F16: "fp16", F32: "fp32", F64: "fp64"}


def _skip_unless_runs(impl: str, dtype: torch.dtype) -> None:
    if not runs_dtype(impl, dtype):
        pytest.skip("the Triton kernels take float16 and bfloat16 (test_float32_is_not_a_triton_dtype)")


# ---- every option combination ------------------------------------------------------------


@pytest.mark.parametrize("options", option_params(_OPTIONS))
def test_every_option_bf16(device: str, impl: str, options: Options) -> None:
    if impl == "reference" and options not in FEW_OPTIONS:
        pytest.skip("the reference against itself: the dozen combinations cover its plumbing")
    for shape in option_shapes(device):
        check_against_reference(dense_case(shape, options, BF16, device), impl)


@pytest.mark.parametrize("dtype", [F16, F32], ids=_DTYPE_IDS.get)
@pytest.mark.parametrize("options", option_params(FEW_OPTIONS))
def test_options_fp16_fp32(device: str, impl: str, options: Options, dtype: torch.dtype) -> None:
    _skip_unless_runs(impl, dtype)
    for shape in option_shapes(device):
        check_against_reference(dense_case(shape, options, dtype, device), impl)


_SINGLE = [
    ("causal", Options(causal=True)),
    ("window-left", Options(window=WINDOWS["wl"])),
    ("window-right", Options(window=WINDOWS["wr"])),
    ("alibi-heads", Options(alibi="heads")),
    ("alibi-batch", Options(alibi="batch")),
    ("softcap", Options(softcap=SOFTCAP)),
    ("softmax_scale", Options(softmax_scale=SCALE)),
]


@pytest.mark.parametrize("options", [pytest.param(o, id=name) for name, o in _SINGLE])
def test_each_option_changes_the_result(device: str, impl: str, options: Options) -> None:
    # The comparisons above can only catch an ignored option if the option moves the output
    # by more than the tolerance: it must, here, by a wide margin.
    case = dense_case(Shape(2, 23, 23, 2, 1, 64), options, BF16, device)
    if options.alibi == "batch":  # per-sequence slopes must differ from the first sequence's
        case.alibi_slopes[1] = case.alibi_slopes[1].flip(0) * 0.3
    out, _, _, _ = run(case, impl, backward=False)
    plain = Case(case.q, case.k, case.v, Options())
    if options.alibi == "batch":
        plain = Case(case.q, case.k, case.v, Options(alibi="heads"), case.alibi_slopes[0])
    with pytest.raises(AssertionError, match="without the option out"):
        compare(plain, out, *plain.call()[1:], None, None, "without the option")
    check_against_reference(case, impl, backward=False)


_FAST_PATH_OPTIONS = [
    Options(window=WINDOWS["w"], alibi="batch"),
    Options(causal=True, softcap=SOFTCAP, softmax_scale=SCALE),
    Options(causal=True, window=(40, -1), alibi="heads", softcap=SOFTCAP, dropout=0.1),
    # ALiBi alone and a softcap alone keep the plain fast configs (Problem.option_configs).
    Options(causal=True, alibi="heads"),
    Options(alibi="batch"),
    Options(softcap=SOFTCAP),
]


@pytest.mark.parametrize("head_dim", [64] if INTERPRETING else [64, 128, 256])
def test_options_on_the_fast_path(device: str, impl: str, head_dim: int) -> None:
    # Lengths and strides that are multiples of 16 run the fast configs, options included
    # (configs._OPTIONS_TABLE where the fast one spills with them); the shapes above do not.
    shape = Shape(2, 192, 256, 4, 1, head_dim) if device != "cpu" else Shape(1, 32, 48, 2, 1, head_dim)
    for options in _FAST_PATH_OPTIONS:
        check_against_reference(dense_case(shape, options, BF16, device), impl)


# ---- shapes ------------------------------------------------------------------------------


def _gqa_heads() -> list:
    # (heads_q, heads_kv): ratios 1, 4 and 8, MQA (heads_kv 1) among them.
    heads = [(2, 2), (4, 1), (8, 1)] if INTERPRETING else [(3, 3), (4, 1), (8, 2), (8, 1), (16, 2)]
    return [pytest.param(h, id=f"hq{h[0]}-hkv{h[1]}") for h in heads]


@pytest.mark.parametrize("heads", _gqa_heads())
def test_gqa_ratios(device: str, impl: str, heads: tuple[int, int]) -> None:
    hq, hkv = heads
    shape = Shape(1, 17, 17, hq, hkv, 32) if INTERPRETING else Shape(2, 33, 29, hq, hkv, 64)
    # Per-head slopes tell the heads of a group apart: a wrong head mapping shows.
    for options in (Options(), Options(causal=True, alibi="batch")):
        check_against_reference(dense_case(shape, options, BF16, device), impl)


def _seqlens() -> list:
    pairs = [(1, 1), (1, 17), (17, 1), (17, 17), (17, 40), (40, 17)]
    if not INTERPRETING:
        pairs += [(1000, 1000), (1, 1000), (1000, 17)]
    return [pytest.param(p, id=f"q{p[0]}-k{p[1]}") for p in pairs]


@pytest.mark.parametrize("seqlens", _seqlens())
def test_odd_sequence_lengths(device: str, impl: str, seqlens: tuple[int, int]) -> None:
    # Causal and windows with seqlen_q > seqlen_k leave the first rows without a visible
    # key (out 0, lse -inf, gradients 0 and never NaN); seqlen_q < seqlen_k is decoding
    # against a cache (aligned bottom-right).
    sq, sk = seqlens
    big = max(sq, sk) >= 1000
    shape = Shape(1, sq, sk, 2, 1, 64) if big else Shape(2, sq, sk, 2, 1, 64)
    window = (100, 20) if big else (5, 2)
    for options in (
        Options(),
        Options(causal=True),
        Options(causal=True, window=window),
        Options(window=window),
    ):
        case = dense_case(shape, options, BF16, device)
        check_against_reference(case, impl)


@pytest.mark.parametrize("head_dim", HEAD_DIMS + PADDED_HEAD_DIMS)
def test_every_head_dim(device: str, impl: str, head_dim: int) -> None:
    shape = Shape(1, 17, 17, 1, 1, head_dim) if INTERPRETING else Shape(2, 17, 23, 2, 1, head_dim)
    options = Options(causal=True, softcap=SOFTCAP)
    check_against_reference(dense_case(shape, options, BF16, device), impl)
    if not INTERPRETING:
        check_against_reference(dense_case(shape, Options(window=(4, 4)), F16, device), impl)


def test_large_scores(device: str, impl: str) -> None:
    # Scores of size ~100: the online softmax must rescale its running max without
    # overflow, and half-precision P is mostly 0 and 1.
    shape = Shape(1, 40, 40, 2, 1, 64)
    for options in (Options(), Options(causal=True, softcap=30.0)):
        check_against_reference(dense_case(shape, options, BF16, device, scale=4.0), impl)


# ---- dtypes ------------------------------------------------------------------------------


def test_float32_is_not_a_triton_dtype(device: str, impl: str) -> None:
    case = dense_case(Shape(1, 5, 5, 1, 1, 32), Options(), F32, device)
    if impl != "triton":
        check_against_reference(case, impl)
        return
    with dispatch.force(impl), pytest.raises(dispatch.UnsupportedError, match="slower path"):
        case.call()


def test_float64(device: str, impl: str) -> None:
    _skip_unless_runs(impl, F64)
    options = Options(causal=True, window=(3, -1), alibi="heads", softcap=SOFTCAP)
    case = dense_case(Shape(1, 4, 5, 2, 1, 32), options, F64, device)
    check_against_reference(case, impl)
    with dispatch.force(impl):
        assert torch.autograd.gradcheck(
            lambda q, k, v: case.call(q, k, v)[0], (case.q, case.k, case.v), fast_mode=True
        )


# ---- varlen ------------------------------------------------------------------------------

# Empty sequences (q and k, q only, k only), length 1, seqlen_q < and > seqlen_k.
_LENS_Q = [0, 1, 17, 5, 3, 0, 6, 2]
_LENS_K = [3, 1, 17, 9, 0, 0, 2, 11]


@pytest.mark.parametrize("options", option_params(FEW_OPTIONS))
def test_varlen(device: str, impl: str, options: Options) -> None:
    case = varlen_case(_LENS_Q, _LENS_K, 4, 2, 64, options, BF16, device)
    check_against_reference(case, impl)


@pytest.mark.parametrize("dtype", [F16, F32], ids=_DTYPE_IDS.get)
def test_varlen_dtypes(device: str, impl: str, dtype: torch.dtype) -> None:
    _skip_unless_runs(impl, dtype)
    options = Options(causal=True, alibi="batch", softcap=SOFTCAP)
    check_against_reference(varlen_case(_LENS_Q, _LENS_K, 2, 1, 32, options, dtype, device), impl)


def test_varlen_matches_dense_batches(device: str, impl: str) -> None:
    # Equal-length sequences packed are the dense batch: the same numbers.
    options = Options(causal=True, alibi="batch")
    dense = dense_case(Shape(3, 11, 13, 2, 1, 32), options, BF16, device, grad=False)
    packed = Case(dense.q.flatten(0, 1), dense.k.flatten(0, 1), dense.v.flatten(0, 1), options,
                  dense.alibi_slopes, *(torch.arange(0, 34, 11, dtype=torch.int32, device=device),
                  torch.arange(0, 40, 13, dtype=torch.int32, device=device)), 11, 13)  # fmt: skip
    with dispatch.force(impl):
        out, lse = dense.call()
        out_p, lse_p = packed.call()
    # The same sequences, so the same numbers up to summation order.
    vmax = float(dense.v.abs().max())
    assert_attention_close(
        out_p, out.flatten(0, 1).double(), dtype=BF16, magnitude=vmax, terms=13 + 32, msg="out"
    )
    assert_close(lse_p, lse.transpose(0, 1).flatten(1, 2).double(), dtype=F32, terms=13 + 32, msg="lse")


def test_varlen_large(device: str, impl: str) -> None:
    if INTERPRETING:
        pytest.skip("long sequences are for compiled kernels")
    lens_q, lens_k = [1, 300, 0, 200, 129], [1000, 300, 5, 2, 129]
    for options in (Options(causal=True), Options(window=(64, 64), alibi="heads")):
        check_against_reference(varlen_case(lens_q, lens_k, 2, 1, 64, options, BF16, device), impl)


@pytest.mark.parametrize(
    "shape",
    [Shape(1, 8192, 8192, 2, 2, 128), Shape(1, 3000, 9000, 2, 1, 64)],
    ids=lambda s: f"{s.seqlen_q}x{s.seqlen_k}",
)
def test_alibi_causal_long_sequences(device: str, impl: str, shape: Shape) -> None:
    """Causal ALiBi at thousands of keys (the Triton kernels split its bias into a key term
    and a row term moved into the log-sum-exp, plan.alibi_flag 2): a steep and a shallow
    slope (2^-8: thousands of keys keep weight), out, lse and gradients against float64."""
    if INTERPRETING or device != "cuda":
        pytest.skip("long sequences are for the GPU")
    case = dense_case(shape, Options(causal=True, alibi="heads"), BF16, device)
    case = dataclasses.replace(case, alibi_slopes=torch.tensor([0.5, 2.0**-8], device=device))
    check_against_reference(case, impl)


# ---- layouts -----------------------------------------------------------------------------


def _bhsd(shape: tuple[int, int, int, int], dtype, device) -> torch.Tensor:
    """A (B, S, H, D) view of a contiguous (B, H, S, D) tensor (the SDPA layout)."""
    b, s, h, d = shape
    return random_tensor((b, h, s, d), dtype, device).transpose(1, 2).requires_grad_()


def _layouts(b, sq, sk, hq, hkv, d, dtype, device) -> dict[str, tuple]:
    """Non-contiguous q, k, v with a unit head_dim stride (read in place) and one without."""
    qkv = random_tensor((b, sq, hq + 2 * hkv, d), dtype, device)  # a fused QKV projection
    wide = random_tensor((b, sq, hq, d + 24), dtype, device)
    wide_k = random_tensor((b, 2 * sk, hkv, d + 8), dtype, device)
    return {
        "bhsd": (_bhsd((b, sq, hq, d), dtype, device), _bhsd((b, sk, hkv, d), dtype, device),
                 _bhsd((b, sk, hkv, d), dtype, device)),
        "fused-qkv": tuple(t.requires_grad_() for t in qkv.split([hq, hkv, hkv], dim=2)) if sq == sk else None,
        "head-dim-slice-and-row-step": (wide[..., 3 : 3 + d].requires_grad_(),
                                        wide_k[:, ::2, :, :d].requires_grad_(),
                                        wide_k[:, 1::2, :, 8:].requires_grad_()),
        "head-dim-strided": (random_tensor((b, sq, d, hq), dtype, device).transpose(2, 3).requires_grad_(),
                             random_tensor((b, sk, d, hkv), dtype, device).transpose(2, 3).requires_grad_(),
                             random_tensor((b, sk, d, hkv), dtype, device).transpose(2, 3).requires_grad_()),
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["bhsd", "fused-qkv", "head-dim-slice-and-row-step", "head-dim-strided"])
def test_noncontiguous_inputs(device: str, impl: str, layout: str) -> None:
    b, sq, sk, hq, hkv, d = 2, 19, 19, 4, 2, 64
    q, k, v = _layouts(b, sq, sk, hq, hkv, d, BF16, device)[layout]
    options = Options(causal=True, alibi="heads")
    case = Case(q, k, v, options, options.slopes(b, hq, device))
    with (
        recording_implementation("attention", impl) as fwd,
        recording_implementation("attention_backward", impl) as bwd,
    ):
        check_against_reference(case, impl, layout)
    assert len(fwd) == 1 and len(bwd) == 1
    if layout != "head-dim-strided":
        # A unit head_dim stride is all the kernels need: q, k, v reach them as the views
        # they are (no copies) in the forward and in the backward.
        for args, first in ((fwd[0], 0), (bwd[0], 1)):
            for name, x, seen in zip("qkv", (q, k, v), args[first : first + 3]):
                assert seen.data_ptr() == x.data_ptr() and seen.stride() == x.stride(), (
                    f"{layout}: {name} was copied before the kernel ({x.stride()} -> {seen.stride()})"
                )


def test_noncontiguous_varlen(device: str, impl: str) -> None:
    # q, k, v: head slices of a packed (tokens, heads, head_dim + 16) buffer.
    lens = [5, 0, 1, 13]
    t, hq, hkv, d = sum(lens), 2, 1, 32
    packed = random_tensor((t, hq + 2 * hkv, d + 16), BF16, device)[..., 8 : 8 + d]
    q, k, v = (x.requires_grad_() for x in packed.split([hq, hkv, hkv], dim=1))
    cu = cu_seqlens(lens, device)
    case = Case(q, k, v, Options(causal=True, window=(3, -1)), None, cu, cu, 13, 13)
    with recording_implementation("attention", impl) as fwd:
        check_against_reference(case, impl)
    assert fwd[0][0].data_ptr() == q.data_ptr(), "packed q was copied before the kernel"


# ---- special values ----------------------------------------------------------------------


def test_nan_stays_in_its_rows(device: str, impl: str) -> None:
    # A NaN in a query poisons its row only; in a key, every row that attends to it (all
    # rows of its K/V head's group, without masks); in a value, that column of those rows.
    for what, options in (("q", Options(causal=True)), ("k", Options()), ("v", Options())):
        case, expected = nan_case(what, options, BF16, device)
        out, lse, _, _ = run(case, impl, backward=False)
        assert torch.equal(torch.isnan(out).cpu(), expected), f"NaN in {what}: wrong rows are NaN"
        compare(case, out, lse, None, None, f"NaN in {what}")  # and the rest is right


def test_empty_inputs(device: str, impl: str) -> None:
    for shape in (Shape(0, 5, 5, 2, 1, 32), Shape(2, 0, 5, 2, 1, 32), Shape(2, 5, 0, 2, 1, 32)):
        case = dense_case(shape, Options(causal=True), BF16, device)
        out, lse, grads, _ = run(case, impl)
        assert out.shape == case.q.shape and lse.shape == (shape.batch, 2, shape.seqlen_q)
        # No keys at all: every row is empty.
        assert (out == 0).all() and torch.isneginf(lse).all()
        for g, x in zip(grads, (case.q, case.k, case.v)):
            assert g.shape == x.shape and (g == 0).all()
    case = varlen_case([0, 0], [0, 0], 2, 1, 32, Options(), BF16, device)
    out, lse, grads, _ = run(case, impl)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0) and all(g.numel() == 0 for g in grads)


def test_lse_is_not_differentiable(device: str, impl: str) -> None:
    case = dense_case(Shape(1, 5, 5, 1, 1, 32), Options(), BF16, device)
    q, k, v = case.q, case.k, case.v
    with dispatch.force(impl):
        for out, lse in (
            A.attention(q, k, v, return_lse=True),
            torch.ops.openkernels.attention(q, k, v, *case.library_args()),
        ):
            assert out.requires_grad and not lse.requires_grad
            with pytest.raises(RuntimeError, match="does not require grad"):
                lse.sum().backward()
        only_out = A.attention(q, k, v)
        assert isinstance(only_out, torch.Tensor) and only_out.shape == q.shape


# ---- determinism -------------------------------------------------------------------------


def test_backward_is_deterministic(device: str, impl: str) -> None:
    # dk/dv add over a GQA group's heads and every query block; dq over key blocks.
    shape = Shape(1, 40, 40, 2, 1, 64) if INTERPRETING else Shape(2, 300, 257, 8, 2, 64)
    for options in (Options(causal=True), Options(window=(31, 17), alibi="heads", softcap=SOFTCAP)):
        case = dense_case(shape, options, BF16, device)
        dout = random_tensor(tuple(case.q.shape), BF16, device)
        first = run(case, impl, dout=dout)
        second = run(case, impl, dout=dout)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        for name, a, b in zip(("dq", "dk", "dv"), first[2], second[2]):
            assert torch.equal(a, b), f"{options.id}: {name} differs between two identical runs"


# ---- torch.compile and opcheck -----------------------------------------------------------


def _compile_cases(device: str) -> list[Case]:
    options = Options(causal=True, window=(9, -1), alibi="batch", softcap=SOFTCAP)
    hq, hkv, d = (2, 1, 32) if INTERPRETING else (4, 2, 64)
    return [
        dense_case(Shape(2, 17, 23, hq, hkv, d), options, BF16, device),
        varlen_case([5, 0, 1, 13], [7, 3, 1, 13], hq, hkv, d, options, BF16, device),
    ]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(device: str, impl: str, backend: str) -> None:
    if backend == "inductor" and (INTERPRETING or impl == "reference"):
        pytest.skip("one inductor run per compiled backend (aot_eager covers the rest)")
    torch._dynamo.reset()
    for case in _compile_cases(device)[: 1 if backend == "inductor" else 2]:

        def loss(q, k, v, case=case):
            out, lse = case.call(q, k, v)
            return out, lse, (out.float() * 2).sum()

        compiled = torch.compile(loss, fullgraph=True, backend=backend)
        leaves = (case.q, case.k, case.v)
        # The compiled backward calls the backward op from autograd's CUDA thread, where the
        # force block is not visible (docs/dispatch.md): run it in this thread, or the
        # compiled gradients of a forced reference come from the Triton backward.
        with dispatch.force(impl), poisoned_empty(), torch.autograd.set_multithreading_enabled(False):
            out, lse, eager = loss(*leaves)
            grads = torch.autograd.grad(eager, leaves)
            out_c, lse_c, got = compiled(*leaves)
            grads_c = torch.autograd.grad(got, leaves)
        # The same kernels run in both: equal outputs and gradients ...
        assert torch.equal(out_c, out) and torch.equal(lse_c, lse), (
            f"{backend} {case.id}: compiled output differs"
        )
        for name, a, b in zip("qkv", grads_c, grads):
            assert torch.equal(a, b), f"{backend} {case.id}: compiled d{name} differs from eager"
        # ... and both are right.
        compare(case, out_c, lse_c, None, None, f"{backend} compiled")


def test_opcheck(device: str, impl: str) -> None:
    ops = torch.ops.openkernels
    for case in _compile_cases(device):
        args = (case.q, case.k, case.v, *case.library_args())
        # opcheck's AOT-dispatch checks run compiled backwards: in this thread, so that the
        # force block reaches them (see test_torch_compile_fullgraph).
        with dispatch.force(impl), torch.autograd.set_multithreading_enabled(False):
            run_opcheck(ops.attention.default, args)
            out, lse = ops.attention(*args)
            dout = random_tensor(tuple(out.shape), out.dtype, device)
            qkv = tuple(t.detach() for t in (case.q, case.k, case.v))
            run_opcheck(ops.attention_backward.default, (dout, *qkv, out.detach(), lse, *case.library_args()))


def test_library_op_matches_public_function(device: str, impl: str) -> None:
    case = _compile_cases(device)[1]
    with dispatch.force(impl):
        out, lse = torch.ops.openkernels.attention(case.q, case.k, case.v, *case.library_args())
        out_f, lse_f = case.call()
    assert torch.equal(out, out_f) and torch.equal(lse, lse_f)


def test_half_precision_tolerance_is_tight(device: str, impl: str) -> None:
    # The comparison must catch errors a little above the half-precision budget: an output
    # off by 4x the allowed P rounding (a P rounded twice, say) fails.
    case = dense_case(Shape(1, 33, 33, 2, 1, 64), Options(causal=True), BF16, device, grad=False)
    out, lse, _, _ = run(case, impl, backward=False)
    compare(case, out, lse, None, None, "as computed")
    vmax = float(case.v.abs().max())
    off = out.float() + 4 * 2**-7 * vmax * torch.sign(random_tensor(tuple(out.shape), device=device))
    with pytest.raises(AssertionError):
        assert_attention_close(off.to(BF16), case.reference(case.q.double(), case.k.double(), case.v.double())[0],
                               dtype=BF16, magnitude=vmax, terms=33 + 64, msg="perturbed")  # fmt: skip
