"""The decode step's fused projections (quant 0.10.17, docs/ops/quant.md) against the two
launches they replace, kernel time at the Llama-style 1B model's shapes (bf16, int4 group 128,
batch 1 unless --ms):

  gated   silu_and_mul (activations' kernel) then the down projection's GEMV, against the
          gated GEMV (act(gate) * up in its x loads): N x K = 2048 x 8192
  normed  rms_norm (layernorm's kernel) then the q/k/v (3072 x 2048) or gate/up (16384 x 2048)
          GEMV, against the normed GEMV (the norm in its x loads)

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/quant_fused_gemv.py [--ms 1,4]

Kernel time: a CUDA graph of calls rotating over enough weight copies (>= 200 MB) that L2 holds
none, CUDA events (shared.dev.bench.rotating_graph_ms). Each fused output is checked against
the unfused pair's (within one rounding of each input value) before it is timed.
"""

from __future__ import annotations

import argparse
import json

import torch

from openkernels.activations import silu_and_mul
from openkernels.layernorm import rms_norm
from openkernels.quant import cuda as G
from openkernels.quant.fused import gated_product, rms_normed
from openkernels.quant.quantize import quantize_int4
from openkernels.shared.dev.bench import rotating_graph_ms

DEV = torch.device("cuda")


def _weights(n: int, k: int, dtype) -> list:
    q = quantize_int4(torch.randn(n, k, device=DEV) * 0.02)
    parts = (q.qweight, q.scales.to(dtype), q.zeros.to(dtype))
    copies = max(1, -(-200 * 2**20 // (n * k // 2)))
    return [tuple(t.clone() for t in parts) for _ in range(copies)]


def _close(fused, unfused, name: str) -> None:
    err = (fused.float() - unfused.float()).abs().max().item()
    scale = unfused.float().abs().max().item()
    if not err <= 0.03 * scale:
        raise SystemExit(f"{name}: fused differs from unfused by {err} (max |out| {scale})")


def _us(ms: float | None) -> float:
    return float("nan") if ms is None else 1e3 * ms


def _gated(m: int, dtype) -> dict:
    n, k = 2048, 8192  # the down projection
    ws = _weights(n, k, dtype)
    gate_up = torch.randn(m, 2 * k, device=DEV, dtype=dtype)
    out = torch.empty(m, n, device=DEV, dtype=dtype)
    config = G.gated_config(gate_up, ws[0][0], ws[0][1], ws[0][2], None, out, 128, "int4", "silu")

    def unfused(w):
        G.int4_linear_fwd(silu_and_mul(gate_up), w[0], w[1], w[2], None, out, 128, "int4")

    def fused(w):
        G.int4_linear_gated_fwd(gate_up, w[0], w[1], w[2], None, out, 128, "int4", "silu")

    fused(ws[0])
    got = out.clone()
    unfused(ws[0])
    _close(got, out, "gated")
    ref = torch.empty_like(out)
    G.int4_linear_fwd(gated_product(gate_up, "silu"), *ws[0], None, ref, 128, "int4")
    _close(got, ref, "gated vs the composed product")
    t_un = rotating_graph_ms([lambda w=w: unfused(w) for w in ws])
    t_fu = rotating_graph_ms([lambda w=w: fused(w) for w in ws])
    return {"case": f"gated M={m} {n}x{k}", "config": config, "unfused_us": _us(t_un), "fused_us": _us(t_fu)}


def _normed(m: int, n: int, k: int, dtype) -> dict:
    ws = _weights(n, k, dtype)
    x = torch.randn(m, k, device=DEV, dtype=dtype) * 4
    norm_weight = (0.5 + torch.rand(k, device=DEV)).to(dtype)
    out = torch.empty(m, n, device=DEV, dtype=dtype)
    config = G.normed_config(x, norm_weight, ws[0][0], ws[0][1], ws[0][2], None, out, 128, "int4")

    def unfused(w):
        G.int4_linear_fwd(rms_norm(x, norm_weight, 1e-5), w[0], w[1], w[2], None, out, 128, "int4")

    def fused(w):
        G.int4_linear_normed_fwd(x, norm_weight, 1e-5, 0.0, w[0], w[1], w[2], None, out, 128, "int4")

    fused(ws[0])
    got = out.clone()
    unfused(ws[0])
    _close(got, out, "normed")
    ref = torch.empty_like(out)
    G.int4_linear_fwd(rms_normed(x, norm_weight, 1e-5), *ws[0], None, ref, 128, "int4")
    _close(got, ref, "normed vs the composed norm")
    t_un = rotating_graph_ms([lambda w=w: unfused(w) for w in ws])
    t_fu = rotating_graph_ms([lambda w=w: fused(w) for w in ws])
    return {"case": f"normed M={m} {n}x{k}", "config": config, "unfused_us": _us(t_un), "fused_us": _us(t_fu)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ms", default="1")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        rows.append(_gated(m, dtype))
        for n, k in ((3072, 2048), (16384, 2048)):  # q/k/v, gate/up
            rows.append(_normed(m, n, k, dtype))
    print(f"{'case':<28} {'config':<14} {'unfused us':>11} {'fused us':>9} {'saved':>7}")
    for r in rows:
        saved = r["unfused_us"] - r["fused_us"]
        print(
            f"{r['case']:<28} {r['config']!s:<14} {r['unfused_us']:>11.2f} {r['fused_us']:>9.2f} {saved:>7.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
