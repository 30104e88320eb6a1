"""Eager replay on a GPU: every replayable op's replayed CUDA calls against its Python path,
bitwise, then host time per call (replayed, Python path, torch).

    python benchmarks/gpu/check_replay_gpu.py [--calls 2000]

For each case: two calls record (a key's second call runs under the recording), then fresh inputs of
the same shapes go through the replay and through the Python path (`replay.disabled()`);
the two outputs must be equal bit for bit (same kernels, same launch). Prints each op's
entries, replayed calls and refusal reasons, then microseconds per call. Exit status 1 on
any mismatch, or when an op that should replay on CUDA was refused.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F

from openkernels.activations import gelu, silu_and_mul
from openkernels.attention import attention
from openkernels.layernorm import layer_norm, rms_norm
from openkernels.shared import replay
from openkernels.shared.dev.bench import host_only_us


def _cases(dev: torch.device) -> list[tuple[str, object, object, object]]:
    """(name, our function, arguments factory, torch equivalent)."""
    bf16 = torch.bfloat16
    out = []
    for dtype in (bf16, torch.float16, torch.float32):
        for shape in ((4, 256), (37, 4096), (3, 5, 1000)):
            n = shape[-1]

            def norm_args(shape=shape, dtype=dtype, n=n):
                return (
                    torch.randn(shape, device=dev, dtype=dtype),
                    torch.randn(n, device=dev, dtype=dtype),
                    1e-6,
                ), {}

            out.append((f"rms_norm {dtype} {shape}", rms_norm, norm_args,
                        lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)))  # fmt: skip

            def ln_args(shape=shape, dtype=dtype, n=n):
                w = torch.randn(n, device=dev, dtype=dtype)
                return (torch.randn(shape, device=dev, dtype=dtype), w, w.clone(), 1e-5), {}

            out.append((f"layer_norm {dtype} {shape}", layer_norm, ln_args,
                        lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps)))  # fmt: skip

            def res_args(shape=shape, dtype=dtype, n=n):
                x = torch.randn(shape, device=dev, dtype=dtype)
                return (x, torch.randn(n, device=dev, dtype=dtype), 1e-6), {"residual": torch.randn_like(x),
                                                                            "prenorm": True}  # fmt: skip

            out.append((f"rms_norm+residual {dtype} {shape}", rms_norm, res_args, None))

            def act_args(shape=shape, dtype=dtype):
                return (torch.randn(*shape[:-1], 2 * shape[-1], device=dev, dtype=dtype),), {}

            out.append((f"silu_and_mul {dtype} {shape}", silu_and_mul, act_args,
                        lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2 :]))  # fmt: skip

            def gelu_args(shape=shape, dtype=dtype):
                return (torch.randn(shape, device=dev, dtype=dtype),), {"approximate": "tanh"}

            out.append(
                (
                    f"gelu tanh {dtype} {shape}",
                    gelu,
                    gelu_args,
                    lambda x, approximate: F.gelu(x, approximate=approximate),
                )
            )
    for dtype in (bf16, torch.float16):

        def att_args(dtype=dtype):
            q = torch.randn(1, 1, 32, 128, device=dev, dtype=dtype)
            k = torch.randn(1, 300, 8, 128, device=dev, dtype=dtype)
            return (q, k, torch.randn_like(k)), {"causal": False}

        out.append((f"attention decode-shaped {dtype}", attention, att_args, None))

        def att_view_args(dtype=dtype):
            qkv = torch.randn(2, 77, 3, 8, 64, device=dev, dtype=dtype)
            return (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), {"causal": True}  # strided views

        out.append((f"attention views causal {dtype}", attention, att_view_args, None))
    return out


# Refusals that are known and kept: the fp8 cache is read through a uint8 view (aten.view.dtype,
# not yet among the recorded views).
_EXPECTED_REFUSALS: dict[str, set[str]] = {}


def _int4_cases(dev: torch.device) -> list[tuple[str, object, object, object]]:
    from openkernels.quant import int4_linear, quantize_int4, quantize_nf4

    out = []
    for m, n, k, kind in (
        (1, 512, 1024, "int4"),
        (5, 384, 512, "int4"),
        (1, 512, 1024, "nf4"),
        (64, 256, 512, "int4"),
        # sm_90: the Gluon wgmma kernel (routed there by gluon.slower_than_triton), whose TMA
        # descriptors replay as tensor maps encoded per call (shared 0.16.5)
        (128, 8192, 8192, "int4"),
        (16, 28672, 8192, "int4"),
    ):
        quantize = quantize_nf4 if kind == "nf4" else quantize_int4
        w = quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16), group_size=128)

        def args(m=m, k=k, w=w):
            return (torch.randn(m, k, device=dev, dtype=torch.bfloat16), w), {}

        out.append((f"int4_linear {kind} M{m} {n}x{k}", int4_linear, args, None))
    return out


def _check_backward(dev: torch.device) -> int:
    """Forward+backward with dense and broadcast (`.sum()`) gradients: replayed gradients
    bitwise against the Python path's."""
    bad = 0
    for dtype in (torch.bfloat16, torch.float32):
        for name, fn in (
            ("rms_norm", lambda x, w, r: rms_norm(x, w, 1e-6)),
            ("rms_norm+residual", lambda x, w, r: rms_norm(x, w, 1e-6, residual=r)),
            ("layer_norm", lambda x, w, r: layer_norm(x, w, w * 0.5, 1e-5)),
            ("silu_and_mul", lambda x, w, r: silu_and_mul(torch.cat([x, x * 0.5], -1))),
            (
                "attention",
                lambda x, w, r: attention(x.view(2, 4, 4, 64), x.view(2, 4, 4, 64), r.view(2, 4, 4, 64)),
            ),
            (  # GQA: dK and dV summed over each group of query heads by a kernel
                "attention gqa",
                lambda x, w, r: attention(x.view(2, 4, 4, 64), r.view(2, 8, 2, 64), r.view(2, 8, 2, 64) * 2),
            ),
        ):
            for dense in (True, False):

                def grads(fn=fn, dense=dense, dtype=dtype, seed=0):
                    g = torch.Generator(device=dev).manual_seed(seed)
                    x = torch.randn(8, 256, device=dev, dtype=dtype, generator=g).requires_grad_()
                    w = torch.randn(256, device=dev, dtype=dtype, generator=g).requires_grad_()
                    r = torch.randn(8, 256, device=dev, dtype=dtype, generator=g).requires_grad_()
                    y = fn(x, w, r)
                    if dense:
                        y.backward(torch.randn(y.shape, device=dev, dtype=y.dtype, generator=g))
                    else:
                        y.float().sum().backward()
                    return [t.grad for t in (x, w, r) if t.grad is not None]

                if "attention" in name and dtype == torch.float32:
                    continue
                grads()
                grads()  # records
                got = grads(seed=1)
                with replay.disabled():
                    want = grads(seed=1)
                if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                    bad += 1
                    print(f"BAD backward {name} {dtype} dense={dense}: replayed gradients differ")
    return bad


