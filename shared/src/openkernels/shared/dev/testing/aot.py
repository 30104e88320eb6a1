"""Ahead-of-time compile checks of Triton kernels for GPUs this machine does not have.

`triton.compile` needs no GPU when it is given a target: this module compiles each
`AotCase` for sm_80, sm_90, gfx90a, gfx942 and gfx950 and reads what the machine code
costs per program, so kernels that would spill, need scratch memory or ask for more shared
memory than the chip has are caught in CI on a CPU-only runner. The wheel brings all tools:
ptxas for CUDA, LLVM and lld (linked into libtriton) for the AMD code objects; no CUDA
toolkit or ROCm install is needed.

* registers: CUDA registers per thread (`ptxas -v`); AMD VGPRs per lane (incl. AGPRs).
* spills: values the register allocator could not keep in registers. CUDA: bytes stored
  and loaded per thread (`ptxas -v`), always local memory. AMD: `.vgpr_spill_count` of the
  code object metadata; those VGPRs go to scratch memory (or to AGPRs on CDNA, cheaper but
  still a sign of a kernel at its limit). `.sgpr_spill_count` is reported but not counted:
  SGPRs spill into VGPR lanes, not memory.
* scratch: per-thread stack frame (CUDA) or per-lane private segment (AMD). Spills land
  there, and so do local arrays indexed at run time. Scratch traffic goes to DRAM through
  the caches and usually ruins a memory-bound kernel.
* shared memory: `metadata.shared`, the bytes one program asks for at launch. Over the
  per-block limit of the chip the launch fails ("out of resources"), so it is an error.

The kernel modules must import without a GPU driver (no launches at import) and the
process must not run with TRITON_INTERPRET=1, which turns `@triton.jit` functions into
interpreter objects. Compiles run in `spawn`ed worker processes (a compiler crash takes
down a worker, not the test run); a case crosses the process boundary by reference,
"package.module:kernel" plus the module's file, so kernels must be module-level
attributes (others are compiled in the calling process instead). Results are cached on
disk under `${OPENKERNELS_CACHE:-~/.cache/openkernels}/aot/`, keyed by everything that
changes the machine code, so a repeated check of an unchanged kernel does not compile.

Typical use in a family's tests::

    CASES = [AotCase(kernels.rmsnorm_fwd, {"x_ptr": "*bf16", ...}, {"BLOCK": 4096}, num_warps=8)]

    @pytest.mark.aot
    def test_kernels_compile_clean():
        reports = check_cases(CASES)  # targets from OPENKERNELS_AOT_TARGETS
        print(format_reports(reports))
        assert_clean(reports)

Written against triton 3.6 (ASTSource with `constexprs` and `attrs`, GPUTarget).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from ...platform import triton_interpreting

__all__ = [
    "check_vendor",
    "SHARED_LIMITS",
    "TARGETS",
    "TARGETS_ENV",
    "AotCase",
    "AotReport",
    "assert_clean",
    "check_cases",
    "compile_case",
    "format_reports",
    "targets_from_env",
]

TARGETS_ENV = "OPENKERNELS_AOT_TARGETS"
# "all": cases marked `variant` compile for every target, not only the reference targets.
VARIANTS_ENV = "OPENKERNELS_AOT_VARIANTS"
CACHE_ENV = "OPENKERNELS_CACHE"

# Warp sizes: 32 on NVIDIA; 64 (wave64) on every CDNA chip (gfx90a = CDNA2 / MI200,
# gfx942 = CDNA3 / MI300, gfx950 = CDNA4 / MI350).
TARGETS: dict[str, GPUTarget] = {
    "sm_80": GPUTarget("cuda", 80, 32),
    "sm_90": GPUTarget("cuda", 90, 32),  # compiled as sm_90a, as Triton does for Hopper
    "gfx90a": GPUTarget("hip", "gfx90a", 64),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}

# Most shared memory (LDS on AMD) one program (thread block / workgroup) may use, in bytes.
# NVIDIA: the opt-in dynamic maximum per block (A100: 163 KiB, H100: 227 KiB; consumer
# sm_86/sm_89 parts have only 99 KiB, sm_80 here means A100). AMD: the addressable LDS per
# workgroup, 64 KiB on CDNA2/CDNA3 and 160 KiB on CDNA4.
SHARED_LIMITS: dict[str, int] = {
    "sm_80": 163 * 1024,
    "sm_90": 227 * 1024,
    "gfx90a": 64 * 1024,
    "gfx942": 64 * 1024,
    "gfx950": 160 * 1024,
}

# Each vendor's reference target: where a case marked `variant` compiles (AotCase.variant).
# Every config's heaviest case compiles for all five; the specializations beside it (one flag
# alone, another dtype, a narrower head) add compiles, not new tiles, and are checked once
# per vendor: CI's cold compile checks were ~30 of its ~60 CPU minutes on the 2-core VM.
REFERENCE_TARGETS: dict[str, str] = {"cuda": "sm_90", "hip": "gfx942"}

# Bump when the measurement or the cache layout changes, to drop old cache entries.
_SCHEMA = 1


def targets_from_env() -> list[str]:
    """Target names from OPENKERNELS_AOT_TARGETS (comma separated); all five when unset."""
    raw = os.environ.get(TARGETS_ENV, "")
    names = [name.strip() for name in raw.split(",") if name.strip()]
    if not names:
        return list(TARGETS)
    _check_target_names(names, source=TARGETS_ENV)
    return names


def _check_target_names(names: Iterable[str], source: str = "targets") -> None:
    unknown = [name for name in names if name not in TARGETS]
    if unknown:
        raise ValueError(
            f"unknown AOT target(s) {', '.join(map(repr, unknown))} in {source}; "
            f"known targets: {', '.join(TARGETS)}"
        )


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class AotCase:
    """One kernel specialization to compile: the kernel, its argument types and constants.

    kernel: a `@triton.jit` function (an `@triton.autotune` / `@triton.heuristics` wrapper
        is unwrapped) or a "package.module:attr" or "path/to/file.py:attr" reference.
    signature: Triton type of every runtime argument, e.g. {"x_ptr": "*bf16", "n": "i32"}.
        Arguments named in `constexprs` may be left out.
    constexprs: values of the tl.constexpr arguments (constexpr defaults fill the rest).
    num_warps, num_stages: launch options, as in a triton.Config.
    label: pytest id and table row name; derived from the kernel and constants if empty.
    options: further compile options (e.g. {"waves_per_eu": 2}, {"maxnreg": 128});
        options a backend does not know are ignored by it.
    attrs: per-argument specialization the launcher would apply, as Triton spells it:
        "D" = value divisible by 16 (pointers: 16-byte aligned), "S" = (AMD) the tensor
        fits in 2 GiB so buffer loads can be used. The default is what a launch with fresh
        torch tensors sees: every pointer "D" (plus "S" on AMD when buffer ops are on),
        integers unspecialized; entries here override it per argument ("" = none). Give
        "D" to integer strides/sizes callers keep at multiples of 16 (Triton specializes
        on that at launch), or the check compiles a slower, unvectorized kernel than runs.
    allow_spills: do not count register spills as a problem.
    variant: a specialization beside its config's heaviest case (one flag alone, another
        dtype, a head padded to the same tile): compiled for the vendor's reference target
        (REFERENCE_TARGETS) when the run includes it, for every target otherwise or with
        OPENKERNELS_AOT_VARIANTS=all (`jobs`).
    max_scratch_bytes: per-thread scratch tolerated before it counts as a problem.
    """

    kernel: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 1
    label: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    attrs: Mapping[str, str] | None = None
    allow_spills: bool = False
    max_scratch_bytes: int = 0
    variant: bool = False

    def __post_init__(self) -> None:
        if not self.label:
            consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
            label = f"{_kernel_name(self.kernel)}[{consts}]w{self.num_warps}s{self.num_stages}"
            object.__setattr__(self, "label", label)

    def jit_function(self) -> JITFunction:
        """The JITFunction to compile, imported first when `kernel` is a reference."""
        kernel = self.kernel
        if isinstance(kernel, str):
            kernel = _import_ref(kernel, getattr(self, "_kernel_file", None))
        kernel = _unwrap(kernel)
        if not isinstance(kernel, JITFunction):
            hint = " (TRITON_INTERPRET is set)" if triton_interpreting() else ""
            raise TypeError(f"{self.label}: {type(kernel).__name__} is not a @triton.jit function{hint}")
        return kernel

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # JITFunctions do not pickle: send "module:qualname" and the module's file, and let
        # the worker process import the kernel again.
        ref = _kernel_ref(self.kernel)
        if ref is None:
            raise TypeError(
                f"{self.label}: kernel is not a module-level attribute, it cannot be sent by reference"
            )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values = {k: dict(v) if isinstance(v, Mapping) else v for k, v in values.items()}
        values["kernel"] = ref[0]
        return (_rebuild_case, (values, ref[1]))


def _rebuild_case(values: dict[str, Any], kernel_file: str | None) -> AotCase:
    case = AotCase(**values)
    object.__setattr__(case, "_kernel_file", kernel_file)  # not a field: no effect on ==
    return case


def _unwrap(kernel: Any) -> Any:
    """The JITFunction inside @triton.autotune / @triton.heuristics wrappers (their `.fn`)."""
    for _ in range(8):
        inner = getattr(kernel, "fn", None)
        if isinstance(kernel, JITFunction) or inner is None:
            break
        kernel = inner
    return kernel


def _kernel_name(kernel: Any) -> str:
    if isinstance(kernel, str):
        return kernel.rpartition(":")[2]
    return getattr(_unwrap(kernel), "__name__", "kernel")


_FILE_MODULES: dict[str, Any] = {}


def _load_file(path: str) -> Any:
    """Execute a Python file as a module of a private name (once per process)."""
    path = os.path.abspath(path)
    if path not in _FILE_MODULES:
        name = "_openkernels_aot_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load kernels from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _FILE_MODULES[path] = module
    return _FILE_MODULES[path]


def _same_file(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def _import_ref(ref: str, kernel_file: str | None = None) -> Any:
    """Resolve "package.module:attr" or "path/to/file.py:attr".

    A module that is not importable by name here (a test file pytest imported with
    --import-mode=importlib, whose directory is not on sys.path) is loaded from
    `kernel_file`, which must also be the file a by-name import finds.
    """
    module_name, sep, attr = ref.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"kernel reference {ref!r} is not of the form 'package.module:attr'")
    if module_name.endswith(".py"):
        module = _load_file(module_name)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if kernel_file is None:
                raise
            module = None
        if kernel_file is not None and (module is None or not _same_file(module.__file__, kernel_file)):
            module = _load_file(kernel_file)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _kernel_ref(kernel: Any) -> tuple[str, str | None] | None:
    """("module:qualname", module file) that re-imports to `kernel`, or None if there is none."""
    if isinstance(kernel, str):
        return kernel, None
    # A wrapper is found at module level under the name of the function it wraps.
    inner = _unwrap(kernel)
    module, qualname = getattr(inner, "__module__", None), getattr(inner, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        return None
    ref = f"{module}:{qualname}"
    try:
        if _import_ref(ref) is not kernel:
            return None
    except Exception:  # any failure means "not importable by reference"
        return None
    return ref, getattr(sys.modules.get(module), "__file__", None)


# --------------------------------------------------------------------------- reports


@dataclass
class AotReport:
    """What one case costs on one target, and the problems found.

    Byte counts are per thread (CUDA) or per lane (AMD); None where the vendor's tools do
    not report the number (spill bytes on AMD, spilled register counts on CUDA).
    """

    label: str
    target: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    registers: int | None = None
    spill_stores: int | None = None  # CUDA: bytes stored to spill slots per thread
    spill_loads: int | None = None  # CUDA: bytes loaded from spill slots per thread
    spilled_vgprs: int | None = None  # AMD: VGPRs spilled (to scratch, or to AGPRs on CDNA)
    spilled_sgprs: int | None = None  # AMD: SGPRs spilled (into VGPR lanes; not a problem)
    scratch_bytes: int | None = None  # CUDA stack frame / AMD private segment
    shared_bytes: int | None = None
    shared_limit: int = 0
    compile_seconds: float = 0.0  # wall time of triton.compile plus the resource read-out
    cached: bool = False  # True when the numbers come from the on-disk cache
    error: str | None = None  # full compiler message of a failed compile


@dataclass
class _Measured:
    """Raw numbers of one compile: what the disk cache stores."""

    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    spilled_vgprs: int | None = None
    spilled_sgprs: int | None = None
    scratch_bytes: int | None = None
    shared_bytes: int | None = None
    compile_seconds: float = 0.0
    error: str | None = None


def _judge(case: AotCase, target: str, m: _Measured, cached: bool) -> AotReport:
    """Turn measured numbers into a report; the thresholds live here, not in the cache."""
    limit = SHARED_LIMITS[target]
    problems: list[str] = []
    if m.error is not None:
        problems.append(f"compile error: {_summary(m.error)}")
    else:
        # SGPR spills go to VGPR lanes (v_writelane), not to memory: not counted; should they
        # reach memory, the scratch check below reports it.
        spilled = bool(m.spill_stores or m.spill_loads or m.spilled_vgprs)
        if spilled and not case.allow_spills:
            if m.spilled_vgprs is not None:
                where = "scratch" if m.scratch_bytes else "AGPRs"
                problems.append(f"spills {m.spilled_vgprs} VGPRs per lane to {where}")
            else:
                problems.append(f"spills {m.spill_stores} B stores / {m.spill_loads} B loads per thread")
        if m.scratch_bytes and m.scratch_bytes > case.max_scratch_bytes:
            problems.append(f"scratch {m.scratch_bytes} B per thread > {case.max_scratch_bytes} B allowed")
        if m.shared_bytes is not None and m.shared_bytes > limit:
            problems.append(f"shared memory {_kib(m.shared_bytes)} > {_kib(limit)} limit of {target}")
    return AotReport(
        label=case.label,
        target=target,
        ok=not problems,
        problems=problems,
        registers=m.registers,
        spill_stores=m.spill_stores,
        spill_loads=m.spill_loads,
        spilled_vgprs=m.spilled_vgprs,
        spilled_sgprs=m.spilled_sgprs,
        scratch_bytes=m.scratch_bytes,
        shared_bytes=m.shared_bytes,
        shared_limit=limit,
        compile_seconds=m.compile_seconds,
        cached=cached,
        error=m.error,
    )


def _summary(error: str) -> str:
    """Last meaningful line of a compiler message (Triton puts the reason last)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "unknown error")[:300]


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB"


