"""The activations ops on JAX arrays: same names, arguments and math as the PyTorch API.

Unary ops take x of any shape; gated ops take x of shape (..., 2d) and return (..., d).
Dtypes: float16, bfloat16, float32 (float64 too with jax_enable_x64, on the jnp backend).
Math is float32 inside, rounded once to the input dtype. Every op works under
``jax.jit`` and differentiates through ``jax.custom_vjp`` with the family's backward
kernels. There is no ``out=``: JAX arrays are immutable.

Backends (`openkernels.shared.jax`): the family's Triton kernels through jax-triton on
GPUs, the Triton interpreter for tests, and a jax.numpy composition everywhere else.
Needs the ``[jax]`` extra: ``pip install openkernels-activations[jax]``.

The functions are made from the op table (`spec.SPECS`), one per op of
`openkernels.activations`: its name, its docstring, and its arguments without ``out=``
(``x``, and ``approximate="none"`` for the GELU ops).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from openkernels.shared import jax as okjax

from .. import api as _api
from ..problem import check_approximate, check_shape
from ..spec import SPECS, Act, OpSpec, act_for

# jax.numpy goes by its full name here: in this package, jnp is the submodule jnp.py.
from . import jnp as jnp_backend
from . import launch

__all__ = list(SPECS)  # one function per op of the table

_DTYPES = (jax.numpy.float16, jax.numpy.bfloat16, jax.numpy.float32, jax.numpy.float64)


def _triton_applies(x: jax.Array) -> bool:
    return okjax.backend() != "jnp" and x.dtype != jax.numpy.float64 and x.size > 0


def _forward(x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    impl = launch.forward if _triton_applies(x) else jnp_backend.forward
    return impl(x, act, gated, act_first)


def _backward(dy: jax.Array, x: jax.Array, act: Act, gated: bool, act_first: bool) -> jax.Array:
    impl = launch.backward if _triton_applies(x) else jnp_backend.backward
    return impl(dy, x, act, gated, act_first)


# The backend is a static argument, read when the public function is called: a backward
# traced later (a vjp function called outside the caller's `use_backend` block) still
# runs where the forward ran.
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _apply(x: jax.Array, act: Act, gated: bool, act_first: bool, backend: str) -> jax.Array:
    with okjax.use_backend(backend):
        return _forward(x, act, gated, act_first)


def _apply_fwd(x, act, gated, act_first, backend):
    return _apply(x, act, gated, act_first, backend), x


def _apply_bwd(act, gated, act_first, backend, x, dy):
    with okjax.use_backend(backend):
        return (_backward(dy, x, act, gated, act_first),)


_apply.defvjp(_apply_fwd, _apply_bwd)


def _call(name: str, x: jax.Array, approximate: str = "none") -> jax.Array:
    okjax.check_array(name, "x", x, _DTYPES)
    check_approximate(name, approximate)
    check_shape(name, tuple(x.shape))
    spec = SPECS[name]
    return _apply(x, act_for(spec, approximate), spec.gated, spec.act_first, okjax.backend())


def _public(spec: OpSpec) -> Callable[..., jax.Array]:
    """The JAX function of one op: the PyTorch function's name, docstring and arguments
    (less ``out=``)."""
    name = spec.name
    if spec.approximate:

        def fn(x: jax.Array, approximate: str = "none") -> jax.Array:
            return _call(name, x, approximate)
    else:

        def fn(x: jax.Array) -> jax.Array:
            return _call(name, x)

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    fn.__doc__ = getattr(_api, name).__doc__
    return fn


globals().update({name: _public(spec) for name, spec in SPECS.items()})
