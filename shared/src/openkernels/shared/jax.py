"""The JAX side of openkernels: which backend runs an op, and how a Triton kernel is launched.

Families expose their ops to JAX in ``openkernels.<family>.jax``; those modules build on
this one. Nothing here (or in them) is imported by the PyTorch API, so JAX stays an
optional extra (``pip install openkernels-<family>[jax]``).

Backends of a JAX op, chosen when the function is traced (inside ``jax.jit`` that is once
per shape and dtype, so a later `use_backend` does not change a compiled function):

* ``"triton"``: the family's own Triton kernels, the same sources and launch configs as
  the PyTorch path, launched through jax-triton on NVIDIA and AMD GPUs.
* ``"interpret"``: the same launches run by the Triton interpreter on the CPU through
  ``jax.pure_callback`` (process started with TRITON_INTERPRET=1). Tests use it to check
  the JAX launch code (argument order, grid, constants) without a GPU.
* ``"jnp"``: a jax.numpy composition that matches the family's reference; it runs wherever
  JAX runs and is what XLA fuses on its own.

Default: ``"triton"`` when JAX's default backend is a GPU and jax-triton imports,
otherwise ``"jnp"`` (with one warning when a GPU is present but jax-triton is not).

The choice is made by `openkernels.shared.dispatch`, where these backends are declared as
the implementations of the front end "jax" (the rules of each live here, in
`unavailable`), so the PyTorch face's overrides steer both: OPENKERNELS_FORCE /
OPENKERNELS_FORBID and `dispatch.force` / `dispatch.forbid`, with bare names ("reference"
runs "jnp", "triton" runs "triton", or "interpret" under TRITON_INTERPRET=1) or "jax:name"
for the JAX face only. `use_backend(name)` is `dispatch.force_first("jax:<name>")`, and
`explain()` says which backend runs and why.

Launch convention: jax-triton passes a kernel its array inputs, then its outputs, then
everything else by keyword as compile-time constants. Shapes are static under JAX, so
every integer argument (sizes, strides) is a constant here: kernels see the same values
as from PyTorch, specialized further. jax-triton binds the arrays to the kernel's first
parameters by position, so a kernel launched from JAX starts its signature with its input
pointers, then its output pointers; `launch` checks that.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import dispatch

__all__ = [
    "BACKENDS",
    "backend",
    "use_backend",
    "explain",
    "dispatch_key",
    "unavailable",
    "gpu_vendor",
    "launch",
    "torch_dtype",
    "check_array",
    "row_view",
]

BACKENDS = ("triton", "interpret", "jnp")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the JAX ops traced inside this block on backend `name` ("triton", "interpret",
    "jnp", or "reference" for "jnp"): `dispatch.force_first("jax:<name>")`, ahead of the
    enclosing `dispatch.force` blocks and OPENKERNELS_FORCE (a forbidden backend stays
    forbidden). Raises UnsupportedError (a ValueError) for a name the JAX face does not
    know, worded as `dispatch.force` words it, and RuntimeError on entry when that backend
    cannot run here (no GPU or jax-triton for "triton", no TRITON_INTERPRET=1 for
    "interpret")."""
    selected = dispatch.selected_by(dispatch.JAX, f"{dispatch.JAX}:{name}", source="use_backend()")
    # "triton" here is jax-triton only: in a force entry it also runs the interpreter.
    target = name if name in selected else selected[0]
    reason = unavailable(target)
    if reason:
        raise RuntimeError(f"JAX backend {target!r} cannot run here: {reason}")
    with dispatch.force_first(f"{dispatch.JAX}:{target}"):
        yield


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


@functools.cache
def _jax_triton():
    """The jax_triton module, or the import error's text."""
    # jax-triton 0.3 sets TRITON_CACHE_DIR="" at import, after which every Triton JIT
    # compile of the process fails ("Could not create or locate cache dir"): the PyTorch
    # path's kernels and torch.compile's included. jax-triton compiles without that cache,
    # so the variable is put back as it was.
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except Exception as exc:  # ImportError, or its own check of JAX's GPU support
        return f"jax-triton does not import ({exc})"
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