# --------------------------------------------------------------------------- compile


def _attrs_for(
    case: AotCase, fn: JITFunction, signature: Mapping[str, str], target: GPUTarget
) -> dict[str, str]:
    """Specialization descriptors per argument name (see AotCase.attrs)."""
    ptr = "DS" if target.backend == "hip" and _amd_buffer_ops() else "D"
    attrs = {name: ptr for name in fn.arg_names if signature.get(name, "").startswith("*")}
    attrs.update(case.attrs or {})
    return {name: desc for name, desc in attrs.items() if desc}


def _amd_buffer_ops() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(getattr(getattr(knobs, "amd", None), "use_buffer_ops", False))


def _full_signature(case: AotCase, fn: JITFunction) -> tuple[dict[str, str], dict[str, Any]]:
    """Signature and constexprs covering every argument, in argument order."""
    constexprs = dict(case.constexprs)
    for param in fn.params:
        if (
            param.is_constexpr
            and param.name not in constexprs
            and param.default is not inspect.Parameter.empty
        ):
            constexprs[param.name] = param.default
    unknown = sorted((set(case.signature) | set(case.constexprs) | set(case.attrs or {})) - set(fn.arg_names))
    if unknown:
        raise ValueError(f"{case.label}: {fn.__name__} has no argument(s) {unknown}")
    missing = [n for n in fn.arg_names if n not in case.signature and n not in constexprs]
    if missing:
        raise ValueError(f"{case.label}: no type in signature and no constexpr value for {missing}")
    signature = {n: "constexpr" if n in constexprs else case.signature[n] for n in fn.arg_names}
    return signature, constexprs


