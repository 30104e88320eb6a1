"""apply_rotary against the float64 reference and against transformers' apply_rotary_pos_emb
written out in torch, for every implementation (the Triton kernel under the interpreter):
forward and backward, odd shapes (seqlen 1, 7, 33; GQA/MQA 3/1; head_dim 64, 80, 96, 128;
partial rotary), cos/sin with and without a batch dim and in other dtypes, non-contiguous
views (q and k sliced out of a fused qkv projection), NaN and inf, empty inputs, every launch
config the heuristic picks; gradcheck in float64; torch.compile and opcheck; bad input.

Tolerance. Each output element is x1 c1 - x2 s1 (or x2 c2 + x1 s2, or a copy) of inputs exact
in float32, computed in float32 and rounded once to the dtype: within half an ulp of the
result (the table's rtol is one ulp), plus the float32 rounding of two products and a sum
(a fused multiply-add rounds once less), at most 3 * 2^-24 (|x1 c1| + |x2 s1|): assert_close's
`term_scale` term with `terms=2` allows 5.6 * 2^-24 times the largest such magnitude. The
gradients are the same expressions (with -s2, -s1), the same bound.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import pytest
import torch

import openkernels.attention as A
from openkernels.attention.rotary import reference as R
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import (
    assert_close,
    failing_implementation,
    poisoned_empty,
    random_tensor,
    run_opcheck,
)
from openkernels.shared.dev.testing import testable_implementations as _testable  # not collected as a test
from openkernels.shared.dispatch import DispatchKey
from openkernels.shared.platform import triton_interpreting

from .cases import recording_implementation

INTERPRETING = triton_interpreting()
BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
OPS = ("apply_rotary", "apply_rotary_backward")
# A second device for mismatch errors: a GPU when there is one, else meta.
OTHER = "cuda:0" if torch.cuda.is_available() else "meta"


CPU_TORCH_OPS = "cpu-torch-ops"


def _targets():
    """(device, implementation) pairs testable in this process, with marks."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    params = []
    for device in devices:
        for impl in _testable("apply_rotary", device):
            marks = [pytest.mark.interpreter] if INTERPRETING else []
            if device != "cpu":
                marks.append(pytest.mark.gpu)
            params.append(pytest.param(device, impl, id=f"{device}-{impl}", marks=marks))
    # The CPU backend's torch ops (where no compiler builds rotary.cpp): `_force` pins them.
    params.append(pytest.param("cpu", CPU_TORCH_OPS, id=f"cpu-{CPU_TORCH_OPS}"))
    return params


TARGETS = _targets()
_no_interpreter = pytest.mark.skipif(INTERPRETING, reason="runs once, outside the interpreter")


@contextlib.contextmanager
def _force(impl: str):
    """Pin `impl` (CPU_TORCH_OPS: the CPU backend without its C++ kernel, replay off so that no
    entry recorded on the kernel replays)."""
    if impl != CPU_TORCH_OPS:
        with dispatch.force(*(f"{op}:{impl}" for op in OPS)):
            yield
        return
    from openkernels.attention.rotary import cpu as rotary
    from openkernels.shared import replay

    saved, rotary.FORCE_TORCH = rotary.FORCE_TORCH, True
    try:
        with dispatch.force(*(f"{op}:cpu" for op in OPS)), replay.disabled():
            yield
    finally:
        rotary.FORCE_TORCH = saved


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    heads_q: int
    heads_k: int
    head_dim: int
    rot_dim: int
    table: str = "batch"  # cos/sin (batch, S, R), "one": (1, S, R), "none": (S, R)

    @property
    def id(self) -> str:
        return (f"b{self.batch}-s{self.seqlen}-h{self.heads_q}_{self.heads_k}-d{self.head_dim}-r{self.rot_dim}"
                f"-{self.table}")  # fmt: skip

    def table_shape(self) -> tuple[int, ...]:
        lead = {"batch": (self.batch,), "one": (1,), "none": ()}[self.table]
        return (*lead, self.seqlen, self.rot_dim)


SHAPES = [
    Shape(2, 1, 3, 1, 64, 64),  # decode: seqlen 1, MQA 3 / 1
    Shape(2, 7, 3, 1, 96, 96, "none"),
    Shape(1, 33, 4, 2, 128, 64),  # partial rotary R = D / 2
    Shape(2, 33, 3, 1, 128, 128, "one"),  # transformers' default position_ids: (1, S, R) tables
    Shape(2, 7, 2, 2, 64, 32, "one"),
    Shape(1, 7, 3, 1, 96, 48, "none"),  # halves of 24: padded tiles
    Shape(1, 5, 2, 1, 80, 32),  # Phi-2: 32 of 80 rotate
]


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        return R.apply_rotary_ref(*(t.detach().double() for t in (self.q, self.k, self.cos, self.sin)))

    def magnitude(self) -> float:
        """Bound on |x1 c1| + |x2 s1| over all elements (the float32 sum's terms)."""
        x = max(_largest(self.q), _largest(self.k), 1.0)
        return x * (_largest(self.cos) + _largest(self.sin))


