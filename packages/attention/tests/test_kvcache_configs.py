"""Launch-config choices of the KV-cache decode kernel (no GPU needed: pure functions)."""

from __future__ import annotations

import pytest

from openkernels.attention.kvcache.triton import plan
from openkernels.attention.kvcache.triton.configs import kv_config, kv_splits, lean_decode, lean_pays


@pytest.mark.parametrize(
    ("bits", "group", "fp8", "key_group", "rotary", "extras", "lean"),
    [
        (8, 128, True, 0, False, True, True),  # fp8 takes every extra
        (4, 128, False, 0, False, True, True),  # int4 per token too
        (8, 128, False, 0, False, False, True),  # int8 per token, plain
        (8, 128, False, 0, False, True, False),  # int8 with ALiBi / softcap / left window
        (4, 32, False, 0, False, False, False),  # groups along head_dim
        (4, 128, False, 32, False, False, False),  # keys by channel
        (8, 128, True, 0, True, False, False),  # in-kernel rotary
        (16, 128, False, 0, False, False, False),  # a 16-bit cache
    ],
)
def test_lean_decode(bits, group, fp8, key_group, rotary, extras, lean):
    assert lean_decode(bits, group, 128, fp8, key_group, rotary, extras) is lean


def test_lean_config_only_where_the_arch_has_one():
    lean = kv_config(128, 8, 4, "sm_90", fp8=True, lean=True)
    assert (lean.block_n, lean.num_warps) == (32, 1)
    assert kv_config(128, 8, 4, "sm_80", lean=True) == kv_config(128, 8, 4, "sm_80")
    assert kv_config(128, 8, 64, "sm_90", lean=True) == kv_config(128, 8, 64, "sm_90")  # chunked prefill
    assert kv_config(256, 8, 4, "sm_90", lean=True) == kv_config(256, 8, 4, "sm_90")  # D256


@pytest.mark.parametrize(
    ("programs", "key_blocks", "warps", "splits"),
    [
        (64, 1024, 1, 32),  # B8 S32768 on 132 SMs: 32 key blocks per split
        (256, 128, 1, 4),  # B32 S4096: at least 32 key blocks per split
        (8, 4096, 1, 128),  # B1 S131072: the cap
        (256, 64, 4, 2),  # 4-warp programs: two per SM
        (8, 128, 1, 17),  # B1 S4096: every SM gets a program before the 32-block minimum applies
        (128, 136, 1, 4),  # Llama 1B at B16, 4352 tokens: 512 programs
        (4, 3, 1, 1),  # a short cache is not split
    ],
)
def test_kv_splits(programs, key_blocks, warps, splits):
    assert kv_splits(programs, key_blocks, 132, warps) == splits


def test_kv_splits_one_warp_at_head_dim_64():
    # Llama 1B at B16, 4352 tokens (head_dim 64): splits of 16 blocks, 1024 programs
    assert kv_splits(128, 136, 132, 1, head_dim=64) == 8
    assert kv_splits(128, 136, 132, 4, head_dim=64) == kv_splits(128, 136, 132, 4)  # 4 warps: unchanged
    assert lean_pays(128, 136, 132, head_dim=64)


def test_kv_splits_min_blocks_override():
    assert kv_splits(8, 64, 132, 4) == 16  # B1 S4096 in 64-key blocks: the rule keeps 4 per split
    assert kv_splits(8, 64, 132, 4, min_blocks=2) == 32


@pytest.mark.parametrize(
    ("programs", "key_blocks", "pays"),
    [
        (8, 128, False),  # B1 S4096: 17 splits of 7-8 blocks (measured slower than 4 warps)
        (256, 128, True),  # B32 S4096: 4 splits of 32 blocks
        (64, 1024, True),  # B8 S32768: 32 splits of 32 blocks
        (8, 4096, True),  # B1 S131072: 128 splits of 32 blocks
    ],
)
def test_lean_pays_only_with_long_splits(programs, key_blocks, pays):
    assert lean_pays(programs, key_blocks, 132) is pays


def _decode_plan(batch: int, tokens: int, bits: int = 8, fp8: bool = False) -> plan.KVLaunches:
    p = plan.KVProblem(
        batch, 1, 32, 8, 128, bits, 128, 0, tokens, 128**-0.5, -1, 0, False, 0.0, 0, 0, False, fp8=fp8
    )
    q = plan.contiguous((batch, 1, 32, 128), False)
    side = plan.contiguous((batch, tokens, 8, 128), False)
    scales = (tokens * 8, 8, 1) if not fp8 else (0, 0, 0)
    return plan.kvcache(p, "sm_90", 132, (q, side, side, scales), q, (32, 1, 1), (0, 0), True)


@pytest.mark.parametrize(("bits", "fp8"), [(8, False), (4, False), (8, True)])
def test_short_quantized_decode_takes_the_four_warp_tile(bits, fp8):
    short = _decode_plan(1, 4096, bits, fp8)
    assert (short.main.num_warps, short.main.config.block_n, short.splits) == (4, 64, 32)
    long = _decode_plan(8, 32768, bits, fp8)
    assert (long.main.num_warps, long.main.config.block_n, long.splits) == (1, 32, 32)
