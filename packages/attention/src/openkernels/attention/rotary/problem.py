"""apply_rotary's rules on shapes and dtype names, framework-neutral: the PyTorch face
(api.py) and the JAX face (jax/) check through these."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DTYPES", "KERNEL_DTYPES", "MAX_HEAD_DIM", "Part", "check_rotary"]

KERNEL_DTYPES = ("float16", "bfloat16", "float32")  # what the rotary kernel takes (elementwise)
# Widest head the rotary kernel's tiles are compile-checked for (triton/configs.py
# ROTARY_AOT_DIMS); wider heads run on the reference (PyTorch) or jax.numpy (JAX).
MAX_HEAD_DIM = 512
DTYPES = ("float16", "bfloat16", "float32", "float64")


class Part(NamedTuple):
    """An array's shape and dtype name ("bfloat16", ...)."""

    shape: tuple[int, ...]
    dtype: str


def check_rotary(name: str, q: Part, k: Part, cos: Part, sin: Part) -> None:
    """apply_rotary's q, k (batch, seqlen, heads, head_dim) and cos, sin ((batch or 1,)
    seqlen, rotary_dim): ValueError / TypeError naming the argument."""
    for what, t in (("q", q), ("k", k)):
        if len(t.shape) != 4:
            raise ValueError(
                f"{name}: {what} must be 4D (batch, seqlen, heads, head_dim), got shape {t.shape}"
            )
    for what, t in (("q", q), ("cos", cos), ("sin", sin)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}: {what} has dtype {t.dtype}; supported: {', '.join(DTYPES)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{name}: q and k must share a dtype, got q {q.dtype} and k {k.dtype}")
    batch, seqlen, _, head_dim = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (batch, seqlen, head_dim):
        raise ValueError(
            f"{name}: q and k must share batch, seqlen and head_dim, got q {q.shape} and k {k.shape}"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"{name}: cos and sin must have one shape, got {cos.shape} and {sin.shape}")
    dims = len(cos.shape)
    if dims not in (2, 3) or cos.shape[-2] != seqlen or (dims == 3 and cos.shape[0] not in (1, batch)):
        raise ValueError(f"{name}: cos and sin must be ({batch} or 1, {seqlen}, rotary_dim) or ({seqlen}, rotary_dim) "
                         f"for q of shape {q.shape}, got {cos.shape}")  # fmt: skip
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(f"{name}: rotary_dim (cos.shape[-1] = {rot_dim}) must be even and in 2..head_dim "
                         f"({head_dim})")  # fmt: skip