def dispatch_key() -> dispatch.DispatchKey:
    """What the backend choice depends on, as dispatch caches it: JAX's platform ("gpu" for
    CUDA and ROCm, else JAX's name for it), TRITON_INTERPRET and, on a GPU, whether
    jax-triton imports."""
    platform = "gpu" if _on_gpu() else jax.default_backend()
    features = []
    if _interpreting():
        features.append("interpreter")
    elif platform == "gpu" and not isinstance(_jax_triton(), str):
        features.append("jax-triton")
    return dispatch.DispatchKey(dispatch.JAX, platform, None, frozenset(features))


def unavailable(backend: str, key: dispatch.DispatchKey | None = None) -> str | None:
    """Why JAX backend `backend` cannot run under `key` (default: `dispatch_key()`, here and
    now), or None: the predicate of the JAX face's implementations in dispatch."""
    if key is None:
        key = dispatch_key()
    if backend == "jnp":
        return None
    interpreting = "interpreter" in key.features
    if backend == "interpret":
        return None if interpreting else "start the process with TRITON_INTERPRET=1"
    if key.arch != "gpu":
        return f"JAX's default backend is {key.arch!r}, not a GPU"
    if interpreting:
        return "TRITON_INTERPRET=1 is set, so Triton kernels are interpreter objects"
    module = _jax_triton()
    return module if isinstance(module, str) else None


@functools.cache
def _warn_no_triton(reason: str) -> None:
    warnings.warn(
        f"openkernels JAX ops run as jax.numpy compositions on this GPU: {reason}; "
        "install openkernels-<family>[jax] on a GPU build of JAX for the Triton kernels",
        RuntimeWarning,
        stacklevel=4,
    )


def backend() -> str:
    """The backend the JAX ops traced now run on: "triton", "interpret" or "jnp" (see the
    module docstring). Raises dispatch.UnsupportedError when the steering leaves none that
    can run here (OPENKERNELS_FORCE=triton off a GPU, say), as a PyTorch op does."""
    key = dispatch_key()
    name = dispatch.select(dispatch.JAX, key)[0].name
    if name == "jnp" and key.arch == "gpu" and not dispatch.steering(dispatch.JAX)[0]:
        reason = unavailable("triton", key)
        if reason:
            _warn_no_triton(reason)
    return name


def explain() -> str:
    """Which backend the JAX ops traced now run on and why each other one is not used
    (`dispatch.explain("jax")`)."""
    return dispatch.explain(dispatch.JAX)


@functools.cache
def gpu_vendor() -> str:
    """ "cuda" or "rocm" for JAX's default GPU backend, "cpu" otherwise (picks launch configs)."""
    if not _on_gpu():
        return "cpu"
    version = jax.devices()[0].client.platform_version.lower()
    return "rocm" if "rocm" in version or "hip" in version else "cuda"


