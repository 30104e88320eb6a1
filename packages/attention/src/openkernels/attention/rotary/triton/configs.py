"""Launch configs of the rotary kernel (kernels.py): one pure function of the head sizes and
the arch, shared by the launcher, the JAX launch and the compile-only checks.

Memory-bound: a program rotates every q and k head of block_t tokens, one (block_t,
block_h, width) tile per step of its head loops, width = the padded head_dim (two rotated
halves plus the copied rest). A tile of ROTARY_TILE elements is 32 values per thread at 128
threads (16-byte vectors of bf16 for x1, x2 and the rest). The four (block_t, R / 2) float32
cos/sin tiles, loaded once per program and live through both head loops, are kept to
ROTARY_TABLE_TILE elements each (16 values per thread): with 16 tokens of D256 they took 64
and put the kernel at 119-125 registers on sm_90 and gfx942, 222 VGPRs in float32 at D512.
Not tuned on a GPU yet (none here): sized so every config compiles without spills on sm_80,
sm_90, gfx90a, gfx942, gfx950 (tests/aot_rotary_cases.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.triton.configs import arch_family

__all__ = ["RotaryConfig", "rotary_blocks", "rotary_config", "all_rotary_configs", "ROTARY_AOT_DIMS",
           "ROTARY_AOT_HEADS"]  # fmt: skip

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
