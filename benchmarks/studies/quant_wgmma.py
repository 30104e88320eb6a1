"""The Gluon Hopper int4_linear kernel (openkernels.quant.gluon, dispatch name "wgmma", issue
24) against the Triton default and F.linear on the bf16 weight, on one sm_90 GPU: correctness
first, then time.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_wgmma.py

bf16 x, bf16 scales with zeros (fp16 scales and symmetric weights in the checks), N x K in
{8192x8192, 28672x8192}, group 128, M in {16, 64, 128, 256}. The kernel's point: the Triton
tiled kernel waits for each wgmma right after issuing it (its dequantization and the tensor
cores never overlap: 0.58-0.65x of F.linear at M = 128 on H200); this one issues step i's
wgmma asynchronously and dequantizes step i + 1 under it.

Correctness, per case (exit status 1 on any failure, before any timing):
* the public op forced to "wgmma" (and every swept config) against the float64 product of x
  and the dequantized weight, elementwise within the error contract
  (`reference.linear_error_bound`, W rounded to x's dtype: the kernel scales before the
  product), no NaN; the Triton default within the same bound; their max difference printed;
* `gluon.unsupported_call` must accept each case (else the Triton launcher would have run it).

Time, per case: the kernel at its default config and the sweep (gluon.sweep_configs: stages
3 / 4, 64- / 128-column steps, 128-row weight tiles), the Triton default (the table's config),
and F.linear on the bf16 weight. Each contender rotates over enough weight copies that they
total >= 200 MB (L2: 60 MB) and is timed by triton.testing.do_bench (median, wall per call)
and by a CUDA graph of the rotating calls replayed and timed with CUDA events (kernel time).
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import rotating_do_bench_ms, rotating_graph_ms, tensor_bytes

SHAPES = ((8192, 8192), (28672, 8192))
GROUP = 128
MS = (16, 64, 128, 256)
SERIES_BYTES = 200e6  # weight bytes per timed rotation (> 60 MB of L2)
CALLS = 60  # calls per captured graph (about)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def check(Q, R, gluon, failures: list, dev) -> None:
    """Correctness before timing: default and swept configs, fp16 scales, symmetric, a bias."""
    from openkernels.shared import dispatch

    gen = torch.Generator(device=dev).manual_seed(0)
    for n, k, group, m, scale_dtype, symmetric, bias in (
        (4100, 4096, 128, 16, torch.bfloat16, False, False),
        (4100, 4096, 128, 128, torch.bfloat16, False, True),
        (2052, 2048, 64, 200, torch.float16, True, True),
        (2052, 2048, 128, 256, torch.float16, False, False),
        (1000, 128, 128, 64, torch.bfloat16, True, False),
    ):
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        weight = Q.quantize_int4(w, group, symmetric, scale_dtype=scale_dtype)
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, device=dev, generator=gen) if bias else None
        wd = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, group, "int4", torch.float64)
        ref = x.double() @ wd.t() + (0 if b is None else b.double())
        bound = R.linear_error_bound(x.double(), wd, ref, x.dtype, weight_rounded_to=x.dtype)
        name = f"M={m} {n}x{k} g{group} {str(scale_dtype)[6:]} scales{' sym' if symmetric else ''}{' bias' if bias else ''}"
        out = torch.empty(m, n, device=dev, dtype=x.dtype)
        why = gluon.unsupported_call(x, weight.qweight, weight.scales, weight.zeros, b, out, group, "int4")
        if why is not None:
            failures.append(f"{name}: the wgmma launcher refuses it ({why})")
            continue
        with dispatch.force("int4_linear:wgmma"):
            got = Q.int4_linear(x, weight, b)
        with dispatch.force("triton"):
            triton_out = Q.int4_linear(x, weight, b)
        outs = [("wgmma", got), ("triton", triton_out)]
        for cfg in gluon.sweep_configs(m):
            o = torch.empty_like(got)
            gluon.int4_linear_fwd(
                x, weight.qweight, weight.scales, weight.zeros, b, o, group, "int4", config=cfg
            )
            outs.append((str(cfg), o))
        for label, o in outs:
            if torch.isnan(o).any():
                failures.append(f"{name}: NaN in the {label} output")
            over = int(((o.double() - ref).abs() > bound).sum())
            if over:
                failures.append(f"{name}: {label}: {over} outputs outside the error contract")
        d = (got.double() - triton_out.double()).abs().max().item()
        log(f"check {name}: {len(outs)} outputs within the contract; wgmma vs triton max|d| {d:.3g}")


def main() -> int:
    if not torch.cuda.is_available() or torch.version.hip is not None:
        print("needs an NVIDIA GPU", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU (H100 / H200): wgmma and TMA", file=sys.stderr)
        return 2
    import openkernels.quant as Q
    from openkernels.quant import gluon
    from openkernels.quant import reference as R
    from openkernels.quant import triton as qt

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    log(
        f"{props.name}, {props.multi_processor_count} SMs, sm_{props.major}{props.minor}, torch {torch.__version__}"
    )
    failures: list[str] = []
    check(Q, R, gluon, failures, dev)
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for f in failures:
            print(f"  {f}")
        return 1

    tables = []
    for n, k in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w16 = [w.to(torch.bfloat16)]
        w16 += [w16[0].clone() for _ in range(max(1, math.ceil(SERIES_BYTES / tensor_bytes(w16[0]))) - 1)]
        q = Q.quantize_int4(w, GROUP, scale_dtype=torch.bfloat16)
        copies = [(q.qweight.clone(), q.scales.clone(), q.zeros.clone())
                  for _ in range(max(2, math.ceil(SERIES_BYTES / tensor_bytes(q.qweight, q.scales, q.zeros))))]  # fmt: skip
        for m in MS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            contenders = []
            default = gluon.config_for(m, n, k, GROUP)
            for cfg in gluon.sweep_configs(m):
                label = f"wgmma {'default ' if cfg == default else ''}m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}s{cfg.stages}"
                fns = [lambda p=p, cfg=cfg, x=x, out=out: gluon.int4_linear_fwd(x, *p, None, out, GROUP, "int4", config=cfg)
                       for p in copies]  # fmt: skip
                contenders.append((label, fns))
            tcfg = qt.config_for(m, n, k, GROUP, dev)
            contenders.append((f"triton {tcfg.path} m{tcfg.block_m}k{tcfg.block_k}",
                               [lambda p=p, x=x, out=out: qt.int4_linear_fwd(x, *p, None, out, GROUP, "int4") for p in copies]))  # fmt: skip
            contenders.append(("F.linear bf16", [lambda wc=wc, x=x: F.linear(x, wc) for wc in w16]))
            rows = []
            for label, fns in contenders:
                fns[0]()
                torch.cuda.synchronize()
                if torch.isnan(out).any():
                    failures.append(f"{label} M={m} {n}x{k}: NaN in the timed output")
                db, gr = rotating_do_bench_ms(fns), rotating_graph_ms(fns, CALLS)
                rows.append((label, db, gr))
                log(
                    f"  M={m} {n}x{k} {label}: do_bench {db:.4f} ms, graph {'n/a' if gr is None else f'{gr:.4f}'} ms"
                )
            tables.append(((m, n, k), rows))
        del copies, w, w16
        torch.cuda.empty_cache()

    print(f"\n{props.name}. ms: do_bench median (wall per call) / CUDA graph of the rotating calls (kernel")
    print("time). ratios from the graph times (do_bench where the capture failed).")
    for (m, n, k), rows in tables:
        t = {label: gr if gr is not None else db for label, db, gr in rows}
        triton_label = next(label for label in t if label.startswith("triton"))
        print(f"\nM={m} N={n} K={k} group {GROUP}, bf16 x, bf16 scales with zeros")
        print(f"  {'contender':30s} {'do_bench':>9s} {'graph':>8s} {'vs F.lin':>8s} {'vs triton':>9s}")
        for label, db, gr in rows:
            gs = "n/a" if gr is None else f"{gr:.4f}"
            print(f"  {label:30s} {db:9.4f} {gs:>8s} {t['F.linear bf16'] / t[label]:7.2f}x "
                  f"{t[triton_label] / t[label]:8.2f}x")  # fmt: skip
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for f in failures:
            print(f"  {f}")
        return 1
    print("\nall outputs within the error contract, no NaN")
    return 0


if __name__ == "__main__":
    sys.exit(main())
