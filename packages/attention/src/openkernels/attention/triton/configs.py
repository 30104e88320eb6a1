"""Launch configs of the attention kernels: one pure function of (head_dim, dtype, arch,
direction, path), shared by the launchers, the tuning sweep and the compile-only checks.

Directions: "fwd" (forward), "dkdv" (backward, one program per key block), "dq"
(backward, one program per query block). The preprocess (delta = rowsum(o * do)) is a
memory-bound pass with a fixed config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AttnConfig",
    "arch_family",
    "launch_config",
    "all_configs",
    "DIRECTIONS",
    "block_d",
    "preprocess_block_m",
    "RotaryConfig",
    "rotary_blocks",
    "rotary_config",
    "all_rotary_configs",
    "ROTARY_AOT_DIMS",
    "ROTARY_AOT_HEADS",
]

DIRECTIONS = ("fwd", "dkdv", "dq")


@dataclass(frozen=True)
class AttnConfig:
    """block_m: query rows per tile, block_n: keys per tile; num_stages: software
    pipelining depth of the block loop; tma: load K/V tiles with the Hopper copy engine
    (tensor descriptors; used on sm_90+ only, where the strides allow)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False


def block_d(head_dim: int) -> int:
    """head_dim padded to a power of two of at least 16, a matrix-unit tile's depth (96 -> 128,
    40 -> 64, 8 -> 16; the pad is masked)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def preprocess_block_m(head_dim: int) -> int:
    """Rows per program of the backward's delta = rowsum(o * do) pass: o and do in float32
    take 2 * rows * BLOCK_D / 128 registers per thread at 4 warps; 64 x 256 spilled 48 B."""
    return min(64, 8192 // block_d(head_dim))


def group_sum_block_rows(block_d: int) -> int:
    """(token, head) rows per program of GQA's dK/dV group sum: 4096 float32 sums a program
    (32 registers a thread at 4 warps)."""
    return max(1, 4096 // block_d)


# (arch family, direction) -> {largest head_dim: (fast, general)}. "fast" serves dense
# calls with no window but the causal one, no ALiBi or softcap, and sequence lengths and
# strides that are multiples of 16 (what the benchmarks and most models run); "general"
# serves everything else. Both compile without register spills for every variant they serve
# on every arch of the family (tests/test_aot.py); the general one gives up some speed for
# that: the backward's key-block kernel holds K, V and float32 dK, dV for its whole loop, and
# window masks, varlen offsets, ALiBi and the softcap's tanh each add live registers.
# Hopper, measured on H200 bf16 (benchmarks/tune_attention.py, docs/perf.md):
# - fwd: 64x64 tiles, 4 warps, 3 stages led at D64 and D128 (480 TFLOP/s at B8 H16 S2048
#   D128 vs 445 for 128x64/8 warps; 354 vs 345 at D64 causal); 128x128/8 warps won causal
#   S8192 by 4% but sits at 255 registers. TMA K/V loads (tensor descriptors) were 0-7%
#   slower except 128x128 at S16384 (+2%): off.
# - dkdv: 64 queries x 128 keys, 8 warps, 3 stages at D128 (326 vs 286 TFLOP/s for 32x128;
#   64x64/4 warps was as fast but spilled); 32x64/4 warps at D64.
# - dq: 128 queries x 64 keys, 8 warps at D128 (309 vs 286 for 128x32); 64x32/4 warps at
#   D64 (ties the best at 96 registers).
# Ampere (sm_80, no device here): the Hopper tiles where they compile clean, smaller ones
# where mma.sync's register operands made them spill. CDNA (gfx90a/gfx942/gfx950, no device
# here): untuned, sized for 64 KiB of LDS and single-stage as the AMD backend prefers.
_C = AttnConfig
_TABLE: dict[tuple[str, str], dict[int, tuple[AttnConfig, AttnConfig]]] = {
    ("hopper", "fwd"): {64: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)), 128: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)),
                        256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("hopper", "dkdv"): {64: (_C(32, 64, 4, 3), _C(32, 32, 8, 2)), 128: (_C(64, 128, 8, 3), _C(32, 32, 8, 2)),
                         256: (_C(32, 32, 8, 2), _C(16, 32, 8, 1))},
    ("hopper", "dq"): {64: (_C(64, 32, 4, 3), _C(64, 32, 8, 3)), 128: (_C(128, 64, 8, 3), _C(64, 32, 4, 3)),
                       256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("ampere", "fwd"): {64: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)), 128: (_C(64, 64, 4, 3), _C(64, 64, 4, 3)),
                        256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("ampere", "dkdv"): {64: (_C(32, 32, 4, 3), _C(32, 32, 8, 2)), 128: (_C(32, 64, 8, 3), _C(32, 32, 8, 2)),
                         256: (_C(32, 32, 8, 2), _C(16, 32, 8, 1))},
    ("ampere", "dq"): {64: (_C(64, 32, 8, 3), _C(64, 32, 8, 3)), 128: (_C(64, 32, 4, 3), _C(64, 32, 4, 3)),
                       256: (_C(64, 32, 8, 2), _C(64, 32, 8, 2))},
    ("cdna", "fwd"): {64: (_C(64, 64, 4, 1), _C(64, 64, 4, 1)), 128: (_C(64, 64, 4, 1), _C(64, 32, 4, 1)),
                      256: (_C(32, 32, 4, 1), _C(32, 32, 4, 1))},
    ("cdna", "dkdv"): {64: (_C(32, 64, 4, 1), _C(16, 32, 4, 1)), 128: (_C(32, 64, 4, 1), _C(16, 32, 4, 1)),
                       256: (_C(16, 32, 4, 1), _C(16, 16, 4, 1))},
    ("cdna", "dq"): {64: (_C(64, 32, 4, 1), _C(32, 32, 4, 1)), 128: (_C(64, 32, 4, 1), _C(32, 32, 4, 1)),
                     256: (_C(32, 16, 4, 1), _C(16, 16, 4, 1))},
}  # fmt: skip
# The interpreter runs programs one after another on numpy: small tiles keep it quick.
_INTERPRETER = AttnConfig(16, 16, 4, 1)


def arch_family(arch: str) -> str:
    """ "hopper" (sm_90 and newer), "ampere" (older sm_), "cdna" (gfx), else "interpreter"."""
    if arch.startswith("sm_"):
        return "hopper" if int(arch[3:].rstrip("a")) >= 90 else "ampere"
    if arch.startswith("gfx"):
        return "cdna"
    return "interpreter"


def launch_config(
    head_dim: int, dtype: torch.dtype, arch: str, direction: str, general: bool = False
) -> AttnConfig:
    """The config the launchers use for `direction` ("fwd", "dkdv", "dq") on `arch`
    ("sm_90", "gfx942", ...; a CPU arch means the Triton interpreter); general: the call is
    off the fast path (see _TABLE)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    family = arch_family(arch)
    if family == "interpreter":
        return _INTERPRETER
    by_dim = _TABLE[family, direction]
    return by_dim[min(d for d in by_dim if d >= head_dim)][int(general)]


