"""The sizes and options of one attention call as the kernels see them, and the argument
checks of both front ends: plain data, shared by the launch plans (triton/plan.py), the
PyTorch API (api.py) and the JAX face (jax/), which must not need torch or triton.
NamedTuples, hashable: the launch plans are cached on them, and the PyTorch launchers build
one per call (a frozen dataclass costs microseconds more).

The checks take a front end's arrays through an `ArrayKind` (what its array type, dtypes
and devices are), so one function checks a torch.Tensor and a jax.Array alike, with the same
messages."""

from __future__ import annotations

import functools
import itertools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = [
    "ArrayKind",
    "check_qkv",
    "check_alibi",
    "check_sinks",
    "check_cu_seqlens",
    "check_dense_call",
    "check_varlen_call",
    "KERNEL_DTYPES",
    "HEAD_DIMS",
    "ATTENTION_HEAD_DIMS",
    "Problem",
    "check_alibi_shape",
    "check_cu_values",
    "check_dropout",
    "dropout_threshold",
    "PHILOX_ROUNDS",
    "check_head_dim",
    "check_options",
    "check_qkv_shapes",
    "check_same_n_seqs",
    "resolve_scale",
]


KERNEL_DTYPES = ("float16", "bfloat16")  # what the Triton attention and KV-cache kernels take
# The KV cache's and the JAX face's head dims (their tiles are tuned and checked per dim).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# attention / attention_varlen: any multiple of 8 up to 256, as FlashAttention-2 takes; the
# Triton kernels pad head_dim to a power of two (at least 16) and mask the pad.
ATTENTION_HEAD_DIMS = tuple(range(8, 257, 8))


class ArrayKind(NamedTuple):
    """How one front end's arrays look to the shared checks.

    name: the array type as messages spell it ("torch.Tensor"); array: that type; floats:
    attention's input dtypes (the front end's dtype objects); float32, int32: its dtypes of
    those names; devices: whether arrays carry a device the call's arrays must share;
    host_values(array) -> the values as a list, or None when they are not known now (while
    a compiler traces): one small device-to-host copy."""

    name: str
    array: type
    floats: tuple
    float32: Any
    int32: Any
    devices: bool
    host_values: Callable[[Any], list | None]


# Dropout alone in a full (not causal) call on the plain fast configs (the D128 backward's
# 64 x 128 dK/dV tile compiles without spills with it on sm_90, 255 registers; causal dropout
# spills 24 B). On since attention 0.8.8: H100, forward+backward with dropout 0.1 against the
# override configs, B8 H16 S2048 D128 2.817 -> 4.556 ms (4.883 before), B2 H16 S8192 D128
# 16.318 (17.620), B8 H32 S2048 D64 5.783 (5.814); the forward runs the same configs either
# way (benchmarks/studies/attention_dropout_configs.py; GPU test
# test_dropout.py::test_full_dropout_on_the_plain_configs passed). False restores the overrides.
FULL_DROPOUT_ON_PLAIN_CONFIGS = True


class Problem(NamedTuple):
    """One attention call as the kernels see it. seqlen_q / seqlen_k: the dense lengths, or
    the longest sequence of a varlen call (n_seqs sequences); window_right 0 is causal, -1
    an unbounded side; alibi: slopes are given ((n_seqs, heads_q) float32); softcap 0: off;
    dropout: the probability dropped (0: off)."""

    n_seqs: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    varlen: bool
    scale: float
    window_left: int
    window_right: int
    alibi: bool
    softcap: float
    dropout: float = 0.0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def options(self) -> bool:
        """Any option beyond the causal mask: a window, ALiBi, softcap or dropout."""
        return (
            self.window_left >= 0
            or self.window_right > 0
            or self.alibi
            or self.softcap > 0
            or self.dropout > 0
        )

    @property
    def option_configs(self) -> bool:
        """Whether the call takes the fast path's override configs for options
        (configs._OPTIONS_TABLE): a window, dropout, or a softcap with ALiBi. ALiBi alone and
        a softcap alone keep the plain configs (attention 0.8.7: on sm_90 the D128 backward's
        64 x 128 dK/dV tile compiles without spills with either, 252-255 registers, and
        spills 24-40 B with both, with a window or with causal dropout)."""
        full_dropout = self.window_right < 0 and not (self.alibi or self.softcap)  # dropout alone, not causal
        return (
            self.window_left >= 0
            or self.window_right > 0
            or (self.dropout > 0 and not (FULL_DROPOUT_ON_PLAIN_CONFIGS and full_dropout))
            or (self.softcap > 0 and self.alibi)
        )

    def general(self, strides_aligned: bool) -> bool:
        """Whether the call is off the fast path (configs._TABLE): varlen, or lengths or
        strides that are not multiples of 16. (Options stay on it: configs._OPTIONS_TABLE.)"""
        return self.varlen or self.seqlen_q % 16 != 0 or self.seqlen_k % 16 != 0 or not strides_aligned


