"""The sizes and options of one attention call as the kernels see them: plain data, shared by
the launch plans (triton/plan.py) and the JAX front end's jax.numpy path (which must not
need triton). NamedTuples, hashable: the launch plans are cached on them, and the PyTorch
launchers build one per call (a frozen dataclass costs microseconds more)."""

from __future__ import annotations

import functools
import itertools
import numbers
from typing import NamedTuple

__all__ = [
    "KERNEL_DTYPES",
    "HEAD_DIMS",
    "ATTENTION_HEAD_DIMS",
    "Problem",
    "KVProblem",
    "check_alibi_shape",
    "check_cache_heads",
    "check_cu_values",
    "check_head_dim",
    "check_lengths",
    "check_new_tokens",
    "check_options",
    "check_page_size",
    "check_qkv_shapes",
    "check_rotary_dim",
    "check_same_n_seqs",
    "resolve_scale",
]


KERNEL_DTYPES = ("float16", "bfloat16")  # what the Triton attention and KV-cache kernels take
# The KV cache's head dims (its tiles are tuned and checked per dim).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# attention / attention_varlen: any multiple of 8 up to 256, as FlashAttention-2 takes; the
# Triton kernels pad head_dim to a power of two (at least 16) and mask the pad.
ATTENTION_HEAD_DIMS = tuple(range(8, 257, 8))


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
    check_head_dim(name, head_dim, head_dims)
    heads_q, heads_kv = q[-2], k[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{name}: heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for MQA/GQA"
        )


def check_head_dim(name: str, head_dim: int, head_dims: tuple[int, ...]) -> None:
    if head_dim not in head_dims:
        described = str(head_dims)
        if head_dims == tuple(range(8, head_dims[-1] + 1, 8)):
            described = f"multiples of 8 up to {head_dims[-1]}"
        raise ValueError(f"{name}: head_dim {head_dim} is not supported; supported: {described}")


def check_alibi_shape(name: str, shape: tuple[int, ...], heads: int, n_seqs: int) -> None:
    """alibi_slopes: one slope per query head, shared by the sequences or one row each."""
    if shape not in ((heads,), (n_seqs, heads)):
        raise ValueError(
            f"{name}: alibi_slopes must have shape ({heads},) or ({n_seqs}, {heads}), got {shape}"
        )


def check_cu_values(name: str, what: str, values: list[int], tokens: int, max_seqlen: int) -> None:
    """The values of cu_seqlens_q / cu_seqlens_k (n_seqs + 1 offsets into `tokens` rows): a
    wrong one would read or write out of bounds."""
    if values[0] != 0 or values[-1] != tokens:
        raise ValueError(f"{name}: {what} must start at 0 and end at the token count {tokens}, got "
                         f"{values[0]} ... {values[-1]}")  # fmt: skip
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: {what} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"{name}: max_seqlen {max_seqlen} is below the longest sequence ({max(lengths)}) in {what}"
        )


def check_same_n_seqs(name: str, cu_q_len: int, cu_k_len: int) -> None:
    if cu_q_len != cu_k_len:
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_q_len - 1} and {cu_k_len - 1}")  # fmt: skip


def resolve_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale of a call: 1 / sqrt(head_dim) unless given."""
    return head_dim**-0.5 if softmax_scale is None else float(softmax_scale)


def check_cache_heads(name: str, q: tuple[int, ...], cache: tuple[int, ...], cache_head_dim: bool,
                      paged: bool, rows_indexed: bool) -> None:  # fmt: skip
    """q (batch, seqlen_q, heads_q, head_dim) against a 4D cache (rows or pages, slots,
    heads_kv, head_dim or its code width): cache_head_dim says whether cache[3] is head_dim
    (not for quantized codes); a contiguous cache has q's batch of rows unless rows_indexed."""
    batch, _, heads_q, head_dim = q
    heads_kv = cache[2]
    if cache_head_dim and cache[3] != head_dim:
        raise ValueError(f"{name}: q has head_dim {head_dim} but the cache has {cache[3]}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{name}: heads_q ({heads_q}) must be a multiple of the cache's heads_kv ({heads_kv})"
        )
    if not paged and cache[0] != batch and not rows_indexed:
        raise ValueError(f"{name}: the cache has batch {cache[0]} but q has {batch}")


