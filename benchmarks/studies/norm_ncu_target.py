"""One norm forward under Nsight Compute: warm-up calls, then one call between
cudaProfilerStart / Stop, so `ncu --profile-from-start off` reads only that call's kernels.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \\
        python benchmarks/studies/norm_ncu_target.py VARIANT ROWSxCOLS [rms|ln|addrms]

VARIANT: triton (the default launchers), staged / regs / push (the sm_90 cluster
kernels, the default chunk shape), push-plain / push-trim / push-bulk / push-lean (the pushed kernel's
other builds, cuda.PUSH_VARIANTS), staged:T,V (a forced (threads, vectors) shape, likewise for
the others), quack (QuACK's RMSNorm),
copy (a device copy of the same bytes: the ceiling's counters).
"""

from __future__ import annotations

import sys

import torch

from openkernels.layernorm import cuda as C
from openkernels.layernorm import triton as T

DEV, DT, EPS = "cuda", torch.bfloat16, 1e-6


def main() -> None:
    variant, shape = sys.argv[1], sys.argv[2]
    op = sys.argv[3] if len(sys.argv) > 3 else "rms"
    m, n = map(int, shape.split("x"))
    rms, res = op != "ln", op == "addrms"
    x, r = torch.randn(m, n, device=DEV, dtype=DT), torch.randn(m, n, device=DEV, dtype=DT)
    w, b = torch.randn(n, device=DEV, dtype=DT), torch.randn(n, device=DEV, dtype=DT)
    y, h = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = torch.empty(m, device=DEV), torch.empty(m, device=DEV)
    args = (x, r if res else None, w, None if rms else b, y, h if res else None, None if rms else mean, rstd)
    kw = {"eps": EPS, "weight_offset": 0.0, "rms": rms, "h_dtype": DT}
    if variant == "triton":
        call = lambda: T.norm_fwd(*args, **kw)  # noqa: E731
    elif variant.startswith(("staged", "regs", "push")):
        config = tuple(map(int, variant.split(":")[1].split(","))) if ":" in variant else None
        kind = variant.split(":")[0]
        # push-plain / push-trim / push-bulk / push-lean: other builds of the pushed kernel (cuda.PUSH_VARIANTS)
        push = kind.removeprefix("push-") if kind.startswith("push-") else kind == "push"
        call = lambda: C.norm_fwd(  # noqa: E731
            *args, **kw, config=config, staged=kind != "regs", push=push
        )  # fmt: skip
    elif variant == "quack":
        import quack

        call = (
            (lambda: quack.rmsnorm(x, w, residual=r, eps=EPS, prenorm=True))
            if res
            else (lambda: quack.rmsnorm(x, w, eps=EPS))
        )
    elif variant == "copy":
        src = torch.empty(m * n * (2 if res else 1), device=DEV, dtype=DT)
        dst = torch.empty_like(src)
        call = lambda: dst.copy_(src)  # noqa: E731
    else:
        raise SystemExit(f"unknown variant {variant}")
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"{variant} {shape} {op}: profiled one call", flush=True)


if __name__ == "__main__":
    main()
