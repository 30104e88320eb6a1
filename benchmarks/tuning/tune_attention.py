"""Sweep tiles, warps and pipelining depth of the attention Triton kernels on a GPU.

    python benchmarks/tuning/tune_attention.py [--directions fwd,bwd] [--shapes 2x16x8192x128c,...] [--rep-ms 50]

Shapes are BxHxSxD with a trailing 'c' for causal. One row per (shape, direction, config):
ms and TFLOP/s (forward 4*B*H*S^2*D, halved when causal; the backward counts 2.5x the
forward: five matmuls to the forward's two), each config first checked against SDPA's output
and gradients, the config launch_config picks today marked '*'. Used to pick the constants
in openkernels/attention/triton/configs.py (results in docs/perf.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from openkernels.attention.core import ops
from openkernels.attention.core.triton import attn_bwd, attn_fwd
from openkernels.attention.core.triton import kernels as K
from openkernels.attention.core.triton.configs import AttnConfig, launch_config
from openkernels.shared.dev.bench import time_ms

ARCH = "sm_90"  # the lent H200; the sweep reports against its table entries
DEFAULT_SHAPES = "8x16x2048x128,2x16x8192x128c,1x16x16384x128,8x32x2048x64c,4x16x4096x128c"


def fwd_candidates(head_dim: int) -> list[AttnConfig]:
    if head_dim > 128:
        tiles = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3)]
    else:
        # The first sweep's leaders (docs/perf.md) and their neighbours, with and without TMA.
        tiles = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                 (128, 64, 8, 4), (64, 128, 4, 3)]  # fmt: skip
    return [AttnConfig(*t, tma=tma) for t in tiles for tma in (False, True)]


def bwd_candidates(head_dim: int, direction: str) -> list[AttnConfig]:
    if direction == "dkdv":
        tiles = [(32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3),
                 (64, 128, 8, 2), (64, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3)]  # fmt: skip
    else:
        tiles = [(64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 3),
                 (64, 64, 8, 3), (128, 64, 8, 2)]  # fmt: skip
    return [AttnConfig(*t) for t in tiles if not (head_dim > 128 and t[0] * t[1] > 4096)]


def _compiled(kernel) -> dict:
    """Every compiled specialization of a @triton.jit kernel, by cache key."""
    out = {}
    for cache in kernel.device_caches.values():
        out.update(cache[0])
    return out


def _spills(kernels, before: dict) -> str:
    """Register spills of the specializations compiled since `before` was taken."""
    new = [k for kern in kernels for key, k in _compiled(kern).items() if key not in before.get(kern, {})]
    if not new:
        return ""
    spills = max(getattr(k, "n_spills", 0) for k in new)
    regs = max(getattr(k, "n_regs", 0) for k in new)
    return f"regs {regs} spills {spills}"


def _parse(spec: str) -> tuple[int, int, int, int, bool]:
    causal = spec.endswith("c")
    b, h, s, d = (int(n) for n in spec.rstrip("c").split("x"))
    return b, h, s, d, causal


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--directions", default="fwd,bwd")
    parser.add_argument("--rep-ms", type=float, default=50.0)
    args = parser.parse_args()
    for spec in args.shapes.split(","):
        b, h, s, d, causal = _parse(spec)
        fwd_flops = 4 * b * h * s * s * d // (2 if causal else 1)
        sets = []
        for _ in range(2):
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            sets.append({"q": q, "k": k, "v": v, "do": torch.randn_like(q)})
        first = sets[0]
        qt, kt, vt = (first[n].transpose(1, 2).detach().requires_grad_() for n in "qkv")
        ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        ref_grads = torch.autograd.grad(ref, (qt, kt, vt), first["do"].transpose(1, 2))
        ref = ref.transpose(1, 2)
        opts = dict(max_seqlen_q=s, max_seqlen_k=s, scale=d**-0.5, window_left=-1,
                    window_right=0 if causal else -1, alibi_slopes=None, softcap=0.0)  # fmt: skip
        for t in sets:
            t["out"], t["lse"] = torch.empty_like(t["q"]), torch.empty(b, h, s, device="cuda")
            attn_fwd(t["q"], t["k"], t["v"], t["out"], t["lse"], None, None, **opts)
        if "fwd" in args.directions:
            chosen = launch_config(d, torch.bfloat16, ARCH, "fwd")
            rows = []
            for cfg in fwd_candidates(d):
                try:
                    before = {K._attn_fwd_kernel: _compiled(K._attn_fwd_kernel)}
                    out = torch.empty_like(first["q"])
                    attn_fwd(first["q"], first["k"], first["v"], out, first["lse"].clone(), None, None, **opts,
                             config=cfg)  # fmt: skip
                    err = (out.float() - ref.float()).abs().max().item()
                    if not err < 2e-2:
                        rows.append((0.0, cfg, f"WRONG err {err:.3g}"))
                        continue
                    ms = time_ms(lambda t, cfg=cfg, opts=opts: attn_fwd(t["q"], t["k"], t["v"], t["out"], t["lse"], None, None,
                                                             **opts, config=cfg), sets, torch.device("cuda"),
                                 rep_ms=args.rep_ms)  # fmt: skip
                    rows.append(
                        (fwd_flops / ms / 1e9, cfg, f"{ms:.4f} ms {_spills([K._attn_fwd_kernel], before)}")
                    )
                except Exception as exc:  # out of shared memory, compile failure
                    rows.append((0.0, cfg, f"{type(exc).__name__}: {str(exc)[:80]}"))
            _report(spec, "fwd", rows, chosen)
        if "bwd" in args.directions:
            dq, dk, dv = (torch.empty_like(first[n]) for n in "qkv")
            picks = {name: launch_config(d, torch.bfloat16, ARCH, name) for name in ("dkdv", "dq")}
            for which in ("dkdv", "dq"):
                rows = []
                for cfg in bwd_candidates(d, which):
                    pair = (cfg, picks["dq"]) if which == "dkdv" else (picks["dkdv"], cfg)
                    bwd_kernels = [K._attn_bwd_dkdv_kernel if which == "dkdv" else K._attn_bwd_dq_kernel]
                    before = {k: _compiled(k) for k in bwd_kernels}
                    try:
                        attn_bwd(first["do"], first["q"], first["k"], first["v"], first["out"], first["lse"], dq,
                                 dk, dv, None, None, **opts, configs=pair)  # fmt: skip
                        err = max((a.float() - r.transpose(1, 2).float()).abs().max().item()
                                  for a, r in zip((dq, dk, dv), ref_grads))  # fmt: skip
                        if not err < 5e-2:
                            rows.append((0.0, cfg, f"WRONG err {err:.3g}"))
                            continue
                        ms = time_ms(
                            lambda t, pair=pair, dq=dq, dk=dk, dv=dv, opts=opts: attn_bwd(t["do"], t["q"], t["k"], t["v"], t["out"], t["lse"], dq, dk,
                                                          dv, None, None, **opts, configs=pair),
                            sets, torch.device("cuda"), rep_ms=args.rep_ms,
                        )  # fmt: skip
                        rows.append(
                            (2.5 * fwd_flops / ms / 1e9, cfg, f"{ms:.4f} ms {_spills(bwd_kernels, before)}")
                        )
                    except Exception as exc:
                        rows.append((0.0, cfg, f"{type(exc).__name__}: {str(exc)[:80]}"))
                _report(spec, f"bwd[{which}]", rows, picks[which])
        del sets, first
        torch.cuda.empty_cache()


def _report(spec: str, direction: str, rows: list, chosen: AttnConfig) -> None:
    rows.sort(key=lambda r: -r[0])
    for tflops, cfg, note in rows[:12] + [r for r in rows[12:] if r[1] == chosen]:
        mark = "*" if cfg == chosen else " "
        print(f"{spec:<18} {direction:<10} {mark} m{cfg.block_m:<4} n{cfg.block_n:<4} w{cfg.num_warps} "
              f"s{cfg.num_stages}{' tma' if cfg.tma else '    '}  {tflops:7.1f} TFLOP/s  {note}", flush=True)  # fmt: skip
    print(flush=True)


if __name__ == "__main__":
    assert ops.HEAD_DIMS  # the family's ops are registered before its launchers run
    main()
