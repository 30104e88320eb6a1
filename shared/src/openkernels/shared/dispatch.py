"""Implementation registry and per-call selection for every openkernels op.

Each op (a name such as "silu_and_mul") has implementations registered per backend with
a priority and a predicate. A call builds a DispatchKey from its inputs (backend, arch,
dtype, features); the ordered list of usable implementations is cached per key. The user
steers selection with OPENKERNELS_FORCE / OPENKERNELS_FORBID or the `force` / `forbid`
context managers; `explain(op, *args)` says what runs and why the others do not. A name
that matches nothing registered is an error (UnsupportedError, a ValueError), never a
silent no-op: a bare name when `force` / `forbid` is called, an "op:name" entry and the
environment variables when selection first reads them (the op's family may be imported
after the block is entered); an unknown name first imports the installed families, so a
name of a family not imported yet is accepted.

The JAX face (openkernels.shared.jax) chooses one backend for all its ops when a function
is traced; its backends ("triton", "interpret", "jnp") are declared here as the
implementations of the front end "jax" and selected by the same code under the same
steering: a bare entry steers both faces ("reference" is also JAX's "jnp", "triton" also
its "interpret" under TRITON_INTERPRET=1), "jax:name" the JAX face only, and
`explain("jax")` says which backend runs and why.

A kernel that raises while compiling or launching is skipped for that key with one
warning and the next implementation runs, unless OPENKERNELS_STRICT=1 (the test suites
set it) or the implementation was forced, in which case the error propagates. An
InvalidInputError (the inputs break the op's contract, found by the kernel's own checks)
always propagates and marks nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .platform import device_info, triton_available, triton_interpreting

__all__ = [
    "JAX",
    "DispatchKey",
    "Implementation",
    "InvalidInputError",
    "KernelFallbackWarning",
    "UnsupportedError",
    "changed",
    "define",
    "explain",
    "forbid",
    "force",
    "force_first",
    "forced_names",
    "implementations",
    "is_steered",
    "key_for",
    "lazy",
    "register",
    "run",
    "select",
    "selected_by",
    "snapshot",
    "steering",
    "Steering",
    "strict",
    "triton_supports",
    "unsteered",
]

FORCE_ENV = "OPENKERNELS_FORCE"
FORBID_ENV = "OPENKERNELS_FORBID"
STRICT_ENV = "OPENKERNELS_STRICT"
# The implementation names every family uses (docs/adding-a-kernel.md), valid before any
# family is imported: force("reference") in a process that imported only openkernels.shared.
STANDARD_NAMES = ("triton", "cpu", "reference")
# The JAX face's name in entries ("jax:jnp") and in select / explain.
JAX = "jax"


class UnsupportedError(ValueError):
    """No registered implementation can run these inputs (or the forced one cannot)."""


class InvalidInputError(ValueError):
    """An implementation's own check found the call's inputs outside the op's contract (a
    length past the cache, a part of strides the kernel cannot read). `run` raises it to the
    caller instead of falling back: the kernel is not broken, and the next implementation
    would compute on the same bad inputs, and marking the kernel failed would send every later
    call with that key to the slower one."""


class KernelFallbackWarning(RuntimeWarning):
    """A kernel failed to compile or launch; the next implementation ran instead."""


class DispatchKey(NamedTuple):
    """What selection depends on. Two calls with equal keys pick the same implementation.
    (A NamedTuple: hashing it on every call is cheap.)"""

    backend: str
    arch: str
    dtype: torch.dtype | None  # None: a choice that does not depend on it (the JAX face's)
    features: frozenset[str] = frozenset()

    def __str__(self) -> str:
        feats = ",".join(sorted(self.features)) or "-"
        dtype = "" if self.dtype is None else f" {str(self.dtype).removeprefix('torch.')}"
        return f"{self.backend}/{self.arch}{dtype} [{feats}]"


Predicate = Callable[[DispatchKey], "str | None"]


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    backends: the device backends it runs on ("cuda", "rocm", "cpu").
    supports: returns None when it can run a key, else the reason it cannot.
    interpretable: a Triton kernel that may also run on CPU tensors under
        TRITON_INTERPRET=1, but only when forced by name (tests do that).
    aliases: other entry names that select it (JAX's "jnp" answers "reference" too).
    forced_only: never picked unless forced (JAX's "interpret").
    """

    op: str
    name: str
    fn: Callable[..., Any]
    backends: frozenset[str]
    priority: int = 0
    supports: Predicate | None = None
    interpretable: bool = False
    aliases: frozenset[str] = frozenset()
    forced_only: bool = False

    def answers(self, name: str) -> bool:
        """Whether an entry naming `name` selects this implementation."""
        return name == self.name or name in self.aliases

    def rejection(self, key: DispatchKey, *, forced: bool = False) -> str | None:
        if self.forced_only and not forced:
            return "runs only when forced"
        on_interpreter = forced and self.interpretable and key.backend == "cpu" and triton_interpreting()
        if key.backend not in self.backends and not on_interpreter:
            return f"runs on {'/'.join(sorted(self.backends))}, not {key.backend}"
        if self.supports is None:
            return None
        try:
            return self.supports(key)
        except Exception as error:  # a broken predicate disqualifies its implementation only
            return f"predicate failed: {type(error).__name__}: {error}"


