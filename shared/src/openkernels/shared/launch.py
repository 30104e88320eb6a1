"""Direct launch of compiled Triton kernels: `launch(kernel, grid, *args, **kwargs)` does what
`kernel[grid](*args, **kwargs)` does, with less host time.

The first call of a specialization goes through `kernel[grid](...)`, which compiles (or
loads) the kernel; later calls hand the arguments straight to the compiled kernel's
launcher, skipping JITFunction.run's binder, its cache-key hashing and hook checks. On the
H200's host that binder was 40% of a decode step's host time (`KVCache.attend`, 93 us).

The specialization key is derived here from every argument, as Triton would specialize
it, so that a cached kernel is never launched on arguments it was not compiled for:
tensors by dtype and 16-byte alignment of their address, integers by "== 1", "divisible by
16" and 32/64-bit range, bools and None by value, floats by type alone, constexpr
parameters by value, host TMA descriptors by dtype, block shape, layout and padding; plus
the current device, num_warps and num_stages. The key is a
superset of Triton's (it distinguishes all that Triton does, and maybe more), so a key hit
means the same compiled kernel Triton would pick.

`prepare(kernel, varying, **fixed)` goes one step further for launchers that cache a launch
plan: every argument but the `varying` ones (the tensors, typically) is fixed once, so a
call binds and keys only those. The plan must then decide every fixed value: a launcher
keeps one prepared launch per plan.

Falls back to `kernel[grid](...)` (same results, Triton's host time) under the Triton
interpreter, for CPU tensors, for kernels that need global scratch memory, and when
`FAST` is False (OPENKERNELS_DIRECT_LAUNCH=0 in the environment sets it so at import: a
way out should a driver or Triton version disagree with the direct call).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["launch", "prepare", "PreparedLaunch", "FAST", "specialization_key", "clear"]

# False: always kernel[grid](...) (overhead measurements, debugging, OPENKERNELS_DIRECT_LAUNCH=0)
FAST = os.environ.get("OPENKERNELS_DIRECT_LAUNCH", "1") not in ("0", "")
_MAX_ENTRIES = 4096  # compiled specializations kept (a bound, as Triton's own caches have none)

_compiled: dict[tuple, Any] = {}
# Called with (compiled kernel or False, grid, every parameter's value) after each launch made
# here while set: openkernels.shared.replay records the launches of a call through it.
observer: Any = None
# id(kernel) -> its signature, and the kernel itself: held, so that no other object can
# take the id that the keys of _compiled use while they exist.
_params: dict[int, tuple[tuple[str, ...], tuple[bool, ...], dict[str, Any], Any]] = {}


def _signature(kernel: Any) -> tuple[tuple[str, ...], tuple[bool, ...], dict[str, Any]]:
    """(parameter names, which are constexpr, defaults) of a JITFunction, read once."""
    entry = _params.get(id(kernel))
    if entry is None:
        params = kernel.params
        defaults = {p.name: p.default for p in params if p.has_default}
        entry = (tuple(p.name for p in params), tuple(bool(p.is_constexpr) for p in params), defaults, kernel)
        _params[id(kernel)] = entry
    return entry[:3]


def _spec(value: Any) -> Any:
    """What Triton specializes a runtime argument on (the key derivation below inlines the
    int and tensor cases; this is its readable form, used for everything else)."""
    kind = type(value)
    if kind is int:
        return _int_spec(value)
    if kind is bool or value is None:
        return value
    if kind is float:
        return float
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15 == 0)
    block = getattr(value, "block_shape", None)
    if block is not None and hasattr(value, "base"):
        # A host TMA descriptor (triton.tools.tensor_descriptor or Gluon's): Triton types it by
        # its base's dtype, block shape, shared layout (Gluon) and padding; its shape and
        # strides are plain arguments of the launcher (not specialized), its base must be
        # 16-byte aligned. Never by value: the descriptor holds a tensor.
        return (kind, value.base.dtype, tuple(block), getattr(value, "layout", None), value.padding)
    return (kind, value)  # anything else (tl.dtype, str...): by value, conservatively


def _int_spec(value: int) -> int:
    """An int's specialization as one small int: 1 is a constant of its own; otherwise
    divisibility by 16 and the 32-bit / signed 64-bit range (Triton's i32 / i64 / u64)."""
    if value == 1:
        return 1
    return 2 + (value & 15 == 0) + 2 * (-(2**31) <= value < 2**31) + 4 * (value < 2**63)


def _key_parts(values: Sequence[Any], constexpr: Sequence[bool] | None = None) -> list[Any]:
    """The specialization of each value, in order; constexpr (one flag per value, None: no
    value is a constexpr) values count by value."""
    parts = []
    append = parts.append
    tensor = torch.Tensor
    for i, value in enumerate(values):
        if constexpr is not None and constexpr[i]:
            append(value)
            continue
        kind = type(value)
        if kind is int:  # most runtime arguments are ints or tensors: checked first
            append(_int_spec(value))
        elif kind is tensor:
            append((value.dtype, value.data_ptr() & 15 == 0))
        else:
            append(_spec(value))
    return parts


def specialization_key(kernel: Any, values: Sequence[Any], num_warps: int | None, num_stages: int | None,
                       device: int, maxnreg: int | None = None) -> tuple:  # fmt: skip
    """The cache key of one launch: values are every parameter's value in order."""
    _, constexpr, _ = _signature(kernel)
    return (id(kernel), device, num_warps, num_stages, maxnreg, *_key_parts(values, constexpr))


_MISSING = object()
# (id(kernel), number of positional arguments, keyword names in call order) -> how to fill
# each remaining parameter: (name, value when not passed, passed by keyword). Launchers call
# a kernel with the same argument names every time, so binding is a lookup after the first.
_bindings: dict[tuple, tuple[tuple[str, Any, bool], ...]] = {}


def _binding(kernel: Any, n_args: int, names_passed: tuple[str, ...]) -> tuple[tuple[str, Any, bool], ...]:
    key = (id(kernel), n_args, names_passed)
    found = _bindings.get(key)
    if found is not None:
        return found
    names, _, defaults = _signature(kernel)
    if n_args > len(names):
        raise TypeError(f"launch: {kernel.__name__} takes {len(names)} arguments, got {n_args}")
    passed = set(names_passed)
    unknown = sorted(passed - set(names[n_args:]))
    if unknown:
        raise TypeError(f"launch: {kernel.__name__} got unexpected arguments {unknown}")
    tail = []
    for name in names[n_args:]:
        if name not in passed and name not in defaults:
            raise TypeError(f"launch: {kernel.__name__} is missing argument {name!r}")
        tail.append((name, defaults.get(name, _MISSING), name in passed))
    found = _bindings[key] = tuple(tail)
    return found


def _bind(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """Every parameter's value in order, as JITFunction's binder would give them."""
    tail = _binding(kernel, len(args), tuple(kwargs))
    values = list(args)
    values += [kwargs[name] if passed else default for name, default, passed in tail]
    return values


def _first_tensor(values: Any) -> torch.Tensor | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    return None


def _options(num_warps: int | None, num_stages: int | None, maxnreg: int | None = None) -> dict[str, int]:
    options = {}
    if num_warps:
        options["num_warps"] = num_warps
    if num_stages:
        options["num_stages"] = num_stages
    if maxnreg:
        options["maxnreg"] = maxnreg
    return options


# (triton.knobs.runtime, triton.runtime.driver), imported on first use
_runtime: tuple[Any, Any] | None = None


def _triton_runtime() -> tuple[Any, Any]:
    global _runtime
    if _runtime is None:
        from triton import knobs
        from triton.runtime import driver

        _runtime = (knobs.runtime, driver)
    return _runtime


def launch(kernel: Any, grid: Sequence[int], *args: Any, num_warps: int | None = None,
           num_stages: int | None = None, maxnreg: int | None = None, **kwargs: Any) -> None:  # fmt: skip
    """kernel[grid](*args, num_warps=..., num_stages=..., maxnreg=..., **kwargs), launched
    directly once the specialization has been compiled. num_warps / num_stages / maxnreg
    None: Triton's defaults for the backend (they differ between CUDA and ROCm)."""
    tensor = _first_tensor(args)
    if tensor is None:
        tensor = _first_tensor(kwargs.values())
    if not FAST or tensor is None or not tensor.is_cuda or not hasattr(kernel, "params"):
        kernel[tuple(grid)](*args, **kwargs, **_options(num_warps, num_stages, maxnreg))
        return
    hooks, driver = _triton_runtime()
    active = driver.active
    values = _bind(kernel, args, kwargs)
    device = active.get_current_device()
    key = specialization_key(kernel, values, num_warps, num_stages, device, maxnreg)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compile(
            kernel,
            grid,
            {**dict(zip(_signature(kernel)[0], values)), **_options(num_warps, num_stages, maxnreg)},
        )
        if len(_compiled) >= _MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = compiled
    elif compiled is False:
        kernel[tuple(grid)](*args, **kwargs, **_options(num_warps, num_stages, maxnreg))
    else:
        _run(compiled, grid, values, active, device, hooks)
    if observer is not None:
        observer(compiled, tuple(grid), values)


def _run(
    compiled: Any, grid: Sequence[int], values: Sequence[Any], active: Any, device: int, hooks: Any
) -> None:
    """Launch a compiled kernel on the current stream, as JITFunction.run would."""
    stream = active.get_current_stream(device)
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    if _no_hooks(enter) and _no_hooks(leave):
        # Triton 3.6 keeps empty hook chains (never None) and builds launch metadata for
        # them on every launch; with nothing hooked the launcher is told so instead.
        meta = enter = leave = None
    else:
        meta = compiled.launch_metadata(tuple(grid), stream, *values)
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, meta, enter, leave, *values)  # fmt: skip


def _compile(kernel: Any, grid: Sequence[int], kwargs: dict[str, Any]) -> Any:
    """kernel[grid](**kwargs): launches (compiling first if needed) and returns the compiled
    kernel, or False when it needs what JITFunction.run sets up (global scratch memory)."""
    compiled = kernel[tuple(grid)](**kwargs)
    meta = compiled.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return False
    return compiled


class PreparedLaunch:
    """`kernel` with every argument but `varying` fixed: `prepared(grid, *values)` launches it
    with `values` for the varying parameters, in the order they were named. Each call keys
    only those values (tensors by dtype and 16-byte alignment, ints as Triton specializes
    them); the fixed ones were specialized once, here. Make one per launch plan."""

    __slots__ = ("_compiled", "_options", "_positions", "_template", "fixed", "kernel", "varying")

    def __init__(self, kernel: Any, varying: Sequence[str], fixed: dict[str, Any], num_warps: int | None = None,
                 num_stages: int | None = None) -> None:  # fmt: skip
        self.kernel = kernel
        self.varying = tuple(varying)
        self.fixed = dict(fixed)
        self._options = _options(num_warps, num_stages)
        self._compiled: dict[tuple, Any] = {}
        self._template: list[Any] | None = None  # None: always kernel[grid] (the interpreter's kernels)
        self._positions: tuple[int, ...] = ()
        if not hasattr(kernel, "params"):
            return
        names, constexpr, defaults = _signature(kernel)
        position = {name: i for i, name in enumerate(names)}
        unknown = sorted((set(varying) | set(fixed)) - set(names))
        if unknown:
            raise TypeError(f"prepare: {kernel.__name__} has no parameters {unknown}")
        both = sorted(set(varying) & set(fixed))
        if both:
            raise TypeError(f"prepare: {both} named both varying and fixed")
        if any(constexpr[position[name]] for name in varying):
            raise TypeError(f"prepare: constexpr parameters cannot vary: {list(varying)}")
        template = []
        for name in names:
            if name in fixed:
                template.append(fixed[name])
            elif name in defaults or name in varying:
                template.append(defaults.get(name))
            else:
                raise TypeError(f"prepare: {kernel.__name__} is missing argument {name!r}")
        self._template = template
        self._positions = tuple(position[name] for name in varying)

    def __call__(self, grid: Sequence[int], *values: Any) -> None:
        if len(values) != len(self.varying):
            raise TypeError(
                f"prepared {self.kernel.__name__}: expected values for {self.varying}, got {len(values)}"
            )
        tensor = _first_tensor(values)
        if not FAST or tensor is None or not tensor.is_cuda or self._template is None:
            self.kernel[tuple(grid)](**dict(zip(self.varying, values)), **self.fixed, **self._options)
            return
        hooks, driver = _triton_runtime()
        active = driver.active
        device = active.get_current_device()
        key = (device, *_key_parts(values))
        compiled = self._compiled.get(key)
        full = self._template.copy()
        for i, value in zip(self._positions, values):
            full[i] = value
        if compiled is None:
            compiled = _compile(
                self.kernel, grid, {**dict(zip(self.varying, values)), **self.fixed, **self._options}
            )
            if len(self._compiled) >= _MAX_ENTRIES:
                self._compiled.clear()
            self._compiled[key] = compiled
        elif compiled is False:
            self.kernel[tuple(grid)](**dict(zip(self.varying, values)), **self.fixed, **self._options)
        else:
            _run(compiled, grid, full, active, device, hooks)
        if observer is not None:
            observer(compiled, tuple(grid), full)


def prepare(kernel: Any, varying: Sequence[str], *, num_warps: int | None = None, num_stages: int | None = None,
            **fixed: Any) -> PreparedLaunch:  # fmt: skip
    """A PreparedLaunch of `kernel`: `varying` parameters given per call, the rest `fixed`."""
    return PreparedLaunch(kernel, varying, fixed, num_warps, num_stages)


def _no_hooks(hook: Any) -> bool:
    """None, or an empty triton.knobs.HookChain (profilers such as Proton add to it)."""
    return hook is None or getattr(hook, "calls", None) == []


def clear() -> None:
    """Forget the compiled specializations and bindings (tests)."""
    _compiled.clear()
    _bindings.clear()
