"""Public functions of the attention family, with argument checks.

attention(q, k, v):        q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> (B, Sq, Hq, D)
attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
                           q (Tq, Hq, D), k, v (Tk, Hkv, D) packed -> (Tq, Hq, D)
Dtypes: float16 and bfloat16 run the fused kernels; float32 (and float64) run the CPU
path or the reference (`dispatch.explain("attention", q)` says which). Semantics (masks
aligned bottom-right, softcap, ALiBi, empty rows) are in reference.py; attention against a
KV cache is in ../kvcache/, apply_rotary in ../rotary/.
"""

from __future__ import annotations

import torch

from openkernels.shared import replay

from . import ops, problem

__all__ = ["attention", "attention_varlen", "TORCH"]


def _host_values(cu: torch.Tensor) -> list | None:
    """cu_seqlens' values: one small device-to-host copy (a wrong one would read or write out
    of bounds); not known while torch.compile traces, nor on meta tensors."""
    if torch.compiler.is_compiling() or cu.device.type == "meta":
        return None
    return cu.tolist()


TORCH = problem.ArrayKind("torch.Tensor", torch.Tensor, (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                          torch.float32, torch.int32, True, _host_values)  # fmt: skip


def _cached() -> bool:
    """Plain Python options (the usual call) are checked once per combination
    (problem.check_options), never while torch.compile traces (dynamo would turn the cache
    lookup into guards)."""
    return not torch.compiler.is_compiling()


def _dropout_seed(name: str, q: torch.Tensor, dropout_p: float, generator: torch.Generator | None):
    """The Philox key of a call with dropout: int32 (2,) on q's device, drawn from `generator`
    (torch's default one for the device when None), so torch.manual_seed repeats the mask
    and a CUDA graph replay draws a new one; None without dropout."""
    if not dropout_p:
        return None
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"{name}: generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    if generator is not None and generator.device.type != q.device.type:
        raise ValueError(f"{name}: generator is on {generator.device} but q is on {q.device}")
    return torch.randint(-(2**31), 2**31, (2,), dtype=torch.int32, device=q.device, generator=generator)


def _run(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, sinks, dropout_p, seed):
    """The cheapest path that is still correct (opdef picks it): the op's body for plain eager
    tensors, one autograd.Function when gradients are needed, else the library op
    (torch.compile, tensor subclasses, meta tensors). Sinks fold into its output (ops.py)."""
    if sinks is not None:
        return ops.with_sinks(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, sinks, dropout_p,
                              seed)  # fmt: skip
    return ops.ATTENTION(
        q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right, alibi, softcap, dropout_p, seed
    )


@replay.replayable
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
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused scaled dot-product attention (FlashAttention-style, never materializes scores).

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (MQA/GQA read the shared K/V heads, no expansion). Any
    strides with a unit head_dim stride run without copies (a transposed (B, H, S, D) view
    included). head_dim any multiple of 8 up to 256; float16/bfloat16 (float32 on a slower
    path).
    causal: mask keys after each query, aligned bottom-right when seqlen_q != seqlen_k
        (query i sees keys j <= i + seqlen_k - seqlen_q; FlashAttention 2's convention).
    softmax_scale: default 1 / sqrt(head_dim).
    window: (left, right) sliding window around i + seqlen_k - seqlen_q; -1 = unbounded.
    alibi_slopes: float32 (heads_q,) or (batch, heads_q); adds -slope * |distance|.
    softcap: > 0 caps scores with softcap * tanh(s / softcap) (Gemma 2).
    sinks: float32 (heads_q,), learnable attention sinks (gpt-oss): one logit per query head
        that every row's softmax also normalizes over, with a zero value; differentiable.
    dropout_p: in [0, 1): attention dropout, applied whenever it is > 0 (pass 0 outside
        training, as with F.scaled_dot_product_attention): each probability is dropped with
        that chance and the kept ones scaled by 1 / (1 - dropout_p). The mask is drawn on the
        device from a seed that `generator` (default: torch's for q's device) gives each
        call, identically by every backend (reference.py), and regenerated by the backward;
        lse stays the softmax's, before dropout.
    generator: the torch.Generator the dropout seed comes from, or None.
    return_lse: also return the float32 logsumexp (batch, heads_q, seqlen_q); rows that see
        no key give output 0 and lse -inf.
    Returns out (batch, seqlen_q, heads_q, head_dim) in q's dtype [, lse]. Differentiable in
    q, k, v; the backward is deterministic (with dropout too, for a given seed).
    """
    left, right, scale = problem.check_dense_call("attention", TORCH, q, k, v, problem.ATTENTION_HEAD_DIMS, causal,
                                                  softmax_scale, window, alibi_slopes, softcap, sinks, _cached())  # fmt: skip
    dropout_p = problem.check_dropout("attention", dropout_p)
    seed = _dropout_seed("attention", q, dropout_p, generator)
    out, lse = _run(q, k, v, None, None, q.shape[1], k.shape[1], scale, left, right, alibi_slopes, float(softcap),
                    sinks, dropout_p, seed)  # fmt: skip
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
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` over packed sequences of different lengths.

    q: (total_q, heads_q, head_dim), k, v: (total_k, heads_kv, head_dim); sequence i is
    rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of
    k and v. `cu_seqlens_*`: int32 (n_seqs + 1,), starting at 0, non-decreasing (empty
    sequences allowed); `max_seqlen_*`: at least the longest sequence (checked: one small
    device-to-host copy per call). Options as in `attention`, applied per sequence (causal
    aligned bottom-right within each); alibi_slopes (heads_q,) or (n_seqs, heads_q).
    Returns out (total_q, heads_q, head_dim) [, lse (heads_q, total_q)].
    """
    left, right, scale = problem.check_varlen_call(
        "attention_varlen", TORCH, q, k, v, problem.ATTENTION_HEAD_DIMS, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal, softmax_scale, window, alibi_slopes, softcap, sinks, _cached(),
    )  # fmt: skip
    dropout_p = problem.check_dropout("attention_varlen", dropout_p)
    seed = _dropout_seed("attention_varlen", q, dropout_p, generator)
    out, lse = _run(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), scale, left, right,
                    alibi_slopes, float(softcap), sinks, dropout_p, seed)  # fmt: skip
    return (out, lse) if return_lse else out
