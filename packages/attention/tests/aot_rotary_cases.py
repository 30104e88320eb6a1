"""Ahead-of-time compile cases of the rotary kernel (rotary/triton/kernels.py), checked by test_aot.py
for sm_80, sm_90, gfx90a, gfx942, gfx950: every config `rotary_config` picks over
configs.ROTARY_AOT_DIMS x ROTARY_AOT_HEADS, forward in bf16 with bf16 tables (what
transformers passes); per head_dim the backward, and fp16 / fp32 inputs with float32 tables
on its largest tile (registers depend on the tile shapes, the flag and the dtypes only)."""

from __future__ import annotations

from openkernels.attention.rotary.triton import configs

_KERNEL = "openkernels.attention.rotary.triton.kernels:_apply_rotary_kernel"
_ACT = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
_STRIDES = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_cb",
            "stride_cs", "stride_sb", "stride_ss")  # fmt: skip


def _case(head_dim: int, rot_dim: int, cfg: configs.RotaryConfig, dtype: str, table: str, backward: bool):
    from openkernels.shared.dev.testing.aot import AotCase

    act, trig = _ACT[dtype], _ACT[table]
    signature = {"q_ptr": act, "k_ptr": act, "cos_ptr": trig, "sin_ptr": trig, "qo_ptr": act, "ko_ptr": act,
                 **dict.fromkeys(_STRIDES, "i32"), "tokens": "i32", "seqlen": "i32", "heads_q": "i32",
                 "heads_k": "i32"}  # fmt: skip
    # The common input, q and k views of a projection output (B, S, H * D): token and head
    # strides are multiples of 16 for every head_dim here (Triton specializes on that);
    # table rows of R elements are not always (R = 2, 24).
    attrs = {name: "D" for name in _STRIDES if name[-2] in "qk"}
    half, rest = configs.rotary_blocks(head_dim, rot_dim)
    constexprs = {"HEAD_DIM": head_dim, "ROT_HALF": rot_dim // 2, "BLOCK_T": cfg.block_t, "BLOCK_HQ": cfg.block_hq,
                  "BLOCK_HK": cfg.block_hk, "BLOCK_HALF": half, "BLOCK_PASS": rest, "BACKWARD": backward}  # fmt: skip
    label = (f"rotary-d{head_dim}-r{rot_dim}-{dtype}-{table}-t{cfg.block_t}q{cfg.block_hq}k{cfg.block_hk}"
             f"w{cfg.num_warps}{'-bwd' if backward else ''}")  # fmt: skip
    return AotCase(_KERNEL, signature, constexprs, num_warps=cfg.num_warps, label=label, attrs=attrs)


def _tile(cfg: configs.RotaryConfig) -> int:
    return cfg.block_t * max(cfg.block_hq, cfg.block_hk)


def cases_for(arch: str) -> list:
    out = []
    largest: dict[tuple[int, int], configs.RotaryConfig] = {}
    for head_dim, rot_dim, cfg in configs.all_rotary_configs(arch):
        out.append(_case(head_dim, rot_dim, cfg, "bf16", "bf16", False))
        largest[head_dim, rot_dim] = max(largest.get((head_dim, rot_dim), cfg), cfg, key=_tile)
    for (head_dim, rot_dim), cfg in largest.items():
        if rot_dim == head_dim or head_dim == 80:
            out.append(_case(head_dim, rot_dim, cfg, "bf16", "bf16", True))
        if head_dim in (128, configs.ROTARY_AOT_DIMS[-1][0]) and rot_dim == head_dim:
            out.append(_case(head_dim, rot_dim, cfg, "fp16", "fp32", False))
            out.append(_case(head_dim, rot_dim, cfg, "fp32", "fp32", True))
    return list({c.label: c for c in out}.values())
