"""jax.numpy compositions of attention, mirroring ../reference.py: the "jnp" backend
of `openkernels.attention.jax` and its path for what no kernel takes (float32, float64).

Math in float32 (float64 for float64 inputs), rounded once to the input dtype; lse stays in
the compute dtype. Scores are materialized per call ((batch, heads, seqlen_q, seqlen_k)), as
the reference does per chunk. Gradients are explicit (not autodiff of the forward): the
forward's log(0) of rows without a visible key would give NaN cotangents.
Varlen calls are padded to (n_seqs, max_seqlen, ...) with the padding zeroed and masked, run
as a dense batch with per-sequence lengths, and packed back with gathers. Dropout draws the
reference's mask (Philox-4x32-7 in uint32 arithmetic) from the call's seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..problem import PHILOX_ROUNDS, Problem, dropout_threshold

__all__ = ["compute_dtype", "attention_fwd", "attention_bwd", "dense_fwd", "dense_bwd"]

_HIGHEST = jax.lax.Precision.HIGHEST


def compute_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


# ---- dropout: reference.dropout_keep in uint32 ------------------------------------------


def _mul_wide(a, m: int):
    """(high, low) 32-bit words of a * m, a uint32 and m a 32-bit constant, in 16-bit limbs
    (no 64-bit integers without x64)."""
    a0, a1 = a & 0xFFFF, a >> 16
    m0, m1 = jnp.uint32(m & 0xFFFF), jnp.uint32(m >> 16)
    lo_lo, hi_lo, lo_hi = a0 * m0, a1 * m0, a0 * m1
    cross = (lo_lo >> 16) + (hi_lo & 0xFFFF) + lo_hi  # < 2**32
    return a1 * m1 + (hi_lo >> 16) + (cross >> 16), a * jnp.uint32(m)


def _philox(key, c0, c1, c2, c3):
    """reference.philox4x32 on uint32 arrays."""
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mul_wide(c0, 0xD2511F53)
        hi1, lo1 = _mul_wide(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = k0 + jnp.uint32(0x9E3779B9), k1 + jnp.uint32(0xBB67AE85)
    return c0, c1, c2, c3


def _dropout_factor(seed, p: Problem, n: int, hkv: int, g: int, sq: int, sk: int, dtype):
    """keep / (1 - dropout) as (n, hkv, g, sq, sk): query head h = hkv * g + its index in the
    group, counter head b * heads_q + h (reference.dropout_keep)."""
    words = jax.lax.bitcast_convert_type(seed, jnp.uint32)
    hq = hkv * g
    groups = (sk + 3) // 4
    shape = (n, hq, sq, groups)
    c0 = jnp.broadcast_to(jnp.arange(groups, dtype=jnp.uint32), shape)
    c1 = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.uint32)[:, None], shape)
    heads = jnp.arange(n, dtype=jnp.uint32)[:, None] * hq + jnp.arange(hq, dtype=jnp.uint32)[None, :]
    c2 = jnp.broadcast_to(heads[:, :, None, None], shape)
    draws = jnp.stack(_philox((words[0], words[1]), c0, c1, c2, jnp.zeros(shape, jnp.uint32)), axis=-1)
    keep = draws.reshape(n, hq, sq, groups * 4)[..., :sk] >= jnp.uint32(dropout_threshold(p.dropout))
    return (keep.astype(dtype) / (1.0 - p.dropout)).reshape(n, hkv, g, sq, sk)


# ---- a dense batch with per-sequence lengths -------------------------------------------


def _scores(qg, k, slopes, p: Problem, len_q, len_k):
    """qg (N, Sq, Hkv, G, D), k (N, Sk, Hkv, D); len_q, len_k (N,) int. Returns the masked
    scores s (N, Hkv, G, Sq, Sk) in the compute dtype, tanh(raw / softcap) (None without a
    cap) and the visibility mask (rows past len_q see nothing: padding)."""
    acc = compute_dtype(qg.dtype)
    n, sq, hkv, g, _ = qg.shape
    sk = k.shape[1]
    # Half-precision products are exact in float32: only the accumulation rounds.
    s = jnp.einsum("nqhgd,nkhd->nhgqk", qg, k, preferred_element_type=acc, precision=_HIGHEST) * p.scale
    t = None
    if p.softcap > 0:
        t = jnp.tanh(s / p.softcap)
        s = p.softcap * t
    i = jnp.arange(sq)[:, None]
    j = jnp.arange(sk)[None, :]
    lq = len_q.reshape(n, 1, 1, 1, 1)
    lk = len_k.reshape(n, 1, 1, 1, 1)
    rel = i + (lk - lq) - j  # query i sits at key position i + len_k - len_q (bottom-right)
    if slopes is not None:
        s = s - slopes.astype(acc).reshape(n, hkv, g, 1, 1) * jnp.abs(rel).astype(acc)
    visible = (j < lk) & (i < lq)
    if p.window_left >= 0:
        visible &= rel <= p.window_left
    if p.window_right >= 0:
        visible &= rel >= -p.window_right
    return jnp.where(visible, s, -jnp.inf), t, visible


def _probabilities(s):
    """Row softmax of masked scores and the row lse; rows with no visible key give 0 and -inf."""
    row_max = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    row_max = jnp.where(jnp.isinf(row_max), 0.0, row_max)
    e = jnp.exp(s - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    probs = e / jnp.where(total == 0, 1.0, total)
    return probs, (row_max + jnp.log(total))[..., 0]


def dense_fwd(q, k, v, slopes, p: Problem, len_q, len_k, seed=None):
    """q (N, Sq, Hq, D), k, v (N, Sk, Hkv, D) -> out (N, Sq, Hq, D) in q's dtype, lse
    (N, Hq, Sq) in the compute dtype; seed: dropout's int32 (2,) (with p.dropout)."""
    acc = compute_dtype(q.dtype)
    n, sq, hq, d = q.shape
    hkv = k.shape[2]
    s, _, _ = _scores(q.reshape(n, sq, hkv, hq // hkv, d), k, slopes, p, len_q, len_k)
    probs, lse = _probabilities(s)
    if p.dropout > 0:
        probs = probs * _dropout_factor(seed, p, n, hkv, hq // hkv, sq, k.shape[1], acc)
    out = jnp.einsum("nhgqk,nkhd->nqhgd", probs, v.astype(acc), precision=_HIGHEST)
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(n, hq, sq)


def dense_bwd(dout, dlse, q, k, v, slopes, p: Problem, len_q, len_k, lse=None, seed=None):
    """Gradients of `dense_fwd` (reference.py's _attend_grads), dlse (N, Hq, Sq) or None
    included: d lse_i / d s_ij = P_ij. lse (N, Hq, Sq): the forward's, when it is not the
    scores' own (learnable sinks fold into it): P = exp(s - lse). Returns dq, dk, dv in the
    inputs' dtype."""
    acc = compute_dtype(q.dtype)
    n, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(n, sq, hkv, g, d)
    s, t, visible = _scores(qg, k, slopes, p, len_q, len_k)
    if lse is None:
        probs, _ = _probabilities(s)
    else:
        probs = jnp.where(visible, jnp.exp(s - lse.astype(acc).reshape(n, hkv, g, sq, 1)), 0.0)
    dog = dout.astype(acc).reshape(n, sq, hkv, g, d)
    kf, vf = k.astype(acc), v.astype(acc)
    dp = jnp.einsum("nqhgd,nkhd->nhgqk", dog, vf, precision=_HIGHEST)
    kept = probs
    if p.dropout > 0:  # out = (P * factor) v: dV sees the kept P, dP the factor
        factor = _dropout_factor(seed, p, n, hkv, g, sq, k.shape[1], acc)
        kept, dp = probs * factor, dp * factor
    inner = dp - jnp.sum(probs * dp, axis=-1, keepdims=True)  # sum_j P_ij dP_ij = dout_i . out_i
    if dlse is not None:
        inner = inner + dlse.astype(acc).reshape(n, hkv, g, sq, 1)
    ds = probs * inner
    if t is not None:
        ds = ds * jnp.where(visible, 1 - t * t, 0.0)  # d(softcap tanh(x / softcap)) / dx
    dq = jnp.einsum("nhgqk,nkhd->nqhgd", ds, kf, precision=_HIGHEST) * p.scale
    dk = jnp.einsum("nhgqk,nqhgd->nkhd", ds, qg.astype(acc), precision=_HIGHEST) * p.scale
    dv = jnp.einsum("nhgqk,nqhgd->nkhd", kept, dog, precision=_HIGHEST)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- varlen: padded to a dense batch ---------------------------------------------------


def _padding(cu, max_len: int):
    """Gather index (n, max_len) into the packed tokens, its validity and the lengths."""
    lens = cu[1:] - cu[:-1]
    pos = jnp.arange(max_len)
    valid = pos[None, :] < lens[:, None]
    return jnp.where(valid, cu[:-1, None] + pos[None, :], 0), valid, lens


def _pad(x, index, valid):
    """Packed (T, ...) -> (n, max_len, ...), zeros in the padding (NaN never leaks in)."""
    if x.shape[0] == 0:
        return jnp.zeros((*index.shape, *x.shape[1:]), x.dtype)
    mask = valid.reshape(*valid.shape, *([1] * (x.ndim - 1)))
    return jnp.where(mask, x[index], jnp.zeros((), x.dtype))


def _unpad_index(cu, tokens: int):
    """(sequence, position) of each packed token; empty sequences are skipped."""
    t = jnp.arange(tokens)
    seq = jnp.searchsorted(cu[1:], t, side="right")
    return seq, t - cu[seq]


def _varlen_layout(cu_q, cu_k, p: Problem, tokens_q: int, tokens_k: int):
    """The padding of q's and k's sides (padded to max_seqlen_q / max_seqlen_k) and their unpadding."""
    q_side, k_side = _padding(cu_q, p.seqlen_q), _padding(cu_k, p.seqlen_k)
    return q_side, k_side, _unpad_index(cu_q, tokens_q), _unpad_index(cu_k, tokens_k)


def _full(n: int, value: int):
    return jnp.full((n,), value, jnp.int32)


def attention_fwd(q, k, v, cu_q, cu_k, slopes, p: Problem, seed=None):
    """Dense q (B, Sq, Hq, D) -> (out, lse (B, Hq, Sq)); varlen q (Tq, Hq, D) -> (out, lse
    (Hq, Tq)). slopes: (n_seqs, Hq) float32 or None; seed: dropout's int32 (2,) or None."""
    if not p.varlen:
        n = q.shape[0]
        return dense_fwd(q, k, v, slopes, p, _full(n, q.shape[1]), _full(n, k.shape[1]), seed)
    (iq, vq, lq), (ik, vk, lk), (seq, pos), _ = _varlen_layout(cu_q, cu_k, p, q.shape[0], k.shape[0])
    out, lse = dense_fwd(_pad(q, iq, vq), _pad(k, ik, vk), _pad(v, ik, vk), slopes, p, lq, lk, seed)
    return out[seq, pos], lse[seq, :, pos].T


def attention_bwd(dout, dlse, q, k, v, cu_q, cu_k, slopes, p: Problem, lse=None, seed=None):
    """(dq, dk, dv) of `attention_fwd` for cotangents dout (like out) and dlse (like lse, or
    None); lse: the forward's when it is not the scores' own (dense_bwd)."""
    if not p.varlen:
        n = q.shape[0]
        return dense_bwd(
            dout, dlse, q, k, v, slopes, p, _full(n, q.shape[1]), _full(n, k.shape[1]), lse, seed
        )
    (iq, vq, lq), (ik, vk, lk), (seq_q, pos_q), (seq_k, pos_k) = _varlen_layout(
        cu_q, cu_k, p, q.shape[0], k.shape[0]
    )
    dlse_pad, lse_pad = (
        None if x is None else jnp.moveaxis(_pad(x.T, iq, vq), 1, 2) for x in (dlse, lse)
    )  # (Hq, Tq) -> (n, Hq, max_q)
    dq, dk, dv = dense_bwd(_pad(dout, iq, vq), dlse_pad, _pad(q, iq, vq), _pad(k, ik, vk), _pad(v, ik, vk),
                            slopes, p, lq, lk, lse_pad, seed)  # fmt: skip
    return dq[seq_q, pos_q], dk[seq_k, pos_k], dv[seq_k, pos_k]
