"""cuDNN's fused attention (through aten's `_scaled_dot_product_cudnn_attention` and its
backward) as an implementation of `attention` / `attention_backward` on Hopper, where it
measured faster than the Triton kernels for plain attention.

Plain: dense (not varlen), no ALiBi, softcap or window other than causal, causal only when
the query and key lengths are equal (cuDNN aligns the mask top-left, ours bottom-right: the
same when they are equal), head_dim 64 or 128, float16 / bfloat16, every stride a multiple of 8
elements and 16-byte aligned pointers, and a query length of at least `MIN_SEQLEN` (shorter
calls, decode among them, stay on the Triton kernels, whose calls replay from C++: an aten
op on a CUDA tensor refuses a replay recording). `ops._fwd_key` / `_bwd_key` mark such calls
with the feature "plain"; `supports` adds the device rules, so `dispatch.explain` shows why a
call does or does not run here.

H200, bf16, TFLOP/s, ours (Triton) / cuDNN through these ops (`.gpu/cudnn_probe.py`,
2026-12-03): B8 H16 S2048 D128 full forward 484 / 649, forward+backward 356 / 555; causal 405
/ 528 and 284 / 443; B2 H16 S8192 D128 causal 452 / 610 and 367 / 550; B8 H32 S2048 D64 full
436 / 462 and 328 / 436.

The backward is not deterministic (the same inputs gave gradients that differ in their last
bits from run to run on the H200; the Triton backward is bitwise repeatable), and the family
promises a deterministic backward: by default plain calls run cuDNN's forward and a
deterministic backward on its log-sum-exp (the Gluon one on sm_90 since attention 0.8.3,
else Triton's). `OPENKERNELS_ATTENTION_NONDETERMINISTIC=1` (read when a key is
first selected) lets cuDNN's backward run too (B8 H16 S2048 D128 full forward+backward: 555
against 356 TFLOP/s).

Layouts: the kernel takes (B, H, S, D) views of our (B, S, H, D) tensors and returns its
output and gradients in that same memory order, so they are adopted without a copy; its
log-sum-exp is natural-log float32 (B, H, S, 1), ours with a unit dimension (the Triton
backward reads it, and this backward reads the Triton forward's).
"""

from __future__ import annotations

import os

import torch

from openkernels.shared import dispatch

from .adopt import adopt

__all__ = ["attn_fwd", "attn_bwd", "supports", "supports_backward", "is_plain", "MIN_SEQLEN", "HEAD_DIMS", "ARCHS",
           "NONDETERMINISTIC_ENV"]  # fmt: skip

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)

MIN_SEQLEN = 512  # query tokens: shorter calls stay on the (replayable) Triton kernels
HEAD_DIMS = (64, 128)  # measured faster there; other head dims were not measured
ARCHS = ("sm_90",)  # H100 / H200
_DTYPES = (torch.float16, torch.bfloat16)
NONDETERMINISTIC_ENV = "OPENKERNELS_ATTENTION_NONDETERMINISTIC"


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def is_plain(q, k, v, cu_seqlens_q, alibi_slopes, softcap, window_left, window_right, *tensors) -> bool:
    """Does a call's shape and options fit this implementation (everything but the device)?
    q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) with a unit last stride; causal is window (-1, 0)."""
    causal = window_right == 0
    return (
        q.shape[1] >= MIN_SEQLEN  # first: most calls that are not plain are short (decode)
        and cu_seqlens_q is None
        and alibi_slopes is None
        and softcap == 0
        and window_left == -1
        and window_right in (-1, 0)
        and (not causal or q.shape[1] == k.shape[1])
        and q.shape[-1] in HEAD_DIMS
        and q.dtype in _DTYPES
        and all(_aligned(t) for t in (q, k, v, *tensors))
    )


def supports(key: dispatch.DispatchKey) -> str | None:
    """Dispatch predicate: None when cuDNN runs `key`, else why not."""
    if key.backend != "cuda":
        return "cuDNN attention runs on NVIDIA GPUs"
    if key.arch not in ARCHS:
        return f"{key.arch}: cuDNN attention is used where it measured faster than ours ({', '.join(ARCHS)})"
    if "plain" not in key.features:
        return (f"not a plain call (dense, no softcap, ALiBi or window, causal only with equal lengths, head_dim "
                f"{' or '.join(map(str, HEAD_DIMS))}, float16 / bfloat16, aligned, at least {MIN_SEQLEN} queries)")  # fmt: skip
    if _FWD is None or _BWD is None or not torch.backends.cudnn.is_available():
        return "this torch has no cuDNN attention"
    return None


def supports_backward(key: dispatch.DispatchKey) -> str | None:
    """The backward's predicate: `supports`, and an opt-in to a backward that is not deterministic."""
    why = supports(key)
    if why is None and os.environ.get(NONDETERMINISTIC_ENV) != "1":
        why = (f"cuDNN's backward is not deterministic; the family's backward is (set {NONDETERMINISTIC_ENV}=1 "
               "to allow it)")  # fmt: skip
    return why


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale, window_left,
             window_right, alibi_slopes, softcap, dropout_p=0.0, dropout_seed=None) -> None:  # fmt: skip
    """reference.attn_fwd for a plain call (`is_plain`; never with dropout, ops._plain)."""
    res = _FWD(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, window_right == 0, False, scale=scale)
    adopt(out, _bhsd(res[0]))
    lse.copy_(res[1].view(lse.shape))


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale,
             window_left, window_right, alibi_slopes, softcap, dropout_p=0.0,
             dropout_seed=None) -> None:  # fmt: skip
    """reference.attn_bwd for a plain call, from the saved out and lse (any forward's)."""
    seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: never read
    grads = _BWD(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(-1), seed, seed, None, None,
                 None, q.shape[1], k.shape[1], 0.0, window_right == 0, scale=scale)  # fmt: skip
    for dst, src in zip((dq, dk, dv), grads):
        adopt(dst, _bhsd(src))
