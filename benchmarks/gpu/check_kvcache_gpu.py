"""GPU check of attention against a KV cache: the Triton kernels (append and attention,
split or not) against the reference backend on the same cache, for every cache format,
contiguous and paged, decode and chunked prefill, each option, and long ragged caches.

    python benchmarks/gpu/check_kvcache_gpu.py
"""

from __future__ import annotations

import itertools
import time

import torch

import openkernels.attention as A
from _compare import relative_error
from openkernels.attention.kvcache import triton as launcher
from openkernels.attention.kvcache.format import unpack_codes
from openkernels.shared import dispatch

DEV = "cuda"


def _rotary(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=DEV, dtype=torch.float32) / dim)
    ang = torch.arange(rows, device=DEV, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def check(lengths, sq=1, hq=32, hkv=8, d=128, kv_dtype=torch.bfloat16, group=None, page=None, splits=None,
          dtype=torch.bfloat16, rotary=False, **kw) -> bool:  # fmt: skip
    b = len(lengths)
    cap = max(lengths) + sq
    caches = []
    k0 = torch.randn(b, max(lengths), hkv, d, device=DEV, dtype=dtype)
    v0 = torch.randn_like(k0)
    perm = None
    for _ in range(2):  # identical caches: one for the kernels, one for the reference
        c = A.KVCache(b, cap, hkv, d, kv_dtype=kv_dtype if kv_dtype in ("int8", "int4") else dtype, group_size=group,
                      page_size=page, device=DEV)  # fmt: skip
        if page is not None:  # pages in a random order (the same for both)
            if perm is None:
                perm = torch.randperm(c.block_table.numel(), device=DEV).to(torch.int32)
            c.block_table = perm.view_as(c.block_table)
        caches.append(c)
    q = torch.randn(b, sq, hq, d, device=DEV, dtype=dtype)
    kn, vn = (
        torch.randn(b, sq, hkv, d, device=DEV, dtype=dtype),
        torch.randn(b, sq, hkv, d, device=DEV, dtype=dtype),
    )
    opts = dict(kw)
    if rotary:
        opts["rotary_cos"], opts["rotary_sin"] = _rotary(cap, d // 2)
    outs = []
    for c, impl in zip(caches, ("triton", "reference")):
        with dispatch.force(impl):
            # ragged lengths: append each sequence's prompt (the same bf16 values in both caches)
            c.reset()
            c.append(k0, v0)  # every sequence gets max(lengths) tokens ...
            c.seqlens.copy_(torch.tensor(lengths, device=DEV, dtype=torch.int32))  # ... then keeps its own
            c._lengths = list(lengths)
            launcher.FORCE_SPLITS = splits
            outs.append(c.attend(q, kn, vn, return_lse=True, **opts))
            launcher.FORCE_SPLITS = None
    (o, lse), (ro, rl) = outs
    same_cache = _same_cache(caches[0], caches[1])
    e = max(relative_error(o, ro), relative_error(lse, rl))
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    ok = e <= tol and same_cache
    label = (f"lens={lengths if len(lengths) < 5 else f'{len(lengths)}x~{max(lengths)}'} sq={sq} h={hq}/{hkv} d={d} "
             f"{kv_dtype if isinstance(kv_dtype, str) else str(kv_dtype)[6:]} g={group} page={page} splits={splits} "
             f"{'rotary ' if rotary else ''}{kw}")  # fmt: skip
    print(f"{'ok ' if ok else 'BAD'} err {e:.2e} cache_equal={same_cache}  {label}")
    return ok


def _same_cache(a: A.KVCache, b: A.KVCache) -> bool:
    """16-bit data, scales and zeros equal; codes equal but for rare neighbours (an ulp at .5)."""
    for x, y in zip((a.k, a.v), (b.k, b.v)):
        if not isinstance(x, A.QuantizedKV):
            if not torch.equal(x, y):
                return False
            continue
        if not (torch.equal(x.scale, y.scale) and torch.equal(x.zero, y.zero)):
            return False
        cx = unpack_codes(x.data, x.bits).int()
        cy = unpack_codes(y.data, y.bits).int()
        diff = (cx - cy).abs()
        if diff.max() > 1 or (diff > 0).float().mean() > 1e-4:
            return False
    return True


def main() -> None:
    torch.manual_seed(0)
    t0 = time.time()
    results = []
    formats = [(torch.bfloat16, None), ("int8", None), ("int8", 32), ("int4", None), ("int4", 32)]
    for (kvd, g), page, sq in itertools.product(formats, (None, 16, 64), (1, 7, 64)):
        results.append(check([1, 300, 1029, 77], sq=sq, kv_dtype=kvd, group=g, page=page))
    for kw in ({"window": (100, -1)}, {"causal": False}, {"softcap": 30.0},
               {"alibi_slopes": torch.rand(32, device=DEV)}, {"window": (50, 0), "softcap": 5.0}):  # fmt: skip
        for kvd, g in ((torch.bfloat16, None), ("int4", 32)):
            results.append(check([5, 700, 2049], sq=4, kv_dtype=kvd, group=g, page=32, **kw))
    for inter in (False, True):
        results.append(check([0, 33, 2000], sq=3, rotary=True, rotary_interleaved=inter))
        results.append(check([10, 600], sq=1, rotary=True, rotary_interleaved=inter, kv_dtype="int8"))
    results.append(check([3000, 17], sq=1, splits=7))
    results.append(check([3000, 17], sq=5, splits=3, kv_dtype="int4"))
    results.append(check([70000, 1, 4096], sq=1, kv_dtype="int4", group=32, page=256))
    results.append(check([131072 - 1], sq=1))
    results.append(check([131072 - 1], sq=1, kv_dtype="int8", page=16))
    results.append(check([300, 900], sq=2, hq=8, hkv=8, d=64))
    results.append(check([300, 900], sq=2, hq=8, hkv=1, d=256, kv_dtype="int4", group=128))
    results.append(check([300, 900], sq=2, hq=6, hkv=2, d=96, kv_dtype="int8", group=32))
    results.append(check([300, 900], sq=9, dtype=torch.float16, kv_dtype="int4"))
    bad = sum(not r for r in results)
    print(f"{len(results) - bad}/{len(results)} checks passed in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
