"""The sizes and options of one attention call as the kernels see them: plain data, shared by
the launch plans (triton/plan.py) and the JAX front end's jax.numpy path (which must not
need triton). NamedTuples, hashable: the launch plans are cached on them, and the PyTorch
launchers build one per call (a frozen dataclass costs microseconds more)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Problem", "KVProblem", "check_qkv_shapes"]


class Problem(NamedTuple):
    """One attention call as the kernels see it. seqlen_q / seqlen_k: the dense lengths, or
    the longest sequence of a varlen call (n_seqs sequences); window_right 0 is causal, -1
    an unbounded side; alibi: slopes are given ((n_seqs, heads_q) float32); softcap 0: off."""

    n_seqs: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    varlen: bool
    scale: float
    window_left: int
    window_right: int
    alibi: bool
    softcap: float

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def general(self, strides_aligned: bool) -> bool:
        """Whether the call is off the fast path (configs._TABLE): a window other than
        causal, varlen, ALiBi, softcap, or lengths or strides that are not multiples of 16."""
        return (
            self.varlen
            or self.window_left >= 0
            or self.window_right > 0
            or self.alibi
            or self.softcap > 0
            or self.seqlen_q % 16 != 0
            or self.seqlen_k % 16 != 0
            or not strides_aligned
        )


class KVProblem(NamedTuple):
    """One attention_kvcache call: q (batch, seqlen_q, heads_q, head_dim) against a cache of
    `bits` (16, 8, 4) with `group_size`; seqlen_new tokens just appended; max_seqlen_k bounds
    every sequence's keys (plans the splits); page_size 0: contiguous cache; rot_half 0: no
    rotary (else the rotated half width, interleaved pairs or halves); leftpad: each sequence's
    tokens start at a per-sequence slot offset (cache_leftpad); row_table: page_size 0 with a
    one-column block table naming each sequence's row (cache_batch_idx); fp8: bits 8 are
    float8_e4m3fn values with a scale per KV head (kvformat.py), not int8 codes; key_group:
    keys quantized by channel over groups of that many tokens (0: per token)."""

    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    bits: int
    group_size: int
    seqlen_new: int
    max_seqlen_k: int
    scale: float
    window_left: int
    window_right: int
    alibi: bool
    softcap: float
    page_size: int
    rot_half: int
    interleaved: bool
    leftpad: bool = False
    row_table: bool = False
    fp8: bool = False
    key_group: int = 0


def check_qkv_shapes(name: str, q: tuple, k: tuple, v: tuple, dims: int, head_dims: tuple[int, ...]) -> None:
    """The shape rules of q, k, v (both front ends): k and v alike, one batch, one head_dim
    out of `head_dims`, heads_q a multiple of heads_kv. Shapes as tuples; ranks already
    checked by the caller."""
    if k != v:
        raise ValueError(f"{name}: k and v must have the same shape, got {k} and {v}")
    if dims == 4 and q[0] != k[0]:
        raise ValueError(f"{name}: q has batch {q[0]} but k has batch {k[0]}")
    head_dim = q[-1]
    if k[-1] != head_dim:
        raise ValueError(f"{name}: q has head_dim {head_dim} but k and v have {k[-1]}")
    if head_dim not in head_dims:
        raise ValueError(f"{name}: head_dim {head_dim} is not supported; supported: {head_dims}")
    heads_q, heads_kv = q[-2], k[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{name}: heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for MQA/GQA"
        )