def check_qkv_shapes(name: str, q: tuple, k: tuple, v: tuple, dims: int, head_dims: tuple[int, ...]) -> None:
    """The shape rules of q, k, v (both front ends): k and v alike, one batch, one head_dim
    out of `head_dims`, heads_q a multiple of heads_kv. Shapes as tuples; ranks already
    checked by the caller."""
    if k != v:
        raise ValueError(f"{name}: k and v must have the same shape, got {k} and {v}")
    if dims == 4 and q[0] != k[0]:
        raise ValueError(f"{name}: q has batch {q[0]} but k has batch {k[0]}")
    head_dim = q[-1]
    if k[-1] != head_dim:
        raise ValueError(f"{name}: q has head_dim {head_dim} but k and v have {k[-1]}")
    check_head_dim(name, head_dim, head_dims)
    heads_q, heads_kv = q[-2], k[-2]
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"{name}: heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for MQA/GQA"
        )


def check_qkv(
    name: str, kind: ArrayKind, q: Any, k: Any, v: Any, dims: int, head_dims: tuple[int, ...]
) -> None:
    """q, k, v: arrays of `kind`, of rank `dims` (4 dense, 3 packed), one dtype out of
    kind.floats (and one device), shapes as check_qkv_shapes says."""
    layout = "(batch, seqlen, heads, head_dim)" if dims == 4 else "(tokens, heads, head_dim)"
    for what, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, kind.array):
            raise TypeError(f"{name}: {what} must be a {kind.name}, got {type(t).__name__}")
        if t.ndim != dims:
            raise ValueError(f"{name}: {what} must be {dims}D {layout}, got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: q, k, v must share a dtype, got q {q.dtype} and {what} {t.dtype}")
        if kind.devices and t.device != q.device:
            raise ValueError(
                f"{name}: q, k, v must be on one device, got q on {q.device} and {what} on {t.device}"
            )
    if q.dtype not in kind.floats:
        names = ", ".join(getattr(d, "__name__", str(d).rpartition(".")[2]) for d in kind.floats)
        raise TypeError(f"{name}: dtype {q.dtype} is not supported; use one of {names}")
    check_qkv_shapes(name, tuple(q.shape), tuple(k.shape), tuple(v.shape), dims, head_dims)


def check_alibi(name: str, kind: ArrayKind, alibi_slopes: Any, q: Any, heads: int, n_seqs: int) -> None:
    """alibi_slopes: None, or a float32 array of `kind` on q's device, (heads,) or (n_seqs, heads)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, kind.array):
        raise TypeError(
            f"{name}: alibi_slopes must be a {kind.name} or None, got {type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != kind.float32:
        raise TypeError(f"{name}: alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if kind.devices and alibi_slopes.device != q.device:
        raise ValueError(f"{name}: alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
    check_alibi_shape(name, tuple(alibi_slopes.shape), heads, n_seqs)


def check_sinks(name: str, kind: ArrayKind, sinks: Any, q: Any, heads: int) -> None:
    """sinks: None, or a float32 (heads,) array of `kind` on q's device: one learnable logit
    per query head, an extra key with a zero value in every row's softmax (reference.py)."""
    if sinks is None:
        return
    if not isinstance(sinks, kind.array):
        raise TypeError(f"{name}: sinks must be a {kind.name} or None, got {type(sinks).__name__}")
    if sinks.dtype != kind.float32:
        raise TypeError(f"{name}: sinks must be float32, got {sinks.dtype}")
    if kind.devices and sinks.device != q.device:
        raise ValueError(f"{name}: sinks is on {sinks.device} but q is on {q.device}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"{name}: sinks must have shape ({heads},) (one per query head), got {tuple(sinks.shape)}"
        )


