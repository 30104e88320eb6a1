"""The Gluon Hopper int4_linear kernel (openkernels.quant.gluon, dispatch name "wgmma").

On the CPU: the dispatch predicate, the launcher's per-call refusals (calls that go to the
Triton launcher), `explain`, the configs' shared memory, and a float64 transliteration of the
kernel's tiling (programs, the stage ring with its one-outstanding-wgmma reuse rule, the
mantissa-trick dequantization rounded to x's dtype, the transposed masked store) against the
reference within the error contract. On an sm_90 GPU, forced: against the reference within
reference.linear_error_bound (W rounded to x's dtype: the kernel scales before the product)
for odd N, M = 16-2053, groups 64 / 128 / one per row, symmetric and with zeros, a bias,
fp16 / bf16, strided x, NaN; and against the Triton path. Its compile checks (sm_90a, every
config; the PTX's asynchronous wgmma) are in test_aot.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import openkernels.quant as Q
from openkernels.quant import gluon
from openkernels.quant import reference as R
from openkernels.shared import dispatch
from openkernels.shared.dispatch import DispatchKey

from .cases import SM90, assert_linear_close, make_weight


@pytest.fixture(autouse=True)
def _fresh_selections():
    yield
    dispatch.changed()


def test_the_predicate_and_explain() -> None:
    key = DispatchKey
    int4 = frozenset({"int4"})
    assert "Hopper" in gluon.supports(key("cuda", "sm_80", torch.bfloat16, int4))
    assert "Hopper" in gluon.supports(key("cuda", "sm_100", torch.bfloat16, int4))
    assert "NVIDIA" in gluon.supports(key("rocm", "gfx942", torch.bfloat16, int4))
    assert "NVIDIA" in gluon.supports(key("cpu", "avx2", torch.bfloat16, int4))
    assert "float32" in gluon.supports(key("cuda", "sm_90", torch.float32, int4))
    if gluon.gluon_hopper_available():
        assert gluon.supports(key("cuda", "sm_90", torch.float16, int4)) is None
        # NF4 is a per-call refusal (the Triton launcher runs it), so forcing "wgmma" never fails on sm_90.
        assert gluon.supports(key("cuda", "sm_90", torch.bfloat16, frozenset({"nf4"}))) is None
    w = Q.quantize_int4(make_weight(8, 64), 64)
    x = torch.randn(4, 64)
    text = dispatch.explain(
        "int4_linear", x, w.qweight, w.scales, w.zeros, None, torch.empty(4, 8), 64, "int4"
    )
    assert "wgmma: runs on cuda, not cpu [priority 25]" in text  # above Triton (20): routed by speed


def test_routing_by_measured_speed() -> None:
    """Unforced calls go to Triton where it measured faster (H200, H100); forced calls and explicit
    configs never do (the plan's `routed`)."""
    assert (
        gluon.slower_than_triton(16, 28672, 8192) is None and gluon.slower_than_triton(64, 8192, 8192) is None
    )
    assert (
        gluon.slower_than_triton(16, 14336, 4096) is None and gluon.slower_than_triton(96, 4096, 4096) is None
    )
    assert "M = 16" in gluon.slower_than_triton(16, 8192, 8192)  # the tensor-core GEMV
    assert "M = 16" in gluon.slower_than_triton(16, 4096, 14336)
    assert "M = 32" in gluon.slower_than_triton(32, 2048, 2048)  # 0.68x against 0.64x
    # From M = 32 at 4096 x 4096 and up, from M = 64 at 2048 x 2048 (K split, quant 0.10.9).
    for m, n, k in (
        (32, 2048, 8192),
        (32, 4096, 4096),
        (64, 4096, 14336),
        (64, 2048, 2048),
        (96, 8192, 2048),
    ):
        assert gluon.slower_than_triton(m, n, k) is None, (m, n, k)
    assert "not measured" in gluon.slower_than_triton(128, 1024, 4096)
    assert "not measured" in gluon.slower_than_triton(256, 8192, 1024)
    assert (
        gluon.slower_than_triton(256, 2048, 8192) is None
        and gluon.slower_than_triton(4096, 2048, 2048) is None
    )
    # NF4 (the "levels" lookup, quant 0.10.15): from 17 rows (the tensor-core GEMV takes 1-16) up
    # to 1024 (dequantize + cuBLAS faster at 2048) from 4096 x 4096 up; int4's limits below.
    for m, n, k in (
        (17, 8192, 8192),
        (24, 4096, 4096),
        (64, 2048, 8192),
        (64, 14336, 4096),
        (1024, 4096, 4096),
    ):
        assert gluon._routed(m, n, k, "nf4") is None, (m, n, k)
    assert "M = 16" in gluon._routed(16, 28672, 8192, "nf4")
    assert "M = 2048" in gluon._routed(2048, 8192, 8192, "nf4")
    assert gluon._routed(24, 2048, 4096, "nf4") == gluon.slower_than_triton(24, 2048, 4096) is not None
    assert gluon._routed(128, 1024, 4096, "nf4") is not None  # and int4's limits
    assert gluon._plan(*_call(kind="nf4", zeros=False), None).flags["NF4_TABLE"] == 2  # "levels"
    call = _call(m=64, n=96, k=256)
    assert gluon._plan(*call, None).routed is not None
    assert gluon._plan(*call, gluon.WgmmaConfig(64, 64, 128, 3)).routed is None
    assert dispatch.forced_names("int4_linear") == frozenset()
    with dispatch.force("int4_linear:wgmma"):
        assert "wgmma" in dispatch.forced_names("int4_linear")


def _call(
    m=64, n=96, k=256, group=128, *, dtype=torch.bfloat16, scales=None, zeros=True, kind="int4", bias=None
):
    x = torch.randn(m, k).to(dtype)
    qweight = torch.zeros(n, k // 2, dtype=torch.uint8)
    s = torch.ones(max(1, k // group), n, dtype=scales or dtype)
    z = torch.full_like(s, 8.0) if zeros else None
    return [x, qweight, s, z, bias, torch.empty(m, n, dtype=dtype), group, kind]


def test_refusals_go_to_triton() -> None:
    assert gluon.unsupported_call(*_call()) is None
    assert gluon.unsupported_call(*_call(m=16)) is None and gluon.unsupported_call(*_call(m=256)) is None
    assert "rows of x" in gluon.unsupported_call(*_call(m=15))
    assert gluon.unsupported_call(*_call(m=257)) is None  # large M: no upper limit since quant 0.10.8
    # NF4 runs here (quant 0.10.8), routed by its own measurements.
    nf4_call = _call(kind="nf4", zeros=False)
    assert gluon.unsupported_call(*nf4_call) is None
    assert "not measured" in gluon._plan(*nf4_call, None).routed
    assert gluon._plan(*nf4_call, None).flags["NF4"] and not gluon._plan(*_call(), None).flags["NF4"]
    assert "bfloat16 / float16" in gluon.unsupported_call(*_call(dtype=torch.float32))
    call = _call()
    call[3] = call[3].half()  # zeros in another dtype than the scales
    assert "zeros" in gluon.unsupported_call(*call)
    assert gluon.unsupported_call(*_call(scales=torch.float16)) is None  # scales in another 16-bit dtype
    assert "multiple of 64" in gluon.unsupported_call(*_call(k=224, group=32))
    assert "multiple of 64" in gluon.unsupported_call(*_call(k=256, group=32))
    assert gluon.unsupported_call(*_call(k=192, group=192)) is None  # one group per row
    call = _call(k=264, group=264)
    assert "multiple of 64" in gluon.unsupported_call(*call)
    call = _call()
    call[0] = torch.randn(64, 512).to(torch.bfloat16)[:, ::2]  # column stride 2: no TMA
    assert "16-byte aligned" in gluon.unsupported_call(*call)
    call = _call()
    call[0] = torch.randn(64, 260).to(torch.bfloat16)[:, :256]  # rows of 520 bytes
    assert "16-byte aligned" in gluon.unsupported_call(*call)
    call = _call()
    call[1] = torch.zeros(96, 136, dtype=torch.uint8)[:, :128]  # code rows of 136 bytes
    assert "16-byte aligned" in gluon.unsupported_call(*call)
    call = _call()
    call[5] = torch.empty(96, 64, dtype=torch.bfloat16).t()
    assert "column stride" in gluon.unsupported_call(*call)
    forced = gluon.WgmmaConfig(64, 64, 128, 4)
    assert "block_k 128" in gluon.unsupported_call(*_call(k=192, group=64), forced)
    split_persistent = gluon.WgmmaConfig(128, 128, 128, 4, 2, 2, persistent=True)
    assert "persistent" in gluon.unsupported_call(*_call(), split_persistent)


def test_graph_scratch_covers_every_split() -> None:
    """kernelize's reserved split-K scratch (triton.reserve_graph_scratch) holds the partials of
    every split config_for picks, so captured and compiled calls do not zero temporaries."""
    from openkernels.quant import triton as qt

    worst = 0
    for m in (16, 64, 65, 128):
        for n in range(64, 40000, 64):
            cfg = gluon.config_for(m, n, 8192, 128)
            if cfg.split_k > 1:
                worst = max(worst, gluon._Plan(cfg, m, n, 8192, 128, torch.bfloat16, torch.bfloat16, True, False,
                                               n, n).partials)  # fmt: skip
    assert 0 < worst <= qt.GRAPH_SCRATCH_PARTIALS


def test_launch_plans_decide_all_but_the_addresses() -> None:
    """A call's plan (cached per shape, dtype and stride) holds the grid, integer arguments and
    flags, or the reason its calls go to Triton; base addresses are checked per call."""
    call = _call(m=64, n=200, k=512, group=128)
    plan = gluon._plan(*call, None)
    cfg = gluon.config_for(64, 200, 512, 128)
    assert plan.grid == (-(-200 // cfg.block_n),) and plan.ints == (64, 200, 512, call[2].stride(0), 200, 4)
    assert plan.flags == dict(GROUP=128, STAGES=cfg.stages, HAS_ZEROS=True, HAS_BIAS=False, SCALE_16=True,
                              SCALES_AHEAD=cfg.scales_ahead, SPLIT_K=cfg.split_k, NF4=False, PERSISTENT=False)  # fmt: skip
    assert plan.num_warps == cfg.num_warps and plan.x_block == (cfg.block_m, cfg.block_k)
    assert plan.w_block == (cfg.block_n, cfg.block_k // 2)
    refused = _call(m=8)
    assert gluon._plan(*refused, None) == gluon.unsupported_call(*refused)
    shifted = _call()
    shifted[0] = torch.randn(64 * 256 + 4).to(torch.bfloat16)[4:].view(64, 256)  # base 8 bytes off
    assert isinstance(gluon._plan(*shifted, None), gluon._Plan)
    assert "base of x" in gluon.unsupported_call(*shifted)


def test_configs() -> None:
    cfg = gluon.WgmmaConfig
    assert gluon.config_for(16, 8192, 8192, 128) == cfg(16, 64, 128, 3, 2, 2)  # 128 tiles: K split in 2
    assert gluon.config_for(128, 8192, 8192, 128) == cfg(128, 64, 128, 3, 2, 2)
    assert gluon.config_for(256, 8192, 8192, 128) == cfg(128, 128, 128, 4, 2)
    # The largest tile that still fills a wave (gluon.TILES_FOR_A_WAVE programs).
    assert gluon.config_for(2048, 8192, 8192, 128) == cfg(256, 128, 64, 4, 1)
    assert gluon.config_for(256, 14336, 4096, 128) == cfg(256, 128, 64, 4, 1)
    assert gluon.config_for(512, 4096, 14336, 128) == cfg(128, 128, 128, 4, 2)
    assert gluon.config_for(256, 4096, 4096, 128) == cfg(128, 64, 128, 3, 2)  # 128 tiles: not split
    assert gluon.config_for(512, 2048, 8192, 128) == cfg(128, 64, 128, 3, 2)
    assert gluon.config_for(128, 28672, 8192, 128) == cfg(128, 64, 128, 3, 2)  # 448 tiles: no split
    # No tile fills a wave: the 128 x 64 tile with K split (64 tiles, 64 steps).
    assert gluon.config_for(256, 2048, 8192, 128) == cfg(128, 64, 128, 3, 2, 4)
    assert gluon.config_for(256, 2048, 2048, 128) == cfg(128, 64, 128, 3, 2)  # 16 steps: not split
    # Scales two steps ahead where every step starts a group; one group per row: one ahead.
    assert gluon.config_for(4096, 8192, 8192, 64) == cfg(256, 128, 64, 4, 2)
    assert gluon.config_for(128, 8192, 4096, 4096).scales_ahead == 1
    # K split where the tiles leave less than two programs per SM, each split >= 16 steps.
    assert gluon.config_for(128, 2048, 8192, 128).split_k == 4  # 32 tiles, 64 steps
    assert gluon.config_for(128, 4096, 4096, 128).split_k == 2  # 64 tiles, 32 steps
    assert gluon.config_for(64, 8192, 8192, 128).split_k == 2
    assert gluon.config_for(16, 28672, 8192, 128).split_k == 1  # 448 tiles
    assert gluon.config_for(128, 4096, 1024, 128).split_k == 1  # 8 steps
    assert gluon.config_for(192, 12288, 8192, 128) == cfg(128, 128, 128, 4, 2)  # past 128 rows: not split
    assert gluon.config_for(17, 8192, 8192, 128).block_m == 32
    assert gluon.config_for(200, 8192, 8192, 128).block_m == 128
    assert gluon.config_for(128, 8192, 8192, 64).block_k == 64
    assert gluon.config_for(128, 8192, 192, 192).block_k == 64
    assert gluon.config_for(128, 8192, 8192, 32) is None
    for m in (16, 64, 128, 256):
        for cfg in [*gluon.all_configs(), *gluon.sweep_configs(m)]:
            assert gluon.smem_bytes(cfg) <= gluon.SMEM_LIMIT, cfg
            assert cfg.block_n in (64, 128) and cfg.block_k in (64, 128) and cfg.stages >= 2


# ---- a float64 transliteration of the kernel ------------------------------------------------


def _tma(t: torch.Tensor, r0: int, c0: int, rows: int, cols: int) -> torch.Tensor:
    """A TMA box: t[r0:r0+rows, c0:c0+cols], zeros past the tensor's edges."""
    box = torch.zeros(rows, cols, dtype=t.dtype)
    part = t[r0 : r0 + rows, c0 : c0 + cols]
    box[: part.shape[0], : part.shape[1]] = part
    return box


def _dequantize(packed, scale, zero, dtype, scale_16: bool) -> torch.Tensor:
    """kernels._dequantize: mantissa OR, one 16-bit subtraction, the product with the scale
    rounded once to `dtype`; (rows, 2 * cols), column 2j from the low nibble of byte j."""
    magic, base = (0x4300, 128.0) if dtype == torch.bfloat16 else (0x6400, 1024.0)
    as16 = lambda nib: (nib.to(torch.int32) | magic).to(torch.int16).view(dtype)  # noqa: E731
    low, high = as16(packed & 0xF), as16(packed >> 4)
    offset = (zero + base).to(dtype)[:, None]
    low, high = low - offset, high - offset
    if scale_16:
        s16 = scale.to(dtype)[:, None]
        low, high = low * s16, high * s16
    else:
        low = (low.float() * scale[:, None]).to(dtype)
        high = (high.float() * scale[:, None]).to(dtype)
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def _prmt(a, b, select) -> torch.Tensor:
    """PTX prmt.b32 (default mode) on int64 tensors holding 32-bit values: output byte k is
    byte (select >> 4k) & 7 of {a's bytes 0-3, b's bytes 4-7}, or with the nibble's bit 3 set
    that byte's top bit copied into all 8 bits. `select` an int or a tensor (per element)."""
    a, b, select = torch.broadcast_tensors(*(torch.as_tensor(v, dtype=torch.int64) for v in (a, b, select)))
    src = torch.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = torch.zeros(src.shape[1:], dtype=torch.int64)
    for k in range(4):
        nibble = ((select >> (4 * k)) & 0xF).expand(src.shape[1:])
        byte = torch.gather(src, 0, (nibble & 7)[None])[0]
        byte = torch.where((nibble & 8) != 0, torch.where((byte & 0x80) != 0, 0xFF, 0), byte)
        out |= byte << (8 * k)
    return out


def _lop3_select(a, b, mask) -> torch.Tensor:
    """lop3.b32 with LUT 0xD8: mask ? b : a, bit by bit."""
    return (a & ~mask & 0xFFFFFFFF) | (b & mask)


def _nf4_pair_words(byte: torch.Tensor, dtype) -> torch.Tensor:
    """kernels._dequantize_nf4's lookup, instruction by instruction, for code bytes `byte` (the
    word's byte t already chosen): the 32-bit register (level[low nibble], level[high nibble])."""
    from openkernels.quant.gluon.kernels import nf4_table_words

    table = [w & 0xFFFFFFFF for w in nf4_table_words.fn("bf16" if dtype == torch.bfloat16 else "fp16")]
    word = byte.to(torch.int64)  # bytes 1-3 of the word do not reach the result: zero here
    x = _prmt(word, word, 0x00)  # byte 0 (t = 0: the selector's nibbles 0 and 1 both t)
    s = x & 0x7777
    y = (x << 4) & 0xFFFFFFFF
    m = _prmt(y, x, 0xD8D8)
    pl, ph = _prmt(table[0], table[1], s), _prmt(table[2], table[3], s)
    ql, qh = _prmt(table[4], table[5], s), _prmt(table[6], table[7], s)
    return _prmt(_lop3_select(pl, ph, m), _lop3_select(ql, qh, m), 0x5140)


def _dequantize_words(codes, scale, zero, dtype, scale_16: bool) -> torch.Tensor:
    """kernels._dequantize as the kernel computes it: the codes read as little-endian 32-bit
    words, thread t of a lane quad building its pair from byte t of each word with the inline
    PTX (shr, prmt, lop3), then the 16-bit subtraction and product (or float32 product)."""
    magic, base = (0x43004300, 128.0) if dtype == torch.bfloat16 else (0x64006400, 1024.0)
    rows, cols = codes.shape
    b = codes.to(torch.int64).reshape(rows, cols // 4, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # (rows, cols // 4)
    offset = (zero + base).to(dtype)[:, None]
    out = torch.empty(rows, cols // 4, 4, 2, dtype=dtype)
    for t in range(4):
        u = _prmt(words, words >> 4, t | ((t + 4) << 8))
        u = (u & 0x000F000F) | magic  # lop3 0xEA: (a & b) | c
        low = (u & 0xFFFF).to(torch.int32).to(torch.int16).view(dtype)
        high = (u >> 16).to(torch.int32).to(torch.int16).view(dtype)
        if scale_16:
            s16 = scale.to(dtype)[:, None]
            low, high = (low - offset) * s16, (high - offset) * s16
        else:
            low = ((low - offset).float() * scale[:, None]).to(dtype)
            high = ((high - offset).float() * scale[:, None]).to(dtype)
        out[:, :, t, 0], out[:, :, t, 1] = low, high
    return out.reshape(rows, 2 * cols)  # column 8a + 2t + e


def _dequantize_words_nf4(codes, scale, dtype, scale_16: bool) -> torch.Tensor:
    """kernels._dequantize_nf4 as the kernel computes it: byte t of each word (thread t of a
    lane quad) looked up by _nf4_pair_words, then the product with the scale (16-bit, or float32
    rounded once)."""
    rows, cols = codes.shape
    b = codes.to(torch.int64).reshape(rows, cols // 4, 4)
    out = torch.empty(rows, cols // 4, 4, 2, dtype=dtype)
    for t in range(4):
        u = _nf4_pair_words(b[..., t], dtype)
        low = (u & 0xFFFF).to(torch.int32).to(torch.int16).view(dtype)
        high = (u >> 16).to(torch.int32).to(torch.int16).view(dtype)
        if scale_16:
            s16 = scale.to(dtype)[:, None]
            low, high = low * s16, high * s16
        else:
            low, high = (low.float() * scale[:, None]).to(dtype), (high.float() * scale[:, None]).to(dtype)
        out[:, :, t, 0], out[:, :, t, 1] = low, high
    return out.reshape(rows, 2 * cols)  # column 8a + 2t + e


def _emulate(
    x, qweight, scales, zeros, bias, out, group: int, cfg: gluon.WgmmaConfig, kind: str = "int4"
) -> None:
    """int4_linear_wgmma_kernel, program by program (the grid's order: the M tiles of a weight
    tile and split consecutive), in float64 products of the 16-bit operands; a split's partial
    rounded to float32 (its workspace), the partials added in split order after the bias."""
    from openkernels.quant.triton.configs import kernel_group

    m, k = x.shape
    n = qweight.shape[0]
    g_size = kernel_group(group, k)
    assert k % cfg.block_k == 0 and g_size % cfg.block_k == 0
    tiles_m = -(-m // cfg.block_m)
    steps = k // cfg.block_k
    per_split = -(-steps // cfg.split_k)
    partials: dict[tuple[int, int], list] = {}
    for pid in range(-(-n // cfg.block_n) * cfg.split_k * tiles_m):
        tile_m, split, tile_n = pid % tiles_m, (pid // tiles_m) % cfg.split_k, pid // (tiles_m * cfg.split_k)
        k0 = split * per_split
        acc = _program(x, qweight, scales, zeros, g_size, cfg, tile_n * cfg.block_n, tile_m * cfg.block_m, k0,
                       min(per_split, steps - k0), kind)  # fmt: skip
        partials.setdefault((tile_n, tile_m), []).append(
            (split, acc if cfg.split_k == 1 else acc.float().double())
        )
    for (tile_n, tile_m), parts in partials.items():
        assert sorted(s for s, _ in parts) == list(range(cfg.split_k))
        off_n, off_m = tile_n * cfg.block_n, tile_m * cfg.block_m
        rows = torch.arange(off_n, off_n + cfg.block_n)
        in_n = rows < n
        acc = torch.zeros(cfg.block_n, cfg.block_m, dtype=torch.float64)
        if bias is not None:
            acc += torch.where(in_n, bias.double()[rows.clamp(max=n - 1)], 0.0)[:, None]
        for _, part in sorted(parts, key=lambda p: p[0]):
            acc += part
        cols = torch.arange(off_m, off_m + cfg.block_m)
        keep_m = cols < m
        tile = acc.to(out.dtype)[in_n][:, keep_m]  # acc[n, m] -> y[m, n]
        out[off_m : off_m + int(keep_m.sum()), off_n : off_n + int(in_n.sum())] = tile.t()


def _program(
    x, qweight, scales, zeros, g_size: int, cfg, off_n: int, off_m: int, k0: int, n_k: int, kind: str = "int4"
) -> torch.Tensor:
    """One program's accumulator (float64, no bias) over K steps k0 .. k0 + n_k - 1. The ring: a
    stage is refilled only once the wgmma that read it has retired (one wgmma outstanding after
    each step's wait), and each step reads its own step's tiles."""
    n = qweight.shape[0]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    ring: list[tuple[int, torch.Tensor, torch.Tensor] | None] = [None] * stages
    retired = [-1]  # the last step whose wgmma has completed

    def issue(step: int) -> None:
        slot = step % stages
        held = ring[slot]
        assert held is None or held[0] <= retired[0], f"stage {slot} refilled while wgmma {held[0]} reads it"
        ring[slot] = (
            step,
            _tma(x, off_m, (k0 + step) * bk, bm, bk),
            _tma(qweight, off_n, (k0 + step) * bk // 2, bn, bk // 2),
        )

    rows = torch.arange(off_n, off_n + bn)
    in_n = rows < n

    def params(g: int):
        scale = torch.zeros(bn)
        scale[in_n] = scales[g, rows[in_n]].float()
        zero = torch.full((bn,), 8.0)
        if zeros is not None:
            zero = torch.zeros(bn)
            zero[in_n] = zeros[g, rows[in_n]].float()
        return scale, zero

    for j in range(min(stages - 1, n_k)):
        issue(j)
    acc = torch.zeros(bn, bm, dtype=torch.float64)
    for i in range(n_k):
        step, x_tile, codes = ring[i % stages]
        assert step == i, f"step {i} read stage {i % stages} holding step {step}"
        scale, zero = params(((k0 + i) * bk) // g_size)  # loaded ahead in the kernel: the same group
        if kind == "nf4":
            w = _dequantize_words_nf4(codes, scale, x.dtype, scales.dtype == x.dtype)
        else:
            w = _dequantize_words(codes, scale, zero, x.dtype, scales.dtype == x.dtype)
        acc += w.double() @ x_tile.double().t()  # wgmma i (exact products, float32 sums ~ float64)
        retired[0] = i - 1  # warpgroup_mma_wait(1): wgmma i - 1 retired
        if i + stages - 1 < n_k:
            issue(i + stages - 1)
    return acc


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "symmetric", "dtype", "scale_dtype", "bias", "stages"),
    [
        (17, 100, 512, 128, False, torch.bfloat16, torch.bfloat16, True, 4),
        (16, 64, 256, 64, True, torch.float16, torch.float16, False, 3),
        (130, 72, 384, 128, False, torch.float16, torch.bfloat16, True, 2),
        (64, 130, 128, 128, True, torch.bfloat16, torch.float16, False, 4),
        (200, 33, 640, 640, False, torch.bfloat16, torch.bfloat16, True, 3),
    ],
)
def test_transliteration_matches_the_reference(
    m, n, k, group, symmetric, dtype, scale_dtype, bias, stages
) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    weight = Q.quantize_int4(
        make_weight(n, k, heavy=True, generator=gen), group, symmetric, scale_dtype=scale_dtype
    )
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen) if bias else None
    cfg = gluon.config_for(m, n, k, group)
    from dataclasses import replace

    cfg = replace(cfg, stages=stages)
    assert gluon.unsupported_call(x, weight.qweight, weight.scales, weight.zeros, b, torch.empty(m, n, dtype=dtype),
                                  group, "int4", cfg) is None  # fmt: skip
    out = torch.full((m, n), float("nan"), dtype=dtype)
    _emulate(x, weight.qweight, weight.scales, weight.zeros, b, out, group, cfg)
    assert_linear_close(out, x, weight, b, w_rounded=True, msg=f"emulated {cfg}")


@pytest.mark.parametrize(
    ("cfg", "m", "n", "k", "group"),
    [
        # K split over programs: ragged shares (7 steps over 2 or 3 programs).
        (gluon.WgmmaConfig(32, 64, 64, 3, 2, 2), 20, 72, 7 * 64, 64),
        (gluon.WgmmaConfig(32, 64, 64, 3, 2, 3), 20, 72, 7 * 64, 64),
        # The large-M tile: 256-row bands of x on 128-row weight tiles, 64-column steps.
        (gluon.WgmmaConfig(256, 128, 64, 4), 300, 136, 256, 64),
    ],
    ids=str,
)
def test_transliteration_of_configs(cfg, m, n, k, group) -> None:
    """Configs config_for picks beyond the table above: a ragged last weight tile and x band,
    a bias."""
    gen = torch.Generator().manual_seed(m + cfg.split_k)
    weight = Q.quantize_int4(make_weight(n, k, heavy=True, generator=gen), group)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    out = torch.full((m, n), float("nan"), dtype=x.dtype)
    _emulate(x, weight.qweight, weight.scales, weight.zeros, b, out, group, cfg)
    assert_linear_close(out, x, weight, b, w_rounded=True, msg=f"emulated {cfg}")


@pytest.mark.parametrize(("dtype", "scale_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16)],
                         ids=str)  # fmt: skip
def test_transliteration_of_nf4(dtype, scale_dtype) -> None:
    """NF4 through the kernel's tiling with the register lookup: the level rounded to x's
    dtype, then its product with the scale rounded (two roundings, inside the contract's
    4-u random walk), against the float64 reference; a ragged weight tile, a bias, a split."""
    gen = torch.Generator().manual_seed(4)
    m, n, k, group = 40, 72, 512, 128
    weight = Q.quantize_nf4(make_weight(n, k, heavy=True, generator=gen), group, scale_dtype=scale_dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen)
    for cfg in (gluon.config_for(m, n, k, group), gluon.WgmmaConfig(64, 64, 128, 3, 2, 2)):
        out = torch.full((m, n), float("nan"), dtype=dtype)
        _emulate(x, weight.qweight, weight.scales, None, b, out, group, cfg, "nf4")
        assert_linear_close(out, x, weight, b, w_rounded=True, msg=f"emulated nf4 {cfg}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_nf4_register_lookup_gives_every_level(dtype) -> None:
    """The NF4 lookup's permutes and selects, emulated bit by bit, give for all 256 code bytes
    the pair (level[low nibble], level[high nibble]) rounded to x's dtype: a table word or a
    selector wrong in one nibble fails here."""
    import inspect

    from openkernels.quant.format import NF4_VALUES
    from openkernels.quant.gluon import kernels

    # The emulation's constants are the kernel's (its inline PTX, kernels._dequantize_nf4).
    source = inspect.getsource(kernels)
    for piece in ("and.b32 s, x, 0x7777", "shl.b32 y, x, 4", "prmt.b32 m, y, x, 0xD8D8", "lop3.b32 pl, pl, ph, m, 0xD8",
                  "lop3.b32 ql, ql, qh, m, 0xD8", "prmt.b32 u, pl, ql, 0x5140", "(t | (t << 4))"):  # fmt: skip
        assert piece in source, piece
    byte = torch.arange(256)
    pair = _nf4_pair_words(byte, dtype)
    levels = torch.tensor(NF4_VALUES).to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(pair & 0xFFFF, levels[byte & 0xF])
    assert torch.equal(pair >> 16, levels[byte >> 4])


def test_rounding_the_scaled_weight_fits_the_contract() -> None:
    """W = (q - z) s rounded to x's dtype (the kernel's A operand) equals the reference's
    float32 dequantization rounded once to x's dtype, bit for bit, for scales in x's dtype
    and in the other 16-bit dtype: the contract's weight term (weight_rounded_to) covers it."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        for scale_dtype in (torch.bfloat16, torch.float16):
            for symmetric in (False, True):
                weight = Q.quantize_int4(make_weight(64, 256, heavy=True, generator=gen), 64, symmetric,
                                         scale_dtype=scale_dtype)  # fmt: skip
                ref = R.dequantize_int4_ref(weight.qweight, weight.scales, weight.zeros, 64, dtype=dtype)
                for fn in (_dequantize, _dequantize_words):
                    parts = []
                    for g in range(4):
                        zero = torch.full((64,), 8.0) if symmetric else weight.zeros[g].float()
                        codes = weight.qweight[:, g * 32 : (g + 1) * 32]
                        parts.append(fn(codes, weight.scales[g].float(), zero, dtype, scale_dtype == dtype))
                    got = torch.cat(parts, 1).view(torch.int16)
                    assert torch.equal(got, ref.view(torch.int16)), (fn.__name__, dtype, scale_dtype)


# ---- on an sm_90 GPU ------------------------------------------------------------------------

_needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("m", [16, 17, 64, 128, 200, 256])
@pytest.mark.parametrize(("k", "group"), [(4096, 128), (2048, 64), (128, 128), (64, 64)], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "sym"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forced_calls_match_the_reference(m, k, group, symmetric, dtype) -> None:
    n = 1000 + 8 * (m % 3) + 4  # odd tile counts: the last weight tile is partly out of range
    gen = torch.Generator().manual_seed(m * 7 + k)
    weight = Q.quantize_int4(make_weight(n, k, heavy=True, generator=gen), group, symmetric).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda") if m % 2 == 0 else None
    with dispatch.force("int4_linear:wgmma"):
        assert "-> wgmma" in dispatch.explain("int4_linear", x, weight.qweight, weight.scales, weight.zeros, bias,
                                              torch.empty(m, n, dtype=dtype, device="cuda"), group, "int4")  # fmt: skip
        out = Q.int4_linear(x, weight, bias)
    assert (
        gluon.unsupported_call(x, weight.qweight, weight.scales, weight.zeros, bias, out, group, "int4")
        is None
    )
    assert_linear_close(out, x, weight, bias, w_rounded=True, msg=f"wgmma m={m} k={k} g={group}")
    triton_out = Q.int4_linear(x, weight, bias)  # the default (Triton) path, within the same bound
    assert_linear_close(triton_out, x, weight, bias, w_rounded=True, msg="triton")
    bound = _bound(x, weight, bias, out.dtype)
    assert ((out.double() - triton_out.double()).abs().cpu() <= 2 * bound).all()


def _bound(x, weight, bias, dtype) -> torch.Tensor:
    xd = x.double().cpu()
    w = Q.dequantize_int4(weight.to("cpu"), torch.float64)
    ref = xd @ w.t() + (0 if bias is None else bias.double().cpu())
    return R.linear_error_bound(xd, w, ref, dtype, weight_rounded_to=x.dtype)


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("m", [16, 100, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_forced_nf4_matches_the_reference(m, dtype) -> None:
    """NF4 through the register lookup (forced: unforced NF4 calls run the Triton path until
    timed), odd N, a bias, against the reference and the Triton path."""
    n, k = 1000 + 8 * (m % 3) + 4, 2048
    gen = torch.Generator().manual_seed(m)
    weight = Q.quantize_nf4(make_weight(n, k, heavy=True, generator=gen), 64).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda")
    with dispatch.force("int4_linear:wgmma"):
        out = Q.int4_linear(x, weight, bias)
    assert gluon.unsupported_call(x, weight.qweight, weight.scales, None, bias, out, 64, "nf4") is None
    assert_linear_close(out, x, weight, bias, w_rounded=True, msg=f"wgmma nf4 m={m}")
    assert_linear_close(Q.int4_linear(x, weight, bias), x, weight, bias, w_rounded=True, msg="triton nf4")


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize(
    ("lookup", "m", "dtype", "scale_dtype"),
    [(lookup, m, d, s) for lookup in gluon.NF4_LOOKUPS[1:] for m in (70, 300, 1024)
     for d, s in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float16, torch.float16))
     if m == 300 or d == torch.float16],
    ids=str,
)  # fmt: skip
def test_nf4_table_lookups_match_the_register_lookup(lookup, m, dtype, scale_dtype, monkeypatch) -> None:
    """NF4's levels read from a table in shared memory (gluon.NF4_LOOKUP "pairs" / "levels")
    give the register lookup's bits (the same level pair, the same one rounding of its product
    with the scale), on the config each M gets, odd N, a bias: bitwise equal, and within the
    contract."""
    n, k = 1000 + 8 * (m % 3) + 4, 2048
    gen = torch.Generator().manual_seed(m)
    w = make_weight(n, k, heavy=True, generator=gen)
    weight = Q.quantize_nf4(w, 128, scale_dtype=scale_dtype).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda")
    cfg = gluon.config_for(m, n, k, 128)
    outs = []
    for name in ("registers", lookup):
        monkeypatch.setattr(gluon, "NF4_LOOKUP", name)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        gluon.int4_linear_fwd(x, weight.qweight, weight.scales, None, bias, out, 128, "nf4", config=cfg)
        assert_linear_close(out, x, weight, bias, w_rounded=True, msg=f"nf4 {name} {cfg}")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("kind", ["int4", "nf4"])
def test_tiled_codes_through_a_4d_view_match_the_rows(kind) -> None:
    """Tiled codes (format.tile_codes) read by the kernel through a 4-D TMA view give the rows'
    bits at every config kind: 128- and 64-column steps, K split, persistent programs, odd M,
    a bias; zeros and symmetric int4."""
    from openkernels.quant.format import tile_codes

    gen = torch.Generator().manual_seed(41)
    n, k = 2048 + 64, 4096
    configs = [gluon.config_for(m, 8192, 8192, 128) for m in (16, 128, 2048)] + [gluon.PERSISTENT_STUDY[0]]
    for symmetric in (False, True) if kind == "int4" else (False,):
        w = make_weight(n, k, heavy=True, generator=gen)
        weight = (Q.quantize_nf4(w, 128) if kind == "nf4" else Q.quantize_int4(w, 128, symmetric)).to("cuda")
        tiled = tile_codes(weight.qweight)
        bias = torch.randn(n, generator=gen).to("cuda")
        for cfg in configs:
            m = cfg.block_m + 37
            x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
            outs = []
            for codes in (weight.qweight, tiled):
                assert gluon.unsupported_call(x, codes, weight.scales, weight.zeros, bias, x.new_empty(m, n), 128,
                                              kind, cfg) is None  # fmt: skip
                out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
                gluon.int4_linear_fwd(x, codes, weight.scales, weight.zeros, bias, out, 128, kind, config=cfg)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), f"{cfg} {kind} symmetric={symmetric}"
            assert_linear_close(outs[1], x, weight, bias, w_rounded=True, msg=f"tiled {cfg}")


@pytest.mark.gpu
@_needs_sm90
def test_fp16_scales_strided_x_and_nan() -> None:
    gen = torch.Generator().manual_seed(5)
    n, k = 520, 1024
    weight = Q.quantize_int4(make_weight(n, k, generator=gen), 128, scale_dtype=torch.float16).to("cuda")
    base = torch.randn(96, k + 64, generator=gen).to("cuda", torch.bfloat16)
    x = base[:, :k]  # rows of (k + 64) elements: a TMA-readable stride other than K
    x[3, 17] = float("nan")
    with dispatch.force("int4_linear:wgmma"):
        out = Q.int4_linear(x, weight)
    assert (
        gluon.unsupported_call(x, weight.qweight, weight.scales, weight.zeros, None, out, 128, "int4") is None
    )
    assert out[3].isnan().all()
    keep = torch.ones(96, dtype=torch.bool)
    keep[3] = False
    assert not out[keep].isnan().any()
    assert_linear_close(out[keep], x[keep], weight, None, w_rounded=True, msg="strided x")
    # A column stride of 2 is refused here and runs on the Triton path (api.py makes it contiguous first).
    wide = torch.randn(96, 2 * k, generator=gen).to("cuda", torch.bfloat16)
    with dispatch.force("int4_linear:wgmma"):
        y = Q.int4_linear(wide[:, ::2], weight)
    assert_linear_close(y, wide[:, ::2], weight, None, w_rounded=True, msg="column stride 2")


@pytest.mark.gpu
@_needs_sm90
def test_repeated_calls_through_the_direct_launch() -> None:
    """The first call of a plan compiles through kernel[grid]; later ones launch the compiled
    kernel directly (descriptors rebuilt per call): each on new tensors must still match, and
    a base 8 bytes off goes to the Triton path."""
    gen = torch.Generator().manual_seed(11)
    weights = [Q.quantize_int4(make_weight(520, 1024, generator=gen), 128).to("cuda") for _ in range(3)]
    with dispatch.force("int4_linear:wgmma"):
        for i, weight in enumerate(weights):
            x = torch.randn(48, 1024, generator=gen).to("cuda", torch.bfloat16)
            assert_linear_close(Q.int4_linear(x, weight), x, weight, None, w_rounded=True, msg=f"call {i}")
        flat = torch.randn(48 * 1024 + 4, generator=gen).to("cuda", torch.bfloat16)
        x = flat[4:].view(48, 1024)
        assert "base of x" in gluon.unsupported_call(x, weights[0].qweight, weights[0].scales, weights[0].zeros,
                                                     None, torch.empty(48, 520, device="cuda", dtype=x.dtype),
                                                     128, "int4")  # fmt: skip
        assert_linear_close(Q.int4_linear(x, weights[0]), x, weights[0], None, w_rounded=False, msg="shifted")


@pytest.mark.gpu
@_needs_sm90
def test_refused_calls_run_the_triton_path() -> None:
    gen = torch.Generator().manual_seed(9)
    weight = Q.quantize_int4(make_weight(256, 256, generator=gen), 32).to("cuda")  # group 32: refused
    x = torch.randn(8, 256, generator=gen).to("cuda", torch.bfloat16)  # 8 rows: refused too
    with dispatch.force("int4_linear:wgmma"):
        out = Q.int4_linear(x, weight)
    assert_linear_close(out, x, weight, None, w_rounded=False, msg="triton fallback")


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize(("m", "n", "k", "group"), [(300, 4100, 2048, 128), (2053, 2056, 2048, 64)], ids=str)
def test_large_m_default_runs_the_kernel(m, n, k, group) -> None:
    """From M = 256 the default (unforced) call runs this kernel, 256-row bands where they fill
    a wave, instead of the Triton launcher's dequantize + cuBLAS: a ragged last band and a
    ragged last weight tile, a bias, within the contract."""
    gen = torch.Generator().manual_seed(m)
    weight = Q.quantize_int4(make_weight(n, k, heavy=True, generator=gen), group).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda")
    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
    assert (
        gluon.unsupported_call(x, weight.qweight, weight.scales, weight.zeros, bias, out, group, "int4")
        is None
    )
    assert gluon.slower_than_triton(m, n, k) is None
    got = Q.int4_linear(x, weight, bias)
    assert_linear_close(got, x, weight, bias, w_rounded=True, msg=f"M={m}")
    with dispatch.force("int4_linear:wgmma"):
        forced = Q.int4_linear(x, weight, bias)
    assert torch.equal(got, forced)  # the same kernel and config: the default ran it


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize(
    "cfg",
    [
        gluon.WgmmaConfig(128, 64, 128, 3, 2, 2),
        gluon.WgmmaConfig(16, 64, 128, 3, 2, 4),
        gluon.WgmmaConfig(64, 64, 64, 3, 2, 3),
    ],
    ids=str,
)
def test_split_k_configs(cfg) -> None:
    """K split over programs, finished in the launch: against the reference, twice (the
    counters left at zero by the first call), and bitwise equal run to run."""
    gen = torch.Generator().manual_seed(13)
    m, n, k = cfg.block_m + 3, 777, 1024
    weight = Q.quantize_int4(make_weight(n, k, generator=gen), 128).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda")
    outs = []
    for _ in range(2):
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
        gluon.int4_linear_fwd(
            x, weight.qweight, weight.scales, weight.zeros, bias, out, 128, "int4", config=cfg
        )
        assert_linear_close(out, x, weight, bias, w_rounded=True, msg=str(cfg))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("cfg", [c for m in (16, 64, 128) for c in gluon.sweep_configs(m)], ids=str)
def test_every_swept_config(cfg) -> None:
    gen = torch.Generator().manual_seed(11)
    m, n, k = cfg.block_m + 3, 777, 1024
    weight = Q.quantize_int4(make_weight(n, k, generator=gen), 128).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda")
    out = torch.empty(m, n, dtype=x.dtype, device="cuda")
    gluon.int4_linear_fwd(x, weight.qweight, weight.scales, weight.zeros, bias, out, 128, "int4", config=cfg)
    assert_linear_close(out, x, weight, bias, w_rounded=True, msg=str(cfg))


@pytest.mark.gpu
@_needs_sm90
@pytest.mark.parametrize("kind", ["int4", "nf4"])
@pytest.mark.parametrize("cfg", gluon.PERSISTENT_STUDY, ids=str)
def test_persistent_configs(cfg, kind) -> None:
    """Persistent programs (a tile loop over more tiles than SMs, the ring's phases running on
    across tiles, the next tile's loads in flight under the epilogue): a ragged last band and
    weight tile, a bias, against the reference, and bitwise equal to the one-tile-per-program
    launch of the same tile."""
    gen = torch.Generator().manual_seed(17)
    m, n, k = 2 * cfg.block_m + 37, 60 * cfg.block_n + 12, 1024
    w = make_weight(n, k, heavy=True, generator=gen)
    weight = (Q.quantize_nf4(w, 128) if kind == "nf4" else Q.quantize_int4(w, 128)).to("cuda")
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda")
    assert (
        -(-m // cfg.block_m) * -(-n // cfg.block_n)
        > torch.cuda.get_device_properties(0).multi_processor_count
    )
    outs = []
    for c in (cfg, dataclasses.replace(cfg, persistent=False)):
        out = torch.full((m, n), float("nan"), dtype=x.dtype, device="cuda")
        gluon.int4_linear_fwd(x, weight.qweight, weight.scales, weight.zeros, bias, out, 128, kind, config=c)
        assert_linear_close(out, x, weight, bias, w_rounded=True, msg=f"{c} {kind}")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
