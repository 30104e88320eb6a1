"""Ahead-of-time compile cases of the KV-cache kernels (kvcache/triton/kernels.py), checked by
test_aot.py for sm_80, sm_90, gfx90a, gfx942, gfx950: every config `kv_config` picks
(decode and chunked prefill) at its heaviest variant, for each cache format."""

from __future__ import annotations

import dataclasses
import inspect

from openkernels.attention.core.triton.plan import softcap_flag
from openkernels.attention.kvcache.triton import configs
from openkernels.attention.kvcache.triton.configs import kv_append_keys_warps

_KERNELS = "openkernels.attention.kvcache.triton.kernels"
_FLOATS = ("qk_scale", "cap_scale", "cap_out")
# (bits, group): 16-bit, then int8 and int4 with one group per head and with groups of 32
# (the gathered scale tile is the register-heavy case); fp8 (bits 8 with FP8) apart below.
_FORMATS = ((16, None), (8, None), (8, 32), (4, None), (4, 32))
_ALL_FLAGS = dict(PAGE_SIZE=16, HAS_ROTARY=True, INTERLEAVED=False, HAS_WINDOW_LEFT=True, HAS_WINDOW_RIGHT=True,
                  HAS_ALIBI=True, HAS_SOFTCAP=True)  # fmt: skip
# cache_leftpad comes with contiguous caches only (rows maybe picked by cache_batch_idx: a
# one-column table read with one scalar load): lighter on registers than the per-key page
# lookups above, checked on the formats that need the most.
_LEFTPAD_FLAGS = _ALL_FLAGS | dict(PAGE_SIZE=0, HAS_LEFTPAD=True, ROW_TABLE=True)