def check_cu_seqlens(
    name: str, kind: ArrayKind, what: str, cu: Any, q: Any, tokens: int, max_seqlen: object
) -> None:
    """cu_seqlens_q / cu_seqlens_k: an int32 (n_seqs + 1,) array of `kind` on q's device, and
    max_seqlen a Python int; the values (when known now) as check_cu_values says."""
    if not isinstance(cu, kind.array):
        raise TypeError(f"{name}: {what} must be a {kind.name}, got {type(cu).__name__}")
    if cu.dtype != kind.int32:
        raise TypeError(f"{name}: {what} must be int32, got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: {what} must be 1D (n_seqs + 1,), got shape {tuple(cu.shape)}")
    if kind.devices and cu.device != q.device:
        raise ValueError(f"{name}: {what} is on {cu.device} but q is on {q.device}")
    if not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise ValueError(f"{name}: max_seqlen for {what} must be a Python int >= 0, got {max_seqlen!r}")
    values = kind.host_values(cu)
    if values is not None:  # unknown while tracing: the caller vouches (as for any index array)
        check_cu_values(name, what, values, tokens, max_seqlen)


def check_dense_call(name: str, kind: ArrayKind, q: Any, k: Any, v: Any, head_dims: tuple[int, ...], causal: object,
                     softmax_scale: object, window: object, alibi_slopes: Any, softcap: object, sinks: Any = None,
                     cached: bool = True) -> tuple[int, int, float]:  # fmt: skip
    """Every check of an `attention` call; returns (window_left, window_right, scale)."""
    check_qkv(name, kind, q, k, v, 4, head_dims)
    left, right = check_options(name, causal, softmax_scale, window, softcap, cached)
    check_alibi(name, kind, alibi_slopes, q, q.shape[2], q.shape[0])
    check_sinks(name, kind, sinks, q, q.shape[2])
    return left, right, resolve_scale(q.shape[-1], softmax_scale)


def check_varlen_call(name: str, kind: ArrayKind, q: Any, k: Any, v: Any, head_dims: tuple[int, ...], cu_seqlens_q: Any,
                      cu_seqlens_k: Any, max_seqlen_q: object, max_seqlen_k: object, causal: object,
                      softmax_scale: object, window: object, alibi_slopes: Any, softcap: object, sinks: Any = None,
                      cached: bool = True) -> tuple[int, int, float]:  # fmt: skip
    """Every check of an `attention_varlen` call; returns (window_left, window_right, scale)."""
    check_qkv(name, kind, q, k, v, 3, head_dims)
    check_cu_seqlens(name, kind, "cu_seqlens_q", cu_seqlens_q, q, q.shape[0], max_seqlen_q)
    check_cu_seqlens(name, kind, "cu_seqlens_k", cu_seqlens_k, q, k.shape[0], max_seqlen_k)
    check_same_n_seqs(name, cu_seqlens_q.shape[0], cu_seqlens_k.shape[0])
    left, right = check_options(name, causal, softmax_scale, window, softcap, cached)
    check_alibi(name, kind, alibi_slopes, q, q.shape[1], cu_seqlens_q.shape[0] - 1)
    check_sinks(name, kind, sinks, q, q.shape[1])
    return left, right, resolve_scale(q.shape[-1], softmax_scale)


def check_head_dim(name: str, head_dim: int, head_dims: tuple[int, ...]) -> None:
    if head_dim not in head_dims:
        described = str(head_dims)
        if head_dims == tuple(range(8, head_dims[-1] + 1, 8)):
            described = f"multiples of 8 up to {head_dims[-1]}"
        raise ValueError(f"{name}: head_dim {head_dim} is not supported; supported: {described}")


