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

VARIANTS = ("mufu", "narrow", "formula", "fma")
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
                                  "fma": tanh_fma}[name]  # fmt: skip
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
