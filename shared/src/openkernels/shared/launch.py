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
parameters by value; plus the current device, num_warps and num_stages. The key is a
superset of Triton's (it distinguishes all that Triton does, and maybe more), so a key hit
means the same compiled kernel Triton would pick.

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

__all__ = ["launch", "FAST", "specialization_key", "clear"]

# False: always kernel[grid](...) (overhead measurements, debugging, OPENKERNELS_DIRECT_LAUNCH=0)
FAST = os.environ.get("OPENKERNELS_DIRECT_LAUNCH", "1") not in ("0", "")
_MAX_ENTRIES = 4096  # compiled specializations kept (a bound, as Triton's own caches have none)

_compiled: dict[tuple, Any] = {}
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
    """What Triton specializes a runtime argument on."""
    kind = type(value)
    if kind is int:
        return (value == 1, value & 15 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if kind is bool or value is None:
        return value
    if kind is float:
        return float
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() & 15 == 0)
    return (kind, value)  # anything else (tl.dtype, str...): by value, conservatively


def specialization_key(kernel: Any, values: Sequence[Any], num_warps: int | None, num_stages: int | None,
                       device: int) -> tuple:  # fmt: skip
    """The cache key of one launch: values are every parameter's value in order."""
    _, constexpr, _ = _signature(kernel)
    return (
        id(kernel),
        device,
        num_warps,
        num_stages,
        *[v if c else _spec(v) for v, c in zip(values, constexpr)],
    )


def _bind(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """Every parameter's value in order, as JITFunction's binder would give them."""
    names, _, defaults = _signature(kernel)
    if len(args) > len(names):
        raise TypeError(f"launch: {kernel.__name__} takes {len(names)} arguments, got {len(args)}")
    values = list(args)
    used = 0
    for name in names[len(args) :]:
        if name in kwargs:
            values.append(kwargs[name])
            used += 1
        elif name in defaults:
            values.append(defaults[name])
        else:
            raise TypeError(f"launch: {kernel.__name__} is missing argument {name!r}")
    if used != len(kwargs):
        unknown = sorted(set(kwargs) - set(names[len(args) :]))
        raise TypeError(f"launch: {kernel.__name__} got unexpected arguments {unknown}")
    return values


def _first_tensor(values: Sequence[Any]) -> torch.Tensor | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    return None


def launch(kernel: Any, grid: Sequence[int], *args: Any, num_warps: int | None = None,
           num_stages: int | None = None, **kwargs: Any) -> None:  # fmt: skip
    """kernel[grid](*args, num_warps=..., num_stages=..., **kwargs), launched directly once
    the specialization has been compiled. num_warps / num_stages None: Triton's defaults
    for the backend (they differ between CUDA and ROCm)."""
    grid = tuple(grid)
    options = {name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages)) if value}
    tensor = _first_tensor(args)
    if tensor is None:
        tensor = _first_tensor(tuple(kwargs.values()))
    if not FAST or not hasattr(kernel, "params") or tensor is None or not tensor.is_cuda:
        kernel[grid](*args, **kwargs, **options)
        return
    from triton import knobs
    from triton.runtime import driver

    values = _bind(kernel, args, kwargs)
    device = driver.active.get_current_device()
    key = specialization_key(kernel, values, num_warps, num_stages, device)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs, **options)
        meta = compiled.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            compiled = False  # scratch memory is set up by JITFunction.run: always go through it
        if len(_compiled) >= _MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = compiled
        return
    if compiled is False:
        kernel[grid](*args, **kwargs, **options)
        return
    stream = driver.active.get_current_stream(device)
    enter = knobs.runtime.launch_enter_hook
    meta = None if enter is None else compiled.launch_metadata(grid, stream, *values)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter,
                 knobs.runtime.launch_exit_hook, *values)  # fmt: skip


def clear() -> None:
    """Forget the compiled specializations (tests)."""
    _compiled.clear()
