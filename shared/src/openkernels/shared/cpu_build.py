"""Compile a C++ source shipped in a wheel into a shared library on first use, load it with ctypes.

Every compile gets ``-I INCLUDE_DIR``: the headers shipped with this package (``openkernels_cpu.h``: the
helpers the kernel families share). Libraries are cached under
``${OPENKERNELS_CACHE:-~/.cache/openkernels}/cpu/<name>-<hash>/``; the hash covers the source, the
headers in INCLUDE_DIR, the flags, the compiler version and the CPU (the code is built for
-march=native), so editing a shared header rebuilds every library that may include it.

An entry holds ``lib<name>.so`` and its manifest ``lib<name>.json`` (size and SHA-256). A library that
does not match its manifest (truncated, empty, overwritten, or from a version without manifests) is
rebuilt, never loaded: mapping a truncated library kills the process with SIGBUS. One process builds
an entry while the others wait on ``lib<name>.lock`` (flock), then load what it built. A build writes
temporary files, fsyncs them and renames them into place; it first removes the temporary files of
builds that were killed. Where the cache cannot be written, libraries are built in a temporary
directory for this process only. A build that fails is not retried in the process, and a compiler
that also fails on an empty source turns the CPU kernels off (no_compiler_reason) after that one error.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: no build lock; the renames keep every entry whole
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "BASE_FLAGS",
    "INCLUDE_DIR",
    "CpuBuildError",
    "KernelLibrary",
    "cache_root",
    "compiler",
    "compiler_available",
    "dtype_support",
    "load_library",
    "no_compiler_reason",
]

BASE_FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=c++17")
# Flags dropped, in turn, when the compiler's error shows it rejects them: the flag named, OpenMP's
# header or runtime missing, or an assembler older than the compiler failing on -march=native's
# instructions. Any other error is final: a broken compiler costs one run, not one per combination.
_OPTIONAL_FLAGS: dict[str, tuple[str, ...]] = {
    "-march=native": ("march", "Assembler messages", "no such instruction"),
    "-fopenmp": ("openmp", "omp.h", "gomp", "libomp"),
}
# Shared headers, on every compile's include path. Kept out of the flags that are hashed: the key
# covers the headers' content, not where this package is installed.
INCLUDE_DIR = pathlib.Path(__file__).with_name("cpu")
_TIMEOUT_S = 300
_TMP_PREFIX = ".tmp-"  # then "<pid>-<random>-<file name>": the pid tells a killed build's leftovers

_lock = threading.Lock()
_loaded: dict[tuple[str, str, tuple[str, ...]], ctypes.CDLL] = {}
_failed: dict[tuple[str, str, tuple[str, ...]], str] = {}  # builds that failed, not retried
_probed: dict[tuple[str, ...], str] = {}  # compiler -> "" (builds an empty source) or why not
_warned = False
_warned_cache = False
_cxx_skipped: str | None = None


class CpuBuildError(RuntimeError):
    """The C++ compiler failed; the message holds its stderr."""


@functools.cache
def compiler() -> tuple[str, ...] | None:
    """The C++ compiler command ($CXX, else c++, g++ or clang++ on PATH), or None.

    A $CXX that names no executable is skipped with a warning; the next candidate is used.
    """
    global _cxx_skipped
    try:
        env = shlex.split(os.environ.get("CXX", ""))
    except ValueError:  # unbalanced quotes
        env = [os.environ["CXX"]]
    if env:
        path = shutil.which(env[0])
        if path is not None:
            return (path, *env[1:])
        _cxx_skipped = f"$CXX={os.environ['CXX']!r} is not an executable"
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path is not None:
            if _cxx_skipped:
                warnings.warn(
                    f"openkernels: {_cxx_skipped}; compiling with {path}", RuntimeWarning, stacklevel=2
                )
            return (path,)
    return None


def compiler_available() -> bool:
    """True when a C++ compiler was found (cached)."""
    return compiler() is not None


def no_compiler_reason() -> str | None:
    """None when a usable compiler exists; else a reason, warning once that the reference path runs.

    Not usable either: a compiler that failed on an empty source after failing a build in this
    process. That build's CpuBuildError already reported it, so it is not warned again.
    """
    global _warned
    cmd = compiler()
    if cmd is not None:
        return _probed.get(cmd) or None
    reason = "no C++ compiler found ($CXX, c++, g++ or clang++)"
    if _cxx_skipped:
        reason = f"{_cxx_skipped} and no c++, g++ or clang++ on PATH"
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


def _local_headers_digest(source: pathlib.Path) -> bytes:
    """Names and contents of the headers beside `source` (a family's own, sorted): what its
    `#include "..."` lines may pull in besides INCLUDE_DIR's."""
    digest = hashlib.sha256()
    for header in sorted(p for p in source.parent.iterdir() if p.suffix in (".h", ".hpp", ".cuh")):
        for part in (header.name.encode(), header.read_bytes()):
            digest.update(part)
            digest.update(b"\0")
    return digest.digest()


def _cache_key(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str]) -> str:
    """Hex digest of what the library depends on: source, the headers beside it, shared
    headers, flags, compiler, CPU."""
    digest = hashlib.sha256()
    for part in (
        source.read_bytes(),
        _local_headers_digest(source),
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


def _compile(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], out: str) -> str:
    """Compile to `out`; return "" on success, else the compiler's output."""
    try:
        run = subprocess.run(
            [*_command(cmd, source, flags), "-o", out],
            check=False,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return str(error) or type(error).__name__
    if run.returncode != 0:
        return run.stderr or run.stdout or f"exit status {run.returncode}"
    return ""


def _probe(cmd: tuple[str, ...]) -> None:
    """After a failed build: does `cmd` build an empty library at all? If not, no_compiler_reason()
    says so from now on, and every CPU backend runs the reference without trying (and warning) again."""
    if cmd in _probed:
        return
    try:
        with tempfile.TemporaryDirectory(prefix="openkernels-probe-") as tmp:
            source = pathlib.Path(tmp, "probe.cpp")
            source.write_text('extern "C" int ok_probe(void) { return 0; }\n')
            flags = [f for f in BASE_FLAGS if f not in _OPTIONAL_FLAGS]
            error = _compile(cmd, source, flags, str(source.with_suffix(".so")))
    except OSError:
        return
    first = error.strip().splitlines()[0] if error.strip() else ""
    _probed[cmd] = error and f"the C++ compiler {shlex.join(cmd)} fails on an empty source ({first})"


def _compile_with_fallbacks(
    cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], out: str
) -> None:
    """Compile to `out`, dropping the optional flags the compiler rejects; CpuBuildError if it fails."""
    attempt, first = tuple(flags), ""
    while True:
        error = _compile(cmd, source, attempt, out)
        if not error:
            return
        first = first or f"$ {shlex.join(_command(cmd, source, attempt))}\n{error}"
        rejected = [
            f for f, signs in _OPTIONAL_FLAGS.items() if f in attempt and any(s in error for s in signs)
        ]
        if not rejected:
            _probe(cmd)
            raise CpuBuildError(f"compiling {source.name} failed:\n{first}")
        attempt = tuple(f for f in attempt if f not in rejected)