def _largest(t: torch.Tensor) -> float:
    """max |t| over the finite elements (0 for none)."""
    t = t.detach().double()
    return float(t.nan_to_num(0.0, 0.0, 0.0).abs().max()) if t.numel() else 0.0


def _inputs(shape: Shape, dtype: torch.dtype, device: str, table_dtype: torch.dtype | None = None) -> Inputs:
    """Fresh random q, k and tables. The tables are random too, not cos and sin of angles:
    the four halves c1, c2, s1, s2 all differ, so a kernel that mixes them up fails."""
    q = random_tensor((shape.batch, shape.seqlen, shape.heads_q, shape.head_dim), dtype, device)
    k = random_tensor((shape.batch, shape.seqlen, shape.heads_k, shape.head_dim), dtype, device)
    table_dtype = table_dtype or dtype
    return Inputs(q, k, random_tensor(shape.table_shape(), table_dtype, device),
                  random_tensor(shape.table_shape(), table_dtype, device))  # fmt: skip


def _check(inputs: Inputs, out: tuple, msg: str, ref=None) -> None:
    ref = ref or inputs.reference()
    for name, got, want in zip(("q_out", "k_out"), out, ref):
        assert_close(
            got, want, dtype=inputs.q.dtype, terms=2, term_scale=inputs.magnitude(), msg=f"{msg} {name}"
        )


def _run(inputs: Inputs, impl: str, grads: tuple | None = None):
    """Outputs (and, given output gradients, the input gradients) under `impl`, outputs
    poisoned before the kernels run."""
    q, k = (t.detach().clone().requires_grad_(grads is not None) for t in (inputs.q, inputs.k))
    with _force(impl), poisoned_empty():
        out = A.apply_rotary(q, k, inputs.cos, inputs.sin)
        if grads is None:
            return out, None
        return out, torch.autograd.grad(out, (q, k), grads)


def _reference_grads(inputs: Inputs, grads: tuple) -> tuple:
    q, k = (t.detach().double().requires_grad_() for t in (inputs.q, inputs.k))
    out = R.apply_rotary_ref(q, k, inputs.cos.double(), inputs.sin.double())
    return torch.autograd.grad(out, (q, k), tuple(g.double() for g in grads))


def _dtypes(impl: str) -> list:
    return [BF16, F16, F32] + ([] if impl == "triton" else [F64])


# ---- against the reference ----------------------------------------------------------------


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("shape", [pytest.param(s, id=s.id) for s in SHAPES])
@pytest.mark.parametrize("dtype", [BF16, F16, F32, F64], ids=str)
def test_matches_reference(device: str, impl: str, shape: Shape, dtype: torch.dtype) -> None:
    if dtype not in _dtypes(impl):
        pytest.skip("the Triton kernel takes float16, bfloat16, float32 (test_explain_names_the_choice)")
    inputs = _inputs(shape, dtype, device)
    grads = tuple(random_tensor(tuple(t.shape), dtype, device) for t in (inputs.q, inputs.k))
    out, got = _run(inputs, impl, grads)
    _check(inputs, out, "forward")
    for name, g, want in zip(("dq", "dk"), got, _reference_grads(inputs, grads)):
        scale = max(_largest(grads[0]), _largest(grads[1]), 1.0) / max(
            _largest(inputs.q), _largest(inputs.k), 1.0
        )
        assert_close(
            g, want, dtype=dtype, terms=2, term_scale=inputs.magnitude() * scale, msg=f"backward {name}"
        )
    for t, name in ((out[0], "q_out"), (out[1], "k_out"), (got[0], "dq"), (got[1], "dk")):
        assert t.is_contiguous() and t.dtype == dtype, f"{name}: a new contiguous {dtype} tensor"


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize(
    ("dtype", "table_dtype"), [(BF16, F32), (F16, BF16), (F32, BF16), (BF16, F64)], ids=lambda d: str(d)[6:]
)
def test_table_dtypes(device: str, impl: str, dtype, table_dtype) -> None:
    # cos and sin of any float dtype, converted to float32 before the math.
    inputs = _inputs(Shape(2, 7, 3, 1, 64, 64), dtype, device, table_dtype)
    out, _ = _run(inputs, impl)
    _check(inputs, out, f"{table_dtype} tables")


