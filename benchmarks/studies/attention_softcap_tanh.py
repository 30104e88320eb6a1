"""The softcap's tanh in the Triton attention kernels (issue 23: options at most 10% slower than
the plain call). On Hopper GPUs the kernels compute it with `kernels._tanh_mufu` (HAS_SOFTCAP
== 2, attention 0.8.6); each variant below takes its place in its own process (Triton
resolves the helper when it compiles), is checked against float64 tanh (every float32 in
[-20, 20]) and float64 attention, then timed forward and forward+backward beside the plain
call, the Triton kernels forced for both.

Variants:
  mufu     tanh.approx.f32, one multi-function-unit (MUFU) op: the default since 0.8.6.
  narrow   mufu on attention 0.8.6's configs (a softcap took the override configs for options,
           configs._OPTIONS_TABLE; since 0.8.7 a softcap alone keeps the plain ones).
  formula  1 - 2 / (exp2(2x log2 e) + 1): one exp2 and one MUFU reciprocal per score
           (kernels._tanh, the portable formula; the NVIDIA default until 0.8.5).
  fma      t = exp2(-2|x| log2 e) in (0, 1], tanh|x| = (1 - t) / (1 + t), the reciprocal of
           1 + t in (1, 2] from a quadratic first guess and two Newton steps: one exp2 on the
           MUFU, the rest on the FMA pipe (slower than formula on an H100: the FMA pipe is
           not idle).
  mixed    mufu, and the forward's softmax computes half of its exp2s on the FMA pipe
           (exp2_fma: a cubic and an exponent-field add, no MUFU op): with a softcap each
           score takes two MUFU ops (tanh, exp2), and the MUFU runs at a quarter of the FMA
           pipe's rate. The plain call's timings in this variant show what it does without a
           softcap. H100, twenty-fourth session: slower, plain and softcapped alike (fwd ms,
           mufu / mixed, plain then cap: B8 H16 S2048 D128 causal 0.362 / 0.400, 0.392 /
           0.420; full 0.619 / 0.689, 0.683 / 0.752; B2 H16 S8192 D128 causal 1.241 / 1.413,
           1.418 / 1.562; B8 H32 S2048 D64 full 0.693 / 0.866, 0.845 / 0.936): the issue
           slots the cubic takes (9 instructions for one MUFU op) cost more than the MUFU
           time it frees; not adopted. sm_90 SASS of the D128 forward: MUFU 136 -> 104, 2376
           -> 2616 instructions, registers 184 -> 178, no spills, no shared-memory traffic.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/attention_softcap_tanh.py [variant ...]
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from attention_option_cost import check, cost_table, run_variants

from openkernels.attention.core.problem import Problem
from openkernels.attention.core.triton import kernels

VARIANTS = ("mufu", "narrow", "formula", "fma", "mixed")
CAP = 30.0


@triton.jit
def tanh_fma(x):
    # t in (0, 1]: no overflow, and 1 + t in (1, 2], where a quadratic guesses 1 / (1 + t)
    # within 1.0e-2 and two Newton steps take it to float32's precision.
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)
    d = 1.0 + t
    r = (0.32321503 * d - 1.45446894) * d + 2.12113641
    r = r + r * (1.0 - d * r)
    r = r + r * (1.0 - d * r)
    y = (1.0 - t) * r
    return tl.where(x < 0, -y, y)


@triton.jit
def exp2_fma(x):
    # 2^x on the FMA and integer pipes, no MUFU op: x rounded to an integer j by adding
    # 1.5 * 2^23 (j lands in the sum's low mantissa bits), 2^(x - j) on [-0.5, 0.5] from a cubic
    # (relative error 7.5e-5), j added to its exponent field (the sum's bits shifted by 23: the
    # magic number's bits shift out). 0 below 2^-125 and for -inf (masked scores).
    xc = tl.maximum(x, -125.0)
    t = xc + 12582912.0
    f = xc - (t - 12582912.0)
    p = ((0.05517164245247841 * f + 0.24261116981506348) * f + 0.6932609677314758) * f + 0.9999280571937561
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return tl.where(x >= -125.0, bits.to(tl.float32, bitcast=True), 0.0)


@triton.jit
def exp2_half_fma(x):
    # 2^x of a (rows, cols) tile, every other column on the FMA pipe (exp2_fma): the MMA
    # accumulator holds column pairs in one thread's registers, so the split moves no data
    # (sm_90 SASS: no shared-memory traffic added; a four-way split added 64 LDS / STS).
    a, b = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return tl.reshape(tl.join(tl.exp2(a), exp2_fma(b)), x.shape)


@triton.jit
def softmax_step_mixed(s, m_i, l_i, MASK: tl.constexpr):
    # kernels._softmax_step with half of the probabilities' exp2s on the FMA pipe
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = exp2_half_fma(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


_TANH = kernels._tanh_mufu  # the variant under study (set before the first compile)


@triton.jit
def _apply_tanh(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, _TANH(x), mask=offs < n)


def tanh_error(device: str = "cuda", limit: float = 20.0) -> tuple[float, float]:
    """(max |_TANH(x) - tanh(x)|, max of that relative to |tanh(x)| for |x| >= 2^-10) over every
    float32 x in [-limit, limit], float64 tanh as the truth."""
    top = int(torch.tensor(limit).view(torch.int32))
    worst_abs = worst_rel = 0.0
    for lo in range(0, top + 1, 1 << 26):
        bits = torch.arange(lo, min(lo + (1 << 26), top + 1), device=device, dtype=torch.int32)
        x = torch.cat([bits.view(torch.float32), -bits.view(torch.float32)])
        y = torch.empty_like(x)
        _apply_tanh[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        truth = torch.tanh(x.double())
        err = (y.double() - truth).abs()
        worst_abs = max(worst_abs, err.max().item())
        big = x.abs() >= 2**-10
        if big.any():
            worst_rel = max(worst_rel, (err[big] / truth[big].abs()).max().item())
    return worst_abs, worst_rel


def _reference(q, k, v, causal: bool):
    """float64 softcapped attention, (B, S, H, D) in and out, autograd for the gradients."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = CAP * torch.tanh(s / CAP)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def run_variant(name: str) -> int:
    global _TANH
    _TANH = kernels._tanh_mufu = {"mufu": kernels._tanh_mufu, "narrow": kernels._tanh_mufu, "formula": kernels._tanh,
                                  "fma": tanh_fma, "mixed": kernels._tanh_mufu}[name]  # fmt: skip
    if name == "mixed":
        kernels._softmax_step = softmax_step_mixed
    if name == "narrow":  # attention 0.8.6's configs: a softcap took the override configs for options
        overrides = Problem.option_configs.fget
        Problem.option_configs = property(lambda p: overrides(p) or p.softcap > 0)
    err_abs, err_rel = tanh_error()
    print(f"[{name}] every float32 in [-20, 20]: max |tanh error| {err_abs:.2e}, relative {err_rel:.2e}")
    passed = check(name, _reference, lambda heads: {"softcap": CAP}, scale=3.0)
    cost_table(name, "cap", lambda heads: {"softcap": CAP})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(run_variants(sys.argv[1:], VARIANTS, run_variant, __file__))
