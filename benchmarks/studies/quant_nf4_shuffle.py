"""NF4 levels by warp shuffle against the table gather in the Triton quant kernels (issue 24),
on one NVIDIA GPU: correctness first, then time.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_nf4_shuffle.py

bf16 x, fp16 scales, N x K in {8192x8192, 28672x8192}, groups 64 and 128, M in {1, 4, 16}
(M = 1: the GEMV kernel; 4 and 16: the tiled kernel, whose NF4 unpacking takes the same
shuffle). The shuffle is what the launchers pick on CUDA (plan.nf4_shuffle); the gather is
forced by LinearConfig(nf4_gather=True) on the table's config, through the Triton launcher.

Correctness, per case (exit status 1 on any failure):
* the public op (`openkernels.quant.int4_linear`, Triton forced) and the gather launch against
  the float64 product of x and the dequantized weight, elementwise within the error contract
  (`reference.linear_error_bound`, NF4 levels rounded to bf16 on the tiled path), no NaN;
* the two against each other, within the same bound; "bits" says whether they are
  bit-identical (expected: the same float32 levels and the same arithmetic);
* `dequantize_int4` (Triton, the shuffle) against `reference.dequantize_int4_ref`: exact.
Max abs differences are printed against reference.int4_linear_ref (float32, rounded once).

Time, per case: int4 (with zeros) and NF4 through the Triton launcher (the table's config;
NF4 by shuffle and by gather; at M = 1 also NF4 shuffle at int4's split of K, since the
table's split 16 for NF4 was measured with the gather), and F.linear on the bf16 weight. Each
contender rotates over enough weight copies that they total >= 200 MB (L2: 60 MB) and is
timed by triton.testing.do_bench (median, wall per call, launch overhead included where it
exceeds the kernel) and by a CUDA graph of the rotating calls replayed and timed with CUDA
events (kernel time back to back).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import rotating_do_bench_ms, rotating_graph_ms, tensor_bytes

SHAPES = ((8192, 8192), (28672, 8192))
GROUPS = (64, 128)
MS = (1, 4, 16)
SERIES_BYTES = 200e6  # weight bytes per timed rotation (> 60 MB of L2)
CALLS = 60  # calls per captured graph (about)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def time_graph(fns) -> float | None:
    """ms per call: `fns` (one per weight copy) captured round-robin in one CUDA graph."""
    return rotating_graph_ms(fns, CALLS)


def time_do_bench(fns) -> float:
    return rotating_do_bench_ms(fns)


def triton_call(qt, x, parts, out, group: int, kind: str, cfg):
    """A call of the Triton launcher on one weight copy (qweight, scales, zeros)."""
    qw, s, z = parts
    return lambda: qt.int4_linear_fwd(x, qw, s, z, None, out, group, kind, config=cfg)


def check_case(Q, R, qt, weight, wd, x, failures: list) -> str:
    """Correctness of one (weight, x): the public op (shuffle) and the forced gather against
    the contract and each other; wd: the weight dequantized in float64. Returns the case's
    one-line summary."""
    from openkernels.shared import dispatch

    m, k = x.shape
    n, group = weight.qweight.shape[0], weight.group_size
    with dispatch.force("triton"):
        public = Q.int4_linear(x, weight)
    cfg = qt.config_for(m, n, k, group, x.device, "nf4")
    gather = torch.empty_like(public)
    qt.int4_linear_fwd(x, weight.qweight, weight.scales, weight.zeros, None, gather, group, "nf4",
                       config=dataclasses.replace(cfg, nf4_gather=True))  # fmt: skip
    ref32 = R.int4_linear_ref(x, weight.qweight, weight.scales, weight.zeros, group, "nf4")
    xd = x.double()
    ref = xd @ wd.t()
    rounded = cfg.path in ("tiled", "dequant")  # NF4 levels in bf16 for the MMA / the GEMM
    bound = R.linear_error_bound(xd, wd, ref, x.dtype, weight_rounded_to=x.dtype if rounded else None)
    name = f"M={m} {n}x{k} g{group} ({cfg.path}, split {cfg.split_k})"
    parts = []
    for label, out in (("shuffle", public), ("gather", gather)):
        got = out.double()
        if torch.isnan(got).any():
            failures.append(f"{name}: NaN in the {label} output")
        over = int(((got - ref).abs() > bound).sum())
        if over:
            failures.append(f"{name}: {label}: {over} outputs outside the error contract")
        parts.append(
            f"{label} max|d| vs ref32 {(out.float() - ref32.float()).abs().max().item():.3g} (over bound {over})"
        )
    between = (public.double() - gather.double()).abs()
    if (between > bound).any():
        failures.append(f"{name}: shuffle and gather differ beyond the contract")
    same = torch.equal(public, gather)
    parts.append(f"shuffle vs gather max|d| {between.max().item():.3g} bits {'same' if same else 'DIFFER'}")
    return f"{name}: " + "; ".join(parts) + f"; max|y| {ref.abs().max().item():.3g}"


def main() -> int:
    if not torch.cuda.is_available() or torch.version.hip is not None:
        print("needs an NVIDIA GPU (the shuffle is inline PTX; ROCm keeps the gather)", file=sys.stderr)
        return 2
    import openkernels.quant as Q
    from openkernels.quant import reference as R
    from openkernels.quant import triton as qt
    from openkernels.quant.triton.configs import gemv_split
    from openkernels.shared import dispatch

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    log(
        f"{props.name}, {props.multi_processor_count} SMs, sm_{props.major}{props.minor}, torch {torch.__version__}"
    )
    assert qt._shuffle(dev), "the launcher does not pick the shuffle on this device"
    failures: list[str] = []
    tables = []
    for n, k in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(n + k)
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        w16 = [w.to(torch.bfloat16)]
        w16 += [w16[0].clone() for _ in range(max(1, math.ceil(SERIES_BYTES / tensor_bytes(w16[0]))) - 1)]
        for group in GROUPS:
            nf4 = Q.quantize_nf4(w, group)
            int4 = Q.quantize_int4(w, group)
            # dequantize: the shuffle in the dequantize kernel, exact against the reference
            with dispatch.force("triton"):
                deq = Q.dequantize_int4(nf4, torch.bfloat16)
            want = R.dequantize_int4_ref(nf4.qweight, nf4.scales, None, group, "nf4", torch.bfloat16)
            if not torch.equal(deq, want):
                d = (deq.float() - want.float()).abs().max().item()
                failures.append(f"dequantize {n}x{k} g{group}: differs from the reference (max|d| {d:.3g})")
            log(f"dequantize nf4 {n}x{k} g{group}: {'exact' if torch.equal(deq, want) else 'DIFFERS'}")
            del deq, want
            copies = {kind: [(q.qweight.clone(), q.scales.clone(), None if q.zeros is None else q.zeros.clone())
                             for _ in range(max(2, math.ceil(SERIES_BYTES / tensor_bytes(q.qweight, q.scales, q.zeros))))]
                      for kind, q in (("int4", int4), ("nf4", nf4))}  # fmt: skip
            wd = R.dequantize_int4_ref(nf4.qweight, nf4.scales, None, group, "nf4", torch.float64)
            for m in MS:
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                log(check_case(Q, R, qt, nf4, wd, x, failures))
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                cfg_nf4 = qt.config_for(m, n, k, group, dev, "nf4")
                contenders = [("int4 (zeros)", "int4", None), ("nf4 shuffle", "nf4", None),
                              ("nf4 gather", "nf4", dataclasses.replace(cfg_nf4, nf4_gather=True))]  # fmt: skip
                if cfg_nf4.path == "gemv":
                    split = gemv_split(n, k, cfg_nf4.block_n, cfg_nf4.block_k, props.multi_processor_count)
                    contenders.append(
                        (f"nf4 shuffle split {split}", "nf4", dataclasses.replace(cfg_nf4, split_k=split))
                    )
                rows = []
                for label, kind, cfg in contenders:
                    fns = [triton_call(qt, x, parts, out, group, kind, cfg) for parts in copies[kind]]
                    fns[0]()
                    if torch.isnan(out).any():
                        failures.append(f"{label} M={m} {n}x{k} g{group}: NaN in the timed output")
                    rows.append((label, time_do_bench(fns), time_graph(fns)))
                fns = [lambda w=wc, x=x: F.linear(x, w) for wc in w16]
                rows.append(("F.linear bf16", time_do_bench(fns), time_graph(fns)))
                for label, db, gr in rows:
                    log(f"  M={m} {n}x{k} g{group} {label}: do_bench {db:.4f} ms, graph "
                        f"{'n/a' if gr is None else f'{gr:.4f}'} ms")  # fmt: skip
                tables.append(((m, n, k, group, cfg_nf4.path, cfg_nf4.split_k), rows))
            del copies, wd
            torch.cuda.empty_cache()
        del w, w16

    print(f"\n{props.name}. ms: do_bench median (wall per call) / CUDA graph of the rotating calls (kernel")
    print("time). ratios from the graph times (do_bench where the capture failed).")
    for (m, n, k, group, path, split), rows in tables:
        t = {label: gr if gr is not None else db for label, db, gr in rows}
        print(f"\nM={m} N={n} K={k} group {group} bf16 x (NF4 table config: {path}, split {split})")
        print(f"  {'contender':24s} {'do_bench':>9s} {'graph':>8s} {'vs F.lin':>8s} {'vs int4':>8s}")
        for label, db, gr in rows:
            gs = "n/a" if gr is None else f"{gr:.4f}"
            print(f"  {label:24s} {db:9.4f} {gs:>8s} {t['F.linear bf16'] / t[label]:7.2f}x "
                  f"{t['int4 (zeros)'] / t[label]:7.2f}x")  # fmt: skip
        print(f"  nf4 gather / shuffle time: {t['nf4 gather'] / t['nf4 shuffle']:.2f}x")
    if failures:
        print(f"\nFAILED ({len(failures)}):")
        for f in failures:
            print(f"  {f}")
        return 1
    print("\nall NF4 outputs within the error contract, no NaN; dequantize exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
