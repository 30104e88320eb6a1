"""AOT cases of the Gluon Hopper int4_linear kernel (openkernels.quant.gluon): sm_90 only, every
config the launcher picks (gluon.all_configs) and the study's sweep, with the signature the
launcher passes (TMA descriptors of x and the codes, the scales in place of absent zeros and
bias), bf16 and fp16 x, scales in x's dtype or the other one, zeros and symmetric, a bias."""

from __future__ import annotations

_KERNEL = "openkernels.quant.gluon.kernels:int4_linear_wgmma_kernel"
_T = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _desc(dtype: str, shape: list[int]) -> str:
    from triton.experimental.gluon import language as gl

    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16, "u8": gl.uint8}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(shape, gl_dtype)
    return f"tensordesc<{dtype}[{','.join(map(str, shape))}],{layout!r}>"


def wgmma_case(cfg, x: str = "bf16", scales: str = "bf16", *, zeros: bool = True, bias: str | None = None,
               group: int = 128, nf4: bool = False, table: int = 0, tiled: bool = False):  # fmt: skip
    """The launch of gluon.launch for config `cfg` (a gluon.WgmmaConfig)."""
    from openkernels.shared.dev.testing.aot import AotCase

    signature = {
        "x_desc": _desc(x, [cfg.block_m, cfg.block_k]),
        "qw_desc": _desc("u8", [cfg.block_n // 16, 1, 16, cfg.block_k // 2] if tiled else [cfg.block_n, cfg.block_k // 2]),
        "s_ptr": _T[scales], "z_ptr": _T[scales], "bias_ptr": _T[bias or scales], "out_ptr": _T[x],
        "ws_ptr": "*fp32" if cfg.split_k > 1 else _T[x], "counter_ptr": "*i32" if cfg.split_k > 1 else _T[x],
        "M": "i32", "N": "i32", "K": "i32", "stride_sg": "i32", "stride_om": "i32", "steps_per_split": "i32",
    }  # fmt: skip
    constexprs = {"GROUP": group, "STAGES": cfg.stages, "HAS_ZEROS": zeros, "HAS_BIAS": bias is not None,
                  "SCALE_16": scales == x, "SCALES_AHEAD": cfg.scales_ahead, "SPLIT_K": cfg.split_k, "NF4": nf4,
                  "PERSISTENT": cfg.persistent, "NF4_TABLE": table}  # fmt: skip
    label = (f"wgmma-m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}s{cfg.stages}a{cfg.scales_ahead}k{cfg.split_k}{'p' if cfg.persistent else ''}-{x}-{scales}"
             f"{'-nf4' if nf4 else '-zeros' if zeros else '-sym'}{f'-t{table}' if table else ''}{'-tiled' if tiled else ''}"
             f"{f'-bias{bias}' if bias else ''}-g{group}")  # fmt: skip
    # K, N, the strides: the launcher passes what the call has (no "D" specialization assumed).
    return AotCase(_KERNEL, signature, constexprs, num_warps=cfg.num_warps, label=label,
                   attrs={"M": "", "N": "", "K": "", "stride_sg": "", "stride_om": "", "steps_per_split": ""})  # fmt: skip


def cases_for(family: str) -> list:
    if family != "hopper":
        return []  # wgmma and TMA: Hopper's (sm_90a)
    from openkernels.quant import gluon

    out = {}
    configs = list(gluon.all_configs())
    for m in (16, 64, 128):
        configs += gluon.sweep_configs(m)
    for cfg in dict.fromkeys(configs):
        c = wgmma_case(cfg)
        out[c.label] = c
    # Every dtype / format / bias variant on the M = 16, 128, 256 and 2048 defaults.
    for m in (16, 128, 256, 2048):
        cfg = gluon.config_for(m, 8192, 8192, 128)
        for x in ("bf16", "fp16"):
            for scales in ("bf16", "fp16"):
                for zeros in (True, False):
                    c = wgmma_case(cfg, x, scales, zeros=zeros, bias="fp32" if zeros else x)
                    out[c.label] = c
    # NF4 (the register lookup of the levels), both dtypes, scales in x's dtype or not.
    for m in (128, 2048):
        cfg = gluon.config_for(m, 8192, 8192, 128)
        for x in ("bf16", "fp16"):
            for scales in ("bf16", "fp16"):
                c = wgmma_case(cfg, x, scales, zeros=False, nf4=True)
                out[c.label] = c
    # NF4 from the tables in shared memory (gluon.NF4_LOOKUP "pairs" and "levels").
    for m in (128, 1024):
        cfg = gluon.config_for(m, 8192, 8192, 128)
        for table in (1, 2):
            for x, scales in (("bf16", "bf16"), ("fp16", "bf16")):
                c = wgmma_case(cfg, x, scales, zeros=False, nf4=True, table=table)
                out[c.label] = c
    # Tiled codes (format.tile_codes through a 4-D TMA view): the M = 16, 128 and 2048 defaults,
    # int4 and NF4, and a K split.
    for m in (16, 128, 2048):
        cfg = gluon.config_for(m, 8192, 8192, 128)
        for nf4 in (False, True):
            c = wgmma_case(cfg, "bf16", "bf16", zeros=not nf4, nf4=nf4, table=2 if nf4 else 0, tiled=True)
            out[c.label] = c
    # K split over programs (the split-K epilogue: partials, the arrival counter).
    for split_cfg in (gluon.WgmmaConfig(128, 64, 128, 3, 2, 2), gluon.WgmmaConfig(16, 64, 128, 3, 2, 4)):
        c = wgmma_case(split_cfg, bias="fp32")
        out[c.label] = c
    # Persistent programs (a tile loop; the next tile's loads before this one's epilogue).
    for cfg in gluon.PERSISTENT_STUDY:
        for x, scales, zeros, nf4 in (
            ("bf16", "bf16", True, False),
            ("fp16", "bf16", False, False),
            ("bf16", "bf16", False, True),
        ):
            c = wgmma_case(cfg, x, scales, zeros=zeros, bias="fp32" if zeros else None, nf4=nf4)
            out[c.label] = c
    # 64-column steps (group 64) and one group per row.
    for group, k in ((64, 4096), (4096, 4096)):
        cfg = gluon.config_for(128, 4096, k, group)
        from openkernels.quant.triton.configs import kernel_group

        c = wgmma_case(cfg, group=kernel_group(group, k))
        out[c.label] = c
    return list(out.values())
