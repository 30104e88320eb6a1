"""The harness of the attention option studies (attention_softcap_tanh.py,
attention_alibi_distance.py): what an option (softcap, ALiBi, ...) costs the Triton kernels
against the same call without it, one kernel variant per process.

A study replaces a helper of `openkernels.attention.core.triton.kernels` in a fresh process
(Triton resolves helpers when it compiles), checks the public call against float64 attention
(forward and gradients; fp16 and bf16; NaN fails) and times it forward and forward+backward
beside the plain call, the Triton kernels forced for both (do_bench, bf16, inputs rotated
past L2).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import torch
from triton.testing import do_bench

from openkernels.attention import attention
from openkernels.shared import dispatch

SHAPES = ((8, 16, 2048, 128), (2, 16, 8192, 128), (8, 32, 2048, 64))


def times(inputs: list, causal: bool, **options) -> tuple[float, float]:
    """(forward ms, forward+backward ms) of the public call with `options`, rotating over
    `inputs` (q, k, v triples, bf16, requires_grad)."""
    calls = iter(range(10**9))

    def fwd():
        q, k, v = inputs[next(calls) % len(inputs)]
        with torch.no_grad():
            return attention(q, k, v, causal=causal, **options)

    def fwd_bwd():
        q, k, v = inputs[next(calls) % len(inputs)]
        out = attention(q, k, v, causal=causal, **options)
        out.backward(torch.ones_like(out))

    return do_bench(fwd, warmup=50, rep=300), do_bench(fwd_bwd, warmup=20, rep=300)


def timing_inputs(B: int, H: int, S: int, D: int) -> list:
    """Enough (q, k, v) copies of (B, S, H, D) bf16 that 200 MB of them rotate past L2."""
    copies = max(1, int(200e6 // (3 * B * S * H * D * 2)))
    return [
        [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
        for _ in range(copies)
    ]


def check(name: str, reference: Callable, options: Callable[[int], dict], scale: float = 1.0) -> bool:
    """The public call (Triton forced) against reference(q, k, v, causal) in float64 on
    2 x 333 x 4 x 64 inputs times `scale`, options(heads) its keyword arguments; prints
    each case, returns whether all were within fp16's / bf16's tolerance."""
    torch.manual_seed(0)
    passed = True
    with dispatch.force("triton"):
        for dtype, tol in ((torch.float16, 4e-3), (torch.bfloat16, 2.5e-2)):
            q, k, v = (torch.randn(2, 333, 4, 64, device="cuda", dtype=dtype) * scale for _ in range(3))
            for t in (q, k, v):
                t.requires_grad_(True)
            for causal in (False, True):
                out = attention(q, k, v, causal=causal, **options(4))
                g = torch.randn_like(out)
                grads = torch.autograd.grad(out, (q, k, v), g)
                qf, kf, vf = (t.detach().double().requires_grad_(True) for t in (q, k, v))
                ref = reference(qf, kf, vf, causal)
                rgrads = torch.autograd.grad(ref, (qf, kf, vf), g.double())
                errs = [((out.double() - ref).abs().max() / ref.abs().max()).item()]
                errs += [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, rgrads)]
                ok = all(e <= tol for e in errs)  # NaN fails
                passed &= ok
                print(f"[{name}] {str(dtype)[6:]} causal={causal} out rel {errs[0]:.2e}, "
                      f"dq/dk/dv rel {errs[1]:.2e}/{errs[2]:.2e}/{errs[3]:.2e} {'ok' if ok else 'FAIL'}")  # fmt: skip
    return passed


def cost_table(name: str, label: str, options: Callable[[int], dict]) -> None:
    """Time at every SHAPES entry, causal and full: the plain call, the call with
    options(heads), their ratio (forward, forward+backward), as a Markdown table."""
    print(
        f"[{name}] | shape | mask | fwd plain | fwd {label} | fwd ratio | f+b plain | f+b {label} | f+b ratio |"
    )
    with dispatch.force("triton"):
        for B, H, S, D in SHAPES:
            qs = timing_inputs(B, H, S, D)
            for causal in (True, False):
                fp, bp = times(qs, causal)
                fo, bo = times(qs, causal, **options(H))
                print(f"[{name}] | B{B} H{H} S{S} D{D} | {'causal' if causal else 'full'} | {fp:.3f} | {fo:.3f} | "
                      f"{fo / fp:.2f}x | {bp:.3f} | {bo:.3f} | {bo / bp:.2f}x |")  # fmt: skip


def run_variants(
    argv: list[str], variants: tuple[str, ...], run_variant: Callable[[str], int], script: str
) -> int:
    """`script --one NAME` runs one variant here; else each named variant (all by default)
    in its own process. Exit status 1 if any variant failed its checks."""
    if len(argv) == 2 and argv[0] == "--one":
        return run_variant(argv[1])
    status = 0
    for name in argv or variants:
        status |= subprocess.call([sys.executable, script, "--one", name])
    return status
