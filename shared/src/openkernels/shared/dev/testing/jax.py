"""Test helpers of the JAX front ends: moving arrays between torch and JAX, and the JAX
backends a test runs over in this process.

The JAX ops are checked against the families' PyTorch references on the same inputs:
make the input with torch (`random_tensor`), hand it to JAX with `to_jax`, bring the
result back with `to_torch` and compare with `assert_close`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ...jax import unavailable

__all__ = ["to_jax", "to_torch", "jax_backends"]


def to_jax(t: torch.Tensor) -> jax.Array:
    """A JAX copy of a (CPU) tensor, dtype kept (bfloat16 through its bits)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.asarray(t.numpy())


def to_torch(a: jax.Array) -> torch.Tensor:
    """A torch CPU copy of a JAX array, dtype kept."""
    host = np.asarray(a)
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def jax_backends() -> list:
    """pytest params of the JAX backends that run here: "jnp" always, "interpret" under
    TRITON_INTERPRET=1 (marked `interpreter`), "triton" on a GPU build of JAX with
    jax-triton (marked `gpu`)."""
    params = [pytest.param("jnp", id="jnp")]
    if unavailable("interpret") is None:
        params.append(pytest.param("interpret", id="interpret", marks=pytest.mark.interpreter))
    if unavailable("triton") is None:
        params.append(pytest.param("triton", id="triton", marks=pytest.mark.gpu))
    return params
