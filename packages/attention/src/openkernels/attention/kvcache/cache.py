"""`KVCache`: storage for attention_with_kvcache that knows its own layout and lengths."""

from __future__ import annotations

from typing import Any

import torch

from . import ops, problem
from .api import (
    KVCallPlan,
    _cache_format,
    _kvcache_call,
    _kvcache_plan,
    check_block_table,
    check_lengths,
    check_rotary_tables,
)
from .format import FP8, KEY_GROUPS, QuantizedKV, code_width, gather_sequence

__all__ = ["KVCache"]

_KV_DTYPES = ("int8", "int4", "fp8")


_MAX_PLANS = 64  # call signatures one cache keeps checked plans for (a model calls a few)
_SCALAR_OPTIONS = {"causal": (bool,), "softmax_scale": (type(None), float, int), "softcap": (float, int),
                   "rotary_interleaved": (bool,)}  # fmt: skip
_TENSOR_OPTIONS = ("alibi_slopes", "rotary_cos", "rotary_sin", "cache_leftpad")


def _call_signature(q: object, k_new: object, v_new: object, options: dict) -> tuple | None:
    """The key under which KVCache.attend reuses a checked plan: q's and the new tokens' type,
    shape, dtype and device and the scalar options with their exact types (True must not hit
    a plan made for 1); None (no reuse) with a tensor option (ALiBi slopes, rotary tables,
    cache_leftpad: checked every call) or anything not a plain tensor."""
    if type(q) is not torch.Tensor or any(options.get(name) is not None for name in _TENSOR_OPTIONS):
        return None
    parts = [q.shape, q.dtype, q.device]
    for t in (k_new, v_new):
        if t is None:
            parts.append(None)
        elif type(t) is torch.Tensor:
            parts += (t.shape, t.dtype, t.device)
        else:
            return None
    for name, value in options.items():
        if name in _TENSOR_OPTIONS:
            continue
        if name == "window":
            if (
                type(value) is not tuple
                or len(value) != 2
                or type(value[0]) is not int
                or type(value[1]) is not int
            ):
                return None
        elif type(value) not in _SCALAR_OPTIONS[name]:
            return None
        parts += (name, value, type(value))
    return tuple(parts)


def reusable_plan(plans: dict, sig: tuple | None, k: Any, v: Any, block_table: Any) -> KVCallPlan | None:
    """The checked plan kept under `sig` when it was made for these cache sides and table."""
    plan = plans.get(sig) if sig is not None else None
    if plan is not None and plan.k_cache is k and plan.v_cache is v and plan.block_table is block_table:
        return plan
    return None  # none kept, or the sides or the table were replaced since


def keep_plan(plans: dict, sig: tuple | None, plan: KVCallPlan) -> None:
    if sig is None:
        return
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[sig] = plan


