"""Launch configs of the KV-cache kernels (kernels.py): tiles per arch family, and the split
of the key axis (flash-decoding), as pure functions shared by the launcher, the tuning sweep
and the compile-only checks. AttnConfig and arch_family are ../../core/triton/configs.py's.
"""

from __future__ import annotations

from ...core.triton.configs import AttnConfig, arch_family, block_d

__all__ = ["kv_config", "kv_splits", "lean_decode", "lean_pays", "short_decode_splits", "kv_append_block_t",
           "kv_append_keys_warps"]  # fmt: skip

_C = AttnConfig

# Rows are (query, head) pairs of one KV head's group: a decode step of GQA 32/8 has 4 rows,
# padded to the 16 a matrix-unit tile needs (the K/V bytes, not the math, bound decode).
# Splits cut the key axis until about `programs per SM` programs are in flight, each with at
# least `min blocks` key blocks (below that the partials' write and merge, and each program's
# pipeline prologue, cost more than they save): (programs per SM, min blocks) by num_warps.
# One-warp programs (the quantized decode on Hopper) need many per SM to hide latency and
# run 32-key blocks: H200, fp8 at B8 S32768 146.6 us with 33 splits (16 programs per SM)
# against 159-168 with fewer; at B32 S4096 (128 blocks) 2-3 splits led (74-76 us) and 9 lost
# (87 us): each program then had 14 blocks. Whatever the warps, the splits first give every SM
# one program where the cache has _KV_MIN_BLOCKS_PER_SPLIT blocks per split for it: a single
# short sequence (B1 S4096: 8 programs, 128 blocks of 32 keys) would otherwise run 32
# one-warp programs on 132 SMs (not measured on the GPU; the 4-warp rule gave it 128).
_KV_SPLIT_RULE = {1: (16, 32), 2: (8, 16)}
_KV_SPLIT_DEFAULT = (2, 4)
_KV_MIN_BLOCKS_PER_SPLIT = 4
# A one-warp (lean) decode pays only with long splits: its programs run their key blocks one
# after another. H200, B1 S4096 (8 programs, 128 blocks of 32 keys: 17 splits of 7-8 blocks),
# CUDA-graph kernel us fp8 / int8 / int4: one warp 15.0 / 21.5 / 19.6; 64-key tiles at 4 warps
# in 33 splits of 2 blocks 10.1 / 11.1 / 10.8 (64 splits of 1 block: 13.2-15.5). The measured
# one-warp wins had 32 or more blocks per split (B32 S4096, B8 S32768, B1 S131072); the
# threshold sits between the two measured regimes. A short decode that falls back to the
# 4-warp tile takes splits of _SHORT_DECODE_MIN_BLOCKS blocks, the measured best above.
_LEAN_MIN_BLOCKS_PER_SPLIT = 16
# One-warp splits at head_dim 64 (Llama 3.2 1B's): H200, B16 S4352 GQA 32/8 (`tune_kvcache.py
# --head-dim 64 --configs 32/1`, CUDA-graph kernel us int4 / int8 / fp8): 9 splits of 15
# blocks 32.8 / 37.8 / 31.7 against 39.4 / 50.2 / 30.5 with the 4 splits of 34 blocks the
# D128 minimum gave. 16 blocks of 32 keys at D64 are the bytes of 8 at D128.
_LEAN_MIN_BLOCKS_D64 = 16
_SHORT_DECODE_MIN_BLOCKS = 2


# arch family -> (decode of a 16-bit cache, decode of an int8/int4 cache, chunked prefill) at
# head_dim <= 128, and every call at D256.
# Hopper, measured on H200 (benchmarks/tuning/tune_kvcache.py, GQA 32/8 D128): 16-bit decode led
# with 128-key tiles at 4 warps, 3 stages (0.939 of copy bandwidth at B32 S4096, 0.891 at
# B1 S131072 with 33 splits) but spills 8 B in its plain variant; 64-key tiles are within
# 1% (0.926 / 0.884); quantized caches led with 64-key tiles at 4 warps too (their loads
# feed the dequantization, which Triton does not pipeline: stages matter little). Compile checks with every flag on: 4 warps put dequantized int8 tiles at
# 246-255 registers and spilled at D256, 8 warps hold them there; 64-row prefill tiles
# spilled at D256 on sm_90 and for quantized caches on sm_80 (32 rows do not); gfx942
# spilled up to 128 VGPRs with 64-key tiles (gathered group scales); 32-key tiles of 16
# rows (4 warps) and 16-key tiles at D256 compile clean on gfx90a, gfx942 and gfx950.
_KV_TABLE: dict[str, tuple[AttnConfig, AttnConfig, AttnConfig, AttnConfig]] = {
    "hopper": (_C(16, 64, 4, 3), _C(16, 64, 4, 3), _C(32, 64, 8, 2), _C(16, 32, 8, 3)),
    "ampere": (_C(16, 64, 8, 3), _C(16, 64, 4, 3), _C(32, 64, 8, 2), _C(16, 32, 8, 2)),
    "cdna": (_C(16, 32, 4, 1), _C(16, 32, 4, 1), _C(16, 32, 4, 1), _C(16, 16, 8, 1)),
}


