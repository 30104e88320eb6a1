"""Reference attention: plain matmul-softmax-matmul in float32 (float64 for float64 inputs).

Semantics every backend follows (the same as FlashAttention 2):
  scores   s[i, j] = softmax_scale * q_i . k_j
  softcap  s = softcap * tanh(s / softcap)                      (when softcap > 0)
  ALiBi    s -= slope[h] * |i + sk - sq - j|                    (after the softcap)
  masks    query i of a sequence of sq queries sits at key position i + sk - sq (aligned
           bottom-right); key j is visible when
             j >= i + sk - sq - window_left   (window_left >= 0)
             j <= i + sk - sq + window_right  (window_right >= 0); causal is window_right = 0
  output   o_i = sum_j softmax(s_i)_j v_j; a row with no visible key gives o_i = 0 and
           lse_i = -inf (log of an empty sum)
  lse      natural-log logsumexp of each row of s, float32 (before any dropout).
  dropout  with dropout_p > 0 and a seed (int32 (2,): the Philox key k0, k1), the
           probability of query i and key j (indices within their sequence) of head h of
           sequence b draws Philox-4x32-7 with counter (j // 4, i, b * heads_q + h, 0);
           of its four 32-bit words, word j % 4, r, keeps it when r >= round(dropout_p *
           2**32) (unsigned), and kept ones are scaled by 1 / (1 - dropout_p). Every
           backend draws the same mask from the same seed (`dropout_keep`).
GQA/MQA: query head h reads key/value head h // (heads_q // heads_kv).

Backend entry points (ops.py calls them; every backend has the same two):
  attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
           scale, window_left, window_right, alibi_slopes, softcap, dropout_p, dropout_seed)
  attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
           max_seqlen_k, scale, window_left, window_right, alibi_slopes, softcap, dropout_p,
           dropout_seed)
q: (B, Sq, Hq, D), k, v: (B, Sk, Hkv, D), any strides with a unit last stride. Varlen calls
pass B = 1 with the packed tokens on dim 1 and int32 cu_seqlens_q / cu_seqlens_k of shape
(n_seqs + 1,) (None for dense calls). out, dout, dq: like q; dk, dv: like k (out, dq, dk,
dv contiguous, written in full). lse: (B, Hq, Sq) float32 contiguous; (1, Hq, Tq) varlen.
alibi_slopes: None, or float32 (n_seqs, Hq) contiguous (a (Hq,) input is expanded).
window_*: -1 for unbounded. dropout_p: 0 (off) or in (0, 1), with dropout_seed an int32 (2,)
tensor on q's device (None when off). Outputs are written in place; nothing is returned.
"""

from __future__ import annotations

import torch

from openkernels.shared import replay

from .problem import PHILOX_ROUNDS, dropout_threshold

__all__ = [
    "attention_ref",
    "attention_varlen_ref",
    "attn_fwd",
    "attn_bwd",
    "compute_dtype",
    "dropout_keep",
    "dropout_threshold",
    "philox4x32",
    "PHILOX_ROUNDS",
]

# Query rows per reference chunk: bounds the float32 score matrix the reference
# materializes to chunk x sk per head.
_CHUNK_ELEMENTS = 2**26


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- dropout: the mask every backend draws (module docstring) ---------------------------
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)
_WORD = 0xFFFFFFFF
# Query rows per reference chunk with dropout: the mask takes a dozen int64 temporaries.
_DROPOUT_CHUNK_ELEMENTS = 2**21


