"""The sm_90 norm kernels' variants, kernel level, one process (H200, bf16): the Triton
launchers, the cluster kernels with the chunk in registers, staged in shared memory (each
chunk shape that fits), the pushed kernel (staged, per-warp statistics stored into every CTA
by st.async; built with bulk staging and trimmed passes since layernorm 0.11.1) and its other
builds (cuda.PUSH_VARIANTS: push-plain, push-trim, push-bulk, push-lean), and QuACK's RMSNorm
where it imports. Forward of RMSNorm, LayerNorm and add_rms_norm (prenorm), then the
backward kernels (registers, staged, CTAs per SM) and RMSNorm forward+backward through
autograd (ours, ours with the cluster kernels forced, QuACK). GB/s count one read and one
write per pass (forward 2 or 4, backward 3, forward+backward 4), fraction of a device copy
measured here; inputs rotated past the 60 MB L2; each variant's output compared with the
Triton one (max abs difference) before it is timed.

    python benchmarks/studies/norm_cluster_variants.py [ROWSxCOLS,...] [rms,ln,addrms] [bwd shapes | none]
    NORM_EXTRA_FLAGS="-DOK_PLAIN_STORES" python ...   # the CUDA kernels built with extra nvcc flags
    PUSH_VARIANT_FLAGS="-DOK_PLAIN_STORES" python ...    # also the pushed forward built that way
    NORM_VARIANTS=triton,push,quack python ...           # only the variants whose names start so
"""

# ruff: noqa: B023 (each closure runs within its own loop iteration)
from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import torch
import triton

import openkernels.layernorm as LN
from openkernels.layernorm import cuda as C
from openkernels.layernorm import triton as T
from openkernels.shared import cuda_build, dispatch

DEV, DT, EPS = "cuda", torch.bfloat16, 1e-6
SHAPES = "32768x2048,4096x16384,1024x65536,512x131072,256x262144"


def _quack() -> object | None:
    try:
        return importlib.import_module("quack.rmsnorm")  # `quack.rmsnorm` is also the function
    except Exception as error:  # ImportError, or a CUDA / CuTe DSL mismatch at import
        print("no QuACK:", repr(error)[:200])
        return None


def _bench(fn: Callable[[dict], object], rotate: list[dict]) -> float:
    calls = [0]

    def step() -> None:
        fn(rotate[calls[0] % len(rotate)])
        calls[0] += 1

    return triton.testing.do_bench(step, warmup=25, rep=150, return_mode="median")


def _shapes(arg: str) -> list[tuple[int, int]]:
    return [tuple(map(int, s.split("x"))) for s in arg.split(",")]


def _copy_gbs() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200, return_mode="median")
    return 2 * a.numel() / ms / 1e6


PUSH_VARIANT = None  # norm_push.cu built with PUSH_VARIANT_FLAGS (main), run as "push-variant"


def _with_push(library: object, call: Callable[[], object]) -> object:
    saved, C._push_library = C._push_library, library
    try:
        return call()
    finally:
        C._push_library = saved


def _report(label: str, variants: dict, sets: list[dict], nbytes: int, copy: float, check) -> None:
    line = []
    only = os.environ.get("NORM_VARIANTS")  # e.g. "triton,push,quack": the names that start so
    for name, fn in variants.items():
        if only and not name.startswith(tuple(only.split(","))):
            continue
        try:
            fn(sets[0])
            if C._broken:  # a refused launch fell back to Triton: report it, and let the next variant run
                raise RuntimeError(C._broken.pop())
            err = check()
            ms = _bench(fn, sets)
            gbs = nbytes / ms / 1e6
            line.append(f"{name} {ms * 1e3:.1f}us {gbs:.0f} ({gbs / copy:.2f}) err {err}")
        except Exception as error:
            line.append(f"{name} FAILED {repr(error)[:120]}")
    print(f"{label}: " + " | ".join(line), flush=True)


