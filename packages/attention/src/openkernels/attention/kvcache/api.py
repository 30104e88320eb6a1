"""attention_with_kvcache: attention against a KV cache, with argument checks.

attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=, v_new=, ...):
    q (B, Sq, Hq, D) against each sequence's cached keys and values (plus k_new / v_new
    appended in place first); the cache contiguous (B, S_cap, Hkv, D) or paged, 16-bit or
    quantized (QuantizedKV: int8, int4, fp8; format.py). Semantics in reference.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from openkernels.shared import dispatch, replay
from openkernels.shared.platform import graph_capturing

from ..core.api import TORCH, _cached
from ..core.problem import check_alibi, check_options
from . import ops, problem
from .format import BITS, FP8, KEY_GROUPS, QuantizedKV, code_width
from .problem import check_lengths

__all__ = ["attention_with_kvcache"]


_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cache_format(name: str, k_cache: object, v_cache: object, q: torch.Tensor) -> tuple[int, int]:
    """(bits, group_size) of a cache given as two tensors or two QuantizedKV; checks that the
    two sides agree and each is well formed."""
    head_dim = q.shape[-1]
    if isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor):
        for what, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(
                    f"{name}: {what} must have q's dtype {q.dtype} (or be a QuantizedKV), got {t.dtype}"
                )
        return 16, head_dim
    if not (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
        raise TypeError(f"{name}: k_cache and v_cache must both be torch.Tensor or both QuantizedKV, got "
                        f"{type(k_cache).__name__} and {type(v_cache).__name__}")  # fmt: skip
    if k_cache.key_group or v_cache.key_group:
        return _channel_keys_format(name, k_cache, v_cache, q)
    if (k_cache.bits, k_cache.group_size) != (v_cache.bits, v_cache.group_size):
        raise ValueError(f"{name}: k_cache and v_cache must share bits and group_size, got "
                         f"{(k_cache.bits, k_cache.group_size)} and {(v_cache.bits, v_cache.group_size)}")  # fmt: skip
    bits, group = k_cache.bits, k_cache.group_size
    if bits not in BITS:
        raise ValueError(f"{name}: a QuantizedKV cache has bits 4 or 8, got {bits!r}")
    if k_cache.data.dtype == FP8 or v_cache.data.dtype == FP8:
        return _fp8_format(name, k_cache, v_cache, q)
    if group not in (32, 64, 128, head_dim) or head_dim % group:
        raise ValueError(
            f"{name}: group_size must divide head_dim {head_dim} and be 32, 64, 128 or head_dim, got {group}"
        )
    for what, side in (("k_cache", k_cache), ("v_cache", v_cache)):
        lead = tuple(side.data.shape[:-1])
        if side.data.dtype != torch.uint8 or side.data.dim() != 4:
            raise TypeError(
                f"{name}: {what}.data must be 4D uint8, got {side.data.dtype} {tuple(side.data.shape)}"
            )
        if side.data.shape[-1] != code_width(head_dim, bits):
            raise ValueError(f"{name}: {what}.data's last dim must be {code_width(head_dim, bits)} for head_dim "
                             f"{head_dim} at {bits} bits, got {side.data.shape[-1]}")  # fmt: skip
        _check_token_scales(
            name, what, side, lead, head_dim // group, k_cache.scale, "k_cache.scale", q.device
        )
    return bits, group


def _check_token_scales(name: str, what: str, side: QuantizedKV, lead: tuple, groups: int, like: torch.Tensor,
                        like_name: str, device: torch.device) -> None:  # fmt: skip
    """A per-token side's scale and zero: float16 (*lead, groups) on `device`, with a unit
    last stride and the strides of `like` (the kernels index them with one set of strides)."""
    for part in ("scale", "zero"):
        t = getattr(side, part)
        want = (*lead, groups)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != want:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: {what}.{part} must be float16 of shape {want}, got {got}")
        if t.stride(-1) != 1 or t.stride() != like.stride() or t.device != device:
            raise ValueError(f"{name}: {what}.{part} must be on {device}, with a unit last stride and the "
                             f"strides of {like_name} (the kernels index them alike)")  # fmt: skip


def _channel_keys_format(name: str, k_cache: QuantizedKV, v_cache: QuantizedKV,
                         q: torch.Tensor) -> tuple[int, int]:  # fmt: skip
    """(bits, the values' group_size) of a cache with keys by channel (format.py): int8/int4
    codes on both sides; the keys' scale and zero float16 (lead0, lead1 // key_group, Hkv, D),
    their residual float16 (batch, key_group, Hkv, D); the values per token."""
    head_dim, group = q.shape[-1], k_cache.key_group
    if v_cache.key_group:
        raise ValueError(f"{name}: only keys are quantized by channel (v_cache.key_group must be 0)")
    if group not in KEY_GROUPS:
        raise ValueError(f"{name}: k_cache.key_group must be one of {KEY_GROUPS}, got {group!r}")
    if k_cache.bits != v_cache.bits or k_cache.bits not in BITS:
        raise ValueError(
            f"{name}: k_cache and v_cache must share bits 4 or 8, got {k_cache.bits} and {v_cache.bits}"
        )
    data = k_cache.data
    if data.dtype != torch.uint8 or data.dim() != 4 or data.shape[-1] != code_width(head_dim, k_cache.bits):
        raise TypeError(f"{name}: k_cache.data must be 4D uint8 (..., heads_kv, {code_width(head_dim, k_cache.bits)}), "
                        f"got {data.dtype} {tuple(data.shape)}")  # fmt: skip
    lead0, lead1, heads_kv = data.shape[:3]
    if lead1 % group:
        raise ValueError(f"{name}: keys by channel need a capacity (or page size) that is a multiple of key_group "
                         f"{group}, got {lead1}")  # fmt: skip
    for part, want in (("scale", (lead0, lead1 // group, heads_kv, head_dim)),
                       ("zero", (lead0, lead1 // group, heads_kv, head_dim)),
                       ("residual", (q.shape[0], group, heads_kv, head_dim))):  # fmt: skip
        t = getattr(k_cache, part)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != want:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name}: k_cache.{part} of keys by channel must be float16 of shape {want}, got {got}"
            )
        if t.stride(-1) != 1 or t.device != q.device:
            raise ValueError(f"{name}: k_cache.{part} must be on {q.device} with a unit last stride")
    if k_cache.zero.stride() != k_cache.scale.stride():
        raise ValueError(f"{name}: k_cache.zero must have the strides of k_cache.scale")
    v_group = v_cache.group_size
    if v_group not in (32, 64, 128, head_dim) or head_dim % v_group:
        raise ValueError(f"{name}: v_cache.group_size must divide head_dim {head_dim} and be 32, 64, 128 or "
                         f"head_dim, got {v_group}")  # fmt: skip
    if v_cache.data.dtype != torch.uint8 or tuple(v_cache.data.shape) != tuple(data.shape):
        raise TypeError(f"{name}: v_cache.data must be uint8 of k_cache.data's shape {tuple(data.shape)}")
    _check_token_scales(name, "v_cache", v_cache, (lead0, lead1, heads_kv), head_dim // v_group, v_cache.scale,
                        "v_cache.scale", q.device)  # fmt: skip
    return k_cache.bits, v_group


def _fp8_format(name: str, k_cache: QuantizedKV, v_cache: QuantizedKV, q: torch.Tensor) -> tuple[int, int]:
    """(8, head_dim) of an fp8 cache: float8_e4m3fn data (..., heads_kv, head_dim) on q's
    device, float32 scale (heads_kv,) per side, no zero."""
    head_dim = q.shape[-1]
    for what, side in (("k_cache", k_cache), ("v_cache", v_cache)):
        if side.data.dtype != FP8 or side.data.dim() != 4 or side.data.shape[-1] != head_dim:
            raise TypeError(f"{name}: an fp8 cache has float8_e4m3fn data (..., heads_kv, {head_dim}) on both sides, "
                            f"got {what}.data {side.data.dtype} {tuple(side.data.shape)}")  # fmt: skip
        if side.group_size != head_dim or side.zero is not None:
            raise ValueError(f"{name}: an fp8 {what} has group_size head_dim ({head_dim}) and no zero "
                             "(build it with QuantizedKV.fp8)")  # fmt: skip
        heads_kv = side.data.shape[2]
        t = side.scale
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (heads_kv,)
                or t.device != q.device):  # fmt: skip
            got = (
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
                if isinstance(t, torch.Tensor)
                else type(t).__name__
            )
            raise ValueError(f"{name}: an fp8 {what}.scale must be float32 of shape ({heads_kv},) on {q.device} "
                             f"(one per KV head), got {got}")  # fmt: skip
    return 8, head_dim


def _cache_data(t: torch.Tensor | QuantizedKV) -> torch.Tensor:
    return t.data if isinstance(t, QuantizedKV) else t


def _shape_or_type(t: object) -> tuple[int, ...] | str:
    """A tensor's shape, or its type's name when it is no tensor (for the message)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_kvcache(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos, rotary_sin,
                   cache_format=None, rows_indexed=False):  # fmt: skip
    """Shapes, dtypes and devices of attention_with_kvcache's tensors; returns (bits, group).
    cache_format: the (bits, group) of a cache already checked for q's dtype, head_dim and
    device (KVCache remembers it), which skips the per-side format checks. rows_indexed: a
    contiguous cache whose rows cache_batch_idx picks (any number of rows)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"{name}: q must be a 4D (batch, seqlen_q, heads_q, head_dim) tensor")
    if q.dtype not in _CACHE_DTYPES:
        raise TypeError(f"{name}: q's dtype {q.dtype} is not supported; use float16, bfloat16 or float32")
    batch, seqlen_q, _, head_dim = q.shape
    problem.check_head_dim(name, head_dim, problem.HEAD_DIMS)
    bits, group = cache_format or _cache_format(name, k_cache, v_cache, q)
    kd, vd = _cache_data(k_cache), _cache_data(v_cache)
    if kd.dim() != 4 or kd.shape != vd.shape:
        raise ValueError(f"{name}: k_cache and v_cache must be 4D of one shape, got {tuple(kd.shape)} and "
                         f"{tuple(vd.shape)}")  # fmt: skip
    for what, t in (("k_cache", kd), ("v_cache", vd)):
        if t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name}: {what} must have a unit stride along head_dim (it is written in place)"
            )
    heads_kv = kd.shape[2]
    paged = block_table is not None
    problem.check_cache_heads(name, tuple(q.shape), tuple(kd.shape), bits == 16, paged, rows_indexed)
    if paged:
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dtype != torch.int32
            or block_table.dim() != 2
        ):
            raise TypeError(f"{name}: block_table must be an int32 (batch, max_pages) tensor")
        if block_table.shape[0] != batch or block_table.device != q.device:
            raise ValueError(f"{name}: block_table must have {batch} rows and be on {q.device}, got "
                             f"{tuple(block_table.shape)} on {block_table.device}")  # fmt: skip
        problem.check_page_size(name, kd.shape[1])
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{name}: cache_seqlens must be an int32 tensor of shape ({batch},)")
    if tuple(cache_seqlens.shape) != (batch,) or cache_seqlens.device != q.device:
        raise ValueError(f"{name}: cache_seqlens must have shape ({batch},) and be on {q.device}, got "
                         f"{tuple(cache_seqlens.shape)} on {cache_seqlens.device}")  # fmt: skip
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{name}: k_new and v_new must be given together")
    if k_new is not None:
        want = (batch, seqlen_q, heads_kv, head_dim)
        for what, t in (("k_new", k_new), ("v_new", v_new)):
            problem.check_new_tokens(name, what, _shape_or_type(t), want)
            if t.dtype != q.dtype or t.device != q.device:
                raise TypeError(f"{name}: {what} must have q's dtype and device, got {t.dtype} on {t.device}")
    check_rotary_tables(name, rotary_cos, rotary_sin, head_dim, q.device)
    return bits, group


def check_rotary_tables(name: str, rotary_cos: object, rotary_sin: object, head_dim: int,
                        device: torch.device) -> None:  # fmt: skip
    """rotary_cos / rotary_sin: both or neither, float (seqlen_ro, rotary_dim / 2) tensors of one
    shape on `device` with a unit last stride, rotary_dim in 2..head_dim."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{name}: rotary_cos and rotary_sin must be given together")
    if rotary_cos is None:
        return
    for what, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: {what} must be a float (seqlen_ro, rotary_dim / 2) tensor, got {got}")
        if t.shape != rotary_cos.shape or t.device != device or t.stride(-1) != 1:
            raise ValueError(f"{name}: rotary_cos and rotary_sin must share a shape, be on {device} and have a unit "
                             f"last stride, got {tuple(t.shape)} on {t.device}")  # fmt: skip
    problem.check_rotary_dim(name, rotary_cos.shape[1], head_dim)


