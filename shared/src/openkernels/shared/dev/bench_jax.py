"""The JAX front ends against the PyTorch API on the same GPU, in the same process.

A family's ``jax_cases(device)`` (in its bench module) returns `JaxCase`s: input sets made
with torch and handed to JAX through DLPack (zero copy, so both sides read the same
memory), the PyTorch call, and the JAX call. `run_jax_cases` times, on rotating input sets
(3x the 60 MB L2), three contenders:

* ``torch``: the family's PyTorch function (its Triton kernel);
* ``jax``: the JAX function under ``jax.jit`` on the "triton" backend (the same kernel
  through jax-triton);
* ``jnp``: the JAX function under ``jax.jit`` on the "jnp" backend (XLA's own fusion of the
  jax.numpy composition).

Two clocks, as in the PyTorch benchmarks (docs/benchmarking.md):

* wall: a batch of calls ended by one device sync, the same for all three, so the host's
  dispatch cost counts on both sides (JAX launches on its own stream, which CUDA events
  recorded by torch would not see). A Python-launched fwd+bwd step is host-bound on the
  lent H200 host, where one jitted JAX call is not: wall time favours JAX there.
* kernel (`kernel_time=True`): device time in kernels per call, from torch.profiler, whose
  CUPTI session records every kernel of the process, XLA's and jax-triton's included. It
  compares what the GPU does. A profiler session slows later Python launches in the
  process, so the two clocks come from separate runs.

It also reports how far the JAX output is from the PyTorch output (0.0 when the same
kernel gives the same bits).
"""

from __future__ import annotations

import os

# JAX takes 75% of the GPU at start by default; torch allocates in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import torch

from .. import jax as okjax
from .bench import L2_BYTES, BenchPoint

__all__ = ["JaxCase", "JaxMeasurement", "run_jax_cases", "format_jax_table", "to_jax"]


@dataclass
class JaxCase(BenchPoint):
    """One point: `make_inputs(device)` gives a dict of torch tensors; `torch_fn` and
    `jax_fn` take that dict (jax_fn with each tensor as a jax.Array) and return the result
    (an array or a tuple of arrays). `bytes` is the least traffic of the work (GB/s),
    `flops` its FLOPs for compute-bound work (TFLOP/s)."""

    make_inputs: Callable[[torch.device], dict[str, torch.Tensor]]
    torch_fn: Callable[[dict[str, Any]], Any]
    jax_fn: Callable[[dict[str, Any]], Any]
    flops: int = 0

    @property
    def label(self) -> str:
        return f"{self.family}.{self.op} {self.direction} {self.size_label()}"


@dataclass
class JaxMeasurement:
    label: str
    torch_ms: float
    jax_ms: float
    jnp_ms: float
    bytes: int
    flops: int
    max_diff: float  # largest |jax - torch| over the outputs (0.0: identical)
    clock: str = "wall"  # or "kernel": device time in kernels per call

    @property
    def jax_over_torch(self) -> float:
        """JAX time / PyTorch time: <= 1.05 meets the 5% bar."""
        return self.jax_ms / self.torch_ms

    @property
    def jnp_over_jax(self) -> float:
        """XLA's jnp composition time / ours: > 1 means the kernel wins."""
        return self.jnp_ms / self.jax_ms


def to_jax(t: torch.Tensor) -> jax.Array:
    """The same device memory as a jax.Array (DLPack, no copy)."""
    return jax.dlpack.from_dlpack(t.contiguous())


def _leaves(result: Any) -> list:
    return [r for r in jax.tree_util.tree_leaves(result) if r is not None]


def _sync_torch(_: Any) -> None:
    torch.cuda.synchronize()


def _sync_jax(result: Any) -> None:
    jax.block_until_ready(result)


