"""Public functions of the attention family, with argument checks.

attention(q, k, v):        q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> (B, Sq, Hq, D)
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                           q (Tq, Hq, D), k, v (Tk, Hkv, D) packed -> (Tq, Hq, D)
Dtypes: float16 and bfloat16 run the fused kernels; float32 (and float64) run the CPU
path or the reference (`dispatch.explain("attention", q)` says which). Semantics (masks
aligned bottom-right, softcap, ALiBi, empty rows) are in reference.py.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch

from . import ops

__all__ = ["attention", "attention_varlen"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_options(name, causal, softmax_scale, window, softcap) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
        or not math.isfinite(softmax_scale) or softmax_scale <= 0
    ):  # fmt: skip
        raise ValueError(
            f"{name}: softmax_scale must be a positive finite float or None, got {softmax_scale!r}"
        )
    if (
        not isinstance(window, (tuple, list)) or len(window) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)
    ):  # fmt: skip
        raise ValueError(f"{name}: window must be a pair of ints >= -1 (-1: unbounded side), got {window!r}")
    if (
        not isinstance(softcap, numbers.Real)
        or isinstance(softcap, bool)
        or not softcap >= 0
        or math.isinf(softcap)
    ):
        raise ValueError(f"{name}: softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    left, right = int(window[0]), int(window[1])
    return left, 0 if causal else right


def _check_qkv(name: str, q: object, k: object, v: object, dims: int) -> None:
    layout = "(batch, seqlen, heads, head_dim)" if dims == 4 else "(tokens, heads, head_dim)"
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name}: {what} must be {dims}D {layout}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: q, k, v must share a dtype, got q {q.dtype} and {what} {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name}: q, k, v must be on one device, got q on {q.device} and {what} on {t.device}"
            )
    if q.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    if k.shape != v.shape:
        raise ValueError(
            f"{name}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if dims == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"{name}: q has batch {q.shape[0]} but k has batch {k.shape[0]}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{name}: q has head_dim {head_dim} but k and v have {k.shape[-1]}")
    if head_dim not in ops.HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {head_dim} is not supported; supported: {ops.HEAD_DIMS}")
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{name}: heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for MQA/GQA"
        )


def _check_alibi(name: str, alibi_slopes: object, q: torch.Tensor, n_seqs: int) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(
            f"{name}: alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"{name}: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"{name}: alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    heads = q.shape[-2]
    if tuple(alibi_slopes.shape) not in ((heads,), (n_seqs, heads)):
        raise ValueError(
            f"{name}: alibi_slopes must have shape ({heads},) or ({n_seqs}, {heads}), got {tuple(alibi_slopes.shape)}"
        )


def _check_cu_seqlens(
    name: str, what: str, cu: object, q: torch.Tensor, tokens: int, max_seqlen: object
) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: {what} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: {what} must be 1D (n_seqs + 1,), got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name}: {what} is on {cu.device} but q is on {q.device}")
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise ValueError(f"{name}: max_seqlen for {what} must be an int >= 0, got {max_seqlen!r}")
    if torch.compiler.is_compiling() or cu.device.type == "meta":
        return  # values are not known while tracing (or on meta tensors)
    # One small device-to-host copy: a wrong cu_seqlens would read or write out of bounds.
    values = cu.tolist()
    if values[0] != 0 or values[-1] != tokens:
        raise ValueError(f"{name}: {what} must start at 0 and end at the token count {tokens}, got "
                         f"{values[0]} ... {values[-1]}")  # fmt: skip
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: {what} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"{name}: max_seqlen {max_seqlen} is below the longest sequence ({max(lengths)}) in {what}"
        )


def _run(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap):
    """The cheapest path that is still correct: the library op under torch.compile, for
    tensor subclasses and meta tensors (its fake), the autograd.Function when gradients are
    needed, else the op's body."""
    tensors = (q, k, v)
    if (
        torch.compiler.is_compiling()
        or any(type(t) is not torch.Tensor for t in tensors)
        or q.device.type not in ("cpu", "cuda")
    ):
        return torch.ops.openkernels.attention(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return ops.EagerAttention.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap)
    return ops.forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled dot-product attention (FlashAttention-style, never materializes scores).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA read the shared K/V heads, no expansion). Any
    strides with a unit head_dim stride run without copies (a transposed (B, H, S, D) view
    included). head_dim in 32, 64, 96, 128, 192, 256; float16/bfloat16 (float32 on a slower
    path).
    causal: mask keys after each query, aligned bottom-right when seqlen_q != seqlen_k
        (query i sees keys j <= i + seqlen_k - seqlen_q; FlashAttention 2's convention).
    softmax_scale: default 1 / sqrt(head_dim).
    window: (left, right) sliding window around i + seqlen_k - seqlen_q; -1 = unbounded.
    alibi_slopes: float32 (heads_q,) or (batch, heads_q); adds -slope * |distance|.
    softcap: > 0 caps scores with softcap * tanh(s / softcap) (Gemma 2).
    return_lse: also return the float32 logsumexp (batch, heads_q, seqlen_q); rows that see
        no key give output 0 and lse -inf.
    Returns out (batch, seqlen_q, heads_q, head_dim) in q's dtype [, lse]. Differentiable in
    q, k, v; the backward is deterministic.
    """
    name = "attention"
    _check_qkv(name, q, k, v, 4)
    left, right = _check_options(name, causal, softmax_scale, window, softcap)
    _check_alibi(name, alibi_slopes, q, q.shape[0])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _run(
        q, k, v, None, None, q.shape[1], k.shape[1], scale, left, right, alibi_slopes, float(softcap)
    )
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` over packed sequences of different lengths.

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim); sequence i is
    rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of
    k and v. cu_seqlens_*: int32 (n_seqs + 1,), starting at 0, non-decreasing (empty
    sequences allowed); max_seqlen_*: at least the longest sequence (checked: one small
    device-to-host copy per call). Options as in `attention`, applied per sequence (causal
    aligned bottom-right within each); alibi_slopes (heads_q,) or (n_seqs, heads_q).
    Returns out (total_q, heads_q, head_dim) [, lse (heads_q, total_q)].
    """
    name = "attention_varlen"
    _check_qkv(name, q, k, v, 3)
    _check_cu_seqlens(name, "cu_seqlens_q", cu_seqlens_q, q, q.shape[0], max_seqlen_q)
    _check_cu_seqlens(name, "cu_seqlens_k", cu_seqlens_k, q, k.shape[0], max_seqlen_k)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_seqlens_q.shape[0] - 1} and {cu_seqlens_k.shape[0] - 1}")  # fmt: skip
    left, right = _check_options(name, causal, softmax_scale, window, softcap)
    _check_alibi(name, alibi_slopes, q, cu_seqlens_q.shape[0] - 1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out, lse = _run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, left, right,
                    alibi_slopes, float(softcap))  # fmt: skip
    return (out, lse) if return_lse else out
