"""A CPU model of the Triton decode kernel's arithmetic on an int8 / int4 cache with one
group per head (the per-token scales folded into the scores and P): the form before
attention 0.4.1 (codes fed to the dots as 1024 + code, the offset taken off the float32
accumulators afterwards) against the centred form (code - 2^(bits-1), exact in float16).
Both in float32 with torch's (round-to-nearest) sums, one split, against the float64
reference on the same cache; the relative L2 error of the bf16 output. Tensor cores do not
accumulate with IEEE round-to-nearest (published measurements find truncation), and the
old form measured worse on the H200 than in this model (docs/perf.md).

    python benchmarks/studies/kvcache_factored_precision.py [TOKENS ...]   (default 4096 32768 131072)
"""

import sys

import torch

from openkernels.attention.kvcache.format import quantize_kv, unpack_codes

torch.manual_seed(0)
D, G, BN = 128, 4, 64


def run(S, bits, splits, centred):
    k = torch.randn(S, D).bfloat16()
    v = torch.randn(S, D).bfloat16()
    q = torch.randn(G, D).bfloat16()
    kq, vq = quantize_kv(k[:, None], bits), quantize_kv(v[:, None], bits)
    kc = unpack_codes(kq.data[:, 0], bits).float()
    vc = unpack_codes(vq.data[:, 0], bits).float()
    ks, kz = kq.scale[:, 0, 0].float(), kq.zero[:, 0, 0].float()
    vs, vz = vq.scale[:, 0, 0].float(), vq.zero[:, 0, 0].float()
    scale = D**-0.5
    q16 = (q.float() * scale).half().float()
    qsum = q16.sum(1)
    mid = float(1 << (bits - 1))
    ref = (
        torch.softmax((q16.double() @ (kc * ks[:, None] + kz[:, None]).double().T), 1)
        @ (vc * vs[:, None] + vz[:, None]).double()
    )
    parts = []
    L = S // splits
    for sp in range(splits):
        m = torch.full((G,), -float("inf"))
        l = torch.zeros(G)
        acc = torch.zeros(G, D)
        off = torch.zeros(G)
        zs = torch.zeros(G)
        for n0 in range(sp * L, (sp + 1) * L, BN):
            sl = slice(n0, n0 + BN)
            if centred:
                qk = q16 @ (kc[sl] - mid).T
                qk = ks[sl] * qk + (kz[sl] + ks[sl] * mid) * qsum[:, None]
            else:
                qk = q16 @ (kc[sl] + 1024).T
                qk = ks[sl] * (qk - 1024 * qsum[:, None]) + kz[sl] * qsum[:, None]
            mn = torch.maximum(m, qk.max(1).values)
            alpha = torch.exp(m - mn)
            p = torch.exp(qk - mn[:, None])
            l = l * alpha + p.sum(1)
            m = mn
            pv = (p * vs[sl]).half().float()
            if centred:
                acc = acc * alpha[:, None] + pv @ (vc[sl] - mid)
                zs = zs * alpha + (p * (vz[sl] + vs[sl] * mid)).sum(1)
            else:
                acc = acc * alpha[:, None] + pv @ (vc[sl] + 1024)
                off = off * alpha + pv.sum(1)
                zs = zs * alpha + (p * vz[sl]).sum(1)
        acc = acc + (zs[:, None] if centred else (zs - 1024 * off)[:, None])
        parts.append((acc, l, m))
    M = torch.stack([p[2] for p in parts]).max(0).values
    num = sum(a * torch.exp(mm - M)[:, None] for a, _, mm in parts)
    den = sum(l * torch.exp(mm - M) for _, l, mm in parts)
    out = (num / den[:, None]).bfloat16().double()
    return float((out - ref).norm() / ref.norm())


def main() -> None:
    print("| cached tokens | cache | old form | centred form |")
    print("|---|---|---|---|")
    for S in map(int, sys.argv[1:] or (4096, 32768, 131072)):
        for bits in (8, 4):
            old, new = run(S, bits, 1, False), run(S, bits, 1, True)
            print(f"| {S} | int{bits} | {old:.4f} | {new:.4f} |", flush=True)


if __name__ == "__main__":
    main()