def _fingerprint(data: bytes) -> dict[str, int | str]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verified(target: pathlib.Path) -> bool:
    """True when `target` matches its manifest (size and SHA-256)."""
    try:
        manifest = json.loads(target.with_suffix(".json").read_text())
        return manifest == _fingerprint(target.read_bytes())
    except (OSError, ValueError):
        return False


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (True where that cannot be told)."""
    if pid <= 0:
        return False
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _clean_stale(entry: pathlib.Path) -> None:
    """Remove the temporary files of builds that died: their process is gone, or they are older than
    a compile may take (a pid from another host or container may look alive)."""
    for path in entry.glob(f"{_TMP_PREFIX}*"):
        try:
            pid = int(path.name[len(_TMP_PREFIX) :].split("-", 1)[0])
            if not _alive(pid) or time.time() - path.stat().st_mtime > _TIMEOUT_S:
                path.unlink()
        except (OSError, ValueError):
            continue


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (one process builds an entry; the others wait, then load it).

    No lock where the file cannot be opened or locked, or after waiting as long as a compile may
    take (a stopped holder must not hang every process): the renames keep the entry whole anyway.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + _TIMEOUT_S
        while fcntl is not None and time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.05)
            except OSError:
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync_dir(path: pathlib.Path) -> None:
    """Make the renames into `path` durable (not every file system can sync a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _build(cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], target: pathlib.Path) -> None:
    """Build `target` and its manifest: temporary files, fsynced, renamed into place.

    OSError where the entry cannot be written; CpuBuildError where the compiler fails.
    """
    manifest = target.with_suffix(".json")
    tmps: list[str] = []
    try:
        for final in (target, manifest):
            fd, tmp = tempfile.mkstemp(
                prefix=f"{_TMP_PREFIX}{os.getpid()}-", suffix=f"-{final.name}", dir=target.parent
            )
            os.close(fd)
            tmps.append(tmp)
        _compile_with_fallbacks(cmd, source, flags, tmps[0])
        with open(tmps[0], "rb+") as f:
            data = f.read()
            os.fsync(f.fileno())
        # mkstemp's files are private: let the manifest be as readable as the library is.
        os.chmod(tmps[1], os.stat(tmps[0]).st_mode & 0o666)
        with open(tmps[1], "w") as f:
            json.dump(_fingerprint(data), f)
            f.flush()
            os.fsync(f.fileno())
        # The library first: a crash between the renames leaves a manifest that does not match it.
        os.replace(tmps[0], target)
        os.replace(tmps[1], manifest)
        _fsync_dir(target.parent)
    finally:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _dlopen(path: pathlib.Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as error:
        raise CpuBuildError(f"loading {path} failed: {error}") from error


def _build_private(
    cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], name: str, why: OSError
) -> ctypes.CDLL:
    """Build in a temporary directory, load, delete it: for a cache that cannot be written."""
    global _warned_cache
    if not _warned_cache:
        _warned_cache = True
        warnings.warn(
            f"openkernels: the CPU kernel cache {cache_root()} cannot be written ({why}); the kernels are "
            "built for this process only (set OPENKERNELS_CACHE to a writable directory)",
            RuntimeWarning,
            stacklevel=3,
        )
    with tempfile.TemporaryDirectory(prefix="openkernels-") as tmp:
        path = pathlib.Path(tmp, name)
        _compile_with_fallbacks(cmd, source, flags, str(path))
        return _dlopen(path)  # the mapping outlives the file


