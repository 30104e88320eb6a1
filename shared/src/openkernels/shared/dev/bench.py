"""Benchmark harness shared by every family.

A family declares `BenchCase`s: a shape, a dtype, a direction, the bytes (or FLOPs) the
work must move at least, a factory of input sets and the contenders (ours and the peers)
as functions of one input set. `run_cases` times every contender on the same inputs in
the same process, rotating input sets so the L2 cache (60 MB on H200) is not what gets
measured, and reports GB/s and the ratio to the device copy, or for compute-bound cases
(`flops` set) TFLOP/s and the ratio to a dense bf16 matmul, both ceilings measured in the
same run (on CPUs the copy STREAM-style, the best of many copies: `copy_ceiling`). Timing
uses triton.testing.do_bench (CUDA events, median) on GPUs and a perf_counter median on
CPUs, with the samples' spread. Nothing here runs at import.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "BenchPoint",
    "BenchCase",
    "Check",
    "score",
    "Measurement",
    "CopyCeiling",
    "copy_ceiling",
    "copy_ceiling_gbps",
    "last_level_cache_bytes",
    "stream_buffer_bytes",
    "matmul_ceiling_tflops",
    "time_ms",
    "host_only_us",
    "tensor_bytes",
    "timed",
    "kernel_ms",
    "compiled_peer",
    "run_cases",
    "format_table",
    "write_json",
]

L2_BYTES = 60 * 2**20  # H200; rotation targets 3x this so nothing stays resident


@dataclass
class BenchPoint:
    """What names a benchmark point and sizes its work, for the PyTorch harness (BenchCase)
    and the JAX one (bench_jax.JaxCase): `bytes` counts each input read once and each
    output written once."""

    family: str
    op: str
    direction: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int

    def size_label(self) -> str:
        """The shape and dtype as labels show them: "4096x8192 bfloat16"."""
        return "x".join(map(str, self.shape)) + " " + str(self.dtype).removeprefix("torch.")


@dataclass
class BenchCase(BenchPoint):
    """One benchmark point.

    make_inputs(device) returns one input set (a dict); contenders map a name ("ours",
    "torch", "torch.compile", "liger", ...) to a function of that set. `bytes` counts each
    input read once and each output written once; `flops` is set for compute-bound work
    (reported in TFLOP/s against the matmul ceiling; `bytes` still sizes the input rotation).
    """

    make_inputs: Callable[[torch.device], dict[str, Any]]
    contenders: dict[str, Callable[[dict[str, Any]], Any]]
    flops: int = 0
    setup: dict[str, Callable[[dict[str, Any]], Any]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.op} {self.direction} {self.size_label()}"


@dataclass
class Check:
    """One self-check: an implementation's result against the float64 reference.

    error: the largest |ours - ref| / (atol + rtol |ref|) over all elements, with the
    tolerance table of openkernels.shared.dev.testing; <= 1 passes, NaN never does."""

    op: str
    direction: str
    implementation: str
    dtype: str
    error: float
    ok: bool


def score(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, *, atol: float | None = None
) -> tuple[float, bool]:
    """(error, ok) of `actual` against `expected` under the tolerance of `dtype`; `atol`
    replaces the table's absolute tolerance where the caller derives a wider one (outputs
    that are long sums of rounded terms, like attention's)."""
    from .testing import tolerance

    tol = tolerance(dtype)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape or (torch.isnan(a) & ~torch.isnan(e)).any():
        return float("nan"), False
    abs_tol = tol.atol if atol is None else atol
    ratio = ((a - e).abs() / (abs_tol + tol.rtol * e.abs())).nan_to_num(0.0)
    error = float(ratio.max()) if ratio.numel() else 0.0
    return error, error <= 1.0