class KVCache:
    """A KV cache for `batch_size` sequences of up to `max_seqlen` tokens each.

    kv_dtype: torch.float16 / torch.bfloat16 (stored as is), torch.float32 (stored as is, for
        float32 queries on the CPU path and the reference; the Triton kernels take 16-bit
        queries), "int8" or "int4" (codes with a float16 scale and zero per token, head and
        group of `group_size` elements along head_dim: 32, 64, 128 or None for the whole head),
        or "fp8" (float8_e4m3fn values with one float32 scale per KV head; torch.float8_e4m3fn
        names it too).
    key_group: int8/int4 only: None (keys per token, as values), or 32 / 64: keys quantized
        per channel over groups of that many tokens (KIVI), the keys of each sequence's last
        incomplete group held in float16 until it fills; a multiple of it must be the page
        size (contiguous: the capacity is rounded up to one). Keeps int4 usable on keys with
        outlier channels; values stay per token (`group_size`).
    k_scale, v_scale: fp8 only: the per-head scales, a float or a (heads_kv,) tensor, fixed for
        the cache's life (default 1.0, as vLLM's uncalibrated default; format.fp8_scale
        derives them from sample keys and values). Values beyond 448 * scale saturate.
    page_size: None for one block per sequence (batch_size, max_seqlen, heads_kv, head_dim), or
        a multiple of 16 for paged storage (num_pages, page_size, heads_kv, head_dim) with a
        block table (batch_size, pages_per_seq) int32; num_pages defaults to what every
        sequence needs at max_seqlen, and the default block table gives sequence b the pages
        b * pages_per_seq onward. Pass (or later assign) `block_table` to share fewer pages;
        it is checked once then, so calls need no device-to-host copy. Every page in it must be
        a page of the cache and appear once (appends write into them).
    The lengths live on the device (`seqlens`, int32) and on the host, so `attend` and
    `append` check bounds without a device-to-host copy.
    """

    def __init__(
        self,
        batch_size: int,
        max_seqlen: int,
        heads_kv: int,
        head_dim: int,
        *,
        kv_dtype: torch.dtype | str = torch.bfloat16,
        group_size: int | None = None,
        page_size: int | None = None,
        num_pages: int | None = None,
        block_table: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        key_group: int | None = None,
    ) -> None:
        for what, n in (("batch_size", batch_size), ("max_seqlen", max_seqlen), ("heads_kv", heads_kv)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"KVCache: {what} must be a positive int, got {n!r}")
        if head_dim not in problem.HEAD_DIMS:
            raise ValueError(f"KVCache: head_dim {head_dim} is not supported; supported: {problem.HEAD_DIMS}")
        if kv_dtype == FP8:
            kv_dtype = "fp8"
        if kv_dtype not in (torch.float16, torch.bfloat16, torch.float32, *_KV_DTYPES):
            raise ValueError(
                "KVCache: kv_dtype must be torch.float16, torch.bfloat16, torch.float32, 'int8', 'int4' or 'fp8', "
                f"got {kv_dtype!r}"
            )
        self.bits = 16 if isinstance(kv_dtype, torch.dtype) else 8 if kv_dtype == "fp8" else int(kv_dtype[3:])
        self.fp8 = kv_dtype == "fp8"
        if self.fp8 and group_size not in (None, head_dim):
            raise ValueError(
                f"KVCache: an fp8 cache has one scale per head (group_size None), got {group_size!r}"
            )
        if not self.fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError("KVCache: k_scale and v_scale belong to an fp8 cache (kv_dtype='fp8')")
        if key_group is not None and (self.bits not in (4, 8) or self.fp8 or key_group not in KEY_GROUPS):
            raise ValueError(f"KVCache: key_group (keys by channel) is for int8/int4 caches and one of {KEY_GROUPS}, "
                             f"got {key_group!r} with kv_dtype={kv_dtype!r}")  # fmt: skip
        if key_group is not None and page_size is not None and page_size % key_group:
            raise ValueError(f"KVCache: page_size {page_size} must be a multiple of key_group {key_group}")
        self.key_group = key_group or 0
        self.group_size = head_dim if group_size is None else group_size
        if self.bits != 16 and (self.group_size not in (32, 64, 128, head_dim) or head_dim % self.group_size):
            raise ValueError(f"KVCache: group_size must divide head_dim {head_dim} and be 32, 64, 128 or None, got "
                             f"{group_size!r}")  # fmt: skip
        if page_size is not None and (not isinstance(page_size, int) or page_size < 16 or page_size % 16):
            raise ValueError(f"KVCache: page_size must be a multiple of 16, got {page_size!r}")
        self.kv_dtype, self.head_dim, self.heads_kv, self.max_seqlen = (
            kv_dtype,
            head_dim,
            heads_kv,
            max_seqlen,
        )
        self.page_size = page_size
        device = torch.device("cpu" if device is None else device)
        if self.fp8:
            scales = [
                _fp8_scale(x, what, heads_kv, device)
                for what, x in (("k_scale", k_scale), ("v_scale", v_scale))
            ]
        if page_size is None:
            lead = (batch_size, -(-max_seqlen // (self.key_group or 1)) * (self.key_group or 1))
            self.block_table = None
        else:
            per_seq = -(-max_seqlen // page_size)
            num_pages = batch_size * per_seq if num_pages is None else num_pages
            lead = (num_pages, page_size)
        if self.fp8:
            self.k, self.v = (QuantizedKV.fp8(self._empty(lead, device), sc) for sc in scales)
        else:
            self.k, self.v = (self._empty(lead, device) for _ in range(2))
        if self.key_group:
            g = self.key_group
            groups = torch.zeros(
                (lead[0], lead[1] // g, heads_kv, head_dim), dtype=torch.float16, device=device
            )
            residual = torch.zeros((batch_size, g, heads_kv, head_dim), dtype=torch.float16, device=device)
            self.k = QuantizedKV(self.k.data, groups, groups.clone(), self.bits, head_dim, residual, g)
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._lengths = [0] * batch_size
        self._formats: dict[tuple, tuple[int, int]] = {}  # (q dtype, head_dim, device) -> (bits, group)
        self._plans: dict[tuple, KVCallPlan] = {}  # call signature -> checked plan (see attend)
        self._block_table = None
        if page_size is not None:
            if block_table is None:
                if num_pages < batch_size * per_seq:
                    raise ValueError(f"KVCache: {num_pages} pages are fewer than the {batch_size * per_seq} the default "
                                     "block table gives out; pass block_table")  # fmt: skip
                block_table = torch.arange(batch_size * per_seq, dtype=torch.int32, device=device)
                block_table = block_table.view(batch_size, per_seq)
            self.block_table = block_table
        elif block_table is not None:
            raise ValueError("KVCache: block_table needs a page_size")

    def _empty(self, lead: tuple[int, int], device: torch.device) -> torch.Tensor | QuantizedKV:
        def zeros(width: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros((*lead, self.heads_kv, width), dtype=dtype, device=device)

        if self.bits == 16:
            return zeros(self.head_dim, self.kv_dtype)
        if self.fp8:  # the data alone: KVCache.__init__ adds the scales
            return zeros(self.head_dim, FP8)
        groups = self.head_dim // self.group_size
        return QuantizedKV(
            zeros(code_width(self.head_dim, self.bits), torch.uint8),
            zeros(groups, torch.float16),
            zeros(groups, torch.float16),
            self.bits,
            self.group_size,
        )

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Tokens held per sequence (host copy)."""
        return list(self._lengths)

    @property
    def nbytes(self) -> int:
        sides = (self.k, self.v)
        return sum(s.nbytes if isinstance(s, QuantizedKV) else s.numel() * s.element_size() for s in sides)

    def _data(self, side: torch.Tensor | QuantizedKV) -> torch.Tensor:
        return side.data if isinstance(side, QuantizedKV) else side

    @property
    def block_table(self) -> torch.Tensor | None:
        """(batch_size, pages_per_seq) int32 page indices of a paged cache, else None."""
        return self._block_table

    @block_table.setter
    def block_table(self, table: torch.Tensor | None) -> None:
        """Assign pages (checked once here, so calls need no device-to-host copy)."""
        if (table is None) != (self.page_size is None):
            raise ValueError("KVCache: only a paged cache has a block_table")
        if table is not None:
            want = (self.batch_size, -(-self.max_seqlen // self.page_size))
            if (
                table.dtype != torch.int32
                or tuple(table.shape) != want
                or table.device != self.seqlens.device
            ):
                raise ValueError(
                    f"KVCache: block_table must be int32 of shape {want} on {self.seqlens.device}"
                )
            # Every slot may receive an append: the whole table counts as written.
            check_block_table("KVCache", table, [self.max_seqlen] * self.batch_size, self.page_size,
                              self._data(self.k).shape[0], seqlen_new=self.max_seqlen)  # fmt: skip
        self._block_table = table

    def _advance(self, n: int, name: str, rotary_cos: torch.Tensor | None, seqlen_q: int) -> list[int]:
        """Host lengths after appending n tokens (bounds checked on the host copy)."""
        rows = None if rotary_cos is None else rotary_cos.shape[0]
        return check_lengths(name, self._lengths, self.max_seqlen, n, seqlen_q, rows)

    def attend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
        **options,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """attention_with_kvcache(q, ..., k_new=k_new, v_new=v_new, **options) on this cache,
        then the lengths advance by k_new's tokens. options: causal, softmax_scale, window,
        alibi_slopes, softcap, rotary_cos, rotary_sin, rotary_interleaved, return_lse,
        cache_leftpad (contiguous caches: int32 (batch_size,), the padding slots each sequence
        starts with, counted in its length, as attention_with_kvcache takes it; checked here
        with one device-to-host copy)."""
        return_lse = options.pop("return_lse", False)
        unknown = set(options) - {"causal", "softmax_scale", "window", "alibi_slopes", "softcap", "rotary_cos",
                                  "rotary_sin", "rotary_interleaved", "cache_leftpad"}  # fmt: skip
        if unknown:
            raise TypeError(f"KVCache.attend: unknown options {sorted(unknown)}")
        n = 0 if k_new is None else k_new.shape[1]
        compiling = torch.compiler.is_compiling()
        sig = None if compiling else _call_signature(q, k_new, v_new, options)
        plan = reusable_plan(self._plans, sig, self.k, self.v, self._block_table)
        fmt = None
        if plan is None:
            # The storage's format is checked once per (q dtype, head_dim, device): a decode step
            # is a ~0.1 ms kernel, and the per-side checks cost ~30 us of Python here.
            key = (q.dtype, q.shape[-1], q.device) if isinstance(q, torch.Tensor) else None
            fmt = self._formats.get(key)
            if fmt is None:
                fmt = _cache_format("KVCache.attend", self.k, self.v, q) if key is not None else None
                if fmt is not None:
                    self._formats[key] = fmt
        lengths = None
        leftpad = options.get("cache_leftpad")
        if not compiling:
            lengths = self._advance(
                n, "KVCache.attend", options.get("rotary_cos"), q.shape[1] if q.dim() == 4 else 0
            )
            if leftpad is not None:
                self._check_leftpad(leftpad, n)
        if sig is not None and plan is None:  # checked by this call: kept for the next ones
            plan = _kvcache_plan(
                "attention_with_kvcache", q, self.k, self.v, self.seqlens, k_new, v_new, self.block_table,
                options.get("causal", True), options.get("softmax_scale"), options.get("window", (-1, -1)), None,
                options.get("softcap", 0.0), None, None, options.get("rotary_interleaved", False), fmt, None, None,
            )  # fmt: skip
            keep_plan(self._plans, sig, plan)
        out, lse = _kvcache_call(
            q, self.k, self.v, self.seqlens, k_new, v_new, self.block_table, options.get("causal", True),
            options.get("softmax_scale"), options.get("window", (-1, -1)), options.get("alibi_slopes"),
            options.get("softcap", 0.0), options.get("rotary_cos"), options.get("rotary_sin"),
            options.get("rotary_interleaved", False), lengths, fmt, cache_leftpad=leftpad, plan=plan,
        )  # fmt: skip
        if n:
            self.seqlens += n
            self._lengths = [x + n for x in self._lengths]
        return (out, lse) if return_lse else out

    def _check_leftpad(self, leftpad: object, n: int) -> None:
        """cache_leftpad against the host lengths (before the append of n tokens)."""
        name = "KVCache.attend"
        if (
            not isinstance(leftpad, torch.Tensor)
            or leftpad.dtype != torch.int32
            or leftpad.shape != (self.batch_size,)
        ):
            raise TypeError(f"{name}: cache_leftpad must be an int32 tensor of shape ({self.batch_size},)")
        if self.page_size is not None:
            raise ValueError(f"{name}: cache_leftpad applies to contiguous caches (page_size None)")
        for b, (pad, length) in enumerate(zip(leftpad.tolist(), self._lengths)):
            if not 0 <= pad <= length:
                raise ValueError(
                    f"{name}: cache_leftpad[{b}] = {pad} must lie in 0..cache_seqlens[{b}] = {length}"
                )

    def append(
        self,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        *,
        rotary_cos: torch.Tensor | None = None,
        rotary_sin: torch.Tensor | None = None,
        rotary_interleaved: bool = False,
    ) -> None:
        """Write k_new, v_new (batch, n, heads_kv, head_dim) after each sequence's tokens
        (rotary on k_new when given; quantized for an int8/int4 cache) and advance."""
        for what, t in (("k_new", k_new), ("v_new", v_new)):
            want = (self.batch_size, k_new.shape[1] if k_new.dim() == 4 else -1, self.heads_kv, self.head_dim)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                raise ValueError(f"KVCache.append: {what} must have shape {want}, got {tuple(t.shape)}")
            if not t.is_floating_point() or t.device != self.seqlens.device:
                raise TypeError(f"KVCache.append: {what} must be a float tensor on {self.seqlens.device}")
            if self.bits == 16 and t.dtype != self.kv_dtype:
                raise TypeError(f"KVCache.append: {what} must be {self.kv_dtype}, got {t.dtype}")
        if not isinstance(rotary_interleaved, bool):
            raise TypeError(f"KVCache.append: rotary_interleaved must be a bool, got {rotary_interleaved!r}")
        check_rotary_tables("KVCache.append", rotary_cos, rotary_sin, self.head_dim, self.seqlens.device)
        n = k_new.shape[1]
        self._advance(n, "KVCache.append", rotary_cos, n)
        quant = (self.k.scale, self.k.zero, self.v.scale, self.v.zero) if self.bits != 16 else (None,) * 4
        ops.KVCACHE_APPEND(self._data(self.k), self._data(self.v), *quant, k_new, v_new, self.seqlens,
                           self.block_table, rotary_cos, rotary_sin, rotary_interleaved, self.bits,
                           self.group_size, None, self.k.residual if self.key_group else None,
                           self.key_group)  # fmt: skip
        self.seqlens += n
        self._lengths = [x + n for x in self._lengths]

    def reset(self) -> None:
        """Forget every token (the storage is kept)."""
        self.seqlens.zero_()
        self._lengths = [0] * self.batch_size

    def dequantize(self, b: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values as (length, heads_kv, head_dim) in `dtype`."""
        bits, group = self.bits, self.group_size
        sides = []
        for side in (self.k, self.v):
            if isinstance(side, QuantizedKV):
                parts = (side.data, side.scale, side.zero)
            else:
                parts = (side, None, None)
            sides.append(gather_sequence(*parts, b, self._lengths[b], self.block_table, bits=bits, group_size=group,
                                         dtype=dtype, residual=getattr(side, "residual", None),
                                         key_group=getattr(side, "key_group", 0)))  # fmt: skip
        return sides[0], sides[1]

    @property
    def k_scale(self) -> torch.Tensor | None:
        """fp8: the keys' float32 (heads_kv,) scales, else None."""
        return self.k.scale if self.fp8 else None

    @property
    def v_scale(self) -> torch.Tensor | None:
        """fp8: the values' float32 (heads_kv,) scales, else None."""
        return self.v.scale if self.fp8 else None

    def __repr__(self) -> str:
        layout = "contiguous" if self.page_size is None else f"paged({self.page_size})"
        return (f"KVCache(batch_size={self.batch_size}, max_seqlen={self.max_seqlen}, heads_kv={self.heads_kv}, "
                f"head_dim={self.head_dim}, kv_dtype={self.kv_dtype}, group_size={self.group_size}, "
                f"{f'key_group={self.key_group}, ' if self.key_group else ''}{layout}, "
                f"lengths={self._lengths})")  # fmt: skip


def _fp8_scale(
    x: float | torch.Tensor | None, what: str, heads_kv: int, device: torch.device
) -> torch.Tensor:
    """An fp8 cache's per-head scale as float32 (heads_kv,) on `device`: positive and finite."""
    if x is None:
        x = 1.0
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point() or tuple(x.shape) not in ((), (heads_kv,)):
            raise ValueError(f"KVCache: {what} must be a float or a float tensor of shape ({heads_kv},), got "
                             f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
        scale = x.detach().to(device=device, dtype=torch.float32).expand(heads_kv).clone()
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        scale = torch.full((heads_kv,), float(x), dtype=torch.float32, device=device)
    else:
        raise TypeError(f"KVCache: {what} must be a float or a tensor, got {type(x).__name__}")
    values = scale.tolist()
    if not all(0 < v < float("inf") for v in values):
        raise ValueError(f"KVCache: {what} must be positive and finite, got {values}")
    return scale