class lazy:  # noqa: N801 - used like a function
    """A callable that imports "package.module:attr" on first call, then calls it.

    Keeps Triton (and compilers) out of import time of the public packages.
    """

    __slots__ = ("_fn", "_kwargs", "_target")

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._target = target
        self._fn: Callable[..., Any] | None = None
        self._kwargs = kwargs

    def _resolve(self) -> Callable[..., Any]:
        fn = self._fn
        if fn is None:
            module, _, attr = self._target.partition(":")
            fn = self._fn = getattr(importlib.import_module(module), attr)
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._resolve()(*args, **self._kwargs, **kwargs)

    def route(self, *args: Any, **kwargs: Any) -> str | None:
        """The target's own `route` attribute called on these arguments (a launcher that sends
        some calls elsewhere says where and why), or None."""
        route = getattr(self._resolve(), "route", None)
        return route(*args, **self._kwargs, **kwargs) if callable(route) else None

    def __repr__(self) -> str:
        return f"lazy({self._target!r})"


@dataclass
class _Op:
    key_fn: Callable[..., DispatchKey] | None = None
    impls: list[Implementation] = field(default_factory=list)


_OPS: dict[str, _Op] = {}
_SELECTION_CACHE: dict[tuple, tuple[Implementation, ...]] = {}
_generation = 0  # bumped by changed(): shared.replay forgets its recorded calls on a change
_BROKEN: set[tuple[str, str, DispatchKey]] = set()
_FORCED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("openkernels_forced", default=())
_FORBIDDEN: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "openkernels_forbidden", default=()
)
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("openkernels_strict", default=False)


_JAX_RULES = lazy("openkernels.shared.jax:unavailable")  # (backend, key) -> why not, or None


def _jax_backend(name: str, priority: int, *, rules: bool = True, **options: Any) -> Implementation:
    """One JAX backend: run("jax") returns its name (the face launches it itself); its rules
    live in openkernels.shared.jax, imported at the first selection, not here."""
    supports = functools.partial(_JAX_RULES, name) if rules else None
    return Implementation(JAX, name, lambda: name, frozenset({JAX}), priority, supports, **options)


# Front ends that choose one backend for all their ops, kept out of _OPS (the CLI and tests
# walk that as the PyTorch ops). Declared here, so that their names are valid in a process
# that never imported JAX (OPENKERNELS_FORCE=jnp set for a program with both faces).
_FACES: dict[str, _Op] = {
    JAX: _Op(
        key_fn=lazy("openkernels.shared.jax:dispatch_key"),
        impls=[
            _jax_backend("triton", 20),
            # The Triton kernels under TRITON_INTERPRET=1, as a forced "triton" runs on CPU
            # tensors in PyTorch; never the default.
            _jax_backend("interpret", 10, aliases=frozenset({"triton"}), forced_only=True),
            _jax_backend("jnp", 0, rules=False, aliases=frozenset({"reference"})),
        ],
    )
}


def define(op: str, key_fn: Callable[..., DispatchKey]) -> None:
    """Declare an op and how its DispatchKey is read from its arguments."""
    _OPS.setdefault(op, _Op()).key_fn = key_fn


