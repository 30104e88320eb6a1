"""Compile a CUDA C++ source shipped in a wheel with nvcc into a shared library on first use,
load it with ctypes: the GPU counterpart of `cpu_build`, sharing its cache discipline
(manifest-checked entries, one builder per entry under a file lock, a private build where the
cache cannot be written).

A library holds the kernels and extern "C" host entries that launch them on a stream the
caller passes (cudart linked statically: it shares the driver's primary context with
PyTorch). Entries live under ``${OPENKERNELS_CACHE:-~/.cache/openkernels}/cuda/<name>-<hash>/``;
the hash covers the source, the flags and nvcc's version.

`ptxas_report` compiles a source for one architecture without a GPU and returns each
kernel's registers and spills: the compile check CI runs for every CUDA C++ kernel.
`load_emulated` builds the same source for the CPU with the host compiler against
`cuda/cuda_emulation.h` (threads as fibers, one OS thread per CTA, clusters met at a barrier):
the kernels then run on CPU tensors, which is how CI checks their results without a GPU.
Every build has `cuda/` on its include path: sources share `async_copy.h` (cp.async, dynamic
shared memory) from there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import cpu_build

__all__ = [
    "CudaBuildError",
    "CudaLibrary",
    "KernelReport",
    "gencode",
    "nvcc",
    "no_nvcc_reason",
    "ptxas_report",
]

# -fPIC goes to the host compiler; cudart is linked statically (nvcc's default).
BASE_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
_TIMEOUT_S = 600
EMULATION_DIR = pathlib.Path(__file__).with_name("cuda")  # cuda_emulation.h, async_copy.h


def _header_flags() -> tuple[str, ...]:
    """The shared headers' folder on the include path, and their digest as a define: part of
    every build's flags, hence of its cache key (a changed header rebuilds)."""
    digest = hashlib.sha256()
    for header in sorted(EMULATION_DIR.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return ("-I", str(EMULATION_DIR), f"-DOK_SHARED_HEADERS={digest.hexdigest()[:16]}")


class CudaBuildError(RuntimeError):
    """nvcc is missing or failed; the message says which, with its output."""


@functools.cache
def nvcc() -> str | None:
    """The nvcc executable: $NVCC, $CUDA_HOME/bin/nvcc, else nvcc on PATH; None if none."""
    candidates = [os.environ.get("NVCC", "")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates.append("nvcc")
    for candidate in candidates:
        path = shutil.which(candidate) if candidate else None
        if path is not None:
            return path
    return None


def no_nvcc_reason() -> str | None:
    """None when nvcc is there, else why the CUDA C++ kernels cannot be built."""
    return None if nvcc() is not None else "nvcc not found ($NVCC, $CUDA_HOME/bin/nvcc or PATH)"


def gencode(arch: str) -> str:
    """nvcc's target flag for an arch such as "sm_90a": machine code only (no PTX to JIT)."""
    number = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{number},code=sm_{number}"


def _cache_root() -> pathlib.Path:
    return cpu_build.cache_root().parent / "cuda"


def load_library(
    source: pathlib.Path, *, name: str, arch: str, extra_flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """Compile `source` for `arch` (once per content, flags and nvcc version) and load it,
    through cpu_build's cache with nvcc as the compiler. CudaBuildError where it cannot be
    built or loaded; that failure is final for this process."""
    cmd = nvcc()
    if cmd is None:
        raise CudaBuildError(no_nvcc_reason() or "no nvcc")
    try:
        return cpu_build.load_library(source, name=name, extra_flags=(gencode(arch), *_header_flags(), *extra_flags),
                                      command=(cmd,), base_flags=BASE_FLAGS, root=_cache_root())  # fmt: skip
    except cpu_build.CpuBuildError as error:
        raise CudaBuildError(f"building {name} with nvcc: {error}") from error


def load_emulated(source: pathlib.Path, *, name: str, defines: Sequence[str] = ()) -> ctypes.CDLL:
    """`source` built for the CPU (C++20, -DOK_CUDA_EMULATION, cuda_emulation.h) with the host
    compiler and loaded: its host entries then launch the kernels on CPU memory. `defines`:
    more -D flags (a variant of the source). Cached as the CPU libraries are (the shared
    headers' digest is part of the flags, hence of the key); cpu_build.CpuBuildError where it
    cannot be built."""
    flags = ("-std=c++20", "-pthread", "-DOK_CUDA_EMULATION", *defines, *_header_flags(), "-x", "c++")
    return cpu_build.load_library(source, name=f"{name}_emulated", extra_flags=flags)


class CudaLibrary:
    """A family's CUDA C++ kernels: `source` built for `arch` and loaded on the first call,
    each host entry's argument types declared (every entry returns an int status: 0, a
    cudaError_t, or a negative code of the entry's own), the library seen by replay
    recordings as `cpu_build.KernelLibrary`'s is: an entry `f` with an exported
    `int f_packed(const int64_t* args)` replays from C++ (pass the stream as an integer, a
    constant of the recording: recordings key on the stream). `queries`: entries that launch
    nothing (they ask the device, say, an occupancy), declared alike but not seen by
    recordings. Calling it returns the library."""

    def __init__(
        self, source: pathlib.Path, *, name: str, arch: str, signatures: Mapping[str, Sequence[Any]],
        extra_flags: Sequence[str] = (), queries: Mapping[str, Sequence[Any]] | None = None,
    ) -> None:  # fmt: skip
        self.source, self.name, self.arch = pathlib.Path(source), name, arch
        self.extra_flags = tuple(extra_flags)
        self.signatures = {entry: list(argtypes) for entry, argtypes in signatures.items()}
        self.queries = {entry: list(argtypes) for entry, argtypes in (queries or {}).items()}
        self._lib: Any = None
        self._emulated: Any = None
        self._lock = threading.Lock()

    def emulated(self) -> Any:
        """The same entries built for the CPU (load_emulated), declared and observed alike:
        they take CPU pointers. cpu_build.CpuBuildError where it cannot be built."""
        if self._emulated is None:
            from . import replay

            with self._lock:
                if self._emulated is None:
                    # The variant's -D flags too (nvcc's other flags mean nothing to the host compiler).
                    defines = [f for f in self.extra_flags if f.startswith("-D")]
                    lib = load_emulated(self.source, name=self.name, defines=defines)
                    for entry, argtypes in self.signatures.items():
                        fn = getattr(lib, entry)
                        fn.argtypes, fn.restype = argtypes, ctypes.c_int
                    self._emulated = self._with_queries(
                        lib, replay.observe_library(lib, tuple(self.signatures))
                    )
        return self._emulated

    def __call__(self) -> Any:
        if self._lib is None:
            from . import replay  # replay builds its own library through cpu_build

            with self._lock:
                if self._lib is None:
                    lib = load_library(
                        self.source, name=self.name, arch=self.arch, extra_flags=self.extra_flags
                    )
                    for entry, argtypes in self.signatures.items():
                        fn = getattr(lib, entry)
                        fn.argtypes, fn.restype = argtypes, ctypes.c_int
                    self._lib = self._with_queries(lib, replay.observe_library(lib, tuple(self.signatures)))
        return self._lib

    def _with_queries(self, lib: ctypes.CDLL, observed: Any) -> Any:
        for entry, argtypes in self.queries.items():
            fn = getattr(lib, entry)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(observed, entry, fn)
        return observed


@dataclass(frozen=True)
class KernelReport:
    """What ptxas said of one kernel (its mangled name)."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    # Instructions whose 64-bit memory descriptor sits in an odd uniform register (`desc[UR1]`):
    # an illegal instruction on the GPU (seen from ptxas 13.0 with an L2 cache-policy hint in
    # inline asm). -1: not checked (no cuobjdump here).
    odd_descriptors: int = -1


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SASS_FUNCTION = re.compile(r"Function : (\S+)")
_DESCRIPTOR = re.compile(r"desc\[UR(\d+)\]")


def cuobjdump() -> str | None:
    """cuobjdump from the PATH, the CUDA toolkit beside nvcc, or the copy Triton ships."""
    found = shutil.which("cuobjdump")
    if found is None and (cmd := nvcc()) is not None:
        beside = pathlib.Path(cmd).resolve().with_name("cuobjdump")
        found = str(beside) if beside.exists() else None
    if found is None:
        try:
            import triton

            bundled = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
            found = str(bundled) if bundled.exists() else None
        except ImportError:
            pass
    return found


def _odd_descriptors(cubin: str) -> dict[str, int] | None:
    """Per kernel of `cubin`, how many SASS instructions take a memory descriptor from an odd
    uniform register; None where no cuobjdump can disassemble it."""
    tool = cuobjdump()
    if tool is None:
        return None
    run = subprocess.run(
        [tool, "-sass", cubin], check=False, capture_output=True, text=True, timeout=_TIMEOUT_S
    )
    return count_odd_descriptors(run.stdout) if run.returncode == 0 else None


def count_odd_descriptors(sass: str) -> dict[str, int]:
    """Per function of cuobjdump's `sass` text, the instructions reading a memory descriptor
    from an odd uniform register (`desc[UR1]`; descriptors are 64-bit, so even pairs)."""
    counts: dict[str, int] = {}
    name = None
    for line in sass.splitlines():
        if m := _SASS_FUNCTION.search(line):
            name = m.group(1)
            counts.setdefault(name, 0)
        elif name is not None and any(int(r) % 2 for r in _DESCRIPTOR.findall(line)):
            counts[name] += 1
    return counts


def ptxas_report(
    source: pathlib.Path, arch: str, extra_flags: Sequence[str] = (), *, use_cache: bool = True
) -> list[KernelReport]:
    """Compile `source` to a cubin for `arch` (no GPU needed) and return ptxas's report of
    every kernel, with the SASS check of its memory descriptors where cuobjdump is found
    (KernelReport.odd_descriptors). CudaBuildError when nvcc is missing or fails.

    Reports are kept on disk (``${OPENKERNELS_CACHE:-~/.cache/openkernels}/ptxas/``) under a key
    of everything that decides them: the source and the files beside it, the shared headers
    (their digest is in the flags), the flags and nvcc's version; a failed compile is never
    kept. A template-heavy source takes nvcc 20-45 s per arch, every test run without this."""
    cmd = nvcc()
    if cmd is None:
        raise CudaBuildError(no_nvcc_reason() or "no nvcc")
    flags = ["-O3", "-std=c++17", "-cubin", gencode(arch), "-Xptxas", "-v", *_header_flags(), *extra_flags]
    key = _report_key(source, flags, cmd)
    if use_cache and (cached := _load_reports(key)) is not None:
        return cached
    with tempfile.TemporaryDirectory(prefix="openkernels-ptxas-") as tmp:
        cubin = os.path.join(tmp, "out.cubin")
        run = subprocess.run(
            [cmd, *flags, str(source), "-o", cubin],
            check=False,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        odd = _odd_descriptors(cubin) if run.returncode == 0 else None
    if run.returncode != 0:
        raise CudaBuildError(f"nvcc failed on {source.name} for {arch}:\n{run.stderr or run.stdout}")
    reports: list[KernelReport] = []
    name, frame = None, None
    for line in (run.stderr + run.stdout).splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), None
        elif (m := _FRAME.search(line)) and name is not None:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and name is not None:
            stack, stores, loads = frame or (0, 0, 0)
            descriptors = -1 if odd is None else odd.get(name, 0)
            reports.append(KernelReport(name, int(m.group(1)), stores, loads, stack, descriptors))
            name = None
    if use_cache:
        _store_reports(key, reports)
    return reports


def _report_key(source: pathlib.Path, flags: Sequence[str], cmd: str) -> str:
    """The source and every C++ file beside it (what it may include), the flags, nvcc's version."""
    digest = hashlib.sha256()
    digest.update(source.name.encode() + b"\0" + source.read_bytes())
    for path in sorted(source.parent.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h", ".hpp") and path != source:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join(flags).encode())
    digest.update(cpu_build._compiler_version((cmd,)).encode())
    digest.update(b"sass-descriptors-v1" if cuobjdump() else b"no-sass")  # what the report holds
    return digest.hexdigest()


def _reports_dir() -> pathlib.Path:
    return cpu_build.cache_root().parent / "ptxas"


def _load_reports(key: str) -> list[KernelReport] | None:
    try:
        rows = json.loads((_reports_dir() / f"{key}.json").read_text())
        return [KernelReport(**row) for row in rows]
    except (OSError, ValueError, TypeError):  # missing, torn or from another layout: compile
        return None


def _store_reports(key: str, reports: list[KernelReport]) -> None:
    directory = _reports_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([asdict(r) for r in reports], f)
        os.replace(tmp, directory / f"{key}.json")  # whole or absent, for concurrent runs
    except OSError:
        pass  # a read-only cache only costs time
