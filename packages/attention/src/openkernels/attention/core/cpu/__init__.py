"""CPU backend of the attention family: PyTorch's CPU flash kernel where the options map onto
it (sdpa.py), a blockwise online softmax in torch ops for the rest (blockwise.py), and for
calls of at most decode.MAX_ROWS query rows per KV head the C++ decode kernel (decode.py),
forward and backward (the backward up to decode.MAX_BACKWARD_KEYS keys), every option included.
Calls with dropout run the reference (reference.py: chunked float32 matmuls, the mask drawn
in torch ops), which draws the same mask as the GPU kernels from the same seed.

Entry points and contract as reference.attn_fwd / attn_bwd (reference.py's docstring): every
option runs (causal and sliding windows aligned bottom-right, ALiBi, softcap, GQA/MQA, varlen,
rows with no visible key), float16 / bfloat16 / float32 / float64, math in float32 (float64
for float64). Dense calls run the whole batch at once; varlen calls one sequence at a time.
"""

from __future__ import annotations

from types import ModuleType

import torch

from openkernels.shared import dispatch, replay

from .. import reference
from . import blockwise, decode, sdpa

__all__ = ["attn_fwd", "attn_bwd", "supports", "FORCE_PATH"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# "sdpa" or "blockwise" to pin the path (tests; softcap always runs blockwise); "decode" (or
# None) lets the decode kernel take the forwards and backwards it runs (`_runs_decode`).
FORCE_PATH: str | None = None


def supports(key: dispatch.DispatchKey) -> str | None:
    """Dispatch predicate: None when this backend runs `key` (every option, any size), else why not."""
    if key.dtype not in _DTYPES:
        return f"dtype {key.dtype}: the CPU backend takes float16, bfloat16, float32 and float64"
    return None


def _path(softcap: float) -> str:
    """Which implementation runs a call: the flash kernel wherever it can.

    Measured on the 2-core AVX2 development machine (shared, so one thread and CPU time:
    min of 3-5 runs), forward / backward ms, flash kernel vs blockwise vs reference:
      B2 H8 S1024 D64 fp32        61/172 vs 105/239 vs 378/710; causal  51/141 vs  71/158
      B2 H8 S1024 D128 fp32      133/347 vs 244/447 vs 437/955; causal 102/279 vs 130/295
      B2 H8 S1024 D64/128 bf16    67/169, 102/236 (causal D128) vs 106/252, 116/266
      GQA 4 (H8/2) D64 fp32       62/162 vs 93/190;  causal 60/132 vs 79/134 (a tie backward)
      GQA 4 D64 bf16 causal       55/134 vs 71/152
      window (256, 0) S1024       37/97 vs 81/133;  S4096: 177/427 vs 380/599
      ALiBi (mask) S1024          116/287 vs 352/499; causal 120/183 vs 133/257
      causal Sq256 x Sk1024       27/63 vs 30/72;   B16 S17 causal: 1.0/1.7 vs 1.9/3.2
    With 2 threads on a busy machine the blockwise path's many small parallel ops lose
    much more (fp32 causal: 2120/3099 vs 88/308). Softcap (blockwise only): 176/316 vs
    564/1072 for the reference (B2 H8 S1024 D64 fp32).
    """
    if softcap > 0 or not sdpa.available():
        return "blockwise"  # the CPU flash kernel has no softcap
    if FORCE_PATH is not None:
        return FORCE_PATH
    return "sdpa"  # faster in every case measured above


def _runs_decode(q, k, v, lse, alibi_slopes, written: tuple, backward: bool = False) -> bool:
    """A dense call runs on the decode kernel (forward: written = (out,); backward: (dq, dk, dv)):
    one C++ call replayed whole, where the flash kernel's goes through several aten ops. See
    decode.why_not_dense."""
    if FORCE_PATH not in (None, "decode") or not all(t.is_contiguous() for t in (lse, *written)):
        return False
    if alibi_slopes is not None and alibi_slopes.stride(-1) != 1:
        return False
    return decode.why_not_dense(q, k, v, backward) is None


def _implementation(
    scale: float, window_left: int, window_right: int, softcap: float
) -> tuple[ModuleType, dict[str, float]]:
    """The module that runs a call the decode kernel does not take (`_path`) and its keyword
    options (only blockwise takes softcap): one rule for attn_fwd and attn_bwd, so the two choose alike."""
    impl = blockwise if _path(softcap) == "blockwise" else sdpa
    opts: dict[str, float] = dict(scale=scale, left=window_left, right=window_right)
    if impl is blockwise:
        opts["softcap"] = softcap
    return impl, opts


def _one_batch(q, k, cu_seqlens_q) -> bool:
    """A dense call with queries and keys runs as one batch: no per-sequence slices."""
    return cu_seqlens_q is None and bool(q.shape[1]) and bool(k.shape[1])


def _sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
    """(q rows, k rows, slopes) per group of equal-length sequences: the dense batch at once, or
    each varlen sequence (slices of dim 1 of the (1, T, H, D) tensors)."""
    if cu_seqlens_q is None:
        yield slice(None), slice(None), alibi_slopes
        return
    replay.reads_host_values("cu_seqlens")  # values baked into a recording
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        slopes = None if alibi_slopes is None else alibi_slopes[i : i + 1]
        yield slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), slopes


def attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale, window_left,
             window_right, alibi_slopes, softcap, dropout_p=0.0, dropout_seed=None) -> None:  # fmt: skip
    if dropout_p > 0:
        reference.attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, scale=scale, window_left=window_left, window_right=window_right,
                           alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                           dropout_seed=dropout_seed)  # fmt: skip
        return
    impl, opts = _implementation(scale, window_left, window_right, softcap)
    with torch.no_grad():
        if _one_batch(q, k, cu_seqlens_q):
            if _runs_decode(q, k, v, lse, alibi_slopes, (out,)):
                decode.attend(q, k, v, out, lse, None, None, seqlen_new=k.shape[1], scale=scale,
                              window_left=window_left, window_right=window_right, alibi_slopes=alibi_slopes,
                              softcap=softcap, leftpad=None)  # fmt: skip
                return
            impl.forward(q, k, v, out, lse, alibi_slopes, **opts)
            return
        for rq, rk, slopes in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
            qs, ks, vs, os, ls = q[:, rq], k[:, rk], v[:, rk], out[:, rq], lse[:, :, rq]
            if qs.shape[1] == 0:
                continue
            if ks.shape[1] == 0:  # no keys: every row empty
                os.zero_()
                ls.fill_(float("-inf"))
                continue
            impl.forward(qs, ks, vs, os, ls, slopes, **opts)


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
             scale, window_left, window_right, alibi_slopes, softcap, dropout_p=0.0,
             dropout_seed=None) -> None:  # fmt: skip
    if dropout_p > 0:
        reference.attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, scale=scale, window_left=window_left, window_right=window_right,
                           alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                           dropout_seed=dropout_seed)  # fmt: skip
        return
    impl, opts = _implementation(scale, window_left, window_right, softcap)
    with torch.no_grad():
        if _one_batch(q, k, cu_seqlens_q):
            if dout.stride(-1) == 1 and _runs_decode(q, k, v, lse, alibi_slopes, (dq, dk, dv), backward=True):
                decode.backward_dense(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, scale=scale,
                                      window_left=window_left, window_right=window_right, softcap=softcap)  # fmt: skip
                return
            impl.backward(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, **opts)
            return
        for rq, rk, slopes in _sequences(q, k, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
            grads = dq[:, rq], dk[:, rk], dv[:, rk]
            if q[:, rq].shape[1] == 0 or k[:, rk].shape[1] == 0:  # nothing attends: zero gradients
                for g in grads:
                    g.zero_()
                continue
            impl.backward(dout[:, rq], q[:, rq], k[:, rk], v[:, rk], out[:, rq], lse[:, :, rq], *grads, slopes,
                          **opts)  # fmt: skip
