"""NF4 on the Gluon wgmma kernel (64-1024 rows of x) with each of its lookups (issue 24: NF4 at
int4's speed; gluon.NF4_LOOKUPS): "registers" (byte permutes of constant words, 12
instructions per pair of codes), "pairs" (each byte of codes indexes 256 level pairs in
shared memory), "levels" (each code indexes 16 levels in shared memory), int4 on the same
config beside them. One sm_90 GPU:

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/quant_nf4_wgmma_table.py [--ms 64,128,512,1024] [--lookups registers,pairs]

Correctness first (exit status 1, nothing timed): every lookup at M = 64, 300 and 1024 on a
4100 x 4096 weight (odd N, a bias), the config gluon.config_for picks, against the float64
product of x and the dequantized weight within the error contract (W rounded to x's dtype),
no NaN. Then CUDA-graph kernel time (weight copies rotated past the 60 MB L2), bf16 x,
bfloat16 scales, group 128, us and x F.linear on the bf16 weight.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import rotating_graph_ms, tensor_bytes

GROUP = 128
SERIES_BYTES = 200e6
CALLS = 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,512,1024")
    ap.add_argument("--shapes", default="8192x8192,28672x8192")
    ap.add_argument("--lookups", default="registers,pairs,levels")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100 / H200)", file=sys.stderr)
        return 2
    import openkernels.quant as Q
    from openkernels.quant import gluon
    from openkernels.quant import reference as R

    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    lookups = args.lookups.split(",")
    default_lookup = gluon.NF4_LOOKUP
    gluon.MAX_M = 1 << 16  # this study's forced calls only
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__, flush=True)

    def run(x, q, bias, out, kind, lookup):
        gluon.NF4_LOOKUP = lookup
        cfg = gluon.config_for(x.shape[0], q.qweight.shape[0], x.shape[1], GROUP)
        gluon.int4_linear_fwd(x, q.qweight, q.scales, q.zeros, bias, out, GROUP, kind, config=cfg)

    failures = []
    gen = torch.Generator(device=dev).manual_seed(0)
    n, k = 4100, 4096
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    q = Q.quantize_nf4(w, GROUP, scale_dtype=torch.bfloat16)
    bias = torch.randn(n, device=dev, generator=gen)
    wd = R.dequantize_int4_ref(q.qweight, q.scales, q.zeros, GROUP, "nf4", torch.float64)
    for m in (64, 300, 1024):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.double() @ wd.t() + bias.double()
        bound = R.linear_error_bound(x.double(), wd, ref, x.dtype, weight_rounded_to=x.dtype)
        for lookup in lookups:
            o = torch.full((m, n), float("nan"), device=dev, dtype=x.dtype)
            run(x, q, bias, o, "nf4", lookup)
            torch.cuda.synchronize()
            over = int(((o.double() - ref).abs() > bound).sum())
            nan = bool(torch.isnan(o).any())
            print(f"check M={m} lookup={lookup}: {over} outside the contract, NaN {nan}", flush=True)
            if over or nan:
                failures.append(f"M={m} lookup={lookup}")
    if failures:
        print("FAILED:", ", ".join(failures))
        return 1

    for n, k in shapes:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w16 = [w.to(torch.bfloat16)]
        w16 += [w16[0].clone() for _ in range(max(1, math.ceil(SERIES_BYTES / tensor_bytes(w16[0]))) - 1)]
        weights = {}
        for kind, quantize in (("int4", Q.quantize_int4), ("nf4", Q.quantize_nf4)):
            one = quantize(w, GROUP, scale_dtype=torch.bfloat16)
            weights[kind] = [Q.Int4Weight(one.qweight.clone(), one.scales.clone(),
                                          None if one.zeros is None else one.zeros.clone(), GROUP, kind)
                             for _ in range(max(2, math.ceil(SERIES_BYTES / one.nbytes())))]  # fmt: skip
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            base = rotating_graph_ms([lambda wc=wc, x=x: F.linear(x, wc) for wc in w16], CALLS)
            rows = [("int4", rotating_graph_ms(
                [lambda c=c, x=x, out=out: run(x, c, None, out, "int4", "registers") for c in weights["int4"]], CALLS))]  # fmt: skip
            for lookup in lookups:
                rows.append((f"nf4 {lookup}", rotating_graph_ms(
                    [lambda c=c, cp=lookup, x=x, out=out: run(x, c, None, out, "nf4", cp) for c in weights["nf4"]], CALLS)))  # fmt: skip
            gluon.NF4_LOOKUP = default_lookup
            rows.append(("nf4 public op (routed)", rotating_graph_ms(
                [lambda c=c, x=x: Q.int4_linear(x, c) for c in weights["nf4"]], CALLS)))  # fmt: skip
            cfg = gluon.config_for(m, n, k, GROUP)
            print(f"M={m} {n}x{k} (config {cfg}): F.linear {base * 1e3:.1f} us", flush=True)
            int4_t = rows[0][1]
            for name, t in rows:
                if t is None:
                    print(f"    {name:24s} capture failed")
                    continue
                print(f"    {name:24s} {t * 1e3:8.1f} us  {base / t:5.2f}x F.linear  {int4_t / t:5.2f}x int4's speed",
                      flush=True)  # fmt: skip
        del weights, w16, w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