def _check_per_sequence(name: str, what: str, t: object, batch: int, device: torch.device) -> None:
    """cache_batch_idx / cache_leftpad: an int32 (batch,) tensor on q's device."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: {what} must be an int32 tensor of shape ({batch},), got {got}")
    if tuple(t.shape) != (batch,) or t.device != device:
        raise ValueError(f"{name}: {what} must have shape ({batch},) and be on {device}, got {tuple(t.shape)} on "
                         f"{t.device}")  # fmt: skip


def check_block_table(name: str, block_table: torch.Tensor, lengths: torch.Tensor | list[int], page: int,
                      num_pages: int, seqlen_new: int = 0, label=None) -> None:  # fmt: skip
    """Every page that holds one of `lengths` tokens of a sequence must exist, and a page that
    receives one of the last `seqlen_new` tokens of a sequence (the append) must appear once
    among the pages in use: two sequences, or two slots of one, writing the same page would
    overwrite each other's keys. Pages only read may be shared. One device-to-host copy.
    label(b, i): how an entry is named in errors (default block_table[b, i])."""
    label = label or (lambda b, i: f"block_table[{b}, {i}]")
    need = torch.as_tensor(lengths, device=block_table.device).to(torch.int64)
    starts = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page
    used = starts < need[:, None]
    bad = (used & ((block_table < 0) | (block_table >= num_pages))).nonzero()
    if bad.shape[0]:
        b, i = bad[0].tolist()
        raise ValueError(f"{name}: {label(b, i)} = {block_table[b, i].item()} is not a page of the cache "
                         f"(0..{num_pages - 1})")  # fmt: skip
    if seqlen_new <= 0:
        return
    pages = torch.where(used, block_table.to(torch.int64), num_pages)  # unused slots count in a spare bin
    uses = torch.bincount(pages.flatten(), minlength=num_pages + 1)
    written = used & (starts + page > need[:, None] - seqlen_new)
    shared = (written & (uses[pages] > 1)).nonzero()
    if shared.shape[0]:
        b, i = shared[0].tolist()
        p = int(block_table[b, i])
        others = [tuple(x) for x in ((pages == p) & used).nonzero().tolist() if tuple(x) != (b, i)]
        raise ValueError(f"{name}: {label(b, i)} = {p} receives new tokens but is also {label(*others[0])}: a "
                         "page written by an append must belong to one sequence once (pages only read may be "
                         "shared)")  # fmt: skip


def _written_slots(positions: torch.Tensor, block_table: torch.Tensor | None,
                   page: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(page or sequence, slot) index tensors of token positions (batch, n)."""
    if block_table is None:
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        return rows.expand_as(positions), positions
    return block_table.to(torch.int64).gather(1, positions // page), positions % page


def _written_parts(k_new, cache_seqlens, block_table, kd, vd, quant, k_residual, key_group):
    """What an append of k_new writes, as (tensor, index) pairs for _append_then_attend: the
    new tokens' slots of every per-token tensor (fp8's per-head scales are fixed when the cache
    is made); with keys by channel, every slot of the groups the new keys touch (a group that
    fills is quantized again from its first token), their scales and the residual."""
    n, page = k_new.shape[1], kd.shape[1]
    start = cache_seqlens.to(torch.int64)[:, None]
    slots = _written_slots(start + torch.arange(n, device=start.device)[None, :], block_table, page)
    if kd.dtype == FP8:
        return [(kd, slots), (vd, slots)]
    if not key_group:
        return [(kd, slots), (vd, slots)] + [(t, slots) for t in quant if t is not None]
    # Each touched group whole: from the first group's start to the end of the last one.
    first = start // key_group * key_group
    last = (start + n + key_group - 1) // key_group * key_group - 1
    span = (first + torch.arange(n + key_group, device=start.device)[None, :]).minimum(last)
    page_of, slot = _written_slots(span, block_table, page)
    k_scale, k_zero, v_scale, v_zero = quant
    groups = (page_of, slot // key_group)
    return [(kd, (page_of, slot)), (k_scale, groups), (k_zero, groups), (k_residual, None), (vd, slots),
            (v_scale, slots), (v_zero, slots)]  # fmt: skip


def _append_then_attend(append, forward, written: list[tuple[torch.Tensor, tuple | None]] | None,
                        append_args: tuple, forward_args: tuple):  # fmt: skip
    """The append, then the forward; when `written` is given (a failure of the forward would
    reach the caller: the tensors the append writes, each with the index of what it writes,
    None for all of it), those parts are saved first and put back if the forward raises, so
    a failed call leaves the cache bitwise as it was."""
    saved = _save(written)
    append(*append_args)
    try:
        return forward(*forward_args)
    except BaseException:
        _restore(saved)
        raise


def _save(written: list[tuple[torch.Tensor, tuple | None]] | None) -> list | None:
    """Copies of the parts a call may write ((tensor, index or None for all of it) pairs)."""
    return (
        None if written is None else [(t, idx, (t if idx is None else t[idx]).clone()) for t, idx in written]
    )


def _restore(saved: list | None) -> None:
    """Put `_save`'s copies back (a call that failed after writing)."""
    for t, idx, old in saved or ():
        if idx is None:
            t.copy_(old)
        else:
            t[idx] = old


class KVCallPlan(NamedTuple):
    """What `_kvcache_call` derives from its checked arguments and reuses for every call of
    the same signature (KVCache keeps one per signature: a decode step then skips the checks):
    the cache sides it was made for (identity-checked on reuse), the format, the window, the
    scale and the quantization's side tensors."""

    k_cache: Any
    v_cache: Any
    block_table: torch.Tensor | None
    bits: int
    group: int
    left: int
    right: int
    scale: float
    softcap: float
    quant: tuple
    key_group: int
    k_residual: torch.Tensor | None


def _kvcache_plan(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
                  window, alibi_slopes, softcap, rotary_cos, rotary_sin, rotary_interleaved, cache_format,
                  cache_batch_idx, cache_leftpad) -> KVCallPlan:  # fmt: skip
    """Every check of attention_with_kvcache's arguments that needs no device read; the plan."""
    batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError(f"{name}: cache_batch_idx picks rows of a contiguous cache; a paged cache's "
                             "block_table already maps sequences to pages")  # fmt: skip
        _check_per_sequence(name, "cache_batch_idx", cache_batch_idx, batch, q.device)
    if cache_leftpad is not None:
        if block_table is not None:
            raise ValueError(f"{name}: cache_leftpad applies to contiguous caches (rows picked by cache_batch_idx "
                             "or not); a paged cache leaves the padding out of its block table")  # fmt: skip
        _check_per_sequence(name, "cache_leftpad", cache_leftpad, batch, q.device)
    bits, group = _check_kvcache(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, rotary_cos,
                                 rotary_sin, cache_format, rows_indexed=cache_batch_idx is not None)  # fmt: skip
    left, right = check_options(name, causal, softmax_scale, window, softcap, _cached())
    check_alibi(name, TORCH, alibi_slopes, q, q.shape[2], q.shape[0])
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"{name}: rotary_interleaved must be a bool, got {rotary_interleaved!r}")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    quant = (k_cache.scale, k_cache.zero, v_cache.scale, v_cache.zero) if bits != 16 else (None,) * 4
    key_group = k_cache.key_group if isinstance(k_cache, QuantizedKV) else 0
    if key_group and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError(f"{name}: keys by channel (key_group {key_group}) take neither cache_batch_idx nor "
                         "cache_leftpad: their groups count positions from each sequence's first slot")  # fmt: skip
    return KVCallPlan(k_cache, v_cache, block_table, bits, group, left, right, scale, float(softcap), quant,
                      key_group, k_cache.residual if key_group else None)  # fmt: skip


def _kvcache_call(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale, window,
                  alibi_slopes, softcap, rotary_cos, rotary_sin, rotary_interleaved, host_lengths,
                  cache_format=None, check=True, cache_batch_idx=None, cache_leftpad=None,
                  plan=None):  # fmt: skip
    """attention_with_kvcache's body; host_lengths: the lengths after the append when the
    caller knows them (KVCache), else they are checked here with one device-to-host copy
    (unless check=False); cache_format: see _check_kvcache; plan: a KVCallPlan made by an
    earlier call of the same signature on these cache sides (KVCache.attend's fast path: the
    checks are skipped).

    cache_batch_idx views the contiguous cache as a paged one with one page per row and the
    table cache_batch_idx[:, None]; cache_leftpad goes to the backends as it is, beside
    cache_seqlens (they take each sequence's first slot and length from the two, clamping the
    pad to the length: reference.py), so that a left-padded call launches nothing before them."""
    name = "attention_with_kvcache"
    if plan is None:
        plan = _kvcache_plan(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal,
                             softmax_scale, window, alibi_slopes, softcap, rotary_cos, rotary_sin, rotary_interleaved,
                             cache_format, cache_batch_idx, cache_leftpad)  # fmt: skip
    bits, group, left, right, scale = plan.bits, plan.group, plan.left, plan.right, plan.scale
    quant, key_group, k_residual = plan.quant, plan.key_group, plan.k_residual
    kd, vd = _cache_data(k_cache), _cache_data(v_cache)
    seqlen_new = 0 if k_new is None else k_new.shape[1]
    tracing = (
        torch.compiler.is_compiling() or q.device.type == "meta" or graph_capturing(q.device)
    )  # no host reads
    label = None
    if cache_batch_idx is not None:
        block_table, label = cache_batch_idx[:, None], (lambda b, i: f"cache_batch_idx[{b}]")
    capacity = kd.shape[1] if block_table is None else block_table.shape[1] * kd.shape[1]
    if host_lengths is None and check and not tracing:  # one small device-to-host copy (two when paged)
        replay.reads_host_values("the checked cache lengths")  # check=False calls replay; these cannot
        rows = None if rotary_cos is None else rotary_cos.shape[0]
        if cache_leftpad is None:
            host_lengths = check_lengths(name, cache_seqlens.tolist(), capacity, seqlen_new, q.shape[1], rows)
            stored = host_lengths
        else:
            ends, pads = torch.stack((cache_seqlens, cache_leftpad)).tolist()
            stored = check_lengths(name, ends, capacity, seqlen_new, q.shape[1], None)
            for b, (end, pad) in enumerate(zip(ends, pads)):
                if not 0 <= pad <= end:
                    raise ValueError(
                        f"{name}: cache_leftpad[{b}] = {pad} must lie in 0..cache_seqlens[{b}] = {end}"
                    )
            host_lengths = check_lengths(name, [e - p for e, p in zip(ends, pads)], capacity, seqlen_new, q.shape[1],
                                         rows)  # fmt: skip
        if block_table is not None:
            check_block_table(name, block_table, stored, kd.shape[1], kd.shape[0], seqlen_new, label)
    max_seqlen_k = max(host_lengths, default=0) if host_lengths is not None else capacity
    # A bound for planning only: rounded up to 16 (what the plans resolve), one key serves 16
    # decode steps in a row and the eager bodies replay (shared.replay).
    max_seqlen_k = -(-max_seqlen_k // 16) * 16
    library = tracing or any(type(t) is not torch.Tensor for t in (q, kd, vd))
    # Both ops take the same path (decided here, once, for the pair).
    append = ops.KVCACHE_APPEND.library if library else ops.KVCACHE_APPEND.direct
    forward = ops.ATTENTION_KVCACHE.library if library else ops.ATTENTION_KVCACHE.direct
    forward_args = (q, kd, vd, *quant, cache_seqlens, block_table, rotary_cos, rotary_sin, seqlen_new, max_seqlen_k,
                    scale, left, right, alibi_slopes, plan.softcap, rotary_interleaved, bits, group,
                    cache_leftpad, k_residual, key_group)  # fmt: skip
    if k_new is None or k_new.numel() == 0:
        return forward(*forward_args)
    written = None
    if not library:
        # Neither op may fail after the append has written: pick both implementations first
        # (a forced or forbidden backend that cannot run raises here). A failure inside the
        # forward falls back to the next implementation unless it would reach the caller
        # (strict, steered, or one candidate): only then are the written slots saved.
        dispatch.select("kvcache_append", dispatch.key_for(k_new))
        chosen = dispatch.select("attention_kvcache", dispatch.key_for(q))
        if dispatch.is_strict() or dispatch.is_steered() or len(chosen) == 1:
            written = _written_parts(k_new, cache_seqlens, block_table, kd, vd, quant, k_residual, key_group)
    append_args = (kd, vd, *quant, k_new, v_new, cache_seqlens, block_table, rotary_cos, rotary_sin,
                   rotary_interleaved, bits, group, cache_leftpad, k_residual, key_group)  # fmt: skip
    return _append_then_attend(append, forward, written, append_args, forward_args)


def fused_append_ready(q: torch.Tensor, k_cache: object, seqlen_new: int) -> bool:
    """Whether a static cache's step can append, attend and advance in one call
    (`_kvcache_append_call`): a 16-bit cache, one query per new token, the Triton backend
    selected (the CPU's kernel is the two-op path's forward). Eager calls only (it reads the
    dispatch state): a compiled step reads what the layer's eager calls found (hf.py)."""
    if not isinstance(k_cache, torch.Tensor) or type(q) is not torch.Tensor or q.shape[1] != seqlen_new:
        return False
    if q.device.type == "cpu":
        return False
    try:
        chosen = dispatch.select("attention_kvcache_append", dispatch.key_for(q))
    except dispatch.UnsupportedError:
        return False
    return chosen[0].name == "triton"


def check_token_rotary(name: str, cos: object, sin: object, k_new: torch.Tensor) -> None:
    """Per-token rotary tables: float (B or 1, Sn, R) tensors of one shape on k_new's device, a
    unit last stride, R even and <= head_dim."""
    batch, seqlen_new, _, head_dim = k_new.shape
    for what, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 3:
            raise TypeError(f"{name}: {what} must be a float (batch or 1, seqlen, rotary_dim) tensor")
        if t.shape != cos.shape or t.device != k_new.device or t.stride(-1) != 1:
            raise ValueError(f"{name}: cos and sin must share a shape, be on {k_new.device} and have a unit last "
                             "stride")  # fmt: skip
    if (
        cos.shape[0] not in (1, batch)
        or cos.shape[1] != seqlen_new
        or cos.shape[2] % 2
        or not (2 <= cos.shape[2] <= head_dim)
    ):
        raise ValueError(f"{name}: cos must be (1 or {batch}, {seqlen_new}, an even rotary_dim <= {head_dim}), got "
                         f"{tuple(cos.shape)}")  # fmt: skip


def _kvcache_append_call(q, k_cache, v_cache, cache_seqlens, k_new, v_new, token_cos, token_sin, advance, causal,
                         softmax_scale, window, softcap, cache_leftpad, host_lengths, check=True,
                         plan=None):  # fmt: skip
    """A 16-bit cache's append of k_new / v_new, the attention of q and the advance of the
    length counter `advance` (int32, one element; it may be cache_seqlens itself) by the new
    tokens, in one op (`ops.ATTENTION_KVCACHE_APPEND`: on CUDA one attention launch, the
    append inside it, the advance in the split combine). token_cos / token_sin: per-token
    rotary tables of q and k_new (B or 1, Sn, R), as transformers' position embeddings give
    them, or None. The checks and host lengths as `_kvcache_call`'s (plan: a KVCallPlan of
    this signature, made by `_kvcache_plan` with these k_new / v_new). A call that fails
    leaves the cache and the counter as they were."""
    name = "attention_with_kvcache"
    if plan is None:
        plan = _kvcache_plan(name, q, k_cache, v_cache, cache_seqlens, k_new, v_new, None, causal, softmax_scale,
                             window, None, softcap, None, None, False, None, None, cache_leftpad)  # fmt: skip
        if token_cos is not None:
            check_token_rotary(name, token_cos, token_sin, k_new)
    if plan.bits != 16:
        raise ValueError(f"{name}: the fused append takes a 16-bit cache")
    seqlen_new = k_new.shape[1]
    tracing = torch.compiler.is_compiling() or graph_capturing(q.device)
    capacity = k_cache.shape[1]
    if host_lengths is None and check and not tracing:
        replay.reads_host_values("the checked cache lengths")
        ends = cache_seqlens.tolist()
        pads = [0] * len(ends) if cache_leftpad is None else cache_leftpad.tolist()
        check_lengths(name, ends, capacity, seqlen_new, q.shape[1], None)
        host_lengths = [e - min(p, e) + seqlen_new for e, p in zip(ends, pads)]
    max_seqlen_k = max(host_lengths, default=0) if host_lengths is not None else capacity
    max_seqlen_k = -(-max_seqlen_k // 16) * 16
    op = ops.ATTENTION_KVCACHE_APPEND.library if tracing else ops.ATTENTION_KVCACHE_APPEND.direct
    args = (q, k_cache, v_cache, cache_seqlens, None, k_new, v_new, token_cos, token_sin, advance, max_seqlen_k,
            plan.scale, plan.left, plan.right, None, plan.softcap, cache_leftpad)  # fmt: skip
    if tracing:
        return op(*args)
    written = None
    chosen = dispatch.select("attention_kvcache_append", dispatch.key_for(q))
    if dispatch.is_strict() or dispatch.is_steered() or len(chosen) == 1:  # a failure would reach the caller
        written = _written_parts(k_new, cache_seqlens, None, k_cache, v_cache, (None,) * 4, None, 0)
        written += [(advance, None)] if advance is not None else []
    saved = _save(written)
    try:
        return op(*args)
    except BaseException:
        _restore(saved)
        raise


# check=False calls replay from their third on (shared.replay: the planning bound is the
# cache's capacity, a function of the shapes); checked ones read the lengths on the host.
@replay.replayable
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor | QuantizedKV,
    v_cache: torch.Tensor | QuantizedKV,
    cache_seqlens: torch.Tensor,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
    return_lse: bool = False,
    check: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries against a KV cache: decode (seqlen_q 1) and chunked prefill.

    q: (batch, seqlen_q, heads_q, head_dim) float16/bfloat16 (float32 on the CPU path or the
    reference). k_cache, v_cache: the cache, either tensors in q's dtype or `QuantizedKV`
    (int8 / int4 codes with float16 per-group scale and zero, format.py), laid out
    contiguous (batch, capacity, heads_kv, head_dim) or paged (num_pages, page_size,
    heads_kv, head_dim) with `block_table` (batch, max_pages) int32 (page_size a multiple of
    16). heads_q a multiple of heads_kv (GQA/MQA). `KVCache` builds and owns all of this.
    cache_seqlens: int32 (batch,), tokens already in each sequence's cache.
    k_new, v_new: (batch, seqlen_q, heads_kv, head_dim): written into the cache in place at
        cache_seqlens (rotated first when rotary_cos is given; quantized for a quantized
        cache) before the attention. cache_seqlens itself is not advanced.
    cache_batch_idx: int32 (batch,), contiguous caches only: sequence b uses row
        cache_batch_idx[b] of a cache of any number of rows (distinct rows when k_new is given).
    cache_leftpad: int32 (batch,), contiguous caches only: sequence b's tokens start at slot
        cache_leftpad[b] of its row (a left-padded batch); the slots before it are never read. cache_seqlens still
        counts from slot 0 (FlashAttention's convention), so sequence b holds cache_seqlens[b]
        - cache_leftpad[b] tokens, and positions (rotary, causal, window) count from its first
        token. 0 <= cache_leftpad[b] <= cache_seqlens[b].
    Sequence b attends its first cache_seqlens[b] (+ seqlen_q when k_new) positions; query i
    sits at the last seqlen_q of them (bottom-right, as in `attention`), which is also its
    rotary position. causal (default True), softmax_scale, window, alibi_slopes (float32
    (heads_q,) or (batch, heads_q)), softcap: as in `attention`.
    rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); rotary on q and k_new over the
        first rotary_dim elements, GPT-NeoX halves or (rotary_interleaved) GPT-J pairs.
    Returns out (batch, seqlen_q, heads_q, head_dim) in q's dtype [, lse (batch, heads_q,
    seqlen_q) float32]. Bounds (lengths against the capacity, block_table entries, rotary
    rows) are checked with a small device-to-host copy before anything is written (`KVCache`
    knows its lengths and skips it); a bad call raises and leaves the cache bitwise unchanged,
    and so does a call whose attention fails after the append. Pages of a block table may be
    shared between sequences for reading; a page that receives new tokens must appear once.
    check=False skips the bounds checks and their device-to-host copy (a decode step that
    never waits for the GPU): the caller guarantees them, and out-of-bounds lengths or pages
    are then undefined behaviour. Shapes, dtypes and devices are checked either way.
    Inference only (no autograd).
    """
    if not isinstance(check, bool):
        raise TypeError(f"attention_with_kvcache: check must be a bool, got {check!r}")
    out, lse = _kvcache_call(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, causal, softmax_scale,
                             window, alibi_slopes, softcap, rotary_cos, rotary_sin, rotary_interleaved, None,
                             check=check, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)  # fmt: skip
    return (out, lse) if return_lse else out
