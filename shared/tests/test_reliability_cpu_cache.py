"""Fault matrix of the CPU kernel cache (cpu_build): damaged entries, concurrent and killed builds, a
cache that cannot be written, a missing or failing compiler.

Each test has its own cache directory and builds a one-line C++ source (~0.3 s a compile); fake
compilers are shell scripts that log each compile (not `--version`) and then fail, wait or run the
real compiler. Subprocesses where a fault would kill the test process or where the state is another
process's (a SIGBUS, a killed build, cold processes racing).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings

import pytest

from openkernels.shared import cpu_build

REAL_CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
needs_compiler = pytest.mark.skipif(REAL_CXX is None, reason="no C++ compiler")

NAME = "ok_fault"
SOURCE = 'extern "C" int ok_answer(int x) { return x + 42; }\n'
# Loads NAME from the source in argv[1] with OPENKERNELS_CACHE and CXX from the environment.
LOADER = (
    "import pathlib, sys\n"
    "from openkernels.shared import cpu_build\n"
    f"lib = cpu_build.load_library(pathlib.Path(sys.argv[1]), name={NAME!r})\n"
    "print(lib.ok_answer(1))\n"
)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A fresh cache directory, and cpu_build's per-process state reset (compiler lookup included)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("OPENKERNELS_CACHE", str(root))
    monkeypatch.delenv("CXX", raising=False)
    for state in ("_loaded", "_failed", "_probed"):
        monkeypatch.setattr(cpu_build, state, {}, raising=False)
    for flag in ("_warned", "_warned_cache"):
        monkeypatch.setattr(cpu_build, flag, False, raising=False)
    monkeypatch.setattr(cpu_build, "_cxx_skipped", None, raising=False)
    cpu_build.compiler.cache_clear()
    yield root
    cpu_build.compiler.cache_clear()


@pytest.fixture
def source(tmp_path) -> pathlib.Path:
    path = tmp_path / "fault.cpp"
    path.write_text(SOURCE)
    return path


def _fake_cxx(tmp_path: pathlib.Path, compile_body: str) -> tuple[pathlib.Path, pathlib.Path]:
    """A compiler script: `--version` is the real compiler's (the cache key stays the same), a compile
    appends its arguments to the log and runs `compile_body`. Returns (script, log)."""
    script, log = tmp_path / "fake-cxx", tmp_path / "compiles.log"
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *--version*) exec {REAL_CXX} "$@";; esac\n'
        f'echo "$*" >> {log}\n'
        f"{compile_body}\n"
    )
    script.chmod(0o755)
    return script, log


def _compiles(log: pathlib.Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _env(cache: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "OPENKERNELS_STRICT")}
    return {**env, "OPENKERNELS_CACHE": str(cache), **extra}


def _load_in_subprocess(source: pathlib.Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOADER, str(source)], env=env, capture_output=True, text=True, timeout=60
    )


def _entry(cache: pathlib.Path) -> pathlib.Path:
    (entry,) = (cache / "cpu").glob(f"{NAME}-*")
    return entry


@needs_compiler
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_library_is_rebuilt(cache, source, damage) -> None:
    """A truncated .so used to kill the loading process (SIGBUS), an empty or garbage one to raise
    OSError for good; the manifest check rebuilds all three."""
    cpu_build.load_library(source, name=NAME)
    library = _entry(cache) / f"lib{NAME}.so"
    good = library.read_bytes()
    damaged = {"truncated": good[: len(good) // 2], "empty": b"", "garbage": b"\x7fELF not a library"}
    library.unlink()  # a new file: this process has the good one mapped
    library.write_bytes(damaged[damage])

    run = _load_in_subprocess(source, _env(cache))
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    assert run.stdout.strip() == "43"
    assert library.stat().st_size == len(good)


@needs_compiler
def test_concurrent_cold_processes_compile_once(cache, source, tmp_path) -> None:
    """Cold processes on one cache: one compiles (under the entry's flock), the others load its build."""
    cxx, log = _fake_cxx(tmp_path, f'sleep 1; exec {REAL_CXX} "$@"')
    env = _env(cache, CXX=str(cxx))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOADER, str(source)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-1000:] for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["43"] * 4
    assert len(_compiles(log)) == 1