def register(
    op: str,
    name: str,
    fn: Callable[..., Any],
    *,
    backends: tuple[str, ...],
    priority: int = 0,
    supports: Predicate | None = None,
    interpretable: bool = False,
) -> Implementation:
    """Register implementation `name` of `op`; higher priority wins among usable ones."""
    entry = _OPS.setdefault(op, _Op())
    if any(i.name == name for i in entry.impls):
        raise ValueError(f"{op}: implementation {name!r} is already registered")
    impl = Implementation(op, name, fn, frozenset(backends), priority, supports, interpretable)
    entry.impls.append(impl)
    entry.impls.sort(key=lambda i: -i.priority)
    changed()
    return impl


def changed() -> None:
    """The registry changed (an implementation registered, replaced or removed): forget
    every selection made, and every call shared.replay recorded (it compares the
    generation, a counter this bumps, on each call)."""
    global _generation
    _SELECTION_CACHE.clear()
    _FORCED_NAMES.clear()
    _generation += 1


def implementations(op: str) -> list[Implementation]:
    """All implementations of `op`, highest priority first."""
    return list(_op(op).impls)


_KEYS: dict[tuple, DispatchKey] = {}


def key_for(tensor: torch.Tensor, *features: str) -> DispatchKey:
    """The DispatchKey of a call whose main input is `tensor` (cached per device and dtype)."""
    cache_key = (tensor.device, tensor.dtype, features)
    key = _KEYS.get(cache_key)
    if key is None:
        info = device_info(tensor.device)
        key = _KEYS[cache_key] = DispatchKey(info.backend, info.arch, tensor.dtype, frozenset(features))
    return key


def triton_supports(key: DispatchKey) -> str | None:
    """Predicate shared by Triton implementations: triton importable, GPU or interpreter."""
    if not triton_available():
        return "the triton package is not installed"
    if key.backend == "cpu" and not triton_interpreting():
        return "needs a CUDA or ROCm device (or TRITON_INTERPRET=1)"
    return None


def _parse(spec: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in spec.split(",") if s.strip())


def _names_for(op: str, specs: tuple[str, ...], impls: list[Implementation]) -> list[str]:
    """The implementations of `op` the entries select, in entry order then priority order.
    Entries are "name" (every op that has such an implementation) or "op:name"; every
    entry has passed _check_specs, so one that names nothing here is for other ops."""
    names: list[str] = []
    for spec in specs:
        scope, sep, name = spec.rpartition(":")
        if not sep or scope == op:
            names += [i.name for i in impls if i.answers(name) and i.name not in names]
    return names


def _known_names(entries: Iterable[_Op]) -> set[str]:
    return {n for entry in entries for i in entry.impls for n in (i.name, *i.aliases)}


_CHECKED: set[tuple[str, ...]] = set()  # entry tuples that named only registered things
_FAMILIES_LOCK = threading.RLock()
_families_imported = False


def _import_families() -> None:
    """Import every installed openkernels.<family> once: each registers its ops on import."""
    global _families_imported
    with _FAMILIES_LOCK:
        if _families_imported:
            return
        _families_imported = True
        from . import manifest

        for name in manifest.families():
            # A family that fails to import says so when imported itself; here its
            # names just stay unknown.
            with contextlib.suppress(Exception):
                importlib.import_module(f"openkernels.{name}")


def _unknown(spec: str) -> str | None:
    """What in entry `spec` ("name" or "op:name") is registered nowhere, or None."""
    scope, sep, name = spec.rpartition(":")
    if not sep:
        known = {*STANDARD_NAMES, *_known_names(_OPS.values()), *_known_names(_FACES.values())}
        if name in known:
            return None
        return f"unknown implementation {name!r} (known: {', '.join(sorted(known))})"
    entry = _OPS.get(scope) or _FACES.get(scope)
    if entry is None:
        ops = ", ".join(sorted(_OPS))
        return f"unknown op {scope!r} in {spec!r} (known ops: {ops}; front ends: {', '.join(_FACES)})"
    known = _known_names([entry])
    if name in known:
        return None
    return f"{spec!r}, but {scope} has no implementation named {name!r} (known: {', '.join(sorted(known))})"


