"""The 4-bit weight on JAX arrays: format.py's layout as a JAX pytree.

    qweight  (N, K // 2) uint8, two codes per byte (column 2j in the low nibble)
    scales   (K // group_size, N) float16 or bfloat16
    zeros    (K // group_size, N) in the scales' dtype, or None (symmetric int4, nf4)
    perm     (K,) int32 or int64 act-order permutation, or None

The arrays are the pytree's leaves and (group_size, kind) its static aux data, so a weight
passes through ``jax.jit``, ``jax.device_put`` and friends like any array tree and a change
of group size or kind retraces. Shapes and dtypes are checked when a weight is built (on
tracers too); values (zeros in 0..16, perm a permutation) are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .. import format as torch_format
from .. import problem

__all__ = ["Int4Weight", "from_torch", "SCALE_DTYPES"]

SCALE_DTYPES = tuple(jnp.dtype(name) for name in problem.SCALE_DTYPES)


def _check_parts(qweight: Any, scales: Any, zeros: Any, group_size: Any, kind: Any, perm: Any) -> None:
    """problem.check_parts on JAX arrays (int32 act-order permutations too)."""
    for name, part in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("perm", perm)):
        if part is not None and not isinstance(part, jax.Array):
            raise TypeError(f"Int4Weight: {name} must be a jax.Array, got {type(part).__name__}")
    meta = [
        None if a is None else problem.Part(tuple(a.shape), str(a.dtype))
        for a in (qweight, scales, zeros, perm)
    ]
    problem.check_parts(meta[0], meta[1], meta[2], group_size, kind, meta[3], perm_dtypes=("int32", "int64"),
                      noun="array")  # fmt: skip


@dataclass(frozen=True, eq=False)
class Int4Weight(problem.Int4Shape):
    """A 4-bit weight W (N, K) in format.py's layout on JAX arrays (module docstring), the
    JAX counterpart of openkernels.quant.Int4Weight; `from_torch` converts one."""

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None
    group_size: int
    kind: str = "int4"
    perm: jax.Array | None = None

    def __post_init__(self) -> None:
        _check_parts(self.qweight, self.scales, self.zeros, self.group_size, self.kind, self.perm)

    def nbytes(self) -> int:
        """Bytes the weight occupies (codes, scales, zeros, perm)."""
        arrays = (self.qweight, self.scales, self.zeros, self.perm)
        return sum(p.size * p.dtype.itemsize for p in arrays if p is not None)

    def to_torch(self, device: torch.device | str = "cpu") -> torch_format.Int4Weight:
        """The same weight as a torch Int4Weight on `device` (a copy; perm becomes int64)."""
        move = lambda a: None if a is None else _to_tensor(a).to(device)  # noqa: E731
        perm = None if self.perm is None else move(self.perm).long()
        return torch_format.Int4Weight(move(self.qweight), move(self.scales), move(self.zeros), self.group_size,
                                       self.kind, perm)  # fmt: skip

    def __repr__(self) -> str:
        return self.describe("jax.Int4Weight", str(self.scales.dtype))


def _flatten(w: Int4Weight) -> tuple[tuple, tuple]:
    return (w.qweight, w.scales, w.zeros, w.perm), (w.group_size, w.kind)


def _unflatten(aux: tuple, leaves: tuple) -> Int4Weight:
    # JAX rebuilds trees with placeholder leaves (tree_map, transformations): no checks here.
    w = object.__new__(Int4Weight)
    for name, value in zip(("qweight", "scales", "zeros", "perm", "group_size", "kind"), (*leaves, *aux)):
        object.__setattr__(w, name, value)
    return w


jax.tree_util.register_pytree_node(Int4Weight, _flatten, _unflatten)


def _to_array(t: torch.Tensor, dtype: Any = None) -> jax.Array:
    """A JAX copy of a tensor (through the host; bfloat16 through its bits)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return jnp.array(t.view(torch.int16).numpy().view(jnp.bfloat16))
    return jnp.array(t.numpy(), dtype=dtype)


def _to_tensor(a: jax.Array) -> torch.Tensor:
    host = np.asarray(a)
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def from_torch(weight: torch_format.Int4Weight) -> Int4Weight:
    """The JAX form of a torch Int4Weight (copies on JAX's default device; an act-order perm
    becomes int32, enough for any in_features)."""
    if not isinstance(weight, torch_format.Int4Weight):
        raise TypeError(f"from_torch: expected an openkernels.quant.Int4Weight, got {type(weight).__name__}")
    zeros = None if weight.zeros is None else _to_array(weight.zeros)
    perm = None if weight.perm is None else _to_array(weight.perm, np.int32)
    return Int4Weight(_to_array(weight.qweight), _to_array(weight.scales), zeros, weight.group_size, weight.kind,
                      perm)  # fmt: skip
