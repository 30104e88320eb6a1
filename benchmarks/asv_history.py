"""Drives asv for the nox sessions asv-run, asv-compare, asv-publish, asv-smoke, asv-noise,
asv-backfill and asv-history.

Every run benchmarks a *commit*, never the working tree: the commit's packages are exported
(`git archive`) and put on the path of the benchmark processes (asv's ASV_PYTHONPATH), while
the suites in benchmarks/asv_suite come from the checkout. asv runs in this interpreter's
environment (`-E existing`, which must hold torch and triton), records the results under the
commit's hash (`--set-commit-hash`), and writes them to the committed results folder.

    python benchmarks/asv_history.py run [COMMIT]          this machine, one commit (HEAD)
    python benchmarks/asv_history.py compare BASE HEAD     both, a table, exit 1 on regressions
                                          [--report PATH]  also as markdown (the CI job posts it)
    python benchmarks/asv_history.py publish               HTML report with the regressions view
    python benchmarks/asv_history.py noise [--runs N]      HEAD N times: each benchmark's spread,
                                                           written to results/asv-noise/<machine>.json
    python benchmarks/asv_history.py smoke                 every suite once on tiny shapes, untimed
    python benchmarks/asv_history.py kernel-commits        the commits that changed a kernel
    python benchmarks/asv_history.py backfill              run those missing for this machine
    python benchmarks/asv_history.py history [--machine M] [--window 3]
                                                           the committed history's regressions,
                                                           exit 1 when any (runs nothing)

Machines are named after the device: "nvidia-h200-sm_90", "amd-instinct-mi300x-gfx942",
"cpu-amd-epyc-2c".

History rule (`history`), beside the two-commit `compare`: the results committed for a
machine, per benchmark time (track_ms) and parameter combination, ordered by commit date (the
date asv records, then the hash), only results of the benchmark's newest version. The
*current* time is the minimum of the last WINDOW results (default 3), the *best earlier*
time the minimum of every result before them. A benchmark is flagged when

    current / best earlier > max(family factor, MARGIN x spread)

with the family factors of FACTORS (1.10, quant 1.15; --factor FAMILY=X overrides), MARGIN
1.1 (--margin) and the spread (max / min over repeated runs of one commit) measured for that
benchmark in results/asv-noise/<machine>.json; without an entry there, the factor alone. The
step is reported at the first commit from which every result stays above best earlier x
limit, with the size of the rise (current / best earlier). A series needs WINDOW + 1 results
to be judged. Minima make the rule robust to the slow outliers a busy machine produces: one
slow run cannot raise the minimum of a window, so it takes WINDOW slow results in a row; a
regression stays flagged until a fix brings the last WINDOW results back within the limit.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
CONF = json.loads((ROOT / "asv.conf.json").read_text())
RESULTS = ROOT / CONF["results_dir"]
SUITES = ROOT / CONF["benchmark_dir"]
HTML = ROOT / CONF["html_dir"]

# A benchmark regresses when its time grows past its family's factor. The factors sit above
# the run-to-run spread measured on the H200 for each family (docs/benchmarking.md).
FACTORS = {"activations": 1.10, "layernorm": 1.10, "attention": 1.10, "quant": 1.15}
DEFAULT_FACTOR = 1.10
# Where a machine's measured noise is kept (outside asv's results folder, which reads every
# JSON file there as results): per benchmark, max / min of its time over repeated runs of
# one commit. compare() then flags a benchmark only past NOISE_MARGIN times that spread (and
# never under its family's factor): a rise inside what the same code shows is not a regression.
NOISE = RESULTS.parent / "asv-noise"
NOISE_MARGIN = 1.10

# Where kernels live, per device kind: a commit changed a kernel when the code (not only
# docstrings or comments) of a file under these paths changed. A GPU machine's history
# follows the Triton kernels, a CPU machine's the C++ ones: a change to the other kind
# cannot move its numbers.
KERNEL_PATHS = {
    "cuda": (":(glob)packages/*/src/openkernels/*/triton/**",),
    "cpu": (":(glob)packages/*/src/openkernels/*/cpu/**", ":(glob)shared/src/openkernels/shared/cpu/**"),
}
# Families whose suites a change under a path exercises ("shared" changes reach them all).
FAMILIES = ("activations", "layernorm", "attention", "quant")
# host_time times every family's public calls (each family's cases come with it).
SUITE_MODULES = {"activations": ["activations", "host_time"], "layernorm": ["layernorm", "host_time"],
                 "attention": ["attention", "host_time"], "quant": ["quant", "host_time"]}  # fmt: skip


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


# ---------------------------------------------------------------------------- the machine


def _slug(text: str) -> str:
    text = re.sub(r"\(r\)|\(tm\)|\bprocessor\b|\bcpu\b|@.*$", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def machine_name() -> str:
    """GPU model and arch on a GPU machine, CPU model and core count otherwise."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        arch = (
            getattr(props, "gcnArchName", "").split(":")[0]
            if torch.version.hip
            else f"sm_{props.major}{props.minor}"
        )
        return f"{_slug(props.name)}-{arch}"
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1]
                break
    except OSError:
        pass
    return f"cpu-{_slug(model)}-{os.cpu_count()}c"