@contextmanager
def _private_triton_cache() -> Iterator[None]:
    """Compile into a throw-away Triton cache: every compile is real (honest timings) and
    nothing lands in ~/.triton; our own cache is the one that saves repeated work."""
    old = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="openkernels-aot-") as tmp:
        os.environ["TRITON_CACHE_DIR"] = tmp
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old


def _measure(case: AotCase, target_name: str) -> _Measured:
    """Compile `case` for one target and read its resource use; errors become `error`."""
    from triton.compiler import ASTSource, make_backend

    start = time.perf_counter()
    try:
        target = TARGETS[target_name]
        fn = case.jit_function()
        signature, constexprs = _full_signature(case, fn)
        backend = make_backend(target)
        attrs = {
            (fn.arg_names.index(name),): backend.parse_attr(desc)
            for name, desc in _attrs_for(case, fn, signature, target).items()
        }
        if fn.is_gluon():  # Gluon kernels (explicit layouts) go through their own front end
            from triton.experimental.gluon._runtime import GluonASTSource

            source = GluonASTSource
        else:
            source = ASTSource
        src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": case.num_warps, "num_stages": case.num_stages, **case.options}
        kernel, log = _compile(src, target, options)
        if target.backend == "cuda":
            m = _parse_ptxas(log) or _parse_ptxas(_run_ptxas(kernel, target))
            if m is None:
                raise RuntimeError(f"could not read the ptxas -v report:\n{log}")
        else:
            m = _read_amdgcn(kernel.asm["amdgcn"])
        m.shared_bytes = int(kernel.metadata.shared)
    except Exception as exc:  # a failed compile is a result, not a crash
        m = _Measured(error=f"{type(exc).__name__}: {exc}")
    m.compile_seconds = round(time.perf_counter() - start, 3)
    return m