def forward(shapes: list[tuple[int, int]], ops: list[str], copy: float, qr: object | None) -> None:
    for m, n in shapes:
        per = m * n * 2
        sets = [
            {"x": torch.randn(m, n, device=DEV, dtype=DT), "r": torch.randn(m, n, device=DEV, dtype=DT)}
            for _ in range(max(1, -(-200_000_000 // (per * 4))))
        ]
        w, bias = torch.randn(n, device=DEV, dtype=DT), torch.randn(n, device=DEV, dtype=DT)
        for op in ops:
            rms, res = op != "ln", op == "addrms"
            y, h = torch.empty(m, n, device=DEV, dtype=DT), torch.empty(m, n, device=DEV, dtype=DT)
            mean, rstd = torch.empty(m, device=DEV), torch.empty(m, device=DEV)

            def args(s: dict, rms=rms, res=res, y=y, h=h, mean=mean, rstd=rstd) -> tuple:
                return (s["x"], s["r"] if res else None, w, None if rms else bias, y, h if res else None,
                        None if rms else mean, rstd)  # fmt: skip

            kw = {"eps": EPS, "weight_offset": 0.0, "rms": rms, "h_dtype": DT}
            variants: dict = {"triton": lambda s, a=args, kw=kw: T.norm_fwd(*a(s), **kw)}
            base = C.cluster_config(n, DT)
            variants[f"regs{tuple(base)}"] = lambda s, a=args, kw=kw: C.norm_fwd(*a(s), **kw, staged=False)
            for shape in C.SHORT_SHAPES + C.SHAPES:
                cfg = C.cluster_config(n, DT, shape)
                if (
                    cfg is None
                    or (n <= 8192 and cfg.cluster > 1)
                    or C.staged_bytes(cfg, res) > C.MAX_STAGED_BYTES
                ):
                    continue
                variants[f"staged{tuple(cfg)}"] = lambda s, a=args, kw=kw, shape=shape: C.norm_fwd(
                    *a(s), **kw, config=shape, staged=True
                )
                if shape in C.PUSH_SHAPES:
                    variants[f"push{tuple(cfg)}"] = lambda s, a=args, kw=kw, shape=shape: C.norm_fwd(
                        *a(s), **kw, config=shape, push=True
                    )
                    for (
                        name
                    ) in C.PUSH_VARIANTS:  # its other builds: push-plain, push-trim, push-bulk, push-lean
                        variants[f"push-{name}{tuple(cfg)}"] = (
                            lambda s, a=args, kw=kw, shape=shape, name=name: C.norm_fwd(
                                *a(s), **kw, config=shape, push=name
                            )
                        )
                    if PUSH_VARIANT is not None:
                        variants[f"push-variant{tuple(cfg)}"] = lambda s, a=args, kw=kw, shape=shape: (
                            _with_push(PUSH_VARIANT, lambda: C.norm_fwd(*a(s), **kw, config=shape, push=True))
                        )
            if qr is not None and rms:
                if res:
                    variants["quack"] = lambda s: qr.rmsnorm(
                        s["x"], w, residual=s["r"], eps=EPS, prenorm=True
                    )
                else:
                    variants["quack"] = lambda s: qr.rmsnorm(s["x"], w, eps=EPS)
            variants["triton"](sets[0])
            ref = y.clone()

            def check(ref=ref, y=y) -> str:
                return f"{(y.float() - ref.float()).abs().max().item():.2g}"

            _report(f"{op} {m}x{n}", variants, sets, per * (4 if res else 2), copy, check)
        del sets


def backward(shapes: list[tuple[int, int]], copy: float, qr: object | None) -> None:
    for m, n in shapes:
        per = m * n * 2
        sets = [
            {"dy": torch.randn(m, n, device=DEV, dtype=DT), "h": torch.randn(m, n, device=DEV, dtype=DT)}
            for _ in range(max(1, -(-200_000_000 // (per * 3))))
        ]
        w = torch.randn(n, device=DEV, dtype=DT)
        for rms in (True, False):
            mean, rstd = torch.randn(m, device=DEV) * 0.1, torch.rand(m, device=DEV) + 0.5
            dh, dw = torch.empty(m, n, device=DEV, dtype=DT), torch.empty(n, device=DEV, dtype=DT)
            db = None if rms else torch.empty(n, device=DEV, dtype=DT)

            def args(s: dict, rms=rms, mean=mean, rstd=rstd, dh=dh, dw=dw, db=db) -> tuple:
                return (s["dy"], s["h"], w, None if rms else mean, rstd, None, dh, dw, db)

            kw = {"weight_offset": 0.0, "rms": rms}
            variants: dict = {"triton": lambda s, a=args, kw=kw: T.norm_bwd(*a(s), **kw)}
            if C.cluster_config(n, DT, shapes=C.BWD_SHAPES) is not None:
                variants["regs"] = lambda s, a=args, kw=kw: C.norm_bwd(*a(s), **kw, staged=False)
            base = C.cluster_config(n, DT, shapes=C.BWD_STAGED_SHAPES)
            for shape in C.BWD_STAGED_SHAPES:
                cfg = C.cluster_config(n, DT, shape, C.BWD_STAGED_SHAPES)
                for cps in (None, 1, 2, 3) if shape == tuple(base[:2]) else (None,):
                    if cfg is not None:
                        variants[f"staged{tuple(cfg)}x{cps}"] = (
                            lambda s, a=args, kw=kw, shape=shape, cps=cps: C.norm_bwd(
                                *a(s), **kw, config=shape, staged=True, ctas_per_sm=cps
                            )
                        )
            variants["triton"](sets[0])
            ref, ref_w = dh.clone(), dw.clone()

            def check(ref=ref, ref_w=ref_w, dh=dh, dw=dw) -> str:
                rel_w = (dw.float() - ref_w.float()).abs().max().item() / (
                    ref_w.float().abs().max().item() + 1e-9
                )
                return f"{(dh.float() - ref.float()).abs().max().item():.2g}/{rel_w:.2g}"

            _report(f"bwd {'rms' if rms else 'ln'} {m}x{n}", variants, sets, 3 * per, copy, check)
        x = torch.randn(m, n, device=DEV, dtype=DT).requires_grad_()
        wg, dy = w.detach().clone().requires_grad_(), torch.randn(m, n, device=DEV, dtype=DT)

        def ours() -> object:
            return torch.autograd.grad(LN.rms_norm(x, wg, EPS), (x, wg), dy)

        def ours_cluster() -> object:
            with dispatch.force("cluster"):
                return torch.autograd.grad(LN.rms_norm(x, wg, EPS), (x, wg), dy)

        steps = {"ours": ours, "ours:cluster": ours_cluster}
        if qr is not None:
            steps["quack"] = lambda: torch.autograd.grad(qr.rmsnorm(x, wg, eps=EPS), (x, wg), dy)
        line = []
        for name, fn in steps.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
                line.append(f"{name} {ms * 1e3:.1f}us {4 * per / ms / 1e6:.0f} GB/s")
            except Exception as error:
                line.append(f"{name} FAILED {repr(error)[:100]}")
        print(f"fwd+bwd rms {m}x{n} (autograd wall): " + " | ".join(line), flush=True)
        del sets


def main() -> None:
    torch.manual_seed(0)
    extra = os.environ.get("NORM_EXTRA_FLAGS")
    if extra:  # a variant of the CUDA library (say -DOK_PLAIN_STORES), built beside the default
        C._library = cuda_build.CudaLibrary(
            C._SOURCE, name="openkernels_layernorm_cuda_variant", arch=C.ARCH, signatures=C._SIGNATURES,
            extra_flags=tuple(extra.split()),
        )  # fmt: skip
        print("CUDA library built with", extra, flush=True)
    push_flags = os.environ.get("PUSH_VARIANT_FLAGS")
    if push_flags:  # the pushed forward built a second way (say -DOK_PLAIN_STORES), beside the default
        global PUSH_VARIANT
        PUSH_VARIANT = cuda_build.CudaLibrary(
            C._PUSH_SOURCE, name="openkernels_layernorm_push_variant", arch=C.ARCH,
            signatures={"ok_norm_fwd_push": C._SIGNATURES["ok_norm_fwd_cluster"]}, extra_flags=tuple(push_flags.split()),
        )  # fmt: skip
    argv = sys.argv[1:] + [None] * 3
    qr = _quack()
    copy = _copy_gbs()
    print(f"copy {copy:.0f} GB/s", flush=True)
    forward(_shapes(argv[0] or SHAPES), (argv[1] or "rms,ln,addrms").split(","), copy, qr)
    if argv[2] != "none":  # "none": the forward only
        backward(_shapes(argv[2] or SHAPES), copy, qr)


if __name__ == "__main__":
    main()