def _check_specs(specs: tuple[str, ...], source: str) -> None:
    """Raise UnsupportedError naming every entry of `source` that matches nothing registered
    (after importing the installed families). Each distinct tuple is checked once."""
    if specs in _CHECKED:
        return
    problems = [p for p in map(_unknown, specs) if p]
    if problems:
        _import_families()
        problems = [p for p in map(_unknown, specs) if p]
    if problems:
        raise UnsupportedError(f"openkernels: {source} names {'; '.join(problems)}")
    _CHECKED.add(specs)


def _op(op: str) -> _Op:
    entry = _OPS.get(op) or _FACES.get(op)
    if entry is None:
        raise UnsupportedError(f"unknown op {op!r}; registered: {sorted(_OPS)}, front ends: {sorted(_FACES)}")
    return entry


def _steering() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forced, forbidden) entries of the context managers then the environment, checked."""
    steering = []
    for var, env, manager in ((_FORCED, FORCE_ENV, "force"), (_FORBIDDEN, FORBID_ENV, "forbid")):
        value = os.environ.get(env, "")
        from_env = _parse(value)
        _check_specs(var.get(), f"dispatch.{manager}()")
        _check_specs(from_env, f"{env}={value!r}")
        steering.append(var.get() + from_env)
    return steering[0], steering[1]


@functools.lru_cache(maxsize=64)
def _steers_ops(specs: tuple[str, ...], generation: int) -> bool:
    """Whether any entry may steer a PyTorch op: all but the ones only a front end knows
    ("jax:jnp", "jnp", "interpret": a use_backend block leaves the PyTorch face as it is).
    generation: the registry's, so that a family registered later is seen."""
    op_names = {*STANDARD_NAMES, *_known_names(_OPS.values())}
    face_only = _known_names(_FACES.values()) - op_names
    for spec in specs:
        scope, sep, name = spec.rpartition(":")
        if scope not in _FACES if sep else name not in face_only:
            return True
    return False


def is_steered() -> bool:
    """True while any force / forbid that may steer a PyTorch op is in effect (environment
    or context managers): callers that would pick a non-openkernels path on their own
    (hf.py's SDPA route) stand back."""
    forced, forbidden = _steering()
    return _steers_ops(forced + forbidden, _generation)


# os.environ.get costs ~1-2 us (it encodes the name and decodes the value); selection reads
# two variables on every call, so on POSIX read CPython's underlying bytes dict instead.
_RAW_ENV = getattr(os.environ, "_data", None) if os.name == "posix" else None
_FORCE_KEY, _FORBID_KEY = FORCE_ENV.encode(), FORBID_ENV.encode()


def _steering_state() -> tuple:
    """Everything besides the key that selection depends on, unparsed (cheap per call)."""
    if _RAW_ENV is not None:
        return (_RAW_ENV.get(_FORCE_KEY), _RAW_ENV.get(_FORBID_KEY), _FORCED.get(), _FORBIDDEN.get())
    return (os.environ.get(FORCE_ENV), os.environ.get(FORBID_ENV), _FORCED.get(), _FORBIDDEN.get())


def unsteered() -> bool:
    """True when no force / forbid that may steer a PyTorch op is in effect (cheap: the
    replay of recorded calls asks on every call, since a recorded call holds the
    implementation picked without steering)."""
    blocks = _FORCED.get() + _FORBIDDEN.get()
    if blocks and _steers_ops(blocks, _generation):
        return False
    if _RAW_ENV is not None:
        if not _RAW_ENV.get(_FORCE_KEY) and not _RAW_ENV.get(_FORBID_KEY):
            return True
    elif not os.environ.get(FORCE_ENV) and not os.environ.get(FORBID_ENV):
        return True
    from_env = _parse(os.environ.get(FORCE_ENV, "")) + _parse(os.environ.get(FORBID_ENV, ""))
    return not _steers_ops(from_env, _generation)


def _reasons(op: str, key: DispatchKey, forced: list[str], forbidden: list[str]) -> list[str]:
    lines = []
    for impl in _op(op).impls:
        if impl.name in forbidden:
            lines.append(f"{impl.name}: forbidden")
        elif forced and impl.name not in forced:
            lines.append(f"{impl.name}: not forced")
        else:
            why = impl.rejection(key, forced=impl.name in forced)
            lines.append(f"{impl.name}: {why or 'usable'}")
    return lines


