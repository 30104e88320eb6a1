"""Launch plan of the rotary kernel (kernels.py): grid, config and every argument but the
pointers, shared by the PyTorch launcher (__init__.py) and the JAX launch (../jax/launch.py).
`Launch` and `Strides` are ../../core/triton/plan.py's."""

from __future__ import annotations

import functools

from ...core.triton.plan import Launch, Strides, cdiv, contiguous, stride_args
from .configs import RotaryConfig, rotary_blocks, rotary_config

__all__ = ["rotary", "contiguous_rotary"]


@functools.lru_cache(maxsize=4096)
def rotary(
    shape_q: tuple[int, int, int, int],
    heads_k: int,
    rot_dim: int,
    strides: tuple[Strides, Strides],
    table_strides: tuple[tuple[int, int], tuple[int, int]],
    backward: bool,
    arch: str,
    config: RotaryConfig | None = None,
) -> Launch:
    """`_apply_rotary_kernel`: q of shape_q (B, S, Hq, D), k with heads_k heads; strides of
    (q, k); table_strides (batch, token) of (cos, sin), batch 0 when the table broadcasts."""
    batch, seqlen, heads_q, head_dim = shape_q
    cfg = config or rotary_config(head_dim, rot_dim, heads_q, heads_k, arch)
    block_half, block_pass = rotary_blocks(head_dim, rot_dim)
    tokens = batch * seqlen
    (cb, cs), (sb, ss) = table_strides
    args = {
        **stride_args(("q", "k"), strides), "stride_cb": cb, "stride_cs": cs, "stride_sb": sb, "stride_ss": ss,
        "tokens": tokens, "seqlen": seqlen, "heads_q": heads_q, "heads_k": heads_k, "HEAD_DIM": head_dim,
        "ROT_HALF": rot_dim // 2, "BLOCK_T": cfg.block_t, "BLOCK_HQ": cfg.block_hq, "BLOCK_HK": cfg.block_hk,
        "BLOCK_HALF": block_half, "BLOCK_PASS": block_pass, "BACKWARD": backward,
    }  # fmt: skip
    return Launch((cdiv(tokens, cfg.block_t),), cfg.num_warps, None, args, cfg)


def contiguous_rotary(
    shape_q: tuple[int, int, int, int],
    heads_k: int,
    table_shape: tuple[int, int, int],
    backward: bool,
    arch: str,
) -> Launch:
    """`rotary` for contiguous q, k and (Bc, S, R) tables."""
    bc, seqlen, rot_dim = table_shape
    k_shape = (*shape_q[:2], heads_k, shape_q[3])
    table = (0 if bc == 1 else seqlen * rot_dim, rot_dim)
    strides = (contiguous(shape_q, False), contiguous(k_shape, False))
    return rotary(tuple(shape_q), heads_k, rot_dim, strides, (table, table), backward, arch)
