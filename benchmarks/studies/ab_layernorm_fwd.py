"""A/B of forward-kernel variants: text edits of openkernels/layernorm/triton/kernels.py,
each loaded as its own module and timed (triton do_bench, inputs rotated past L2) in one
process with Liger on the same inputs. How the evict-first finding in docs/perf.md was made.

    python benchmarks/studies/ab_layernorm_fwd.py   (GPU)

Variants: current, no_evict (evict-first hints dropped), skip_round (no h rounding round
trip without a residual), both. Rewrite VARIANTS for the next question.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import tempfile

import torch
import triton
from triton.testing import do_bench

import openkernels.layernorm.triton.kernels as K
from openkernels.layernorm.triton import configs

ROUND = """    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += r.to(tl.float32)
    return h.to(res_out_ptr.dtype.element_ty).to(tl.float32)"""
SKIP_ROUND = """    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += r.to(tl.float32)
        return h.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    if x.dtype != res_out_ptr.dtype.element_ty:
        return h.to(res_out_ptr.dtype.element_ty).to(tl.float32)
    return h"""


def variants() -> dict[str, str]:
    src = pathlib.Path(K.__file__).read_text()
    no_evict = src.replace(', eviction_policy="evict_first"', "")
    return {
        "current": src,
        "no_evict": no_evict,
        "skip_round": src.replace(ROUND, SKIP_ROUND),
        "both": no_evict.replace(ROUND, SKIP_ROUND),
    }


def load(name: str, text: str, folder: pathlib.Path):
    path = folder / f"lnvar_{name}.py"
    path.write_text(text)  # Triton reads kernel source from the file
    spec = importlib.util.spec_from_file_location(f"lnvar_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    folder = pathlib.Path(tempfile.mkdtemp())
    mods = {name: load(name, text, folder) for name, text in variants().items()}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        LigerRMSNormFunction = None
    dev = "cuda"
    for rows, n in ((32768, 2048), (16384, 4096), (8192, 8192), (4096, 16384)):
        for rms in (True, False):
            sets = []
            for _ in range(3):
                x = torch.randn(rows, n, device=dev).bfloat16()
                sets.append(
                    dict(
                        x=x,
                        w=(1 + 0.1 * torch.randn(n, device=dev)).bfloat16(),
                        b=torch.randn(n, device=dev).bfloat16(),
                        out=torch.empty_like(x),
                        mean=torch.empty(rows, device=dev),
                        rstd=torch.empty(rows, device=dev),
                        tok=torch.zeros(1, device=dev, dtype=torch.bfloat16),
                    )
                )
            cfg = configs.launch_config(n, torch.bfloat16, "cuda", "fwd", True, rms)
            nbytes = 2 * rows * n * 2
            line = f"{rows}x{n} {'rms' if rms else 'ln '} cfg r{cfg.block_rows}w{cfg.num_warps}:"
            for name, m in mods.items():
                line += f" {name} {nbytes / _time_variant(m, sets, cfg, rows, n, rms) / 1e6:.0f}"
            if rms and LigerRMSNormFunction is not None:
                i = [0]

                def liger(i=i, sets=sets):
                    s = sets[i[0] % 3]
                    i[0] += 1
                    LigerRMSNormFunction.apply(s["x"], s["w"], 1e-6, 0.0, "none", False)

                line += (
                    f" | liger {nbytes / do_bench(liger, warmup=25, rep=60, return_mode='median') / 1e6:.0f}"
                )
            print(line, flush=True)


def _time_variant(m, sets, cfg, rows: int, n: int, rms: bool) -> float:
    i = [0]

    def step():
        s = sets[i[0] % 3]
        i[0] += 1
        m._norm_fwd_kernel[(triton.cdiv(rows, cfg.block_rows),)](
            s["x"], s["x"], s["w"], s["x"] if rms else s["b"], s["out"], s["tok"],
            s["rstd"] if rms else s["mean"], s["rstd"], rows, n, n, 0, n, 0, 1e-6, 0.0,
            IS_RMS=rms, HAS_RESIDUAL=False, STORE_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=not rms,
            EVEN_C=n == cfg.block_cols, PERSISTENT=False, PREFETCH=False, BLOCK_R=cfg.block_rows,
            BLOCK_C=cfg.block_cols, num_warps=cfg.num_warps,
        )  # fmt: skip

    return do_bench(step, warmup=25, rep=60, return_mode="median")


if __name__ == "__main__":
    main()
