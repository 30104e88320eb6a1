"""The `openkernels` command: what this machine has, the self-checks, the benchmarks, the demo.

    openkernels env                        versions, devices, and what dispatch runs for each op
    openkernels check [family ...] [--device cpu|cuda|all]
    openkernels bench [family ...] [--device cpu|cuda|all] [--quick] [--peers a,b]
                      [--json PATH] [--plot PNG]
    openkernels demo [args ...]            openkernels.shared.dev.model_demo

`python -m openkernels.shared ...` runs the same. Families are the installed
openkernels.<name> packages with a bench module; each supplies `checks(device)` (every op on
every usable implementation against the float64 reference) and `cases(device, peers=...)`
(benchmark cases against peers). Exit codes: 0 success, 1 a check failed (check) or a
family's cases could not be built (bench), 2 a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import platform as _platform
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NoReturn

import torch

from .. import __version__, dispatch, manifest
from ..platform import DeviceInfo, cpu_isa, device_info, triton_interpreting
from .bench import (
    BenchCase,
    Check,
    Measurement,
    copy_ceiling,
    format_table,
    matmul_ceiling_tflops,
    run_cases,
    write_json,
)

__all__ = ["main", "families"]

PLOT_NEEDS = "--plot needs matplotlib: pip install matplotlib"
# The families of this repository (packages/<name>, distribution openkernels-<name>): named
# in the message when one is asked for and not installed. Others that install an
# openkernels.<name> package with a bench module are found all the same (`families`).
KNOWN_FAMILIES = ("activations", "layernorm", "attention", "quant")


def families() -> list[str]:
    """Installed families whose manifest names bench modules (openkernels.shared.manifest)."""
    return [name for name, m in manifest.families().items() if m.bench]


def _bench(family: str) -> ModuleType:
    """The family's headline bench module: the first its manifest names."""
    return importlib.import_module(f"openkernels.{family}.{manifest.families()[family].bench[0]}")


class _UsageError(Exception):
    """A bad command line: reported in one line, exit code 2."""


def _install_hint(names: Sequence[str]) -> str:
    dists = " ".join(f"openkernels-{name}" for name in names)
    paths = " ".join(f"./packages/{name}" for name in names)
    return f"pip install {dists} (from a clone of the repository: pip install {paths})"


def _chosen_families(wanted: Sequence[str]) -> list[str]:
    installed = families()
    missing = [f for f in dict.fromkeys(wanted) if f not in installed]
    absent = [f for f in missing if f in KNOWN_FAMILIES]
    unknown = [f for f in missing if f not in KNOWN_FAMILIES]
    have = f"installed: {', '.join(installed) or 'none'}"
    if unknown:
        close = [difflib.get_close_matches(f, [*KNOWN_FAMILIES, *installed], n=1) for f in unknown]
        hint = "".join(f" (did you mean {c[0]}?)" for c in close if c and len(unknown) == 1)
        raise _UsageError(
            f"unknown family {', '.join(unknown)}{hint}; the families are {', '.join(KNOWN_FAMILIES)} ({have})"
        )
    if absent:
        raise _UsageError(
            f"{', '.join(absent)} {'is a family' if len(absent) == 1 else 'are families'} of openkernels "
            f"but not installed here ({have}): {_install_hint(absent)}"
        )
    if not installed:
        raise _UsageError(f"no openkernels family is installed: {_install_hint(KNOWN_FAMILIES)}")
    return list(dict.fromkeys(wanted)) or installed