@pytest.mark.parametrize(("device", "impl"), TARGETS)
def test_noncontiguous_views(device: str, impl: str) -> None:
    # q, k, v sliced out of a fused qkv projection (B, S, (Hq + 2 Hk) D): head strides D, token
    # strides (Hq + 2 Hk) D; the (B, H, S, D) layout transposed; tables sliced out of wider
    # rows and longer caches; last dims that are not unit stride (copied first).
    b, s, hq, hk, d, r = 2, 7, 3, 1, 64, 64
    qkv = random_tensor((b, s, (hq + 2 * hk) * d), BF16, device)
    fused = (qkv[..., : hq * d].view(b, s, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d))
    transposed = (random_tensor((b, hq, s, d), BF16, device).transpose(1, 2),
                  random_tensor((b, hk, s, d), BF16, device).transpose(1, 2))  # fmt: skip
    strided_last = (random_tensor((b, s, d, hq), BF16, device).transpose(2, 3),
                    random_tensor((b, s, d, hk), BF16, device).transpose(2, 3))  # fmt: skip
    tables = {
        "contiguous": lambda: random_tensor((b, s, r), BF16, device),
        "wide-rows": lambda: random_tensor((b, s, r + 6), BF16, device)[..., 3 : 3 + r],
        "cache-prefix": lambda: random_tensor((s + 5, r), F32, device)[2 : 2 + s],
        "strided-last": lambda: random_tensor((r, s), F32, device).t(),
    }
    for (name, (q, k)), (table, make) in zip(
        (
            ("fused-qkv", fused),
            ("transposed", transposed),
            ("strided-last", strided_last),
            ("fused-qkv", fused),
        ),
        tables.items(),
    ):
        inputs = Inputs(q, k, make(), make())
        before = [t.clone() for t in (q, k, inputs.cos, inputs.sin)]
        grads = tuple(random_tensor(tuple(t.shape), BF16, device) for t in (q, k))
        out, got = _run(inputs, impl, grads)
        _check(inputs, out, f"{name} q/k, {table} tables")
        for g, want in zip(got, _reference_grads(inputs, grads)):
            assert_close(
                g, want, dtype=BF16, terms=2, term_scale=inputs.magnitude() * 4, msg=f"{name} backward"
            )
        for a, b_ in zip((q, k, inputs.cos, inputs.sin), before):
            assert torch.equal(a, b_), "the inputs are not written"
    # Gradients reach the fused projection output through the views.
    base = qkv.detach().clone().requires_grad_()
    q, k = base[..., : hq * d].view(b, s, hq, d), base[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    cos, sin = random_tensor((s, r), BF16, device), random_tensor((s, r), BF16, device)
    with _force(impl):
        q_out, k_out = A.apply_rotary(q, k, cos, sin)
    (q_out.float().square().sum() + k_out.float().sum()).backward()
    base64 = qkv.detach().double().requires_grad_()
    q64, k64 = base64[..., : hq * d].view(b, s, hq, d), base64[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    rq, rk = R.apply_rotary_ref(q64, k64, cos.double(), sin.double())
    ((q_out.double().detach() * 2 * rq).sum() + rk.sum()).backward()  # the same loss's gradient
    assert_close(
        base.grad, base64.grad, dtype=BF16, terms=2, term_scale=50.0, msg="gradient of the fused qkv"
    )
    assert (base.grad[..., (hq + hk) * d :] == 0).all(), "v's part of the projection gets no gradient"


# ---- transformers' formula --------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (Llama), on (B, H, S, D) q and k and (B, S, R)
    tables, with the partial-rotary split of GPT-NeoX / Phi when R < D."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_rot, q_pass, k_rot, k_pass = q[..., :r], q[..., r:], k[..., :r], k[..., r:]
    q_embed = (q_rot * cos) + (_rotate_half(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate_half(k_rot) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def _hf_tables(batch: int, seqlen: int, rot_dim: int, dtype, device, base: float = 10000.0, offset: int = 0):
    """LlamaRotaryEmbedding's cos and sin (B, S, R) for positions offset.. (float32 math, then
    the dtype, as transformers does)."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device=device).float() / rot_dim)
    )
    positions = torch.arange(offset, offset + seqlen, device=device).float()[None].expand(batch, -1)
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("rot", ["full", "partial"])
def test_matches_transformers_formula(device: str, impl: str, rot: str) -> None:
    b, s, hq, hk, d = 2, 33, 4, 2, 64
    r = d if rot == "full" else d // 2
    cos, sin = _hf_tables(b, s, r, BF16, device, offset=1000)  # late positions: fast-turning angles
    q, k = random_tensor((b, s, hq, d), BF16, device), random_tensor((b, s, hk, d), BF16, device)
    # The same numbers in float64: transformers' formula equals the reference's semantics.
    q64, k64, c64, s64 = (t.double() for t in (q, k, cos, sin))
    hq64, hk64 = _hf_apply_rotary_pos_emb(q64.transpose(1, 2), k64.transpose(1, 2), c64, s64)
    ref_q, ref_k = R.apply_rotary_ref(q64, k64, c64, s64)
    assert_close(hq64.transpose(1, 2), ref_q, dtype=F64, msg="transformers' q")
    assert_close(hk64.transpose(1, 2), ref_k, dtype=F64, msg="transformers' k")
    # In bfloat16 transformers rounds each product and the sum (three roundings); ours rounds
    # once: within transformers' own error of it, and closer to the exact result on average.
    with _force(impl):
        ours = A.apply_rotary(q, k, cos, sin)
    theirs = _hf_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    u = 2.0**-8  # bfloat16's unit roundoff
    for name, x, o, t, ref in zip(("q", "k"), (q, k), ours, theirs, (ref_q, ref_k)):
        xt = x.transpose(1, 2).double()
        c, sn = cos[:, None].double().abs(), sin[:, None].double().abs()
        terms = torch.cat(
            (xt[..., :r].abs() * c + _rotate_half(xt[..., :r]).abs() * sn, xt[..., r:].abs()), -1
        )
        bound = (2 * u * terms + 2 * u * ref.transpose(1, 2).abs()).transpose(1, 2)
        gap = (o.double() - t.transpose(1, 2).double()).abs()
        assert (gap <= bound).all(), f"{name}: {float((gap - bound).max())} past transformers' own rounding"
        ours_err = (o.double() - ref).abs().mean()
        theirs_err = (t.transpose(1, 2).double() - ref).abs().mean()
        assert ours_err < theirs_err, f"{name}: one rounding ({ours_err:.3g}) vs three ({theirs_err:.3g})"


# ---- NaN, inf, empty ----------------------------------------------------------------------


@pytest.mark.parametrize(("device", "impl"), TARGETS)
def test_nan_and_inf_propagate(device: str, impl: str) -> None:
    # A NaN in x reaches its element and its rotation partner (x1 <-> x2) and nothing else; a
    # NaN table entry reaches the element it multiplies in every head of its token; inf as the
    # arithmetic has it (inf * 0 = NaN where a table entry is 0).
    shape = Shape(2, 7, 3, 1, 64, 32)
    inputs = _inputs(shape, BF16, device)
    q, k, cos, sin = (t.clone() for t in (inputs.q, inputs.k, inputs.cos, inputs.sin))
    q[0, 1, 2, 3] = float("nan")  # first half: partner 3 + 16
    q[1, 6, 0, 20] = float("nan")  # second half: partner 4
    q[1, 2, 1, 40] = float("nan")  # the copied rest
    k[0, 3, 0, 5] = float("inf")
    sin[0, 3, 5 + 16] = 0.0  # inf * 0 in k's second half
    cos[1, 4, 7] = float("nan")
    inputs = Inputs(q, k, cos, sin)
    grads = tuple(random_tensor(tuple(t.shape), BF16, device) for t in (q, k))
    grads[0][0, 5, 1, 9] = float("nan")
    out, got = _run(inputs, impl, grads)
    _check(inputs, out, "forward")  # NaN / inf at the reference's places, values elsewhere
    nan_q = torch.isnan(out[0]).nonzero().tolist()
    expected = {(0, 1, 2, 3), (0, 1, 2, 19), (1, 6, 0, 20), (1, 6, 0, 4), (1, 2, 1, 40)}
    expected |= {(1, 4, h, 7) for h in range(3)}  # c1 meets x1 only
    assert {tuple(i) for i in nan_q} == expected
    assert torch.isinf(out[1][0, 3, 0, 5]) and torch.isnan(out[1][0, 3, 0, 5 + 16])
    for g, want in zip(got, _reference_grads(inputs, grads)):
        assert_close(g, want, dtype=BF16, terms=2, term_scale=100.0, msg="backward")
    assert torch.isnan(got[0][0, 5, 1, 9]) and torch.isnan(got[0][0, 5, 1, 9 + 16])


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("shape", [(0, 7, 3, 1), (2, 0, 3, 1), (2, 7, 0, 1), (2, 7, 3, 0)], ids=str)
def test_empty(device: str, impl: str, shape) -> None:
    b, s, hq, hk = shape
    q = random_tensor((b, s, hq, 64), BF16, device, requires_grad=True)
    k = random_tensor((b, s, hk, 64), BF16, device, requires_grad=True)
    table = random_tensor((s, 64), BF16, device)
    with _force(impl), poisoned_empty():
        q_out, k_out = A.apply_rotary(q, k, table, table)
        (q_out.float().sum() + k_out.float().sum()).backward()
    assert q_out.shape == q.shape and k_out.shape == k.shape
    if k.numel():
        inputs = Inputs(q.detach(), k.detach(), table, table)
        _check(inputs, (q_out, k_out), "k alone")
        assert not torch.isnan(k.grad).any()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


# ---- every launch config (Triton) --------------------------------------------------------


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx942", "tiny"])
def test_triton_launch_configs(device: str, impl: str, arch: str) -> None:
    # The GPU configs (head blocks up to 64 heads, up to 16 tokens per program) and the
    # smallest one, through the launcher on shapes that leave ragged token blocks and head
    # loops of several steps: forward and backward against the reference.
    if impl != "triton":
        pytest.skip("the launch configs are the Triton kernel's")
    from openkernels.attention.rotary import triton as launcher
    from openkernels.attention.rotary.triton.configs import RotaryConfig, rotary_config

    for shape in (Shape(3, 7, 5, 3, 64, 64), Shape(1, 5, 2, 1, 80, 32), Shape(1, 17, 1, 1, 64, 32, "one")):
        cfg = (
            RotaryConfig(1, 1, 1, 4)
            if arch == "tiny"
            else rotary_config(shape.head_dim, shape.rot_dim, shape.heads_q, shape.heads_k, arch)
        )
        inputs = _inputs(shape, BF16, device)
        cos, sin = inputs.cos if inputs.cos.dim() == 3 else inputs.cos[None], inputs.sin
        sin = sin if sin.dim() == 3 else sin[None]
        for backward, entry in ((False, launcher.apply_rotary_fwd), (True, launcher.apply_rotary_bwd)):
            with poisoned_empty():
                out = (torch.empty_like(inputs.q), torch.empty_like(inputs.k))
            entry(inputs.q, inputs.k, cos, sin, *out, config=cfg)
            q64, k64, c64, s64 = (t.double() for t in (inputs.q, inputs.k, cos, sin))
            ref = (R._rotate_half(q64, c64, s64, backward), R._rotate_half(k64, c64, s64, backward))
            _check(inputs, out, f"{cfg} backward={backward}", ref)


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("chunk", [1, 100, 2**18])
def test_cpu_token_chunks(device: str, impl: str, chunk: int, monkeypatch) -> None:
    # The CPU path works through the tokens in chunks of about CHUNK_ELEMENTS: one token at a
    # time, several with a ragged last chunk, and all at once.
    if impl != CPU_TORCH_OPS:
        pytest.skip("the chunks are the CPU backend's torch ops'")
    from openkernels.attention.rotary import cpu as rotary

    monkeypatch.setattr(rotary, "CHUNK_ELEMENTS", chunk)
    for shape in (Shape(2, 33, 3, 1, 96, 48, "one"), Shape(1, 7, 2, 2, 64, 64)):
        inputs = _inputs(shape, BF16, device)
        grads = tuple(random_tensor(tuple(t.shape), BF16, device) for t in (inputs.q, inputs.k))
        out, got = _run(inputs, impl, grads)
        _check(inputs, out, f"chunks of {chunk}")
        for g, want in zip(got, _reference_grads(inputs, grads)):
            assert_close(
                g, want, dtype=BF16, terms=2, term_scale=inputs.magnitude() * 4, msg=f"chunks of {chunk}"
            )


# ---- gradcheck, torch.compile, opcheck ---------------------------------------------------


@_no_interpreter
def test_gradcheck_float64() -> None:
    # The reference's formula, the library op and the public function (their backward is the
    # transposed rotation, written out, not autograd of the forward) in float64.
    q = random_tensor((2, 3, 3, 8), F64, requires_grad=True)
    k = random_tensor((2, 3, 1, 8), F64, requires_grad=True)
    for rot_dim, lead in ((8, (2,)), (4, (1,)), (6, ())):
        cos = random_tensor((*lead, 3, rot_dim), F64)
        sin = random_tensor((*lead, 3, rot_dim), F64)
        assert torch.autograd.gradcheck(lambda q, k, c=cos, s=sin: A.apply_rotary(q, k, c, s), (q, k))
        assert torch.autograd.gradcheck(
            lambda q, k, c=cos, s=sin: torch.ops.openkernels.apply_rotary(q, k, c, s), (q, k)
        )
        tables = (cos.clone().requires_grad_(), sin.clone().requires_grad_())
        assert torch.autograd.gradcheck(R.apply_rotary_ref, (q, k, *tables))


def _compile_inputs(device: str) -> list[Inputs]:
    return [
        _inputs(Shape(2, 7, 3, 1, 64, 32), BF16, device),
        _inputs(Shape(1, 5, 2, 2, 96, 96, "none"), F32, device),
    ]


@pytest.mark.parametrize(("device", "impl"), TARGETS)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(device: str, impl: str, backend: str) -> None:
    if backend == "inductor" and INTERPRETING:
        pytest.skip("one inductor run, outside the interpreter (aot_eager covers the Triton kernel)")
    for inputs in _compile_inputs(device)[: 1 if backend == "inductor" else 2]:
        torch._dynamo.reset()

        def loss(q, k, cos, sin):
            q_out, k_out = A.apply_rotary(q, k, cos, sin)
            return q_out, k_out, (q_out.float() * 2).sum() + k_out.float().square().sum()

        compiled = torch.compile(loss, fullgraph=True, backend=backend)
        leaves = tuple(t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k))
        with _force(impl), poisoned_empty():
            q_out, k_out, eager = loss(*leaves, inputs.cos, inputs.sin)
            grads = torch.autograd.grad(eager, leaves)
            q_c, k_c, got = compiled(*leaves, inputs.cos, inputs.sin)
            grads_c = torch.autograd.grad(got, leaves)
        # The same kernels run in both: equal outputs and gradients, and both are right. The
        # reference backward on a GPU runs cuBLAS-free torch ops whose CUDA kernels were seen to
        # round differently between the two runs (H200: dk, aot_eager); it gets a few ulps.
        assert torch.equal(q_c, q_out) and torch.equal(k_c, k_out), f"{backend}: compiled output differs"
        for name, a, b in zip(("dq", "dk"), grads_c, grads):
            if impl == "reference" and device != "cpu":
                torch.testing.assert_close(a, b, rtol=4e-3, atol=1e-5, msg=f"{backend}: compiled {name}")
            else:
                assert torch.equal(a, b), f"{backend}: compiled {name} differs from eager"
        _check(inputs, (q_c, k_c), f"{backend} compiled")


@_no_interpreter
def test_torch_compile_dynamic_seqlen() -> None:
    # The fakes with symbolic batch and sequence lengths: one graph serves several lengths.
    torch._dynamo.reset()
    compiled = torch.compile(A.apply_rotary, fullgraph=True, backend="aot_eager", dynamic=True)
    for s in (3, 9, 17):
        inputs = _inputs(Shape(2, s, 3, 1, 64, 64, "one"), BF16, "cpu")
        _check(inputs, compiled(inputs.q, inputs.k, inputs.cos, inputs.sin), f"dynamic seqlen {s}")


@pytest.mark.parametrize(("device", "impl"), TARGETS)
def test_opcheck(device: str, impl: str) -> None:
    ops = torch.ops.openkernels
    for inputs in _compile_inputs(device):
        q, k = (t.detach().clone().requires_grad_() for t in (inputs.q, inputs.k))
        views = (q.detach().transpose(1, 2).contiguous().transpose(1, 2), k.detach())  # strided q
        with _force(impl):
            run_opcheck(ops.apply_rotary.default, (q, k, inputs.cos, inputs.sin))
            run_opcheck(ops.apply_rotary.default, (*views, inputs.cos, inputs.sin))
            grads = tuple(random_tensor(tuple(t.shape), t.dtype, device) for t in (q, k))
            run_opcheck(ops.apply_rotary_backward.default, (*grads, inputs.cos, inputs.sin))


@pytest.mark.parametrize(("device", "impl"), TARGETS)
def test_library_op_matches_public_function(device: str, impl: str) -> None:
    inputs = _compile_inputs(device)[0]
    with _force(impl):
        ours = A.apply_rotary(inputs.q, inputs.k, inputs.cos, inputs.sin)
        library = torch.ops.openkernels.apply_rotary(inputs.q, inputs.k, inputs.cos, inputs.sin)
    assert all(torch.equal(a, b) for a, b in zip(ours, library))


# ---- API behaviour ------------------------------------------------------------------------


@_no_interpreter
def test_meta_tensors_use_the_fake() -> None:
    q, k = (t.to("meta").requires_grad_() for t in (torch.empty(2, 5, 4, 64), torch.empty(2, 5, 2, 64)))
    cos = torch.empty(5, 32, device="meta")
    q_out, k_out = A.apply_rotary(q, k, cos, cos)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.device.type == "meta"
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@_no_interpreter
def test_double_backward_is_a_clear_error() -> None:
    q = random_tensor((1, 3, 2, 8), F64, requires_grad=True)
    k = random_tensor((1, 3, 1, 8), F64, requires_grad=True)
    cos, sin = random_tensor((3, 8), F64), random_tensor((3, 8), F64)
    q_out, _ = A.apply_rotary(q, k, cos, sin)  # eager: the autograd.Function
    (g,) = torch.autograd.grad((q_out * q_out).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|double backward"):
        g.sum().backward()
    q_out, _ = torch.ops.openkernels.apply_rotary(q, k, cos, sin)  # library op
    (g,) = torch.autograd.grad((q_out * q_out).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward is not supported"):
        g.sum().backward()


@_no_interpreter
def test_tables_need_no_grad_only_under_grad_mode() -> None:
    # Under no_grad nothing is differentiated, so tables that require grad are accepted.
    inputs = _inputs(Shape(1, 3, 2, 1, 8, 8), F64, "cpu")
    cos = inputs.cos.clone().requires_grad_()
    with torch.no_grad():
        out = A.apply_rotary(inputs.q, inputs.k, cos, inputs.sin)
    _check(inputs, out, "no_grad")
    q = inputs.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="openkernels::apply_rotary: cos and sin get no gradient"):
        torch.ops.openkernels.apply_rotary(q, inputs.k, cos, inputs.sin)


@_no_interpreter
def test_explain_names_the_choice() -> None:
    q = torch.randn(1, 4, 2, 64)
    text = dispatch.explain("apply_rotary", q)
    assert "runs 'cpu'" in text and "reference" in text and "triton" in text
    assert "runs 'cpu'" in dispatch.explain("apply_rotary_backward", q)
    triton = next(i for i in dispatch.implementations("apply_rotary") if i.name == "triton")
    for dtype in (BF16, F16, F32):
        assert triton.supports(DispatchKey("cuda", "sm_90", dtype)) is None
    why = triton.supports(DispatchKey("cuda", "sm_90", F64))
    assert why is not None and "float16, bfloat16 and float32" in why
    wide = dispatch.implementations("apply_rotary")[0].op
    assert dispatch._op(wide).key_fn(torch.empty(1, 1, 1, 1024)).features == frozenset({"wide-head"})
    why = triton.supports(DispatchKey("cuda", "sm_90", BF16, frozenset({"wide-head"})))
    assert why is not None and "head_dim above 512" in why


def test_rotary_max_head_dim_is_compile_checked() -> None:
    from openkernels.attention.rotary import ops
    from openkernels.attention.rotary.triton import configs

    assert max(d for d, _ in configs.ROTARY_AOT_DIMS) == ops.MAX_HEAD_DIM


@_no_interpreter
def test_forced_implementation_reaches_the_backward_on_another_thread() -> None:
    # Autograd runs CUDA backwards on its own threads, where dispatch.force is not set: the
    # backward must still run the implementation the forward was forced to.
    inputs = _inputs(Shape(1, 3, 2, 1, 64, 64), BF16, "cpu")
    q, k = (t.clone().requires_grad_() for t in (inputs.q, inputs.k))
    with dispatch.force("reference"):
        outs = [A.apply_rotary(q, k, inputs.cos, inputs.sin),
                torch.ops.openkernels.apply_rotary(q, k, inputs.cos, inputs.sin)]  # fmt: skip
    for out in outs:
        grads = []
        with recording_implementation("apply_rotary_backward", "reference") as calls:
            thread = threading.Thread(
                target=lambda out=out, grads=grads: grads.append(torch.autograd.grad(out, (q, k), out))
            )
            thread.start()
            thread.join()
        assert len(grads) == 1 and len(calls) == 1, "the backward ran another implementation than the forward"


# ---- bad input ---------------------------------------------------------------------------


def _base():
    """q (2, 5, 4, 64), k (2, 5, 2, 64) bf16, cos, sin (2, 5, 64) float32."""
    return (random_tensor((2, 5, 4, 64), BF16), random_tensor((2, 5, 2, 64), BF16), random_tensor((2, 5, 64)),
            random_tensor((2, 5, 64)))  # fmt: skip


def _grad(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


# (name, call on (q, k, cos, sin) of _base(), error type, message pattern)
_ERRORS = [
    ("q-3d", lambda q, k, c, s: A.apply_rotary(q[0], k, c, s), ValueError,
     r"q must be 4D \(batch, seqlen, heads, head_dim\), got shape \(5, 4, 64\)"),
    ("k-5d", lambda q, k, c, s: A.apply_rotary(q, k[None], c, s), ValueError, "k must be 4D"),
    ("q-not-a-tensor", lambda q, k, c, s: A.apply_rotary(q.float().numpy(), k, c, s), TypeError,
     "q must be a torch.Tensor, got ndarray"),
    ("sin-list", lambda q, k, c, s: A.apply_rotary(q, k, c, s.tolist()), TypeError, "sin must be a torch.Tensor"),
    ("q-int", lambda q, k, c, s: A.apply_rotary(q.to(torch.int32), k.to(torch.int32), c, s), TypeError,
     "q has dtype int32; supported: float16, bfloat16, float32, float64"),
    ("q-k-dtype", lambda q, k, c, s: A.apply_rotary(q, k.half(), c, s), TypeError,
     "q and k must share a dtype, got q bfloat16 and k float16"),
    ("cos-int", lambda q, k, c, s: A.apply_rotary(q, k, c.to(torch.int64), s), TypeError, "cos has dtype int64"),
    ("k-device", lambda q, k, c, s: A.apply_rotary(q, k.to(OTHER), c, s), ValueError,
     f"k is on {OTHER} but q is on cpu"),
    ("cos-device", lambda q, k, c, s: A.apply_rotary(q, k, c.to(OTHER), s), ValueError,
     f"cos is on {OTHER} but q is on cpu"),
    ("sin-device", lambda q, k, c, s: A.apply_rotary(q, k, c, s.to(OTHER)), ValueError, f"sin is on {OTHER}"),
    ("batch", lambda q, k, c, s: A.apply_rotary(q, k[:1], c, s), ValueError,
     r"q and k must share batch, seqlen and head_dim, got q \(2, 5, 4, 64\) and k \(1, 5, 2, 64\)"),
    ("seqlen", lambda q, k, c, s: A.apply_rotary(q, k[:, :4], c, s), ValueError, "must share batch, seqlen"),
    ("head_dim", lambda q, k, c, s: A.apply_rotary(q, k[..., :32], c[..., :32], s[..., :32]), ValueError,
     "must share batch, seqlen and head_dim"),
    ("cos-vs-sin", lambda q, k, c, s: A.apply_rotary(q, k, c, s[..., :32]), ValueError,
     r"cos and sin must have one shape, got \(2, 5, 64\) and \(2, 5, 32\)"),
    ("cos-seqlen", lambda q, k, c, s: A.apply_rotary(q, k, c[:, :4], s[:, :4]), ValueError,
     r"cos and sin must be \(2 or 1, 5, rotary_dim\) or \(5, rotary_dim\) for q of shape \(2, 5, 4, 64\), "
     r"got \(2, 4, 64\)"),
    ("cos-batch", lambda q, k, c, s: A.apply_rotary(q, k, torch.cat([c, c[:1]]), torch.cat([s, s[:1]])),
     ValueError, r"got \(3, 5, 64\)"),
    ("cos-1d", lambda q, k, c, s: A.apply_rotary(q, k, c[0, 0], s[0, 0]), ValueError, r"got \(64,\)"),
    ("cos-4d", lambda q, k, c, s: A.apply_rotary(q, k, c[:, None], s[:, None]), ValueError, r"got \(2, 1, 5, 64\)"),
    ("odd-rotary_dim", lambda q, k, c, s: A.apply_rotary(q, k, c[..., :31], s[..., :31]), ValueError,
     r"rotary_dim \(cos.shape\[-1\] = 31\) must be even and in 2..head_dim \(64\)"),
    ("rotary_dim-above-head_dim", lambda q, k, c, s: A.apply_rotary(q, k, torch.cat([c, c[..., :2]], -1),
     torch.cat([s, s[..., :2]], -1)), ValueError, r"rotary_dim \(cos.shape\[-1\] = 66\) must be even and in"),
    ("rotary_dim-0", lambda q, k, c, s: A.apply_rotary(q, k, c[..., :0], s[..., :0]), ValueError,
     r"rotary_dim \(cos.shape\[-1\] = 0\)"),
    ("cos-requires-grad", lambda q, k, c, s: A.apply_rotary(q, k, _grad(c), s), ValueError,
     "cos and sin get no gradient; pass them detached"),
    ("sin-requires-grad", lambda q, k, c, s: A.apply_rotary(_grad(q), k, c, _grad(s)), ValueError,
     r"sin.requires_grad is True"),
]  # fmt: skip


@_no_interpreter
@pytest.mark.parametrize(("bad", "error", "match"), [pytest.param(f, e, m, id=n) for n, f, e, m in _ERRORS])
def test_bad_input_is_a_clear_error(bad, error, match) -> None:
    # Every implementation raises AssertionError if reached: the error must come from the
    # argument checks, before any kernel.
    with contextlib.ExitStack() as stack:
        for op in OPS:
            for impl in dispatch.implementations(op):
                stack.enter_context(failing_implementation(op, impl.name, AssertionError(f"{impl.name} ran")))
        with pytest.raises(error, match=match) as caught:
            bad(*_base())
    assert str(caught.value).startswith("apply_rotary: "), "an error names the function"


# ---- large tensors ------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_offsets_past_2_31_elements() -> None:
    # q of 2^31 + a token's worth of elements (4 GiB of bf16): the last tokens' offsets need
    # int64 (rows are checked at both ends against the reference).
    heads, d = 32, 128
    s = 2**31 // (heads * d) + 1
    try:
        q = torch.randn(1, s, heads, d, device="cuda", dtype=BF16)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    k = torch.randn(1, s, 1, d, device="cuda", dtype=BF16)
    cos, sin = (torch.randn(s, d, device="cuda") for _ in range(2))
    with _force("triton"):
        q_out, k_out = A.apply_rotary(q, k, cos, sin)
    for rows in (slice(0, 3), slice(s - 3, s)):
        part = Inputs(q[:, rows], k[:, rows], cos[rows], sin[rows])
        _check(part, (q_out[:, rows], k_out[:, rows]), f"tokens {rows}")