def _compile(src: Any, target: GPUTarget, options: dict[str, Any]) -> tuple[Any, str]:
    """triton.compile into a private cache; for CUDA also return the `ptxas -v` log of the
    cubin Triton builds (it runs ptxas with -v and prints the log when asked to)."""
    nvidia = getattr(getattr(triton, "knobs", None), "nvidia", None)
    out = io.StringIO()
    with _private_triton_cache():
        if target.backend != "cuda" or not hasattr(nvidia, "dump_ptxas_log"):
            return triton.compile(src, target=target, options=options), ""
        with nvidia.scope(), contextlib.redirect_stdout(out):
            nvidia.dump_ptxas_log = True
            kernel = triton.compile(src, target=target, options=options)
    return kernel, out.getvalue()


def _run_ptxas(kernel: Any, target: GPUTarget) -> str:
    """Run the wheel's ptxas -v on the kernel's PTX with Triton's flags (the fallback when
    Triton's own log was not captured) and return its log."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    meta = kernel.metadata
    cmd = [
        get_ptxas(target.arch).path,
        "-lineinfo",
        "-v",
        f"--gpu-name={sm_arch_from_capability(target.arch)}",
    ]
    if not getattr(meta, "enable_fp_fusion", True):
        cmd.append("--fmad=false")
    if getattr(meta, "ptx_options", None):
        cmd += meta.ptx_options.split()
    with tempfile.TemporaryDirectory(prefix="openkernels-ptxas-") as tmp:
        ptx = Path(tmp, "kernel.ptx")
        ptx.write_text(kernel.asm["ptx"])
        proc = subprocess.run(
            [*cmd, str(ptx), "-o", str(ptx.with_suffix(".cubin"))], capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -v failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stderr


def _parse_ptxas(log: str) -> _Measured | None:
    """Registers, spills and stack frame from a `ptxas -v` log; None if it has none."""
    # One "N bytes stack frame, N bytes spill stores, N bytes spill loads" line per function
    # (noinline helpers have their own); spills add up, the deepest frame counts.
    frame_re = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
    frames = [tuple(map(int, t)) for t in re.findall(frame_re, log)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    if not frames or not regs:
        return None
    return _Measured(
        registers=max(regs),
        spill_stores=sum(f[1] for f in frames),
        spill_loads=sum(f[2] for f in frames),
        scratch_bytes=max(f[0] for f in frames),
    )


def _read_amdgcn(asm: str) -> _Measured:
    """Read the code object metadata the AMDGPU backend prints at the end of the assembly."""

    def value(key: str) -> int:
        found = re.findall(rf"^\s*\.{key}:\s+(\d+)\s*$", asm, flags=re.MULTILINE)
        if not found:
            raise RuntimeError(f"no .{key} in the AMDGCN metadata")
        return max(map(int, found))

    return _Measured(
        registers=value("vgpr_count"),
        spilled_vgprs=value("vgpr_spill_count"),
        spilled_sgprs=value("sgpr_spill_count"),
        scratch_bytes=value("private_segment_fixed_size"),
    )


# --------------------------------------------------------------------------- cache


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "openkernels")
    return Path(root) / "aot"


def _stable(value: Any) -> str:
    # JIT helpers passed as constexprs hash by their source; dtypes and numbers by repr.
    return getattr(value, "cache_key", None) or repr(value)


_TOOLCHAIN: dict[str, str] = {}


def _toolchain_key(target_name: str) -> str:
    """Triton build (sources + libtriton), backend tools (ptxas version) and the compiler
    environment variables Triton itself keys its cache on."""
    if target_name not in _TOOLCHAIN:
        from triton.compiler import make_backend

        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # older layouts
            from triton.compiler.compiler import triton_key  # type: ignore[no-redef]
        backend_hash = make_backend(TARGETS[target_name]).hash()
        _TOOLCHAIN[target_name] = f"{triton.__version__}|{triton_key()}|{backend_hash}"
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env = sorted(get_cache_invalidating_env_vars().items())
    except ImportError:
        env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_WORKER_ENV_PREFIXES))
    return f"{_TOOLCHAIN[target_name]}|{env}"


def _cache_key(case: AotCase, target_name: str) -> str:
    """Hash of everything that changes the machine code of `case` on `target_name`.

    The kernel part is JITFunction.cache_key: its source plus the cache keys of the jit
    helpers it calls and the global constexprs it reads.
    """
    fn = case.jit_function()
    signature, constexprs = _full_signature(case, fn)
    target = TARGETS[target_name]
    material = {
        "schema": _SCHEMA,
        "toolchain": _toolchain_key(target_name),
        "target": [target_name, repr(target)],
        "kernel": [fn.__module__, fn.__qualname__, fn.cache_key],
        "signature": signature,
        "constexprs": {k: _stable(v) for k, v in sorted(constexprs.items())},
        "options": {k: _stable(v) for k, v in sorted(case.options.items())},
        "warps_stages": [case.num_warps, case.num_stages],
        "attrs": sorted(_attrs_for(case, fn, signature, target).items()),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _cache_load(key: str) -> _Measured | None:
    try:
        data = json.loads((_cache_dir() / f"{key}.json").read_text())
        return _Measured(**data)
    except (OSError, ValueError, TypeError):
        return None


def _cache_store(key: str, m: _Measured) -> None:
    if m.error is not None:
        return  # failures are re-run: they may come from the environment, not the kernel
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
            json.dump(asdict(m), f)
        os.replace(f.name, directory / f"{key}.json")  # atomic: parallel runs never see half a file
    except OSError:
        pass  # a read-only cache only costs time


# --------------------------------------------------------------------------- drivers


def compile_case(case: AotCase, target_name: str, *, use_cache: bool = True) -> AotReport:
    """Compile one case for one target in this process (or take it from the disk cache)."""
    _check_target_names([target_name])
    _refuse_interpreter()
    key = _safe_key(case, target_name) if use_cache else None
    if key is not None and (hit := _cache_load(key)) is not None:
        return _judge(case, target_name, hit, cached=True)
    m = _measure(case, target_name)
    if key is not None:
        _cache_store(key, m)
    return _judge(case, target_name, m, cached=False)


def check_cases(
    cases: Iterable[AotCase],
    targets: Sequence[str] | None = None,
    processes: int | None = None,
    *,
    use_cache: bool = True,
) -> list[AotReport]:
    """Compile every case for every target; one report per (case, target), cases outer.

    targets: target names, default `targets_from_env()`.
    processes: worker processes, default min(2, cpu count); 0 compiles in this process
        (no crash isolation; for debugging).
    """
    targets = targets_from_env() if targets is None else list(targets)
    _check_target_names(targets)
    _refuse_interpreter()
    jobs = job_list(cases, targets)
    results: list[AotReport | None] = [None] * len(jobs)
    keys: list[str | None] = [None] * len(jobs)
    pending: list[int] = []
    for i, (case, t) in enumerate(jobs):
        keys[i] = _safe_key(case, t) if use_cache else None
        hit = _cache_load(keys[i]) if keys[i] is not None else None
        if hit is not None:
            results[i] = _judge(case, t, hit, cached=True)
        else:
            pending.append(i)

    if processes is None:
        processes = min(2, os.cpu_count() or 1)
    remote = [i for i in pending if processes > 0 and _kernel_ref(jobs[i][0].kernel) is not None]
    local = sorted(set(pending) - set(remote))
    measured: dict[int, _Measured] = _run_in_workers(jobs, remote, processes) if remote else {}
    for i in local:
        measured[i] = _measure(*jobs[i])
    for i, m in measured.items():
        if keys[i] is not None:
            _cache_store(keys[i], m)
        results[i] = _judge(jobs[i][0], jobs[i][1], m, cached=False)
    return [r for r in results if r is not None]


def job_list(cases: Iterable[AotCase], targets: Sequence[str]) -> list[tuple[AotCase, str]]:
    """The (case, target) compiles check_cases runs, cases outer: every case for every target,
    except that a `variant` case goes only to its vendor's reference target where the run's
    targets (OPENKERNELS_AOT_TARGETS) include it, unless OPENKERNELS_AOT_VARIANTS=all."""
    every = os.environ.get(VARIANTS_ENV, "").strip().lower() == "all"
    run_targets = set(targets_from_env()) | set(targets)

    def wanted(case: AotCase, target: str) -> bool:
        reference = REFERENCE_TARGETS[TARGETS[target].backend]
        return every or not case.variant or target == reference or reference not in run_targets

    return [(case, t) for case in cases for t in targets if wanted(case, t)]


def _safe_key(case: AotCase, target_name: str) -> str | None:
    # An unresolvable kernel gets no key; _measure then reports why it cannot compile.
    try:
        return _cache_key(case, target_name)
    except Exception:  # unresolvable kernel: _measure reports it
        return None


def _refuse_interpreter() -> None:
    if triton_interpreting():
        raise RuntimeError(
            "AOT compile checks cannot run with TRITON_INTERPRET=1: @triton.jit then returns "
            "interpreter objects; run them in a process without TRITON_INTERPRET"
        )


# One spawn pool per process, reused across calls: starting a worker costs seconds (it
# imports torch and triton). Recreated when the worker count, sys.path or the compiler
# environment changes, since workers only see what was there when they started.
_POOL: tuple[Any, cf.ProcessPoolExecutor] | None = None
_WORKER_ENV_PREFIXES = ("TRITON_", "AMDGCN_", "MLIR_", "LLVM_")


def _shared_pool(processes: int) -> cf.ProcessPoolExecutor:
    global _POOL
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_WORKER_ENV_PREFIXES))
    ident = (processes, tuple(sys.path), tuple(env))
    if _POOL is None or _POOL[0] != ident:
        _drop_pool()
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(max_workers=processes, mp_context=ctx, initializer=_worker_init)
        _POOL = (ident, pool)
    return _POOL[1]


def _worker_init() -> None:
    # Kernel modules are imported after this: with TRITON_INTERPRET inherited from the
    # parent, @triton.jit would make interpreter objects that cannot be compiled.
    os.environ.pop("TRITON_INTERPRET", None)


def _drop_pool(wait: bool = False) -> None:
    global _POOL
    if _POOL is not None:
        _POOL[1].shutdown(wait=wait, cancel_futures=True)
        _POOL = None


# Stop the workers before interpreter teardown, while the modules they need still exist.
atexit.register(_drop_pool, wait=True)


def _run_in_workers(
    jobs: list[tuple[AotCase, str]], indices: list[int], processes: int
) -> dict[int, _Measured]:
    """Compile jobs[indices] in the worker pool; jobs whose worker died are retried alone, so
    a compiler crash (LLVM abort, ptxas segfault) is pinned on the case that caused it."""
    out: dict[int, _Measured] = {}
    crashed: list[int] = []
    pool = _shared_pool(processes)
    futures = {pool.submit(_measure, *jobs[i]): i for i in indices}
    for future in cf.as_completed(futures):
        try:
            out[futures[future]] = future.result()
        except cf.process.BrokenProcessPool:
            crashed.append(futures[future])
    if crashed:
        _drop_pool()
    ctx = multiprocessing.get_context("spawn")
    for i in sorted(crashed):
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init) as alone:
            try:
                out[i] = alone.submit(_measure, *jobs[i]).result()
            except cf.process.BrokenProcessPool as exc:
                out[i] = _Measured(error=f"compiler process died (crash in LLVM or ptxas?): {exc}")
    return out


# --------------------------------------------------------------------------- output


def format_reports(reports: Sequence[AotReport]) -> str:
    """A compact fixed-width table, one row per (case, target)."""
    header = ("case", "target", "ok", "regs", "spills", "scratch", "shared/limit", "secs", "problems")
    rows = [header]
    for r in reports:
        if r.spilled_vgprs is not None:
            spills = f"{r.spilled_vgprs} v/{r.spilled_sgprs} s"
        elif r.spill_stores is not None:
            spills = f"{r.spill_stores}/{r.spill_loads} B"
        else:
            spills = "-"
        shared = "-" if r.shared_bytes is None else f"{r.shared_bytes}/{r.shared_limit}"
        secs = f"{r.compile_seconds:.2f}" + ("*" if r.cached else "")
        rows.append(
            (
                r.label,
                r.target,
                "ok" if r.ok else "FAIL",
                "-" if r.registers is None else str(r.registers),
                spills,
                "-" if r.scratch_bytes is None else str(r.scratch_bytes),
                shared,
                secs,
                "; ".join(r.problems),
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
    # The last column (problems) is not padded.
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    ]
    lines.append("(secs with * come from the cache: the time of the original compile)")
    return "\n".join(line.rstrip() for line in lines)


def assert_clean(reports: Sequence[AotReport]) -> None:
    """Raise AssertionError naming every (case, target) with a problem, and why."""
    failed = [r for r in reports if not r.ok]
    if failed:
        lines = [f"  {r.label} on {r.target}: {'; '.join(r.problems)}" for r in failed]
        raise AssertionError(f"{len(failed)} of {len(reports)} AOT checks failed:\n" + "\n".join(lines))


def check_vendor(
    cases_for: Callable[[str], Sequence[AotCase]],
    vendor: str,
    *,
    target_groups: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """A family's AOT test for one vendor ("cuda" or "rocm"): compile `cases_for(vendor)`
    for that vendor's targets in OPENKERNELS_AOT_TARGETS, print the reports, and fail on a
    spill, scratch, shared memory over the chip's limit or a missing compile. Skips under
    TRITON_INTERPRET and when no target of the vendor is asked for.

    target_groups: where cases suit only some targets (configs tuned per arch family), the
    targets of each group by name, {"hopper": ("sm_90",), ...}: `cases_for(group)` then
    compiles for the asked targets of its group alone, and a group none is asked for is left out."""
    import pytest

    from ...platform import triton_interpreting

    if triton_interpreting():
        pytest.skip("compile-only checks need TRITON_INTERPRET unset")
    prefix = "sm_" if vendor == "cuda" else "gfx"
    targets = [t for t in targets_from_env() if t.startswith(prefix)]
    own_targets = {vendor: targets} if target_groups is None else target_groups
    groups = {group: [t for t in targets if t in own] for group, own in own_targets.items()}
    if not any(groups.values()):
        pytest.skip(f"no {vendor} targets in OPENKERNELS_AOT_TARGETS")
    reports, expected = [], 0
    for group, group_targets in groups.items():
        if group_targets:
            cases = list(cases_for(group))
            reports += check_cases(cases, group_targets)
            expected += len(job_list(cases, group_targets))
    print(format_reports(reports))
    assert_clean(reports)
    assert len(reports) == expected
