"""What every asv suite shares: one measuring pass per suite, then a lookup per benchmark.

asv runs each benchmark and parameter combination in a process of its own ("spawn" launch,
so no CUDA state is ever forked). Importing torch and starting CUDA in each of those
hundreds of processes would cost more than the measurements, so each suite measures every
combination it is asked for once, in `setup_cache` (a single process), and its `track_*`
benchmarks read the numbers back:

- GPUs: `openkernels.shared.bench.time_ms`, the do_bench median of CUDA-event times; CPUs:
  its perf_counter median. Input sets rotate past the 60 MB L2 (three times its size).
- `track_ms`: milliseconds per call, the number regressions are judged on (asv reads a
  larger value as worse); `track_gbps` / `track_tflops`: the same measurement as throughput.
- The `backend` parameter forces one implementation through `openkernels.shared.dispatch`
  ("triton" on GPUs, "cpu" on CPUs, "reference" on both) in strict mode, so a backend
  that cannot run raises instead of timing a fallback.

Environment (set by benchmarks/asv_history.py; plain `asv run` needs neither):

- OPENKERNELS_ASV_SELECT: the regex given to `asv run --bench`; `setup_cache` measures only
  the combinations it selects.
- OPENKERNELS_ASV_SMOKE=1: each combination runs once on a tiny shape, untimed: the
  suite's code is exercised in seconds (`nox -s asv-smoke`, part of the CPU test run).

The suites keep to the families' public API and their `bench.cases`, which have kept their
signatures since each family landed, so today's suites also measure past commits.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

SELECT_ENV = "OPENKERNELS_ASV_SELECT"
SMOKE_ENV = "OPENKERNELS_ASV_SMOKE"
BACKENDS = ["triton", "cpu", "reference"]
DTYPES = ["bfloat16", "float16", "float32"]
L2_BYTES = 60 * 2**20
MAX_INPUT_SETS = 8
# asv's default of 60 s per setup_cache covers a few dozen GPU measurements, not a suite's.
SETUP_CACHE_TIMEOUT = 3600
VERSION = "1"  # bump when what the suites measure changes meaning (old results drop out)


class NotApplicableError(NotImplementedError):
    """This parameter combination does not exist on this machine (asv records it as n/a)."""


def smoke() -> bool:
    return os.environ.get(SMOKE_ENV, "0") not in ("", "0")


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split("x"))


def only_case(cases: Sequence[Any]) -> Any:
    if len(cases) != 1:
        raise RuntimeError(f"expected one benchmark case, got {len(cases)}")
    return cases[0]


def _input_sets(case: Any, contender: str, dev: Any) -> list[Any]:
    """Enough input sets to stream three L2s' worth of bytes between reuses."""
    count = 1 if smoke() else max(1, min(MAX_INPUT_SETS, math.ceil(3 * L2_BYTES / max(case.bytes, 1))))
    sets = [case.make_inputs(dev) for _ in range(count)]
    prepare = getattr(case, "setup", {}).get(contender)
    return [prepare(s) for s in sets] if prepare else sets


def _measure(case: Any, contender: str, backend: str, dev: Any) -> dict[str, float]:
    import torch

    from openkernels.shared import dispatch
    from openkernels.shared.bench import time_ms

    fn = case.contenders[contender]
    sets = _input_sets(case, contender, dev)
    with dispatch.force(backend), dispatch.strict():
        fn(sets[0])  # compiles, and raises here when the forced backend cannot run
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if smoke():
            start = time.perf_counter()
            fn(sets[0])
            ms = (time.perf_counter() - start) * 1e3
        else:
            ms = time_ms(fn, sets, dev)
    out = {"ms": ms, "gbps": case.bytes / ms / 1e6}
    flops = getattr(case, "flops", 0)
    if flops:
        out["tflops"] = flops / ms / 1e9
    return out


def _unsupported(exc: Exception) -> bool:
    from openkernels.shared.dispatch import UnsupportedError

    return isinstance(exc, UnsupportedError)