@needs_compiler
def test_killed_build_is_cleaned_and_rebuilt(cache, source, tmp_path) -> None:
    """A build killed mid-compile leaves its temporary file; the next build removes it and succeeds."""
    cxx, log = _fake_cxx(tmp_path, "sleep 60")
    proc = subprocess.Popen(
        [sys.executable, "-c", LOADER, str(source)],
        env=_env(cache, CXX=str(cxx)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not _compiles(log) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the loader and its compiler
    proc.wait(timeout=10)
    entry = _entry(cache)
    assert [p for p in entry.iterdir() if p.name.startswith(".")], "the killed build left no temp file"

    lib = cpu_build.load_library(source, name=NAME)  # the real compiler: same compiler version, same entry
    assert lib.ok_answer(1) == 43
    assert [p.name for p in entry.iterdir() if p.name.startswith(".")] == []


@needs_compiler
def test_unwritable_cache_builds_for_the_process(cache, source, tmp_path, monkeypatch) -> None:
    """A cache that cannot be created or written (here below a regular file: modes do not stop root)
    builds in a temporary directory, with one warning for the process."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("OPENKERNELS_CACHE", str(blocker / "cache"))
    other = tmp_path / "other.cpp"
    other.write_text('extern "C" int ok_other(void) { return 7; }\n')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_build.load_library(source, name=NAME).ok_answer(1) == 43
        assert cpu_build.load_library(other, name="ok_fault_other").ok_other() == 7
    assert len(caught) == 1 and "cannot be written" in str(caught[0].message)


def test_no_compiler(cache, source, tmp_path, monkeypatch) -> None:
    """No compiler anywhere: one warning, a reason naming the missing $CXX, CpuBuildError on load."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CXX", str(tmp_path / "missing-cxx"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reasons = {cpu_build.no_compiler_reason() for _ in range(3)}
        with pytest.raises(cpu_build.CpuBuildError):
            cpu_build.load_library(source, name=NAME)
    (reason,) = reasons
    assert reason is not None and "$CXX" in reason and "missing-cxx" in reason
    assert len(caught) == 1


@needs_compiler
def test_missing_cxx_falls_back_to_path(cache, source, tmp_path, monkeypatch) -> None:
    """$CXX naming no executable used to turn the CPU kernels off with c++ on PATH; now it is skipped,
    with the reason in one warning."""
    monkeypatch.setenv("CXX", str(tmp_path / "missing-cxx"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_build.no_compiler_reason() is None
        assert cpu_build.load_library(source, name=NAME).ok_answer(1) == 43
    assert len(caught) == 1 and "missing-cxx" in str(caught[0].message)


@needs_compiler
def test_failing_compiler_runs_once_per_library(cache, source, tmp_path, monkeypatch) -> None:
    """A compiler that exits 1 used to be run 4 times (flag combinations) per load; now once per library
    and process, then once on an empty source, after which no_compiler_reason() turns the CPU off."""
    cxx, log = _fake_cxx(tmp_path, 'echo "fake-cxx: internal error" >&2; exit 1')
    monkeypatch.setenv("CXX", str(cxx))
    other = tmp_path / "other.cpp"
    other.write_text(SOURCE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for path, name in ((source, NAME), (other, "ok_fault_other")):
                with pytest.raises(cpu_build.CpuBuildError, match="internal error"):
                    cpu_build.load_library(path, name=name)
        reason = cpu_build.no_compiler_reason()
    compiles = _compiles(log)
    assert sum(str(source) in c for c in compiles) == 1
    assert sum(str(other) in c for c in compiles) == 1
    assert len(compiles) == 3  # and the empty-source probe
    assert reason is not None and "internal error" in reason
    assert caught == []  # the CpuBuildError is the report; dispatch turns it into one warning


@needs_compiler
def test_failing_compiler_warns_once_through_dispatch(cache, tmp_path) -> None:
    """The issue's case: 27 warnings and 108 compiles over activations and layernorm ops in three
    dtypes; now one warning, one compile and one probe (layernorm is not tried)."""
    pytest.importorskip("torch")
    pytest.importorskip("openkernels.activations")
    pytest.importorskip("openkernels.layernorm")
    cxx, log = _fake_cxx(tmp_path, "exit 1")
    script = (
        "import warnings, torch\n"
        "import openkernels.activations as A, openkernels.layernorm as L\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for dtype in (torch.float32, torch.bfloat16, torch.float16):\n"
        "        x, w = torch.randn(4, 16, dtype=dtype), torch.ones(16, dtype=dtype)\n"
        "        A.silu(x), A.gelu(x), A.silu_and_mul(x), L.rms_norm(x, w)\n"
        "print(len(caught))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(cache, CXX=str(cxx)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "1"
    assert len(_compiles(log)) == 2


@needs_compiler
def test_rejected_optional_flag_is_dropped(cache, source, tmp_path, monkeypatch) -> None:
    """A compiler whose error names an optional flag (-fopenmp here) is retried without it."""
    body = (
        'case "$*" in *-fopenmp*) echo "error: unsupported option \'-fopenmp\'" >&2; exit 1;; esac\n'
        f'exec {REAL_CXX} "$@"'
    )
    cxx, log = _fake_cxx(tmp_path, body)
    monkeypatch.setenv("CXX", str(cxx))
    lib = cpu_build.load_library(source, name=NAME)
    assert isinstance(lib, ctypes.CDLL) and lib.ok_answer(1) == 43
    assert len(_compiles(log)) == 2
