"""What every asv suite shares: one measuring pass per suite, then a lookup per benchmark.

asv runs each benchmark and parameter combination in a process of its own ("spawn" launch,
so no CUDA state is ever forked). Importing torch and starting CUDA in each of those
hundreds of processes would cost more than the measurements, so each suite measures every
combination it is asked for once, in `setup_cache` (a single process), and its `track_*`
benchmarks read the numbers back:

- GPUs: `openkernels.shared.dev.bench.time_ms`, the do_bench median of CUDA-event times; CPUs:
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

Peers (`PeerSuite`): beside each family's suite, a `<Suite>Peers` class times the peers
its bench module already runs (torch eager, torch.compile, SDPA backends, Liger, ...) on
the same cases, with a `peer` parameter (the peer's name in the report) instead of
`backend`, in bfloat16. A peer that is not installed, or cannot run on this device or
case, is n/a (NotImplementedError, with the reason on stderr): never a failure, and never
something else timed in its place.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

SELECT_ENV = "OPENKERNELS_ASV_SELECT"
SMOKE_ENV = "OPENKERNELS_ASV_SMOKE"
BACKENDS = ["triton", "cpu", "reference"]
DTYPES = ["bfloat16", "float16", "float32"]
DEVICE_TYPES = ("cuda", "cpu")
# Peers are timed in the dtype every family's headline numbers are written in.
PEER_DTYPES = ["bfloat16"]
L2_BYTES = 60 * 2**20
MAX_INPUT_SETS = 8
# asv's default of 60 s per setup_cache covers a few dozen GPU measurements, not a suite's.
SETUP_CACHE_TIMEOUT = 3600
VERSION = "1"  # bump when what the suites measure changes meaning (old results drop out)


class NotApplicableError(NotImplementedError):
    """This parameter combination does not exist on this machine (asv records it as n/a)."""


class PeerUnavailableError(NotApplicableError):
    """A peer is not installed, or cannot run this case on this device: n/a, with the reason."""


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


def grid_case(bench: Any, dev: Any, shape: str, dtype: str, smoke_shape: tuple[int, ...], **grid: Any) -> Any:
    """The one case of a family's `bench.cases(dev, shapes=, dtypes=, **grid)` for one asv
    parameter set: `shape` ("AxB...") or `smoke_shape` in smoke mode, `dtype` by name."""
    shapes = [smoke_shape if smoke() else parse_shape(shape)]
    return only_case(bench.cases(dev, shapes=shapes, dtypes=[torch_dtype(dtype)], **grid))


def _input_sets(case: Any, contender: str, dev: Any) -> list[Any]:
    """Enough input sets to stream three L2s' worth of bytes between reuses."""
    count = 1 if smoke() else max(1, min(MAX_INPUT_SETS, math.ceil(3 * L2_BYTES / max(case.bytes, 1))))
    sets = [case.make_inputs(dev) for _ in range(count)]
    prepare = getattr(case, "setup", {}).get(contender)
    return [prepare(s) for s in sets] if prepare else sets


def _first_call(fn: Any, sets: list[Any], dev: Any) -> None:
    """One call, waited for: compiles, and raises here when the implementation cannot run."""
    import torch

    fn(sets[0])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_ms(fn: Any, sets: list[Any], dev: Any) -> float:
    """Milliseconds per call after the first: one call in smoke mode, else `time_ms`."""
    from openkernels.shared.dev.bench import time_ms

    if smoke():
        start = time.perf_counter()
        fn(sets[0])
        return (time.perf_counter() - start) * 1e3
    return time_ms(fn, sets, dev)


def _steered(backend: str | None) -> contextlib.AbstractContextManager[None]:
    """The forced backend in strict mode; nothing for peers (backend None), which do not
    go through openkernels' dispatch."""
    if backend is None:
        return contextlib.nullcontext()
    from openkernels.shared import dispatch

    stack = contextlib.ExitStack()
    stack.enter_context(dispatch.force(backend))
    stack.enter_context(dispatch.strict())
    return stack


