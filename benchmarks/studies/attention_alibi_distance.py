"""ALiBi's distance term in the Triton attention kernels (issue 23: options at most 10% slower
than the plain call; ALiBi was 1.26-1.31x on the H200). Each variant of
`kernels._alibi_distance` runs in its own process (Triton resolves the helper when it
compiles), is checked against float64 attention with ALiBi (forward and gradients), then
timed forward and forward+backward beside the plain call, the Triton kernels forced for both.

Variants:
  int    the kernels' forms: causal calls split the bias into a key term added to each
         score and a row term moved into the log-sum-exp (attention 0.8.7, plan.alibi_flag
         2); full calls float(|i + diag - j|), integer arithmetic and an int-to-float
         conversion per score.
  abs    float(|i + diag - j|) for causal calls too.
  before attention 0.8.6's kernels: abs, and ALiBi calls on the fast path's override configs
         for options (configs._OPTIONS_TABLE: narrower backward tiles at D128 on Hopper),
         which ALiBi alone leaves since attention 0.8.7 (Problem.option_configs).
  float  |float(i + diag) - float(j)|: the row and column vectors converted before they
         broadcast, one subtraction per score (the conversion runs at a quarter of the FMA
         rate). Not the default: untimed, and with it one backward config (the JAX dK/dV
         case of test_aot.py, D96 with a window, 128 registers) spills 4 B on sm_80 and sm_90.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/attention_alibi_distance.py [variant ...]
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from attention_option_cost import check, cost_table, run_variants

from openkernels.attention.core.problem import Problem
from openkernels.attention.core.triton import kernels, plan

VARIANTS = ("int", "abs", "before", "float")
SLOPES = (0.5, 0.25, 0.125, 0.0625)  # the accuracy check's 4 heads


def _slopes(heads: int) -> torch.Tensor:
    """ALiBi's slopes for `heads` heads (the paper's geometric series), float32 on the GPU."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)


@triton.jit
def alibi_distance_float(i, j, diag):
    return tl.abs((i + diag).to(tl.float32) - j.to(tl.float32))


def _reference(q, k, v, causal: bool):
    """float64 attention with ALiBi (SLOPES), (B, S, H, D) in and out (sq == sk)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    pos = torch.arange(q.shape[1], device=q.device, dtype=torch.float64)
    slopes = torch.tensor(SLOPES, device=q.device, dtype=torch.float64)
    s = s - slopes[None, :, None, None] * (pos[:, None] - pos[None, :]).abs()
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def run_variant(name: str) -> int:
    if name == "float":
        kernels._alibi_distance = alibi_distance_float  # before the first compile in this process
    if name in ("abs", "before", "float"):
        plan.SPLIT_ALIBI = False
    if name == "before":
        overrides = Problem.option_configs.fget
        Problem.option_configs = property(lambda p: overrides(p) or p.alibi)
    passed = check(name, _reference, lambda heads: {"alibi_slopes": torch.tensor(SLOPES, device="cuda")})
    cost_table(name, "alibi", lambda heads: {"alibi_slopes": _slopes(heads)})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(run_variants(sys.argv[1:], VARIANTS, run_variant, __file__))
