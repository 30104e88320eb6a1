"""The KV cache's storage formats, and their quantize / dequantize / gather in torch ops.

A cache side (K or V) is `data` plus, when quantized, a `scale` (and for the integer
formats a `zero`):

    16-bit   data (..., heads_kv, head_dim) float16/bfloat16; scale = zero = None.
    int8     data (..., heads_kv, head_dim) uint8 codes 0..255.
    int4     data (..., heads_kv, head_dim // 2) uint8, two codes per byte: element 2j in the
             low nibble, 2j + 1 in the high nibble; codes 0..15.
             int8/int4 scale, zero: float16 (..., heads_kv, head_dim // group_size), per token,
             head and group; group g covers elements g * group_size .. (g + 1) * group_size - 1.
    int8/int4 keys by channel (KIVI): data as above, per token; scale, zero float16
             (lead0, lead1 // key_group, heads_kv, head_dim), one per channel over each group of
             `key_group` consecutive token positions (32 or 64, dividing the page size); the
             keys of each sequence's last, incomplete group wait in `residual`, float16
             (batch, key_group, heads_kv, head_dim) (position p in row p % key_group), and are
             quantized together when the group fills. Values stay per token.
    fp8      data (..., heads_kv, head_dim) torch.float8_e4m3fn; scale float32 (heads_kv,), one
             per KV head for every token (what vLLM, TensorRT-LLM and FlashInfer call an fp8
             KV cache with per-head scales); zero = None; bits 8, group_size head_dim.

"..." is (batch, capacity) for a contiguous cache, (num_pages, page_size) for a paged one.

Quantization is asymmetric, round to nearest, per token and head over each group:

    zero  = fp16(min x)             scale = fp16((max x - min x) / (2^bits - 1))
    code  = clamp(floor((x - zero) * (1 / scale) + 0.5), 0, 2^bits - 1)   (0 when scale == 0)
    x'    = code * scale + zero     (float32)

The Triton append kernel computes the same float32 expressions, so its codes match these
except where a product lands within an ulp of .5 (one code apart, rare).
Values must lie within float16's range (|x| < 65504): scale and zero are float16.

Keys by channel use the same expressions with the group along the tokens: for each head and
channel c of a full group, zero = fp16(min over the group's tokens), scale = fp16(range /
(2^bits - 1)). A sequence of L tokens holds floor(L / key_group) quantized groups and
L mod key_group keys in float16 in its residual rows.

fp8 is symmetric with a fixed scale per head, set when the cache is made (1.0 unless given;
`fp8_scale` derives one from sample keys or values):

    x' = float8_e4m3fn(clamp(x / scale, -448, 448)) * scale     (round to nearest even)

Values beyond 448 * scale saturate to it (e4m3fn has no infinity); below 2^-6 * scale they
are subnormal (steps of 2^-9 * scale). The Triton append rounds the same way, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "QuantizedKV",
    "BITS",
    "FP8",
    "FP8_MAX",
    "fp8_scale",
    "quantize_fp8",
    "KEY_GROUPS",
    "quantize_channels",
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
FP8 = torch.float8_e4m3fn  # the fp8 format's storage dtype (bits 8, told apart from int8 by it)
FP8_MAX = 448.0  # e4m3fn's largest finite value
KEY_GROUPS = (32, 64)  # tokens per group of keys quantized by channel


@dataclass
class QuantizedKV:
    """One side (K or V) of a quantized KV cache.

    int8 / int4: data uint8 (..., heads_kv, head_dim) for bits=8, (..., heads_kv, head_dim // 2)
    for bits=4; scale, zero: float16 (..., heads_kv, head_dim // group_size).
    fp8: data torch.float8_e4m3fn (..., heads_kv, head_dim); scale float32 (heads_kv,); zero
    None; bits 8, group_size head_dim (`QuantizedKV.fp8(data, scale)` builds one).
    Keys by channel (key_group 32 or 64): scale, zero float16 (lead0, lead1 // key_group,
    heads_kv, head_dim) per channel and group of tokens, residual float16 (batch, key_group,
    heads_kv, head_dim) for the keys of each sequence's incomplete group; group_size head_dim.
    The leading dims are (batch, capacity) or (num_pages, page_size). Format details in this
    module's docstring.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group_size: int
    residual: torch.Tensor | None = None
    key_group: int = 0  # > 0: keys quantized by channel over groups of key_group tokens

    @classmethod
    def fp8(cls, data: torch.Tensor, scale: torch.Tensor) -> QuantizedKV:
        """An fp8 side: data float8_e4m3fn (..., heads_kv, head_dim), scale float32 (heads_kv,)."""
        return cls(data, scale, None, 8, data.shape[-1])

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == FP8

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
        parts = (self.data, self.scale, self.zero, self.residual)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

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


def fp8_scale(x: torch.Tensor, headroom: float = 1.0) -> torch.Tensor:
    """A per-head fp8 scale from sample keys or values x (..., heads_kv, head_dim): the largest
    |x| of each head over FP8_MAX, times `headroom` (> 1 leaves room for larger values later),
    float32 (heads_kv,); 1.0 for a head whose samples are all zero."""
    if not x.is_floating_point() or x.dim() < 2:
        raise TypeError(
            f"fp8_scale: x must be a float tensor (..., heads_kv, head_dim), got {x.dtype} {x.dim()}D"
        )
    if not headroom > 0:
        raise ValueError(f"fp8_scale: headroom must be positive, got {headroom!r}")
    amax = x.detach().to(torch.float32).abs().transpose(0, -2).flatten(1).amax(1)
    if not torch.isfinite(amax).all():
        raise ValueError("fp8_scale: x must be finite")
    return torch.where(amax > 0, amax * (headroom / FP8_MAX), 1.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., heads_kv, head_dim), any float dtype, as float8_e4m3fn codes of x / scale with
    scale float32 (heads_kv,): clamped to +-448, rounded to nearest even (the module docstring)."""
    y = x.to(torch.float32) / scale.to(torch.float32)[:, None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_channels(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys x (..., tokens, heads_kv, head_dim) of one full group, quantized per head and
    channel over the tokens: (codes packed as quantize_kv packs them, (..., tokens, heads_kv,
    code width) uint8; scale, zero float16 (..., heads_kv, head_dim))."""
    xf = x.to(torch.float32)
    lo, hi = xf.amin(dim=-3), xf.amax(dim=-3)
    scale = ((hi - lo) / _levels(bits)).to(_SCALE_DTYPE)
    zero = lo.to(_SCALE_DTYPE)
    s32 = scale.to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.floor((xf - zero.to(torch.float32).unsqueeze(-3)) * inv.unsqueeze(-3) + 0.5)
    codes = codes.clamp(0, _levels(bits)).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes.contiguous(), scale, zero


def _dequantize_channels(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                         key_group: int) -> torch.Tensor:  # fmt: skip
    """Codes (n * key_group, heads_kv, width) with scale/zero (n, heads_kv, head_dim), float32."""
    c = unpack_codes(codes, bits).to(torch.float32).unflatten(0, (-1, key_group))
    return (c * scale.to(torch.float32)[:, None] + zero.to(torch.float32)[:, None]).flatten(0, 1)


def unpack_codes(data: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., head_dim) from `data`."""
    if bits == 8:
        return data
    return torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)


def dequantize_kv(qkv: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """code * scale + zero in float32 (fp8: code * scale), returned in `dtype`: (..., heads_kv,
    head_dim)."""
    if qkv.is_fp8:
        return (qkv.data.to(torch.float32) * qkv.scale.to(torch.float32)[:, None]).to(dtype)
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
    residual: torch.Tensor | None = None,
    key_group: int = 0,
) -> torch.Tensor:
    """Sequence b's first `length` tokens of one cache side, dequantized: (length, heads_kv,
    head_dim) in `dtype`; they sit from slot `start` of its storage (a left padding). Keys by
    channel (key_group > 0, start 0): the full groups' codes with their per-channel scales,
    then the residual rows."""
    if key_group:
        full = length // key_group * key_group
        groups = full // key_group
        keys = _dequantize_channels(_rows(data, b, full, block_table), _rows(scale, b, groups, block_table),
                                    _rows(zero, b, groups, block_table), bits, key_group)  # fmt: skip
        return torch.cat((keys, residual[b, : length - full].to(torch.float32))).to(dtype)
    rows = _rows(data, b, length, block_table, start)
    if bits == 16:
        return rows.to(dtype)
    if rows.dtype == FP8:  # one scale per head, for every token
        return dequantize_kv(QuantizedKV.fp8(rows, scale), dtype)
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
    k_residual: torch.Tensor | None = None,
    key_group: int = 0,
    **layout: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_sequence of both sides, each given as (data, scale, zero): (keys, values);
    layout: gather_sequence's bits, group_size, dtype and start, the same for both sides
    (passed on as they are, so the two signatures cannot drift apart); k_residual,
    key_group: keys quantized by channel."""
    k = gather_sequence(*k_parts, b, length, block_table, residual=k_residual, key_group=key_group, **layout)
    v = gather_sequence(*v_parts, b, length, block_table, **layout)
    return k, v