_TORCH_DTYPES = {
    jnp.dtype(jnp.float16): torch.float16,
    jnp.dtype(jnp.bfloat16): torch.bfloat16,
    jnp.dtype(jnp.float32): torch.float32,
    jnp.dtype(jnp.float64): torch.float64,
    jnp.dtype(jnp.int8): torch.int8,
    jnp.dtype(jnp.uint8): torch.uint8,
    jnp.dtype(jnp.int16): torch.int16,
    jnp.dtype(jnp.int32): torch.int32,
    jnp.dtype(jnp.int64): torch.int64,
    jnp.dtype(jnp.bool_): torch.bool,
}


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype (launch configs are keyed by torch dtypes)."""
    return _TORCH_DTYPES[jnp.dtype(dtype)]


def check_array(name: str, arg: str, x: Any, dtypes: Sequence[Any]) -> None:
    """Raise TypeError unless `x` is a JAX array (or tracer) of one of `dtypes`."""
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name}: {arg} must be a jax.Array, got {type(x).__name__}")
    allowed = [jnp.dtype(d) for d in dtypes]
    if x.dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name}: {arg} has dtype {x.dtype.name}; supported: {names}")


def row_view(x: jax.Array) -> tuple[jax.Array, int, int]:
    """x as a contiguous (rows, last dim) matrix, with its two sizes (a free reshape)."""
    n_cols = x.shape[-1] if x.ndim else 1
    n_rows = math.prod(x.shape[:-1]) if x.ndim else 1
    return x.reshape(n_rows, n_cols), n_rows, n_cols


def _check_order(
    kernel: Any, inputs: Sequence[str], outputs: Sequence[str], constants: Mapping[str, Any]
) -> None:
    names = list(kernel.arg_names)
    unknown = sorted((set(inputs) | set(outputs) | set(constants)) - set(names))
    if unknown:
        raise TypeError(f"{_kernel_name(kernel)} has no arguments {unknown}")
    # jax-triton binds the arrays to the kernel's first parameters by position, so the
    # pointers must lead the signature: inputs, then outputs, then only constants.
    expected = [n for n in names if n in inputs] + [n for n in names if n in outputs]
    rest = names[len(expected) :]
    if names[: len(expected)] != expected or any(n not in constants for n in rest):
        raise TypeError(
            f"{_kernel_name(kernel)} cannot be launched from JAX: its parameters {names} must start with "
            f"the inputs {list(inputs)} then the outputs {list(outputs)}, and every later parameter "
            "must be given as a constant"
        )


def _kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", repr(kernel))


def launch(
    kernel: Any,
    *,
    grid: tuple[int, ...],
    inputs: Mapping[str, jax.Array],
    outputs: Mapping[str, jax.ShapeDtypeStruct],
    constants: Mapping[str, Any],
    num_warps: int,
    num_stages: int,
    zeroed: Sequence[str] = (),
) -> tuple[jax.Array, ...]:
    """Launch a Triton kernel on JAX arrays; returns the outputs in `outputs`' order.

    kernel: a ``@triton.jit`` function whose runtime arguments are the `inputs` pointers
    followed by the `outputs` pointers (each group in the kernel's own order); every other
    argument, integers included, is given in `constants`. zeroed: outputs that start as
    zeros (kernels that accumulate). Runs through jax-triton on backend "triton" and through
    the Triton interpreter on backend "interpret".
    """
    _check_order(kernel, list(inputs), list(outputs), constants)
    names = list(kernel.arg_names)
    in_names = [n for n in names if n in inputs]
    out_names = [n for n in names if n in outputs]
    order = [out_names.index(n) for n in outputs]  # kernel order -> caller's order
    shapes = [jax.ShapeDtypeStruct(outputs[n].shape, outputs[n].dtype) for n in out_names]
    where = backend()
    if where == "triton":
        jt = _jax_triton()
        results = jt.triton_call(
            *[inputs[n] for n in in_names],
            kernel=kernel,
            out_shape=shapes,
            grid=tuple(grid),
            name=_kernel_name(kernel),
            num_warps=num_warps,
            num_stages=num_stages,
            zeroed_outputs=tuple(out_names.index(n) for n in zeroed),  # hashable: a jaxpr parameter
            **constants,
        )
    elif where == "interpret":
        arrays = [inputs[n] for n in in_names]
        results = _interpret(
            kernel, grid, arrays, in_names, out_names, shapes, dict(constants), num_warps, num_stages
        )
    else:
        raise RuntimeError(f"launch() runs Triton kernels; the current JAX backend is {where!r}")
    results = list(results)
    return tuple(results[i] for i in order)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.array(a, copy=True)  # writable and contiguous: the kernel reads it as a tensor
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _interpret(
    kernel: Any,
    grid: tuple[int, ...],
    arrays: list[jax.Array],
    in_names: list[str],
    out_names: list[str],
    shapes: list[jax.ShapeDtypeStruct],
    constants: dict[str, Any],
    num_warps: int,
    num_stages: int,
) -> list[jax.Array]:
    """The launch on the CPU: the interpreter reads torch tensors, so arrays cross over."""

    def host(*arrays: np.ndarray) -> list[np.ndarray]:
        args = {n: _to_torch(a) for n, a in zip(in_names, arrays)}
        outs = [torch.zeros(s.shape, dtype=torch_dtype(s.dtype)) for s in shapes]
        args.update(zip(out_names, outs))
        kernel[tuple(grid)](**args, **constants, num_warps=num_warps, num_stages=num_stages)
        return [_to_numpy(t) for t in outs]

    # vmap of an op on this backend calls the kernel once per batch element.
    return jax.pure_callback(host, shapes, *arrays, vmap_method="sequential")