def _load(
    cmd: tuple[str, ...], source: pathlib.Path, flags: Sequence[str], target: pathlib.Path
) -> ctypes.CDLL:
    """Load `target` if it matches its manifest; else build it (one process at a time) and load it."""
    if not _verified(target):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(target.with_suffix(".lock")):
                if not _verified(target):  # else another process built it while this one waited
                    _clean_stale(target.parent)
                    _build(cmd, source, flags, target)
        except OSError as error:
            return _build_private(cmd, source, flags, target.name, error)
    return _dlopen(target)


def load_library(
    source: pathlib.Path, *, name: str, extra_flags: Sequence[str] = (), command: tuple[str, ...] | None = None,
    base_flags: Sequence[str] = BASE_FLAGS, root: pathlib.Path | None = None,
) -> ctypes.CDLL:  # fmt: skip
    """Compile `source` (once per content, shared headers, flags, compiler and CPU) and load it.
    `command`, `base_flags`, `root`: another toolchain and cache directory than the C++
    compiler's (cuda_build passes nvcc's).

    CpuBuildError where it cannot be built or loaded; that failure is final for this process.
    """
    source = pathlib.Path(source).resolve()
    flags = (*base_flags, *extra_flags)
    key = (str(source), name, flags)
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        if key in _failed:
            raise CpuBuildError(_failed[key])
        cmd = command or compiler()
        if cmd is None:
            raise CpuBuildError(no_compiler_reason() or "no C++ compiler")
        target = (root or cache_root()) / f"{name}-{_cache_key(cmd, source, flags)[:16]}" / f"lib{name}.so"
        try:
            lib = _loaded[key] = _load(cmd, source, flags, target)
        except (CpuBuildError, OSError) as error:
            _failed[key] = str(error) if isinstance(error, CpuBuildError) else f"building {name}: {error}"
            raise CpuBuildError(_failed[key]) from error
        return lib


class KernelLibrary:
    """A family's C++ kernels: `source` compiled and loaded on the first call, each kernel's
    argument types declared (every kernel returns an int status), the library seen by replay
    recordings (`openkernels.shared.replay.observe_library`). Calling it returns the library.

    signatures: kernel name -> ctypes argument types, in order. A CpuBuildError is raised at
    the call, and again at every later call (load_library does not retry a failed build).
    """

    def __init__(
        self,
        source: pathlib.Path,
        *,
        name: str,
        signatures: Mapping[str, Sequence[Any]],
        extra_flags: Sequence[str] = (),
    ) -> None:
        self.source, self.name, self.extra_flags = pathlib.Path(source), name, tuple(extra_flags)
        self.signatures = {kernel: list(argtypes) for kernel, argtypes in signatures.items()}
        self._lib: Any = None
        self._lock = threading.Lock()

    def __call__(self) -> Any:
        if self._lib is None:
            from . import replay  # replay builds its own library through this module

            with self._lock:
                if self._lib is None:
                    lib = load_library(self.source, name=self.name, extra_flags=self.extra_flags)
                    for kernel, argtypes in self.signatures.items():
                        fn = getattr(lib, kernel)
                        fn.argtypes, fn.restype = argtypes, ctypes.c_int
                    self._lib = replay.observe_library(lib, tuple(self.signatures))
        return self._lib


def dtype_support(dtype: Any, supported: Collection[Any]) -> str | None:
    """A C++ backend's dispatch predicate on one dtype: None when `dtype` (a torch.dtype) is one
    of `supported` and a compiler is there, else why not (float64 goes to the reference)."""
    if dtype not in supported:
        if str(dtype) == "torch.float64":
            return "float64 runs on the reference implementation"
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        return f"{dtype} is not supported ({names})"
    return no_compiler_reason()
