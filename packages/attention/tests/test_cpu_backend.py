"""The CPU backend (openkernels.attention.core.cpu) on each of its paths: PyTorch's CPU flash kernel
(cpu/sdpa.py), the blockwise online softmax (cpu/blockwise.py) and the C++ kernel of few query
rows per KV head (cpu/decode.py; the calls it does not take run on the other two).

Each test runs the public functions with the backend forced (dispatch.force("cpu")) and one
path pinned (cpu.FORCE_PATH; softcap always runs blockwise), checks which path ran, and
compares out, lse and dq / dk / dv with the reference on float64 copies of the inputs
(cases.check_against_reference: outputs poisoned with NaN, so an unwritten element or a
NaN fails; tolerances derived in cases.py's docstring: the dtype's rtol on the result, plus
the half-precision rounding of P and of D_i = dout_i . out_i relative to the sum of the
terms' magnitudes, plus float32 accumulation growing like sqrt(terms)).
"""

from __future__ import annotations

import pytest
import torch

from openkernels.attention.core import cpu
from openkernels.attention.core.cpu import blockwise, decode, sdpa
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import random_tensor

from .cases import (
    SCALE,
    SOFTCAP,
    WINDOWS,
    Case,
    Options,
    Shape,
    check_against_reference,
    compare,
    cu_seqlens,
    dense_case,
    nan_case,
    run,
    varlen_case,
)

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DTYPE_IDS = {BF16: "bf16", F16: "fp16", F32: "fp32", F64: "fp64"}


