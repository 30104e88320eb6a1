"""Compile a C++ source shipped in a wheel into a shared library on first use, load it with ctypes.

Every compile gets ``-I INCLUDE_DIR``: the headers shipped with this package (``openkernels_cpu.h``: the
helpers the kernel families share). Libraries are cached under
``${OPENKERNELS_CACHE:-~/.cache/openkernels}/cpu/<name>-<hash>/``; the hash covers the source, the
headers in INCLUDE_DIR, the flags, the compiler version and the CPU (the code is built for
-march=native), so editing a shared header rebuilds every library that may include it.
Several processes may build the same library at once: each compiles to a temporary file and renames it
into place atomically.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence

__all__ = [
    "BASE_FLAGS",
    "INCLUDE_DIR",
    "CpuBuildError",
    "cache_root",
    "compiler",
    "compiler_available",
    "load_library",
    "no_compiler_reason",
]

BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c++17")
_OPTIONAL_FLAGS = ("-march=native", "-fopenmp")  # dropped, in turn, when the compiler rejects them
# Shared headers, on every compile's include path. Kept out of the flags that are hashed: the key
# covers the headers' content, not where this package is installed.
INCLUDE_DIR = pathlib.Path(__file__).with_name("cpu")
_TIMEOUT_S = 300

_lock = threading.Lock()
_loaded: dict[tuple[str, str, tuple[str, ...]], ctypes.CDLL] = {}
_warned = False


class CpuBuildError(RuntimeError):
    """The C++ compiler failed; the message holds its stderr."""


@functools.cache
def compiler() -> tuple[str, ...] | None:
    """The C++ compiler command ($CXX, else c++, g++ or clang++ on PATH), or None."""
    env = shlex.split(os.environ.get("CXX", ""))
    candidates = [env] if env else [["c++"], ["g++"], ["clang++"]]
    for cmd in candidates:
        path = shutil.which(cmd[0])
        if path is not None:
            return (path, *cmd[1:])
    return None


def compiler_available() -> bool:
    """True when a C++ compiler was found (cached)."""
    return compiler() is not None


def no_compiler_reason() -> str | None:
    """None when a compiler exists; else a reason, warning once that the reference path runs."""
    global _warned
    if compiler_available():
        return None
    reason = "no C++ compiler found ($CXX, c++, g++ or clang++)"
    if not _warned:
        _warned = True
        warnings.warn(
            f"openkernels: {reason}; the CPU kernels fall back to the reference implementation",
            RuntimeWarning,
            stacklevel=2,
        )
    return reason


def cache_root() -> pathlib.Path:
    """Directory holding the compiled CPU libraries."""
    base = os.environ.get("OPENKERNELS_CACHE") or os.path.join("~", ".cache", "openkernels")
    return pathlib.Path(base).expanduser() / "cpu"


@functools.cache
def _compiler_version(cmd: tuple[str, ...]) -> str:
    try:
        run = subprocess.run([*cmd, "--version"], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown ({error})"
    return run.stdout + run.stderr


@functools.cache
def _cpu_signature() -> str:
    """CPU model and feature flags: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            wanted = ("model name", "flags", "Features", "CPU part")
            lines = {}
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in wanted and key not in lines:
                    lines[key] = line.strip()
            return "\n".join(lines[k] for k in wanted if k in lines)
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _headers_digest() -> bytes:
    """Names and contents of the headers in INCLUDE_DIR (sorted): part of every cache key."""
    digest = hashlib.sha256()
    for header in sorted(INCLUDE_DIR.glob("*.h")):
        for part in (header.name.encode(), header.read_bytes()):
            digest.update(part)
            digest.update(b"\0")
    return digest.digest()


def _cache_key(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str]) -> str:
    """Hex digest of what the library depends on: source, shared headers, flags, compiler, CPU."""
    digest = hashlib.sha256()
    for part in (
        source.read_bytes(),
        _headers_digest(),
        "\0".join(flags).encode(),
        _compiler_version(cmd).encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    digest.update(_cpu_signature().encode())
    return digest.hexdigest()


def _command(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str]) -> list[str]:
    """The compile command, without its output: the flags, the shared include directory, the source."""
    return [*cmd, *flags, "-I", str(INCLUDE_DIR), str(source)]


def _compile(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], target: pathlib.Path) -> str:
    """Compile to `target` atomically; return "" on success, else the compiler's output."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run(
            [*_command(cmd, source, flags), "-o", tmp],
            check=False,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        if run.returncode != 0:
            return run.stderr or run.stdout or f"exit status {run.returncode}"
        os.replace(tmp, target)
        return ""
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: pathlib.Path, *, name: str, extra_flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compile `source` (once per content, shared headers, flags, compiler and CPU) and load it."""
    source = pathlib.Path(source).resolve()
    flags = (*BASE_FLAGS, *extra_flags)
    key = (str(source), name, flags)
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        cmd = compiler()
        if cmd is None:
            raise CpuBuildError(no_compiler_reason() or "no C++ compiler")
        target = cache_root() / f"{name}-{_cache_key(cmd, source, flags)[:16]}" / f"lib{name}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Retry without the optional flags a compiler may reject (-march=native, -fopenmp).
            attempts = [flags]
            for drop in _OPTIONAL_FLAGS:
                attempts += [tuple(f for f in a if f != drop) for a in attempts if drop in a]
            errors = []
            for attempt in attempts:
                error = _compile(cmd, source, attempt, target)
                if not error:
                    break
                errors.append(f"$ {shlex.join(_command(cmd, source, attempt))}\n{error}")
            else:
                raise CpuBuildError(f"compiling {source.name} failed:\n" + "\n".join(errors[:1]))
        lib = _loaded[key] = ctypes.CDLL(str(target))
        return lib
