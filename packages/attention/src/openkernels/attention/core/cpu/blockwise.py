"""Blockwise online-softmax attention in plain torch ops (FlashAttention 2's algorithm).

Runs every option, softcap included. For each block of query rows the key blocks that the
mask leaves visible are visited in order with a running row max m, row sum l and
unnormalized output; blocks outside the window are never computed. The backward
recomputes each tile's probabilities from the saved lse. Scores exist one tile
(query block x key block) at a time, never for a whole row.

One call covers sequences of equal lengths (the dense batch, or one varlen sequence):
q, out, dout, dq (B, Sq, Hq, D), k, v, dk, dv (B, Sk, Hkv, D) views with a unit last
stride; lse (B, Hq, Sq); slopes (B, Hq) float32 or None. Internally the G = Hq / Hkv query
heads that share a KV head are stacked under the rows, q as (B, Hkv, Sq, G, D), so a tile
is one batched GEMM (B * Hkv) x (R * G, D) x (D, K) that reads K and V once, unexpanded.
Math in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from ..reference import compute_dtype
from .geometry import Geometry

__all__ = ["forward", "backward"]

# Tile size: rows x keys. Measured (B2 H8 S1024 D64 fp32, one thread) from 64 x 256 to
# 512 x 512 within 15% of each other; 128 x 256 was among the fastest, causal or not.
BLOCK_Q = 128
BLOCK_K = 256


def _heads_major(t: torch.Tensor, heads_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, S, H, D) -> (B, Hkv, S, H / Hkv, D), contiguous, in `dtype` (one copy)."""
    x = t.unflatten(2, (heads_kv, t.shape[2] // heads_kv)).permute(0, 2, 1, 3, 4)
    return torch.empty(x.shape, dtype=dtype).copy_(x)


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """src (B, Hkv, S, G, D) into dst (B, S, Hkv * G, D)."""
    dst.unflatten(2, src.shape[1:4:2]).copy_(src.permute(0, 2, 1, 3, 4))


class _Scores:
    """Score tiles of one call: s = q . k (q pre-scaled), softcap, ALiBi, mask."""

    def __init__(self, geo: Geometry, slopes: torch.Tensor | None, softcap: float, shape: tuple[int, ...]):
        self.geo = geo
        self.softcap = softcap
        b, hkv, _, g, _ = shape
        self.slopes = None if slopes is None else slopes.view(b, hkv, 1, g, 1)

    def tile(self, qb: torch.Tensor, kh: torch.Tensor, r0: int, r1: int, c0: int, c1: int):
        """(s (B, Hkv, R, G, K), tanh(raw / softcap) or None) for rows [r0, r1), keys [c0, c1)."""
        b, hkv = qb.shape[:2]
        s = torch.matmul(qb, kh[:, :, c0:c1].transpose(-1, -2)).view(b, hkv, r1 - r0, -1, c1 - c0)
        t = None
        if self.softcap > 0:
            t = torch.tanh(s.div_(self.softcap))
            s = t * self.softcap
        if self.slopes is not None:
            dist = self.geo.distance(r0, r1, c0, c1, s.dtype)[:, None, :]
            s.addcmul_(self.slopes, dist, value=-1.0)
        if not self.geo.is_full(r0, r1, c0, c1):
            s.masked_fill_(~self.geo.visible(r0, r1, c0, c1)[:, None, :], float("-inf"))
        return s, t


def forward(q, k, v, out, lse, slopes, *, scale: float, left: int, right: int, softcap: float) -> None:
    """Write out (B, Sq, Hq, D) and lse (B, Hq, Sq) in place."""
    sq, hq = q.shape[1], q.shape[2]
    sk, hkv = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    geo = Geometry(sq, sk, left, right)
    qh = _heads_major(q, hkv, acc).mul_(scale)  # scale folded into q: one multiply per element
    kh = _heads_major(k, hkv, acc).squeeze(3)
    vh = _heads_major(v, hkv, acc).squeeze(3)
    scores = _Scores(geo, None if slopes is None else slopes.to(acc), softcap, qh.shape)
    oh = torch.zeros_like(qh)
    lse_h = torch.full(qh.shape[:4], float("-inf"), dtype=acc)
    for r0 in range(0, sq, BLOCK_Q):
        r1 = min(sq, r0 + BLOCK_Q)
        k0, k1 = geo.key_range(r0, r1)
        if k0 >= k1:
            continue  # every row empty: output 0, lse -inf
        qb = qh[:, :, r0:r1].flatten(2, 3)  # (B, Hkv, R * G, D), a view
        o = oh[:, :, r0:r1].flatten(2, 3)
        m = torch.full(lse_h[:, :, r0:r1].shape, float("-inf"), dtype=acc)
        l = torch.zeros_like(m)
        for c0 in range(k0, k1, BLOCK_K):
            c1 = min(k1, c0 + BLOCK_K)
            s, _ = scores.tile(qb, kh, r0, r1, c0, c1)
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with nothing visible yet has max -inf: shift by 0, its terms exp(-inf) = 0.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp(m - m_safe)
            p = s.sub_(m_safe[..., None]).exp_()
            l.mul_(alpha).add_(p.sum(dim=-1))
            o.mul_(alpha.flatten(2, 3)[..., None])
            o.add_(torch.matmul(p.flatten(2, 3), vh[:, :, c0:c1]))
            m = m_new
        o.div_(l.masked_fill(l == 0, 1.0).flatten(2, 3)[..., None])  # empty rows: 0 / 1
        lse_h[:, :, r0:r1] = m.masked_fill(m == float("-inf"), 0.0) + torch.log(l)  # log 0 = -inf
    _store(out, oh)
    lse.unflatten(1, (hkv, hq // hkv)).copy_(lse_h.permute(0, 1, 3, 2))


def backward(dout, q, k, v, out, lse, dq, dk, dv, slopes, *, scale: float, left: int, right: int,
             softcap: float) -> None:  # fmt: skip
    """Write dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D) in place, from the saved out and lse."""
    sq, hq = q.shape[1], q.shape[2]
    sk, hkv = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    geo = Geometry(sq, sk, left, right)
    qh = _heads_major(q, hkv, acc).mul_(scale)
    kh = _heads_major(k, hkv, acc).squeeze(3)
    vh = _heads_major(v, hkv, acc).squeeze(3)
    doh = _heads_major(dout, hkv, acc)
    delta = (doh * _heads_major(out, hkv, acc)).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP)
    # Empty rows (lse -inf) get lse +inf: exp(s - lse) = 0 for their (all -inf) scores, no NaN.
    lse_h = lse.unflatten(1, (hkv, hq // hkv)).permute(0, 1, 3, 2).to(acc)
    lse_h = lse_h.masked_fill(lse_h == float("-inf"), float("inf"))
    scores = _Scores(geo, None if slopes is None else slopes.to(acc), softcap, qh.shape)
    dqh = torch.zeros_like(qh)
    dkh = torch.zeros_like(kh)
    dvh = torch.zeros_like(vh)
    for r0 in range(0, sq, BLOCK_Q):
        r1 = min(sq, r0 + BLOCK_Q)
        k0, k1 = geo.key_range(r0, r1)
        qb = qh[:, :, r0:r1].flatten(2, 3)
        dob = doh[:, :, r0:r1].flatten(2, 3)
        dqb = dqh[:, :, r0:r1].flatten(2, 3)
        lse_b = lse_h[:, :, r0:r1, :, None]
        delta_b = delta[:, :, r0:r1, :, None]
        for c0 in range(k0, k1, BLOCK_K):
            c1 = min(k1, c0 + BLOCK_K)
            s, t = scores.tile(qb, kh, r0, r1, c0, c1)
            p = s.sub_(lse_b).exp_()
            p2 = p.flatten(2, 3)  # (B, Hkv, R * G, K): the G heads of a KV head sum in the GEMMs
            dvh[:, :, c0:c1].add_(torch.matmul(p2.transpose(-1, -2), dob))
            dp = torch.matmul(dob, vh[:, :, c0:c1].transpose(-1, -2)).view(p.shape)
            ds = dp.sub_(delta_b).mul_(p)
            if t is not None:  # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2
                ds.mul_(1.0 - t * t)
            ds2 = ds.flatten(2, 3)
            dqb.add_(torch.matmul(ds2, kh[:, :, c0:c1]))
            dkh[:, :, c0:c1].add_(torch.matmul(ds2.transpose(-1, -2), qb))  # qb carries the scale
    _store(dq, dqh.mul_(scale))
    _store(dk, dkh[:, :, :, None])
    _store(dv, dvh[:, :, :, None])
