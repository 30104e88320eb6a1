"""Option combinations, shapes and implementations the attention tests run over, and the
float64 reference comparison they share.

Tolerances. Every output of attention is a sum: out_i = sum_j P_ij v_j over the visible keys,
dv_j = sum_i P_ij dout_i over the queries (and the heads of a GQA group), dq_i = scale *
sum_j dS_ij k_j and dk_j = scale * sum_i dS_ij q_i with dS_ij = P_ij (dP_ij - D_i), dP_ij =
dout_i . v_j, D_i = dout_i . out_i. Fused kernels accumulate these sums in float32, but with
half-precision operands: P (and dS) are rounded to float16/bfloat16 before they meet V (K, Q)
in the matrix unit, and D_i is computed from the output already rounded to the dtype. Each
term then carries a relative error of up to u = 2^-8 (bf16) / 2^-11 (fp16), and in the worst
case these add up with one sign: the error of a sum is bounded by u times the sum of the
absolute values of its terms (its "magnitude" M below), not by u times the result, which can
cancel to much less. The comparison therefore allows

    rtol(dtype) * |expected|            (the final rounding of the output to the dtype)
  + 2u * max M = rtol(dtype) * max M    (half-precision operands, two roundings per term)
  + 4 sqrt(terms) 2^-24 max M           (float32 accumulation, assert_close's own term)

where M is computed exactly from the float64 reference: the attention probabilities P are
the reference's output for V = identity, and M_out = P |V|, M_dv = P^T |dout|, M_dq = scale
|dS| |K|, M_dk = scale |dS|^T |Q| (with a softcap, dS carries the cap's derivative
1 - tanh^2(raw score / softcap)). D_i computed from the kernel's rounded output is off by
exactly dD_i = dout_i . (out_i - out_ref_i), known once the forward ran; it shifts row i of
dS by P_ij dD_i, which adds scale dD_i (P K)_i to dq_i and scale sum_i P_ij dD_i q_i to dk_j
(allowed twice over). float32 inputs (a float32 P) get the float32 terms only; lse, a
float32 log-sum-exp of float32 scores, is compared with the float32 tolerance on the scale
of the largest score.

These are worst-case bounds: the CPU backend and the Triton kernels (interpreter) use up to
0.36 of them on random inputs, and a gradient scaled by 1.05 (bf16), 1.005 (fp16) or
1.001 (float32) fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.core import reference as R
from openkernels.shared import dispatch, replay
from openkernels.shared.dev.testing import (
    TOLERANCES,
    assert_close,
    poisoned_empty,
    random_tensor,
    testable_implementations,
)
from openkernels.shared.platform import triton_interpreting

HALF = (torch.float16, torch.bfloat16)
KERNEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# attention takes any multiple of 8 up to 256: these run padded tiles (8 -> 16, 40 -> 64, 200 -> 256)
PADDED_HEAD_DIMS = (8, 40, 200)
INTERPRETING = triton_interpreting()

# Window sizes that cut into sequences of 17..40 tokens from either side.
WINDOWS = {"": (-1, -1), "wl": (7, -1), "wr": (-1, 4), "w": (5, 3)}
SOFTCAP = 2.0  # small enough that tanh bends scores of N(0, 1)-ish size: the cap matters
SCALE = 0.3  # above 1/sqrt(head_dim) for every head_dim: peakier than the default


@dataclass(frozen=True)
class Options:
    """One combination of the public API's options."""

    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    alibi: str | None = None  # None, "heads": (heads_q,) slopes, "batch": (batch or n_seqs, heads_q)
    softcap: float = 0.0
    softmax_scale: float | None = None
    dropout: float = 0.0  # dropout_p; the seed comes from the case (Case.seed)

    @property
    def id(self) -> str:
        parts = ["causal"] if self.causal else []
        parts += [name for name, w in WINDOWS.items() if w == self.window and name]
        if self.window not in WINDOWS.values():
            parts.append(f"w{self.window[0]}_{self.window[1]}")
        if self.alibi:
            parts.append(f"alibi-{self.alibi}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.softmax_scale is not None:
            parts.append(f"scale{self.softmax_scale:g}")
        if self.dropout:
            parts.append(f"drop{self.dropout:g}")
        return "-".join(parts) or "plain"

    def scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    def slopes(self, n_seqs: int, heads: int, device: str) -> torch.Tensor | None:
        """Fresh positive slopes (float32, as the API requires), large enough to matter."""
        if self.alibi is None:
            return None
        shape = (heads,) if self.alibi == "heads" else (n_seqs, heads)
        return torch.rand(shape, device=device) * 0.9 + 0.1


def all_options() -> list[Options]:
    """Every combination: causal x window (none, left, right, both) x ALiBi (none, per head,
    per sequence) x softcap x softmax_scale. (causal with a right-only window is causal:
    causal overrides the right side.)"""
    return [
        Options(causal, window, alibi, softcap, scale)
        for causal, window, alibi, softcap, scale in itertools.product(
            (False, True), WINDOWS.values(), (None, "heads", "batch"), (0.0, SOFTCAP), (None, SCALE)
        )
    ]


# A dozen combinations that between them set every option value and the pairs that
# interact (causal with windows, ALiBi with windows and softcap): the interpreter's set.
FEW_OPTIONS = [
    Options(),
    Options(causal=True),
    Options(window=WINDOWS["wl"]),
    Options(window=WINDOWS["wr"]),
    Options(window=WINDOWS["w"], softmax_scale=SCALE),
    Options(causal=True, window=WINDOWS["wl"]),
    Options(causal=True, window=WINDOWS["w"], alibi="heads"),
    Options(alibi="batch", softcap=SOFTCAP),
    Options(softcap=SOFTCAP, softmax_scale=SCALE),
    Options(causal=True, alibi="heads", softcap=SOFTCAP, softmax_scale=SCALE),
    Options(window=WINDOWS["w"], alibi="batch", softcap=SOFTCAP),
    Options(causal=True, window=WINDOWS["wr"], alibi="batch", softmax_scale=SCALE),
]


def option_params(options: list[Options]) -> list:
    return [pytest.param(o, id=o.id) for o in options]


def targets():
    """(device, implementation) pairs testable in this process, with marks."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    params = []
    for device in devices:
        for impl in testable_implementations("attention", device):
            if impl in ("cudnn", "gluon"):  # plain calls only: test_cudnn.py / test_gluon.py make their own
                continue
            marks = [pytest.mark.interpreter] if INTERPRETING else []
            if device != "cpu":
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(device, impl, id=f"{device}-{impl}", marks=marks))
    return params


def runs_dtype(impl: str, dtype: torch.dtype) -> bool:
    """The Triton kernels take float16 and bfloat16; float32 and float64 go elsewhere."""
    return impl != "triton" or dtype in HALF


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def id(self) -> str:
        return f"b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-h{self.heads_q}_{self.heads_kv}-d{self.head_dim}"


def option_shapes(device: str) -> list[Shape]:
    """Shapes every option combination runs on: GQA, seqlen_q == / < / > seqlen_k, both head
    dims the interpreter takes. The interpreter runs each program in numpy: at most 40
    tokens and 2 query heads per K/V head there. Elsewhere one shape spans several key and
    query blocks of the kernels (blocks of 64 or 128), with ragged last blocks."""
    if INTERPRETING:
        return [Shape(2, 17, 17, 2, 1, 64), Shape(1, 17, 40, 2, 2, 32), Shape(2, 40, 23, 2, 1, 32)]
    shapes = [Shape(2, 17, 17, 4, 2, 64), Shape(1, 17, 40, 2, 1, 32), Shape(2, 40, 23, 2, 2, 64)]
    if device != "cpu":
        shapes.append(Shape(2, 200, 161, 4, 1, 128))
    return shapes


# ---- cases -------------------------------------------------------------------------------


@dataclass
class Case:
    """Inputs of one call: dense (q (B, Sq, Hq, D)) or varlen (packed q (Tq, Hq, D) and
    cu_seqlens), with the options and fresh ALiBi slopes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    options: Options
    alibi_slopes: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seed: int = 20261204  # of the generator the dropout seed is drawn from (Options.dropout)
    seed_words: torch.Tensor | None = None  # the Philox key itself, when another front end drew it (JAX)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def scale(self) -> float:
        return self.options.scale(self.q.shape[-1])

    @property
    def id(self) -> str:
        return f"{self.options.id} {str(self.dtype).removeprefix('torch.')} q{tuple(self.q.shape)} k{tuple(self.k.shape)}"

    def kwargs(self) -> dict:
        o = self.options
        kw = dict(causal=o.causal, softmax_scale=o.softmax_scale, window=o.window, alibi_slopes=self.alibi_slopes,
                  softcap=o.softcap)  # fmt: skip
        if o.dropout:
            kw["dropout_p"] = o.dropout
        return kw

    def generator(self) -> torch.Generator:
        """A generator in the state the call draws its dropout seed from."""
        return torch.Generator(device=self.q.device).manual_seed(self.seed)

    def dropout_seed(self) -> torch.Tensor:
        """The seed `attention` draws from `generator()` (api._dropout_seed), for the reference."""
        if self.seed_words is not None:
            return self.seed_words
        return torch.randint(-(2**31), 2**31, (2,), dtype=torch.int32, device=self.q.device,
                             generator=self.generator())  # fmt: skip

    def call(self, q=None, k=None, v=None, **overrides):
        """The public function with return_lse=True -> (out, lse)."""
        q, k, v = (self.q if q is None else q), (self.k if k is None else k), (self.v if v is None else v)
        kw = {**self.kwargs(), **overrides}
        if kw.get("dropout_p"):
            kw.setdefault("generator", self.generator())
        if self.varlen:
            return A.attention_varlen(q, k, v, self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q,
                                      self.max_seqlen_k, return_lse=True, **kw)  # fmt: skip
        return A.attention(q, k, v, return_lse=True, **kw)

    def reference(self, q, k, v, **overrides):
        """The reference (in the compute dtype of q: float64 for float64 copies) -> (out, lse)."""
        kw = {**self.kwargs(), **overrides}
        if kw.get("dropout_p"):
            kw.setdefault("dropout_seed", self.dropout_seed())
        if self.varlen:
            return R.attention_varlen_ref(
                q, k, v, self.cu_seqlens_q, self.cu_seqlens_k, return_lse=True, **kw
            )
        return R.attention_ref(q, k, v, return_lse=True, **kw)

    def library_args(self) -> tuple:
        """Arguments of torch.ops.openkernels.attention after q, k, v."""
        o = self.options
        left, right = o.window[0], 0 if o.causal else o.window[1]
        max_q = self.max_seqlen_q if self.varlen else self.q.shape[1]
        max_k = self.max_seqlen_k if self.varlen else self.k.shape[1]
        seed = self.dropout_seed() if o.dropout else None
        return (self.cu_seqlens_q, self.cu_seqlens_k, max_q, max_k, self.scale, left, right, self.alibi_slopes,
                o.softcap, o.dropout, seed)  # fmt: skip


def dense_case(shape: Shape, options: Options, dtype: torch.dtype, device: str, *, grad: bool = True,
               scale: float = 1.0) -> Case:  # fmt: skip
    """Fresh N(0, scale) q, k, v of `shape` (B, S, H, D)."""
    b, sq, sk, hq, hkv, d = dataclasses.astuple(shape)
    return Case(
        random_tensor((b, sq, hq, d), dtype, device, scale=scale, requires_grad=grad),
        random_tensor((b, sk, hkv, d), dtype, device, scale=scale, requires_grad=grad),
        random_tensor((b, sk, hkv, d), dtype, device, requires_grad=grad),
        options,
        options.slopes(b, hq, device),
    )


def nan_case(what: str, options: Options, dtype: torch.dtype, device: str) -> tuple[Case, torch.Tensor]:
    """A (2, 17, 17, 4, 2, 64) case with one NaN at [1, 3, 1, 7] of q, k or v (`what`), and
    where that NaN must spread in the output (a CPU bool mask): from q, its row only; from
    k, every row of its K/V head's group (query heads 2, 3); from v, that column of those rows."""
    case = dense_case(Shape(2, 17, 17, 4, 2, 64), options, dtype, device, grad=False)
    x = getattr(case, what).clone()
    x[1, 3, 1, 7] = float("nan")
    setattr(case, what, x)
    expected = torch.zeros(case.q.shape, dtype=torch.bool)
    if what == "q":
        expected[1, 3, 1] = True
    elif what == "k":
        expected[1, :, 2:4] = True
    else:
        expected[1, :, 2:4, 7] = True
    return case, expected


def cu_seqlens(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def varlen_case(lens_q: list[int], lens_k: list[int], heads_q: int, heads_kv: int, head_dim: int,
                options: Options, dtype: torch.dtype, device: str, *, grad: bool = True) -> Case:  # fmt: skip
    tq, tk = sum(lens_q), sum(lens_k)
    return Case(
        random_tensor((tq, heads_q, head_dim), dtype, device, requires_grad=grad),
        random_tensor((tk, heads_kv, head_dim), dtype, device, requires_grad=grad),
        random_tensor((tk, heads_kv, head_dim), dtype, device, requires_grad=grad),
        options,
        options.slopes(len(lens_q), heads_q, device),
        cu_seqlens(lens_q, device),
        cu_seqlens(lens_k, device),
        max(lens_q, default=0),
        max(lens_k, default=0),
    )


# ---- comparison --------------------------------------------------------------------------


def assert_attention_close(
    actual, expected, *, dtype: torch.dtype, magnitude: float, terms: int, msg: str, extra: float = 0.0
):
    """assert_close for a sum of `terms` products whose absolute values add up to at most
    `magnitude` (see the module docstring): half-precision operands add rtol(dtype) *
    magnitude to atol, and `extra` (an absolute error known otherwise) is added as well,
    both expressed in assert_close's float32 sum term (4 sqrt(terms) 2^-24 max(|expected|,
    term_scale))."""
    unit = 4 * math.sqrt(terms) * 2.0**-24
    rounding = TOLERANCES[dtype].rtol * magnitude if dtype in HALF else 0.0
    term_scale = magnitude + (rounding + extra) / unit
    assert_close(actual, expected, dtype=dtype, terms=terms, term_scale=term_scale, msg=msg)


def _four_d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    return t.unsqueeze(0) if varlen else t


def probabilities(case: Case, q64: torch.Tensor, k64: torch.Tensor) -> torch.Tensor:
    """The attention probabilities (B, Sq, Hq, Sk) in float64, from the reference itself:
    its output for V = identity (rows with no visible key are 0)."""
    kw = case.kwargs()
    kw.pop("alibi_slopes")
    kw.pop("dropout_p", None)  # the softmax's own; _magnitudes bounds dropout's scaling

    def dense(q, k, slopes):  # q (B, Sq, Hq, D), k (B, Sk, Hkv, D) -> (B, Sq, Hq, Sk)
        sk, hkv = k.shape[1], k.shape[2]
        eye = torch.eye(sk, dtype=torch.float64, device=k.device)[None, :, None, :]
        return R.attention_ref(q, k, eye.expand(k.shape[0], sk, hkv, sk), alibi_slopes=slopes, **kw)

    with torch.no_grad():
        if not case.varlen:
            return dense(q64, k64, case.alibi_slopes)
        # Varlen: block-diagonal, one dense call per sequence (sequences without queries or
        # keys leave their block 0).
        p = q64.new_zeros(1, q64.shape[0], q64.shape[1], k64.shape[0])
        cq, ck = case.cu_seqlens_q.tolist(), case.cu_seqlens_k.tolist()
        for i in range(len(cq) - 1):
            if cq[i] == cq[i + 1] or ck[i] == ck[i + 1]:
                continue
            slopes = case.alibi_slopes
            if slopes is not None and slopes.dim() == 2:
                slopes = slopes[i : i + 1]
            p[:, cq[i] : cq[i + 1], :, ck[i] : ck[i + 1]] = dense(
                q64[None, cq[i] : cq[i + 1]], k64[None, ck[i] : ck[i + 1]], slopes
            )
        return p


def _magnitudes(case, P, q, k, v, out_ref, out, dout) -> dict[str, tuple[float, float]]:
    """name -> (max M, extra absolute error) of out, dq, dk, dv (module docstring); every
    tensor float64 and 4D; out is the kernel's own (rounded) output."""
    group = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)

    def per_kv_head(t):  # (B, Sk, Hq, D) -> (B, Sk, Hkv, D): a GQA group's heads add up
        return t.unflatten(2, (k.shape[2], group)).sum(3)

    def top(t):  # NaN inputs (the NaN test) give NaN in their rows: the finite rows set the scale
        return float(t.nan_to_num(0.0, 0.0, 0.0).max()) if t.numel() else 0.0

    # Dropout scales each kept probability by 1 / (1 - p): bound every term by that factor.
    factor = 1.0 / (1.0 - case.options.dropout)
    m = {"out": (top(torch.einsum("bqhk,bkhd->bqhd", P * factor, vx.abs())), 0.0)}
    if dout is None:
        return m
    m["dv"] = (top(per_kv_head(torch.einsum("bqhk,bqhd->bkhd", P * factor, dout.abs()))), 0.0)
    dP = torch.einsum("bqhd,bkhd->bqhk", dout, vx)
    D = (dout * out_ref).sum(-1, keepdim=True)
    # The kernel's D_i = dout_i . out_i uses its own output: off by exactly dout_i . (out_i -
    # out_ref_i), plus float32 rounding of the sum.
    dD = (dout * (out - out_ref)).sum(-1, keepdim=True).abs() + 2.0**-22 * (dout.abs() * out.abs()).sum(
        -1, keepdim=True
    )
    if case.options.softcap:  # the cap's derivative 1 - tanh^2 scales dS (and its errors)
        raw = case.scale * torch.einsum("bqhd,bkhd->bqhk", q, kx)
        P = P * (1 - torch.tanh(raw / case.options.softcap) ** 2)
    dS = P * (dP - D).abs() if factor == 1.0 else P * (dP.abs() * factor + D.abs())
    # D_i's error shifts row i of dS by P_ij dD_i: in dq_i that is dD_i (P K)_i exactly. (2x:
    # a margin on an error that is known, not bounded.)
    m["dq"] = (
        top(case.scale * torch.einsum("bqhk,bkhd->bqhd", dS, kx.abs())),
        2 * top(case.scale * dD * torch.einsum("bqhk,bkhd->bqhd", P, kx).abs()),
    )
    m["dk"] = (
        top(case.scale * per_kv_head(torch.einsum("bqhk,bqhd->bkhd", dS, q.abs()))),
        2 * top(case.scale * per_kv_head(torch.einsum("bqhk,bqhd->bkhd", P * dD, q.abs()))),
    )
    return m


def score_bound(case: Case) -> float:
    """A bound on |score| (before the cap): scale * max ||q_i||_1 * max |k| + ALiBi's largest
    bias; lse's float32 error is relative to it."""
    q, k = case.q.detach().double(), case.k.detach().double()
    if not q.numel() or not k.numel():
        return 0.0
    q, k = q.nan_to_num(0.0, 0.0, 0.0), k.nan_to_num(0.0, 0.0, 0.0)
    bound = case.scale * float(q.abs().sum(-1).max()) * float(k.abs().max())
    if case.alibi_slopes is not None:
        span = case.max_seqlen_q + case.max_seqlen_k if case.varlen else q.shape[1] + k.shape[1]
        bound += float(case.alibi_slopes.max()) * span
    return bound


def run(case: Case, impl: str, *, backward: bool = True, dout: torch.Tensor | None = None):
    """The public function under `impl` with poisoned outputs -> (out, lse, grads or None, dout)."""
    with dispatch.force(impl), poisoned_empty():
        out, lse = case.call()
        grads = None
        if backward:
            if dout is None:
                dout = random_tensor(tuple(out.shape), out.dtype, str(out.device))
            grads = torch.autograd.grad(out, (case.q, case.k, case.v), dout)
    return out, lse, grads, dout


def check_against_reference(case: Case, impl: str, msg: str = "", *, backward: bool = True) -> None:
    """out, lse and the gradients of sum(out * dout) against the reference in float64."""
    msg = f"{msg} {case.id}".strip()
    out, lse, grads, dout = run(case, impl, backward=backward)
    compare(case, out, lse, grads, dout, msg)


def compare(case: Case, out, lse, grads, dout, msg: str) -> None:
    dtype = case.dtype
    acc = R.compute_dtype(dtype)
    assert out.dtype == dtype and out.shape == case.q.shape, f"{msg}: out {out.dtype} {tuple(out.shape)}"
    assert lse.dtype == acc, f"{msg}: lse dtype {lse.dtype}"
    assert not lse.requires_grad, f"{msg}: lse must be non-differentiable"

    leaves = [
        t.detach().to(torch.float64).requires_grad_(grads is not None) for t in (case.q, case.k, case.v)
    ]
    out_ref, lse_ref = case.reference(*leaves)
    grads_ref = None
    if grads is not None:
        grads_ref = torch.autograd.grad(out_ref, leaves, dout.double(), allow_unused=True)
        grads_ref = [torch.zeros_like(x) if g is None else g for g, x in zip(grads_ref, leaves)]

    P = probabilities(case, leaves[0].detach(), leaves[1].detach())
    q64, k64, v64 = (_four_d(t.detach(), case.varlen) for t in leaves)
    out64 = _four_d(out_ref.detach(), case.varlen)
    dout64 = None if grads is None else _four_d(dout.double(), case.varlen)
    got64 = _four_d(out.detach().to(out64), case.varlen)
    mags = _magnitudes(case, P, q64, k64, v64, out64, got64, dout64)

    sq = case.max_seqlen_q if case.varlen else case.q.shape[1]
    sk = case.max_seqlen_k if case.varlen else case.k.shape[1]
    d = case.q.shape[-1]
    group = case.q.shape[-2] // case.k.shape[-2]
    m_out, _ = mags["out"]
    assert_attention_close(out, out_ref, dtype=dtype, magnitude=m_out, terms=sk + d, msg=f"{msg} out")
    assert_close(lse, lse_ref, dtype=acc, terms=sk + d, term_scale=score_bound(case), msg=f"{msg} lse")
    # Rows that see no key: exactly 0 and -inf, whatever the kernel's blocking.
    empty = torch.isneginf(lse_ref).cpu()
    if empty.any():
        lse_c = lse.detach().cpu()
        assert torch.isneginf(lse_c[empty]).all(), f"{msg}: lse of rows with no visible key must be -inf"
        rows = empty.transpose(-1, -2) if case.varlen else empty.transpose(1, 2)
        assert (out.detach().cpu()[rows] == 0).all(), f"{msg}: rows with no visible key must be 0"
    if grads is None:
        return
    for name, g, g_ref, x, terms in (
        ("dq", grads[0], grads_ref[0], case.q, sk + d),
        ("dk", grads[1], grads_ref[1], case.k, sq * group + d),
        ("dv", grads[2], grads_ref[2], case.v, sq * group + d),
    ):
        assert g.dtype == x.dtype and g.shape == x.shape, f"{msg}: {name} {g.dtype} {tuple(g.shape)}"
        magnitude, extra = mags[name]
        assert_attention_close(
            g, g_ref, dtype=dtype, magnitude=magnitude, terms=terms, extra=extra, msg=f"{msg} {name}"
        )


# ---- dispatch spy ------------------------------------------------------------------------


@contextlib.contextmanager
def recording_implementation(op: str, name: str) -> Iterator[list[tuple]]:
    """Inside the block every call of implementation `name` of `op` is recorded (its
    positional arguments) and then run; the registry is restored afterwards."""
    impls = dispatch._op(op).impls
    index = next(i for i, impl in enumerate(impls) if impl.name == name)
    original = impls[index]
    calls: list[tuple] = []

    def record(*args, **kwargs):
        calls.append(args)
        return original.fn(*args, **kwargs)

    impls[index] = dataclasses.replace(original, fn=record)
    dispatch.changed()
    try:
        with replay.disabled():  # a replayed call would not run the implementation's Python
            yield calls
    finally:
        impls[index] = original
        dispatch.changed()
