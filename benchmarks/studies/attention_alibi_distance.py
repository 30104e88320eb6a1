"""ALiBi's distance term in the Triton attention kernels (issue 23: options at most 10% slower
than the plain call; ALiBi was 1.26-1.31x on the H200). Each variant of
`kernels._alibi_distance` runs in its own process (Triton resolves the helper when it
compiles), is checked against float64 attention with ALiBi (forward and gradients), then
timed forward and forward+backward beside the plain call, the Triton kernels forced for both.

Variants:
  int    float(|i + diag - j|): integer arithmetic and an int-to-float conversion per score
         (the kernels' form).
  float  |float(i + diag) - float(j)|: the row and column vectors converted before they
         broadcast, one subtraction per score (the conversion runs at a quarter of the FMA
         rate). Not the default: untimed, and with it one backward config (the JAX dK/dV
         case of test_aot.py, D96 with a window, 128 registers) spills 4 B on sm_80 and sm_90.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/attention_alibi_distance.py [variant ...]
"""

from __future__ import annotations

import subprocess
import sys

import torch
import triton
import triton.language as tl
from attention_softcap_tanh import SHAPES, times, timing_inputs

from openkernels.attention import attention
from openkernels.attention.core.triton import kernels
from openkernels.shared import dispatch

VARIANTS = ("int", "float")


@triton.jit
def alibi_distance_float(i, j, diag):
    return tl.abs((i + diag).to(tl.float32) - j.to(tl.float32))


def _reference(q, k, v, slopes, causal: bool):
    """float64 attention with ALiBi, (B, S, H, D) in and out (bottom-right aligned, sq == sk)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    pos = torch.arange(q.shape[1], device=q.device, dtype=torch.float64)
    s = s - slopes.double()[None, :, None, None] * (pos[:, None] - pos[None, :]).abs()
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def run_variant(name: str) -> int:
    if name == "float":
        kernels._alibi_distance = alibi_distance_float  # before the first compile in this process
    failed = False
    torch.manual_seed(0)
    with dispatch.force("triton"):
        for dtype, tol in ((torch.float16, 4e-3), (torch.bfloat16, 2.5e-2)):
            q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=dtype) for _ in range(3))
            slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
            for t in (q, k, v):
                t.requires_grad_(True)
            for causal in (False, True):
                out = attention(q, k, v, causal=causal, alibi_slopes=slopes)
                g = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), g)
                qf, kf, vf = (t.detach().double().requires_grad_(True) for t in (q, k, v))
                ref = _reference(qf, kf, vf, slopes, causal)
                rgrads = torch.autograd.grad(ref, (qf, kf, vf), g.double())
                errs = [((out.double() - ref).abs().max() / ref.abs().max()).item()]
                errs += [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, rgrads)]
                ok = all(e <= tol for e in errs)  # NaN fails
                failed |= not ok
                print(f"[{name}] {str(dtype)[6:]} causal={causal} out rel {errs[0]:.2e}, "
                      f"dq/dk/dv rel {errs[1]:.2e}/{errs[2]:.2e}/{errs[3]:.2e} {'ok' if ok else 'FAIL'}")  # fmt: skip
        print(
            f"[{name}] | shape | mask | fwd plain | fwd alibi | fwd ratio | f+b plain | f+b alibi | f+b ratio |"
        )
        for B, H, S, D in SHAPES:
            qs = timing_inputs(B, H, S, D)
            slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H)
            for causal in (True, False):
                fp, bp = times(qs, causal)
                fa, ba = times(qs, causal, alibi_slopes=slopes)
                print(f"[{name}] | B{B} H{H} S{S} D{D} | {'causal' if causal else 'full'} | {fp:.3f} | {fa:.3f} | "
                      f"{fa / fp:.2f}x | {bp:.3f} | {ba:.3f} | {ba / bp:.2f}x |")  # fmt: skip
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--one":
        return run_variant(argv[1])
    status = 0
    for name in argv or VARIANTS:
        status |= subprocess.call([sys.executable, __file__, "--one", name])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