@dataclass
class Measurement:
    family: str
    op: str
    direction: str
    shape: tuple[int, ...]
    dtype: str
    contender: str
    ms: float
    gbps: float
    tflops: float
    ratio_to_ceiling: float
    device: str
    error: str = ""
    # Device time of the kernels alone (torch.profiler), without the host's launch gaps:
    # what a step costs the GPU when the host keeps up (0: not measured).
    kernel_ms: float = 0.0
    # The case's FLOPs (0: a memory-bound case, reported in GB/s against the copy ceiling;
    # else compute-bound, reported in TFLOP/s against the matmul ceiling).
    flops: int = 0
    # How noisy `ms` is: the interquartile range of the timed calls over their median (CPUs;
    # 0: not measured, as on GPUs, where do_bench gives the median alone).
    spread: float = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(
    fn: Callable[[dict[str, Any]], Any],
    input_sets: Sequence[dict[str, Any]],
    device: torch.device,
    **options: float,
) -> float:
    """Median milliseconds of fn over rotating input sets (options: warmup_ms, rep_ms of `timed`)."""
    return timed(fn, input_sets, device, **options)[0]


def timed(
    fn: Callable[[dict[str, Any]], Any],
    input_sets: Sequence[dict[str, Any]],
    device: torch.device,
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
) -> tuple[float, float]:
    """(median milliseconds, spread) of fn over rotating input sets. spread: the
    interquartile range of the CPU samples over their median; 0 on GPUs (not measured)."""
    index = [0]

    def step() -> None:
        fn(input_sets[index[0] % len(input_sets)])
        index[0] += 1

    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=warmup_ms, rep=rep_ms, return_mode="median")), 0.0
    step()  # warm-up: first-call compilation and allocator growth stay out of the numbers
    samples = []
    deadline = time.perf_counter() + max(rep_ms, 1.0) / 1e3
    while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 200):
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(samples)
    quartiles = statistics.quantiles(samples, n=4)
    return median, (quartiles[2] - quartiles[0]) / median if median > 0 else 0.0


def compiled_peer(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile(fn, dynamic=False) as a benchmark peer, with dynamo's recompile limits
    raised: dynamic=False specializes per shape, dtype and grad mode, and past the default
    limit of 8 recompiles of one code object the peer silently runs eager (seen in a GPU
    run of the activations benchmark)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 1024)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
    return torch.compile(fn, dynamic=False)


def kernel_ms(
    fn: Callable[[dict[str, Any]], Any],
    input_sets: Sequence[dict[str, Any]],
    device: torch.device,
    iters: int = 10,
) -> float:
    """Milliseconds of device time per call spent in kernels (memsets and copies included),
    summed from torch.profiler over `iters` calls on rotating input sets. 0 off CUDA."""
    if device.type != "cuda":
        return 0.0
    for s in input_sets[:2]:
        fn(s)
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(input_sets[i % len(input_sets)])
        _sync(device)
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total_us / iters / 1e3