def _time_ms(
    call: Callable[[Any], Any], sets: Sequence[Any], sync: Callable[[Any], None], batch: int
) -> float:
    """Wall milliseconds per call: the median of 7 batches, each ended by one sync."""
    for s in sets:  # compile, allocate, warm the caches of both sides
        sync(call(s))
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        out = None
        for i in range(batch):
            out = call(sets[i % len(sets)])
        sync(out)
        samples.append((time.perf_counter() - start) * 1e3 / batch)
    return statistics.median(samples)


def _kernel_ms(
    call: Callable[[Any], Any], sets: Sequence[Any], sync: Callable[[Any], None], iters: int = 20
) -> float:
    """Device milliseconds per call spent in kernels (and copies/memsets), torch.profiler."""
    for s in sets:
        sync(call(s))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = None
        for i in range(iters):
            out = call(sets[i % len(sets)])
        sync(out)
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0)
    return total_us / iters / 1e3


def _max_diff(a: Any, b: Any) -> float:
    worst = 0.0
    for x, y in zip(_leaves(a), _leaves(b)):
        xt = torch.from_dlpack(x) if not isinstance(x, torch.Tensor) else x
        yt = torch.from_dlpack(y) if not isinstance(y, torch.Tensor) else y
        diff = (xt.double() - yt.double()).abs().nan_to_num(0.0, 0.0, 0.0)
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
    return worst


def run_jax_cases(
    cases: Sequence[JaxCase],
    *,
    batch: int = 50,
    kernel_time: bool = False,
    log: Callable[[str], None] = print,
) -> list[JaxMeasurement]:
    """Time every case's three contenders (wall clock, or kernel time with `kernel_time`);
    needs a GPU build of JAX with jax-triton."""
    device = torch.device("cuda")
    results = []
    clock = _kernel_ms if kernel_time else functools.partial(_time_ms, batch=batch)
    for case in cases:
        count = min(8, max(2, math.ceil(3 * L2_BYTES / max(case.bytes, 1))))
        torch_sets = [case.make_inputs(device) for _ in range(count)]
        torch.cuda.synchronize()
        jax_sets = [{k: to_jax(v) for k, v in s.items()} for s in torch_sets]
        times = {}
        for backend in ("triton", "jnp"):
            # A fresh function per backend: jax.jit caches traces by function, and the
            # backend is fixed when a function is traced (inside this block).
            fn = jax.jit(lambda s, f=case.jax_fn: f(s))
            with okjax.use_backend(backend):
                times[backend] = clock(fn, jax_sets, _sync_jax)
                if backend == "triton":
                    jax_out = fn(jax_sets[0])
        torch_ms = clock(case.torch_fn, torch_sets, _sync_torch)
        diff = _max_diff(jax_out, case.torch_fn(torch_sets[0]))
        m = JaxMeasurement(case.label, torch_ms, times["triton"], times["jnp"], case.bytes, case.flops, diff,
                           "kernel" if kernel_time else "wall")  # fmt: skip
        results.append(m)
        log(format_jax_table([m], header=len(results) == 1))
        del torch_sets, jax_sets, jax_out
    return results


def format_jax_table(results: Sequence[JaxMeasurement], *, header: bool = True) -> str:
    lines = []
    if header:
        lines.append(
            f"{'case (' + results[0].clock + ' time)':<58} {'torch ms':>9} {'jax ms':>9} {'jnp ms':>9} {'jax/torch':>9} "
            f"{'jnp/jax':>8} {'jax rate':>12} {'max|jax-torch|':>14}"
        )
    for m in results:
        rate = (
            f"{m.flops / m.jax_ms / 1e9:.1f} TFLOP/s" if m.flops else f"{m.bytes / m.jax_ms / 1e6:.0f} GB/s"
        )
        lines.append(
            f"{m.label:<58} {m.torch_ms:>9.4f} {m.jax_ms:>9.4f} {m.jnp_ms:>9.4f} {m.jax_over_torch:>9.3f} "
            f"{m.jnp_over_jax:>8.2f} {rate:>12} {m.max_diff:>14.3g}"
        )
    return "\n".join(lines)