def _signature(kernel_name: str, pointers: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Types of the runtime arguments (pointers as given, floats fp32, ints i32) and the
    "D" (multiple of 16) attribute for the 16-byte-aligned row strides the launchers pass."""
    import importlib

    kernel = getattr(importlib.import_module(_KERNELS), kernel_name)
    names = [
        n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" not in str(p.annotation)
    ]
    signature, attrs = {}, {}
    for n in names:
        if n.endswith("_ptr"):
            signature[n] = pointers.get(n, "*fp32")
        elif n in _FLOATS:
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
            # Row strides of q, K/V data, outputs and new tokens are multiples of 16 for every
            # supported head_dim (int4 rows are head_dim / 2 bytes); scale rows are not.
            if n.startswith("stride_") and n[-1] in "bsh" and n[7] in "qkvo" and n != "stride_sh":
                attrs[n] = "D"
    return signature, attrs


def _attn_case(head_dim: int, rows: int, bits: int, group: int | None, arch: str, split: bool,
               plain: bool = False, leftpad: bool = False, fp8: bool = False, key_group: int = 0,
               lean: bool = False, fused: bool = False):  # fmt: skip
    """plain: what a decode step on a contiguous cache launches (causal only): no block
    table, rotary tables or slopes (None pointers are constants to Triton), no scales for a
    16-bit cache. fp8: e4m3 bytes with float32 per-head scales, converted in hardware on
    sm_90 and with bit operations elsewhere (as the launcher picks). key_group: keys by channel
    (their key blocks are the groups), with the residual's pointer. fused: a static cache's
    decode step (16-bit): the append of the new tokens in the kernel, with per-token rotary
    tables and left padding on a contiguous cache."""
    from openkernels.shared.dev.testing.aot import AotCase

    cfg = configs.kv_config(head_dim, bits, rows, arch, fp8, lean)
    if key_group and key_group % cfg.block_n:  # as the plan: a key block lies in one group
        cfg = dataclasses.replace(cfg, block_n=key_group)
    data = "*bf16" if bits == 16 else "*u8"
    scales = "*fp32" if fp8 else "*fp16"
    pointers = {"q_ptr": "*bf16", "k_ptr": data, "v_ptr": data, "k_scale_ptr": scales, "k_zero_ptr": "*fp16",
                "v_scale_ptr": scales, "v_zero_ptr": "*fp16", "o_ptr": "*fp32" if split else "*bf16",
                "seqlens_ptr": "*i32", "block_table_ptr": "*i32", "leftpad_ptr": "*i32", "res_ptr": "*fp16",
                "kn_ptr": "*bf16", "vn_ptr": "*bf16", "cos_ptr": "*bf16" if fused else "*fp32",
                "sin_ptr": "*bf16" if fused else "*fp32"}  # fmt: skip
    signature, attrs = _signature("_attention_kvcache_fwd_kernel", pointers)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": configs.block_d(head_dim), "BLOCK_M": cfg.block_m,
                  "BLOCK_N": cfg.block_n, "BITS": bits, "GROUP": group or head_dim,
                  **(_LEFTPAD_FLAGS if leftpad else _ALL_FLAGS), "FAST_DEQUANT": arch.startswith("sm_"),
                  "HAS_SOFTCAP": softcap_flag(1.0, arch),
                  "FP8": fp8, "FP8_NATIVE": fp8 and arch == "sm_90", "KEY_GROUP": key_group}  # fmt: skip
    if key_group:  # pages hold whole groups (the API's rule)
        constexprs["PAGE_SIZE"] = 64
    else:  # the launcher passes None: no residual
        del signature["res_ptr"]
        constexprs["res_ptr"] = None
    if fp8:  # no zero
        for name in ("k_zero_ptr", "v_zero_ptr"):
            del signature[name]
            constexprs[name] = None
    if lean:  # no in-kernel rotary; int8 also without ALiBi, softcap and a left window
        extras = bits == 8 and not fp8
        assert configs.lean_decode(bits, group or head_dim, head_dim, fp8, key_group, False, False)
        constexprs |= dict(HAS_ROTARY=False)
        constexprs["cos_ptr"] = constexprs["sin_ptr"] = None
        signature.pop("cos_ptr"), signature.pop("sin_ptr")
        if extras:
            constexprs |= dict(HAS_ALIBI=False, HAS_SOFTCAP=False, HAS_WINDOW_LEFT=False, slopes_ptr=None)
            signature.pop("slopes_ptr")
    if plain:
        nones = ["block_table_ptr", "cos_ptr", "sin_ptr", "slopes_ptr", "leftpad_ptr"]
        if bits == 16:
            nones += ["k_scale_ptr", "k_zero_ptr", "v_scale_ptr", "v_zero_ptr"]
        for name in nones:
            if name not in signature:
                continue
            del signature[name]
            constexprs[name] = None
        constexprs |= dict(
            PAGE_SIZE=0,
            HAS_ROTARY=False,
            HAS_WINDOW_LEFT=False,
            HAS_ALIBI=False,
            HAS_SOFTCAP=False,
            HAS_LEFTPAD=False,
        )
    if fused:
        assert bits == 16
        for name in ("k_scale_ptr", "k_zero_ptr", "v_scale_ptr", "v_zero_ptr"):
            del signature[name]
            constexprs[name] = None
        constexprs |= dict(PAGE_SIZE=0, HAS_ROTARY=False, HAS_LEFTPAD=True, ROW_TABLE=True, FUSED_APPEND=True,
                           ROT_TOKENS=True)  # fmt: skip
    label = (f"attn-d{head_dim}-{bits}b-g{group or 'head'}-m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}"
             f"s{cfg.num_stages}{'-split' if split else ''}{'-plain' if plain else ''}"
             f"{'-leftpad' if leftpad else ''}{'-lean' if lean else ''}{'-fused-append' if fused else ''}")  # fmt: skip
    if fp8:
        label = label.replace(f"-{bits}b-", "-fp8-")
    if key_group:
        label += f"-keys-by-channel{key_group}"
    return AotCase(f"{_KERNELS}:_attention_kvcache_fwd_kernel", signature, constexprs, num_warps=cfg.num_warps,
                   num_stages=cfg.num_stages, label=label, attrs=attrs)  # fmt: skip


def _append_case(head_dim: int, bits: int, group: int | None, leftpad: bool = False, fp8: bool = False):
    from openkernels.shared.dev.testing.aot import AotCase

    data = "*bf16" if bits == 16 else "*u8"
    scales = "*fp32" if fp8 else "*fp16"
    pointers = {"k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "k_ptr": data, "v_ptr": data, "k_scale_ptr": scales,
                "k_zero_ptr": "*fp16", "v_scale_ptr": scales, "v_zero_ptr": "*fp16", "seqlens_ptr": "*i32",
                "block_table_ptr": "*i32", "leftpad_ptr": "*i32"}  # fmt: skip
    signature, attrs = _signature("_kvcache_append_fwd_kernel", pointers)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": configs.block_d(head_dim),
                  "BLOCK_T": configs.kv_append_block_t(head_dim), "BITS": bits, "GROUP": group or head_dim,
                  "PAGE_SIZE": 16, "HAS_ROTARY": True, "INTERLEAVED": False}  # fmt: skip
    if leftpad:
        constexprs |= dict(PAGE_SIZE=0, HAS_LEFTPAD=True, ROW_TABLE=True)
    if fp8:
        constexprs["FP8"] = True
        for name in ("k_zero_ptr", "v_zero_ptr"):
            del signature[name]
            constexprs[name] = None
    label = (
        f"append-d{head_dim}-{'fp8' if fp8 else f'{bits}b'}-g{group or 'head'}{'-leftpad' if leftpad else ''}"
    )
    return AotCase(f"{_KERNELS}:_kvcache_append_fwd_kernel", signature, constexprs, num_warps=4, label=label,
                   attrs=attrs)  # fmt: skip


def _append_keys_case(head_dim: int, bits: int, key_group: int):
    from openkernels.shared.dev.testing.aot import AotCase

    pointers = {"k_new_ptr": "*bf16", "k_ptr": "*u8", "k_scale_ptr": "*fp16", "k_zero_ptr": "*fp16", "res_ptr": "*fp16",
                "seqlens_ptr": "*i32", "block_table_ptr": "*i32"}  # fmt: skip
    signature, attrs = _signature("_kvcache_append_keys_by_channel_kernel", pointers)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": configs.block_d(head_dim), "KEY_GROUP": key_group, "BITS": bits,
                  "PAGE_SIZE": 64, "HAS_ROTARY": True, "INTERLEAVED": False}  # fmt: skip
    return AotCase(f"{_KERNELS}:_kvcache_append_keys_by_channel_kernel", signature, constexprs,
                   num_warps=kv_append_keys_warps(head_dim, key_group),
                   label=f"append-keys-by-channel-d{head_dim}-{bits}b-g{key_group}", attrs=attrs)  # fmt: skip


def _combine_case(head_dim: int, tile: bool = False, advance: bool = False):
    """The split loop at 128 splits, or (tile) the widest (splits, head_dim) tile the plan loads at
    once; advance: with a static cache's length advanced by program 0."""
    from openkernels.shared.dev.testing.aot import AotCase

    signature, attrs = _signature(
        "_attention_kvcache_combine_kernel", {"o_ptr": "*bf16", "advance_ptr": "*i32"}
    )
    block_d = configs.block_d(head_dim)
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SPLITS": 4096 // block_d if tile else 128,
                  "SPLITS_TILE": tile, "ADVANCE": advance}  # fmt: skip
    return AotCase(f"{_KERNELS}:_attention_kvcache_combine_kernel", signature, constexprs, num_warps=4,
                   label=f"combine-d{head_dim}{'-tile' if tile else ''}{'-advance' if advance else ''}",
                   attrs=attrs)  # fmt: skip