def rotating_graph_ms(
    fns: Sequence[Callable[[], Any]], calls: int = 60, capture_error_mode: str = "global"
) -> float | None:
    """Kernel milliseconds per call of `fns` (one per input copy, rotated so L2 holds none),
    captured round-robin in one CUDA graph of about `calls` calls and replayed back to back:
    launch overhead left out. None when the capture fails (reported on stderr).
    capture_error_mode "thread_local" lets other threads make CUDA calls meanwhile."""
    reps = max(1, -(-calls // len(fns)))
    try:
        for f in fns:
            f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
            for _ in range(reps):
                for f in fns:
                    f()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        replays = 10
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) / (replays * reps * len(fns))
    except Exception as error:  # a call that cannot be captured: the caller reports None
        print(f"graph capture failed: {error!r}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes held by the tensors (None skipped): a weight copy's size when rotating past L2."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def host_only_us(fn: Callable[[], Any], calls: int = 50, warmup: int = 5) -> float:
    """Host microseconds per call of `fn` on a CUDA device, timed while a queued sleep kernel
    keeps the GPU busy: neither the kernels' time nor a full launch queue enters it (keep
    calls x launches per call well under the queue's ~1000 entries). `warmup` calls first
    (compiles, and shared.replay's recording on a key's second call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time queued first
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def eager_wall_us(calls: Sequence[Callable[[], Any]], reps: int = 5, per_rep: int = 100) -> float:
    """Eager wall microseconds per call as a user's loop sees them (host and kernels): the best
    of `reps` repetitions of `per_rep` calls cycling through `calls` (rotate copies of the
    inputs past the L2), after 20 warm-up calls (compiles, replay's recording)."""
    for i in range(20):
        calls[i % len(calls)]()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for i in range(per_rep):
            calls[i % len(calls)]()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / per_rep * 1e6)
    return best


def rotating_do_bench_ms(fns: Sequence[Callable[[], Any]]) -> float:
    """Median wall milliseconds per call of `fns` (rotated), triton.testing.do_bench: CPU launch
    overhead included where it is longer than the kernel."""
    from triton.testing import do_bench

    turn = [0]

    def call() -> None:
        fns[turn[0] % len(fns)]()
        turn[0] += 1

    return do_bench(call, warmup=10, rep=100, return_mode="median")


@dataclass(frozen=True)
class CopyCeiling:
    """A measured copy bandwidth (bytes read + written per second, in GB/s).

    gbps: the ceiling. CPUs: the best of `repeats` (STREAM's rule: the least disturbed
    copy); GPUs: the do_bench median. repeats: GB/s of every timed copy (one on GPUs).
    buffer_bytes: the size of each of the two buffers; threads: torch's intra-op threads
    (CPUs; 0 on GPUs); cache_bytes: the last-level cache the buffers were sized against
    (CPUs; 0 on GPUs)."""

    gbps: float
    repeats: tuple[float, ...]
    buffer_bytes: int
    threads: int = 0
    cache_bytes: int = 0

    def describe(self) -> str:
        """One line: the ceiling, how it was measured, and how far its repeats spread."""
        mib = self.buffer_bytes / 2**20
        if not self.threads:
            return f"copy ceiling: {self.gbps:.0f} GB/s (median copy of 2 x {mib:.0f} MiB)"
        low, median = min(self.repeats), statistics.median(self.repeats)
        return (
            f"copy ceiling: {self.gbps:.1f} GB/s, the best of {len(self.repeats)} copies of 2 x {mib:.0f} MiB "
            f"({self.buffer_bytes / self.cache_bytes:.3g}x the {self.cache_bytes / 2**20:.0f} MiB last-level "
            f"cache) on {self.threads} threads; they ran at {low:.1f}-{self.gbps:.1f} GB/s (median "
            f"{median:.1f}), so one timing here now can be {1 - low / self.gbps:.0%} off"
        )


def last_level_cache_bytes() -> int:
    """The last-level caches of all CPUs together (Linux sysfs: one entry per cache instance,
    told apart by the CPUs sharing it), or 32 MiB where that cannot be read."""
    import glob

    sizes: dict[tuple[int, str], int] = {}
    for index in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cache/index[0-9]*"):
        try:
            with open(f"{index}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{index}/level") as f:
                level = int(f.read())
            with open(f"{index}/shared_cpu_list") as f:
                shared = f.read().strip()
            with open(f"{index}/size") as f:
                text = f.read().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes[level, shared] = int(digits) * unit
    top = max((level for level, _ in sizes), default=0)
    return sum(size for (level, _), size in sizes.items() if level == top) or 32 * 2**20


def stream_buffer_bytes(cache_bytes: int, free_bytes: int | None = None) -> int:
    """Bytes of each of the CPU copy ceiling's two buffers: STREAM's 4x the last-level caches
    together, so the copy streams from DRAM; at least 64 MiB, at most 2 GiB, and at most a
    quarter of the free memory (`free_bytes`) but never below 16 MiB."""
    nbytes = min(max(4 * cache_bytes, 64 * 2**20), 2**31)
    return nbytes if free_bytes is None else max(min(nbytes, free_bytes // 4), 16 * 2**20)


def copy_ceiling(device: torch.device | str, nbytes: int | None = None) -> CopyCeiling:
    """Device copy bandwidth, measured now.

    GPUs: a copy between two buffers of `nbytes` (default 2 GiB), the do_bench median.
    CPUs, by STREAM's rules: buffers of `stream_buffer_bytes` unless `nbytes` is given (4x
    the last-level caches, so the copy streams from DRAM); torch's copy_ on all its intra-op threads; pages touched before timing; the best
    of at least 10 copies (up to 100 within about 0.3 s). The median of a 200 ms loop that
    it replaces varied 14-42 GB/s between runs on the 2-core development machine while other
    work ran: a median of a loaded machine measures the load, the best copy the memory."""
    device = torch.device(device)
    if device.type == "cuda":
        n = (nbytes or 2**31) // 4
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        ms = time_ms(lambda _: dst.copy_(src), [{}], device, rep_ms=200)
        gbps = 2 * n * 4 / ms / 1e6
        return CopyCeiling(gbps, (gbps,), n * 4)
    cache = last_level_cache_bytes()
    if nbytes is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
            free = None
        nbytes = stream_buffer_bytes(cache, free)
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32).fill_(1.0)  # fill_: every page touched, in parallel
    dst = torch.empty_like(src).fill_(0.0)
    dst.copy_(src)  # warm-up
    repeats = []
    deadline = time.perf_counter() + 0.3
    while len(repeats) < 10 or (time.perf_counter() < deadline and len(repeats) < 100):
        start = time.perf_counter()
        dst.copy_(src)
        repeats.append(2 * n * 4 / (time.perf_counter() - start) / 1e9)
    return CopyCeiling(max(repeats), tuple(repeats), n * 4, torch.get_num_threads(), cache)


def copy_ceiling_gbps(device: torch.device | str, nbytes: int | None = None) -> float:
    """Device copy bandwidth (bytes read + written per second, in GB/s), measured now: the
    ceiling of memory-bound work (`copy_ceiling(device).gbps`)."""
    return copy_ceiling(device, nbytes).gbps


def matmul_ceiling_tflops(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, n: int = 8192
) -> float:
    """Dense matmul throughput (2 n^3 FLOPs per product, in TFLOP/s), measured now: the
    ceiling of compute-bound work. GPUs: an n x n x n product in `dtype`, timed like the
    cases (do_bench median). CPUs: n capped at 1024 so it stays quick (a fraction of a
    second), in float32 unless `dtype` runs faster: CPUs without native bf16/fp16 matmul
    run those dtypes far below float32 (1.3 vs 50 GFLOP/s on the 2-core development
    machine), and CPU attention (torch's and ours) computes in float32 there. A 256 probe
    decides whether `dtype` is worth the full size."""
    device = torch.device(device)
    if device.type == "cuda":
        return _matmul_tflops(device, dtype, n)
    n = min(n, 1024)
    best = _matmul_tflops(device, torch.float32, n)
    if dtype != torch.float32 and _matmul_tflops(device, dtype, min(n, 256)) > best / 2:
        best = max(best, _matmul_tflops(device, dtype, n))
    return best


def _matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda _: torch.matmul(a, b, out=c), [{}], device, rep_ms=200)
    return 2 * n**3 / ms / 1e9


def _input_sets(case: BenchCase, device: torch.device) -> list[dict[str, Any]]:
    """Enough input sets that together they exceed 3x the L2 cache."""
    first = case.make_inputs(device)
    per_set = max(case.bytes, 1)
    count = 1 if device.type == "cpu" else min(8, max(2, math.ceil(3 * L2_BYTES / per_set)))
    return [first] + [case.make_inputs(device) for _ in range(count - 1)]


def run_cases(
    cases: Sequence[BenchCase],
    device: torch.device | str,
    *,
    ceiling_gbps: float | None = None,
    ceiling_tflops: float | None = None,
    only: Sequence[str] | None = None,
    rep_ms: float = 100.0,
    same_size_copy: bool = True,
    kernel_time: bool = False,
) -> list[Measurement]:
    """Time every contender of every case on the same inputs; errors are recorded, not raised.

    kernel_time: also measure each contender's device time in kernels (Measurement.kernel_ms),
    for steps whose host work (autograd, Python launchers) can outrun the GPU. Measured in a
    second pass after every wall time: a torch.profiler session leaves per-launch overhead
    behind in the process, which inflated the wall times of Python-launched contenders timed
    after it (seen on H200: 0.17 vs 0.07 ms for a 0.07 ms kernel).

    Cases with `flops` are compute-bound: their ratio_to_ceiling is TFLOP/s over
    `ceiling_tflops` (the bf16 matmul, measured here when not given) and they get no
    same-size copy; the others' is GB/s over `ceiling_gbps` (the device copy, measured
    here when not given). A ceiling no case needs is not measured."""
    device = torch.device(device)
    if any(not c.flops for c in cases):
        ceiling_gbps = ceiling_gbps or copy_ceiling_gbps(device)
    if any(c.flops for c in cases):
        ceiling_tflops = ceiling_tflops or matmul_ceiling_tflops(device)
    results = []
    for case in cases:
        sets = _input_sets(case, device)
        contenders = dict(case.contenders)
        if same_size_copy and not case.flops:
            # A copy moving the same bytes: what the memory system gives a problem this small.
            contenders["copy"] = _same_size_copy(case.bytes, device, len(sets))
        for name, fn in contenders.items():
            if only and name not in only:
                continue
            prepared = sets
            try:
                if name in case.setup:
                    prepared = [case.setup[name](s) for s in sets]
                ms, spread = timed(fn, prepared, device, rep_ms=rep_ms)
                error = ""
            except Exception as exc:  # a peer that cannot run this case is reported, not fatal
                ms, spread, error = float("nan"), 0.0, f"{type(exc).__name__}: {str(exc)[:120]}"
            gbps = case.bytes / ms / 1e6 if ms == ms else float("nan")
            tflops = case.flops / ms / 1e9 if case.flops and ms == ms else 0.0
            ratio = tflops / ceiling_tflops if case.flops else gbps / ceiling_gbps
            results.append(
                Measurement(
                    case.family,
                    case.op,
                    case.direction,
                    tuple(case.shape),
                    str(case.dtype).removeprefix("torch."),
                    name,
                    ms,
                    gbps,
                    tflops,
                    ratio,
                    _device_name(device),
                    error,
                    flops=case.flops,
                    spread=spread,
                )
            )
            _sync(device)
        del sets
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if kernel_time and device.type == "cuda":
        _add_kernel_times(cases, results, device, only)
    return results


def _add_kernel_times(
    cases: Sequence[BenchCase], results: list[Measurement], device: torch.device, only: Sequence[str] | None
) -> None:
    """Fill Measurement.kernel_ms for every contender that ran, on fresh input sets."""
    ran = {(m.op, m.direction, m.shape, m.dtype, m.contender): m for m in results if not m.error}
    for case in cases:
        sets = _input_sets(case, device)
        for name, fn in case.contenders.items():
            m = ran.get(
                (case.op, case.direction, tuple(case.shape), str(case.dtype).removeprefix("torch."), name)
            )
            if m is None or (only and name not in only):
                continue
            try:
                prepared = [case.setup[name](s) for s in sets] if name in case.setup else sets
                m.kernel_ms = kernel_ms(fn, prepared, device)
            except Exception:  # it ran in the first pass; a failure here leaves kernel_ms at 0
                m.kernel_ms = 0.0
        del sets
        torch.cuda.empty_cache()


def _same_size_copy(nbytes: int, device: torch.device, count: int) -> Callable[[dict[str, Any]], Any]:
    n = max(1, nbytes // 2 // 4)
    pairs = [(torch.empty(n, device=device), torch.empty(n, device=device)) for _ in range(count)]
    index = [0]

    def copy(_: dict[str, Any]) -> Any:
        src, dst = pairs[index[0] % count]
        index[0] += 1
        return dst.copy_(src)

    return copy


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()}"


def format_table(
    results: Sequence[Measurement], *, ceiling_gbps: float | None = None, ceiling_tflops: float | None = None
) -> str:
    """One row per case and contender: ms, GB/s, ratio to the ceiling, and the peer's time as
    a multiple of ours (> 1: ours is faster; not shown for the same-size copy); then, where
    measured, the kernels' device time, its GB/s and the same multiple on device time.

    Compute-bound cases (Measurement.flops set) go in a second table of the same columns in
    TFLOP/s, against the matmul ceiling (`ceiling_tflops`; when not given, read back from
    the measurements' ratios). Where the timings' spread was measured (CPUs), a last line
    says how noisy they are."""
    byte_rows = [m for m in results if not m.flops]
    flop_rows = [m for m in results if m.flops]
    lines = []
    if byte_rows or not flop_rows:
        if ceiling_gbps:
            lines.append(f"copy ceiling: {ceiling_gbps:.0f} GB/s")
        lines += _table(byte_rows, "GB/s", lambda m: f"{m.gbps:8.0f}", _kernel_gbps)
    if flop_rows:
        if lines:
            lines.append("")
        ceiling_tflops = ceiling_tflops or next(
            (m.tflops / m.ratio_to_ceiling for m in flop_rows if m.tflops and m.ratio_to_ceiling), None
        )
        if ceiling_tflops:
            lines.append(f"matmul ceiling: {_tflops(ceiling_tflops, 0)} TFLOP/s")
        lines += _table(flop_rows, "TFLOP/s", lambda m: _tflops(m.tflops, 8), _kernel_tflops)
    noisy = [m for m in results if m.spread and not m.error]
    if noisy:
        worst = max(noisy, key=lambda m: m.spread)
        lines.append(
            f"timing noise (interquartile range of each row's timed calls / their median): median "
            f"{statistics.median(m.spread for m in noisy):.0%}, largest {worst.spread:.0%} "
            f"({_label(worst)}, {worst.contender})"
        )
    return "\n".join(lines)


def _label(m: Measurement) -> str:
    return f"{m.op} {m.direction} {'x'.join(map(str, m.shape))} {m.dtype}"


def _kernel_gbps(m: Measurement) -> str:
    nbytes = m.gbps * m.ms * 1e6
    return f"{nbytes / m.kernel_ms / 1e6:9.0f}"


def _kernel_tflops(m: Measurement) -> str:
    return _tflops(m.flops / m.kernel_ms / 1e9, 9)


def _tflops(value: float, width: int) -> str:
    """One decimal at GPU rates (hundreds of TFLOP/s), four below 1 (CPUs)."""
    return f"{value:{width}.1f}" if value >= 1 else f"{value:{width}.4f}"


def _table(
    results: Sequence[Measurement],
    unit: str,
    rate: Callable[[Measurement], str],
    kernel_rate: Callable[[Measurement], str],
) -> list[str]:
    header = f"{'case':<46} {'contender':<14} {'ms':>9} {unit:>8} {'ceil':>6}  vs ours  {'kern ms':>8} {'kern ' + unit:>9}"
    lines = [header, "-" * len(header)]
    ours = {(m.op, m.direction, m.shape, m.dtype): m.ms for m in results if m.contender == "ours"}
    kernel_base = {
        (m.op, m.direction, m.shape, m.dtype): m.kernel_ms for m in results if m.contender == "ours"
    }
    for m in results:
        label = _label(m)
        if m.error:
            lines.append(f"{label:<46} {m.contender:<14} {'error':>9}  {m.error}")
            continue
        base = ours.get((m.op, m.direction, m.shape, m.dtype))
        speed = f"{m.ms / base:5.2f}x" if base and m.contender not in ("ours", "copy") else ""
        kern = ""
        if m.kernel_ms:
            kern_base = kernel_base.get((m.op, m.direction, m.shape, m.dtype))
            kern_speed = f" {m.kernel_ms / kern_base:5.2f}x" if kern_base and m.contender != "ours" else ""
            kern = f"  {m.kernel_ms:8.4f} {kernel_rate(m)}{kern_speed}"
        lines.append(
            f"{label:<46} {m.contender:<14} {m.ms:9.4f} {rate(m)} {m.ratio_to_ceiling:6.3f}  {speed:>6}{kern}"
        )
    return lines


def write_json(results: Sequence[Measurement], path: str, **meta: Any) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [asdict(m) for m in results]}, f, indent=1)