def steering(op: str) -> tuple[list[str], list[str]]:
    """The implementations of `op` forced (in the order they are tried) and forbidden now."""
    forced_specs, forbidden_specs = _steering()
    impls = _op(op).impls
    return _names_for(op, forced_specs, impls), _names_for(op, forbidden_specs, impls)


_FORCED_NAMES: dict[tuple, frozenset[str]] = {}


def forced_names(op: str) -> frozenset[str]:
    """The implementations of `op` that force blocks and the environment name now (empty when
    none), cached per steering state (about a microsecond). For launchers that send some
    calls to another kernel by measured speed: forced by name, they take every call they can."""
    cache_key = (op, _steering_state())
    hit = _FORCED_NAMES.get(cache_key)
    if hit is None:
        if len(_FORCED_NAMES) >= 256:
            _FORCED_NAMES.clear()
        hit = _FORCED_NAMES[cache_key] = frozenset(steering(op)[0])
    return hit


def selected_by(op: str, entry: str, *, source: str = "dispatch.selected_by()") -> list[str]:
    """The implementations of `op` that `entry` ("name" or "op:name") selects, best first;
    UnsupportedError, worded as for force(), when it names nothing registered."""
    _check_specs((entry,), source)
    return _names_for(op, (entry,), _op(op).impls)


def select(op: str, key: DispatchKey) -> tuple[Implementation, ...]:
    """Usable implementations of `op` for `key`, in the order they will be tried."""
    cache_key = (op, key, _steering_state())
    hit = _SELECTION_CACHE.get(cache_key)
    if hit is not None:
        return hit
    impls = _op(op).impls
    forced, forbidden = steering(op)
    if forced:
        by_name = {i.name: i for i in impls}
        chosen = tuple(
            by_name[n]
            for n in forced
            if n not in forbidden and by_name[n].rejection(key, forced=True) is None
        )[:1]
    else:
        chosen = tuple(i for i in impls if i.name not in forbidden and i.rejection(key) is None)
    if not chosen:
        what = f"forced {forced}" if forced else "no implementation"
        detail = "; ".join(_reasons(op, key, forced, forbidden))
        raise UnsupportedError(f"{op}: {what} can run {key} ({detail})")
    _SELECTION_CACHE[cache_key] = chosen
    return chosen


def is_strict() -> bool:
    return _STRICT.get() or os.environ.get(STRICT_ENV, "0") not in ("", "0")


def run(op: str, *args: Any, **kwargs: Any) -> Any:
    """Run `op` with the best usable implementation for its arguments."""
    entry = _op(op)
    if entry.key_fn is None:
        raise UnsupportedError(f"{op}: no key function defined")
    key = entry.key_fn(*args, **kwargs)
    chosen = select(op, key)
    if len(chosen) == 1 and not _BROKEN:  # the common case: one try, no bookkeeping
        return chosen[0].fn(*args, **kwargs)
    for position, impl in enumerate(chosen):
        if (op, impl.name, key) in _BROKEN:
            continue
        try:
            return impl.fn(*args, **kwargs)
        except (torch.OutOfMemoryError, InvalidInputError):
            raise
        except Exception as error:
            forced = bool(steering(op)[0])
            if is_strict() or forced or position == len(chosen) - 1:
                raise
            _BROKEN.add((op, impl.name, key))
            warnings.warn(
                f"openkernels: {op} implementation {impl.name!r} failed on {key} "
                f"({type(error).__name__}: {error}); using {chosen[position + 1].name!r} from now on",
                KernelFallbackWarning,
                stacklevel=2,
            )
    raise UnsupportedError(f"{op}: every implementation failed on {key}")


