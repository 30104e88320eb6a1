"""The sizes and options of one attention-against-a-KV-cache call as the kernels see them, and
the cache's shape rules: plain data and checks on shapes and values, shared by the PyTorch
and JAX faces (../core/problem.py holds the options and rules both problems share)."""

from __future__ import annotations

from typing import NamedTuple

from ..core.problem import HEAD_DIMS, KERNEL_DTYPES, check_head_dim

__all__ = [
    "KERNEL_DTYPES",
    "HEAD_DIMS",
    "KVProblem",
    "check_cache_heads",
    "check_head_dim",
    "check_lengths",
    "check_new_tokens",
    "check_page_size",
    "check_rotary_dim",
]


class KVProblem(NamedTuple):
    """One attention_kvcache call: q (batch, seqlen_q, heads_q, head_dim) against a cache of
    `bits` (16, 8, 4) with `group_size`; seqlen_new tokens just appended; max_seqlen_k bounds
    every sequence's keys (plans the splits); page_size 0: contiguous cache; rot_half 0: no
    rotary (else the rotated half width, interleaved pairs or halves); leftpad: each sequence's
    tokens start at a per-sequence slot offset (cache_leftpad); row_table: page_size 0 with a
    one-column block table naming each sequence's row (cache_batch_idx); fp8: bits 8 are
    float8_e4m3fn values with a scale per KV head (format.py), not int8 codes; key_group:
    keys quantized by channel over groups of that many tokens (0: per token); fused_append:
    the seqlen_new new tokens are written by the attention kernel itself (16-bit contiguous
    caches, one block of query rows), rot_tokens: with per-token rotary tables (rot_half their
    half width) instead of position-indexed ones; advance: the call adds seqlen_new to the
    cache's length counter after its attention (the split combine does it when there is one)."""

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
    fused_append: bool = False
    rot_tokens: bool = False
    advance: bool = False


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