def ensure_machine(name: str) -> None:
    """asv's machine record (~/.asv-machine.json), filled from this host, under `name`."""
    asv("machine", "--machine", name, "--yes", capture=True)


# ---------------------------------------------------------------------------- selection


def load_suites() -> list[object]:
    """An instance of every suite class (importing the suites needs no torch)."""
    sys.path.insert(0, str(SUITES.parent))
    import importlib

    suites = []
    for path in sorted(SUITES.glob("[!_]*.py")):
        module = importlib.import_module(f"{SUITES.name}.{path.stem}")
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and value.__module__ == module.__name__
                and hasattr(value, "measure_all")
            ):
                suites.append(value())
    return suites


def selection(dev: str, *, families: list[str] | None = None, lean: bool = False) -> str:
    """A regex naming exactly the benchmarks measured on this kind of device.

    asv starts a process for every benchmark and parameter combination it is asked for, so
    naming only those that apply here keeps it from starting thousands that would only say
    n/a. lean: the history subset, bfloat16 on the device's own kernels (Triton or C++), no
    peer suite and no end-to-end model (a suite's `lean` attribute).
    """
    own = "triton" if dev == "cuda" else "cpu"
    names = []
    for suite in load_suites():
        module = type(suite).__module__.split(".", 1)[-1]
        if families and module not in {m for f in families for m in SUITE_MODULES[f]}:
            continue
        if lean and not getattr(suite, "lean", True):
            continue
        tracks = sorted(n for n in dir(suite) if n.startswith("track_"))
        for combo in suite.combos(dev):
            params = dict(zip(suite.param_names, combo, strict=True))
            if lean and "backend" in params and (params["backend"] != own or params["dtype"] != "bfloat16"):
                continue
            label = re.escape(f"({', '.join(repr(v) for v in combo)})")
            names.append(f"{re.escape(module)}\\.{type(suite).__name__}\\.(?:{'|'.join(tracks)}){label}")
    if not names:
        raise SystemExit("no benchmark applies here")
    return "^(?:" + "|".join(names) + ")$"


# ---------------------------------------------------------------------------- running asv


def asv(*args: str, env: dict[str, str] | None = None, capture: bool = False, check: bool = True) -> int:
    cmd = [sys.executable, "-m", "asv", *args]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=capture, text=True)
    if check and done.returncode not in (0, 2):  # 2: some benchmark failed, reported by asv
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited with {done.returncode}\n{done.stderr or ''}")
    return done.returncode


def export_commit(sha: str, into: Path) -> str:
    """The commit's shared and family sources under `into`; returns their src folders as a path."""
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", sha, "shared", "packages"], cwd=ROOT, check=True, stdout=out)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    srcs = [into / "shared" / "src", *sorted((into / "packages").glob("*/src"))]
    return os.pathsep.join(str(p) for p in srcs if p.is_dir())


STABLE_PYTHON = Path(tempfile.gettempdir()) / "openkernels-asv" / "python"


def stable_python() -> str:
    """A wrapper at one fixed path that runs this interpreter. asv names an existing
    environment after its interpreter's path and draws one graph line per name: through the
    wrapper, runs from any venv or checkout (nox, a GPU runner, the lent H200) stay one line."""
    STABLE_PYTHON.parent.mkdir(parents=True, exist_ok=True)
    STABLE_PYTHON.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    STABLE_PYTHON.chmod(0o755)
    return str(STABLE_PYTHON)


