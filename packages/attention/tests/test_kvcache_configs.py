"""Launch-config choices of the KV-cache decode kernel (no GPU needed: pure functions)."""

from __future__ import annotations

import pytest

from openkernels.attention.triton.configs import kv_config, kv_splits, lean_decode


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