# fp8 decode takes the quantized caches' config. H200, 2026-12-02, kernel us at B32 S4096 /
# B8 S32768 / B1 S131072 (SDPA 133.8 / 251.6 / 136.9): 64 keys, 4 warps, 3 stages 116.3 /
# 194.4 / 103.0; 128 keys at 4 warps 97.1 / 236.3 / 93.4 (3 stages: spills 4 B with every
# flag on) and 105.2 / 265.9 / 103.5 (2 stages); 8 warps slower at every shape.
#
# Lean quantized decode on Hopper: one warp per program, 32-key tiles, 3 stages, many programs
# per SM (_KV_SPLIT_RULE). A program of one warp has no cross-warp reduction or barrier wait
# in its loop (the softmax's row max and sum, the scale rows and P's move into the dot's
# operand layout stay within the warp), and its loads are in flight while other programs
# compute. H200 (`tune_kvcache.py`, CUDA-graph kernel us, B32 S4096 / B8 S32768): fp8 74.4 /
# 146.6 against 101.8 / 189.3 with 64 keys at 4 warps (0.85 of copy bandwidth), int8 130.6 /
# 215.9 against 142.9 / 398.6, int4 -- / 186.4 against 97.0 / 244.5. Its tile is at the 255
# register limit: in-kernel rotary, groups along head_dim and keys by channel spilled 4-236 B
# on sm_90 (int8 also with ALiBi, softcap and windows together), so those keep the 4-warp tile.
_LEAN_DECODE = {"hopper": _C(16, 32, 1, 3)}


def lean_decode(
    bits: int, group_size: int, head_dim: int, fp8: bool, key_group: int, rotary: bool, extras: bool
) -> bool:
    """Whether a quantized decode specialization fits the one-warp tile without spills: one
    scale per token (or fp8's per head), no keys by channel, no in-kernel rotary; for int8
    also none of ALiBi, softcap or a left window (`extras`)."""  # fmt: skip
    per_token = fp8 or group_size == head_dim
    return bits != 16 and per_token and not key_group and not rotary and (fp8 or bits == 4 or not extras)


def kv_config(
    head_dim: int, bits: int, rows: int, arch: str, fp8: bool = False, lean: bool = False
) -> AttnConfig:
    """Launch config of `_attention_kvcache_fwd_kernel` for `rows` packed rows (seqlen_q *
    group) of one KV head, a cache of `bits` (16, 8, 4; fp8: e4m3 bytes) on `arch`; decode
    (rows <= 16) streams K/V with 16-row tiles. lean: a quantized decode that `lean_decode`
    admits (one-warp tiles where the arch has them)."""
    family = arch_family(arch)
    if family == "interpreter":  # 32 keys: a page of 16 takes the per-key table lookups
        return AttnConfig(16, 32, 4, 1)
    decode16, decode_quant, prefill, wide = _KV_TABLE[family]
    if head_dim > 128:
        # fp8 tiles of 32 keys at D256 spilled 4-28 B with every flag on (sm_80, sm_90);
        # 16 keys compile clean on both.
        return _C(16, 16, 8, 3) if fp8 and family != "cdna" else wide
    if rows > 16:
        return prefill
    if lean and family in _LEAN_DECODE:
        return _LEAN_DECODE[family]
    return decode16 if bits == 16 else decode_quant


def kv_append_keys_warps(head_dim: int, key_group: int) -> int:
    """Warps of the keys-by-channel append: a (key_group, head_dim) float32 tile and its
    rotary partner per program; at 4 warps a (64, 256) one spilled hundreds of bytes."""
    return 8 if key_group * block_d(head_dim) > 8192 else 4


def kv_splits(
    programs: int,
    key_blocks: int,
    sm_count: int,
    num_warps: int = 4,
    min_blocks: int | None = None,
    head_dim: int = 128,
) -> int:
    """How many splits of the key axis for programs of `num_warps` warps, at most 128: one
    program per SM if the splits keep _KV_MIN_BLOCKS_PER_SPLIT key blocks each, and up to the
    rule's programs per SM while they keep its minimum of blocks (_KV_SPLIT_RULE; `min_blocks`
    overrides that minimum). The one-warp minimum counts blocks of head_dim 128; at head_dim
    64 a block is half the bytes and half as many more are needed (see _LEAN_MIN_BLOCKS_D64)."""
    per_sm, rule_min = _KV_SPLIT_RULE.get(num_warps, _KV_SPLIT_DEFAULT)
    if num_warps == 1 and head_dim <= 64:
        rule_min = _LEAN_MIN_BLOCKS_D64
    min_blocks = min_blocks or rule_min
    programs = max(programs, 1)
    fill = min(-(-sm_count // programs), key_blocks // _KV_MIN_BLOCKS_PER_SPLIT)
    more = min(-(-per_sm * sm_count // programs), key_blocks // min_blocks)
    return max(1, min(max(fill, more), 128))


def lean_pays(programs: int, key_blocks: int, sm_count: int, head_dim: int = 128) -> bool:
    """Whether a one-warp decode of `programs` programs over `key_blocks` blocks of its tile
    keeps _LEAN_MIN_BLOCKS_PER_SPLIT blocks per split (else the 4-warp tile is faster)."""
    splits = kv_splits(programs, key_blocks, sm_count, 1, head_dim=head_dim)
    return key_blocks >= _LEAN_MIN_BLOCKS_PER_SPLIT * splits


def short_decode_splits(programs: int, key_blocks: int, sm_count: int, num_warps: int) -> int:
    """Splits of a quantized decode too short for the one-warp tile (see lean_pays)."""
    return kv_splits(programs, key_blocks, sm_count, num_warps, _SHORT_DECODE_MIN_BLOCKS)


def kv_append_block_t(head_dim: int) -> int:
    """New tokens per program of `_kvcache_append_fwd_kernel` (a (tokens, head_dim) float32 tile)."""
    return max(1, 2048 // block_d(head_dim))