def all_configs(arch: str) -> list[tuple[int, str, bool, AttnConfig]]:
    """(head_dim, direction, general, config) for every tuned head_dim, and 200 for the padded
    ones (any multiple of 8 runs the config of the next tuned one): what the compile-only
    checks build."""
    dims = (32, 64, 96, 128, 192, 200, 256)
    return [
        (d, direction, general, launch_config(d, torch.bfloat16, arch, direction, general))
        for d in dims
        for direction in DIRECTIONS
        for general in (False, True)
    ]


# ---- attention against a KV cache (kvcache_kernels.py) -----------------------------------
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
# Hopper, measured on H200 (benchmarks/tune_kvcache.py, GQA 32/8 D128): 16-bit decode led
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


# ---- rotary position embedding (rotary_kernels.py) -----------------------------------------
# Memory-bound: a program rotates every q and k head of block_t tokens, one (block_t,
# block_h, width) tile per step of its head loops, width = the padded head_dim (two rotated
# halves plus the copied rest). A tile of ROTARY_TILE elements is 32 values per thread at 128
# threads (16-byte vectors of bf16 for x1, x2 and the rest). The four (block_t, R / 2) float32
# cos/sin tiles, loaded once per program and live through both head loops, are kept to
# ROTARY_TABLE_TILE elements each (16 values per thread): with 16 tokens of D256 they took 64
# and put the kernel at 119-125 registers on sm_90 and gfx942, 222 VGPRs in float32 at D512.
# Not tuned on a GPU yet (none here): sized so every config compiles without spills on sm_80,
# sm_90, gfx90a, gfx942, gfx950 (tests/aot_rotary_cases.py).
ROTARY_TILE = 4096
ROTARY_TABLE_TILE = 512
ROTARY_MAX_BLOCK_T = 16