def run_commit(
    commit: str,
    *,
    machine: str,
    regex: str,
    launch: str = "spawn",
    smoke: bool = False,
    working_tree: bool = False,
) -> int:
    """Benchmark one commit on this machine with the suites of the checkout; asv's exit code.

    working_tree: the checkout's sources instead of the commit's (the smoke run checks the
    suites against the code beside them; nothing is saved then)."""
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="openkernels-asv-") as tmp:
        if working_tree:
            srcs = [ROOT / "shared" / "src", *sorted((ROOT / "packages").glob("*/src"))]
            path = os.pathsep.join(str(p) for p in srcs)
        else:
            path = export_commit(sha, Path(tmp))
        extra = os.environ.get("ASV_PYTHONPATH")  # e.g. where asv_runner lives, if not beside torch
        env = {
            "ASV_PYTHONPATH": os.pathsep.join([path, *([extra] if extra else [])]),
            "OPENKERNELS_ASV_SELECT": regex,
            "OPENKERNELS_STRICT": "1",
            **({"OPENKERNELS_ASV_SMOKE": "1"} if smoke else {}),
        }
        args = ["run", "-E", f"existing:{stable_python()}", "--set-commit-hash", sha, "--machine", machine,
                "--bench", regex, "--launch-method", launch, "--show-stderr"]  # fmt: skip
        if smoke:
            args += ["--quick", "--dry-run"]
        print(f"asv: {sha[:10]} on {machine} ({launch} launch)", flush=True)
        return asv(*args, env=env)


# ---------------------------------------------------------------------------- results


def load_results(machine: str, sha: str) -> dict[tuple[str, str], float]:
    """{(benchmark, params): value} of one commit on one machine, from the results folder."""
    from asv.results import iter_results_for_machine_and_hash

    values: dict[tuple[str, str], float] = {}
    for result in iter_results_for_machine_and_hash(str(RESULTS), machine, sha):
        for name in result.get_all_result_keys():
            params = result.get_result_params(name)
            value = result.get_result_value(name, params)
            combos = _combos(params) if params else [""]
            for label, v in zip(combos, value if params else [value], strict=False):
                if v is not None and v == v:
                    values[(name, label)] = float(v)
    return values


def _combos(params: list[list[str]]) -> list[str]:
    import itertools

    return [", ".join(p) for p in itertools.product(*params)]


def family_of(benchmark: str) -> str:
    return benchmark.split(".", 1)[0]


def measure_noise(machine: str, runs: int, regex: str, launch: str, budget_s: float = 0) -> dict:
    """Benchmark HEAD `runs` times; per benchmark (track_ms) the spread max / min of its
    times; written to NOISE/<machine>.json with the commit, date and per-family quantiles.
    With `budget_s`, no run starts after that many seconds; the file is rewritten after every
    run from the second on, so a call cut short keeps what it measured."""
    sha = git("rev-parse", "--verify", "HEAD^{commit}")
    times: dict[str, list[float]] = {}
    start = time.monotonic()
    data: dict = {}
    for i in range(runs):
        if i >= 2 and budget_s and time.monotonic() - start > budget_s:
            print(f"noise: budget of {budget_s:.0f} s spent after {i} runs", flush=True)
            break
        print(f"noise: run {i + 1} of {runs}", flush=True)
        run_commit(sha, machine=machine, regex=regex, launch=launch)
        for (name, label), value in load_results(machine, sha).items():
            if name.endswith(".track_ms"):
                times.setdefault(f"{name}({label})", []).append(value)
        if i >= 1:
            data = _write_noise(machine, sha, i + 1, times)
    return data


