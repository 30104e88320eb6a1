"""The KV cache's storage formats, and their quantize / dequantize / gather in torch ops.

A cache side (K or V) is `data` plus, when quantized, a per-(token, head, group) `scale` and
`zero`:

    16-bit   data (..., heads_kv, head_dim) float16/bfloat16; scale = zero = None.
    int8     data (..., heads_kv, head_dim) uint8 codes 0..255.
    int4     data (..., heads_kv, head_dim // 2) uint8, two codes per byte: element 2j in the
             low nibble, 2j + 1 in the high nibble; codes 0..15.
    scale, zero: float16 (..., heads_kv, head_dim // group_size); group g covers elements
             g * group_size .. (g + 1) * group_size - 1 of head_dim.

"..." is (batch, capacity) for a contiguous cache, (num_pages, page_size) for a paged one.

Quantization is asymmetric, round to nearest, per token and head over each group:

    zero  = fp16(min x)             scale = fp16((max x - min x) / (2^bits - 1))
    code  = clamp(floor((x - zero) * (1 / scale) + 0.5), 0, 2^bits - 1)   (0 when scale == 0)
    x'    = code * scale + zero     (float32)

The Triton append kernel computes the same float32 expressions, so its codes match these
except where a product lands within an ulp of .5 (one code apart, rare).
Values must lie within float16's range (|x| < 65504): scale and zero are float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "QuantizedKV",
    "BITS",
    "code_width",
    "quantize_kv",
    "dequantize_kv",
    "quantize_unchecked",
    "unpack_codes",
    "gather_sequence",
    "gather_kv",
]

BITS = (4, 8)  # the quantized formats; 16 stands for an unquantized cache
_SCALE_DTYPE = torch.float16


@dataclass
class QuantizedKV:
    """One side (K or V) of a quantized KV cache: codes plus float16 per-group scale and zero.

    data: uint8 (..., heads_kv, head_dim) for bits=8, (..., heads_kv, head_dim // 2) for bits=4;
    scale, zero: float16 (..., heads_kv, head_dim // group_size). The leading dims are
    (batch, capacity) or (num_pages, page_size). Format details in this module's docstring.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (8 // self.bits)

    @property
    def shape(self) -> torch.Size:
        """The logical (unquantized) shape."""
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_kv(self, dtype)


def code_width(head_dim: int, bits: int) -> int:
    """Bytes (or 16-bit elements) per token and head in `data`."""
    return head_dim if bits in (8, 16) else head_dim // 2


def _levels(bits: int) -> int:
    return (1 << bits) - 1


def quantize_kv(x: torch.Tensor, bits: int, group_size: int | None = None) -> QuantizedKV:
    """Quantize x (..., heads_kv, head_dim), any float dtype, to the int8 or int4 cache format
    with groups of `group_size` along head_dim (None: the whole head)."""
    if bits not in BITS:
        raise ValueError(f"quantize_kv: bits must be 4 or 8, got {bits!r}")
    head_dim = x.shape[-1]
    group_size = head_dim if group_size is None else group_size
    if group_size <= 0 or head_dim % group_size or (bits == 4 and group_size % 2):
        raise ValueError(
            f"quantize_kv: group_size {group_size} must divide head_dim {head_dim} (and be even for int4)"
        )
    if not x.is_floating_point():
        raise TypeError(f"quantize_kv: x must be a float tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    if xf.numel() and (not torch.isfinite(xf).all() or xf.abs().max() >= 65504):
        raise ValueError("quantize_kv: values must be finite and within float16's range (|x| < 65504)")
    return quantize_unchecked(xf, bits, group_size)


def quantize_unchecked(xf: torch.Tensor, bits: int, group_size: int) -> QuantizedKV:
    """quantize_kv without its argument checks (the backends' append)."""
    xf = xf.to(torch.float32)
    head_dim = xf.shape[-1]
    groups = xf.unflatten(-1, (head_dim // group_size, group_size))
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / _levels(bits)).to(_SCALE_DTYPE)
    zero = lo.to(_SCALE_DTYPE)
    s32 = scale.to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.floor((groups - zero.to(torch.float32)[..., None]) * inv[..., None] + 0.5)
    codes = codes.clamp(0, _levels(bits)).to(torch.uint8).flatten(-2)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedKV(codes.contiguous(), scale.contiguous(), zero.contiguous(), bits, group_size)


def unpack_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., head_dim) from `data`."""
    if bits == 8:
        return data
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def dequantize_kv(qkv: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale + zero in float32, returned in `dtype`: (..., heads_kv, head_dim)."""
    codes = unpack_codes(qkv.data, qkv.bits).to(torch.float32)
    groups = codes.unflatten(-1, (codes.shape[-1] // qkv.group_size, qkv.group_size))
    x = groups * qkv.scale.to(torch.float32)[..., None] + qkv.zero.to(torch.float32)[..., None]
    return x.flatten(-2).to(dtype)


def _rows(
    t: torch.Tensor | None, b: int, length: int, block_table: torch.Tensor | None, start: int = 0
) -> torch.Tensor | None:
    """Tokens start..start+length-1 of sequence b's storage as (length, ...) from a contiguous
    (B, S, ...) or paged (P, page, ...) tensor."""
    if t is None:
        return None
    if block_table is None:
        return t[b, start : start + length]
    page = t.shape[1]
    pages = block_table[b, : -(-(start + length) // page)].long()
    return t[pages].flatten(0, 1)[start : start + length]


def gather_sequence(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    b: int,
    length: int,
    block_table: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    start: int = 0,
) -> torch.Tensor:
    """Sequence b's first `length` tokens of one cache side, dequantized: (length, heads_kv,
    head_dim) in `dtype`; they sit from slot `start` of its storage (a left padding)."""
    rows = _rows(data, b, length, block_table, start)
    if bits == 16:
        return rows.to(dtype)
    qkv = QuantizedKV(rows, _rows(scale, b, length, block_table, start), _rows(zero, b, length, block_table, start),
                      bits, group_size)  # fmt: skip
    return dequantize_kv(qkv, dtype)


def gather_kv(
    k_parts: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    v_parts: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    b: int,
    length: int,
    block_table: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_sequence of both sides, each given as (data, scale, zero): (keys, values)."""
    k, v = (gather_sequence(*parts, b, length, block_table, bits=bits, group_size=group_size, dtype=dtype,
                            start=start) for parts in (k_parts, v_parts))  # fmt: skip
    return k, v
