"""CUDA C++ backend of int4_linear for small batches (int4_gemv.cu). One row of x: a GEMV on
CUDA cores (the weight streamed with one 16-byte load per thread and row, codes turned into
floats by bit tricks, NF4 levels looked up in registers by a warp shuffle). 2-16 rows (int4):
tensor cores on the codes in their stored order (mma.m16n8k16; each lane's 32-code window of
a column is one load, and x is read in the same permuted order).

One row of x, persistent (config "persistent", "persistent-r<rows>-d<depth>-c<ctas per SM>"
or "-g<grid>"): SMs x CTAs per SM CTAs walk blocks of rows grid-stride with the next items'
weight loads in flight during the current one's math, x kept in registers where K <= 8192.
Forced only (by `config`) until it is timed on an H200 against the kernel above: the default
dispatch still runs the one-round GEMV.

1-16 rows, W as the A operand (config "tc[-t<tiles>][-u<unroll>][-k<splits>][-p]", int4_tc.cu,
its own library; 1-8 rows where K is split over a cluster or the launch is a dependent): a
tensor-core GEMV. W's 16-row tiles are mma.m16n8k16's A operand and x the B operand, so one
MMA takes 256 codes; the codes enter the MMA as (base + q) - (base + zero), exact, and where
the group size is a multiple of 128 the scale multiplies each 128-code chunk's fp32 sum once.
The default for up to 16 rows of x on sm_90 where measured (default_config). NF4 runs the same
kernels from a second build of int4_tc.cu (-DOK_TC_NF4, built on NF4's first call): each byte
of codes' two levels read from a table of level pairs in shared memory (quant 0.10.14; looked
up in registers by byte permutes before, TC_NF4_LOOKUP "registers"), the levels rounded to x's
dtype (quant 0.10.11; no dependent-launch or ring build of it). Config
"tcr[-t<tiles>][-s<stages>]": the same math fed by a producer warp that keeps `stages` stages of
1024 codes per row (with their scales, zeros and x) in flight in shared memory by bulk copies
(cp.async.bulk on mbarriers); group sizes that are multiples of 128. Forced only, until timed.

2-16 rows, persistent (config "mma-persistent[-n<columns>][-d<depth>][-c<ctas per SM>][-g<grid>]"):
SMs x CTAs per SM CTAs walk tiles of 32 or 64 columns grid-stride, each thread's code windows,
scales and zeros copied by cp.async into a ring of `depth` stages in shared memory ahead of
the math. Forced only (by `config`) until timed on an H200 against the one-round kernel, which
the default dispatch still runs for 2-16 rows.

Dispatch name "gemv", registered on CUDA (sm_80 and newer) above wgmma and Triton: unforced,
it runs the tensor-core GEMV or the one-round kernel where default_config says they measured
fastest and hands every other call to the implementation dispatch ranks next; forced by name
(`dispatch.force("gemv")`) it runs the tensor-core GEMV there and the GEMV / one-round MMA kernel elsewhere. Same entry
point as triton.int4_linear_fwd; a call these kernels do not take (more than 16 rows of x, NF4 past one row
outside the tensor-core GEMV, K or the group size not a multiple of 32 (K of 128 past
one row), 16-bit dtypes other than bf16 / fp16, misaligned parts, N not a multiple of 4 (32
past one row)) goes to the Triton launcher. The library is built with nvcc for the device's
arch on first use; if that fails the Triton kernels run, with one warning. CPU tensors run the same source built for the CPU emulation
(openkernels.shared.cuda_build.load_emulated): how the tests check it without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re
import warnings
from dataclasses import astuple, dataclass, fields

import torch
from torch import Tensor

from openkernels.shared import cuda_build, dispatch
from openkernels.shared.dispatch import DispatchKey

from ..format import nf4_values

__all__ = [
    "MMA_MAX_ROWS",
    "MMA_PERSISTENT_CONFIGS",
    "MMA_PERSISTENT_SHAPES",
    "PERSISTENT_CONFIGS",
    "PERSISTENT_SHAPES",
    "ROWS",
    "PersistentConfig",
    "gemv_rows",
    "MmaPersistentConfig",
    "TC_CONFIGS",
    "TC_SHAPES",
    "takes_tiled",
    "tiled_config",
    "TC_PDL_CONFIGS",
    "TC_SPLITS",
    "TC_SPLIT_CONFIGS",
    "TcConfig",
    "tc_config",
    "int4_linear_fwd",
    "GATED_ACTS",
    "gated_config",
    "takes_gated",
    "normed_config",
    "takes_normed",
    "int4_linear_normed_fwd",
    "int4_linear_gated_fwd",
    "mma_persistent_config",
    "persistent_config",
    "supports",
    "unsupported_call",
]

_SOURCE = pathlib.Path(__file__).with_name("int4_gemv.cu")
_TC_SOURCE = pathlib.Path(__file__).with_name("int4_tc.cu")
_CODES = {torch.bfloat16: 1, torch.float16: 2}
_BIAS_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_KINDS = {"int4": 0, "int4 symmetric": 1, "nf4": 2}
ROWS = (4, 8)  # rows of W per CTA of the GEMV
MMA_MAX_ROWS = 16  # rows of x the tensor-core kernel takes (one m16 tile)
_MMA_COLS = 32  # columns of W per CTA of the tensor-core kernel
# The persistent GEMV's (rows per block, items in flight ahead of the math) pairs built in
# int4_gemv.cu (launch_persistent_shape), and the CTAs per SM each defaults to (the number
# resident at its register count: 2 at <= 128 registers, 1 for 8 rows).
PERSISTENT_SHAPES = {(2, 4): 2, (4, 1): 2, (4, 2): 2, (8, 1): 1}
# What a GPU run times against the one-round GEMV ("persistent" is r4-d2-c2).
PERSISTENT_CONFIGS = (
    "persistent-r4-d2-c2", "persistent-r4-d1-c2", "persistent-r2-d4-c2", "persistent-r8-d1-c1",
    "persistent-r4-d2-c1", "persistent-r4-d2-c3", "persistent-r8-d1-c2",
)  # fmt: skip
# The persistent tensor-core kernel's (columns per tile, stages of the cp.async ring) pairs
# built in int4_gemv.cu (launch_mma_persistent_shape), each with its default CTAs per SM (one:
# 160-198 registers).
MMA_PERSISTENT_SHAPES = {(32, 4): 1, (32, 8): 1, (64, 2): 1, (64, 4): 1}
# What a GPU run times against the one-round kernel ("mma-persistent" is n32-d8-c1).
MMA_PERSISTENT_CONFIGS = (
    "mma-persistent-n32-d8", "mma-persistent-n32-d4", "mma-persistent-n64-d4", "mma-persistent-n64-d2",
    "mma-persistent-n32-d4-c2",
)  # fmt: skip
# The tensor-core GEMV's (16-row tiles of W per CTA, chunks per warp trip) pairs built in
# int4_tc.cu (launch_tc), and what a GPU run times ("tc" is t2-u2).
TC_SHAPES = ((1, 2), (2, 2), (4, 1))
TC_CONFIGS = tuple(f"tc-t{t}-u{u}" for t, u in TC_SHAPES)
# The same shapes with K split over a cluster of CTAs (int4_tc_split_kernel, sm_90; config
# "tc-t<tiles>-u<unroll>-k<splits>"): cluster sizes taken, and what a GPU run times.
TC_SPLITS = (2, 4, 8)
TC_SPLIT_CONFIGS = ("tc-t1-u2-k2", "tc-t1-u2-k4", "tc-t1-u2-k8", "tc-t2-u2-k2", "tc-t2-u2-k4", "tc-t4-u1-k2")
# Any tc config with "-p": launched as a programmatic dependent of the kernel before it (sm_90),
# its codes, scales and zeros fetched into L2 before it waits for that kernel (int4_tc.cu
# tc_prologue). A study's variant, forced only until timed; what a GPU run times.
TC_PDL_CONFIGS = ("tc-t1-u2-p", "tc-t2-u2-p", "tc-t4-u1-p", "tc-t1-u2-k2-p", "tc-t2-u2-k2-p", "tc-t4-u1-k2-p")
# Any tc config with "-x2" (9-16 rows of x, neither split nor dependent): each n8 tile of x in
# its own CTA, two CTAs per tile of W (int4_tc.cu's XT); what a GPU run times.
TC_XSPLIT_CONFIGS = ("tc-t1-u2-x2", "tc-t2-u2-x2", "tc-t4-u1-x2")
# True: default_config routes 9-16 rows to the x-split builds of the two-tile configs it picks.
# Off until a GPU has timed them against the two-tile builds (quant 0.10.10: built and tested
# on the CPU emulation only; `gpu_session.sh quant xsplit` runs their GPU tests and timing).
TC_XSPLIT_DEFAULT = False
TC_MAX_ROWS = 16  # rows of x the tensor-core GEMV takes (two n8 tiles)
TC_SPLIT_MAX_ROWS = 8  # ... where K is split over a cluster or the launch is a dependent (one n8 tile)
TC_SMALL_N = 2048  # 9-16 rows: the two-tile tensor-core GEMV up to this N (default_config)
# The same GEMV fed by a producer warp's ring of bulk copies (int4_tc_ring_kernel, config
# "tcr-t<tiles>-s<stages>"): (16-row tiles of W per CTA, stages in flight) built. A study's
# variant, forced only until timed on an H200 against the register kernel.
TCR_SHAPES = ((1, 4), (1, 8), (2, 4), (4, 2))
TCR_CONFIGS = tuple(f"tcr-t{t}-s{s}" for t, s in TCR_SHAPES)
_TCR_MAX_SHARED = 200 * 1024  # the ring's dynamic shared memory (int4_tc.cu's launch_tc_ring)
_EMULATED_SMS = 2  # what the CPU emulation counts as SMs (a grid of 2 x CTAs per SM)
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "ok_int4_gemv": [_I32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I64,
                     _I64],
    "ok_int4_gemv_persistent": [_I32, _I32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64,
                                _I64, _I64, _I64, _I64, _I64],
    "ok_int4_mma_persistent": [_I32, _I32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64,
                               _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64],
    "ok_int4_mma": [_I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
                    _I64, _I64],
}  # fmt: skip


_TC_SIGNATURES = {
    # (device, x, scale dtype codes, tiles, unroll, splits, pdl, tiled, xtiles, prologue, the pointers, bias code,
    # out, sizes, strides, group size, the norm's weight, epsilon and weight offset, stream)
    "ok_int4_tc": [_I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64,
                   _I64, _I64, _I64, _I64, _I64, _I64, _P, _F64, _F64, _I64],
    "ok_int4_tc_ring": [_I32, _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _I32, _P, _I64, _I64, _I64, _I64, _I64,
                        _I64, _I64, _I64, _I64],
}  # fmt: skip


@functools.cache
def _library(arch: str) -> cuda_build.CudaLibrary:
    return cuda_build.CudaLibrary(
        _SOURCE, name=f"openkernels_quant_cuda_{arch}", arch=arch, signatures=_SIGNATURES
    )


# How the NF4 build's kernels (register and K-split) read a code's level: "shared", a table of level pairs in
# shared memory indexed by each byte of codes (one load per pair: quant 0.10.14), or
# "registers", the byte permutes over constant words (nf4_levels). A study's knob, read when a
# call loads its library: calls the eager replay already recorded keep the build they recorded
# (openkernels.shared.replay.set_mode forgets them).
TC_NF4_LOOKUPS = ("shared", "registers")
TC_NF4_LOOKUP = "shared"


@functools.cache
def _tc_library(arch: str, nf4: bool = False, lookup: str = "shared") -> cuda_build.CudaLibrary:
    """The tensor-core GEMV alone (int4_tc.cu): what the default path builds on first use;
    `nf4`: its NF4 build (-DOK_TC_NF4, the same kernels reading NF4 levels), built on NF4's
    first call only, with `lookup` (TC_NF4_LOOKUPS) in its kernels."""
    if nf4:
        if lookup not in TC_NF4_LOOKUPS:
            raise ValueError(f"NF4 lookup {lookup!r}: one of {TC_NF4_LOOKUPS}")
        suffix, flags = ("", ()) if lookup == "shared" else ("_registers", ("-DOK_TC_NF4_REGISTERS",))
        return cuda_build.CudaLibrary(
            _TC_SOURCE, name=f"openkernels_quant_tc_nf4{suffix}_{arch}", arch=arch, signatures=_TC_SIGNATURES,
            extra_flags=("-DOK_TC_NF4", *flags),
        )  # fmt: skip
    return cuda_build.CudaLibrary(
        _TC_SOURCE, name=f"openkernels_quant_tc_{arch}", arch=arch, signatures=_TC_SIGNATURES
    )


def supports(key: DispatchKey) -> str | None:
    """Dispatch predicate: None when these kernels can run `key`, else why not."""
    if key.backend != "cuda":
        return f"the CUDA C++ GEMV runs on NVIDIA GPUs (this is {key.backend}/{key.arch})"
    if not key.arch.startswith("sm_") or int(key.arch.removeprefix("sm_").rstrip("a")) < 80:
        return f"the CUDA C++ GEMV is built for sm_80 and newer (this is {key.arch})"
    if key.dtype not in _CODES:
        return f"activations in {key.dtype}: the GEMV takes bfloat16 and float16"
    return cuda_build.no_nvcc_reason()


def gemv_rows(n: int, config: int | None = None) -> int | None:
    """Rows of W per CTA of the GEMV: 8 where N allows (half the reads of x per weight byte),
    else 4; `config` forces one (tests); None when N is a multiple of neither."""
    if config is not None:
        return config if n % config == 0 else None
    return next((r for r in (8, 4) if n % r == 0), None)


@dataclass(frozen=True)
class PersistentConfig:
    """The persistent GEMV's knobs: rows of W per block, items (blocks' 16-byte chunks) in
    flight ahead of the math, CTAs per SM, or an explicit grid (tests: fewer CTAs than SMs)."""

    rows: int = 4
    depth: int = 2
    ctas_per_sm: int | None = None
    grid: int | None = None

    def grid_for(self, n_blocks: int, sms: int) -> int:
        ctas = self.ctas_per_sm or PERSISTENT_SHAPES[(self.rows, self.depth)]
        return max(1, min(n_blocks, self.grid if self.grid is not None else ctas * sms))


_PERSISTENT = re.compile(r"persistent(?:-r(\d+))?(?:-d(\d+))?(?:-c(\d+))?(?:-g(\d+))?")


def persistent_config(config: object) -> PersistentConfig | None:
    """`config` "persistent[-r<rows>][-d<depth>][-c<CTAs per SM>][-g<grid>]" as its knobs (rows 4
    and depth 2 where left out), None for any other config; ValueError for a (rows, depth)
    pair that is not built."""
    if not isinstance(config, str) or not config.startswith("persistent"):
        return None
    match = _PERSISTENT.fullmatch(config)
    if match is None:
        raise ValueError(f"config {config!r}: not persistent[-r<rows>][-d<depth>][-c<ctas>][-g<grid>]")
    rows, depth, ctas, grid = (None if g is None else int(g) for g in match.groups())
    out = PersistentConfig(rows or 4, depth or 2, ctas, grid)
    if (out.rows, out.depth) not in PERSISTENT_SHAPES:
        raise ValueError(f"config {config!r}: (rows, depth) not among {sorted(PERSISTENT_SHAPES)}")
    if out.ctas_per_sm == 0 or out.grid == 0:
        raise ValueError(f"config {config!r}: CTAs per SM and grid are at least 1")
    return out


@dataclass(frozen=True)
class MmaPersistentConfig:
    """The persistent tensor-core kernel's knobs: columns of W per tile (32 or 64), stages of
    the cp.async ring (items in flight ahead of the math), CTAs per SM, or an explicit grid."""

    cols: int = 32
    depth: int = 8
    ctas_per_sm: int | None = None
    grid: int | None = None

    def grid_for(self, n_tiles: int, sms: int) -> int:
        ctas = self.ctas_per_sm or MMA_PERSISTENT_SHAPES[(self.cols, self.depth)]
        return max(1, min(n_tiles, self.grid if self.grid is not None else ctas * sms))


_MMA_PERSISTENT = re.compile(r"mma-persistent(?:-n(\d+))?(?:-d(\d+))?(?:-c(\d+))?(?:-g(\d+))?")


def mma_persistent_config(config: object) -> MmaPersistentConfig | None:
    """`config` "mma-persistent[-n<columns>][-d<depth>][-c<CTAs per SM>][-g<grid>]" as its knobs
    (32 columns, depth 8 where left out; depth 4 for 64 columns), None for any other config;
    ValueError for a (columns, depth) pair that is not built."""
    if not isinstance(config, str) or not config.startswith("mma-persistent"):
        return None
    match = _MMA_PERSISTENT.fullmatch(config)
    if match is None:
        raise ValueError(f"config {config!r}: not mma-persistent[-n<cols>][-d<depth>][-c<ctas>][-g<grid>]")
    cols, depth, ctas, grid = (None if g is None else int(g) for g in match.groups())
    cols = cols or 32
    out = MmaPersistentConfig(cols, depth or (8 if cols == 32 else 4), ctas, grid)
    if (out.cols, out.depth) not in MMA_PERSISTENT_SHAPES:
        raise ValueError(f"config {config!r}: (columns, depth) not among {sorted(MMA_PERSISTENT_SHAPES)}")
    if out.ctas_per_sm == 0 or out.grid == 0:
        raise ValueError(f"config {config!r}: CTAs per SM and grid are at least 1")
    return out


@dataclass(frozen=True)
class TcConfig:
    """The tensor-core GEMV's knobs: 16-row tiles of W per CTA, 128-code chunks per warp trip
    (their loads issued before their math), the CTAs of a cluster that split K (1: none), and
    the CTAs that share a tile of W, one per n8 tile of x (xtiles 2: 9-16 rows)."""

    tiles: int = 2
    unroll: int = 2
    splits: int = 1
    pdl: bool = False
    xtiles: int = 1


def _two_knobs(config: object, name: str, knobs: str, cls: type, shapes: tuple) -> object | None:
    """`config` "<name>[-<k1><int>][-<k2><int>]" (knobs: the two letters) as cls(k1, k2) (its
    defaults where left out), None for a config not of that name; ValueError for a pair not in
    `shapes`."""
    if not isinstance(config, str) or not (config == name or config.startswith(name + "-")):
        return None
    match = re.fullmatch(rf"{name}(?:-{knobs[0]}(\d+))?(?:-{knobs[1]}(\d+))?", config)
    syntax = f"{name}[-{knobs[0]}<int>][-{knobs[1]}<int>]"
    if match is None:
        raise ValueError(f"config {config!r}: not {syntax}")
    default = cls()
    values = [
        default_value if g is None else int(g) for g, default_value in zip(match.groups(), astuple(default))
    ]
    out = cls(*values)
    if tuple(values) not in shapes:
        raise ValueError(
            f"config {config!r}: ({', '.join(f.name for f in fields(cls))}) not among {sorted(shapes)}"
        )
    return out


@functools.lru_cache(maxsize=256)  # parsed once per config: the launcher asks per call
def tc_config(config: object) -> TcConfig | None:
    """`config` "tc[-t<tiles>][-u<unroll>][-k<splits>][-x2][-p]" as its knobs (2, 2, 1, one CTA
    per tile of W and no PDL where left out), None for any other config; ValueError for a pair
    that is not built, splits not in TC_SPLITS, or -x2 with a split or -p."""
    splits, pdl, xtiles = 1, False, 1
    if isinstance(config, str) and (config == "tc" or config.startswith("tc-")):
        match = re.fullmatch(r"(tc(?:-t\d+)?(?:-u\d+)?)(?:-k(\d+))?(?:-x(\d+))?(-p)?", config)
        if match is None:
            raise ValueError(f"config {config!r}: not tc[-t<tiles>][-u<unroll>][-k<splits>][-x2][-p]")
        full = config
        config, pdl = match.group(1), match.group(4) is not None
        splits = 1 if match.group(2) is None else int(match.group(2))
        xtiles = 1 if match.group(3) is None else int(match.group(3))
        if splits != 1 and splits not in TC_SPLITS:
            raise ValueError(f"config {config}-k{splits}: splits not among {TC_SPLITS}")
        if xtiles != 1 and (xtiles != 2 or splits != 1 or pdl):
            raise ValueError(f"config {full!r}: -x2 is the only x split, and neither splits K nor takes -p")
    out = _two_knobs(config, "tc", "tu", TcConfig, TC_SHAPES)
    return None if out is None else TcConfig(out.tiles, out.unroll, splits, pdl, xtiles)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TcRingConfig:
    """The ring-fed tensor-core GEMV's knobs: 16-row tiles of W per CTA, stages of 1024 codes
    per row (with their scales, zeros and x) in flight."""

    tiles: int = 2
    stages: int = 4

    def shared_bytes(self, m: int, x_size: int, s_size: int) -> int:
        """Dynamic shared memory of a launch (int4_tc.cu: ring_stage_bytes x stages)."""
        rows = 16 * self.tiles
        return self.stages * (self.tiles * 8 * 1024 + 2 * 8 * rows * s_size + m * 8 * 128 * x_size)


def tcr_config(config: object) -> TcRingConfig | None:
    """`config` "tcr[-t<tiles>][-s<stages>]" as its knobs (2 and 4 where left out), None for any
    other config; ValueError for a pair that is not built."""
    return _two_knobs(config, "tcr", "ts", TcRingConfig, TCR_SHAPES)  # type: ignore[return-value]


def _path(m: int, config: int | str | None) -> str:
    """ "gemv" for one row of x (or `config` an int, its rows per CTA), "mma" for 2-16 rows (or
    `config` "mma", which also takes one row), "persistent" for `config` "persistent...",
    "mma-persistent" for `config` "mma-persistent..." (1-16 rows)."""
    if mma_persistent_config(config) is not None:
        return "mma-persistent"
    if tc_config(config) is not None:
        return "tc"
    if tcr_config(config) is not None:
        return "tcr"
    if config == "mma" or (config is None and m > 1):
        return "mma"
    if persistent_config(config) is not None:
        return "persistent"
    return "gemv"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tc_shape_unsupported(
    m: int, n: int, k: int, group_size: int, kind: str, tiles: int, group_multiple: int, max_rows: int,
    nf4: bool = True,
) -> str | None:  # fmt: skip
    """The tensor-core GEMV's shape limits, one list for its register and ring-fed builds
    (`nf4`: whether the build has an NF4 twin)."""
    if m > max_rows:
        return f"{m} rows of x for this tensor-core GEMV (it takes up to {max_rows})"
    if kind == "nf4" and not nf4:
        return "NF4 on the ring-fed tensor-core GEMV (it takes int4)"
    if k % 128 or group_size % group_multiple:
        return f"K = {k} not a multiple of 128 or group size {group_size} not of {group_multiple}"
    if n % (16 * tiles):
        return f"N = {n} not a multiple of {16 * tiles} (the tensor-core GEMV's rows per CTA)"
    return None


def _n_of(qweight: Tensor) -> int:
    """N of codes in the stored rows (N, K // 2) or format.tile_codes' layout (N // 16, K // 128, 1024)."""
    return qweight.shape[0] * (16 if qweight.dim() == 3 else 1)


def unsupported_call(x, qweight, scales, zeros, bias, out, group_size, kind, config=None) -> str | None:
    """Why this call goes to the Triton kernels instead (None: a kernel here takes it)."""
    m, k = x.shape
    n = _n_of(qweight)
    if (
        qweight.dim() == 3
    ):  # tiled codes: the tensor-core GEMV's builds but the dependent launch and the x split
        tc = tc_config(config)
        if tcr_config(config) is None and (
            tc is None or tc.pdl or tc.xtiles > 1 or (m > TC_SPLIT_MAX_ROWS and tc.splits > 1)
        ):
            return (
                "tiled codes (format.tile_codes) outside the tensor-core GEMV's configs without -p or -x2 (up to "
                f"{TC_MAX_ROWS} rows, {TC_SPLIT_MAX_ROWS} where K is split)"
            )
        if qweight.shape[1] * 128 != k or not qweight.is_contiguous():
            return "tiled codes not contiguous or not of x's K"
    if m > MMA_MAX_ROWS:
        return f"{m} rows of x (these kernels take up to {MMA_MAX_ROWS})"
    dtypes_ok = (
        x.dtype in _CODES and scales.dtype in _CODES and (zeros is None or zeros.dtype == scales.dtype)
    )
    if not dtypes_ok:
        return "dtypes of x, scales or zeros other than bfloat16 / float16 (zeros as scales)"
    if bias is not None and bias.dtype not in _BIAS_CODES:
        return f"a bias in {bias.dtype}"
    if not out.is_contiguous():
        return "a strided output"
    if qweight.data_ptr() % 16 or qweight.stride(0) % 16 or x.data_ptr() % 16:
        return "qweight rows or x not 16-byte aligned"
    ring = tcr_config(config)
    if ring is not None:
        if qweight.dim() != 3:
            return "the ring-fed tensor-core GEMV reads tiled codes only (format.tile_codes)"
        if x.is_cuda and not _arch(x.device).startswith("sm_90"):
            return "the ring-fed tensor-core GEMV on a GPU older than sm_90 (it needs bulk copies)"
        # group_size % 128: the ring stages one scale (zero) per 1024-code chunk and row.
        why = _tc_shape_unsupported(
            m, n, k, group_size, kind, ring.tiles, group_multiple=128, max_rows=TC_SPLIT_MAX_ROWS, nf4=False
        )
        if why is not None:
            return why
        if x.stride(0) * x.element_size() % 16:
            return "rows of x not 16-byte aligned"
        params = [scales] if zeros is None else [scales, zeros]
        if any(t.stride(-1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16 for t in params):
            return "scale or zero rows not contiguous and 16-byte aligned (the ring copies them in bulk)"
        if ring.shared_bytes(m, x.element_size(), scales.element_size()) > _TCR_MAX_SHARED:
            return f"{ring.stages} stages for {m} rows of x do not fit in shared memory"
        return None
    tc = tc_config(config)
    if tc is not None:
        why = _tc_shape_unsupported(
            m, n, k, group_size, kind, tc.tiles, group_multiple=32, max_rows=TC_MAX_ROWS
        )
        if why is not None:
            return why
        if kind == "nf4" and tc.pdl:
            return "NF4 on a dependent tensor-core GEMV (its NF4 build has no dependent launch)"
        if m > TC_SPLIT_MAX_ROWS and (tc.splits > 1 or tc.pdl):
            return f"{m} rows of x for a split or dependent tensor-core GEMV (it takes up to {TC_SPLIT_MAX_ROWS})"
        if tc.xtiles > 1 and m <= TC_SPLIT_MAX_ROWS:
            return f"{m} rows of x for the x-split tensor-core GEMV (it takes {TC_SPLIT_MAX_ROWS + 1}-{TC_MAX_ROWS})"
        if tc.splits > 1 and x.is_cuda and not _arch(x.device).startswith("sm_90"):
            return "K split over a cluster on a GPU older than sm_90 (it needs thread-block clusters)"
        if tc.pdl and x.is_cuda and not _arch(x.device).startswith("sm_90"):
            return "a programmatic dependent launch on a GPU older than sm_90"
        if m > 1 and x.stride(0) % 8:
            return "rows of x not 16-byte aligned"
        return None
    mp = mma_persistent_config(config)
    if mp is not None:
        if kind == "nf4":
            return "NF4 on the tensor-core kernel (it takes int4)"
        if k % 128 or group_size % 32:
            return f"K = {k} not a multiple of 128 or group size {group_size} not of 32"
        if n % mp.cols:
            return f"N = {n} not a multiple of {mp.cols} (the persistent tensor-core kernel's tile)"
        if m > 1 and x.stride(0) % 8:
            return "rows of x not 16-byte aligned"
        lane = mp.cols // 8  # a lane's contiguous scales (zeros): one 2 * lane-byte copy
        params = [scales] if zeros is None else [scales, zeros]
        if any(t.stride(0) % lane or t.stride(1) != 1 or t.data_ptr() % (2 * lane) for t in params):
            return "scales or zeros rows not aligned to a lane's columns"
        return None
    if _path(m, config) == "mma":
        if kind == "nf4":
            return "NF4 past one row of x (the tensor-core kernel takes int4)"
        if k % 128 or group_size % 32:
            return f"K = {k} not a multiple of 128 or group size {group_size} not of 32"
        if n % _MMA_COLS:
            return f"N = {n} not a multiple of {_MMA_COLS}"
        if m > 1 and x.stride(0) % 8:
            return "rows of x not 16-byte aligned"
        return None
    if m != 1:
        return f"{m} rows of x for the GEMV (it takes one)"
    if k % 32 or group_size % 32:
        return f"K = {k} or group size {group_size} not a multiple of 32"
    persistent = persistent_config(config)
    if persistent is not None:
        rows = persistent.rows
        if n % rows:
            return f"N = {n} not a multiple of {rows} (the persistent GEMV's rows per block)"
    else:
        rows = gemv_rows(n, config)
        if rows is None:
            return f"N = {n} not a multiple of 4"
    params = [scales] if zeros is None else [scales, zeros]
    if any(t.stride(0) % rows or t.stride(1) != 1 or t.data_ptr() % (2 * rows) for t in params):
        return "scales or zeros rows not aligned to the rows per CTA"
    return None


def _kind(kind: str, zeros: Tensor | None) -> int:
    if kind == "nf4":
        return _KINDS["nf4"]
    return _KINDS["int4"] if zeros is not None else _KINDS["int4 symmetric"]


def _arch(device: torch.device) -> str:
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


_broken: list[str] = []  # why the GPU library cannot run (warned once)


def _load(device: torch.device, tc: bool = False, nf4: bool = False):
    """The library for `device` (`tc`: the tensor-core GEMV's, `nf4` its NF4 build), or None
    (warned once) when it cannot be built. CPU tensors take the kernels built for the CPU
    emulation."""
    arch = "sm_80" if device.type == "cpu" else _arch(device)
    library = _tc_library(arch, nf4, TC_NF4_LOOKUP) if tc else _library(arch)  # both functools.cache'd
    if device.type == "cpu":
        return library.emulated()
    if _broken:
        return None
    try:
        return library()
    except cuda_build.CudaBuildError as error:
        _broken.append(str(error))
        warnings.warn(f"openkernels.quant: the CUDA C++ GEMV is off: {error}", RuntimeWarning, stacklevel=3)
        return None


_OP = "int4_linear"


def default_tc(m: int, n: int, k: int, group_size: int, arch: str) -> str | None:
    """The tensor-core GEMV config the default dispatch runs for this call, or None: the call
    goes on to the implementation below (wgmma on sm_90, else Triton). From kernel times
    (CUDA graphs, `benchmarks/studies/quant_tc_gemv.py`, bf16 x, group 128; docs/perf.md),
    x F.linear, Triton / tc:
      H200 8192 x 8192:  M = 1 1.64 / 1.78 (t2-u2), M = 4 1.25 / 1.76 (t2-u2), M = 16 1.22 / 1.27
      H200 28672 x 8192: M = 1 1.84 / 2.21 (t4-u1), M = 4 1.46 / 2.02 (t4-u1), M = 16 1.54 / 1.30
      H100 16384 x 2048: M = 1 1.81 / 2.35 (t4-u1), M = 4 1.35 / 2.32 (t4-u1)
      H100 2048 x 2048:  M = 1 0.85 / 1.24 (t1-u2), M = 4 0.57 / 1.21 (t1-u2)
      H100 3072 x 2048:  M = 1 0.83 / 1.26 (t1-u2), M = 4 0.63 / 1.21 (t1-u2)
      H100 2048 x 8192:  M = 1 1.48 / 1.45 (t1-u2), M = 4 0.77 / 1.42 (t1-u2)
    So up to 8 rows of x (one n8 tile), K from 2048 (a CTA's 8 warps split K by 128-code
    chunks): t4-u1 from N = 16384, t2-u2 from 8192, t1-u2 below. With K split over clusters
    (H100, 2026-12-06, M = 1 / 4 / 8, us): 2048 x 8192 t1-u2 10.5 / 10.6 / 11.0, t1-u2-k2
    8.3 / 8.4 / 8.6 (-k4 11.7, -k8 13.7: more CTAs than fit at once, a second wave); 4096 x
    8192 t1-u2 12.9 / 13.1, t2-u2-k2 12.3 / 12.4; 8192 x 8192 t2-u2 19.7 / 20.0 / 20.5,
    t4-u1-k2 18.2 / 18.6 / 19.3; 16384 x 8192 t4-u1 31.0, -k2 33.2; 28672 x 8192 t4-u1 55.4,
    -k2 55.2 (M = 4, 8: 55.7 / 57.1 against 56.2 / 58.4); at K = 2048 every split was slower.
    So from K = 8192 the tile that gives 128 CTAs unsplit (one per SM) is split in two (256
    CTAs, two per SM): t1 to N = 2048, t2 below 8192, t4 below 16384. Other archs, and K
    below 2048 (not measured), keep the implementation below."""
    if not arch.startswith("sm_90") or m > 8 or k < 2048 or k % 128 or group_size % 32:
        return None
    if n >= 16384 and n % 64 == 0:
        return "tc-t4-u1"
    if k >= 8192:  # a long K over one CTA per SM: split in two
        if n <= 2048 and n % 16 == 0:
            return "tc-t1-u2-k2"
        if n < 8192 and n % 32 == 0:
            return "tc-t2-u2-k2"
        if n % 64 == 0:
            return "tc-t4-u1-k2"
    if n >= 8192 and n % 32 == 0:
        return "tc-t2-u2"
    return "tc-t1-u2" if n % 16 == 0 else None


def default_config(
    m: int, n: int, k: int, group_size: int, arch: str, *, scales_in_x_dtype: bool = False, kind: str = "int4"
) -> str | None:
    """The config the default dispatch runs here for this call, or None: the call goes on to the
    implementation below (wgmma on sm_90, else Triton). Up to 8 rows of x: default_tc. 9-16
    rows on sm_90, kernel times at M = 16 (`quant_tc_gemv.py --ms 16`, float16 scales, us):
    quant 0.10.7 (one LOP3 per dequantized pair, the chunk's scaling a template argument), H100:
    8192 x 8192 one-round mma 25.3 / tc-t4-u1 20.4 (t2-u2 26.5), 28672 x 8192 wgmma (the
    default before) 89.3 / mma 86.4 / tc-t4-u1 70.3, 16384 x 2048 mma 15.1 / tc-t4-u1 14.5,
    2048 x 8192 tc-t1-u2 11.3 (mma 18.1), 2048 x 2048 tc-t1-u2 4.6 (mma 6.3). quant 0.10.6, H200:
    3072 x 2048 Triton 9.3 / mma 6.7 / tc-t1-u2 6.5. With scales in x's dtype (`scales_in_x_dtype`,
    the models' default since quant 0.10.6) wgmma dequantizes in packed 16-bit arithmetic and
    stays ahead where it takes the call: H100, 28672 x 8192, bfloat16 scales, kernel / eager
    wall 67.1 / 75.5 us against tc-t4-u1's 71.5 / 81.6 (`quant_wgmma_wall.py --ms 16`). So the
    two-tile tensor-core GEMV: t1-u2 to N = 2048, t4-u1 from N = 8192 unless wgmma takes the
    call with such scales; between them the one-round kernel where wgmma would hand the call
    to Triton, and wgmma where it takes it. NF4 (`kind`; the one-round kernel takes int4 only,
    and wgmma takes NF4 from 64 rows): the tensor-core GEMV at every N, t4-u1 from 8192, t2-u2
    where N allows below it (H100, M = 16: 8192 x 8192 26.6 us against NF4's Triton path 39.8,
    28672 x 8192 90.3 against 119.4; not timed against other tc configs)."""
    if m <= TC_SPLIT_MAX_ROWS:
        return default_tc(m, n, k, group_size, arch)
    if not arch.startswith("sm_90") or m > TC_MAX_ROWS or k < 2048 or k % 128 or group_size % 32:
        return None
    x_split = "-x2" if TC_XSPLIT_DEFAULT else ""
    if n <= TC_SMALL_N and n % 16 == 0:
        return "tc-t1-u2" + x_split
    if kind == "nf4":
        tiles = next((t for t in ((4,) if n >= 8192 else ()) + (2, 1) if n % (16 * t) == 0), None)
        return None if tiles is None else f"tc-t{tiles}-u{1 if tiles == 4 else 2}" + x_split
    from .. import gluon  # the wgmma launcher's own routing (imported on use: gluon needs Triton)

    # (wgmma takes 16 rows and more: at 9-15 a call it "takes" went on to Triton before quant 0.10.15)
    wgmma_takes_it = m >= gluon.MIN_M and gluon.slower_than_triton(m, n, k) is None
    if n >= 8192 and n % 64 == 0 and not (wgmma_takes_it and scales_in_x_dtype):
        return "tc-t4-u1" + x_split
    return None if wgmma_takes_it else "mma"


_CONTIGUOUS = torch.empty(0)  # unsupported_call's stand-in for the output ops.forward makes (contiguous)


def tiled_config(
    m: int, n: int, k: int, group_size: int, arch: str, *, scales_in_x_dtype: bool = False, kind: str = "int4"
) -> str | None:
    """The tensor-core GEMV config tiled codes (format.tile_codes) run on: the default config
    where it is one that reads them (no programmatic dependent launch, no x split), else None
    (wgmma reads them where it takes the call, else they are converted to rows). Where the rows
    go to the one-round kernel (9-16 rows, int4, N below 8192), which reads rows only, NF4's
    choice instead: the tensor-core GEMV at every N."""
    config = default_config(m, n, k, group_size, arch, scales_in_x_dtype=scales_in_x_dtype, kind=kind)
    if config == "mma":
        config = default_config(m, n, k, group_size, arch, scales_in_x_dtype=scales_in_x_dtype, kind="nf4")
    tc = tc_config(config)
    return config if tc is not None and not tc.pdl and tc.xtiles == 1 else None


def takes_tiled(rows: Tensor, tiled: Tensor, scales, zeros, bias, group_size: int, kind: str) -> bool:
    """Whether int4_linear_fwd runs this call (rows (M, K), dispatch's first choice here; the
    caller's checks in ops.tiled_runner) on the tensor-core GEMV with the tiled codes."""
    if _broken:
        return False
    k = rows.shape[1]
    config = tiled_config(rows.shape[0], 16 * tiled.shape[0], k, group_size, _arch(rows.device),
                          scales_in_x_dtype=scales.dtype == rows.dtype, kind=kind)  # fmt: skip
    return (
        config is not None
        and unsupported_call(rows, tiled, scales, zeros, bias, _CONTIGUOUS, group_size, kind, config) is None
    )


def _hand_on(args) -> None:
    """The call to the implementation dispatch would pick after this one (Triton when none)."""
    x, kind = args[0], args[7]
    chosen = dispatch.select(_OP, dispatch.key_for(x, kind))
    names = [impl.name for impl in chosen]
    after = chosen[names.index("gemv") + 1 :] if "gemv" in names else ()
    if after:
        return after[0].fn(*args)
    return _triton(*args)


def _check_status(status: int, on_gpu: bool) -> None:
    """After a launch: nothing where it ran (0); an emulated launch's refusal raises (a bug of the
    caller's checks); a GPU launch's failure turns the library off with one warning (the caller
    then runs its fallback, as every later call does)."""
    if status == 0:
        return
    if not on_gpu:
        raise RuntimeError(f"the emulated kernel refused a launch (status {status})")
    _broken.append(f"launch status {status}")
    warnings.warn(
        f"openkernels.quant: the CUDA C++ kernel's launch failed (status {status}); the Triton kernels run from "
        "now on",
        RuntimeWarning,
        stacklevel=3,
    )


def _triton(x, qweight, scales, zeros, bias, out, group_size, kind) -> None:
    from ..triton import int4_linear_fwd as triton_int4_linear_fwd

    triton_int4_linear_fwd(x, qweight, scales, zeros, bias, out, group_size, kind)


def int4_linear_fwd(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bias: Tensor | None, out: Tensor,
    group_size: int, kind: str, *, config: int | str | None = None,
) -> None:  # fmt: skip
    """triton.int4_linear_fwd's contract. `config` (tests, benchmarks): an int forces the GEMV
    with that many rows of W per CTA, "mma" the tensor-core kernel, "persistent..." the
    persistent GEMV (persistent_config), "mma-persistent..." the persistent tensor-core kernel
    (mma_persistent_config), "tc..." the tensor-core GEMV with W as the A operand (tc_config),
    "tcr..." the same fed by a ring of bulk copies (tcr_config)."""
    args = (x, qweight, scales, zeros, bias, out, group_size, kind)
    tiled = qweight.dim() == 3
    if tiled:  # format.tile_codes: only the tensor-core GEMV reads them, so nothing to fall back to
        if config is None and x.is_cuda:
            config = tiled_config(
                x.shape[0], _n_of(qweight), x.shape[1], group_size, _arch(x.device),
                scales_in_x_dtype=scales.dtype == x.dtype, kind=kind,
            )  # fmt: skip
        why = unsupported_call(*args, config) or ("the CUDA library is unavailable" if _broken else None)
        if why is not None:
            raise ValueError(f"int4_linear_fwd: {why}")
    if config is None and x.is_cuda:  # the tensor-core GEMV where it measured fastest, else on
        config = default_config(
            x.shape[0], qweight.shape[0], x.shape[1], group_size, _arch(x.device),
            scales_in_x_dtype=scales.dtype == x.dtype, kind=kind,
        )  # fmt: skip
        if config is None or unsupported_call(*args, config) is not None:
            if "gemv" not in dispatch.forced_names(_OP):
                return _hand_on(args)
            config = None  # forced by name: the GEMV (one row) or the one-round MMA kernel
    if (_broken and x.is_cuda) or unsupported_call(*args, config) is not None:
        return _triton(*args)
    m, k = x.shape
    lib = _load(x.device, tc=_path(m, config) in ("tc", "tcr"), nf4=kind == "nf4")
    if lib is None:
        if tiled:
            raise ValueError("int4_linear_fwd: tiled codes and the CUDA library could not be built")
        return _triton(*args)
    n = _n_of(qweight)
    code = _kind(kind, zeros)
    device = x.device.index if x.is_cuda else -1
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
    bias_ptr = 0 if bias is None else bias.data_ptr()
    bias_code = 0 if bias is None else _BIAS_CODES[bias.dtype]
    zeros_ptr = 0 if zeros is None else zeros.data_ptr()
    if _path(m, config) == "mma":
        status = lib.ok_int4_mma(
            device, _CODES[x.dtype], _CODES[scales.dtype], code, x.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
            zeros_ptr, bias_ptr, bias_code, out.data_ptr(), m, n, k, x.stride(0), qweight.stride(0),
            scales.stride(0), out.stride(0), group_size, stream,
        )  # fmt: skip
    elif _path(m, config) == "tc":
        p = tc_config(config)
        status = lib.ok_int4_tc(
            device, _CODES[x.dtype], _CODES[scales.dtype], p.tiles, p.unroll, p.splits, int(p.pdl),
            int(tiled), p.xtiles, 0, x.data_ptr(),
            qweight.data_ptr(), scales.data_ptr(), zeros_ptr, bias_ptr, bias_code, out.data_ptr(), m, n, k,
            x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), group_size, 0, 0.0, 0.0, stream,
        )  # fmt: skip
    elif _path(m, config) == "tcr":
        p = tcr_config(config)
        status = lib.ok_int4_tc_ring(
            device, _CODES[x.dtype], _CODES[scales.dtype], p.tiles, p.stages, x.data_ptr(), qweight.data_ptr(),
            scales.data_ptr(), zeros_ptr, bias_ptr, bias_code, out.data_ptr(), m, n, k, x.stride(0),
            qweight.stride(0), scales.stride(0), out.stride(0), group_size, stream,
        )  # fmt: skip
    elif _path(m, config) == "mma-persistent":
        p = mma_persistent_config(config)
        grid = p.grid_for(n // p.cols, _sm_count(device) if x.is_cuda else _EMULATED_SMS)
        status = lib.ok_int4_mma_persistent(
            device, _CODES[x.dtype], _CODES[scales.dtype], code, p.cols, p.depth, x.data_ptr(), qweight.data_ptr(),
            scales.data_ptr(), zeros_ptr, bias_ptr, bias_code, out.data_ptr(), m, n, k, x.stride(0),
            qweight.stride(0), scales.stride(0), out.stride(0), group_size, grid, stream,
        )  # fmt: skip
    elif _path(m, config) == "persistent":
        p = persistent_config(config)
        grid = p.grid_for(n // p.rows, _sm_count(device) if x.is_cuda else _EMULATED_SMS)
        lut = nf4_values(x.device) if code == _KINDS["nf4"] else None
        status = lib.ok_int4_gemv_persistent(
            device, _CODES[x.dtype], _CODES[scales.dtype], p.rows, p.depth, code, x.data_ptr(),
            qweight.data_ptr(), scales.data_ptr(), zeros_ptr, 0 if lut is None else lut.data_ptr(), bias_ptr,
            bias_code, out.data_ptr(), n, k, qweight.stride(0), scales.stride(0), group_size, grid, stream,
        )  # fmt: skip
    else:
        lut = nf4_values(x.device) if code == _KINDS["nf4"] else None
        status = lib.ok_int4_gemv(
            device, _CODES[x.dtype], _CODES[scales.dtype], gemv_rows(n, config), code, x.data_ptr(),
            qweight.data_ptr(), scales.data_ptr(), zeros_ptr, 0 if lut is None else lut.data_ptr(), bias_ptr,
            bias_code, out.data_ptr(), n, k, qweight.stride(0), scales.stride(0), group_size, stream,
        )  # fmt: skip
    _check_status(status, x.is_cuda)
    return None if status == 0 else _triton(*args)


# The prologue builds (int4_tc.cu's PRO): the CTA's x computed into shared memory before the main
# loop, act(gate) * up (gated_value: these activations) or the RMSNorm (normed_prologue: K up to
# NORMED_MAX_K, one round of loads); at most PROLOGUE_MAX_BYTES of it per CTA.
GATED_ACTS = {"silu": 1, "gelu": 2, "gelu_tanh": 3}
NORMED_MAX_K = 8192
PROLOGUE_MAX_BYTES = 64 * 1024
# Whether Int4Linear's gated_fuses / normed_fuses route a decode step's calls to them (takes_gated,
# takes_normed). Off: on an H100 (2026-12-07, `benchmarks/studies/quant_fused_gemv.py`, kernel us
# against the activation's or the norm's kernel plus the GEMV, CUDA graph) the gated GEMV at
# 2048 x 8192 took 9.37 against 8.85 (M = 1) and 13.97 against 9.38 (M = 4), the normed one 5.27
# against 5.58 at 3072 x 2048 and 11.06 against 10.41 at 16384 x 2048 (M = 1), slower again at
# M = 4; the 1B decode step 1.258 ms with them, 1.251 without (docs/perf.md). Forced by name
# (gated_config / normed_config with a config, or this flag) they run and are tested.
PROLOGUES_DEFAULT = False


def gated_config(gate_up: Tensor, qweight: Tensor, scales, zeros, bias, out, group_size: int, kind: str,
                 act: str, config: str | None = None) -> str | None:  # fmt: skip
    """The tensor-core GEMV config that runs down(act(gate) * up) for this call in one launch
    (gate_up (M, 2K): gate in columns [0, K), up in [K, 2K)), or None: the call is composed
    (the activation, then int4_linear). Up to 8 rows, the config int4_linear's default would
    run on the gate half (`config`, for tests and the CPU emulation: that config instead)
    when it is a tensor-core GEMV build without a dependent launch or x split."""
    if act not in GATED_ACTS or kind == "nf4" or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None  # (NF4: no gated build; its split t4-u1 spilled on sm_90)
    if gate_up.stride(1) != 1:
        return None
    if gate_up.is_cuda and _broken:
        return None
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    x = gate_up[:, :k]
    if config is None:
        if not gate_up.is_cuda:
            return None  # the CPU emulation runs only when a test names the config
        pick = tiled_config if qweight.dim() == 3 else default_config
        config = pick(m, _n_of(qweight), k, group_size, _arch(gate_up.device),
                      scales_in_x_dtype=scales.dtype == gate_up.dtype, kind=kind)  # fmt: skip
    tc = tc_config(config)
    if tc is None or tc.pdl or tc.xtiles != 1 or m > TC_SPLIT_MAX_ROWS:
        return None
    span = k if tc.splits == 1 else -(-(k // 128) // tc.splits) * 128  # a CTA's share of K
    if m * span * gate_up.element_size() > PROLOGUE_MAX_BYTES:
        return None
    if unsupported_call(x, qweight, scales, zeros, bias, out, group_size, kind, config) is not None:
        return None
    return config


def takes_gated(
    gate_up: Tensor, qweight: Tensor, scales, zeros, bias, group_size: int, kind: str, act: str
) -> bool:
    """Whether int4_linear_gated_fwd runs this call (gate_up (M, 2K) on the GPU) in one launch and
    the default route sends it there (PROLOGUES_DEFAULT)."""
    if not PROLOGUES_DEFAULT:
        return False
    return gated_config(gate_up, qweight, scales, zeros, bias, _CONTIGUOUS, group_size, kind, act) is not None


def int4_linear_gated_fwd(
    gate_up: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, bias: Tensor | None, out: Tensor,
    group_size: int, kind: str, act: str, *, config: str | None = None,
) -> None:  # fmt: skip
    """out (M, N) = (act(gate) * up) @ W^T + bias, gate_up (M, 2K) (the gated op's contract:
    reference.int4_linear_gated_fwd): one launch of the tensor-core GEMV's gated build where
    gated_config names one, else composed (fused.int4_linear_gated_fwd)."""
    from ..fused import int4_linear_gated_fwd as composed

    chosen = gated_config(gate_up, qweight, scales, zeros, bias, out, group_size, kind, act, config)
    lib = None if chosen is None else _load(gate_up.device, tc=True, nf4=kind == "nf4")
    if lib is None:
        return composed(gate_up, qweight, scales, zeros, bias, out, group_size, kind, act)
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    p = tc_config(chosen)
    status = lib.ok_int4_tc(
        gate_up.device.index if gate_up.is_cuda else -1, _CODES[gate_up.dtype], _CODES[scales.dtype], p.tiles,
        p.unroll, p.splits, 0, int(qweight.dim() == 3), 1, GATED_ACTS[act], gate_up.data_ptr(), qweight.data_ptr(),
        scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), 0 if bias is None else bias.data_ptr(),
        0 if bias is None else _BIAS_CODES[bias.dtype], out.data_ptr(), m, _n_of(qweight), k, gate_up.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), group_size, 0, 0.0, 0.0,
        torch.cuda.current_stream(gate_up.device).cuda_stream if gate_up.is_cuda else 0,
    )  # fmt: skip
    _check_status(status, gate_up.is_cuda)
    return (
        None if status == 0 else composed(gate_up, qweight, scales, zeros, bias, out, group_size, kind, act)
    )


def normed_config(x: Tensor, norm_weight: Tensor, qweight: Tensor, scales, zeros, bias, out, group_size: int,
                  kind: str, config: str | None = None) -> str | None:  # fmt: skip
    """The tensor-core GEMV config that runs forward(RMSNorm(x)) for this call in one launch (x
    (M, K), norm_weight (K,) in x's dtype, contiguous and 16-byte aligned), or None: the call is
    composed (the norm, then int4_linear). Up to 8 rows, int4, the config int4_linear's default
    would run (`config`: that one instead, for tests and the CPU emulation) when it is a
    tensor-core GEMV build with K unsplit, no dependent launch and no x split."""
    if kind == "nf4" or x.dim() != 2 or x.stride(1) != 1:
        return None
    if (
        norm_weight.dim() != 1
        or norm_weight.shape[0] != x.shape[1]
        or norm_weight.dtype != x.dtype
        or norm_weight.device != x.device
        or norm_weight.stride(0) != 1
        or norm_weight.data_ptr() % 16
    ):
        return None
    if x.is_cuda and _broken:
        return None
    m, k = x.shape
    if config is None:
        if not x.is_cuda:
            return None  # the CPU emulation runs only when a test names the config
        pick = tiled_config if qweight.dim() == 3 else default_config
        config = pick(m, _n_of(qweight), k, group_size, _arch(x.device), scales_in_x_dtype=scales.dtype == x.dtype,
                      kind=kind)  # fmt: skip
    tc = tc_config(config)
    if tc is None or tc.pdl or tc.xtiles != 1 or tc.splits > 1 or m > TC_SPLIT_MAX_ROWS:
        return None
    if k > NORMED_MAX_K or m * k * x.element_size() > PROLOGUE_MAX_BYTES:
        return None
    if unsupported_call(x, qweight, scales, zeros, bias, out, group_size, kind, config) is not None:
        return None
    return config


def takes_normed(x: Tensor, norm_weight: Tensor, qweight: Tensor, scales, zeros, bias, group_size: int,
                 kind: str) -> bool:  # fmt: skip
    """Whether int4_linear_normed_fwd runs this call (x (M, K) on the GPU) in one launch and the
    default route sends it there (PROLOGUES_DEFAULT)."""
    if not PROLOGUES_DEFAULT:
        return False
    return (
        normed_config(x, norm_weight, qweight, scales, zeros, bias, _CONTIGUOUS, group_size, kind) is not None
    )


def int4_linear_normed_fwd(
    x: Tensor, norm_weight: Tensor, eps: float, weight_offset: float, qweight: Tensor, scales: Tensor,
    zeros: Tensor | None, bias: Tensor | None, out: Tensor, group_size: int, kind: str, *, config: str | None = None,
) -> None:  # fmt: skip
    """out (M, N) = RMSNorm(x) @ W^T + bias (the normed op's contract:
    reference.int4_linear_normed_fwd): one launch of the tensor-core GEMV's normed build where
    normed_config names one, else composed (fused.int4_linear_normed_fwd)."""
    from ..fused import int4_linear_normed_fwd as composed

    args = (x, norm_weight, eps, weight_offset, qweight, scales, zeros, bias, out, group_size, kind)
    chosen = normed_config(x, norm_weight, qweight, scales, zeros, bias, out, group_size, kind, config)
    lib = None if chosen is None else _load(x.device, tc=True)
    if lib is None:
        return composed(*args)
    m, k = x.shape
    p = tc_config(chosen)
    status = lib.ok_int4_tc(
        x.device.index if x.is_cuda else -1, _CODES[x.dtype], _CODES[scales.dtype], p.tiles, p.unroll, 1, 0,
        int(qweight.dim() == 3), 1, 4, x.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
        0 if zeros is None else zeros.data_ptr(), 0 if bias is None else bias.data_ptr(),
        0 if bias is None else _BIAS_CODES[bias.dtype], out.data_ptr(), m, _n_of(qweight), k, x.stride(0),
        qweight.stride(0), scales.stride(0), out.stride(0), group_size, norm_weight.data_ptr(), float(eps),
        float(weight_offset), torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0,
    )  # fmt: skip
    _check_status(status, x.is_cuda)
    return None if status == 0 else composed(*args)


def _route(x, qweight, scales, zeros, bias, out, group_size, kind, *, config=None) -> str | None:
    """For dispatch.explain: where an unforced call with these arguments goes (None: the
    GEMV / MMA path it would take anyway, CPU tensors, explicit configs)."""
    if config is not None or not x.is_cuda:
        return None
    args = (x, qweight, scales, zeros, bias, out, group_size, kind)
    m, k = x.shape
    n = _n_of(qweight)
    config = default_config(
        m, n, k, group_size, _arch(x.device), scales_in_x_dtype=scales.dtype == x.dtype, kind=kind
    )
    if config is not None and unsupported_call(*args, config) is None:
        return (
            f"the tensor-core GEMV ({config})"
            if config.startswith("tc")
            else "the one-round tensor-core kernel"
        )
    if "gemv" in dispatch.forced_names(_OP):
        return None
    chosen = [impl.name for impl in dispatch.select(_OP, dispatch.key_for(x, kind))]
    after = chosen[chosen.index("gemv") + 1 :] if "gemv" in chosen else []
    target = after[0] if after else "triton"
    return (
        f"handed on to {target!r} (the tensor-core GEMV runs M <= {TC_MAX_ROWS} on sm_90 where K >= 2048;"
        f" this is M = {m}, N x K = {n} x {k})"
    )


int4_linear_fwd.route = _route  # type: ignore[attr-defined]
