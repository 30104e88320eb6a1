"""The norm backward's persistent tile grid against what fits on an SM (issue 25: RMSNorm
forward+backward at 0.74x QuACK at 2048 columns and 0.82x at 8192, H100 kernel time,
layernorm 0.11.4).

The tile backward runs `programs_per_sm` programs per SM, each over a run of rows, each
writing its own dweight/dbias partial row (configs.launch_config). ptxas (sm_90, Triton 3.6)
gives the 2048-column RMSNorm tile 96 registers at 4 warps: 5 programs of 128 threads fit on
an SM, the grid asks for 8, so 3/8 of the programs run as a second wave after the first; at
8192 columns (16 warps, 96-121 registers) one program fits where the grid asks for 4. This
times candidate configs of the tile backward kernel alone (`norm_bwd` with `config=`, Triton
do_bench median, L2 flushed by do_bench), bf16, 64M elements, for RMSNorm, LayerNorm and
RMSNorm with the residual's gradient (add_rms_norm's backward); each config's dh and dweight
are compared with the default's first (max abs difference; bitwise where the row runs
match).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/norm_bwd_occupancy.py [COLS,...]
"""

from __future__ import annotations

import sys

import torch
import triton

from openkernels.layernorm.triton import configs, norm_bwd

NC = configs.NormConfig
DEV, DT, ELEMENTS = "cuda", torch.bfloat16, 1 << 26

# (block_rows, block_cols, warps, programs per SM, prefetch) per row length; the first is
# launch_config's pick of layernorm 0.11.4.
CANDIDATES = {
    2048: [(1, 2048, 4, 8, True), (1, 2048, 4, 4, True), (1, 2048, 4, 5, True), (1, 2048, 8, 4, True),
           (1, 2048, 8, 3, True), (1, 2048, 4, 4, False), (1, 2048, 2, 8, True), (2, 2048, 8, 2, True)],
    4096: [(1, 4096, 16, 2, True), (1, 4096, 16, 1, True), (1, 4096, 8, 2, True), (1, 4096, 8, 4, True)],
    8192: [(1, 8192, 16, 4, False), (1, 8192, 16, 1, False), (1, 8192, 16, 1, True), (1, 8192, 32, 1, False),
           (1, 8192, 16, 2, False), (1, 8192, 8, 2, False)],
}  # fmt: skip


def _inputs(rows: int, cols: int, op: str) -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, dtype=torch.float32, generator=g).to(DT)

    h, dy = rand(rows, cols), rand(rows, cols)
    hf = h.float()
    mean = None if op != "ln" else hf.mean(1)
    centred = hf if mean is None else hf - mean[:, None]
    rstd = torch.rsqrt(centred.square().mean(1) + 1e-6)
    return dict(dy=dy, h=h, weight=1 + 0.1 * rand(cols), mean=mean, rstd=rstd,
                dh_out=rand(rows, cols) if op == "rms+dh" else None)  # fmt: skip


def _run(s: dict, op: str, cfg: NC | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    cols = s["h"].shape[1]
    dh = torch.empty_like(s["h"])
    dw = torch.empty(cols, dtype=torch.float32, device=DEV)
    db = torch.empty(cols, dtype=torch.float32, device=DEV) if op == "ln" else None
    norm_bwd(s["dy"], s["h"], s["weight"], s["mean"], s["rstd"], s["dh_out"], dh, dw, db, weight_offset=0.0,
             rms=op != "ln", config=cfg)  # fmt: skip
    return dh, dw, db


def main(cols_list: list[int]) -> None:
    print(torch.cuda.get_device_name(), "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    src = torch.empty(ELEMENTS * 3, dtype=DT, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    print(f"copy {copy_gbs:.0f} GB/s")
    print(
        "| op | cols | config (rows, cols, warps, per SM, prefetch) | ms | GB/s (3 passes) | of copy | x default | max diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cols in cols_list:
        rows = ELEMENTS // cols
        for op in ("rms", "ln", "rms+dh"):
            s = _inputs(rows, cols, op)
            ref = _run(s, op, None)
            passes = 4 if op == "rms+dh" else 3
            base = None
            for cand in CANDIDATES[cols]:
                cfg = NC(*cand[:3], "tile", cand[3], cand[4])
                try:
                    out = _run(s, op, cfg)
                    diff = max(
                        float((a.float() - b.float()).abs().max()) for a, b in zip(out, ref) if a is not None
                    )
                    ms = triton.testing.do_bench(
                        lambda s=s, op=op, cfg=cfg: _run(s, op, cfg), warmup=10, rep=100, return_mode="median"
                    )
                except Exception as error:  # a config that does not compile or launch: reported, not fatal
                    print(f"| {op} | {cols} | {cand} | failed: {repr(error)[:120]} |")
                    continue
                base = base or ms
                gbs = passes * rows * cols * 2 / ms / 1e6
                print(f"| {op} | {cols} | {cand} | {ms:.4f} | {gbs:.0f} | {gbs / copy_gbs:.3f} | "
                      f"{base / ms:.2f}x | {diff:.2e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main([int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096,8192").split(",")])