@dataclass(frozen=True)
class RotaryConfig:
    """block_t: tokens per program; block_hq / block_hk: q / k heads per step of the head
    loops (a power of two up to the head count, so small GQA groups waste no lanes)."""

    block_t: int
    block_hq: int
    block_hk: int
    num_warps: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rotary_blocks(head_dim: int, rot_dim: int) -> tuple[int, int]:
    """(BLOCK_HALF, BLOCK_PASS): the rotated half R / 2 and the copied rest D - R padded to
    powers of two (BLOCK_PASS 0 when R = D)."""
    rest = head_dim - rot_dim
    return _pow2_at_least(rot_dim // 2), _pow2_at_least(rest) if rest else 0


def rotary_config(head_dim: int, rot_dim: int, heads_q: int, heads_k: int, arch: str) -> RotaryConfig:
    """Launch config of `_apply_rotary_kernel` (forward and backward alike) for heads of
    head_dim elements of which rot_dim rotate, on `arch` ("sm_90", "gfx942", ...; a CPU arch
    means the interpreter). The q heads fill the tile first (block_t tokens of block_hq
    heads); the k loop takes as many heads as fit in the same tile."""
    family = arch_family(arch)
    if family == "interpreter":
        # Small tiles: the interpreter's tests then step through several tokens per program,
        # ragged token blocks and head loops of more than one step.
        return RotaryConfig(4, min(2, _pow2_at_least(heads_q)), min(2, _pow2_at_least(heads_k)), 4)
    half, rest = rotary_blocks(head_dim, rot_dim)
    width = 2 * half + rest
    per_tile = 1 << max(0, (ROTARY_TILE // width).bit_length() - 1)  # token-heads per tile
    block_hq = min(_pow2_at_least(heads_q), per_tile)
    block_t = max(1, min(ROTARY_MAX_BLOCK_T, per_tile // block_hq, ROTARY_TABLE_TILE // half))
    block_hk = min(_pow2_at_least(heads_k), per_tile // block_t)
    # Same 128 threads on both vendors: AMD wavefronts are 64 wide.
    return RotaryConfig(block_t, block_hq, block_hk, 2 if family == "cdna" else 4)


# (heads_q, heads_k) of the compile-only checks: MHA, GQA and MQA from 1 to 128 heads, which
# between them reach the largest token block (one head: the widest cos/sin tiles), the
# largest head blocks and the mixed ones.
ROTARY_AOT_HEADS = ((1, 1), (3, 1), (8, 8), (32, 8), (64, 8), (128, 128))
# (head_dim, rot_dim): full rotary at every tile width up to 512 (ops.ROTARY_MAX_HEAD_DIM), half rotary
# (a copied rest), Phi-2's 32 of 80 and GPT-NeoX-20B's 24 of 96 (padded halves and rest).
ROTARY_AOT_DIMS = ((64, 64), (64, 32), (80, 32), (96, 96), (96, 24), (128, 128), (128, 64), (256, 256),
                   (256, 128), (512, 512), (512, 2))  # fmt: skip


def all_rotary_configs(arch: str) -> list[tuple[int, int, RotaryConfig]]:
    """(head_dim, rot_dim, config) for ROTARY_AOT_DIMS x ROTARY_AOT_HEADS: the distinct
    configs the launcher picks there, for the compile-only checks."""
    out = {}
    for head_dim, rot_dim in ROTARY_AOT_DIMS:
        for heads_q, heads_k in ROTARY_AOT_HEADS:
            cfg = rotary_config(head_dim, rot_dim, heads_q, heads_k, arch)
            out[head_dim, rot_dim, cfg] = (head_dim, rot_dim, cfg)
    return list(out.values())