def _kv_loop(dev: torch.device, batch: int, prompt: int, capacity: int, steps: int, **cache_kw) -> int:
    """One decode loop on two equal caches, replayed and on the Python path: each step
    writes the new token either through attend(q, k, v) or through append() then attend(q)
    (alternating), then two more layers attend; outputs and caches must stay bitwise equal."""
    from openkernels.attention import KVCache

    what = f"KVCache B{batch} prompt {prompt} {cache_kw}"
    caches = []
    for _ in range(2):
        c = KVCache(batch, capacity, 8, 128, device=dev, **cache_kw)
        g = torch.Generator(device=dev).manual_seed(3)
        k = torch.randn(batch, prompt, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
        c.append(k, torch.randn(k.shape, device=dev, dtype=k.dtype, generator=g))
        caches.append(c)
    g = torch.Generator(device=dev).manual_seed(4)
    bad = 0
    for step in range(steps):
        q = torch.randn(batch, 1, 32, 128, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, 1, 8, 128, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(k.shape, device=dev, dtype=k.dtype, generator=g)
        for layer in range(3):  # a decode step's layers share the key
            outs = []
            for i, c in enumerate(caches):
                with replay.disabled() if i else contextlib.nullcontext():
                    if layer == 0 and step % 2:
                        c.append(k, v)
                        outs.append(c.attend(q))
                    else:
                        outs.append(c.attend(q, k, v) if layer == 0 else c.attend(q))
            if not torch.equal(outs[0], outs[1]) or torch.isnan(outs[0]).any():
                bad += 1
                print(f"BAD {what} step {step} layer {layer}: replayed output differs")
    for b in range(batch):
        if not all(torch.equal(x, y) for x, y in zip(caches[0].dequantize(b), caches[1].dequantize(b))):
            bad += 1
            print(f"BAD {what}: replayed appends left another cache (sequence {b})")
    return bad


def _check_kv_decode(dev: torch.device) -> int:
    """KVCache decode loops in every format, contiguous and paged, lengths crossing several
    multiples of 16, and one 128K-token sequence."""
    bad = 0
    for kv_dtype in (torch.bfloat16, "fp8", "int8", "int4"):
        bad += _kv_loop(dev, 2, 21, 256, 40, kv_dtype=kv_dtype)
        bad += _kv_loop(dev, 2, 21, 256, 24, kv_dtype=kv_dtype, page_size=16)
        bad += _kv_loop(dev, 1, 131072 - 5, 131072 + 64, 12, kv_dtype=kv_dtype)
    bad += _kv_loop(dev, 2, 21, 256, 40, kv_dtype="int4", key_group=32)
    return bad


def _us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def _host_times(fn, a: tuple, kw: dict, ref, calls: int) -> tuple[float, float, float]:
    ours = _us(lambda: fn(*a, **kw), calls)
    with replay.disabled():
        python = _us(lambda: fn(*a, **kw), calls)
    theirs = _us(lambda: ref(*a, **kw), calls) if ref is not None else float("nan")
    return ours, python, theirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    dev = torch.device("cuda")
    replay.set_mode("all")
    bad = 0
    torch.manual_seed(0)
    for name, fn, make, _ in _cases(dev) + _int4_cases(dev):
        a, kw = make()
        fn(*a, **kw)  # marks the key seen
        fn(*a, **kw)  # records
        for _ in range(2):
            a, kw = make()
            got = fn(*a, **kw)
            with replay.disabled():
                want = fn(*a, **kw)
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            same = all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
            nan = any(torch.isnan(g).any().item() for g in got)
            if not same or nan:
                bad += 1
                print(f"BAD {name}: replayed output differs from the Python path (nan={nan})")
    torch.cuda.synchronize()
    bad += _check_backward(dev)
    bad += _check_kv_decode(dev)
    for name, stats in replay.all_stats().items():
        print(f"{name:60} entries {stats['entries']:3} hits {stats['hits']:4} refused {stats['refused']}")
        unexpected = set(stats["refused"]) - _EXPECTED_REFUSALS.get(name.rstrip("'"), set())
        # An op's own bodies (`<family>.ops.*`) run on the Python path only until the public
        # call replays as a whole (with its graph node, under autograd): they may never hit.
        body = ".ops." in name
        if unexpected or (stats["entries"] and not stats["hits"] and not body):
            bad += 1
            print(f"BAD {name}: refused {sorted(unexpected)} or recorded and never replayed")
    print("\nhost time per call (us): replayed / Python path / torch")
    for name, fn, make, ref in _cases(dev) + _int4_cases(dev):
        if "(4, 256)" not in name and "decode" not in name and "8192" not in name:
            continue
        ours, python, theirs = _host_times(fn, *make(), ref, args.calls)
        print(f"{name:40} {ours:7.1f} {python:7.1f} {theirs:7.1f}")
    print("\nhost time only (us, GPU kept busy): replayed / Python path")
    for name, fn, make, _ in _int4_cases(dev):
        if "8192" in name:
            a, kw = make()
            ours = host_only_us(lambda fn=fn, a=a, kw=kw: fn(*a, **kw))
            with replay.disabled():
                python = host_only_us(lambda fn=fn, a=a, kw=kw: fn(*a, **kw))
            print(f"{name:40} {ours:7.1f} {python:7.1f}")
    print("checks passed" if not bad else f"{bad} check(s) failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