class Path:
    """The pinned path and the modules that ran (recorded per forward / backward call)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ran: list[str] = []

    def expected(self, case: Case) -> list[str]:
        """The path of the forward and of the backward."""
        other = "blockwise" if case.options.softcap > 0 or self.name == "blockwise" else "sdpa"
        if self.name != "decode" or case.varlen:
            return [other, other]
        return [
            "decode" if decode.why_not_dense(case.q, case.k, case.v, b) is None else other
            for b in (False, True)
        ]

    def check(self, case: Case, msg: str = "") -> None:
        """check_against_reference on the CPU backend, then: the expected paths (and only they) ran."""
        self.ran.clear()
        check_against_reference(case, "cpu", f"{self.name} {msg}".strip())
        expected = self.expected(case)
        ok = set(self.ran) == set(expected) and (self.ran[0], self.ran[-1]) == tuple(expected)
        assert ok, f"{case.id}: expected the {expected} paths (forward, backward), ran {self.ran}"


@pytest.fixture(params=["sdpa", "blockwise", "decode"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Path:
    pinned = Path(request.param)
    monkeypatch.setattr(cpu, "FORCE_PATH", request.param)
    spied = [(sdpa, "sdpa", ("forward", "backward")), (blockwise, "blockwise", ("forward", "backward")),
             (decode, "decode", ("attend", "backward_dense"))]  # fmt: skip
    for module, name, fns in spied:
        for fn in fns:
            original = getattr(module, fn)

            def spy(*args, _original=original, _name=name, **kwargs):
                pinned.ran.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, fn, spy)
    return pinned


# ---- options -----------------------------------------------------------------------------

# Each option alone, then the combinations that interact (masks with ALiBi and softcap).
_OPTIONS = [
    Options(),
    Options(causal=True),
    Options(window=WINDOWS["wl"]),
    Options(window=WINDOWS["wr"]),
    Options(window=WINDOWS["w"]),
    Options(alibi="heads"),
    Options(alibi="batch"),
    Options(softcap=SOFTCAP),
    Options(softmax_scale=SCALE),
    Options(causal=True, window=WINDOWS["wl"], alibi="batch"),
    Options(causal=True, softcap=SOFTCAP, softmax_scale=SCALE),
    Options(window=WINDOWS["w"], alibi="heads", softcap=SOFTCAP),
]
# seqlen_q == seqlen_k, a single token, seqlen_q < seqlen_k (a cache) and seqlen_q > seqlen_k
# (causal and right windows leave the first rows with no visible key).
_SHAPES = [
    Shape(2, 17, 17, 4, 2, 64),
    Shape(1, 1, 1, 2, 1, 32),
    Shape(2, 13, 40, 4, 2, 32),
    Shape(2, 40, 13, 4, 1, 64),
]


@pytest.mark.parametrize("options", [pytest.param(o, id=o.id) for o in _OPTIONS])
def test_options(path: Path, options: Options) -> None:
    for shape in _SHAPES:
        path.check(dense_case(shape, options, F32, "cpu"), shape.id)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=["gqa1", "gqa4", "gqa8"])
def test_gqa_ratios(path: Path, heads: tuple[int, int]) -> None:
    # Per-sequence slopes tell a group's heads apart: a wrong head mapping shows.
    shape = Shape(2, 33, 29, *heads, 64)
    for options in (Options(), Options(causal=True, alibi="batch"), Options(window=(9, 3), softcap=SOFTCAP)):
        path.check(dense_case(shape, options, BF16, "cpu"))


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=DTYPE_IDS.get)
def test_dtypes(path: Path, dtype: torch.dtype) -> None:
    # 300 x 600: several query and key tiles of the blockwise path (128 x 256) and two row
    # blocks of the flash kernel under a window (256 rows), at the default block sizes.
    shape = Shape(1, 300, 600, 4, 2, 64)
    for options in (Options(causal=True), Options(window=(150, 20), alibi="heads"), Options(softcap=SOFTCAP)):
        path.check(dense_case(shape, options, dtype, "cpu"))


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
def test_small_blocks(path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small blocks on small inputs: tiles that are skipped, fully visible (no mask) or cut by
    # the mask, ragged last tiles, and flash-kernel row blocks whose dk / dv add up.
    monkeypatch.setattr(blockwise, "BLOCK_Q", 16)
    monkeypatch.setattr(blockwise, "BLOCK_K", 32)
    monkeypatch.setattr(sdpa, "_MASK_ELEMENTS", 2048)
    monkeypatch.setattr(sdpa, "_WINDOW_ROWS", 24)
    for shape in (Shape(2, 70, 97, 4, 2, 32), Shape(2, 97, 70, 2, 1, 32)):
        for options in (
            Options(causal=True),
            Options(window=(20, 9)),
            Options(alibi="batch"),
            Options(causal=True, window=(40, -1), alibi="heads", softcap=SOFTCAP),
        ):
            path.check(dense_case(shape, options, dtype, "cpu"), shape.id)


def test_large_scores(path: Path) -> None:
    # Scores of size ~100: the running max must rescale without overflow. bfloat16: in float32
    # the scores' own rounding (~1e-5 at |s| ~ 100, both paths alike) moves P by about the
    # float32 output tolerance, which does not model it; bfloat16's P rounding budget does.
    shape = Shape(1, 70, 300, 2, 1, 64)
    for options in (Options(), Options(causal=True, alibi="heads")):
        path.check(dense_case(shape, options, BF16, "cpu", scale=4.0))


def test_empty_rows_have_zero_gradients(path: Path) -> None:
    # seqlen_q > seqlen_k with causal: the first 23 rows see no key: out 0, lse -inf (checked by
    # compare) and dq exactly 0; nothing NaN.
    for options in (Options(causal=True), Options(causal=True, alibi="batch", softcap=SOFTCAP)):
        case = dense_case(Shape(2, 40, 17, 2, 1, 32), options, F32, "cpu")
        path.ran.clear()
        out, lse, grads, dout = run(case, "cpu")
        compare(case, out, lse, grads, dout, path.name)
        assert (grads[0][:, :23] == 0).all(), "dq of rows with no visible key must be 0"
        assert all(torch.isfinite(g).all() for g in grads)


# ---- varlen ------------------------------------------------------------------------------

# Empty sequences (both sides, q only, k only), length 1, seqlen_q < and > seqlen_k.
_LENS_Q = [0, 1, 17, 5, 3, 0, 6, 2]
_LENS_K = [3, 1, 17, 9, 0, 0, 2, 11]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize(
    "options",
    [pytest.param(o, id=o.id) for o in (
        Options(),
        Options(causal=True),
        Options(window=WINDOWS["w"], alibi="batch"),
        Options(causal=True, alibi="heads", softcap=SOFTCAP),
    )],
)  # fmt: skip
def test_varlen(path: Path, options: Options, dtype: torch.dtype) -> None:
    path.check(varlen_case(_LENS_Q, _LENS_K, 4, 2, 32, options, dtype, "cpu"))


# ---- layouts and special values ----------------------------------------------------------


def test_noncontiguous_inputs(path: Path) -> None:
    b, sq, sk, hq, hkv, d = 2, 19, 23, 4, 2, 64

    def bhsd(s: int, h: int) -> torch.Tensor:  # a transposed (B, H, S, D) tensor viewed as (B, S, H, D)
        return random_tensor((b, h, s, d), BF16).transpose(1, 2).requires_grad_()

    wide = random_tensor((b, 2 * sk, hkv, d + 8), BF16)  # head_dim slices and every other row
    layouts = {
        "bhsd": (bhsd(sq, hq), bhsd(sk, hkv), bhsd(sk, hkv)),
        "slices": (bhsd(sq, hq), wide[:, ::2, :, :d].requires_grad_(), wide[:, 1::2, :, 8:].requires_grad_()),
    }
    for name, (q, k, v) in layouts.items():
        for options in (Options(causal=True, alibi="heads"), Options(window=(5, 5), softcap=SOFTCAP)):
            path.check(Case(q, k, v, options, options.slopes(b, hq, "cpu")), name)
    # Packed varlen views: q, k, v head slices of one (tokens, heads, head_dim + 16) buffer.
    lens = [5, 0, 1, 13]
    packed = random_tensor((sum(lens), hq + 2 * hkv, d + 16), BF16)[..., 8 : 8 + d]
    q, k, v = (x.requires_grad_() for x in packed.split([hq, hkv, hkv], dim=1))
    cu = cu_seqlens(lens, "cpu")
    path.check(Case(q, k, v, Options(causal=True, window=(3, -1)), None, cu, cu, 13, 13), "packed")


def test_nan_stays_in_its_rows(path: Path) -> None:
    # A NaN in a query poisons its row only; in a key, every row of its K/V head's group; in a
    # value, that column of those rows. The rest matches the reference.
    for what, options in (("q", Options(causal=True)), ("k", Options()), ("v", Options(alibi="heads"))):
        case, expected = nan_case(what, options, F32, "cpu")
        out, lse, _, _ = run(case, "cpu", backward=False)
        assert torch.equal(torch.isnan(out), expected), f"{path.name}: NaN in {what}: wrong elements are NaN"
        compare(case, out, lse, None, None, f"{path.name}: NaN in {what}")


# ---- selection ---------------------------------------------------------------------------


def test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unpinned: the flash kernel, except softcap (it has none).
    monkeypatch.setattr(cpu, "FORCE_PATH", None)
    assert cpu._path(0.0) == "sdpa"
    assert cpu._path(SOFTCAP) == "blockwise"
    monkeypatch.setattr(cpu, "FORCE_PATH", "sdpa")
    assert cpu._path(SOFTCAP) == "blockwise"
    monkeypatch.setattr(cpu, "FORCE_PATH", "blockwise")
    assert cpu._path(0.0) == "blockwise"


def test_supports() -> None:
    for dtype in (F16, BF16, F32, F64):
        assert cpu.supports(dispatch.key_for(torch.empty(1, dtype=dtype))) is None
    assert "int32" in cpu.supports(dispatch.key_for(torch.empty(1, dtype=torch.int32)))


def test_results_take_the_kernels_memory_and_keep_the_op_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32: the SDPA kernel's out and gradients already have the (B, S, H, D) layout, and are
    # adopted (adopt.py) instead of copied; the op's results stay contiguous, own their
    # memory and equal the reference.
    monkeypatch.setattr(cpu, "FORCE_PATH", "sdpa")
    adopted: list[bool] = []
    real = sdpa.adopt
    monkeypatch.setattr(
        sdpa, "adopt", lambda dst, src: adopted.append(dst.stride() == src.stride()) or real(dst, src)
    )
    import openkernels.attention as K

    q = random_tensor((2, 17, 4, 64), F32).requires_grad_()
    k, v = (random_tensor((2, 17, 2, 64), F32).requires_grad_() for _ in range(2))
    with dispatch.force("cpu"):
        out = K.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
    assert adopted == [True] * 4
    for t in (out, q.grad, k.grad, v.grad):
        assert t.is_contiguous() and t._base is None
    for t in (q, k, v):
        assert t.grad.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    check_against_reference(Case(q, k, v, Options(causal=True), None), "cpu", "adopted")


def test_calls_of_few_rows_per_kv_head_take_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unpinned: forward and backward of a short call on the C++ kernel; a backward over more
    # than MAX_BACKWARD_KEYS keys, float64, a head_dim that is not a multiple of 16 and more
    # than MAX_ROWS rows per KV head on the flash kernel.
    monkeypatch.setattr(cpu, "FORCE_PATH", None)
    ran: list[str] = []
    for module, name, fns in (
        (sdpa, "sdpa", ("forward", "backward")),
        (decode, "decode", ("attend", "backward_dense")),
    ):
        for fn in fns:
            original = getattr(module, fn)
            monkeypatch.setattr(
                module, fn, lambda *a, _o=original, _n=name, **k: ran.append(_n) or _o(*a, **k)
            )
    long_keys = decode.MAX_BACKWARD_KEYS + 1
    for shape, dtype, expected in (
        (Shape(2, 16, 16, 4, 2, 64), F32, ["decode", "decode"]),
        (Shape(1, 1, long_keys, 4, 1, 32), BF16, ["decode", "sdpa"]),
        (Shape(2, 16, 16, 4, 2, 64), F64, ["sdpa", "sdpa"]),
        (Shape(2, 16, 16, 4, 2, 40), F32, ["sdpa", "sdpa"]),
        (Shape(1, 33, 33, 4, 2, 32), F32, ["sdpa", "sdpa"]),
    ):
        ran.clear()
        case = dense_case(shape, Options(causal=True), dtype, "cpu")
        check_against_reference(case, "cpu", shape.id)
        assert ran == expected, f"{shape.id} {dtype}: ran {ran}, expected {expected}"