def _measure(
    case: Any, contender: str, backend: str | None, dev: Any, *, peer: bool = False
) -> dict[str, float]:
    """One contender of one case: {"ms", "gbps"}, and "tflops" for cases that count FLOPs.
    The input sets are prepared outside the forced backend (as the bench modules do);
    the calls run inside it. peer: a failure to prepare the inputs or of the first call
    means that the peer cannot run here (PeerUnavailableError); ours propagate."""
    fn = case.contenders[contender]
    try:
        sets = _input_sets(case, contender, dev)
        with _steered(backend):
            _first_call(fn, sets, dev)
    except Exception as exc:
        if not peer:
            raise
        raise PeerUnavailableError(f"{contender}: {type(exc).__name__}: {exc}") from exc
    with _steered(backend):
        ms = _timed_ms(fn, sets, dev)
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
    last), sets `case` or defines `build(dev, **params)` returning the family's BenchCase
    for one combination (or raising NotApplicableError), and defines its own two-line
    `setup_cache` calling `measure_all`: asv keys the cache by the module and line of that
    function, so a shared one would hand every suite the first suite's numbers.

    asv skips names that start with "_", so `from . import _harness` keeps this class out
    of discovery; mix in `GBps` and/or `TFLOPs` for throughput beside `track_ms`.
    """

    params: list[list[str]] = []
    param_names: list[str] = []
    timeout = SETUP_CACHE_TIMEOUT
    # In the lean selection (backfill of old commits, noise runs): the suites that time
    # openkernels' own code; the peers and end-to-end models are left out of it.
    lean = True
    # asv keeps results only while a benchmark's version matches; by default that is a hash
    # of its source, which changes with any edit of the harness. Bump on a change of meaning.
    version = VERSION

    # Shapes per device kind, for suites with a "shape" parameter (its values are the union).
    gpu_shapes: Sequence[str] = ()
    cpu_shapes: Sequence[str] = ()
    # Parameter values measured on GPUs alone ({name: values}; quant: M = 2048).
    gpu_only: Mapping[str, Sequence[str]] = {}

    # The suite module's function of one case, `case(dev, **params, peers=[...])`, taking every
    # parameter but `backend` / `peer` by name; set as `case = staticmethod(_case)`, it gives
    # the suite its `build` (ours alone; PeerSuite: the one peer beside ours).
    case: Any = None

    def build(self, dev: Any, **params: str) -> Any:
        """The family's case for one combination: `case` without peers, else the suite's own."""
        if self.case is None:
            raise NotImplementedError
        del params["backend"]
        return self.case(dev, **params, peers=[])

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
        return self.on_grid(device_type, params)

    def on_grid(self, device_type: str, params: Mapping[str, str]) -> bool:
        """The family's shapes for this kind of device, and `gpu_only` values on GPUs alone."""
        gpu = device_type == "cuda"
        if not gpu and any(params.get(name) in values for name, values in self.gpu_only.items()):
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

    def measure(self, dev: Any, params: dict[str, str]) -> dict[str, Any]:
        """One combination: build its case and time our contender on the forced backend."""
        case = self.build(dev, **params)
        return _measure(case, self.contender(**params), params["backend"], dev)

    def measure_all(self) -> dict[tuple[str, ...], dict[str, Any]]:
        """Every selected combination measured once: {combo: {"ms", "gbps", "tflops"}} or
        {combo: {"error"}}; combinations that do not apply here are left out."""
        dev = device()
        results: dict[tuple[str, ...], dict[str, Any]] = {}
        for combo in self.combos(dev.type):
            if not self._selected(combo):
                continue
            try:
                results[combo] = self.measure(dev, dict(zip(self.param_names, combo, strict=True)))
            except NotApplicableError as exc:
                if str(exc):
                    print(f"{type(self).__name__}{combo}: n/a: {exc}", file=sys.stderr)
            except Exception as exc:
                if _unsupported(exc):  # the forced backend declines this dtype or shape: n/a
                    print(f"{type(self).__name__}{combo}: n/a: {exc}", file=sys.stderr)
                    continue
                print(f"{type(self).__name__}{combo}: {exc!r}", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                results[combo] = {"error": f"{type(exc).__name__}: {exc}"}  # fails its lookups
            finally:
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


class PeerSuite(Suite):
    """Base of the peer suites: a family's cases timed for the peers its bench module runs.

    A subclass sets `peers` ({name in the report: the bench module's contender name}) and,
    for peers that run on one kind of device only, `peer_devices`; its params end with
    PEER_DTYPES and the peer names (param names `dtype`, `peer`), given or taken over from
    its family's suite (`family=`), its `case` or `build` returns the case holding that
    contender. No backend is forced: a peer does not go through
    openkernels' dispatch. A peer that is not installed (the case has no such contender),
    does not run on this kind of device, or fails to prepare its inputs or on its first
    call is n/a (PeerUnavailableError): the suite never fails because of a peer, and never
    times something else in its place.
    """

    peers: dict[str, str] = {}
    lean = False
    peer_devices: dict[str, tuple[str, ...]] = {}

    def __init_subclass__(cls, family: type[Suite] | None = None, **kwargs: Any) -> None:
        """`class XPeers(PeerSuite, family=X)`: the peers are timed on X's grid. Its shapes per
        kind of device, GPU-only values and every parameter before `dtype` are taken over
        rather than copied into each peer suite, so the two cannot drift apart."""
        super().__init_subclass__(**kwargs)
        if family is None:
            return
        if family.param_names[-2:] != ["dtype", "backend"]:
            raise TypeError(f"{family.__name__}'s parameters do not end with dtype, backend")
        cls.gpu_shapes, cls.cpu_shapes, cls.gpu_only = family.gpu_shapes, family.cpu_shapes, family.gpu_only
        cls.params = [*family.params[:-2], PEER_DTYPES, list(cls.peers)]
        cls.param_names = [*family.param_names[:-2], "dtype", "peer"]

    def contender(self, **params: str) -> str:
        return self.peers[params["peer"]]

    def build(self, dev: Any, **params: str) -> Any:
        """`case` with the peer's contender beside ours; a peer that needs more has its own."""
        if self.case is None:
            raise NotImplementedError
        peers = [self.peers[params.pop("peer")]]
        return self.case(dev, **params, peers=peers)

    def runs_on(self, device_type: str, peer: str) -> bool:
        return device_type in self.peer_devices.get(peer, DEVICE_TYPES)

    def applies(self, device_type: str, **params: str) -> bool:
        """The peer runs on this kind of device, bfloat16, and the family's shapes for it."""
        if not self.runs_on(device_type, params["peer"]) or params["dtype"] not in PEER_DTYPES:
            return False
        return self.on_grid(device_type, params)

    def measure(self, dev: Any, params: dict[str, str]) -> dict[str, Any]:
        peer = params["peer"]
        if not self.runs_on(dev.type, peer):
            raise PeerUnavailableError(f"{peer} runs on {', '.join(self.peer_devices[peer])} only")
        try:
            case = self.build(dev, **params)
        except NotApplicableError:
            raise
        except Exception as exc:  # e.g. a bench module of an older commit without this peer
            raise PeerUnavailableError(f"{peer}: {type(exc).__name__}: {exc}") from exc
        name = self.contender(**params)
        if name not in case.contenders:
            raise PeerUnavailableError(f"{peer} is not installed here, or has no implementation of this case")
        return _measure(case, name, None, dev, peer=True)


class GBps:
    def track_gbps(self, cache: dict, *combo: str) -> float:
        return self.found["gbps"]

    track_gbps.unit = "GB/s"


class TFLOPs:
    def track_tflops(self, cache: dict, *combo: str) -> float:
        return self.found["tflops"]  # suites whose every case counts FLOPs

    track_tflops.unit = "TFLOP/s"