def check_alibi_shape(name: str, shape: tuple[int, ...], heads: int, n_seqs: int) -> None:
    """alibi_slopes: one slope per query head, shared by the sequences or one row each."""
    if shape not in ((heads,), (n_seqs, heads)):
        raise ValueError(
            f"{name}: alibi_slopes must have shape ({heads},) or ({n_seqs}, {heads}), got {shape}"
        )


def check_cu_values(name: str, what: str, values: list[int], tokens: int, max_seqlen: int) -> None:
    """The values of cu_seqlens_q / cu_seqlens_k (n_seqs + 1 offsets into `tokens` rows): a
    wrong one would read or write out of bounds."""
    if values[0] != 0 or values[-1] != tokens:
        raise ValueError(f"{name}: {what} must start at 0 and end at the token count {tokens}, got "
                         f"{values[0]} ... {values[-1]}")  # fmt: skip
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name}: {what} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"{name}: max_seqlen {max_seqlen} is below the longest sequence ({max(lengths)}) in {what}"
        )


def check_same_n_seqs(name: str, cu_q_len: int, cu_k_len: int) -> None:
    if cu_q_len != cu_k_len:
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, "
                         f"got {cu_q_len - 1} and {cu_k_len - 1}")  # fmt: skip


def resolve_scale(head_dim: int, softmax_scale: float | None) -> float:
    """The softmax scale of a call: 1 / sqrt(head_dim) unless given."""
    return head_dim**-0.5 if softmax_scale is None else float(softmax_scale)


PHILOX_ROUNDS = 7  # of dropout's Philox-4x32 (reference.py), as FlashAttention 2's


def dropout_threshold(dropout_p: float) -> int:
    """The unsigned 32-bit Philox word below which dropout drops a probability (reference.py)."""
    return min(round(dropout_p * 2**32), 2**32 - 1)


def check_dropout(name: str, dropout_p: object) -> float:
    """dropout_p: a float in [0, 1) (0: off); returned as a float."""
    if (
        not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool) or not 0 <= dropout_p < 1
    ):  # NaN fails both comparisons
        raise ValueError(f"{name}: dropout_p must be a float in [0, 1) (0: off), got {dropout_p!r}")
    return float(dropout_p)


def _finite(x) -> bool:
    """math.isfinite that dynamo can trace when it turns a float argument into a symbolic
    one (math.isinf/isfinite on it is unsupported): x - x is NaN for +-inf and NaN."""
    return x - x == 0


def check_options(name: str, causal: object, softmax_scale: object, window: object, softcap: object,
                  cached: bool = True) -> tuple[int, int]:  # fmt: skip
    """(window_left, window_right) of an attention call after checking its scalar options, for
    both front ends; with `cached`, plain Python values are checked once per combination."""
    if (
        cached
        and type(causal) is bool
        and type(window) is tuple
        and len(window) == 2
        and type(window[0]) is int
        and type(window[1]) is int
        and type(softcap) in (float, int)
        and (softmax_scale is None or type(softmax_scale) in (float, int))
    ):  # exact types: True == 1 must not hit an entry cached for 1
        return _checked_options(name, causal, softmax_scale, window, softcap)
    return _check_options_now(name, causal, softmax_scale, window, softcap)


@functools.lru_cache(maxsize=1024)
def _checked_options(name, causal, softmax_scale, window, softcap) -> tuple[int, int]:
    return _check_options_now(name, causal, softmax_scale, window, softcap)


def _check_options_now(name, causal, softmax_scale, window, softcap) -> tuple[int, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    if softmax_scale is not None and (
        not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, bool)
        or not _finite(softmax_scale) or softmax_scale <= 0
    ):  # fmt: skip
        raise ValueError(
            f"{name}: softmax_scale must be a positive finite float or None, got {softmax_scale!r}"
        )
    if (
        not isinstance(window, (tuple, list)) or len(window) != 2
        or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)
    ):  # fmt: skip
        raise ValueError(f"{name}: window must be a pair of ints >= -1 (-1: unbounded side), got {window!r}")
    if (
        not isinstance(softcap, numbers.Real)
        or isinstance(softcap, bool)
        or not softcap >= 0
        or not _finite(softcap)
    ):
        raise ValueError(f"{name}: softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    left, right = int(window[0]), int(window[1])
    return left, 0 if causal else right
