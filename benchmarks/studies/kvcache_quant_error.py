"""Quantization error of the int8 / int4 / fp8 KV-cache formats on the attention output: float32
reference attention on the bf16 cache against the same on the dequantized cache, for random
normal activations and for keys with outlier channels (the table in
docs/ops/attention-kvcache.md), at 4096 cached tokens (batch 4) and 131072 (batch 1). fp8 with
its per-head scales calibrated on the cache's own keys and values (format.fp8_scale) and with
the default scale 1.0. Keys by channel (KIVI): keys quantized per channel over groups of 32 or
64 tokens (float16 first, as the cache rounds them), values per token over the whole head.

    python benchmarks/studies/kvcache_quant_error.py [TOKENS ...]
"""

from __future__ import annotations

import sys

import torch

from openkernels.attention.core import reference as R
from openkernels.attention.kvcache import reference as KR
from openkernels.attention.kvcache.format import (
    QuantizedKV,
    dequantize_kv,
    fp8_scale,
    quantize_fp8,
    quantize_kv,
)

Hq, Hk, D = 32, 8, 128


def run(kind: str, S: int) -> list[str]:
    B = 4 if S <= 8192 else 1
    q = torch.randn(B, 1, Hq, D)
    k = torch.randn(B, S, Hk, D)
    v = torch.randn(B, S, Hk, D)
    if kind == "outliers":  # real-model-like keys: a few channels 20x larger, a per-channel bias
        ch = torch.randperm(D)[:4]
        k[..., ch] *= 20
        k += torch.randn(D) * 2
        v[..., torch.randperm(D)[:2]] *= 8
    kb, vb = k.bfloat16(), v.bfloat16()
    ref = R.attention_ref(q.bfloat16().float(), kb.float(), vb.float(), causal=True)
    rows = []
    for bits, g in ((8, None), (8, 32), (4, None), (4, 64), (4, 32)):
        kq = dequantize_kv(quantize_kv(kb, bits, g))
        vq = dequantize_kv(quantize_kv(vb, bits, g))
        o = R.attention_ref(q.bfloat16().float(), kq, vq, causal=True)
        rel = ((o - ref).norm() / ref.norm()).item()
        mx = ((o - ref).abs().max() / ref.abs().max()).item()
        rows.append(f"| {kind} | {S} | int{bits} | {g or 'head'} | {rel:.2e} | {mx:.2e} |")
    for bits in (8, 4):
        for g in (32, 64):
            kq, _ = KR.keys_by_channel(kb, bits, g)  # S a multiple of g
            vq = dequantize_kv(quantize_kv(vb, bits, None))
            o = R.attention_ref(q.bfloat16().float(), kq, vq, causal=True)
            rel = ((o - ref).norm() / ref.norm()).item()
            mx = ((o - ref).abs().max() / ref.abs().max()).item()
            rows.append(
                f"| {kind} | {S} | int{bits}, keys by channel | keys {g} tokens, values head | {rel:.2e} | {mx:.2e} |"
            )
    for label, calibrated in (("per-head scale (calibrated)", True), ("scale 1.0", False)):
        kq, vq = (
            dequantize_kv(QuantizedKV.fp8(quantize_fp8(x, sc), sc))
            for x in (kb, vb)
            for sc in [fp8_scale(x) if calibrated else torch.ones(Hk)]
        )
        o = R.attention_ref(q.bfloat16().float(), kq, vq, causal=True)
        rel = ((o - ref).norm() / ref.norm()).item()
        mx = ((o - ref).abs().max() / ref.abs().max()).item()
        rows.append(f"| {kind} | {S} | fp8 e4m3 | {label} | {rel:.2e} | {mx:.2e} |")
    return rows


def main() -> None:
    torch.manual_seed(0)
    tokens = [int(a) for a in sys.argv[1:]] or [4096, 131072]
    print("| inputs | cached tokens | cache | group | rel. L2 error | max error / max |out| |")
    print("|---|---|---|---|---|---|")
    for kind in ("random", "outliers"):
        for S in tokens:
            print("\n".join(run(kind, S)), flush=True)


if __name__ == "__main__":
    main()