def check_page_size(name: str, page: int) -> None:
    if page % 16:
        raise ValueError(f"{name}: the page size (k_cache.shape[1] = {page}) must be a multiple of 16")


def check_new_tokens(name: str, what: str, got: tuple[int, ...] | str, want: tuple[int, ...]) -> None:
    """k_new / v_new: `got` is the array's shape, or its type's name when it is no array."""
    if got != want:
        raise ValueError(f"{name}: {what} must have shape {want} (one new token per query), got {got}")


def check_rotary_dim(name: str, half: int, head_dim: int) -> None:
    """rotary_cos / rotary_sin of `half` columns rotate 2 * half of head_dim's elements."""
    if not 1 <= 2 * half <= head_dim:
        raise ValueError(f"{name}: rotary_dim (2 x rotary_cos.shape[1] = {2 * half}) must be "
                         f"in 2..head_dim ({head_dim})")  # fmt: skip


def _finite(x) -> bool:
    """math.isfinite that dynamo can trace when it turns a float argument into a symbolic
    one (math.isinf/isfinite on it is unsupported): x - x is NaN for +-inf and NaN."""
    return x - x == 0


def check_options(name: str, causal: object, softmax_scale: object, window: object, softcap: object,
                  cached: bool = True) -> tuple[int, int]:  # fmt: skip
    """(window_left, window_right) of an attention call after checking its scalar options, for
    both front ends; with `cached`, plain Python values are checked once per combination."""
    if (
        cached
        and type(causal) is bool
        and type(window) is tuple
        and len(window) == 2
        and type(window[0]) is int
        and type(window[1]) is int
        and type(softcap) in (float, int)
        and (softmax_scale is None or type(softmax_scale) in (float, int))
    ):  # exact types: True == 1 must not hit an entry cached for 1
        return _checked_options(name, causal, softmax_scale, window, softcap)
    return _check_options_now(name, causal, softmax_scale, window, softcap)


@functools.lru_cache(maxsize=1024)
def _checked_options(name, causal, softmax_scale, window, softcap) -> tuple[int, int]:
    return _check_options_now(name, causal, softmax_scale, window, softcap)


def _check_options_now(name, causal, softmax_scale, window, softcap) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
        or not _finite(softmax_scale) or softmax_scale <= 0
    ):  # fmt: skip
        raise ValueError(
            f"{name}: softmax_scale must be a positive finite float or None, got {softmax_scale!r}"
        )
    if (
        not isinstance(window, (tuple, list)) or len(window) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)
    ):  # fmt: skip
        raise ValueError(f"{name}: window must be a pair of ints >= -1 (-1: unbounded side), got {window!r}")
    if (
        not isinstance(softcap, numbers.Real)
        or isinstance(softcap, bool)
        or not softcap >= 0
        or not _finite(softcap)
    ):
        raise ValueError(f"{name}: softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    left, right = int(window[0]), int(window[1])
    return left, 0 if causal else right


def check_lengths(name: str, lengths: list[int], capacity: int, seqlen_new: int, seqlen_q: int,
                  rotary_rows: int | None) -> list[int]:  # fmt: skip
    """Host lengths before the append against the capacity (and the rotary table); returns
    the lengths after the append."""
    for b, cached in enumerate(lengths):
        if cached < 0 or cached + seqlen_new > capacity:
            raise ValueError(f"{name}: cache_seqlens[{b}] = {cached} plus {seqlen_new} new tokens is outside the "
                             f"cache's capacity of {capacity} tokens")  # fmt: skip
        if rotary_rows is not None and (
            cached + seqlen_new - seqlen_q < 0 or cached + seqlen_new > rotary_rows
        ):
            raise ValueError(f"{name}: rotary positions {cached + seqlen_new - seqlen_q}..{cached + seqlen_new - 1} of "
                             f"sequence {b} are outside rotary_cos's {rotary_rows} rows")  # fmt: skip
    return [n + seqlen_new for n in lengths]
