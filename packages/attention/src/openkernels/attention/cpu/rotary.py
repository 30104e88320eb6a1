"""CPU backend of the rotary position embedding: the reference's float32 math (float64 for
float64) in token chunks whose float32 intermediates stay in cache, each half computed as one
multiply and one multiply-add straight from the 16-bit inputs (no float32 copy of x) and
rounded once into the output. Contract: reference.apply_rotary_fwd / apply_rotary_bwd.

Measured on the 2-core development machine (shared, noisy: min of 7 x 10 calls, forward,
bf16, tables (1, S, R), ms at 1 / 2 threads; runs differed by up to 1.5x):
  q 1x512x32x128, k 1x512x8x128:   reference 6.8 / 6.1, this path 5.5 / 4.8, transformers'
                                   formula in bf16 arithmetic 4.1-6.6 / 2.7-4.0
  Phi-2 1x256x32x80 (R 32):        reference 1.3 / 1.4, this path 1.0 / 1.0, transformers' 1.0 / 1.0-1.2
  decode 64x1x32x128:              reference 0.49 / 0.57, this path 0.44 / 0.37, transformers' 0.40 / 0.27
So about 1.3x the reference and on par with the torch formula (which rounds three times);
not the fused single pass a C++ kernel would be. Chunks of 2^14 and 2^16 elements and no
chunking measured 13.7, 7.3 and 11.2 ms against 5.8 for 2^18 (first shape, 1 thread).
"""

from __future__ import annotations

import torch

from ..reference import compute_dtype

__all__ = ["apply_rotary_fwd", "apply_rotary_bwd", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 2**18  # float32 elements of one half per chunk (1 MiB)


def _tables(
    cos: torch.Tensor, sin: torch.Tensor, acc: torch.dtype, transpose: bool
) -> tuple[torch.Tensor, ...]:
    """(c1, c2, s1, s2) as (Bc, S, 1, R / 2) in the compute dtype; the transpose's (s1, s2) are
    (-s2, -s1)."""
    half = cos.shape[-1] // 2
    c, s = cos.to(acc).unsqueeze(-2), sin.to(acc).unsqueeze(-2)
    if transpose:
        return c[..., :half], c[..., half:], -s[..., half:], -s[..., :half]
    return c[..., :half], c[..., half:], s[..., :half], s[..., half:]


def _rotate(x: torch.Tensor, tables: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    """out = the rotation of x (B, S, H, D) by tables (c1, c2, s1, s2) of (Bc, S, 1, R / 2)."""
    batch, seqlen, heads, head_dim = x.shape
    half = tables[0].shape[-1]
    tokens = max(1, CHUNK_ELEMENTS // max(1, batch * heads * half))
    buf = torch.empty((batch, min(tokens, seqlen), heads, half), dtype=tables[0].dtype)
    for start in range(0, seqlen, tokens):
        if tokens >= seqlen:  # one chunk: no slicing (about 10 us a view op on the dev machine)
            xs, os, b, (c1, c2, s1, s2) = x, out, buf, tables
        else:
            rows = slice(start, start + tokens)
            xs, os = x[:, rows], out[:, rows]
            b = buf[:, : xs.shape[1]]
            c1, c2, s1, s2 = (t[:, rows] for t in tables)
        x1, x2 = xs[..., :half], xs[..., half : 2 * half]
        torch.mul(x1, c1, out=b)
        b.addcmul_(x2, s1, value=-1.0)
        os[..., :half].copy_(b)
        torch.mul(x2, c2, out=b)
        b.addcmul_(x1, s2)
        os[..., half : 2 * half].copy_(b)
    if 2 * half < head_dim:
        out[..., 2 * half :].copy_(x[..., 2 * half :])


def _run(x_q, x_k, cos, sin, out_q, out_k, transpose: bool) -> None:
    with torch.no_grad():
        tables = _tables(cos, sin, compute_dtype(x_q.dtype), transpose)
        _rotate(x_q, tables, out_q)
        _rotate(x_k, tables, out_k)


def apply_rotary_fwd(q, k, cos, sin, q_out, k_out) -> None:
    _run(q, k, cos, sin, q_out, k_out, False)


def apply_rotary_bwd(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in) -> None:
    _run(grad_q, grad_k, cos, sin, grad_q_in, grad_k_in, True)
