"""Calls of attention_with_kvcache the KV-cache tests run, and their float64 reference check.

A `Scenario` describes one call (cache lengths, queries, layout, cache format, options); `build`
makes a `KVCall` of it with fresh random inputs. The cache is poisoned wherever it holds no
token before the call: NaN in 16-bit data, NaN scales in a quantized cache, NaN-filled pages
no sequence owns (and, when asked, -1 in the block table past each sequence's last page). An
implementation that reads a slot it must not, or forgets to write one it must, puts NaN in
its output and fails the comparison.

`check_call` runs one call under an implementation and checks
  - the append: the slots at cache_seqlens[b] .. + seqlen_new hold k_new / v_new (rotated,
    quantized as format.quantize_kv does: scale and zero equal, codes equal but rarely one
    apart), every other slot of every cache tensor is bitwise unchanged;
  - the attention: out and lse against the float64 reference (reference.attention_ref) on the
    cache the call left (dequantized in float32, as the semantics in reference.py read it).

Tolerances (derived as in cases.py, whose bound they extend). The semantics read a quantized
cache in float32 and multiply q rounded to its dtype; a fused implementation multiplies
half-precision operands instead, in one of these forms (`designs`):
  q      as the semantics say, or float16(rotated q * softmax_scale) (the Triton kernel on
         int8/int4: q meets the dequantized cache in float16);
  k, v   the float32 dequantization, or it rounded to q's dtype (the CPU backend gathers the
         cache in q's dtype), or code * scale + zero in float16 arithmetic (the Triton
         kernel's tiles); the kernel's factored form for one group per head, scale * (q .
         codes) + zero * sum(q), multiplies the float32 values.
The effect of each combination is known exactly: the float64 reference on its operands minus
the reference on the semantics' ones. Whichever form runs,
    |out - ref| <= |out - ref_form|               + |ref_form - ref|
                   cases.py's half-precision bound  at most the largest over the forms: `extra`
with cases.py's bound taken on M = max(P |V|) over the forms (P |V| is the attention output of
|V|: the reference computes it, no probability matrix needed). For a quantized cache M takes
|scale * code| + |zero| for |V|: the terms the factored form rounds (p * scale in float16)
and those of code * scale + zero. lse is allowed float32 rounding on the largest score plus
the largest |lse_form - lse|. On a 16-bit or float32 cache there is one form, the extra is 0
and the bound is cases.py's.
On a GPU the forms are exact up to fused multiply-adds (in the rotation of q and in code *
scale + zero), which may round the other way: with per-element bounds e_q, e_k, e_v of that,
each score moves by at most dist = scale * max sum_d (e_q |k| + |q| e_k + e_q e_k), each
probability by a factor within exp(+-2 dist): out by (exp(2 dist) - 1) M + P e_v more, lse
by dist more. On the CPU (the interpreter, the CPU backend, the reference) the same
expressions run in the same order and this term is 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import openkernels.attention as A
from openkernels.attention.core import reference as R
from openkernels.attention.kvcache import reference as KR
from openkernels.attention.kvcache.format import (
    QuantizedKV,
    fp8_scale,
    gather_sequence,
    quantize_channels,
    quantize_fp8,
    quantize_kv,
    quantize_unchecked,
    unpack_codes,
)
from openkernels.shared import dispatch
from openkernels.shared.dev.testing import TOLERANCES, assert_close, poisoned_empty, random_tensor

from .cases import assert_attention_close

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# name -> (q dtype, bits, group_size (None: the whole head))
FORMATS = {
    "bf16": (BF16, 16, None),
    "fp16": (F16, 16, None),
    "fp32": (F32, 16, None),
    "int8": (BF16, 8, None),
    "int8-g32": (BF16, 8, 32),
    "int8-g32-fp16": (F16, 8, 32),
    "int4": (BF16, 4, None),
    "int4-g32": (BF16, 4, 32),
    "fp8": (BF16, 8, None),
    "fp8-fp16": (F16, 8, None),
    "int4-keys32": (BF16, 4, None),
    "int8-keys64-fp16": (F16, 8, None),
    "int4-g32-keys64": (BF16, 4, 32),
}
FP8_FORMATS = ("fp8", "fp8-fp16")  # float8_e4m3fn data, a float32 scale per KV head
# keys quantized by channel over groups of this many tokens (values per token, group_size)
KEY_GROUP_FORMATS = {"int4-keys32": 32, "int8-keys64-fp16": 64, "int4-g32-keys64": 64}
SOFTCAP = 2.0
SCALE = 0.3
U16 = 2.0**-11  # float16's unit roundoff


@dataclass(frozen=True)
class Scenario:
    """One attention_with_kvcache call. lengths: cache_seqlens (before the append);
    capacity: tokens per sequence (contiguous) or pages per sequence x page (paged), by
    default the longest sequence after the call (which then fills its cache exactly)."""

    name: str
    lengths: tuple[int, ...]
    seqlen_q: int = 1
    append: bool = True
    heads: tuple[int, int] = (2, 1)
    head_dim: int = 64
    page: int | None = None
    capacity: int | None = None
    fmt: str = "bf16"
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    alibi: str | None = None  # None, "heads" ((heads_q,) slopes) or "batch" ((batch, heads_q))
    softcap: float = 0.0
    softmax_scale: float | None = None
    rotary: str | None = None  # None, "halves" (GPT-NeoX) or "interleaved" (GPT-J)
    rotary_dim: int | None = None  # default: head_dim
    pad_table: bool = False  # -1 in the block table past each sequence's last page

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.fmt][0]

    @property
    def bits(self) -> int:
        return FORMATS[self.fmt][1]

    @property
    def seqlen_new(self) -> int:
        return self.seqlen_q if self.append else 0


@dataclass
class KVCall:
    """The arguments of one attention_with_kvcache call (the cache is updated in place)."""

    q: torch.Tensor
    k_cache: torch.Tensor | QuantizedKV
    v_cache: torch.Tensor | QuantizedKV
    cache_seqlens: torch.Tensor
    k_new: torch.Tensor | None
    v_new: torch.Tensor | None
    block_table: torch.Tensor | None
    causal: bool
    window: tuple[int, int]
    softcap: float
    softmax_scale: float | None
    alibi_slopes: torch.Tensor | None
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    name: str = ""

    @property
    def bits(self) -> int:
        return self.k_cache.bits if isinstance(self.k_cache, QuantizedKV) else 16

    @property
    def fp8(self) -> bool:
        return isinstance(self.k_cache, QuantizedKV) and self.k_cache.is_fp8

    @property
    def key_group(self) -> int:
        return self.k_cache.key_group if isinstance(self.k_cache, QuantizedKV) else 0

    @property
    def group(self) -> int:  # the values' group (the keys' too unless by channel)
        return self.v_cache.group_size if isinstance(self.v_cache, QuantizedKV) else self.q.shape[-1]

    @property
    def lengths(self) -> list[int]:
        return self.cache_seqlens.tolist()

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else self.k_new.shape[1]

    @property
    def page(self) -> int | None:
        return None if self.block_table is None else data_of(self.k_cache).shape[1]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def kwargs(self) -> dict:
        return dict(k_new=self.k_new, v_new=self.v_new, block_table=self.block_table, causal=self.causal,
                    softmax_scale=self.softmax_scale, window=self.window, alibi_slopes=self.alibi_slopes,
                    softcap=self.softcap, rotary_cos=self.rotary_cos, rotary_sin=self.rotary_sin,
                    rotary_interleaved=self.rotary_interleaved)  # fmt: skip

    def call(self, **overrides):
        """attention_with_kvcache(..., return_lse=True) -> (out, lse)."""
        kw = {**self.kwargs(), **overrides}
        return A.attention_with_kvcache(
            self.q, self.k_cache, self.v_cache, self.cache_seqlens, return_lse=True, **kw
        )

    def storage(self) -> list[torch.Tensor]:
        """Every tensor of the cache (data, and scale and zero when quantized)."""
        out = []
        for side in (self.k_cache, self.v_cache):
            parts = (
                [side.data, side.scale, side.zero, side.residual] if isinstance(side, QuantizedKV) else [side]
            )
            out += [t for t in parts if t is not None]
        return out


def data_of(side: torch.Tensor | QuantizedKV) -> torch.Tensor:
    return side.data if isinstance(side, QuantizedKV) else side


def rotary_tables(rows: int, rotary_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (rows, rotary_dim / 2) float32 of the usual 10000^(-2j / rotary_dim) frequencies."""
    inv = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def slots(b: int, positions: torch.Tensor, block_table: torch.Tensor | None,
          page: int | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Storage index (lead 0, lead 1) of sequence b's token positions."""
    if block_table is None:
        return torch.full_like(positions, b), positions
    return block_table[b, positions // page].long(), positions % page


def _poison(side: torch.Tensor | QuantizedKV, valid: torch.Tensor) -> None:
    """NaN where `valid` (lead dims) is False: in the data of a 16-bit or fp8 side, in the
    scales of an int8/int4 one."""
    if isinstance(side, QuantizedKV) and side.is_fp8:
        side.data.view(torch.uint8)[~valid.to(side.data.device)] = 0x7F  # e4m3fn's NaN
        return
    if isinstance(side, QuantizedKV) and side.key_group:  # build_keys_by_channel poisoned it
        return
    target = side.scale if isinstance(side, QuantizedKV) else side
    target[~valid.to(target.device)] = float("nan")


def _keys_by_channel(full: torch.Tensor, s: Scenario, bits: int, key_group: int, batch: int,
                     block_table: torch.Tensor | None) -> QuantizedKV:  # fmt: skip
    """A keys-by-channel side holding sequence b's first s.lengths[b] keys of `full` (at their
    slots): each full group quantized by channel, the rest in float16 residual rows; NaN
    scales of every group that is not full and NaN residual rows past each sequence's."""
    lead0, lead1, hkv, d = full.shape
    assert lead1 % key_group == 0, s
    data = quantize_kv(full, bits).data  # codes in the unused slots: their scales are NaN
    scale = torch.full(
        (lead0, lead1 // key_group, hkv, d), float("nan"), dtype=torch.float16, device=full.device
    )
    zero = scale.clone()
    residual = torch.full((batch, key_group, hkv, d), float("nan"), dtype=torch.float16, device=full.device)
    page = s.page
    for b, n in enumerate(s.lengths):
        idx = slots(b, torch.arange(n), block_table, page)
        keys = full.cpu()[idx].to(torch.float16).to(full.device)
        whole = n // key_group * key_group
        for first in range(0, whole, key_group):
            codes, sc, zr = quantize_channels(keys[first : first + key_group], bits)
            data[slots(b, torch.arange(first, first + key_group), block_table, page)] = codes
            at = (
                (b, first // key_group)
                if page is None
                else (int(block_table[b, first // page]), first % page // key_group)
            )
            scale[at], zero[at] = sc, zr
        residual[b, : n - whole] = keys[whole:]
    return QuantizedKV(data, scale, zero, bits, d, residual, key_group)


def build(s: Scenario, device: str) -> KVCall:
    """Fresh N(0, 1) inputs of scenario `s` (module docstring: the poisoned slots)."""
    dtype, bits, group = FORMATS[s.fmt]
    batch, (hq, hkv), d, sn = len(s.lengths), s.heads, s.head_dim, s.seqlen_new
    after = [n + sn for n in s.lengths]
    capacity = s.capacity or max(after)
    if s.fmt in KEY_GROUP_FORMATS and s.page is None:  # whole groups of keys
        capacity = -(-capacity // KEY_GROUP_FORMATS[s.fmt]) * KEY_GROUP_FORMATS[s.fmt]
    if s.page is None:
        lead, block_table = (batch, capacity), None
        assert capacity >= max(after), s
    else:
        per_seq = -(-capacity // s.page)
        num_pages = batch * per_seq + 2  # two pages nobody owns
        lead = (num_pages, s.page)
        block_table = torch.randperm(num_pages)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
        assert per_seq * s.page >= max(after), s
    full = random_tensor((*lead, hkv, d), dtype if bits == 16 else F32, device)
    fullv = random_tensor((*lead, hkv, d), dtype if bits == 16 else F32, device)
    if bits == 16:
        k_cache, v_cache = full, fullv
    elif s.fmt in KEY_GROUP_FORMATS:
        k_cache = _keys_by_channel(full, s, bits, KEY_GROUP_FORMATS[s.fmt], batch, block_table)
        v_cache = quantize_kv(fullv, bits, group)
    elif s.fmt in FP8_FORMATS:
        # Per-head scales around the data's range, some below it: those heads saturate.
        sides = []
        for x in (full, fullv):
            scale = (fp8_scale(x) * (0.6 + 0.8 * torch.rand(hkv, device=x.device))).contiguous()
            sides.append(QuantizedKV.fp8(quantize_fp8(x, scale), scale))
        k_cache, v_cache = sides
    else:
        k_cache, v_cache = quantize_kv(full, bits, group), quantize_kv(fullv, bits, group)
    valid = torch.zeros(lead, dtype=torch.bool)
    for b, n in enumerate(s.lengths):
        if n:
            valid[slots(b, torch.arange(n), block_table, s.page)] = True
    for side in (k_cache, v_cache):
        _poison(side, valid)
    if block_table is not None and s.pad_table:
        for b, n in enumerate(after):
            block_table[b, -(-n // s.page) :] = -1
    if block_table is not None:
        block_table = block_table.to(device)
    rotary_cos = rotary_sin = None
    if s.rotary:
        rotary_cos, rotary_sin = rotary_tables(capacity, s.rotary_dim or d, device)
    alibi = None
    if s.alibi:
        alibi = torch.rand((hq,) if s.alibi == "heads" else (batch, hq), device=device) * 0.9 + 0.1
    return KVCall(
        q=random_tensor((batch, s.seqlen_q, hq, d), dtype, device),
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=torch.tensor(s.lengths, dtype=torch.int32, device=device),
        k_new=random_tensor((batch, sn, hkv, d), dtype, device) if s.append else None,
        v_new=random_tensor((batch, sn, hkv, d), dtype, device) if s.append else None,
        block_table=block_table,
        causal=s.causal,
        window=s.window,
        softcap=s.softcap,
        softmax_scale=s.softmax_scale,
        alibi_slopes=alibi,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        rotary_interleaved=s.rotary == "interleaved",
        name=s.name,
    )


# ---- the check ---------------------------------------------------------------------------


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN compares equal to the same NaN)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def snapshot(call: KVCall) -> list[torch.Tensor]:
    return [t.clone() for t in call.storage()]


def assert_unchanged(call: KVCall, before: list[torch.Tensor], msg: str) -> None:
    for i, (a, b) in enumerate(zip(call.storage(), before)):
        assert torch.equal(raw_bits(a), raw_bits(b)), f"{msg}: cache tensor {i} changed"


def _gather(call: KVCall, side: torch.Tensor | QuantizedKV, b: int, length: int) -> torch.Tensor:
    """Sequence b's first `length` tokens of one side, dequantized in float32: (L, Hkv, D)."""
    idx = slots(b, torch.arange(length, device=call.q.device), call.block_table, call.page)
    if not isinstance(side, QuantizedKV):
        return side[idx].to(F32)
    if side.is_fp8:
        return QuantizedKV.fp8(side.data[idx], side.scale).dequantize()
    if side.key_group:
        return gather_sequence(side.data, side.scale, side.zero, b, length, call.block_table, bits=side.bits,
                               group_size=side.group_size, dtype=F32, residual=side.residual,
                               key_group=side.key_group)  # fmt: skip
    return QuantizedKV(
        side.data[idx], side.scale[idx], side.zero[idx], side.bits, side.group_size
    ).dequantize()


def ulp_apart(a: torch.Tensor, b: torch.Tensor, ulps: int) -> bool:
    """Same-sign finite floats at most `ulps` representable values apart."""
    diff = (raw_bits(a).to(torch.int64) - raw_bits(b).to(torch.int64)).abs()
    return bool((diff <= ulps).all())


def fp8_within_one_step(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float8_e4m3fn values at most one representable step apart (the step at the larger
    magnitude: 2^(e - 3) in [2^e, 2^(e + 1)), 2^-9 among the subnormals)."""
    a, b = a.float(), b.float()
    big = torch.maximum(a.abs(), b.abs()).clamp_min(2.0**-6)
    step = torch.exp2(torch.floor(torch.log2(big)) - 3)
    return bool(((a - b).abs() <= step).all())


def check_append(call: KVCall, before: list[torch.Tensor], *, fma: bool, msg: str) -> None:
    """The appended slots hold k_new (rotated) / v_new as the semantics say; every other slot
    of every cache tensor is bitwise unchanged. fma: rotated values may differ in the last
    float32 bit (module docstring), one ulp of the stored format."""
    after = call.storage()
    if call.k_new is None:
        assert_unchanged(call, before, f"{msg} (no k_new)")
        return
    device = call.q.device
    lead = data_of(call.k_cache).shape[:2]
    touched = torch.zeros(lead, dtype=torch.bool, device=device)
    rotated = call.rotary_cos is not None
    for b, start in enumerate(call.lengths):
        pos = torch.arange(start, start + call.seqlen_new, device=device)
        idx = slots(b, pos, call.block_table, call.page)
        touched[idx] = True
        k = call.k_new[b].to(F32)
        if rotated:
            k = KR.rotate(k, pos, call.rotary_cos, call.rotary_sin, call.rotary_interleaved)
        sides = [("k", k, call.k_cache, fma and rotated), ("v", call.v_new[b], call.v_cache, False)]
        if call.key_group:  # the keys' own check, below
            sides = sides[1:]
        for what, x, side, fuzzy in sides:
            where = f"{msg}: appended {what} of sequence {b}"
            if call.bits == 16:
                got, want = side[idx], x.to(side.dtype)
                ok = ulp_apart(got, want, 1) if fuzzy else torch.equal(got, want)
                assert ok, (
                    f"{where} differs from k_new / v_new{' rotated' if what == 'k' and rotated else ''}"
                )
                continue
            if call.fp8:  # the head's fixed scale; round to nearest even, bit for bit
                got, want = side.data[idx], quantize_fp8(x, side.scale)
                ok = (
                    fp8_within_one_step(got, want)
                    if fuzzy
                    else torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                )
                assert ok, f"{where} differs from format.quantize_fp8's"
                continue
            want = quantize_unchecked(x, call.bits, call.group)
            for part in ("scale", "zero"):
                got_p, want_p = getattr(side, part)[idx], getattr(want, part)
                ok = ulp_apart(got_p, want_p, 1) if fuzzy else torch.equal(got_p, want_p)
                assert ok, f"{where}: {part} differs from format.quantize_kv's"
            codes = unpack_codes(side.data[idx], call.bits).int()
            diff = (codes - unpack_codes(want.data, call.bits).int()).abs()
            # A code may land one apart where (x - zero) / scale sits within a float32 ulp of
            # a rounding boundary: rare. More than a few, or two apart, is a bug.
            assert int(diff.max()) <= 1, f"{where}: codes {int(diff.max())} apart from quantize_kv's"
            assert int((diff > 0).sum()) <= 1 + diff.numel() // 256, (
                f"{where}: {int((diff > 0).sum())} of {diff.numel()} codes one apart from quantize_kv's"
            )
    if call.key_group:  # k data, scale, zero and residual checked there; the values below
        _check_keys_by_channel(call, before[:4], after[:4], fma=fma and rotated, msg=msg)
        after, before = after[4:], before[4:]
    for i, (a, b) in enumerate(zip(after, before)):
        if a.dim() == 1:  # an fp8 side's per-head scale: no append writes it
            assert torch.equal(raw_bits(a), raw_bits(b)), f"{msg}: the fp8 scale (cache tensor {i}) changed"
            continue
        assert torch.equal(raw_bits(a)[~touched], raw_bits(b)[~touched]), (
            f"{msg}: cache tensor {i} changed outside the appended slots"
        )


def _check_keys_by_channel(call: KVCall, before: list[torch.Tensor], after: list[torch.Tensor], *, fma: bool,
                           msg: str) -> None:  # fmt: skip
    """Keys by channel after an append: each group the new keys fill is quantize_channels of
    its keys (the residual's before the call, then the new ones rotated and rounded to
    float16; codes rarely one apart, scale and zero one float16 ulp with fma), the new keys of
    an incomplete group are in its residual rows, and nothing else changed."""
    data0, scale0, zero0, res0 = before
    data1, scale1, zero1, res1 = after
    g, page, bits = call.key_group, call.page, call.bits
    lead = data1.shape[:2]
    touched = torch.zeros(lead, dtype=torch.bool, device=data1.device)
    touched_g = torch.zeros(scale1.shape[:2], dtype=torch.bool, device=data1.device)
    touched_r = torch.zeros(res1.shape[:2], dtype=torch.bool, device=data1.device)
    for b, start in enumerate(call.lengths):
        end = start + call.seqlen_new
        pos = torch.arange(start, end, device=data1.device)
        k = call.k_new[b].to(F32)
        if call.rotary_cos is not None:
            k = KR.rotate(k, pos, call.rotary_cos, call.rotary_sin, call.rotary_interleaved)
        k = k.to(torch.float16)
        for first in range(start // g * g, end, g):
            last = min(first + g, end)
            where = f"{msg}: keys {first}..{last - 1} of sequence {b}"
            new = k[max(first, start) - start : last - start]
            if last - first < g:
                rows = slice(max(first, start) - first, last - first)
                got, want = res1[b, rows], new
                ok = ulp_apart(got, want, 1) if fma else torch.equal(raw_bits(got), raw_bits(want))
                assert ok, f"{where}: the residual rows differ from the new keys"
                touched_r[b, rows] = True
                continue
            keys = torch.cat((res0[b, : max(start - first, 0)], new))
            codes, sc, zr = quantize_channels(keys, bits)
            idx = slots(b, torch.arange(first, last, device=data1.device), call.block_table, page)
            at = (
                (b, first // g)
                if page is None
                else (int(call.block_table[b, first // page]), first % page // g)
            )
            for part, got, want in (("scale", scale1[at], sc), ("zero", zero1[at], zr)):
                ok = ulp_apart(got, want, 1) if fma else torch.equal(raw_bits(got), raw_bits(want))
                assert ok, f"{where}: {part} differs from format.quantize_channels'"
            diff = (unpack_codes(data1[idx], bits).int() - unpack_codes(codes, bits).int()).abs()
            assert int(diff.max()) <= 1, f"{where}: codes {int(diff.max())} apart from quantize_channels'"
            assert int((diff > 0).sum()) <= 1 + diff.numel() // 256, (
                f"{where}: {int((diff > 0).sum())} codes apart"
            )
            touched[idx] = True
            touched_g[at] = True
    for name, a, b_, mask in (("data", data1, data0, touched), ("scale", scale1, scale0, touched_g),
                              ("zero", zero1, zero0, touched_g), ("residual", res1, res0, touched_r)):  # fmt: skip
        assert torch.equal(raw_bits(a)[~mask], raw_bits(b_)[~mask]), (
            f"{msg}: keys' {name} changed outside the append"
        )


def query(call: KVCall, b: int, length: int, *, rounded: bool = True) -> torch.Tensor:
    """Sequence b's queries (Sq, Hq, D) rotated at positions length - Sq .. length - 1 in
    float32 and (rounded, as the semantics say) back to q's dtype."""
    q = call.q[b]
    if call.rotary_cos is None:
        return q
    pos = torch.arange(length - q.shape[0], length, device=q.device)
    q = KR.rotate(q, pos, call.rotary_cos, call.rotary_sin, call.rotary_interleaved)
    return q.to(call.q.dtype) if rounded else q


def _codes(call: KVCall, side: QuantizedKV, b: int, length: int):
    """Sequence b's codes, scales and zeros per element (L, Hkv, D): float32, float16, float16."""
    idx = slots(b, torch.arange(length, device=call.q.device), call.block_table, call.page)
    codes = unpack_codes(side.data[idx], side.bits).float()
    scale = side.scale[idx].repeat_interleave(side.group_size, -1)
    zero = side.zero[idx].repeat_interleave(side.group_size, -1)
    return codes, scale, zero


def designs(call: KVCall, b: int, length: int):
    """The operands an implementation may multiply for sequence b (module docstring): q
    designs [(q, softmax scale)], k designs, v designs (the semantics' first), and the
    magnitude of each value's terms, (L, Hkv, D): |v|, or |scale * code| + |zero| when
    quantized."""
    dtype = call.q.dtype
    k, v = _gather(call, call.k_cache, b, length), _gather(call, call.v_cache, b, length)
    qs, ks, vs, mag = [(query(call, b, length), call.scale)], [k], [v], v.abs()
    if call.fp8:
        # The Triton kernel: float16(rotated q * (softmax_scale * k_scale * unit)) against the
        # codes times 2^-8 / unit (unit 2^8 where the bytes are converted with bit operations,
        # 1 with the hardware), the value scale on the output. In the semantics' terms: q
        # design that / k_scale / unit, softmax scale 1, k and v the dequantized cache.
        group = call.q.shape[2] // data_of(call.k_cache).shape[2]
        k_scale = call.k_cache.scale.repeat_interleave(group)[None, :, None]  # (1, Hq, 1)
        rotated = query(call, b, length, rounded=False).float()
        for unit in (1.0, 256.0):
            total = torch.tensor(call.scale, dtype=F32, device=k_scale.device) * (k_scale * unit)
            q16 = (rotated * total).clamp(-65504, 65504).half()
            qs.append((q16.double() / (k_scale.double() * unit), 1.0))
        ks.append(k.to(dtype))  # the CPU backend gathers the cache in q's dtype
        vs.append(v.to(dtype))
        return qs, ks, vs, mag
    if call.bits != 16:
        qs.append(((query(call, b, length, rounded=False).float() * call.scale).half(), 1.0))
        sides = ((call.k_cache, ks), (call.v_cache, vs))
        if call.key_group:
            # Keys by channel: float32 q * softmax_scale, times each group's per-channel scale
            # and rounded to float16 (compare() bounds that rounding); the residual keys meet
            # float16(q * softmax_scale), the design above; the CPU backend gathers in q's dtype.
            qs.append((query(call, b, length, rounded=False).float() * call.scale, 1.0))
            ks.append(k.to(dtype))
            sides = sides[1:]
        for side, out in sides:
            codes, scale, zero = _codes(call, side, b, length)
            out += [out[0].to(dtype), codes.half() * scale + zero]
            mag = (codes * scale.float()).abs() + zero.float().abs()  # the v side's, last
    return qs, ks, vs, mag


def reference(call: KVCall, b: int, q, k, v, scale: float):
    """The float64 reference of sequence b on q (Sq, Hq, D), k, v (L, Hkv, D) -> (out (Sq, Hq,
    D), lse (Hq, Sq))."""
    slopes = call.alibi_slopes
    if slopes is not None and slopes.dim() == 2:
        slopes = slopes[b : b + 1]
    o, lse = R.attention_ref(q.double()[None], k.double()[None], v.double()[None], causal=call.causal,
                             softmax_scale=scale, window=call.window, alibi_slopes=slopes, softcap=call.softcap,
                             return_lse=True)  # fmt: skip
    return o[0], lse[0]


def _finite_max(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def compare(call: KVCall, out: torch.Tensor, lse: torch.Tensor, *, device: str, msg: str) -> None:
    """out (B, Sq, Hq, D), lse (B, Hq, Sq) of an implementation against the reference on the
    cache as it is now (module docstring: the tolerances)."""
    dtype = call.q.dtype
    sq, hq, d = call.q.shape[1:]
    assert out.dtype == dtype and out.shape == call.q.shape, f"{msg}: out {out.dtype} {tuple(out.shape)}"
    assert lse.dtype == F32 and tuple(lse.shape) == (call.q.shape[0], hq, sq), (
        f"{msg}: lse {tuple(lse.shape)}"
    )
    group = hq // data_of(call.k_cache).shape[2]
    for b, cached in enumerate(call.lengths):
        length = cached + call.seqlen_new
        where = f"{msg} [{call.name}: sequence {b}, {length} keys]"
        qs, ks, vs, mag = designs(call, b, length)
        (q, scale), k, v = qs[0], ks[0], vs[0]
        o_ref, l_ref = reference(call, b, q, k, v, scale)
        magnitude = extra_out = extra_lse = 0.0
        for qd, sd in qs:
            for kd in ks:
                magnitude = max(magnitude, _finite_max(reference(call, b, qd, kd, mag, sd)[0]))
                for vd in vs:
                    o, l = reference(call, b, qd, kd, vd, sd)
                    extra_out = max(extra_out, _finite_max(o - o_ref))
                    extra_lse = max(
                        extra_lse, _finite_max(torch.where(torch.isfinite(l_ref), l - l_ref, 0.0))
                    )
        score_max = 0.0
        if length:  # |score| <= scale * max ||q_i||_1 * max |k| (+ ALiBi's largest bias below)
            score_max = scale * float(q.double().abs().sum(-1).max()) * float(k.abs().max())
        # fp8 tiles convert exactly: only integer codes have a dequantization a GPU may fuse.
        quantized = call.bits != 16 and not call.fp8
        if length and device != "cpu" and (call.rotary_cos is not None or quantized):
            # A GPU's fused multiply-adds (module docstring): e_q one ulp of the rotated q,
            # e_k, e_v: code * scale rounded once fewer, the result one float16 ulp either way.
            e_q = TOLERANCES[dtype].rtol * q.double().abs() if call.rotary_cos is not None else 0 * q.double()
            e_k = e_v = torch.zeros_like(k, dtype=torch.float64)
            if quantized:
                e_v = 3 * U16 * _codes_mag(call, call.v_cache, b, length)
                if not call.key_group:  # keys by channel: the centred codes are exact
                    e_k = 3 * U16 * _codes_mag(call, call.k_cache, b, length)
            qa, eq = q.double().abs().transpose(0, 1), e_q.transpose(0, 1)  # (Hq, Sq, D)
            ka, ek = (
                t.double().abs().repeat_interleave(group, 1).transpose(0, 1) for t in (k, e_k)
            )  # (Hq, L, D)
            dist = scale * float((eq @ ka.mT + qa @ ek.mT + eq @ ek.mT).max())
            extra_out += math.expm1(2 * dist) * magnitude + _finite_max(
                reference(call, b, q, k, e_v, scale)[0]
            )
            extra_lse += dist
        if call.key_group and length:
            # float16(q * s_c) for the keys of full groups: each product rounded once, so each
            # score moves by at most U16 * sum_c |q_c s_c (code - M)| = U16 * sum_c |q_c| |k_c -
            # z_c - s_c M|, bounded here by U16 * |q| . (|k| + |z| + |s| M).
            qf = query(call, b, length, rounded=False).double().abs() * call.scale  # (Sq, Hq, D)
            kmag = _channel_key_mag(call, b, length)  # (L, Hkv, D)
            qa = qf.transpose(0, 1)  # (Hq, Sq, D)
            ka = kmag.repeat_interleave(group, 1).transpose(0, 1)  # (Hq, L, D)
            dist = U16 * float((qa @ ka.mT).max())
            extra_out += math.expm1(2 * dist) * magnitude
            extra_lse += dist
        terms = length + d
        assert_attention_close(out[b], o_ref, dtype=dtype, magnitude=magnitude, terms=terms, extra=extra_out,
                               msg=f"{where} out")  # fmt: skip
        if call.alibi_slopes is not None:
            score_max += float(call.alibi_slopes.max()) * (length + sq)
        unit = 4 * math.sqrt(terms) * 2.0**-24
        assert_close(lse[b], l_ref, dtype=F32, terms=terms, term_scale=score_max + extra_lse / unit,
                     msg=f"{where} lse")  # fmt: skip
        empty = torch.isneginf(l_ref).cpu()  # (Hq, Sq): rows that see no key
        if empty.any():
            assert torch.isneginf(lse[b].cpu()[empty]).all(), f"{where}: lse of a row with no visible key"
            assert (out[b].cpu().transpose(0, 1)[empty] == 0).all(), (
                f"{where}: out of a row with no visible key"
            )


def _channel_key_mag(call: KVCall, b: int, length: int) -> torch.Tensor:
    """|k| + |zero| + |scale| M per key element of sequence b's full groups (0 for the
    residual keys), float64 (L, Hkv, D), for keys by channel."""
    side, g = call.k_cache, call.key_group
    whole = length // g * g
    k = _gather(call, side, b, length).double().abs()
    groups = torch.arange(whole // g, device=k.device)
    if call.block_table is None:
        idx = (torch.full_like(groups, b), groups)
    else:
        page = call.page
        idx = (call.block_table[b, groups * g // page].long(), groups * g % page // g)
    mid = 1 << (call.bits - 1)
    extra = side.zero[idx].double().abs() + side.scale[idx].double().abs() * mid  # (groups, Hkv, D)
    out = torch.zeros_like(k)
    out[:whole] = k[:whole] + extra.repeat_interleave(g, 0)
    return out


def _codes_mag(call: KVCall, side: QuantizedKV, b: int, length: int) -> torch.Tensor:
    """|scale * code| + |zero| per element (L, Hkv, D), float64."""
    codes, scale, zero = _codes(call, side, b, length)
    return (codes.double() * scale.double()).abs() + zero.double().abs()


def check_call(call: KVCall, impl: str, device: str, msg: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Run `call` under `impl` (outputs poisoned) and check the append and the attention."""
    msg = f"{msg} {impl}".strip()
    before = snapshot(call)
    with dispatch.force(impl), poisoned_empty():
        out, lse = call.call()
    check_append(call, before, fma=device != "cpu", msg=msg)
    compare(call, out, lse, device=device, msg=msg)
    return out, lse


def copy_call(call: KVCall) -> KVCall:
    """The same call on a copy of the cache."""

    def clone(side):
        if isinstance(side, QuantizedKV):
            zero = None if side.zero is None else side.zero.clone()
            residual = None if side.residual is None else side.residual.clone()
            return dataclasses.replace(side, data=side.data.clone(), scale=side.scale.clone(), zero=zero,
                                       residual=residual)  # fmt: skip
        return side.clone()

    return dataclasses.replace(call, k_cache=clone(call.k_cache), v_cache=clone(call.v_cache))


__all__ = [
    "FORMATS",
    "FP8_FORMATS",
    "KEY_GROUP_FORMATS",
    "fp8_within_one_step",
    "SCALE",
    "SOFTCAP",
    "KVCall",
    "Scenario",
    "build",
    "check_append",
    "check_call",
    "compare",
    "copy_call",
    "rotary_tables",
    "snapshot",
]
