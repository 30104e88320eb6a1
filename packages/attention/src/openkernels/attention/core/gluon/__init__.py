"""Gluon launchers of the attention family: the Hopper (sm_90) forward of kernels.py and the
backward of kernels_bwd.py.

Registered as implementation "gluon" of `attention` and `attention_backward`. The backward is
the default for plain calls on sm_90 (priority 25, above Triton's: behind cuDNN's forward,
forward+backward 1.01-1.11x the Triton backward's on the H200); the forward, 0.60-0.80x
cuDNN's, runs only when forced (`dispatch.force("attention:gluon")`; docs/perf.md). They take
plain calls (ops._plain: dense, causal or full, no window, ALiBi, softcap, dropout or sinks,
head_dim 64 or 128, float16 / bfloat16, at least cudnn.MIN_SEQLEN queries). Each direction
takes the other implementations' out and lse (natural-log, float32), so either may be
forced alone.
"""

from __future__ import annotations

import functools
import math

import torch

from openkernels.shared import dispatch
from openkernels.shared.launch import launch as direct_launch
from openkernels.shared.platform import gluon_hopper_available

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "supports",
    "launch",
    "launch_bwd",
    "HEAD_DIMS",
    "ROWS",
    "ARCHS",
    "PINGPONG",
    "config",
    "bwd_config",
]

HEAD_DIMS = (64, 128)
ARCHS = ("sm_90",)
ROWS = 64  # query rows per consumer warpgroup; a program takes 2 x ROWS
# Registers per thread: 12 warps (two consumer warpgroups and the producer's warpgroup)
# at maxnreg 168 fill the 64K register file; the producer gives back all but 24 of its.
MAX_REGS, CONSUMER_REGS = 168, 240
# The consumers' schedule (kernels._consumer): each issuing the next block's S before its
# own softmax (False), or the two taking turns at the tensor cores (True, FlashAttention-3's
# ping-pong). Neither is measured yet; the study sweeps both.
PINGPONG = False
MAX_GRID_Y = 65535  # batch * heads: programs of one query block column


def config(head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, STAGES): 128-key blocks; two K/V stages at D128 (160 KiB of shared memory
    with Q), three at D64 (112 KiB)."""
    return (128, 2) if head_dim == 128 else (128, 3)


def bwd_config(head_dim: int) -> tuple[int, int, int, int]:
    """(dkdv query rows, dkdv stages, dq key block, dq stages). The dK/dV kernel holds dK and
    dV (64 keys x D, float32) per warpgroup: at D128 its S^T / dP^T tiles take 32 queries (64
    spilled 112-152 B per thread, ptxas sm_90a), three stages; the dQ kernel 128-key blocks,
    two stages at D128 (192 KiB of shared memory), three at D64."""
    return (32, 3, 128, 2) if head_dim == 128 else (64, 3, 128, 3)


def supports(key: dispatch.DispatchKey) -> str | None:
    """Dispatch predicate (forward and backward): None when the Gluon kernels run `key`, else why not."""
    if key.backend != "cuda":
        return "the Gluon attention kernels run on NVIDIA GPUs"
    if key.arch not in ARCHS:
        return f"{key.arch}: the Gluon kernels are written for Hopper ({', '.join(ARCHS)}: wgmma, TMA)"
    if "plain" not in key.features:
        return "not a plain call (dense, causal or full, no window, ALiBi, softcap or dropout, head_dim 64 or 128)"
    if not gluon_hopper_available():
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


def _heads_packed(t: torch.Tensor) -> torch.Tensor:
    """t (B, S, H, D) with each token's heads contiguous (what a TMA row needs)."""
    d = t.shape[-1]
    if (
        t.stride(-1) == 1
        and t.stride(-2) == d
        and t.data_ptr() % 16 == 0
        and all(s * t.element_size() % 16 == 0 for s in t.stride()[:2])
    ):
        return t
    return t.contiguous()


