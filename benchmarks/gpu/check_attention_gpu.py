"""Quick GPU check of the attention Triton kernels against the float32 reference: every
option alone and a few combined, forward, lse and gradients, bf16 and fp16, dense and varlen.

    python benchmarks/gpu/check_attention_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import openkernels.attention as A
from _compare import relative_error
from openkernels.attention.core import reference as R
from openkernels.shared import dispatch


def check(b=2, sq=300, sk=300, hq=8, hkv=2, d=128, dtype=torch.bfloat16, varlen=None, **kw) -> bool:
    dev = "cuda"
    if varlen:
        lq, lk = varlen
        cq = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        shapes = ((int(cq[-1]), hq, d), (int(ck[-1]), hkv, d))
    else:
        shapes = ((b, sq, hq, d), (b, sk, hkv, d))
    q = torch.randn(shapes[0], device=dev, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shapes[1], device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
    with dispatch.force("triton"):
        if varlen:
            o, lse = A.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
        else:
            o, lse = A.attention(q, k, v, return_lse=True, **kw)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, (q, k, v), do)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    if varlen:
        ro, rl = R.attention_varlen_ref(*leaves, cq, ck, return_lse=True, **kw)
    else:
        ro, rl = R.attention_ref(*leaves, return_lse=True, **kw)
    rg = torch.autograd.grad(ro, leaves, do.float())
    errs = [relative_error(x, ref) for x, ref in [(o, ro), (lse, rl), *zip(grads, rg)]]
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    peer = ""
    if not varlen and set(kw) <= {"causal", "softmax_scale"}:
        # FlashAttention's test rule: within 2x (plus a little) of what SDPA in the same dtype
        # gets against the same float32 reference.
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            po = F.scaled_dot_product_attention(qt, kt, vt, is_causal=kw.get("causal", False) and sq == sk,
                                                scale=kw.get("softmax_scale"), enable_gqa=hq != hkv)  # fmt: skip
            pg = torch.autograd.grad(po, (qt, kt, vt), do.transpose(1, 2))
        perrs = [relative_error(x.transpose(1, 2), ref) for x, ref in [(po, ro), *zip(pg, rg)]]
        peer = " | sdpa-flash out {:.2e} dq {:.2e} dk {:.2e} dv {:.2e}".format(*perrs)
        if sq == sk:
            ours = [errs[0], *errs[2:]]
            ok = all(e <= 2 * p + 1e-3 for e, p in zip(ours, perrs)) and errs[1] <= tol
        else:
            ok = all(e <= tol for e in errs)
    else:
        ok = all(e <= tol for e in errs)
    name = {k2: (v2 if not isinstance(v2, torch.Tensor) else "t") for k2, v2 in kw.items()}
    print(f"{'ok ' if ok else 'BAD'} {str(dtype)[6:]} b{b} sq{sq} sk{sk} h{hq}/{hkv} d{d} varlen={bool(varlen)} "
          f"{name}  out {errs[0]:.2e} lse {errs[1]:.2e} dq {errs[2]:.2e} dk {errs[3]:.2e} dv {errs[4]:.2e}{peer}",
          flush=True)  # fmt: skip
    return ok


def main() -> None:
    torch.manual_seed(0)
    results = []
    for d in (32, 64, 96, 128, 192, 256):
        results.append(check(d=d))
        results.append(check(d=d, causal=True, sq=257, sk=515))
    for dtype in (torch.float16, torch.bfloat16):
        results.append(check(dtype=dtype, causal=True))
        results.append(check(dtype=dtype, sq=515, sk=257, causal=True))
        results.append(check(dtype=dtype, window=(100, 30)))
        results.append(check(dtype=dtype, window=(64, -1), causal=True))
        results.append(check(dtype=dtype, alibi_slopes=torch.rand(8, device="cuda"), causal=True))
        results.append(check(dtype=dtype, softcap=20.0, causal=True))
        results.append(check(dtype=dtype, softmax_scale=0.3, hkv=1))
        results.append(check(dtype=dtype, varlen=([300, 0, 1, 129], [300, 5, 1, 0]), causal=True))
        results.append(check(dtype=dtype, varlen=([513, 77], [700, 77]), window=(50, 50),
                             alibi_slopes=torch.rand(2, 8, device="cuda"), softcap=10.0))  # fmt: skip
    results.append(check(b=1, sq=4096, sk=4096, hq=4, hkv=4, causal=True))
    print(f"{sum(results)}/{len(results)} checks passed")


if __name__ == "__main__":
    main()
