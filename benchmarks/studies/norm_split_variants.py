"""The long-row Triton split forward's variants, kernel level, one process (issue 25; bf16):
RMSNorm and LayerNorm, each without and with a residual (h = x + r stored), on rows split over
programs that wait for each other (_norm_fwd_split_kernel). Variants: LayerNorm's chunk
statistics in two reductions or one pass (ONE_PASS), 64 or 32 elements per thread (4 or 8
warps on an 8192-column chunk; 8 or 16 on the 16384-column chunks of 1048576 columns), h held
across the wait in 16 bits or float32 (NARROW); beside them the launch the library picks
today (`default`: launch_config, the tile kernel at 16384 columns) and a torch copy of x
(`y.copy_(x)`: one read, one write of the same bytes) as the ceiling.

Each variant is launched from the launch plan (plan.plan with an explicit NormConfig, then
NARROW set) exactly as triton.norm_fwd launches it, checked against reference.norm_fwd in
float32 on the same inputs first (max abs difference of y, no NaN, h bit for bit; any failure
makes the exit status 1), then timed by triton.testing.do_bench (median) over input copies
that together exceed the 60 MB L2. GB/s count x read and y written (plus r read and h
written with a residual); cells are "fraction of copy/GB/s". Kernels are compiled first in
worker processes (Triton's disk cache; compiles hold the GIL, so threads would not help).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python benchmarks/studies/norm_split_variants.py [ROWSxCOLS,...] [rms,rms+res,ln,ln+res]
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
import triton

from openkernels.layernorm import reference as R
from openkernels.layernorm import triton as T
from openkernels.layernorm.triton import configs as C
from openkernels.layernorm.triton import kernels as K
from openkernels.layernorm.triton import plan as P
from openkernels.shared.launch import launch

T0 = time.time()
DEV, DT, EPS = "cuda", torch.bfloat16, 1e-5
SHAPES = "4096x16384,2048x32768,1024x65536,512x131072,256x262144,64x1048576"
OPS = "rms,rms+res,ln,ln+res"
L2_BYTES = 60e6
WARMUP_MS, REP_MS = 10, 60
KERNEL_NAMES = {
    "_norm_fwd_kernel": "tile",
    "_norm_fwd_split_kernel": "split",
    "_norm_fwd_looped_kernel": "looped",
}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:5.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Variant:
    """One split forward: one_pass (LayerNorm's ONE_PASS), per_thread (elements per thread
    on the chunk), narrow (NARROW)."""

    one_pass: bool
    per_thread: int
    narrow: bool

    def label(self, rms: bool) -> str:
        stats = "" if rms else ("1p-" if self.one_pass else "2p-")
        return f"{stats}e{self.per_thread}-{'N' if self.narrow else 'f'}"


def variants(rms: bool) -> list[Variant]:
    passes = (False,) if rms else (False, True)
    return [Variant(o, e, nw) for o in passes for e in (64, 32) for nw in (True, False)]


def _split_config(n: int, v: Variant) -> C.NormConfig:
    """The split config of variant v: launch_config's chunk (8192 columns, 16384 past 64 of
    them), v's elements per thread."""
    chunk = C.SPLIT_COLS if -(-n // C.SPLIT_COLS) <= C.MAX_SPLITS else 2 * C.SPLIT_COLS
    return C.NormConfig(1, chunk, max(1, chunk // (32 * v.per_thread)), "split", one_pass=v.one_pass)


def _launch_plan(m: int, n: int, rms: bool, v: Variant | None, sm_count: int) -> tuple[P.FwdPlan, dict]:
    """(plan, constexprs) of variant v, or of the library's own choice (v None)."""
    cfg = None if v is None else _split_config(n, v)
    lp = P.plan("fwd", m, n, DT, "cuda", n % 16 == 0, rms, sm_count, cfg)
    meta = dict(lp.constexprs)
    if v is not None:
        meta["NARROW"] = v.narrow
    return lp, meta


def _kernel_kwargs(lp: P.FwdPlan, meta: dict, op: str, m: int, n: int, t: dict) -> dict:
    """Every argument of lp's kernel by name, as triton.norm_fwd passes them; t holds the
    tensors (or, for the compile workers, their dtypes)."""
    rms, res = op.startswith("rms"), op.endswith("+res")
    args = (t["x"], t["r"] if res else t["x"], t["w"], t["x"] if rms else t["b"], t["y"],
            t["h"] if res else t["token"], t["rstd"] if rms else t["mean"], t["rstd"],
            m, n, n, n if res else 0, n, n if res else 0, EPS, 0.0)  # fmt: skip
    kw = dict(zip(T._FWD_ARG_NAMES, args))
    kw.update(IS_RMS=rms, HAS_RESIDUAL=res, STORE_RESIDUAL=res, HAS_WEIGHT=True, HAS_BIAS=not rms, **meta)
    if lp.config.mode == "split":
        kw.update(part_ptr=t["part"], arrived_ptr=t["arrived"], n_splits=lp.splits)
    return kw


def _warm(task: tuple) -> None:
    """Compile one launch into Triton's disk cache (a worker process): task = (kernel name,
    positional runtime arguments with dtypes for tensors, constexprs, num_warps)."""
    name, positional, constexprs, warps = task
    getattr(K, name).warmup(*positional, grid=(1,), num_warps=warps, num_stages=1, **dict(constexprs))


def _warm_task(lp: P.FwdPlan, kw: dict) -> tuple:
    fn = getattr(K, lp.kernel)
    values = {k: (v.dtype if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    positional = tuple(values[p.name] for p in fn.params if not p.is_constexpr)
    constexprs = tuple((p.name, values[p.name]) for p in fn.params if p.is_constexpr)
    return lp.kernel, positional, constexprs, lp.config.num_warps


def precompile(tasks: list[tuple]) -> None:
    """Every launch compiled in worker processes first; the timed process then loads them from
    Triton's cache (each compile holds the GIL for ~1 s: ~150 of them in one process would
    take longer than the timing)."""
    tasks = list(dict.fromkeys(tasks))
    workers = max(1, min(len(tasks), (os.cpu_count() or 2) - 1, 16))
    start = time.time()
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            for future in [pool.submit(_warm, task) for task in tasks]:
                future.result()
        log(f"compiled {len(tasks)} kernels in {workers} processes ({time.time() - start:.0f}s)")
    except Exception as error:  # compiled on first launch instead
        log(f"compiling in workers failed ({repr(error)[:200]}): compiling on first use")


def _bench(fn, sets: list[dict]) -> float:
    calls = [0]

    def step() -> None:
        fn(sets[calls[0] % len(sets)])
        calls[0] += 1

    return triton.testing.do_bench(step, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _check(op: str, t: dict, want: dict) -> str | None:
    """None if y, h, mean and rstd match the float32 reference; else what is wrong. y: within
    one bf16 ulp (2^-7 relative; rounding takes half) plus 1e-4 of max|y| for statistics that
    differ in float32's last digits; h: bit for bit (both round x + r once)."""
    y, y_ref = t["y"].float(), want["y"]
    if torch.isnan(y).any():
        return "NaN in y"
    diff = (y - y_ref).abs()
    scale = float(y_ref.abs().max())
    if bool((diff > 2.0**-7 * y_ref.abs() + 1e-4 * scale).any()):
        return f"y off by {float(diff.max()):.3g} (max|y| {scale:.3g})"
    if op.endswith("+res") and not torch.equal(t["h"], want["h"]):
        return "h differs from x + r rounded once"
    for stat in ("rstd",) if op.startswith("rms") else ("rstd", "mean"):
        rel = float(((t[stat] - want[stat]).abs() / want[stat].abs().clamp(min=1e-3)).max())
        if not rel <= 1e-4:
            return f"{stat} off by {rel:.3g} (relative)"
    return None


def run(shapes: list[tuple[int, int]], ops: list[str]) -> int:
    device = torch.device(DEV, torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    sm_count = props.multi_processor_count
    log(f"{props.name}, {sm_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    todo = []  # (op, m, n, label, plan, meta)
    for m, n in shapes:
        for op in ops:
            rms = op.startswith("rms")
            for v in [None, *variants(rms)]:
                lp, meta = _launch_plan(m, n, rms, v, sm_count)
                label = "default" if v is None else v.label(rms)
                todo.append((op, m, n, label, lp, meta))
    dtypes = dict.fromkeys(("x", "r", "w", "b", "y", "h", "token"), DT)
    dtypes.update(mean=torch.float32, rstd=torch.float32, part=torch.float32, arrived=torch.int32)
    precompile([_warm_task(lp, _kernel_kwargs(lp, meta, op, m, n, dtypes)) for op, m, n, _, lp, meta in todo])

    failures, rows = [], {}
    for m, n in shapes:
        per = m * n * DT.itemsize
        sets = [{"x": torch.randn(m, n, device=DEV, dtype=DT), "r": torch.randn(m, n, device=DEV, dtype=DT)}
                for _ in range(max(2, -(-int(2 * L2_BYTES) // per)))]  # fmt: skip
        fixed = {
            "w": (1 + 0.5 * torch.randn(n, device=DEV)).to(DT),
            "b": torch.randn(n, device=DEV).to(DT),
            "y": torch.empty(m, n, device=DEV, dtype=DT),
            "h": torch.empty(m, n, device=DEV, dtype=DT),
            "mean": torch.empty(m, device=DEV),
            "rstd": torch.empty(m, device=DEV),
            "token": T._dtype_token(DT, device),
            "arrived": T._arrival_counters(device, m),
        }
        copy_ms = _bench(lambda s, y=fixed["y"]: y.copy_(s["x"]), sets)
        copy = 2 * per / copy_ms / 1e6
        for op in ops:
            rms, res = op.startswith("rms"), op.endswith("+res")
            s0 = sets[0]
            want = {"y": torch.empty(m, n, device=DEV), "h": torch.empty(m, n, device=DEV, dtype=DT),
                    "mean": torch.empty(m, device=DEV), "rstd": torch.empty(m, device=DEV)}  # fmt: skip
            R.norm_fwd(s0["x"], s0["r"] if res else None, fixed["w"], None if rms else fixed["b"], want["y"],
                       want["h"] if res else None, None if rms else want["mean"], want["rstd"], eps=EPS,
                       weight_offset=0.0, rms=rms, h_dtype=DT)  # fmt: skip
            cells = {"copy": f"{copy:.0f}"}
            for op_, m_, n_, label, lp, meta in todo:
                if (op_, m_, n_) != (op, m, n):
                    continue
                t = dict(fixed, part=torch.empty(m * lp.splits * 2, device=DEV))
                for key in ("y", "h", "mean", "rstd"):  # unwritten outputs fail the check
                    t[key].fill_(float("nan"))
                kernel = f"{KERNEL_NAMES[lp.kernel]} w{lp.config.num_warps}"

                def call(s: dict, t=t, lp=lp, meta=meta, op=op, m=m, n=n) -> None:
                    launch(getattr(K, lp.kernel), lp.grid, **_kernel_kwargs(lp, meta, op, m, n, {**t, **s}),
                           num_warps=lp.config.num_warps, num_stages=lp.config.num_stages)  # fmt: skip

                name = label if label != "default" else f"default ({kernel})"
                try:
                    call(s0)
                    torch.cuda.synchronize()
                    problem = _check(op, {**t, **s0}, want)
                except Exception as error:
                    problem = f"raised {repr(error)[:160]}"
                if problem is not None:
                    failures.append(f"{op} {m}x{n} {name}: {problem}")
                    cells[label] = "FAIL"
                    continue
                gbs = per * (4 if res else 2) / _bench(call, sets) / 1e6
                cells[label] = f"{gbs / copy:.2f}/{gbs:.0f}"
                if label == "default":
                    cells["kernel"] = kernel
            rows[(op, m, n)] = cells
            print(_row(op, m, n, cells), flush=True)
        del sets
    _table(shapes, ops, rows)
    for failure in failures:
        print("FAILED", failure)
    log("done")
    return 1 if failures else 0


def _row(op: str, m: int, n: int, cells: dict) -> str:
    return f"{op:7s} {m:>5d}x{n:<8d} " + "  ".join(f"{k} {v}" for k, v in cells.items())


def _table(shapes: list[tuple[int, int]], ops: list[str], rows: dict) -> None:
    print("\nfraction of copy / GB/s (bf16). 2p/1p: LayerNorm's chunk statistics in two reductions /")
    print("one pass (ONE_PASS); e64/e32: elements per thread (4/8 warps on 8192-column chunks, 8/16 on")
    print("the 16384-column chunks of 1048576 columns); N/f: h held across the wait in bf16 (NARROW) /")
    print("float32; default: the library's launch today (kernel, warps); copy: y.copy_(x) GB/s.")
    for family in ("rms", "ln"):
        chosen = [op for op in ops if op.startswith(family)]
        if not chosen:
            continue
        labels = [v.label(family == "rms") for v in variants(family == "rms")]
        head = f"\n{'op':7s} {'shape':14s} {'copy':>5s} {'default':>10s} {'kernel':>10s} "
        print(head + " ".join(f"{label:>10s}" for label in labels))
        for op in chosen:
            for m, n in shapes:
                cells = rows.get((op, m, n), {})
                line = (
                    f"{op:7s} {f'{m}x{n}':14s} {cells.get('copy', '-'):>5s} {cells.get('default', '-'):>10s} "
                )
                line += f"{cells.get('kernel', '-'):>10s} "
                print(line + " ".join(f"{cells.get(label, '-'):>10s}" for label in labels))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("norm_split_variants: needs a CUDA device")
    argv = [*sys.argv[1:], None, None]
    shapes = [tuple(map(int, s.split("x"))) for s in (argv[0] or SHAPES).split(",")]
    ops = (argv[1] or OPS).split(",")
    unknown = set(ops) - set(OPS.split(","))
    if unknown:
        sys.exit(f"norm_split_variants: unknown ops {sorted(unknown)}; known: {OPS}")
    torch.manual_seed(0)
    sys.exit(run(shapes, ops))


if __name__ == "__main__":
    main()
