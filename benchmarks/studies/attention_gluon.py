"""The Gluon Hopper attention kernels (openkernels.attention.core.gluon, issue 23) on one sm_90
GPU: first the forward's output and log-sum-exp against float32 math on odd shapes (exits 1
on any failure unless --force; the backward's checks are tests/test_gluon.py), then the
forward at the issue's shapes beside the family's Triton forward, SDPA cuDNN, SDPA flash and
FlashAttention-4 (flash_attn.cute, when it imports), then forward+backward through autograd:
the public `attention` with the default implementations (cuDNN forward, Triton backward),
with the Gluon ones forced, and the same peers.

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) python3 benchmarks/studies/attention_gluon.py [--backward | --backward-sweep]

--backward-sweep: the Gluon backward's configs (BWD_VARIANTS) against the Triton backward, the
backward alone, checked then timed.
--backward: only forward+backward at every shape, the default (cuDNN forward, Triton
backward) against the default forward with the Gluon backward forced, and SDPA cuDNN.

bf16, kernel calls timed with triton.testing.do_bench over enough q/k/v copies (>= 200 MB)
that L2 (60 MB) holds none; TFLOP/s count 4 * B * H * S^2 * D, halved for causal. Gluon
configs (BLOCK_N / STAGES) and both schedules ("pp": ping-pong) are swept per head_dim.
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from openkernels.attention.core import gluon as G
from openkernels.attention.core import triton as T

DEV = "cuda"
SHAPES = ((8, 16, 2048, 128), (2, 16, 8192, 128), (1, 16, 16384, 128), (8, 32, 2048, 64), (2, 32, 8192, 64))
CONFIGS = {128: ((128, 2),), 64: ((128, 2), (128, 3), (128, 4))}
SERIES_BYTES = 200e6


def reference(q, k, v, causal, scale):
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))
    g = qh.shape[1] // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vh).transpose(1, 2), torch.logsumexp(s, -1)


def gluon_fwd(q, k, v, causal, **kw):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=DEV, dtype=torch.float32)
    G.launch(q, k, v, out, lse, scale=q.shape[-1] ** -0.5, causal=causal, **kw)
    return out, lse


def triton_fwd(q, k, v, causal):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=DEV, dtype=torch.float32)
    T.attn_fwd(q, k, v, out, lse, None, None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
               scale=q.shape[-1] ** -0.5, window_left=-1, window_right=0 if causal else -1, alibi_slopes=None,
               softcap=0.0)  # fmt: skip
    return out, lse


def check() -> int:
    fails = 0
    cases = [(2, 128, 128, 4, 4, 128), (2, 1000, 1000, 4, 2, 128), (1, 333, 777, 2, 1, 64),
             (2, 2048, 2048, 4, 4, 64), (1, 777, 333, 2, 2, 128), (1, 4096, 4096, 2, 2, 128)]  # fmt: skip
    for b, sq, sk, h, hkv, d in cases:
        for causal in (False, True):
            for dtype, pingpong in ((torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)):
                q = torch.randn(b, sq, h, d, device=DEV, dtype=dtype)
                k, v = (torch.randn(b, sk, hkv, d, device=DEV, dtype=dtype) for _ in range(2))
                name = f"B{b} Sq{sq} Sk{sk} H{h}/{hkv} D{d} causal={causal} {dtype} pingpong={pingpong}"
                try:
                    out, lse = gluon_fwd(q, k, v, causal, pingpong=pingpong)
                    torch.cuda.synchronize()
                except Exception as exc:  # report and go on: the sweep shows every failure
                    print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}")
                    fails += 1
                    continue
                ref_out, ref_lse = reference(q, k, v, causal, d**-0.5)
                seen = torch.isfinite(ref_lse)
                err = (out.float() - ref_out).abs().max().item()
                lse_err = (lse - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
                nan = bool(out.isnan().any() or lse.isnan().any())
                ok = err < 2e-2 and lse_err < 1e-3 and not nan and bool((lse[~seen] == float("-inf")).all())
                fails += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {name}: max|dout| {err:.2e} max|dlse| {lse_err:.2e} nan={nan}"
                )
    return fails


def fa4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # not installed: the peer is left out
        return None
    return flash_attn_func


def bench_shape(b: int, h: int, s: int, d: int, causal: bool, flash4) -> str:
    """One shape: every contender over the same rotating q/k/v copies."""
    copies = max(1, math.ceil(SERIES_BYTES / (3 * b * s * h * d * 2)))
    sets = [
        [torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(3)] for _ in range(copies)
    ]
    turn = [0]

    def nxt():
        turn[0] = (turn[0] + 1) % copies
        return sets[turn[0]]

    def sdpa(backend):
        with sdpa_kernel(backend):
            q, k, v = (t.transpose(1, 2) for t in nxt())
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    contenders = [
        (f"gluon{bn}/{st}{'pp' if pp else ''}",
         lambda bn=bn, st=st, pp=pp: gluon_fwd(*nxt(), causal, block_n=bn, stages=st, pingpong=pp))
        for bn, st in CONFIGS[d] for pp in (False, True)
    ]  # fmt: skip
    contenders += [
        ("triton", lambda: triton_fwd(*nxt(), causal)),
        ("cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)),
        ("sdpa-flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION)),
    ]
    if flash4 is not None:
        contenders.append(("fa4", lambda: flash4(*nxt(), causal=causal)))
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    row = []
    for name, fn in contenders:
        try:
            ms = do_bench(fn, rep=200)
            row.append(f"{name} {ms:.3f} ({flops / ms / 1e9:.0f})")
        except Exception as exc:  # a contender that fails to run is reported, not fatal
            row.append(f"{name} ERR {type(exc).__name__}: {str(exc)[:80]}")
    return f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}: " + " | ".join(row)


def bench_train(b: int, h: int, s: int, d: int, causal: bool, flash4, backward_only: bool = False) -> str:
    """Forward+backward through autograd (2.5x the forward's FLOPs) over rotating copies.
    backward_only: the default (cuDNN forward, Triton backward) against the same forward with
    the Gluon backward forced, and SDPA cuDNN: where the Gluon backward would go by default."""
    import openkernels.attention as A
    from openkernels.shared import dispatch

    copies = max(1, math.ceil(SERIES_BYTES / (4 * b * s * h * d * 2)))
    sets = [
        [torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16, requires_grad=i < 3) for i in range(4)]
        for _ in range(copies)
    ]
    turn = [0]

    def nxt():
        turn[0] = (turn[0] + 1) % copies
        return sets[turn[0]]

    def ours(*forced):
        q, k, v, dout = nxt()
        with dispatch.force(*forced):
            out = A.attention(q, k, v, causal=causal)
            out.backward(dout)

    def sdpa(backend):
        q, k, v, dout = nxt()
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal)
            out.backward(dout.transpose(1, 2))

    def fa4_train():
        q, k, v, dout = nxt()
        out = flash4(q, k, v, causal=causal)
        (out[0] if isinstance(out, tuple) else out).backward(dout)

    contenders = [
        ("default", lambda: ours()),
        ("gluon+gluon", lambda: ours("attention:gluon", "attention_backward:gluon")),
        ("gluon+triton", lambda: ours("attention:gluon", "attention_backward:triton")),
        ("cudnn", lambda: sdpa(SDPBackend.CUDNN_ATTENTION)),
        ("sdpa-flash", lambda: sdpa(SDPBackend.FLASH_ATTENTION)),
    ]
    if backward_only:
        contenders = [contenders[0], ("cudnn+gluon", lambda: ours("attention_backward:gluon")), contenders[3]]
    if flash4 is not None:
        contenders.append(("fa4", fa4_train))
    flops = 2.5 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    row = []
    for name, fn in contenders:
        try:
            ms = do_bench(fn, rep=300, grad_to_none=[t for group in sets for t in group[:3]])
            row.append(f"{name} {ms:.3f} ({flops / ms / 1e9:.0f})")
        except Exception as exc:  # a contender that fails to run is reported, not fatal
            row.append(f"{name} ERR {type(exc).__name__}: {str(exc)[:80]}")
    return f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} fwd+bwd: " + " | ".join(row)


BWD_SWEEP_SHAPES = ((8, 16, 2048, 128, False), (8, 16, 2048, 128, True), (2, 16, 8192, 128, True),
                    (8, 32, 2048, 64, False), (2, 32, 8192, 64, True))  # fmt: skip
# (dK/dV query rows, dK/dV stages, dQ key block, dQ stages); the default (gluon.bwd_config) first
BWD_VARIANTS = {
    128: ((32, 3, 128, 2), (32, 2, 128, 2), (32, 4, 128, 2), (64, 2, 128, 2), (32, 3, 64, 2), (32, 3, 64, 3)),
    64: ((64, 3, 128, 3), (64, 2, 128, 3), (64, 4, 128, 3), (32, 3, 128, 3), (64, 3, 128, 2), (64, 3, 64, 4)),
}


def bwd_sweep() -> int:
    """The Gluon backward's configs (gluon.bwd_config overridden) on the Triton forward's out and
    lse, against the Triton backward: gradients within 2e-2 of the largest, no NaN, then time
    (do_bench of the backward alone, ms). A config that fails to compile or run is reported."""
    return sum(_bwd_sweep_shape(*shape) for shape in BWD_SWEEP_SHAPES)


def _bwd_sweep_shape(b: int, h: int, s: int, d: int, causal: bool) -> int:
    q, k, v, dout = (torch.randn(b, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    out, lse = triton_fwd(q, k, v, causal)
    scale = d**-0.5
    opts = dict(max_seqlen_q=s, max_seqlen_k=s, scale=scale, window_left=-1, window_right=0 if causal else -1,
                alibi_slopes=None, softcap=0.0)  # fmt: skip
    ref = [torch.empty_like(t) for t in (q, k, v)]

    def triton_bwd():
        T.attn_bwd(dout, q, k, v, out, lse, *ref, None, None, **opts)

    triton_bwd()
    triton_ms = do_bench(triton_bwd, rep=200)
    problem = T._problem(q, k, None, s, s, scale, -1, 0 if causal else -1, None, 0.0, 0.0)
    delta = T.bwd_delta(out, dout, lse, None, problem)
    fails, row = 0, [f"triton {triton_ms:.3f}"]
    for cfg in BWD_VARIANTS[d]:
        grads = [torch.empty_like(t) for t in (q, k, v)]

        def run(cfg=cfg, grads=grads):
            G.launch_bwd(dout, q, k, v, lse, delta, *grads, scale=scale, causal=causal, config=cfg)

        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or run: reported, not fatal
            row.append(f"{cfg} ERR {type(exc).__name__}: {str(exc)[:60]}")
            continue
        errs = [
            ((g.float() - r.float()).abs().max() / r.float().abs().max()).item() for g, r in zip(grads, ref)
        ]
        bad = any(math.isnan(e) or e > 2e-2 for e in errs)
        fails += bad
        ms = do_bench(run, rep=200)
        row.append(
            f"{cfg} {ms:.3f} ({triton_ms / ms:.2f}x){' BAD ' + str([round(e, 4) for e in errs]) if bad else ''}"
        )
    print(
        f"B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} bwd ms (x Triton): " + " | ".join(row),
        flush=True,
    )
    return fails


def bench() -> None:
    flash4 = fa4()
    print("shape: ms (TFLOP/s)")
    for b, h, s, d in SHAPES:
        for causal in (False, True):
            print(bench_shape(b, h, s, d, causal, flash4), flush=True)
    for b, h, s, d in SHAPES:
        for causal in (False, True):
            print(bench_train(b, h, s, d, causal, flash4), flush=True)


def main() -> None:
    start = time.time()
    if "--backward-sweep" in sys.argv:  # the Gluon backward's configs against the Triton backward
        print(torch.cuda.get_device_name(), torch.__version__)
        sys.exit(1 if bwd_sweep() else 0)
    if "--backward" in sys.argv:  # the Gluon backward behind the default forward, every shape
        print(torch.cuda.get_device_name(), torch.__version__, "shape: ms (TFLOP/s)")
        for b, h, s, d in SHAPES:
            for causal in (False, True):
                print(bench_train(b, h, s, d, causal, None, backward_only=True), flush=True)
        return
    print(torch.cuda.get_device_name(), torch.__version__)
    fails = check()
    print(f"correctness: {fails} failures ({time.time() - start:.0f} s)", flush=True)
    if fails and "--force" not in sys.argv:
        sys.exit(1)
    bench()


if __name__ == "__main__":
    main()
