"""Ahead-of-time compile checks of the attention kernels for every launch config they can
pick, for sm_80, sm_90 (CUDA configs) and gfx90a, gfx942, gfx950 (ROCm configs): compiles,
no register spills, no scratch, shared memory within the chip's limit. The KV-cache
kernels' cases come from aot_kvcache_cases.py, the rotary kernel's from aot_rotary_cases.py,
the kernels as JAX compiles them (every integer a constant) from aot_jax_cases.py, the
Gluon Hopper forward's (sm_90 only) from aot_gluon_cases.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openkernels.attention.core.triton import configs, plan
from openkernels.shared.platform import triton_interpreting

from .aot_gluon_cases import cases_for as gluon_cases_for
from .aot_jax_cases import cases_for as jax_cases_for
from .aot_kvcache_cases import cases_for as kvcache_cases_for
from .aot_rotary_cases import cases_for as rotary_cases_for

pytestmark = pytest.mark.aot

_KERNELS = "openkernels.attention.core.triton.kernels"
_ACT = {"bf16": "*bf16", "fp16": "*fp16"}
_FLAGS = ("IS_VARLEN", "HAS_WINDOW_LEFT", "HAS_WINDOW_RIGHT", "HAS_ALIBI", "HAS_SOFTCAP", "HAS_DROPOUT")
_NONE = dict.fromkeys(_FLAGS, False)
_ALL = dict.fromkeys(_FLAGS, True)
_CAUSAL = _NONE | {"HAS_WINDOW_RIGHT": True}
_WINDOWS = _NONE | {"IS_VARLEN": True, "HAS_WINDOW_LEFT": True, "HAS_WINDOW_RIGHT": True}
_OPTIONS = _ALL | {"IS_VARLEN": False}  # every option the fast configs serve
# The same with ALiBi's split bias (plan.alibi_flag 2: causal, here with a left window too).
_OPTIONS_CAUSAL_ALIBI = _OPTIONS | {"HAS_ALIBI": 2}


def _for_arch(flags: dict, arch: str) -> dict:
    """flags with HAS_SOFTCAP as the launchers set it on `arch` (NVIDIA: the tanh instruction)."""
    return flags | {"HAS_SOFTCAP": plan.softcap_flag(1.0 if flags["HAS_SOFTCAP"] else 0.0, arch)}


def _strides(*names: str) -> dict[str, str]:
    return {f"stride_{n}{axis}": "i32" for n in names for axis in "bsh"}


def _signature(direction: str, act: str) -> dict[str, str]:
    lse = {"stride_lb": "i32", "stride_lh": "i32"}
    sizes = {"seqlen_q": "i32", "seqlen_k": "i32", "heads_q": "i32", "group": "i32"}
    window = {"window_left": "i32", "window_right": "i32"}
    dropout = {"drop_below": "i32", "drop_scale": "fp32"}
    if direction == "fwd":
        ptrs = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "cu_q_ptr": "*i32", "cu_k_ptr": "*i32",
                "slopes_ptr": "*fp32", "seed_ptr": "*i32", "o_ptr": act, "lse_ptr": "*fp32"}  # fmt: skip
        return {**ptrs, **_strides("q", "k", "v", "o"), **lse, **sizes,
                "qk_scale": "fp32", "cap_scale": "fp32", "cap_out": "fp32", **window, **dropout}  # fmt: skip
    ptrs = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "do_ptr": act, "lse_ptr": "*fp32", "delta_ptr": "*fp32",
            "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "slopes_ptr": "*fp32", "seed_ptr": "*i32"}  # fmt: skip
    grads = ("dk", "dv") if direction == "dkdv" else ("dq",)
    ptrs |= {f"{g}_ptr": act for g in grads}
    scales = {"qk_scale": "fp32", "sm_scale": "fp32", "cap_scale": "fp32", "cap_out": "fp32"}
    return {**ptrs, **_strides("q", "k", "v", "do", *grads), **lse, **sizes, **scales, **window, **dropout}


def _case(direction: str, head_dim: int, cfg: configs.AttnConfig, dtype: str, flags: dict, *,
          aligned_seqlens: bool = False):  # fmt: skip
    from openkernels.shared.dev.testing.aot import AotCase

    kernel = {"fwd": "_attn_fwd_kernel", "dkdv": "_attn_bwd_dkdv_kernel", "dq": "_attn_bwd_dq_kernel"}[
        direction
    ]
    signature = _signature(direction, _ACT[dtype])
    # Sequence and head strides are multiples of 16 for every supported head_dim (Triton
    # specializes on that at launch); the lse strides are sequence lengths (any value).
    attrs = {name: "D" for name in signature if name.startswith("stride_") and name[-2] != "l"}
    if aligned_seqlens:  # the fast path's launches: Triton specializes on lengths % 16 == 0
        attrs |= {"seqlen_q": "D", "seqlen_k": "D"}
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": configs.block_d(head_dim), "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, **flags}  # fmt: skip
    # A flag's initial, with its value where it is a mode (HAS_ALIBI 2, HAS_SOFTCAP 2), not on/off.
    flag_text = (
        "".join(
            name.split("_")[-1][0] + ("" if isinstance(on, bool) or on == 1 else str(on))
            for name, on in flags.items()
            if on
        )
        or "plain"
    )
    label = (
        f"{direction}-d{head_dim}-{dtype}-m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}-{flag_text}"
        f"{'-aligned' if aligned_seqlens else ''}"
    )
    return AotCase(f"{_KERNELS}:{kernel}", signature, constexprs, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, label=label, attrs=attrs)  # fmt: skip


def _preprocess_case(head_dim: int):
    from openkernels.shared.dev.testing.aot import AotCase

    signature = {"o_ptr": "*bf16", "do_ptr": "*bf16", "cu_q_ptr": "*i32", "delta_ptr": "*fp32",
                 **_strides("o", "do"), "stride_lb": "i32", "stride_lh": "i32", "seqlen_q": "i32",
                 "heads_q": "i32"}  # fmt: skip
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": configs.block_d(head_dim),
                  "BLOCK_M": configs.preprocess_block_m(head_dim), "IS_VARLEN": True}  # fmt: skip
    return AotCase(f"{_KERNELS}:_attn_bwd_preprocess_kernel", signature, constexprs, num_warps=4,
                   label=f"preprocess-d{head_dim}")  # fmt: skip


def _group_sum_case(head_dim: int, group: int):
    from openkernels.shared.dev.testing.aot import AotCase

    signature = {"part_ptr": "*fp32", "grad_ptr": "*bf16", "stride_gb": "i64", "stride_gs": "i32", "stride_gh": "i32",
                 "seqlen": "i32", "heads_kv": "i32"}  # fmt: skip
    block_d = configs.block_d(head_dim)
    constexprs = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_D": block_d,
                  "BLOCK_R": configs.group_sum_block_rows(block_d)}  # fmt: skip
    return AotCase(f"{_KERNELS}:_attn_bwd_group_sum_kernel", signature, constexprs, num_warps=4,
                   label=f"group-sum-d{head_dim}-g{group}")  # fmt: skip


def cases_for(arch: str) -> list:
    """Every config `launch_config` picks, with the heaviest variant it serves. Fast configs
    (dense, 16-aligned sequence lengths and strides): causal, which compiles every segment
    loop the plain call has plus its mask, and every option but varlen (or their override for
    options, configs._OPTIONS_TABLE). General configs: varlen with two-sided windows, and
    every flag on (neither register count bounds the other).
    Head dims 64, 128, 256 (the widest of each BLOCK_D); 32, 96, 192 (the same tiles,
    masked head_dim padding) with every flag on. One fp16 forward, the preprocess kernel,
    GQA's dK/dV group sum. Marked `variant` (compiled for each vendor's reference target):
    the flags alone beside an options override, the padded head dims, the fp16 forward.
    Each compile takes 2-15 s on one CI core, so the grid is what bounds the registers."""
    out = {}
    for head_dim, direction, general, cfg in configs.all_configs(arch):
        # (dtype, flags, aligned, variant): variants compile for each vendor's reference
        # target (aot.REFERENCE_TARGETS), the rest for all five.
        if not general:
            variants = [("bf16", _CAUSAL, True, False)] if head_dim in (64, 128, 256) else []
            if (
                variants
                and configs.launch_config(head_dim, torch.bfloat16, arch, direction, False, True) == cfg
            ):
                # no override for options: they run it too
                variants += [("bf16", _OPTIONS, True, False), ("bf16", _OPTIONS_CAUSAL_ALIBI, True, False)]
            elif variants:  # an override for options: ALiBi alone and a softcap alone still run this config
                variants += [
                    ("bf16", _CAUSAL | {"HAS_ALIBI": 2}, True, True),
                    ("bf16", _NONE | {"HAS_ALIBI": True}, True, True),
                    ("bf16", _CAUSAL | {"HAS_SOFTCAP": True}, True, True),
                    ("bf16", _NONE | {"HAS_SOFTCAP": True}, True, True),
                    # problem.FULL_DROPOUT_ON_PLAIN_CONFIGS
                    ("bf16", _NONE | {"HAS_DROPOUT": True}, True, True),
                ]
        elif head_dim in (64, 128, 256):
            variants = [("bf16", _WINDOWS, False, False), ("bf16", _ALL, False, False)]
        else:  # the same tiles as the next wider head, its padding masked
            variants = [("bf16", _ALL, False, True)]
        if general and head_dim == 128 and direction == "fwd":
            variants.append(("fp16", _ALL, False, True))
        for dtype, flags, aligned, variant in variants:
            c = _case(direction, head_dim, cfg, dtype, _for_arch(flags, arch), aligned_seqlens=aligned)
            out[c.label] = dataclasses.replace(c, variant=variant)
    for head_dim, direction, cfg in configs.options_configs(arch):
        for flags in (_OPTIONS, _OPTIONS_CAUSAL_ALIBI):
            c = _case(direction, head_dim, cfg, "bf16", _for_arch(flags, arch), aligned_seqlens=True)
            out[c.label] = c
    for head_dim in (32, 64, 96, 128, 192, 256):
        c = _preprocess_case(head_dim)
        out[c.label] = c
    for head_dim, group in ((64, 4), (128, 8), (256, 2)):
        c = _group_sum_case(head_dim, group)
        out[c.label] = c
    return list(out.values())


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942", "gfx950"])
def test_kernels_compile_clean_for_every_config(target: str) -> None:
    if triton_interpreting():
        pytest.skip("compile-only checks need TRITON_INTERPRET unset")
    from openkernels.shared.dev.testing.aot import (
        assert_clean,
        check_cases,
        format_reports,
        job_list,
        targets_from_env,
    )

    if target not in targets_from_env():
        pytest.skip(f"{target} is not in OPENKERNELS_AOT_TARGETS")
    cases = cases_for(target) + kvcache_cases_for(target) + rotary_cases_for(target) + jax_cases_for(target)
    cases += gluon_cases_for(target)
    reports = check_cases(cases, [target])
    print(format_reports(reports))
    assert_clean(reports)
    assert len(reports) == len(job_list(cases, [target]))