def _packs_heads(t: torch.Tensor) -> bool:
    """Each token's heads contiguous: the kernels store rows at head stride D, element stride 1."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def _output(t: torch.Tensor) -> torch.Tensor:
    """t itself when the kernels can write it, else a fresh packed tensor to copy into t after
    (not empty_like: that keeps an SDPA-layout tensor's strides)."""
    return t if _packs_heads(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _check_layouts(outputs: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> None:
    """What the kernels assume of tensors they index themselves: outputs with packed heads,
    per-row float32 tensors (lse, delta) with unit stride along the sequence."""
    for name, t in outputs.items():
        if not _packs_heads(t):
            raise ValueError(
                f"{name}: each token's heads must be contiguous (strides (..., D, 1)), got {t.stride()}"
            )
    for name, t in rows.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected unit stride along the sequence, got {t.stride()}")


def attn_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale, window_left,
             window_right, alibi_slopes, softcap, dropout_p=0.0, dropout_seed=None) -> None:  # fmt: skip
    """reference.attn_fwd for a plain call (see `supports`)."""
    if q.shape[0] * q.shape[2] > MAX_GRID_Y:  # the grid's second axis: the Triton kernel takes these
        from ..triton import attn_fwd as triton_fwd

        triton_fwd(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                   scale=scale, window_left=window_left, window_right=window_right, alibi_slopes=alibi_slopes,
                   softcap=softcap)  # fmt: skip
        return
    causal = window_right == 0
    target = _output(out)
    launch(_heads_packed(q), _heads_packed(k), _heads_packed(v), target, lse, scale=scale, causal=causal)
    if target is not out:
        out.copy_(target)


@functools.cache
def _shared_layout(rows: int, d: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a (1, rows, d) TMA block (built once: 6 us each)."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(
        [1, rows, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def _desc(t: torch.Tensor, rows: int):
    """Rank-3 TMA descriptor (batch, token, heads * D) of a (B, S, H, D) tensor whose tokens'
    heads are contiguous, blocks of `rows` tokens of one head: a block past a sequence's end
    reads zeros, never the next sequence."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    d = t.shape[-1]
    return TensorDescriptor(
        t, [t.shape[0], t.shape[1], t.shape[2] * d], [t.stride(0), t.stride(1), 1], [1, rows, d],
        _shared_layout(rows, d, t.dtype),
    )  # fmt: skip


def launch(q, k, v, out, lse, *, scale: float, causal: bool, block_n: int | None = None,
           stages: int | None = None, pingpong: bool | None = None) -> None:  # fmt: skip
    """out (B, Sq, Hq, D), lse (B, Hq, Sq) float32 = attention of q (B, Sq, Hq, D) over k, v
    (B, Sk, Hkv, D), each token's heads contiguous (stride(2) == D); causal is bottom-right
    aligned. block_n / stages override `config`, pingpong the schedule (benchmarks)."""
    from .kernels import attn_fwd_kernel

    batch, seqlen_q, heads, d = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    bn, st = config(d)
    bn, st = block_n or bn, stages or st
    pingpong = PINGPONG if pingpong is None else pingpong
    _check_layouts({"out": out}, {"lse": lse})
    if st < 2:
        raise ValueError(
            f"stages must be at least 2 (a consumer holds one slot while the next fills), got {st}"
        )

    grid = (-(-seqlen_q // (2 * ROWS)), batch * heads)
    direct_launch(
        attn_fwd_kernel, grid, _desc(q, ROWS), _desc(k, bn), _desc(v, bn), out, lse,
        seqlen_q, seqlen_k, heads, heads // heads_kv, out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        scale * math.log2(math.e),
        CAUSAL=causal, BLOCK_N=bn, HEAD_DIM=d, STAGES=st, PINGPONG=pingpong, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip


def attn_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, scale,
             window_left, window_right, alibi_slopes, softcap, dropout_p=0.0, dropout_seed=None) -> None:  # fmt: skip
    """reference.attn_bwd for a plain call (see `supports`), from any forward's out and lse."""
    if q.shape[0] * q.shape[2] > MAX_GRID_Y:
        from ..triton import attn_bwd as triton_bwd

        triton_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, scale=scale, window_left=window_left, window_right=window_right,
                   alibi_slopes=alibi_slopes, softcap=softcap)  # fmt: skip
        return
    from .. import triton as triton_launchers

    # delta = rowsum(dO * O) per query row, float32, laid out as lse: the Triton backward's first kernel
    problem = triton_launchers._problem(q, k, None, max_seqlen_q, max_seqlen_k, scale, window_left, window_right,
                                        None, 0.0, 0.0)  # fmt: skip
    delta = triton_launchers.bwd_delta(out, dout, lse, None, problem)
    if _packs_heads(dk) and _packs_heads(dv) and dk.stride() == dv.stride():
        targets = [_output(dq), dk, dv]
    else:  # the dK/dV kernel writes dv with dk's strides: both fresh, packed alike
        targets = [_output(dq), *(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (dk, dv))]
    launch_bwd(_heads_packed(dout), _heads_packed(q), _heads_packed(k), _heads_packed(v), lse, delta, *targets,
               scale=scale, causal=window_right == 0)  # fmt: skip
    for target, grad in zip(targets, (dq, dk, dv)):
        if target is not grad:
            grad.copy_(target)


def launch_bwd(dout, q, k, v, lse, delta, dq, dk, dv, *, scale: float, causal: bool,
               config: tuple[int, int, int, int] | None = None) -> None:  # fmt: skip
    """dq (B, Sq, Hq, D), dk, dv (B, Sk, Hkv, D) with each token's heads contiguous (dk and dv
    alike), from dout, q, k, v laid out the same, lse and delta (B, Hq, Sq) float32 with unit
    stride along the sequence. `config` overrides bwd_config (the study's sweep)."""
    from .kernels_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel

    batch, seqlen_q, heads, d = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads // heads_kv
    q_rows, kv_stages, block_n, q_stages = config or bwd_config(d)
    _check_layouts({"dq": dq, "dk": dk, "dv": dv}, {"lse": lse, "delta": delta})
    if dv.stride() != dk.stride():
        raise ValueError(f"dv: the kernel writes it with dk's strides {dk.stride()}, got {dv.stride()}")
    qk_scale = scale * math.log2(math.e)
    common = dict(CAUSAL=causal, D=d, CONSUMER_REGS=CONSUMER_REGS, num_warps=4, maxnreg=MAX_REGS)
    direct_launch(
        attn_bwd_dkdv_kernel, (-(-seqlen_k // (2 * ROWS)), batch * heads_kv),
        _desc(k, ROWS), _desc(v, ROWS), _desc(q, q_rows), _desc(dout, q_rows), dk, dv, lse, delta,
        seqlen_q, seqlen_k, heads_kv, group, dk.stride(0), dk.stride(1), lse.stride(0), lse.stride(1),
        qk_scale, scale, STAGES=kv_stages, **common,
    )  # fmt: skip
    direct_launch(
        attn_bwd_dq_kernel, (-(-seqlen_q // (2 * ROWS)), batch * heads),
        _desc(q, ROWS), _desc(dout, ROWS), _desc(k, block_n), _desc(v, block_n), dq, lse, delta,
        seqlen_q, seqlen_k, heads, group, dq.stride(0), dq.stride(1), lse.stride(0), lse.stride(1),
        qk_scale, scale, BLOCK_N=block_n, STAGES=q_stages, **common,
    )  # fmt: skip