def explain(op: str, *args: Any, **kwargs: Any) -> str:
    """Which implementation `op(*args)` runs and why each other one is not used."""
    entry = _op(op)
    if entry.key_fn is None:
        raise UnsupportedError(f"{op}: no key function defined")
    key = entry.key_fn(*args, **kwargs)
    forced, forbidden = steering(op)
    try:
        chosen = select(op, key)
        # The implementation a call runs now: the first that has not failed on this key.
        runs = next((impl for impl in chosen if (op, impl.name, key) not in _BROKEN), chosen[-1])
        head = f"{op} on {key}: runs {runs.name!r}"
        route = getattr(runs.fn, "route", None)
        try:
            note = route(*args, **kwargs) if callable(route) else None
        except Exception as error:  # an explanation never fails the caller
            note = f"(its route could not be read: {type(error).__name__}: {error})"
        if note:
            head += f"; for these arguments: {note}"
    except UnsupportedError as error:
        chosen, head = (), f"{op} on {key}: nothing can run ({error})"
    lines = [head]
    for impl, reason in zip(entry.impls, _reasons(op, key, forced, forbidden)):
        mark = "->" if chosen and impl is runs else "  "
        broken = " (failed earlier, skipped)" if (op, impl.name, key) in _BROKEN else ""
        lines.append(f" {mark} {reason} [priority {impl.priority}]{broken}")
    return "\n".join(lines)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def _checked_now(specs: tuple[str, ...], manager: str) -> tuple[str, ...]:
    """Type-check the entries and check bare names and front-end entries ("jax:jnp") now;
    "op:name" entries are checked when selection first reads them, since the op's family
    may be imported inside the block."""
    for spec in specs:
        if not isinstance(spec, str):
            raise TypeError(f"dispatch.{manager}: entries are strings ('name' or 'op:name'), got {spec!r}")
    now = tuple(s for s in specs if ":" not in s or s.rpartition(":")[0] in _FACES)
    _check_specs(now, f"dispatch.{manager}()")
    return specs


def force(*specs: str) -> contextlib.AbstractContextManager[None]:
    """Use only these implementations ("name" or "op:name") inside the block. The blocks
    are per thread (and per asyncio task): another thread does not see them, nor does the
    backward of a torch.compile'd graph on CUDA, which autograd runs on its own thread
    (docs/dispatch.md: run it with torch.autograd.set_multithreading_enabled(False))."""
    return _set(_FORCED, _FORCED.get() + _checked_now(specs, "force"))


def force_first(*specs: str) -> contextlib.AbstractContextManager[None]:
    """As `force`, but these entries are tried before those of the enclosing blocks: the
    innermost block wins (`openkernels.shared.jax.use_backend(name)` is
    `force_first("jax:<name>")`, so a JAX backward re-entering its forward's backend wins
    over the caller's blocks)."""
    return _set(_FORCED, _checked_now(specs, "force_first") + _FORCED.get())


def forbid(*specs: str) -> contextlib.AbstractContextManager[None]:
    """Never use these implementations ("name" or "op:name") inside the block (per thread,
    as `force`)."""
    return _set(_FORBIDDEN, _FORBIDDEN.get() + _checked_now(specs, "forbid"))


def strict(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Inside the block a failing kernel raises instead of falling back."""
    return _set(_STRICT, enabled)


class Steering(NamedTuple):
    """The steering state (force / forbid / strict blocks) of one moment; see snapshot."""

    forced: tuple[str, ...]
    forbidden: tuple[str, ...]
    strict: bool

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) under this state, in the calling thread's own context: any
        number of threads may run under one snapshot at once (a contextvars.Context can be
        entered by one thread at a time, and two threads running one graph's backward with
        retain_graph=True crashed on it)."""
        tokens = (_FORCED.set(self.forced), _FORBIDDEN.set(self.forbidden), _STRICT.set(self.strict))
        try:
            return fn(*args, **kwargs)
        finally:
            _STRICT.reset(tokens[2])
            _FORBIDDEN.reset(tokens[1])
            _FORCED.reset(tokens[0])


def snapshot() -> Steering:
    """The steering state (force / forbid / strict blocks) of the current call, to run
    later work under: `snapshot().run(fn, *args)`. Autograd runs CUDA backwards on its own
    threads, where context variables set around the forward are not visible; families save
    a snapshot in the forward's autograd context and run the backward in it."""
    return Steering(_FORCED.get(), _FORBIDDEN.get(), _STRICT.get())


def reset_failures() -> None:
    """Forget kernels marked failed (tests use this)."""
    _BROKEN.clear()
