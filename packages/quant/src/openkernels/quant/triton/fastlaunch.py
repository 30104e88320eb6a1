"""Launching a Triton kernel with less host time than `kernel[grid](...)`.

The first call with a given specialization goes through `kernel[grid](...)` (which compiles
it); later calls call the compiled kernel's launcher directly, skipping Triton's argument
binder, cache-key hashing and hook checks. The caller gives a static key that pins the
constexprs, launch options, dtypes and integer arguments (a launch plan's key); this module
adds what may change between calls with the same plan: each tensor's 16-byte alignment.
Host time per call, H200 machine: 44.1 -> 35.1 us for the whole launcher at M=1 (before the
launch plans); benchmarks/overhead_quant.py measures it.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime import driver

__all__ = ["launch", "FAST"]

FAST = True  # False: always kernel[grid](...) (overhead measurements, debugging)
_compiled: dict[tuple, Any] = {}


def launch(kernel: Any, grid: tuple[int, int], args: tuple, constexprs: dict[str, Any], num_warps: int,
           num_stages: int, static_key: tuple) -> None:  # fmt: skip
    """kernel[grid](*args, **constexprs, num_warps=..., num_stages=...); runtime arguments in
    the kernel's parameter order, every constexpr given; `static_key` must change whenever
    anything but tensor addresses changes."""
    first = args[0]
    if not FAST or not first.is_cuda:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    key = (static_key, *[a.data_ptr() & 15 == 0 for a in args if isinstance(a, torch.Tensor)])
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        # The launcher takes every parameter in order, constexprs included (it skips them).
        _compiled[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args) :]))
        return
    compiled, const_values = entry
    stream = driver.active.get_current_stream(first.get_device())
    compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                 *const_values)  # fmt: skip
