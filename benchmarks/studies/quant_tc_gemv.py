"""The tensor-core GEMV (quant's CUDA config "tc...": W as mma.m16n8k16's A operand) against
the kernels that take M = 1-16 today (issue 24): the public op's default route, openkernels'
Triton kernel, the CUDA GEMV (M = 1) and the one-round tensor-core kernel "mma" (M > 1),
torch's tinygemm (M = 1) and F.linear on the bf16 weight; with --tiled each tc config also on
the tiled codes (format.tile_codes).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_tc_gemv.py [--ms 1,4,16] [--shapes 8192x8192,28672x8192]

bf16 x, int4 with zeros, group 128; `--kinds int4,nf4` times NF4 (bfloat16 scales, no zeros) on
the same configs too (its public default, its Triton path and the CUDA GEMV), beside int4 in
the same process (issue 24: NF4 at int4's speed). Kernel time: a CUDA graph of calls rotating over enough
weight copies (>= 200 MB) that L2 holds none, timed with CUDA events. Every CUDA output is
checked against float64 (the error contract of tests/cases.py) before it is timed; a config
that fails is reported and not timed. Copy bandwidth (read + write) measured in the same
process; "frac" is weight bytes / kernel time over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import threading
import time

import torch
import torch.nn.functional as F

from openkernels.quant import cuda as G
from openkernels.quant import int4_linear
from openkernels.quant.bench.peers import run_tinygemm, setup_tinygemm
from openkernels.quant.format import tile_codes
from openkernels.quant.quantize import quantize_int4, quantize_nf4
from openkernels.quant.reference import int4_linear_ref
from openkernels.quant.triton import int4_linear_fwd as triton_fwd
from openkernels.shared.dev.bench import rotating_graph_ms, tensor_bytes

T0 = time.time()
DEV = torch.device("cuda")
GROUP = 128
SERIES_BYTES = 200e6
CALLS = 60


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def copy_gbps() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() / (start.elapsed_time(end) / 20 * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--shapes", default="8192x8192,28672x8192")
    parser.add_argument("--configs", default=",".join(G.TC_CONFIGS + G.TC_SPLIT_CONFIGS))
    parser.add_argument(
        "--tiled",
        action="store_true",
        help="each tc config also on format.tile_codes' layout (rows named '<config> tiled')",
    )
    parser.add_argument("--kinds", default="int4", help="int4, nf4 or both (comma-separated)")
    parser.add_argument(
        "--nf4-lookups",
        default=",".join(G.TC_NF4_LOOKUPS),
        help="NF4's tc configs with each of these register-kernel lookups (G.TC_NF4_LOOKUPS; rows of "
        "a lookup other than the default named '<config> <lookup>')",
    )
    parser.add_argument(
        "--json", default=None, help="every row as {n, k, m, name, us} (e2e_decode_step.py --tc-routes)"
    )
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    props = torch.cuda.get_device_properties(DEV)
    arch = f"sm_{props.major}{props.minor}"
    log(
        f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; building the tc library"
    )
    G._tc_library(arch)()
    lookups = args.nf4_lookups.split(",")
    if "nf4" in args.kinds:
        for lookup in lookups:
            G._tc_library(arch, nf4=True, lookup=lookup)()
    log("tc library built; the other CUDA kernels build in a thread")
    threading.Thread(target=lambda: G._library(arch)(), daemon=True).start()
    copy = copy_gbps()
    log(f"copy {copy:.0f} GB/s (read + write)")
    table = []
    kinds = args.kinds.split(",")
    for n, k, kind in [(n, k, kind) for n, k in shapes for kind in kinds]:
        gen = torch.Generator(device=DEV).manual_seed(n + k)
        w = torch.randn(n, k, device=DEV, generator=gen) * 0.02
        q = quantize_nf4(w, GROUP, scale_dtype=torch.bfloat16) if kind == "nf4" else quantize_int4(w, GROUP)
        wbf = [w.to(torch.bfloat16)] + [
            (torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16) for _ in range(2)
        ]
        del w
        qbytes = tensor_bytes(*(t for t in (q.qweight, q.scales, q.zeros) if t is not None))
        copies = max(2, math.ceil(SERIES_BYTES / qbytes))
        clone = lambda t: None if t is None else t.clone()  # noqa: E731
        qs = [(q.qweight.clone(), q.scales.clone(), clone(q.zeros)) for _ in range(copies)]
        tiled_qs = [(tile_codes(c[0]), c[1], c[2]) for c in qs] if args.tiled else []
        for m in ms:
            x = torch.randn(m, k, device=DEV, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
            ref = int4_linear_ref(x.double(), q.qweight, q.scales, q.zeros, GROUP, kind)
            bound = 1e-2 * ref.abs().max().item()  # loose sanity bound; tests/test_gemv.py has the contract
            rows = []

            label = f"{n}x{k} M={m} {kind}"

            def timed(name, fns, nbytes, note="", rows=rows, label=label):
                t = rotating_graph_ms(fns, CALLS, capture_error_mode="thread_local")
                rows.append((name, t, nbytes, note))
                log(f"  {label} {name}: {t * 1e3:.1f} us {note}")

            log(f"{n}x{k} M={m}: {copies} weight copies of {qbytes / 1e6:.1f} MB")
            timed("F.linear bf16", [lambda w=w, x=x: F.linear(x, w) for w in wbf], tensor_bytes(wbf[0]))
            timed(
                "triton",
                [lambda c=c, x=x, out=out, kind=kind: triton_fwd(x, *c, None, out, GROUP, kind) for c in qs],
                qbytes,
            )
            if m == 1 and kind == "int4":
                tg = [setup_tinygemm({"x": x, "q": type(q)(*c, GROUP, kind)}) for c in qs[:4]]
                timed(
                    "tinygemm",
                    [lambda st=st: run_tinygemm(st) for st in tg],
                    tensor_bytes(tg[0]["tiled"], tg[0]["sz"]),
                )
                del tg
            # What a user's call runs today (dispatch's default: the tc GEMV up to 8 rows on sm_90,
            # wgmma or Triton past it), through the public op.
            public = [dataclasses.replace(q, qweight=c[0], scales=c[1], zeros=c[2]) for c in qs]
            timed("public default", [lambda p=p, x=x: int4_linear(x, p) for p in public], qbytes)
            old = [("gemv r8", 8)] if m == 1 else [("mma (one-round)", "mma")]
            default_lookup = G.TC_NF4_LOOKUP
            tc_configs = [(c, c, qs, default_lookup) for c in args.configs.split(",")]
            if kind == "nf4":
                tc_configs += [(f"{c} {lk}", c, qs, lk) for c in args.configs.split(",") for lk in lookups
                               if lk != default_lookup]  # fmt: skip
            tc_configs += [
                (f"{c} tiled", c, tiled_qs, default_lookup) for c in args.configs.split(",") if tiled_qs
            ]
            for name, config, weights, lookup in [
                (name, config, qs, default_lookup) for name, config in old
            ] + tc_configs:
                G.TC_NF4_LOOKUP = lookup  # the library a call loads (NF4 only; captured with the graph)
                why = G.unsupported_call(x, *weights[0], None, out, GROUP, kind, config)
                if why is not None:
                    log(f"  {name}: not taken: {why}")
                    continue
                out.fill_(float("nan"))
                G.int4_linear_fwd(x, *weights[0], None, out, GROUP, kind, config=config)
                torch.cuda.synchronize()
                err = (out.double() - ref).abs().max().item()
                if G._broken or not err <= bound:
                    log(f"  {name}: WRONG: max |error| {err:.3g} (bound {bound:.3g}) {G._broken}")
                    rows.append((name, None, qbytes, f"WRONG {err:.3g}"))
                    continue
                timed(
                    name,
                    [
                        lambda c=c, x=x, out=out, config=config, kind=kind: G.int4_linear_fwd(
                            x, *c, None, out, GROUP, kind, config=config
                        )
                        for c in weights
                    ],
                    qbytes,
                    f"max|err| {err:.2g}",
                )
            G.TC_NF4_LOOKUP = default_lookup
            table.append((n, k, m, kind, rows))
    print(
        f"\n{props.name}: copy {copy:.0f} GB/s. Kernel time (CUDA graph, weights past L2), bf16 x, group 128"
    )
    for n, k, m, kind, rows in table:
        base = next(t for name, t, _, _ in rows if name == "F.linear bf16")
        print(f"\nM={m} N={n} K={k} {kind}")
        print(f"  {'contender':18s} {'us':>7s} {'GB/s':>6s} {'frac':>5s} {'x F.lin':>7s}  note")
        for name, t, nbytes, note in rows:
            if t is None:
                print(f"  {name:18s} {'-':>7s} {'-':>6s} {'-':>5s} {'-':>7s}  {note}")
                continue
            gbps = nbytes / (t * 1e-3) / 1e9
            print(f"  {name:18s} {t * 1e3:7.1f} {gbps:6.0f} {gbps / copy:5.2f} {base / t:6.2f}x  {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"n": n, "k": k, "m": m, "kind": kind, "name": name, "us": None if t is None else t * 1e3}
                       for n, k, m, kind, rows in table for name, t, _, _ in rows], f, indent=1)  # fmt: skip
    print(f"\ntotal {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
