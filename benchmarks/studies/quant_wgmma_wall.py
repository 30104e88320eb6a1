"""The Gluon wgmma int4_linear kernel through the public op, as a user calls it (issue 24):
eager wall time per call and kernel time, against the default (Triton) path and F.linear on
the bf16 weight, on one sm_90 GPU; "wgmma" and "triton" are those implementations forced
(the default routes between them: gluon.slower_than_triton). The question: with the launch plan and the direct launch
(quant 0.9.4), where does the forced "wgmma" beat the default in the wall time of an eager
call, so that dispatch could pick it there?

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_wgmma_wall.py \
        [--shapes 8192x8192,28672x8192] [--ms 16,32,64,96,128,192,256] [--no-routing 1] [--scale-dtype float16]

--scale-dtype (bfloat16 unless given): the scales' and zeros' dtype (quantize_int4's default is
float16).
--no-routing 1: the default takes the wgmma kernel for every call it can (gluon.slower_than_triton
answers None), to measure it where the routing would send calls to Triton; the default's
calls replay from C++ (shared.replay), forced ones never do.

bf16 x, bf16 scales (or --scale-dtype) with zeros, group 128, N x K in {8192x8192, 28672x8192}, M in {16, 32,
64, 96, 128, 192, 256}. Each contender rotates over weight copies totalling >= 200 MB (L2:
60 MB): `rotating_do_bench_ms` (median wall per call: the host's time where it is longer than
the kernel's) and `rotating_graph_ms` (a CUDA graph of the calls: kernel time). First, per
shape and M, the forced call's output against the default's (each against a float32
product of x and the dequantized weight, relative error printed; NaN fails). Then the host
time alone at M = 128, 8192 x 8192: 200 calls timed on the host while a queued sleep kernel
keeps the GPU busy (`shared.dev.bench.host_only_us`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import host_only_us, rotating_do_bench_ms, rotating_graph_ms, tensor_bytes

SHAPES = ((8192, 8192), (28672, 8192))
MS = (16, 32, 64, 96, 128, 192, 256)
GROUP = 128
SERIES_BYTES = 200e6
CALLS = 60


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100 / H200)", file=sys.stderr)
        return 2
    import openkernels.quant as Q
    from openkernels.shared import dispatch

    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    scale_dtype = getattr(torch, args.get("--scale-dtype", "bfloat16"))
    print(f"scales and zeros in {scale_dtype}", flush=True)
    if args.get("--no-routing") == "1":
        from openkernels.quant import gluon

        gluon.slower_than_triton = lambda m, n, k: None
    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args["--shapes"].split(",")]
        if "--shapes" in args
        else SHAPES
    )
    ms = [int(v) for v in args["--ms"].split(",")] if "--ms" in args else MS
    failures: list[str] = []
    rows = []
    for n, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        q = Q.quantize_int4(w, GROUP, scale_dtype=scale_dtype)
        w_deq = Q.dequantize_int4(q, torch.float32)
        per_copy = tensor_bytes(q.qweight, q.scales, q.zeros)
        weights = [q] + [
            dataclasses.replace(q, qweight=q.qweight.clone(), scales=q.scales.clone(), zeros=q.zeros.clone())
            for _ in range(max(1, math.ceil(SERIES_BYTES / per_copy)) - 1)
        ]
        w16 = [w.to(torch.bfloat16) for _ in range(max(1, math.ceil(SERIES_BYTES / (n * k * 2))))]
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.float() @ w_deq.t()
            default_y = Q.int4_linear(x, q)
            with dispatch.force("int4_linear:wgmma"):
                wgmma_y = Q.int4_linear(x, q)
            errs = (rel_error(default_y, ref), rel_error(wgmma_y, ref))
            if any(math.isnan(e) or e > 2e-2 for e in errs):
                failures.append(f"M={m} {n}x{k}: relative error default {errs[0]:.2e}, wgmma {errs[1]:.2e}")
            public = [lambda wt=wt, x=x: Q.int4_linear(x, wt) for wt in weights]
            contenders = {"default": public, "wgmma": public, "triton": public,
                          "F.linear": [lambda wc=wc, x=x: F.linear(x, wc) for wc in w16]}  # fmt: skip
            times = {}
            for label, fns in contenders.items():
                forced = label in ("wgmma", "triton")
                with dispatch.force(f"int4_linear:{label}") if forced else contextlib.nullcontext():
                    times[label] = (rotating_do_bench_ms(fns), rotating_graph_ms(fns, CALLS))
            rows.append((m, n, k, errs, times))
            fl = times["F.linear"]
            print(f"M={m:3d} {n}x{k} err {errs[0]:.1e}/{errs[1]:.1e} | " + " | ".join(
                f"{label} wall {db:.4f} ({fl[0] / db:.2f}x) graph {gr or float('nan'):.4f} "
                f"({(fl[1] or float('nan')) / (gr or float('nan')):.2f}x)" for label, (db, gr) in times.items()
            ), flush=True)  # fmt: skip
        del weights, w16, w, w_deq
        torch.cuda.empty_cache()

    # Host time alone, at M = 128 and 8192 x 8192 (the kernels' time kept out: host_us).
    q = Q.quantize_int4(torch.randn(8192, 8192, device=dev) * 0.02, GROUP, scale_dtype=torch.bfloat16)
    x = torch.randn(128, 8192, device=dev).to(torch.bfloat16)
    w16 = torch.randn(8192, 8192, device=dev).to(torch.bfloat16)
    host = {
        "default": host_only_us(lambda: Q.int4_linear(x, q)),
        "F.linear": host_only_us(lambda: F.linear(x, w16)),
    }
    for name in ("wgmma", "triton"):
        with dispatch.force(f"int4_linear:{name}"):
            host[name] = host_only_us(lambda: Q.int4_linear(x, q))
    print("\nhost us per call (M=128, 8192x8192, 50 calls behind a queued GPU sleep): "
          + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))  # fmt: skip

    print("\nms: wall (do_bench median) / kernel (CUDA graph); x F.linear in brackets")
    names = ("default", "wgmma", "triton", "F.linear")
    print(
        "| M | N x K | "
        + " | ".join(f"{c} wall" for c in names)
        + " | "
        + " | ".join(f"{c} kernel" for c in names)
        + " |"
    )
    print("|---|---|" + "---|" * 8)
    for m, n, k, _errs, t in rows:
        fl = t["F.linear"]
        cells = [f"{t[c][0]:.4f} ({fl[0] / t[c][0]:.2f}x)" for c in names]
        cells += [
            "n/a" if t[c][1] is None else f"{t[c][1]:.4f} ({(fl[1] or math.nan) / t[c][1]:.2f}x)"
            for c in names
        ]
        print(f"| {m} | {n}x{k} | " + " | ".join(cells) + " |")
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for f in failures:
            print(f"  {f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
