"""M = 1 int4 / NF4 linear on one GPU: the one-round CUDA GEMV, the persistent GEMV's configs,
openkernels' Triton kernel, torch's tinygemm and F.linear on the bf16 weight (issue 24). Then
M = 16 (int4 with zeros, the same weight copies): the one-round tensor-core kernel ("mma"),
the persistent tensor-core kernel's configs (G.MMA_PERSISTENT_CONFIGS), Triton, tinygemm and
F.linear.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_gemv_variants.py

bf16 x, group 128, N x K in {8192x8192, 28672x8192}, kinds int4 (zeros) and nf4. Each
contender is timed over enough weight copies (>= 200 MB per series) that L2 (60 MB) holds
none: a CUDA graph of the rotating calls replayed and timed with CUDA events (kernel time
back to back), and triton.testing.do_bench on the same rotation (wall per call, CPU launch
overhead included when it is longer than the kernel). Copy bandwidth (read + write of a
large device-to-device copy_) is measured in the same process. The CUDA library is built by
nvcc in a thread while the other contenders are timed. Every CUDA variant's output is
compared with the Triton kernel's (max abs diff) before it is timed.
"""

from __future__ import annotations

import math
import sys
import threading
import time

import torch
import torch.nn.functional as F

from openkernels.shared.dev.bench import rotating_do_bench_ms, rotating_graph_ms, tensor_bytes

T0 = time.time()
DEV = torch.device("cuda")
GROUP = 128
SHAPES = ((8192, 8192), (28672, 8192))
KINDS = ("int4", "nf4")
SERIES_BYTES = 200e6  # bytes of weight per timed series (L2: 60 MB)
CALLS = 60  # calls per captured graph (about)


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


from openkernels.quant import cuda as G  # noqa: E402
from openkernels.quant.quantize import quantize_int4, quantize_nf4  # noqa: E402
from openkernels.quant.triton import int4_linear_fwd as triton_fwd  # noqa: E402

props = torch.cuda.get_device_properties(DEV)
ARCH = f"sm_{props.major}{props.minor}"
log(f"{props.name}, {props.multi_processor_count} SMs, {ARCH}, torch {torch.__version__}")

# ---- the CUDA C++ library: nvcc in a thread while the rest runs --------------------------
build: dict = {}


def _build() -> None:
    t = time.time()
    try:
        G._library(ARCH)()
        build["ok"] = True
    except Exception as error:
        build["error"] = repr(error)
    build["s"] = time.time() - t


builder = threading.Thread(target=_build, daemon=True)
builder.start()


# ---- timing ------------------------------------------------------------------------------


def time_graph(fns) -> float | None:
    """ms per call: `fns` (one per weight copy) captured round-robin in one CUDA graph (thread_local: the nvcc build thread's
    CUDA calls do not break the capture)."""
    return rotating_graph_ms(fns, CALLS, capture_error_mode="thread_local")


def time_do_bench(fns) -> float:
    return rotating_do_bench_ms(fns)


def copy_gbps() -> float:
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    start.record()
    for _ in range(n):
        dst.copy_(src)
    end.record()
    end.synchronize()
    ms = start.elapsed_time(end) / n
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---- cases -------------------------------------------------------------------------------


def make_case(n: int, k: int, kind: str, w_copies: list) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(n + k + len(kind))
    w = torch.randn(n, k, device=DEV, generator=gen) * 0.02
    q = quantize_nf4(w, GROUP) if kind == "nf4" else quantize_int4(w, GROUP)
    del w
    qbytes = tensor_bytes(q.qweight, q.scales, q.zeros)
    copies = max(2, math.ceil(SERIES_BYTES / qbytes))
    qs = [
        (q.qweight.clone(), q.scales.clone(), None if q.zeros is None else q.zeros.clone())
        for _ in range(copies)
    ]
    x = torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
    case = {"n": n, "k": k, "kind": kind, "q": q, "qs": qs, "x": x, "qbytes": qbytes, "rows": []}
    case["out"] = torch.empty(1, n, device=DEV, dtype=torch.bfloat16)
    # tinygemm (int4 with zeros): its own tiled copies
    if kind == "int4":
        try:
            from openkernels.quant.bench.peers import setup_tinygemm
            from openkernels.quant.format import Int4Weight

            tg = []
            for qw, s, z in qs:
                st = setup_tinygemm({"x": x, "q": Int4Weight(qw, s, z, GROUP, "int4")})
                tg.append(st)
            case["tinygemm"] = tg
        except Exception as error:
            case["tinygemm_error"] = repr(error)
    case["w"] = w_copies
    return case


def triton_call(case, i):
    qw, s, z = case["qs"][i]
    x, out = case["x"], case["out"]
    kind = case["kind"]
    return lambda: triton_fwd(x, qw, s, z, None, out, GROUP, kind)


def cuda_call(case, i, config):
    qw, s, z = case["qs"][i]
    x, out = case["x"], case["out"]
    kind = case["kind"]
    return lambda: G.int4_linear_fwd(x, qw, s, z, None, out, GROUP, kind, config=config)


def record(case, name, fns, wbytes, note=""):
    try:
        ms = time_graph(fns)
        db = time_do_bench(fns)
    except Exception as error:
        log(f"  {name}: failed: {error!r}")
        case["rows"].append((name, None, None, wbytes, f"failed: {error!r}"[:80]))
        return
    case["rows"].append((name, ms, db, wbytes, note))
    shown = "n/a" if ms is None else f"{ms:.4f}"
    log(f"  {name}: graph {shown} ms, do_bench {db:.4f} ms")


