"""The Gluon wgmma int4_linear kernel (openkernels.quant.gluon) past its routed rows: M = 128 to
2048, where the public op runs wgmma up to 256 rows and dequantize + cuBLAS from 512 (issue 24:
M = 128 >= 1.1x and M = 2048 >= 0.95x F.linear). One sm_90 GPU:

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \
        python3 benchmarks/studies/quant_wgmma_large_m.py [--ms 128,512,2048] [--shapes 8192x8192]

The question: do wider x bands (BLOCK_M = 256, the wgmma's N = 256: the dequantized weight
tile serves twice the columns) or more programs per SM (64-row bands) close the gap the
default configs leave. The study lifts gluon.MAX_M for its own calls only.

Correctness first (exit status 1, nothing timed): every config at every M against the float64
product of x and the dequantized weight within the error contract
(`reference.linear_error_bound`, W rounded to x's dtype), no NaN, on a 4100 x 4096 weight
(odd N, a bias) at M = 300 and 2048. Then per shape and M, CUDA-graph kernel time (rotating
weight copies >= 200 MB, past the 60 MB L2) of each config, the public op as routed (default)
and F.linear on the bf16 weight.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import rotating_graph_ms as _graph_ms
from openkernels.shared.dev.bench import tensor_bytes

GROUP = 128
KIND = "int4"  # --kind
SERIES_BYTES = 200e6
CALLS = 20
T0 = time.perf_counter()


def rotating_graph_ms(fns, calls: int) -> float:
    """Kernel ms per call; inf where the capture failed (reported on stderr)."""
    t = _graph_ms(fns, calls)
    return float("inf") if t is None else t


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


ONLY: list = []  # --configs: these instead of the sweep


def configs(gluon, m: int, n: int = 8192, k: int = 8192) -> list:
    """The routed default (where M <= 256) and the variants: 64 / 128 / 256-row x bands on 64- /
    128-row weight tiles, 64- and 128-column steps, within 227 KiB of shared memory."""
    if ONLY:  # "auto": the default config at this shape (gluon.config_for)
        return list(dict.fromkeys(gluon.config_for(m, n, k, GROUP) if c == "auto" else c for c in ONLY))
    out = {}
    if m <= 256:
        out[gluon.config_for(m, 8192, 8192, GROUP)] = None
    for bm in (64, 128, 256):
        if bm > 2 * max(m, 64):
            continue
        for bn in (64, 128):
            for bk, stages in ((64, 4), (128, 3), (128, 4), (64, 6)):
                cfg = gluon.WgmmaConfig(bm, bn, bk, stages)
                if gluon.smem_bytes(cfg) <= gluon.SMEM_LIMIT:
                    out[cfg] = None
    return list(out)


def label(cfg) -> str:
    p = "p" if cfg.persistent else ""
    return f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}s{cfg.stages}a{cfg.scales_ahead}x{cfg.split_k}{p}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,512,1024,2048")
    ap.add_argument("--shapes", default="8192x8192,28672x8192")
    ap.add_argument(
        "--kind", default="int4", choices=("int4", "nf4"), help="nf4: the public op runs Triton (routed)"
    )
    ap.add_argument(
        "--configs",
        default="",
        help="e.g. auto,m256n128k64s4,m128n64k128s3a2x2 instead of the sweep (aN: scales N steps ahead, "
        "xS: split K S ways; p: persistent; auto: gluon.config_for at each shape)",
    )
    args = ap.parse_args()
    global KIND
    KIND = args.kind
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100 / H200)", file=sys.stderr)
        return 2
    import openkernels.quant as Q
    from openkernels.quant import gluon
    from openkernels.quant import reference as R

    for spec in filter(None, args.configs.split(",")):
        if spec == "auto":  # config_for at each shape
            ONLY.append("auto")
            continue
        bm, bn, bk, st, ahead, split, persistent = re.fullmatch(
            r"m(\d+)n(\d+)k(\d+)s(\d+)(?:a(\d))?(?:x(\d))?(p)?", spec
        ).groups()
        ONLY.append(gluon.WgmmaConfig(int(bm), int(bn), int(bk), int(st), int(ahead or 1), int(split or 1),
                                      bool(persistent)))  # fmt: skip

    def quantize(w):
        if KIND == "nf4":
            return Q.quantize_nf4(w, GROUP, scale_dtype=torch.bfloat16)
        return Q.quantize_int4(w, GROUP, scale_dtype=torch.bfloat16)

    gluon.MAX_M = 1 << 16  # this study's calls only: the launcher's own routing is not used
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    log(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")

    failures: list[str] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    n, k = 4100, 4096
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    weight = quantize(w)
    b = torch.randn(n, device=dev, generator=gen)
    wd = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, GROUP, KIND, torch.float64)
    for m in (20, 300, 2048):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.double() @ wd.t() + b.double()
        bound = R.linear_error_bound(x.double(), wd, ref, x.dtype, weight_rounded_to=x.dtype)
        for cfg in configs(gluon, m, n, k):
            o = torch.full((m, n), float("nan"), device=dev, dtype=x.dtype)
            gluon.int4_linear_fwd(
                x, weight.qweight, weight.scales, weight.zeros, b, o, GROUP, KIND, config=cfg
            )
            over = int(((o.double() - ref).abs() > bound).sum())
            if torch.isnan(o).any() or over:
                failures.append(
                    f"M={m} {n}x{k} {label(cfg)}: {over} outside the contract, NaN {bool(torch.isnan(o).any())}"
                )
        log(f"check M={m} {n}x{k}: {len(configs(gluon, m, n, k))} configs run")
    del w, wd
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1

    results = []
    for n, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w16 = [w.to(torch.bfloat16)]
        w16 += [w16[0].clone() for _ in range(max(1, math.ceil(SERIES_BYTES / tensor_bytes(w16[0]))) - 1)]
        q = quantize(w)
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        copies = [Q.Int4Weight(q.qweight.clone(), q.scales.clone(), clone(q.zeros), q.group_size, q.kind)
                  for _ in range(max(2, math.ceil(SERIES_BYTES / q.nbytes())))]  # fmt: skip
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            rows = [
                (
                    "F.linear bf16",
                    rotating_graph_ms([lambda wc=wc, x=x: F.linear(x, wc) for wc in w16], CALLS),
                )
            ]
            rows.append(
                (
                    "public op (routed)",
                    rotating_graph_ms([lambda c=c, x=x: Q.int4_linear(x, c) for c in copies], CALLS),
                )
            )
            for cfg in configs(gluon, m, n, k):
                fns = [lambda c=c, cfg=cfg, x=x, out=out: gluon.int4_linear_fwd(x, c.qweight, c.scales, c.zeros, None, out, GROUP,
                                                                  KIND, config=cfg) for c in copies]  # fmt: skip
                rows.append((label(cfg), rotating_graph_ms(fns, CALLS)))
            base = rows[0][1]
            flops = 2 * m * n * k
            log(f"M={m} {n}x{k}: F.linear {base * 1e3:.1f} us ({flops / base / 1e9:.0f} TFLOP/s)")
            for name, t in sorted(rows[1:], key=lambda r: r[1]):
                log(
                    f"    {name:22s} {t * 1e3:8.1f} us  {base / t:5.2f}x F.linear  {flops / t / 1e9:5.0f} TFLOP/s"
                )
            results.append(((m, n, k), rows))
        del copies, w, w16, q
        torch.cuda.empty_cache()
    print(f"\n{props.name}: best wgmma config per case (CUDA-graph kernel time, x F.linear bf16)")
    for (m, n, k), rows in results:
        base = rows[0][1]
        best = min(rows[2:], key=lambda r: r[1])
        print(f"  M={m:5d} {n}x{k}: best {best[0]} {base / best[1]:.2f}x, public op {base / rows[1][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