def _variant(case):
    return dataclasses.replace(case, variant=True)


def cases_for(arch: str) -> list:
    """Decode (16 rows) and chunked-prefill configs at head_dim 128 and 256 (the widest tile
    of each config; 96 and 192 pad to them) for every cache format with every flag on; the
    split (float32 partial) store once per config; the launches' plain specializations; the
    append kernel per format; the merge. A config serving both rows counts once."""
    out = []
    for head_dim in (128, 256):
        for rows in (16, 64):
            for bits, group in _FORMATS:
                out.append(_attn_case(head_dim, rows, bits, group, arch, split=False))
            out.append(_attn_case(head_dim, rows, 4, 32, arch, split=True))
            # Variants (compiled for each vendor's reference target, aot.REFERENCE_TARGETS):
            # the plain launches, 8-bit left padding, the split store beside its once-per-config
            # case, the lean tile's left padding and split.
            out += [
                _variant(_attn_case(head_dim, rows, bits, None, arch, split=False, plain=True))
                for bits in (16, 4)
            ]
            out += [_variant(_attn_case(head_dim, rows, 8, None, arch, split=False, leftpad=True)),
                    _attn_case(head_dim, rows, 4, 32, arch, split=False, leftpad=True)]  # fmt: skip
            out += [_attn_case(head_dim, rows, 8, None, arch, split=False, plain=False, fp8=True)]
            if rows <= 16:  # a static cache's decode step: the append in the kernel
                out += [_attn_case(head_dim, rows, 16, None, arch, split=True, fused=True)]
            out += [_variant(_attn_case(head_dim, rows, 8, None, arch, split=split, plain=plain, fp8=True))
                    for split, plain in ((True, False), (False, True))]  # fmt: skip
            out += [_attn_case(head_dim, rows, bits, None, arch, split=False, key_group=g)
                    for bits in (8, 4) for g in (32, 64)]  # fmt: skip
            out += [_variant(_attn_case(head_dim, rows, bits, None, arch, split=True, key_group=g))
                    for bits in (8, 4) for g in (32, 64)]  # fmt: skip
            if rows <= 16 and configs.kv_config(head_dim, 8, rows, arch, lean=True) != configs.kv_config(
                head_dim, 8, rows, arch
            ):  # the one-warp decode tile, where the arch has one
                out += [_attn_case(head_dim, rows, bits, None, arch, split=False, fp8=fp8, lean=True)
                        for bits, fp8 in ((8, False), (4, False), (8, True))]  # fmt: skip
                out += [_variant(_attn_case(head_dim, rows, bits, None, arch, split=split, fp8=fp8, lean=True,
                                            leftpad=leftpad))
                        for bits, fp8 in ((8, False), (4, False), (8, True)) for split in (False, True)
                        for leftpad in (False, True) if split or leftpad]  # fmt: skip
        for bits, group in _FORMATS:
            out.append(_append_case(head_dim, bits, group))
        out.append(_append_case(head_dim, 4, 32, leftpad=True))
        out.append(_append_case(head_dim, 8, None, fp8=True))
        out += [_append_keys_case(head_dim, bits, g) for bits in (8, 4) for g in (32, 64)]
        out.append(_combine_case(head_dim))
    out += [_combine_case(head_dim, tile=True) for head_dim in (64, 128)]
    out += [_combine_case(64, tile=True, advance=True)]
    return list({c.label: c for c in out}.values())