def _mul_wide(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m for a in [0, 2**32) (int64) and a 32-bit constant m,
    in int64 without overflow: a is split in 16-bit halves."""
    low = (a & 0xFFFF) * m
    t = (a >> 16) * m + (low >> 16)
    return t >> 16, ((t & 0xFFFF) << 16) | (low & 0xFFFF)


def philox4x32(key: tuple, c0, c1, c2, c3, rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 (Salmon et al. 2011) on int64 tensors holding unsigned 32-bit words: the
    four output words of counter (c0, c1, c2, c3) under key (k0, k1); what the Triton
    kernels' `_philox` computes."""
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mul_wide(c0, _PHILOX_MUL[0])
        hi1, lo1 = _mul_wide(c2, _PHILOX_MUL[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_KEY_STEP[0]) & _WORD, (k1 + _PHILOX_KEY_STEP[1]) & _WORD
    return c0, c1, c2, c3


def dropout_keep(seed: torch.Tensor, heads: torch.Tensor, rows: torch.Tensor, n_keys: int,
                 dropout_p: float) -> torch.Tensor:  # fmt: skip
    """Which probabilities dropout keeps: (len(heads), len(rows), n_keys) bool for keys 0..n_keys
    - 1. seed: int32 (2,); heads: the counter's head word b * heads_q + h per head; rows: query
    indices within the sequence (module docstring)."""
    key = seed.to(torch.int64) & _WORD
    groups = torch.arange((n_keys + 3) // 4, device=rows.device)
    c0 = groups[None, None, :]
    c1 = rows.to(torch.int64)[None, :, None]
    c2 = heads.to(torch.int64)[:, None, None]
    shape = (len(heads), len(rows), len(groups))
    words = philox4x32(
        (key[0], key[1]), c0.expand(shape), c1.expand(shape), c2.expand(shape), c0.new_zeros(shape)
    )
    draws = torch.stack(words, dim=-1).flatten(-2)[..., :n_keys]
    return draws >= dropout_threshold(dropout_p)


def _dropout_factor(seed, heads, rows, n_keys, dropout_p, dtype) -> torch.Tensor:
    """keep / (1 - dropout_p) as (H, R, n_keys) in `dtype`."""
    keep = dropout_keep(seed, heads, rows, n_keys, dropout_p)
    return keep.to(dtype) / (1.0 - dropout_p)


def _visible(sq: int, sk: int, rows: torch.Tensor, window_left: int, window_right: int) -> torch.Tensor:
    """(len(rows), sk) bool: which keys each query row (its index within the sequence) sees."""
    diag = rows[:, None] + (sk - sq)
    cols = torch.arange(sk, device=rows.device)[None, :]
    mask = torch.ones(len(rows), sk, dtype=torch.bool, device=rows.device)
    if window_left >= 0:
        mask &= cols >= diag - window_left
    if window_right >= 0:
        mask &= cols <= diag + window_right
    return mask


def _scores(q, k, slopes, *, scale, window_left, window_right, softcap, rows, sq):
    """Masked scores (H, R, Sk) of `_attend_one`, and tanh(raw / softcap) (None without a cap)."""
    sk = k.shape[1]
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if slopes is not None:
        dist = (rows[:, None] + (sk - sq) - torch.arange(sk, device=q.device)[None, :]).abs()
        s = s - slopes[:, None, None] * dist.to(s.dtype)
    return s.masked_fill(~_visible(sq, sk, rows, window_left, window_right), float("-inf")), t


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor | None,
    *,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    rows: torch.Tensor,
    sq: int,
    sinks: torch.Tensor | None = None,
    dropout: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q: (H, R, D) (rows `rows` of its sq queries), k, v: (H, Sk, D) in the
    compute dtype, heads already matched; slopes, sinks: (H,) or None; dropout: None or
    (seed, heads, dropout_p) (see dropout_keep). Returns (o (H, R, D), lse (H, R))."""
    sk = k.shape[1]
    if sk == 0:  # no keys: every row is empty (but for its sink)
        empty = (
            q.new_full(q.shape[:-1], float("-inf")) if sinks is None else sinks[:, None].expand(q.shape[:-1])
        )
        return q.new_zeros(q.shape) + 0 * q, empty
    s, _ = _scores(q, k, slopes, scale=scale, window_left=window_left, window_right=window_right,
                   softcap=softcap, rows=rows, sq=sq)  # fmt: skip
    if sinks is not None:  # one more key per head: logit sinks[h], value 0
        s = torch.cat((s, sinks[:, None, None].expand(*s.shape[:-1], 1)), dim=-1)
        v = torch.cat((v, v.new_zeros(v.shape[0], 1, v.shape[2])), dim=1)
    # Softmax is shift-invariant, so the row max is detached; a row with no visible key has
    # max -inf: shifted by 0 instead, its terms are exp(-inf) = 0 (no NaN, in autograd too).
    row_max = s.detach().amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    e = torch.exp(s - row_max)
    total = e.sum(dim=-1, keepdim=True)
    p = e / total.masked_fill(total == 0, 1.0)
    lse = (row_max + torch.log(total)).squeeze(-1)  # log(0) = -inf for empty rows
    if dropout is not None:  # the keys' probabilities only (a sink's value is 0)
        seed, heads, dropout_p = dropout
        factor = _dropout_factor(seed, heads, rows, sk, dropout_p, p.dtype)
        p = torch.cat((p[..., :sk] * factor, p[..., sk:]), dim=-1)
    return torch.matmul(p, v), lse


def _dropout_for(seq: int, hq: int, dropout_p: float, seed, device) -> tuple | None:
    """_attend_one's dropout argument for sequence `seq` (None when off)."""
    if not dropout_p:
        return None
    return seed, seq * hq + torch.arange(hq, device=device), dropout_p


def attend(q, k, v, slopes, *, scale, window_left, window_right, softcap, sinks=None, dropout_p=0.0,
           dropout_seed=None, seq=0):  # fmt: skip
    """One sequence, all rows: q (Sq, Hq, D), k, v (Sk, Hkv, D) -> o (Sq, Hq, D), lse (Hq, Sq);
    sinks: (Hq,) learnable sink logits (see attention_ref) or None; dropout_p, dropout_seed:
    dropout as the module docstring draws it, for sequence number `seq`."""
    acc = compute_dtype(q.dtype)
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    qh = q.to(acc).transpose(0, 1)
    kh = k.to(acc).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    vh = v.to(acc).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    sl = None if slopes is None else slopes.to(acc)
    dropout = _dropout_for(seq, hq, dropout_p, dropout_seed, q.device)
    chunk = max(1, (_DROPOUT_CHUNK_ELEMENTS if dropout else _CHUNK_ELEMENTS) // max(1, hq * sk))
    outs, lses = [], []
    for start in range(0, sq, chunk):
        rows = torch.arange(start, min(sq, start + chunk), device=q.device)
        o, lse = _attend_one(
            qh[:, start : start + chunk], kh, vh, sl, scale=scale, window_left=window_left,
            window_right=window_right, softcap=softcap, rows=rows, sq=sq,
            sinks=None if sinks is None else sinks.to(acc), dropout=dropout,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape, dtype=acc), q.new_zeros((hq, 0), dtype=acc)
    return torch.cat(outs, dim=1).transpose(0, 1), torch.cat(lses, dim=1)


def _attend_grads(q, k, v, out, dout, slopes, *, scale, window_left, window_right, softcap, dropout_p=0.0,
                  dropout_seed=None, seq=0):  # fmt: skip
    """Gradients of `_attend` for one sequence with keys: q, out, dout (Sq, Hq, D), k, v (Sk,
    Hkv, D) -> dq, dk, dv in the compute dtype; delta = rowsum(dout * out) from the out given,
    as the kernels take it (learnable sinks, ops.py, hand it a scaled one). Explicit, not autograd: attn_bwd also runs inside the
    library op (torch.compile, opcheck), below the Autograd dispatch key, where autograd
    records nothing."""
    acc = compute_dtype(q.dtype)
    sq, hq, _ = q.shape
    sk, hkv, _ = k.shape
    qh, doh = q.to(acc).transpose(0, 1), dout.to(acc).transpose(0, 1)
    delta = (doh * out.to(acc).transpose(0, 1)).sum(dim=-1, keepdim=True)  # (Hq, Sq, 1)
    kh = k.to(acc).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    vh = v.to(acc).transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    sl = None if slopes is None else slopes.to(acc)
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
    dropout = _dropout_for(seq, hq, dropout_p, dropout_seed, q.device)
    chunk = max(1, (_DROPOUT_CHUNK_ELEMENTS if dropout else _CHUNK_ELEMENTS) // max(1, hq * sk))
    for start in range(0, sq, chunk):
        rows = torch.arange(start, min(sq, start + chunk), device=q.device)
        r = slice(start, start + chunk)
        s, t = _scores(qh[:, r], kh, sl, scale=scale, window_left=window_left, window_right=window_right,
                       softcap=softcap, rows=rows, sq=sq)  # fmt: skip
        row_max = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - row_max.masked_fill(torch.isinf(row_max), 0.0))
        total = e.sum(dim=-1, keepdim=True)
        p = e / total.masked_fill(total == 0, 1.0)  # rows with no visible key: 0
        dp = torch.matmul(doh[:, r], vh.transpose(-1, -2))
        kept = p
        if dropout is not None:  # o = (p * factor) v: dV sees the dropped p, dP the factor
            factor = _dropout_factor(dropout[0], dropout[1], rows, sk, dropout_p, p.dtype)
            kept = p * factor
            dp = dp * factor
        ds = p * (dp - delta[:, r])
        if t is not None:
            ds = ds * (1 - t * t)  # d(softcap * tanh(x / softcap)) / dx
        dv += torch.matmul(kept.transpose(-1, -2), doh[:, r])
        dq[:, r] = torch.matmul(ds, kh) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qh[:, r]) * scale

    def per_kv_head(g):  # (Hq, Sk, D) -> (Sk, Hkv, D): the heads of a group add up
        return g.unflatten(0, (hkv, hq // hkv)).sum(1).transpose(0, 1)

    return dq.transpose(0, 1), per_kv_head(dk), per_kv_head(dv)


def _slopes_for(alibi_slopes: torch.Tensor | None, index: int) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    return alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[index]


def _window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    left, right = window
    return left, 0 if causal else right


def attention_ref(
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
    dropout_seed: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of `attention`: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) -> o (B, Sq, Hq, D) in
    the compute dtype (float32, float64 for float64 inputs) [, lse (B, Hq, Sq)].
    sinks: (Hq,) learnable sinks (gpt-oss): every row's softmax also normalizes over one more
    key of logit sinks[h] and value 0, so o shrinks by the sink's share and lse includes it.
    dropout_p, dropout_seed (int32 (2,)): the mask the module docstring defines.
    Differentiable (autograd through plain torch ops, sinks included)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = _window(causal, window)
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = attend(q[b], k[b], v[b], _slopes_for(alibi_slopes, b), scale=scale, window_left=left,
                        window_right=right, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                        dropout_seed=dropout_seed, seq=b)  # fmt: skip
        outs.append(o)
        lses.append(lse)
    acc = compute_dtype(q.dtype)
    o = torch.stack(outs) if outs else q.new_zeros(q.shape, dtype=acc)
    lse = torch.stack(lses) if lses else q.new_zeros((0, q.shape[2], q.shape[1]), dtype=acc)
    return (o, lse) if return_lse else o


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of `attention_varlen`: packed q (Tq, Hq, D), k, v (Tk, Hkv, D), sequence i
    being rows cu_seqlens[i]:cu_seqlens[i + 1] -> o (Tq, Hq, D) [, lse (Hq, Tq)]."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    left, right = _window(causal, window)
    replay.reads_host_values("cu_seqlens")  # values baked into a recording
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        o, lse = attend(
            q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], _slopes_for(alibi_slopes, i),
            scale=scale, window_left=left, window_right=right, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
            dropout_seed=dropout_seed, seq=i,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    acc = compute_dtype(q.dtype)
    o = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=acc)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((q.shape[1], q.shape[0]), dtype=acc)
    return (o, lse) if return_lse else o


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale, window_left, window_right, alibi_slopes, softcap, dropout_p,
         dropout_seed):  # fmt: skip
    """The backend contract's 4D tensors through the reference -> (o, lse) in the compute dtype."""
    opts = dict(softmax_scale=scale, window=(window_left, window_right), softcap=softcap, dropout_p=dropout_p,
                dropout_seed=dropout_seed, return_lse=True)  # fmt: skip
    if cu_seqlens_q is None:
        return attention_ref(q, k, v, alibi_slopes=alibi_slopes, **opts)
    o, lse = attention_varlen_ref(
        q[0], k[0], v[0], cu_seqlens_q, cu_seqlens_k, alibi_slopes=alibi_slopes, **opts
    )
    return o[None], lse[None]


def attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale, window_left,
             window_right, alibi_slopes, softcap, dropout_p=0.0, dropout_seed=None) -> None:  # fmt: skip
    with torch.no_grad():
        o, row_lse = _run(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, window_left=window_left,
                          window_right=window_right, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                          dropout_seed=dropout_seed)  # fmt: skip
    out.copy_(o)
    lse.copy_(row_lse)


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
             scale, window_left, window_right, alibi_slopes, softcap, dropout_p=0.0,
             dropout_seed=None) -> None:  # fmt: skip
    opts = dict(scale=scale, window_left=window_left, window_right=window_right, softcap=softcap,
                dropout_p=dropout_p, dropout_seed=dropout_seed)  # fmt: skip
    for g in (dq, dk, dv):
        g.zero_()  # sequences without queries or keys: nothing attends, zero gradients
    if cu_seqlens_q is None:
        spans = [(b, slice(None), slice(None), b) for b in range(q.shape[0])]
    else:
        replay.reads_host_values("cu_seqlens")  # values baked into a recording
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        spans = [(0, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1]), i) for i in range(len(cq) - 1)]
    for b, rq, rk, seq in spans:
        if q[b, rq].shape[0] == 0 or k[b, rk].shape[0] == 0:
            continue
        slopes = _slopes_for(alibi_slopes, seq)
        grads = _attend_grads(q[b, rq], k[b, rk], v[b, rk], out[b, rq], dout[b, rq], slopes, seq=seq, **opts)
        for dst, g in zip((dq[b, rq], dk[b, rk], dv[b, rk]), grads):
            dst.copy_(g)