log("copy bandwidth ...")
COPY = copy_gbps()
log(f"copy: {COPY:.0f} GB/s (read + write)")

cases = []
for n, k in SHAPES:
    wc = [(torch.randn(n, k, device=DEV) * 0.02).to(torch.bfloat16) for _ in range(2)]
    for kind in KINDS:
        log(f"setting up {kind} {n}x{k} ...")
        cases.append(make_case(n, k, kind, wc))

# M = 16: the int4 cases' weight copies, tinygemm's tiles and F.linear's weights, a 16-row x.
M16 = 16
for case in [c for c in cases if c["kind"] == "int4"]:
    gen = torch.Generator(device=DEV).manual_seed(case["n"] + 16)
    x16 = torch.randn(M16, case["k"], device=DEV, generator=gen).to(torch.bfloat16)
    c16 = {
        **case,
        "m": M16,
        "x": x16,
        "rows": [],
        "out": torch.empty(M16, case["n"], device=DEV, dtype=torch.bfloat16),
    }
    if "tinygemm" in case:
        c16["tinygemm"] = [{**st, "x": x16} for st in case["tinygemm"]]
    cases.append(c16)

for case in cases:
    n, k, kind, m = case["n"], case["k"], case["kind"], case.get("m", 1)
    log(f"{kind} M={m} {n}x{k}: {len(case['qs'])} weight copies of {case['qbytes'] / 1e6:.1f} MB")
    copies = range(len(case["qs"]))
    record(case, "triton", [triton_call(case, i) for i in copies], case["qbytes"])
    if "tinygemm" in case:
        from openkernels.quant.bench.peers import run_tinygemm

        tg = case["tinygemm"]
        record(
            case,
            "tinygemm",
            [lambda st=st: run_tinygemm(st) for st in tg],
            tensor_bytes(tg[0]["tiled"], tg[0]["sz"]),
        )
    elif kind == "int4":
        log(f"  tinygemm: setup failed: {case.get('tinygemm_error')}")
    x = case["x"]
    record(
        case,
        "F.linear bf16",
        [lambda w=w, x=x: F.linear(x, w) for w in case["w"]],
        tensor_bytes(case["w"][0]),
    )

log("waiting for the CUDA library build ...")
builder.join()
log(f"CUDA library: {build}")
CUDA_CONFIGS = [("cuda-old-r8", 8), ("cuda-old-r4", 4)] + [(f"cuda-{c}", c) for c in G.PERSISTENT_CONFIGS]
MMA_CONFIGS = [("cuda-mma (old)", "mma")] + [(f"cuda-{c}", c) for c in G.MMA_PERSISTENT_CONFIGS]
if build.get("ok"):
    for case in cases:
        n, k, kind, m = case["n"], case["k"], case["kind"], case.get("m", 1)
        log(f"{kind} M={m} {n}x{k}: CUDA variants")
        ref = torch.empty_like(case["out"])
        triton_call(case, 0)()
        ref.copy_(case["out"])
        scale = ref.float().abs().max().item()
        for name, config in MMA_CONFIGS if m > 1 else CUDA_CONFIGS:
            qw, s, z = case["qs"][0]
            why = G.unsupported_call(case["x"], qw, s, z, None, case["out"], GROUP, kind, config)
            if why is not None:
                log(f"  {name}: not taken: {why}")
                continue
            try:
                case["out"].fill_(float("nan"))
                cuda_call(case, 0, config)()
                torch.cuda.synchronize()
                diff = (case["out"].float() - ref.float()).abs().max().item()
            except Exception as error:
                log(f"  {name}: failed: {error!r}")
                continue
            if G._broken:
                log(f"  {name}: the CUDA library is off: {G._broken}")
                break
            note = f"max|d| vs triton {diff:.3g} (max|y| {scale:.3g})"
            log(f"  {name}: {note}")
            record(
                case, name, [cuda_call(case, i, config) for i in range(len(case["qs"]))], case["qbytes"], note
            )
else:
    log("no CUDA variants: the library did not build")

# ---- table -------------------------------------------------------------------------------
print()
print(f"{props.name}: copy {COPY:.0f} GB/s (read + write). ms: CUDA graph of rotating calls (kernel time);")
print("do_bench: wall per call. GB/s: weight + scales (+ zeros) bytes / graph ms; frac: of copy.")
for case in cases:
    print(f"\n{case['kind']} M={case.get('m', 1)} N={case['n']} K={case['k']} group {GROUP} bf16 x")
    base = next((r[1] or r[2] for r in case["rows"] if r[0] == "F.linear bf16" and (r[1] or r[2])), None)
    print(f"  {'contender':28s} {'ms':>8s} {'do_bench':>9s} {'GB/s':>7s} {'frac':>6s} {'vs F.lin':>8s}  note")
    for name, ms, db, wbytes, note in case["rows"]:
        t = ms if ms is not None else db
        if t is None:
            print(f"  {name:28s} {'-':>8s} {'-':>9s} {'-':>7s} {'-':>6s} {'-':>8s}  {note}")
            continue
        gbps = wbytes / (t * 1e-3) / 1e9
        speed = f"{base / t:.2f}x" if base else "-"
        ms_s = "n/a" if ms is None else f"{ms:.4f}"
        print(f"  {name:28s} {ms_s:>8s} {db:9.4f} {gbps:7.0f} {gbps / COPY:6.2f} {speed:>8s}  {note}")
print(f"\ntotal {time.time() - T0:.0f} s")
sys.exit(0)