def _write_noise(machine: str, sha: str, runs: int, times: dict[str, list[float]]) -> dict:
    spread = {k: max(v) / min(v) for k, v in sorted(times.items()) if len(v) == runs and min(v) > 0}
    families: dict[str, dict[str, float]] = {}
    for family in sorted({family_of(k) for k in spread}):
        values = sorted(v for k, v in spread.items() if family_of(k) == family)
        families[family] = {"n": len(values), "median": _quantile(values, 0.5), "p90": _quantile(values, 0.9),
                            "max": values[-1]}  # fmt: skip
    data = {"machine": machine, "commit": sha, "date": time.strftime("%Y-%m-%d"), "runs": runs,
            "families": families, "spread": spread}  # fmt: skip
    NOISE.mkdir(parents=True, exist_ok=True)
    (NOISE / f"{machine}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"noise after {runs} runs:")
    for family, q in families.items():
        print(f"{family:12} {q['n']:4} benchmarks: spread median {q['median']:.3f}, p90 {q['p90']:.3f}, "
              f"max {q['max']:.3f}")  # fmt: skip
    return data


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_noise(machine: str) -> dict[str, float]:
    """{"benchmark(params)": spread} measured on `machine`, or {} when never measured."""
    path = NOISE / f"{machine}.json"
    return json.loads(path.read_text())["spread"] if path.exists() else {}


class Row(NamedTuple):
    """One time of the two-commit comparison: status ("slower", "faster", "new", "only base"
    or ""), benchmark, parameters, base and head ms (None where missing), ratio, limit."""

    status: str
    name: str
    label: str
    base: float | None
    head: float | None
    ratio: float
    limit: float


def compare_rows(
    machine: str, base: str, head: str, factors: dict[str, float]
) -> tuple[list[Row], list[str]]:
    """Every time either commit has, judged: the rows (slowest ratio first) and the
    regressions (a time past its limit: its family's factor, or NOISE_MARGIN times its
    measured spread if larger; or measured at the base and missing at head)."""
    before, after = load_results(machine, base), load_results(machine, head)
    noise = load_noise(machine)
    rows, regressions = [], []
    for key in sorted(set(before) | set(after)):
        name, label = key
        if not name.endswith(".track_ms"):
            continue  # throughput is the same measurement; time is what is judged
        b, a = before.get(key), after.get(key)
        limit = max(
            factors.get(family_of(name), DEFAULT_FACTOR), NOISE_MARGIN * noise.get(f"{name}({label})", 0.0)
        )
        if b is None or a is None:
            if a is None:
                regressions.append(f"{name}({label}): measured at the base, failed or missing at head")
            rows.append(Row("only base" if a is None else "new", name, label, b, a, float("nan"), limit))
            continue
        ratio = a / b
        status = "slower" if ratio > limit else "faster" if ratio < 1 / limit else ""
        if status == "slower":
            regressions.append(f"{name}({label}): {b:.4g} -> {a:.4g} ms ({ratio:.2f}x, limit {limit:.2f}x)")
        rows.append(Row(status, name, label, b, a, ratio, limit))
    rows.sort(key=lambda r: -(r.ratio if r.ratio == r.ratio else 9))
    return rows, regressions


def compare(machine: str, base: str, head: str, factors: dict[str, float]) -> list[str]:
    """Print the table of every time both commits have; return the regressions (compare_rows)."""
    rows, regressions = compare_rows(machine, base, head, factors)
    print(f"{'':7} {'base ms':>10} {'head ms':>10} {'ratio':>6}  benchmark (params)")
    for r in rows:
        fmt = lambda v: f"{v:10.4g}" if v is not None else f"{'-':>10}"  # noqa: E731
        print(
            f"{r.status:7} {fmt(r.base)} {fmt(r.head)} {r.ratio:6.2f}  {r.name.removesuffix('.track_ms')}({r.label})"
        )
    return regressions


def markdown_report(machine: str, base: str, head: str, rows: list[Row], regressions: list[str]) -> str:
    """The comparison as markdown, for the CI job's summary and its commit comment: the verdict,
    the regressions, then every time with its ratio and limit (slowest first)."""
    verdict = f"**{len(regressions)} regression(s)**" if regressions else "no regression"
    lines = [f"## asv: {head[:8]} against {base[:8]} on {machine}: {verdict}", ""]
    lines += [f"- {r}" for r in regressions] + ([""] if regressions else [])
    lines += ["| | benchmark (params) | base ms | head ms | ratio | limit |", "|---|---|---|---|---|---|"]
    cell = lambda v: f"{v:.4g}" if v is not None else "-"  # noqa: E731
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio == r.ratio else "-"
        bench = f"`{r.name.removesuffix('.track_ms')}({r.label})`"
        lines.append(f"| {r.status} | {bench} | {cell(r.base)} | {cell(r.head)} | {ratio} | {r.limit:.2f}x |")
    return "\n".join(lines) + "\n"


def publish() -> Path:
    """asv publish, then the regressions view keeps times only: asv reads every larger value
    as worse, so a throughput gain (GB/s, TFLOP/s up) would be listed as a regression."""
    asv("publish")
    path = HTML / "regressions.json"
    if path.exists():
        data = json.loads(path.read_text())
        data["regressions"] = [r for r in data.get("regressions", []) if ".track_ms" in r[0]]
        path.write_text(json.dumps(data))
    return HTML / "index.html"


# ---------------------------------------------------------------------------- history rule

HISTORY_WINDOW = 3


class Point(NamedTuple):
    """One committed time: the commit's date (ms since the epoch, as asv records it), hash, value."""

    date: int
    commit: str
    value: float


class Regression(NamedTuple):
    """A benchmark whose last results all sit above its best earlier result times `limit`."""

    benchmark: str
    best: Point  # the best (lowest) result before the last window
    current: float  # the minimum of the last window
    step: Point  # the first result of the rise that lasts to the newest one
    before: Point  # the result just before the step
    limit: float

    @property
    def rise(self) -> float:
        return self.current / self.best.value


def history_machines(results: Path | None = None) -> list[str]:
    """The machines with committed results (a folder holding asv's machine.json)."""
    return sorted(p.parent.name for p in (results or RESULTS).glob("*/machine.json"))


def _row_times(columns: list[str], row: list) -> list[tuple[str, float]]:
    """(params label, time) of one benchmark's row in an asv result file; failures dropped."""
    cell = dict(zip(columns, row))
    values, params = cell.get("result"), cell.get("params") or []
    labels = _combos(params) if params else [""]
    values = values if params else [values]
    return [
        (label, float(v))
        for label, v in zip(labels, values or [])
        if isinstance(v, (int, float)) and math.isfinite(v)
    ]


def load_series(machine: str, results: Path | None = None) -> dict[str, list[Point]]:
    """{"benchmark(params)": its times, oldest commit first} of every track_ms committed for
    `machine`, read as plain JSON; only results of the benchmark's newest version."""
    found: dict[str, list[tuple[Point, str]]] = {}
    for path in sorted(((results or RESULTS) / machine).glob("*.json")):
        if path.name == "machine.json":
            continue
        data = json.loads(path.read_text())
        columns = data.get("result_columns", ["result", "params", "version"])
        for name, row in (data.get("results") or {}).items():
            if not name.endswith(".track_ms") or not row:
                continue
            version = str(dict(zip(columns, row)).get("version"))
            for label, value in _row_times(columns, row):
                point = Point(int(data["date"]), data["commit_hash"], value)
                found.setdefault(f"{name}({label})", []).append((point, version))
    return {key: _newest_version(points) for key, points in sorted(found.items())}


def _newest_version(points: list[tuple[Point, str]]) -> list[Point]:
    ordered = sorted(points, key=lambda pv: (pv[0].date, pv[0].commit))
    return [p for p, v in ordered if v == ordered[-1][1]]


def history_limit(benchmark: str, noise: dict[str, float], factors: dict[str, float], margin: float) -> float:
    """max(the family's factor, `margin` x the benchmark's measured spread, when measured)."""
    return max(factors.get(family_of(benchmark), DEFAULT_FACTOR), margin * noise.get(benchmark, 0.0))


def judge(benchmark: str, series: list[Point], window: int, limit: float) -> Regression | None:
    """The history rule on one series (oldest first): the regression, or None."""
    if len(series) <= window:
        return None
    best = min(series[:-window], key=lambda p: p.value)
    current = min(p.value for p in series[-window:])
    if best.value <= 0 or current <= best.value * limit:
        return None
    threshold = best.value * limit
    start = next(i for i in range(len(series)) if min(p.value for p in series[i:]) > threshold)
    return Regression(benchmark, best, current, series[start], series[start - 1], limit)


def history(
    machine: str,
    *,
    window: int = HISTORY_WINDOW,
    margin: float = NOISE_MARGIN,
    factors: dict[str, float] | None = None,
    results: Path | None = None,
) -> tuple[list[Regression], int]:
    """The regressions in `machine`'s committed history, and how many series were judged."""
    noise = load_noise(machine)
    factors = FACTORS if factors is None else factors
    found, judged = [], 0
    for benchmark, series in load_series(machine, results).items():
        judged += len(series) > window
        limit = history_limit(benchmark, noise, factors, margin)
        regression = judge(benchmark, series, window, limit)
        if regression:
            found.append(regression)
    return found, judged


def _when(point: Point) -> str:
    return f"{point.commit[:8]} ({time.strftime('%Y-%m-%d', time.gmtime(point.date / 1000))})"


def describe(r: Regression, window: int) -> str:
    """One line per regression: where the step happened and how large the rise is."""
    return (
        f"{r.benchmark.replace('.track_ms', '')}: step at {_when(r.step)} after {_when(r.before)}; "
        f"min of last {window} {r.current:.4g} ms vs best earlier {r.best.value:.4g} ms at "
        f"{_when(r.best)}: {r.rise:.2f}x (limit {r.limit:.2f}x)"
    )


# ---------------------------------------------------------------------------- history


def _code(text: str, path: str) -> str:
    """A file's code without docstrings and comments (the raw text for non-Python files)."""
    if not path.endswith(".py"):
        return text
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _show(sha: str, path: str) -> str:
    done = subprocess.run(["git", "show", f"{sha}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def kernel_commits(dev: str) -> list[tuple[str, list[str]]]:
    """(sha, families) of every commit, oldest first, whose kernels for `dev` changed; only
    families with benchmark cases at that commit (their bench module) are listed."""
    paths = KERNEL_PATHS[dev]
    shas = git("log", "--reverse", "--format=%H", "--", *paths).split()
    out = []
    for sha in shas:
        files = git("diff-tree", "--no-commit-id", "--name-only", "-r", "--root", sha, "--", *paths).split()
        parent = git("rev-list", "--parents", "-n", "1", sha).split()[1:2]
        changed = [f for f in files if not parent or _code(_show(sha, f), f) != _code(_show(parent[0], f), f)]
        if not changed:
            continue  # docstrings and comments only
        families = sorted({f.split("/")[1] for f in changed if f.startswith("packages/")})
        if any(f.startswith("shared/") for f in changed):
            families = list(FAMILIES)
        benched = [
            f for f in families if f in FAMILIES and _show(sha, f"packages/{f}/src/openkernels/{f}/bench.py")
        ]
        out.append((sha, benched))
    return out


def has_results(machine: str, sha: str) -> bool:
    return any((RESULTS / machine).glob(f"{sha[:8]}-*.json"))


# ---------------------------------------------------------------------------- commands


def _factors(overrides: list[str]) -> dict[str, float]:
    """FACTORS with the command line's FAMILY=X overrides."""
    factors = dict(FACTORS)
    for item in overrides:
        family, _, value = item.partition("=")
        factors[family] = float(value)
    return factors


def history_command(machines: list[str], window: int, margin: float, factors: dict[str, float]) -> int:
    """Print the history rule's regressions per machine; 1 when any, else 0."""
    if window < 1:
        raise SystemExit("history: --window must be at least 1")
    flagged = 0
    for machine in machines:
        if not (RESULTS / machine).is_dir():
            raise SystemExit(f"history: no results for {machine} in {RESULTS}")
        found, judged = history(machine, window=window, margin=margin, factors=factors)
        noise = "measured noise" if load_noise(machine) else "no noise file: family factors only"
        print(f"{machine}: {judged} series judged (window {window}, {noise}), {len(found)} regression(s)")
        for regression in found:
            print("  " + describe(regression, window))
        flagged += len(found)
    return 1 if flagged else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="benchmark one commit (default HEAD) on this machine")
    p_run.add_argument("commit", nargs="?", default="HEAD")
    p_cmp = sub.add_parser("compare", help="benchmark BASE and HEAD, print the table, exit 1 on regressions")
    p_cmp.add_argument("base")
    p_cmp.add_argument("head")
    p_cmp.add_argument("--no-run", action="store_true", help="compare results already in the folder")
    p_cmp.add_argument("--factor", action="append", default=[], metavar="FAMILY=X", help="override a factor")
    p_cmp.add_argument("--report", metavar="PATH", help="also write the comparison as markdown here")
    sub.add_parser("publish", help="the HTML report (asv publish) into " + CONF["html_dir"])
    p_smoke = sub.add_parser("smoke", help="every suite once on tiny shapes, untimed, results not saved")
    p_smoke.add_argument("--families", default="", help="comma-separated families (default: all)")
    p_list = sub.add_parser("kernel-commits", help="list the commits that changed a kernel")
    p_list.add_argument("--device", action="append", choices=["cuda", "cpu"], help="default: both")
    p_back = sub.add_parser("backfill", help="benchmark the kernel commits that have no results here yet")
    p_back.add_argument("--budget-s", type=float, default=0, help="start no commit after this many seconds")
    p_back.add_argument("--newest-first", action="store_true")
    p_noise = sub.add_parser("noise", help="benchmark HEAD several times; record each benchmark's spread")
    p_noise.add_argument("--runs", type=int, default=4)
    p_noise.add_argument(
        "--budget-s", type=float, default=0, help="start no run after this many seconds (2 always run)"
    )
    p_hist = sub.add_parser("history", help="the history rule on committed results; exit 1 when any flagged")
    p_hist.add_argument("--machine", action="append", help="default: every machine with results")
    p_hist.add_argument("--window", type=int, default=HISTORY_WINDOW, help="results in the last window")
    p_hist.add_argument("--margin", type=float, default=NOISE_MARGIN, help="times the measured spread")
    p_hist.add_argument("--factor", action="append", default=[], metavar="FAMILY=X", help="override a factor")
    for p in (p_run, p_cmp, p_back, p_noise):
        p.add_argument("--lean", action="store_true", help="bfloat16 on the device's own kernels only")
        p.add_argument("--families", default="", help="comma-separated families (default: all)")
        p.add_argument(
            "--launch", default=CONF.get("launch_method", "spawn"), choices=["spawn", "forkserver"]
        )
    args = parser.parse_args(argv)

    if args.command == "kernel-commits":
        for dev in args.device or ("cuda", "cpu"):
            print(f"# {dev}")
            for sha, families in kernel_commits(dev):
                print(sha[:10], ",".join(families) or "-", git("log", "-1", "--format=%s", sha)[:80])
        return 0
    if args.command == "publish":
        print(f"report: {publish()}")
        return 0
    if args.command == "history":
        machines = args.machine or history_machines()
        return history_command(machines, args.window, args.margin, _factors(args.factor))

    dev = device_type()
    machine = machine_name()
    ensure_machine(machine)
    if args.command == "smoke":
        # forkserver: hundreds of lookups at ~10 ms each instead of a fresh interpreter each;
        # safe because no process here touches a GPU before it forks.
        families = [f for f in args.families.split(",") if f] or None
        regex = selection(dev, families=families)
        code = run_commit(
            "HEAD", machine=machine, regex=regex, launch="forkserver", smoke=True, working_tree=True
        )
        return 1 if code else 0

    families = [f for f in args.families.split(",") if f] or None
    if args.command == "run":
        return 1 if run_commit(args.commit, machine=machine, regex=selection(dev, families=families,
                               lean=args.lean), launch=args.launch) else 0  # fmt: skip
    if args.command == "compare":
        factors = _factors(args.factor)
        base, head = (git("rev-parse", "--verify", f"{c}^{{commit}}") for c in (args.base, args.head))
        regex = selection(dev, families=families, lean=args.lean)
        if not args.no_run:
            for sha in (base, head):
                run_commit(sha, machine=machine, regex=regex, launch=args.launch)
        regressions = compare(machine, base, head, factors)
        if args.report:
            rows, _ = compare_rows(machine, base, head, factors)
            Path(args.report).write_text(markdown_report(machine, base, head, rows, regressions))
        if regressions:
            print(f"\n{len(regressions)} regression(s) on {machine}:", *regressions, sep="\n  ")
            return 1
        print(f"\nno regression on {machine} (factors: {factors})")
        return 0
    if args.command == "noise":
        if args.runs < 2:
            raise SystemExit("noise: --runs must be at least 2")
        measure_noise(
            machine, args.runs, selection(dev, families=families, lean=args.lean), args.launch, args.budget_s
        )
        return 0
    if args.command == "backfill":
        start = time.monotonic()
        commits = kernel_commits(dev)
        for sha, touched in reversed(commits) if args.newest_first else commits:
            chosen = [f for f in touched if not families or f in families]
            if not chosen or has_results(machine, sha):
                continue
            if args.budget_s and time.monotonic() - start > args.budget_s:
                print("budget spent; run backfill again for the rest")
                break
            try:
                regex = selection(dev, families=chosen, lean=args.lean)
            except SystemExit:
                continue
            run_commit(sha, machine=machine, regex=regex, launch=args.launch)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