def _free(dev: Any) -> None:
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class Suite:
    """Base of every suite. A suite sets `params` and `param_names` (`dtype` then `backend`
    last), defines `build(dev, **params)` returning the family's BenchCase for one
    combination (or raising NotApplicableError), and defines its own two-line `setup_cache`
    calling `measure_all`: asv keys the cache by the module and line of that function, so
    a shared one would hand every suite the first suite's numbers.

    asv skips names that start with "_", so `from . import _harness` keeps this class out
    of discovery; mix in `GBps` and/or `TFLOPs` for throughput beside `track_ms`.
    """

    params: list[list[str]] = []
    param_names: list[str] = []
    timeout = SETUP_CACHE_TIMEOUT
    # asv keeps results only while a benchmark's version matches; by default that is a hash
    # of its source, which changes with any edit of the harness. Bump on a change of meaning.
    version = VERSION

    # Shapes per device kind, for suites with a "shape" parameter (its values are the union).
    gpu_shapes: Sequence[str] = ()
    cpu_shapes: Sequence[str] = ()

    def build(self, dev: Any, **params: str) -> Any:
        raise NotImplementedError

    def contender(self, **params: str) -> str:
        """The name of our contender in the case (the decode cases name it by cache format)."""
        return "ours"

    def applies(self, device_type: str, **params: str) -> bool:
        """Whether a combination is measured on a device of this kind ("cuda" or "cpu").

        Backends: Triton on GPUs in the 16-bit dtypes the bars are written in; the C++ CPU
        kernels on CPUs in bfloat16 and float32; the reference on both, as the baseline
        (bfloat16 on GPUs). Shapes: the family's grid for that device kind. Decided without
        importing torch, so benchmarks/asv_history.py can select before asv starts anything.
        """
        backend, dtype = params["backend"], params["dtype"]
        gpu = device_type == "cuda"
        allowed = {
            "triton": ("bfloat16", "float16") if gpu else (),
            "cpu": () if gpu else ("bfloat16", "float32"),
            "reference": ("bfloat16",) if gpu else ("bfloat16", "float32"),
        }
        if dtype not in allowed[backend]:
            return False
        shapes = self.gpu_shapes if gpu else self.cpu_shapes
        return "shape" not in params or params["shape"] in shapes

    def combos(self, device_type: str) -> list[tuple[str, ...]]:
        """The parameter combinations measured on this kind of device."""
        return [
            combo
            for combo in itertools.product(*self.params)
            if self.applies(device_type, **dict(zip(self.param_names, combo, strict=True)))
        ]

    def _selected(self, combo: tuple[str, ...]) -> bool:
        pattern = os.environ.get(SELECT_ENV)
        if not pattern:
            return True
        module = type(self).__module__.split(".", 1)[-1]  # asv names benchmarks from its root
        label = f"({', '.join(repr(v) for v in combo)})"
        names = [n for n in dir(self) if n.startswith("track_")]
        return any(re.search(pattern, f"{module}.{type(self).__name__}.{n}{label}") for n in names)

    def measure_all(self) -> dict[tuple[str, ...], dict[str, Any]]:
        """Every selected combination measured once: {combo: {"ms", "gbps", "tflops"}} or
        {combo: {"error"}}; combinations that do not apply here are left out."""
        dev = device()
        results: dict[tuple[str, ...], dict[str, Any]] = {}
        for combo in self.combos(dev.type):
            if not self._selected(combo):
                continue
            case = None
            try:
                params = dict(zip(self.param_names, combo, strict=True))
                case = self.build(dev, **params)
                results[combo] = _measure(case, self.contender(**params), params["backend"], dev)
            except NotApplicableError:
                pass
            except Exception as exc:
                if _unsupported(exc):  # the forced backend declines this dtype or shape: n/a
                    print(f"{type(self).__name__}{combo}: n/a: {exc}", file=sys.stderr)
                    continue
                print(f"{type(self).__name__}{combo}: {exc!r}", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                results[combo] = {"error": f"{type(exc).__name__}: {exc}"}  # fails its lookups
            finally:
                del case
                _free(dev)
        return results

    def setup(self, cache: dict, *combo: str) -> None:
        found = cache.get(tuple(combo))
        if found is None:
            raise NotImplementedError  # not on this machine, or not selected: asv records n/a
        if "error" in found:
            raise RuntimeError(found["error"])
        self.found = found

    def track_ms(self, cache: dict, *combo: str) -> float:
        return self.found["ms"]

    track_ms.unit = "ms"


class GBps:
    def track_gbps(self, cache: dict, *combo: str) -> float:
        return self.found["gbps"]

    track_gbps.unit = "GB/s"


class TFLOPs:
    def track_tflops(self, cache: dict, *combo: str) -> float:
        return self.found["tflops"]  # suites whose every case counts FLOPs

    track_tflops.unit = "TFLOP/s"