def _devices(spec: str) -> list[torch.device]:
    """The devices --device names: for all, cpu plus the current GPU when torch sees one."""
    if spec == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise _UsageError(f"--device takes cpu, cuda, cuda:N or all, not {spec!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise _UsageError(f"--device takes cpu, cuda, cuda:N or all, not {spec!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda: torch sees no CUDA or ROCm device here")
    return [device]


def _where(device: torch.device) -> str:
    info = device_info(device)
    return f"{device} ({info.backend}/{info.arch}, {info.name})"


class _Progress:
    """tqdm on stderr when it is importable, else one stderr line rewritten in place."""

    def __init__(self, total: int, what: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self._total, self._done, self._what, self._width = total, 0, what, 0
        self._bar = (
            tqdm(total=total, desc=what, file=sys.stderr, leave=False, dynamic_ncols=True) if tqdm else None
        )

    def start(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(label)
            return
        line = f"\r{self._what} {self._done + 1}/{self._total}: {label}"
        sys.stderr.write(line.ljust(self._width))
        sys.stderr.flush()
        self._width = len(line)

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, text: str) -> None:
        """Print to stdout without tearing the progress line."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
            return
        self._clear()
        print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._clear()

    def _clear(self) -> None:
        if self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


# ---- env ---------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _family_version(family: str) -> str:
    module = importlib.import_module(f"openkernels.{family}")
    version = _distribution_version(f"openkernels-{family}")
    if version is None:  # a source tree on sys.path, not an installed distribution
        return f"{getattr(module, '__version__', '?')} (source tree: {module.__path__[0]})"
    return version


def _owner(fn: Callable[..., Any] | None) -> str | None:
    """Family of a dispatch key function: openkernels.<family>.ops defines it."""
    parts = getattr(fn, "__module__", "").split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "openkernels" else None


@contextlib.contextmanager
def _recording_calls() -> Iterator[dict[str, tuple[tuple, dict]]]:
    """Inside the block, op -> (args, kwargs) of the first dispatch call each op gets: the
    arguments `dispatch.explain` needs to say what that call runs. Each op's key function
    is wrapped for the block (the registry has no public list of op names: `_OPS`)."""
    seen: dict[str, tuple[tuple, dict]] = {}
    entries = dict(dispatch._OPS)
    saved = {op: entry.key_fn for op, entry in entries.items()}

    def recorder(op: str, key_fn: Callable[..., dispatch.DispatchKey]) -> Callable[..., dispatch.DispatchKey]:
        def key(*args: Any, **kwargs: Any) -> dispatch.DispatchKey:
            seen.setdefault(op, (args, kwargs))
            return key_fn(*args, **kwargs)

        return key

    for op, entry in entries.items():
        if entry.key_fn is not None:
            entry.key_fn = recorder(op, entry.key_fn)
    try:
        yield seen
    finally:
        for op, entry in entries.items():
            entry.key_fn = saved[op]


@contextlib.contextmanager
def _reference_only() -> Iterator[None]:
    """Every op on its reference implementation, whatever OPENKERNELS_FORCE / FORBID say:
    collecting inputs compiles no C++ library and launches no Triton kernel."""
    steering = {k: os.environ.pop(k) for k in (dispatch.FORCE_ENV, dispatch.FORBID_ENV) if k in os.environ}
    try:
        with dispatch.force("reference"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os.environ.update(steering)


def _bench_modules(family: str) -> list[ModuleType]:
    """The bench modules the family's manifest names, each with checks or cases."""
    modules = manifest.families()[family].bench_modules()
    return [m for m in modules if hasattr(m, "checks") or hasattr(m, "cases")]


def _run_first_case(module: ModuleType, device: torch.device) -> None:
    """Run "ours" of the module's first benchmark case once, then the contenders the module
    names in OP_CONTENDERS (those that reach an op "ours" does not)."""
    try:
        cases = module.cases(device, peers=())
    except TypeError:  # a cases() without a peers argument
        cases = module.cases(device)
    case: BenchCase = cases[0]
    made = case.make_inputs(device)
    for name in ("ours", *getattr(module, "OP_CONTENDERS", ())):
        inputs = case.setup[name](made) if name in case.setup else made
        case.contenders[name](inputs)


def _representative_calls(
    device: torch.device, chosen: Sequence[str]
) -> tuple[dict[str, tuple[tuple, dict]], dict[str, str]]:
    """For every op of the chosen families, the arguments of a representative call on
    `device` and where they come from: the first call the op gets in its family's
    `checks(device)`; for ops no check reaches, in the first benchmark case of a bench
    module, those without checks first (the attention KV-cache ops: kvcache.bench).
    Everything runs on the reference implementations."""
    owner = {op: _owner(entry.key_fn) for op, entry in dispatch._OPS.items()}
    source: dict[str, str] = {}
    with _recording_calls() as seen, _reference_only():
        for family in chosen:
            ops = {op for op, f in owner.items() if f == family}
            modules = _bench_modules(family)
            steps = [(f"{m.__name__}.checks()", m.checks) for m in modules if hasattr(m, "checks")]
            for m in sorted(modules, key=lambda m: hasattr(m, "checks")):  # stable: bench first among equals
                if hasattr(m, "cases"):
                    steps.append((f"{m.__name__}.cases()[0]", functools.partial(_run_first_case, m)))
            for where, step in steps:
                if not ops - seen.keys():
                    break
                with contextlib.suppress(Exception):  # an op it did not reach stays unexplained
                    step(device)
                for op in seen.keys() - source.keys():
                    source[op] = where.removeprefix("openkernels.")
    return seen, source


_HEAD = re.compile(r"^(?P<op>\S+) on (?P<key>.+?): (runs '(?P<runs>[^']+)'|nothing can run (?P<why>.*))$")
_LINE = re.compile(r"^ (?:->|  ) (?P<name>[^:]+): (?P<reason>.*) \[priority -?\d+\](?P<broken> \(.*\))?$")


def _explain_row(op: str, args: tuple, kwargs: dict) -> tuple[str, str, str]:
    """(input, chosen implementation, why the others are not) from dispatch.explain."""
    lines = dispatch.explain(op, *args, **kwargs).splitlines()
    head = _HEAD.match(lines[0])
    if head is None:
        return "?", "?", lines[0]
    what = head["key"].partition(" ")[2]  # the key less its backend/arch, the table's title
    runs = head["runs"] or "nothing"
    others = []
    for line in lines[1:]:
        row = _LINE.match(line)
        if row is None or row["name"] == runs:
            continue
        reason = "usable, lower priority" if row["reason"] == "usable" else row["reason"]
        others.append(f"{row['name']}: {reason}{row['broken'] or ''}")
    if head["why"]:
        others.insert(0, head["why"])
    return what.replace(" [-]", ""), runs, "; ".join(others)


def _device_groups() -> list[tuple[DeviceInfo, list[torch.device]]]:
    """cpu, then the visible GPUs grouped by (backend, arch): dispatch keys hold only those,
    so every GPU of a group selects alike."""
    groups: dict[tuple[str, str], tuple[DeviceInfo, list[torch.device]]] = {}
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for device in devices:
        info = device_info(device)
        groups.setdefault((info.backend, info.arch), (info, []))[1].append(device)
    return list(groups.values())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell; the last one is left unpadded."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, None, *rows]:
        if row is None:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
            continue
        lines.append("  ".join(f"{c!s:<{w}}" for c, w in zip(row, widths)) + "  " + str(row[-1]))
    return lines


def _sources(source: dict[str, str], chosen: Sequence[str]) -> list[str]:
    """Where the representative inputs come from, one line per place, in family order; the
    ops are named where a place supplied only some of its family's."""
    places: dict[str, list[str]] = {}
    for op in dispatch._OPS:
        if op in source:
            places.setdefault(source[op], []).append(op)
    order = {family: i for i, family in enumerate(chosen)}
    lines = []
    for place in sorted(places, key=lambda p: order.get(p.split(".")[0], len(order))):
        family, ops = place.split(".")[0], places[place]
        whole = len(ops) == sum(_owner(e.key_fn) == family for e in dispatch._OPS.values())
        lines.append(place + ("" if whole else f" ({', '.join(ops)})"))
    return lines


def _dispatch_rows(device: torch.device, chosen: Sequence[str]) -> tuple[list[tuple[str, ...]], list[str]]:
    """One row per registered op, its family's ops together: (family, op, input, runs, why
    not the others); and where the inputs came from."""
    calls, source = _representative_calls(device, chosen)
    rows = []
    for op, entry in dispatch._OPS.items():
        family = _owner(entry.key_fn) or "-"
        if op not in calls:
            rows.append((family, op, "-", "?", "no representative input in its family's bench modules"))
            continue
        try:
            rows.append((family, op, *_explain_row(op, *calls[op])))
        except Exception as error:  # a broken key function: say so, keep the table
            rows.append((family, op, "-", "?", f"explain failed: {type(error).__name__}: {error}"))
    order = {family: i for i, family in enumerate(chosen)}
    rows.sort(key=lambda row: order.get(row[0], len(order)))  # stable: registration order within
    shown = [row if i == 0 or rows[i - 1][0] != row[0] else ("", *row[1:]) for i, row in enumerate(rows)]
    return shown, _sources(source, chosen)


def _env(args: argparse.Namespace) -> int:
    chosen = families()
    for family in chosen:  # each family registers its ops on import
        importlib.import_module(f"openkernels.{family}")
    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    else:
        build = "CPU-only build"
    steering = [k for k in (dispatch.FORCE_ENV, dispatch.FORBID_ENV, dispatch.STRICT_ENV) if k in os.environ]
    interpreter = (
        "on: Triton kernels run on CPU tensors where forced by name" if triton_interpreting() else "off"
    )
    header = [
        ("openkernels-shared", __version__),
        ("torch", f"{torch.__version__} ({build})"),
        ("triton", _distribution_version("triton") or "not installed"),
        ("python", f"{_platform.python_version()} {_platform.python_implementation()} ({sys.executable})"),
        ("platform", _platform.platform()),
        ("cpu", f"{os.cpu_count()} cores, ISA {cpu_isa()}, {torch.get_num_threads()} torch threads"),
        ("triton interpreter", interpreter),
        ("dispatch steering", ", ".join(f"{k}={os.environ[k]}" for k in steering) or "none"),
    ]
    width = max(len(k) for k, _ in header)
    lines = [f"{k:<{width}}  {v}" for k, v in header]
    groups = _device_groups()
    lines += ["", "devices"]
    for info, devices in groups:
        lines.append(f"  {', '.join(map(str, devices)):<12} {info.backend}/{info.arch:<10} {info.name}")
    lines += ["", "families"]
    lines += [f"  {family:<12} {_family_version(family)}" for family in chosen] or ["  none installed"]
    print("\n".join(lines), flush=True)
    for info, devices in groups:
        rows, sources = _dispatch_rows(devices[0], chosen)
        print(f"\ndispatch on {', '.join(map(str, devices))} ({info.backend}/{info.arch}, {info.name})")
        print("\n".join(_table(("family", "op", "input", "runs", "not picked: why"), rows)))
        print("inputs: the first call each op gets in\n  " + "\n  ".join(sources), flush=True)
    return 0


# ---- check -------------------------------------------------------------------------------


def _check(args: argparse.Namespace) -> int:
    chosen, devices = _chosen_families(args.families), _devices(args.device)
    results: list[tuple[torch.device, str, Check]] = []
    errors: dict[tuple[str, str], str] = {}
    progress = _Progress(len(chosen) * len(devices), "check")
    try:
        for device in devices:
            for family in chosen:
                progress.start(f"{family} on {device}")
                try:
                    checks = [
                        c for m in _bench_modules(family) if hasattr(m, "checks") for c in m.checks(device)
                    ]
                except Exception as error:  # a family whose checks crash fails, the rest still run
                    errors[str(device), family] = f"{type(error).__name__}: {error}"
                    checks = [Check(f"({family} checks raised)", "-", "-", "-", float("nan"), False)]
                results += [(device, family, c) for c in checks]
                progress.advance()
    finally:
        progress.close()
    header = ("device", "family", "op", "dir", "implementation", "dtype", "error/tol", "result")
    rows = [
        (str(d), f, c.op, c.direction, c.implementation, c.dtype, f"{c.error:9.3f}", "ok" if c.ok else "FAIL")
        for d, f, c in results
    ]
    print("\n".join(_table(header, rows)))
    print("error/tol: the largest |ours - reference| / tolerance over the output; <= 1 passes")
    for device in devices:
        mine = [c for d, _, c in results if d == device]
        bad = sum(not c.ok for c in mine)
        state = "all passed" if not bad else f"{bad} FAILED"
        print(f"{_where(device)}: {len(mine)} checks, {state}")
    failed = [(d, f, c) for d, f, c in results if not c.ok]
    for d, f, c in failed:
        cause = errors.get((str(d), f), f"error/tol {c.error:.3f}")
        print(f"FAILED {d} {f} {c.op} {c.direction} {c.implementation}: {cause}")
    print(f"\n{'all checks passed' if not failed else f'{len(failed)} of {len(results)} checks FAILED'}")
    return 1 if failed else 0


# ---- bench -------------------------------------------------------------------------------


def _require_matplotlib() -> None:
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError:
        raise _UsageError(PLOT_NEEDS) from None


def _plot(results: Sequence[Measurement], path: str) -> None:
    """Horizontal bars: the ratio to the ceiling of every contender of every case, one panel
    per device (1.0 = the device copy for memory-bound cases, the matmul for compute-bound)."""
    from matplotlib.figure import Figure

    devices = list(dict.fromkeys(m.device for m in results))
    contenders = list(dict.fromkeys(m.contender for m in results))
    panels = []
    for device in devices:
        mine = [m for m in results if m.device == device and not m.error]
        labels = list(dict.fromkeys(_case_label(m) for m in mine))
        panels.append((device, mine, labels))
    heights = [max(1.5, 0.12 * len(labels) * (len(contenders) + 1)) for _, _, labels in panels]
    fig = Figure(figsize=(10, sum(heights) + 1.0 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    bar = 1.0 / (len(contenders) + 1)
    for ax, (device, mine, labels) in zip(axes, panels):
        row = {label: i for i, label in enumerate(labels)}
        for j, name in enumerate(contenders):
            points = [
                (row[_case_label(m)] + j * bar, m.ratio_to_ceiling) for m in mine if m.contender == name
            ]
            if points:
                ys, xs = zip(*points)
                if name == "copy":  # the same-size copy: what the memory system gives these bytes
                    ax.barh(ys, xs, height=bar, label="copy (same bytes)", color="0.65")
                else:
                    ax.barh(ys, xs, height=bar, label=name)
        ax.set_yticks([i + bar * (len(contenders) - 1) / 2 for i in range(len(labels))], labels, fontsize=7)
        ax.invert_yaxis()
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("ratio to the ceiling (copy GB/s, or matmul TFLOP/s for compute-bound cases)")
        ax.set_title(device, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=120)


def _case_label(m: Measurement) -> str:
    return f"{m.family}: {m.op} {m.direction} {'x'.join(map(str, m.shape))} {m.dtype}"


# Peers whose absence has a cause to name: the module that has them, what to install.
_PEER_PACKAGES = {
    "liger": ("liger_kernel", "pip install liger-kernel"),
    "bnb-nf4": ("bitsandbytes", "pip install bitsandbytes"),
    "gemlite": ("gemlite", "pip install gemlite"),
    "flex": ("torch.nn.attention.flex_attention", "FlexAttention needs torch 2.5 or later"),
}


def _not_installed(peer: str) -> str | None:
    """Why `peer` cannot run in this process at all, when its package is missing."""
    module, install = _PEER_PACKAGES.get(peer, (None, ""))
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        found = False
    return None if found else f"{module} is not installed ({install})"


def _missing_peers(
    peers: Sequence[str], work: Sequence[tuple[torch.device, str, list[BenchCase]]]
) -> tuple[dict[str, str], list[str]]:
    """Requested peers that no benchmark case has: (peer -> where and why, the peers missing
    on every device). The families leave out a peer that is not installed, that has no
    counterpart of their ops, or that does not run on the device (Liger's Triton kernels on
    a CPU), and say nothing."""
    devices = list(dict.fromkeys(d for d, _, _ in work))
    missing: dict[str, str] = {}
    nowhere = []
    for peer in dict.fromkeys(peers):
        without = []
        for device in devices:
            built = [(f, cases) for d, f, cases in work if d == device]
            if not any(peer in case.contenders for _, cases in built for case in cases):
                without.append((device, [f for f, _ in built]))
        if not without:
            continue
        why = _not_installed(peer)
        if why is None:
            missing[peer] = "; ".join(f"on {d}: no case of {' or '.join(f)} has it there" for d, f in without)
        else:
            missing[peer] = f"on {', '.join(str(d) for d, _ in without)}: {why}"
        if len(without) == len(devices):
            nowhere.append(peer)
    return missing, nowhere


def _bench_cmd(args: argparse.Namespace) -> int:
    if args.plot:
        _require_matplotlib()  # before minutes of timing, not after
    chosen, devices = _chosen_families(args.families), _devices(args.device)
    peers = None if args.peers is None else tuple(p.strip() for p in args.peers.split(",") if p.strip())
    rep_ms = 50.0 if args.quick else 200.0
    work: list[tuple[torch.device, str, list[BenchCase]]] = []
    broken = []
    for device in devices:
        for family in chosen:
            bench = _bench(family)
            try:  # each family skips the peers that are not installed; None: its own list
                cases = bench.cases(device) if peers is None else bench.cases(device, peers=peers)
            except Exception as error:  # an unknown peer name, say: that family is skipped
                broken.append(f"{family} on {device}: no cases: {type(error).__name__}: {error}")
                print(f"openkernels bench: {broken[-1]}", file=sys.stderr)
                continue
            work.append((device, family, cases))
    missing, nowhere = _missing_peers(peers or (), work)
    for peer, why in missing.items():
        print(f"openkernels bench: peer {peer} skipped {why}", file=sys.stderr)
    if peers and work and len(nowhere) == len(set(peers)):
        raise _UsageError(
            f"none of the requested peers ({', '.join(nowhere)}) can run here (see above): nothing to "
            "compare ours with; leave --peers out for each family's own list"
        )
    results: list[Measurement] = []
    meta_devices: dict[str, dict[str, Any]] = {}
    progress = _Progress(sum(len(c) for _, _, c in work), "bench")
    try:
        for device in devices:
            mine = [(f, c) for d, f, c in work if d == device]
            every = [case for _, cases in mine for case in cases]
            ceilings: dict[str, float] = {}
            copy: dict[str, Any] = {}
            progress.start(f"ceilings on {device}")
            if any(not c.flops for c in every):
                measured = copy_ceiling(device)
                ceilings["ceiling_gbps"] = measured.gbps
                copy = {
                    "ceiling_gbps_repeats": list(measured.repeats),
                    "ceiling_gbps_buffer": measured.buffer_bytes,
                }
                progress.write(f"\n{_where(device)}: {measured.describe()}")
            if any(c.flops for c in every):
                ceilings["ceiling_tflops"] = matmul_ceiling_tflops(device)
            info = device_info(device)
            meta_devices[str(device)] = {
                "backend": info.backend,
                "arch": info.arch,
                "name": info.name,
                **ceilings,
                **copy,
            }
            for family, cases in mine:
                family_results = []
                for case in cases:
                    progress.start(f"{family} {case.label} on {device}")
                    family_results += run_cases([case], device, rep_ms=rep_ms, **ceilings)
                    progress.advance()
                progress.write(
                    f"\n== {family} on {_where(device)} ==\n{format_table(family_results, **ceilings)}"
                )
                results += family_results
    finally:
        progress.close()
    if args.json:
        write_json(
            results,
            args.json,
            devices=meta_devices,
            families=chosen,
            peers=list(peers) if peers is not None else "each family's default",
            peers_skipped=missing,
            rep_ms=rep_ms,
            torch=torch.__version__,
            triton=_distribution_version("triton"),
            openkernels_shared=__version__,
        )
        print(f"wrote {args.json}")
    if args.plot and results:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if broken else 0


# ---- demo --------------------------------------------------------------------------------


def _demo(argv: list[str]) -> int:
    name = f"{__package__}.model_demo"
    try:
        model_demo = importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name == name:
            print(
                f"openkernels demo: this openkernels-shared has no model demo ({name} is missing)",
                file=sys.stderr,
            )
        else:
            print(f"openkernels demo: {name} needs {error.name!r}, not installed: {error}", file=sys.stderr)
        return 2
    return int(model_demo.main(argv) or 0)


# ---- command line ------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, keeping its option strings and its subcommands' parsers, so that
    an unknown option is reported by the subcommand it was given to, with its usage and the
    closest option. (A subcommand's parser hands the arguments it does not know back to the
    top-level one, which would report them with the top-level usage.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.option_names: list[str] = []  # before argparse's __init__ adds -h, --help
        self.commands: dict[str, _Parser] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.option_names += action.option_strings
        return action

    def unrecognized(self, extra: Sequence[str]) -> NoReturn:
        """Exit 2 with this parser's usage, naming the arguments and the closest options."""
        hints = []
        for arg in extra:
            name = arg.partition("=")[0]
            close = difflib.get_close_matches(name, self.option_names, n=1) if name.startswith("-") else []
            if close:
                hints.append(("" if len(extra) == 1 else f"{arg}: ") + f"did you mean {close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else ""))


def _parser() -> _Parser:
    parser = _Parser(
        prog="openkernels", description="openkernels: fused kernels for PyTorch, from the command line."
    )
    parser.add_argument("--version", action="version", version=f"openkernels-shared {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{env,check,bench,demo}")
    env = sub.add_parser("env", help="versions, devices, families, and what dispatch runs for each op")
    env.set_defaults(func=_env)
    device_help = "cpu, cuda, cuda:N or all (default: all = cpu, plus cuda when torch sees a GPU)"
    check = sub.add_parser("check", help="every op on every usable implementation against the reference")
    check.add_argument("families", nargs="*", metavar="family", help="default: every installed family")
    check.add_argument("--device", default="all", help=device_help)
    check.set_defaults(func=_check)
    bench = sub.add_parser(
        "bench", help="benchmark cases against peers: GB/s or TFLOP/s, ratio to the ceiling"
    )
    bench.add_argument("families", nargs="*", metavar="family", help="default: every installed family")
    bench.add_argument("--device", default="all", help=device_help)
    bench.add_argument(
        "--quick", action="store_true", help="shorter timing runs (50 ms per contender, not 200)"
    )
    bench.add_argument(
        "--peers",
        default=None,
        help="comma-separated peers, e.g. torch,torch.compile,liger (default: each family's own list); "
        "a peer no case has here (not installed, not on this device) is named with the reason, and "
        "when none of them can run the command stops with exit code 2",
    )
    bench.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    bench.add_argument(
        "--plot", metavar="PNG", help="write a bar chart of the ratios to the ceiling (matplotlib)"
    )
    bench.set_defaults(func=_bench_cmd)
    sub.add_parser(
        "demo", help="the model demo (openkernels.shared.dev.model_demo); arguments go to it", add_help=False
    )
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `openkernels` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # everything after `demo` belongs to the demo, --help included
        return _demo(argv[1:])
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            parser.commands.get(args.command, parser).unrecognized(extra)
    except SystemExit as exit_:  # --help, --version, or a usage error argparse reported
        return exit_.code if isinstance(exit_.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except _UsageError as error:
        print(f"openkernels {args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
