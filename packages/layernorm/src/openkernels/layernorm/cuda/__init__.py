"""CUDA C++ backend of the layernorm family on Hopper: a row split over a thread-block
cluster, the row's partial sums exchanged through distributed shared memory.

Dispatch name "push" (norm_push.cu, the forward only, above Triton's priority): the pushed
kernel for the rows it measured faster on (push_config), every other call to Triton. Dispatch
name "cluster" (norm_cluster.cu, forward and backward, below Triton's priority): runs only
when forced (`dispatch.force("cluster")`); slower than Triton where measured. Same entry
points as triton.norm_fwd / norm_bwd; a call they do not take (dtypes other than one 16-bit
or float32 row dtype with a weight of that dtype or float32, rows not a whole number of
16-byte vectors, misaligned rows or parameters, rows longer than 16 CTAs hold: 1048576 bf16
columns forward, 131072 backward) goes to the Triton launcher, which takes every call. Each
library is built with nvcc on first use (openkernels.shared.cuda_build); if that fails the
Triton kernels run, with one warning.
CPU tensors run the same source built for the CPU emulation (cuda_build.load_emulated): how
the tests check the kernels without a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import warnings
from typing import NamedTuple

import torch

from openkernels.shared import cuda_build
from openkernels.shared.dispatch import DispatchKey

__all__ = [
    "BWD_SHAPES",
    "BWD_STAGED_SHAPES",
    "ClusterConfig",
    "SHAPES",
    "SHORT_SHAPES",
    "PUSH_SHAPES",
    "cluster_config",
    "push_config",
    "push_norm_fwd",
    "wide_clusters_fit",
    "push_supports",
    "staged_bytes",
    "use_staged",
    "norm_bwd",
    "norm_fwd",
    "supports",
    "unsupported_bwd_call",
    "unsupported_call",
]

_SOURCE = pathlib.Path(__file__).with_name("norm_cluster.cu")
ARCH = "sm_90a"  # clusters and distributed shared memory: Hopper's; machine code for sm_90 only
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "ok_norm_fwd_cluster": [_I32, _I32, _I32, _I32, _I32, _I32, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64,
                            _I64, _I64, _I64, _F64, _F64, _I32, _I64],
    "ok_norm_bwd_cluster": [_I32, _I32, _I32, _I32, _I32, _I32, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I64,
                            _I64, _I64, _I64, _I64, _I64, _I64, _F64, _I32, _I64],
}  # fmt: skip
_library = cuda_build.CudaLibrary(
    _SOURCE, name="openkernels_layernorm_cuda", arch=ARCH, signatures=_SIGNATURES
)
# The pushed forward (norm_push.cu): its own library, so that the default path's first call
# builds only its few kernels; ok_norm_fwd_cluster's arguments.
_PUSH_SOURCE = pathlib.Path(__file__).with_name("norm_push.cu")
# norm_push.cu's build macros: OK_PUSH_TRIM (bfloat16 pairs by a shift and a mask, no add of a
# zero weight_offset, weight and bias in one FMA, LayerNorm's statistics in one pass) and
# OK_PUSH_BULK (each CTA's chunk staged by one TMA bulk copy per tensor instead of a cp.async
# per 16 bytes). Both are on in the default build since layernorm 0.11.1: on an H100 they took
# LayerNorm from 0.76-0.82 to 0.79-0.87 of copy and left RMSNorm and add_rms_norm where they
# were (docs/perf.md). OK_PUSH_MERGE (layernorm 0.11.8): LayerNorm's per-warp parts merged by
# sums where they share one count (full rows), else with one fast division per pairwise merge
# instead of two IEEE ones: the merge runs between the exchange and the normalize pass.
# OK_PUSH_WLOAD=3 with OK_PUSH_BY_OP (layernorm 0.11.11): RMSNorm calls run an instance of their
# own that loads the weight into registers while the chunk lands (the build before loaded each
# vector's weight inside the normalize loop, behind the previous vector's bounds branch: one L2
# round trip per vector); H200, kernel time: RMSNorm 0.82-0.83 -> 0.85 of copy at 32768-65536
# columns, add_rms_norm unchanged, LayerNorm's instance as before (docs/perf.md).
# OK_PUSH_CENTER_FMA (layernorm 0.11.14): LayerNorm's (h - mean) * rstd as one FMA per element,
# h * rstd - mean * rstd; H100, kernel time: LayerNorm 0-1.5% faster at every routed shape,
# RMSNorm unchanged (docs/perf.md, thirtieth session).
_MERGE_FLAGS = ("-DOK_PUSH_TRIM", "-DOK_PUSH_BULK", "-DOK_PUSH_MERGE")
_W3R_FLAGS = (*_MERGE_FLAGS, "-DOK_PUSH_WLOAD=3", "-DOK_PUSH_BY_OP")
PUSH_DEFAULT_FLAGS: tuple[str, ...] = (*_W3R_FLAGS, "-DOK_PUSH_CENTER_FMA")
# ok_norm_fwd_push_clusters(device, dtype code, weight code, threads, vpt, cluster, flags): how
# many such clusters the device holds at once (asked before a non-portable cluster is routed).
_PUSH_QUERIES = {"ok_norm_fwd_push_clusters": [_I32] * 7}
_push_library = cuda_build.CudaLibrary(
    _PUSH_SOURCE, name="openkernels_layernorm_push", arch=ARCH,
    signatures={"ok_norm_fwd_push": _SIGNATURES["ok_norm_fwd_cluster"]}, extra_flags=PUSH_DEFAULT_FLAGS,
    queries=_PUSH_QUERIES,
)  # fmt: skip
# Other builds of it, for studies and tests (norm_fwd(..., push=<name>)): "plain" (no macro:
# the default until layernorm 0.11.0), "trim" and "bulk" (one each), "lean" (both: the default
# of layernorm 0.11.1-0.11.7), "merge" (the default of layernorm 0.11.8-0.11.10: each vector's
# weight and bias loaded inside the normalize loop). Where those loads are issued (layernorm
# 0.11.11's study, on merge): "g2" / "g4" (OK_PUSH_WGROUP: that many vectors' loads together),
# "w2" / "w3" (OK_PUSH_WLOAD: every vector's into registers before the exchange / while the
# chunk lands, in the one instance every op runs), "pf" (their lines asked into L1 before the
# exchange, no registers held), "w2r" / "w3r" (as w2 / w3 in an RMSNorm instance of its own;
# w3r is the default of layernorm 0.11.11-0.11.13). "sp" (layernorm 0.11.12's study, on w3r):
# LayerNorm calls without a residual stage the chunk's weight and bias in shared memory by bulk
# copies beside x; "sp2" RMSNorm calls without a residual too (their weight staged instead of
# held in registers): both slower on an H100 (LayerNorm up to 1.8x, sp2's RMSNorm up to 1.5x; docs/
# perf.md). "cf" (layernorm 0.11.13's study): LayerNorm's centring as one FMA per element, the
# default's flags since 0.11.14; "spf" that on "sp".
PUSH_VARIANTS: dict[str, tuple[str, ...]] = {
    "plain": (), "trim": ("-DOK_PUSH_TRIM",), "bulk": ("-DOK_PUSH_BULK",), "lean": ("-DOK_PUSH_TRIM", "-DOK_PUSH_BULK"),
    "merge": _MERGE_FLAGS,
    "g2": (*_MERGE_FLAGS, "-DOK_PUSH_WGROUP=2"), "g4": (*_MERGE_FLAGS, "-DOK_PUSH_WGROUP=4"),
    "w2": (*_MERGE_FLAGS, "-DOK_PUSH_WLOAD=2"), "w3": (*_MERGE_FLAGS, "-DOK_PUSH_WLOAD=3"),
    "pf": (*_MERGE_FLAGS, "-DOK_PUSH_WLOAD=4"),
    "w2r": (*_MERGE_FLAGS, "-DOK_PUSH_WLOAD=2", "-DOK_PUSH_BY_OP"), "w3r": _W3R_FLAGS,
    "sp": (*_W3R_FLAGS, "-DOK_PUSH_SMEM_PARAMS=1"), "sp2": (*_W3R_FLAGS, "-DOK_PUSH_SMEM_PARAMS=2"),
    "cf": PUSH_DEFAULT_FLAGS, "spf": (*_W3R_FLAGS, "-DOK_PUSH_SMEM_PARAMS=1", "-DOK_PUSH_CENTER_FMA"),
}  # fmt: skip
_push_variants: dict[str, cuda_build.CudaLibrary] = {}


def push_variant_library(variant: str) -> cuda_build.CudaLibrary:
    """norm_push.cu built with PUSH_VARIANTS[variant]'s flags (built on first use)."""
    if variant not in PUSH_VARIANTS:
        raise ValueError(f"pushed forward variant {variant!r}: one of {sorted(PUSH_VARIANTS)}")
    if variant not in _push_variants:
        _push_variants[variant] = cuda_build.CudaLibrary(
            _PUSH_SOURCE, name=f"openkernels_layernorm_push_{variant}", arch=ARCH,
            signatures=_push_library.signatures, extra_flags=PUSH_VARIANTS[variant], queries=_PUSH_QUERIES,
        )  # fmt: skip
    return _push_variants[variant]


# (threads per CTA, 16-byte vectors per thread) of the forward, for rows split over a
# cluster: from the narrowest chunk (bf16: 8192 columns per CTA) to the widest (65536).
SHAPES: tuple[tuple[int, int], ...] = ((256, 4), (256, 8), (512, 8), (512, 16))
# Rows of up to 8192 elements take one CTA each (a cluster of 1: no exchange), the narrowest
# chunk that holds them: these two, then (256, 4).
SHORT_SHAPES: tuple[tuple[int, int], ...] = ((128, 2), (256, 2))
_ONE_CTA_MAX = 8192
# The backward holds dy, h and two float32 sums per element: 2 vectors per thread (bf16: 4096
# and 8192 columns per CTA), at most 128 registers, so 65536 // (128 * threads) CTAs per SM.
BWD_SHAPES: tuple[tuple[int, int], ...] = ((256, 2), (512, 2))
# The staged backward (dy and h in shared memory, two rows deep; only the float32 sums in
# registers) also takes 4 vectors per thread: up to 262144 bf16 columns.
BWD_STAGED_SHAPES: tuple[tuple[int, int], ...] = ((256, 2), (512, 2), (256, 4), (512, 4))
# The pushed forward's shapes (norm_push.cu): those push_config picks, bf16 / fp16 chunks of
# 8192, 16384 and 32768 columns.
PUSH_SHAPES: tuple[tuple[int, int], ...] = ((256, 4), (256, 8), (512, 8))
PUSH_DTYPES = (torch.bfloat16, torch.float16)
_BWD_REGISTERS = 128  # the most any backward kernel takes (ptxas, sm_90a): sets CTAs per SM
PORTABLE_CLUSTER = 8  # any sm_90 part schedules 8 CTAs per cluster
MAX_CLUSTER = 16  # the non-portable limit (the launcher opts in per kernel)
_FLAGS = {"rms": 1, "residual": 2, "store_residual": 4, "weight": 8, "bias": 16, "staged": 256}
MAX_STAGED_BYTES = 227 * 1024  # sm_90's dynamic shared memory per CTA
_BWD_FLAGS = {"rms": 1, "weight": 8, "dh_out": 32, "weight_grad": 64, "bias_grad": 128, "staged": 256}


class ClusterConfig(NamedTuple):
    threads: int
    vectors_per_thread: int
    cluster: int


def _vector(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector."""
    return 16 // dtype.itemsize


def cluster_config(
    n_cols: int, dtype: torch.dtype, shape: tuple[int, int] | None = None, shapes: tuple = SHAPES
) -> ClusterConfig | None:
    """The forward's (shapes=SHAPES) launch shape for rows of n_cols: rows of up to 8192
    elements one CTA each, the narrowest chunk of SHORT_SHAPES + SHAPES that holds them; longer
    rows the narrowest chunk of `shapes` whose cluster stays portable (<= 8 CTAs), else the
    narrowest within 16; None past 16 of the widest chunks. The backward (BWD_SHAPES) takes
    the cluster rule alone. `shape` forces (threads, vectors per thread) (tests); None then if
    the row needs more than 16 such chunks."""
    vec = _vector(dtype)
    if shape is None and shapes is SHAPES and n_cols <= _ONE_CTA_MAX:
        for threads, vpt in (*SHORT_SHAPES, *SHAPES):
            if n_cols <= threads * vpt * vec <= _ONE_CTA_MAX:
                return ClusterConfig(threads, vpt, 1)
    candidates = [shape] if shape is not None else list(shapes)
    for limit in (PORTABLE_CLUSTER, MAX_CLUSTER):
        for threads, vpt in candidates:
            cluster = -(-n_cols // (threads * vpt * vec))
            if cluster <= limit:
                return ClusterConfig(threads, vpt, cluster)
    return None


def push_config(n_cols: int, dtype: torch.dtype, residual: bool, wide: bool = False) -> ClusterConfig | None:
    """The pushed forward's launch where it measured faster than the Triton kernels, else
    None. H200, bf16, kernel time as a fraction of copy (push / Triton; QuACK), 2026-12-05
    (`benchmarks/studies/norm_cluster_variants.py`, docs/perf.md):
      RMSNorm   32768 0.82 / 0.69, 65536 0.81 / 0.69, 131072 0.79 / 0.68, 262144 0.75 / 0.66
      LayerNorm 32768 0.70 / 0.58, 65536 0.69 / 0.56, 131072 0.68 / 0.57, 262144 0.62 / 0.56
      with a residual (add_rms_norm) 32768 0.88 / 0.86, 65536 0.88 / 0.80; 131072 only with a
      cluster of 16 (0.84 / 0.82), 262144 0.69 / 0.82 (Triton), 1048576 and 16384 Triton.
    So rows of 32768-262144 columns (16384 per CTA, 32768 past 131072: clusters of 2-8, all
    portable), with a residual 32768-65536 (8192 per CTA: clusters of 4-8); 16-bit dtypes.

    `wide` (where the device schedules clusters of 9-16 CTAs: wide_clusters_fit; RMSNorm calls,
    and LayerNorm calls without a residual) also takes non-portable clusters where they
    measured faster (H200, layernorm 0.11.11's RMSNorm instance, 2026-12-07): RMSNorm 262144
    on 16 CTAs of 16384 columns 0.83 (0.78 on 8 of 32768), add_rms_norm 262144 on 16 of 16384
    0.86 (Triton 0.82) and 131072 on 16 of 8192 (0.84 / 0.82, 2026-12-05). H100, layernorm
    0.11.13 (thirtieth session): LayerNorm 262144 on 16 of 16384 0.81 (0.79 on 8 of 32768);
    524288 on 16 of 32768 RMSNorm 0.84, LayerNorm 0.74 (Triton 0.77 / 0.67). So past 131072
    columns 16384 per CTA, past 262144 32768 per CTA up to 524288; with a residual 8192 per
    CTA up to 131072, 16384 per CTA up to 262144."""
    if dtype not in PUSH_DTYPES:
        return None
    vec = _vector(dtype)
    if residual:
        shape = (
            (256, 4) if 32768 <= n_cols <= 65536 or (wide and 65536 < n_cols <= 131072)
            else (256, 8) if wide and 131072 < n_cols <= 262144 else None
        )  # fmt: skip
    elif 32768 <= n_cols <= 131072:
        shape = (256, 8)
    elif 131072 < n_cols <= 262144:
        shape = (256, 8) if wide else (512, 8)
    else:
        shape = (512, 8) if wide and 262144 < n_cols <= 524288 else None
    if shape is None:
        return None
    return ClusterConfig(*shape, -(-n_cols // (shape[0] * shape[1] * vec)))


# (device index: get_device(), -1 on the CPU; dtype, weight dtype, config, residual, RMSNorm
# instance) -> whether the device schedules that instance's non-portable cluster (asked once each:
# cudaOccupancyMaxActiveClusters). Keyed by the index, not x.device: building a torch.device per
# call cost more than the rest of the lookup.
_wide_fits: dict[tuple, bool] = {}
# Device indices that refused a non-portable launch the query had allowed: portable from then on.
_wide_refused: set[int] = set()


def wide_clusters_fit(
    x: torch.Tensor, weight: torch.Tensor | None, cfg: ClusterConfig, residual: bool, rms_only: bool = True
) -> bool:
    """Whether x's device can run the pushed forward on clusters of cfg.cluster CTAs (past 8,
    the portable size, a part may not: Hopper's GPCs differ in free SMs), in the RMSNorm
    instance (`rms_only`: RMSNorm without a bias) or the other one. Asked of the device once per
    (device, dtypes, shape, residual, instance); False where the library cannot load or the
    device answers 0 or an error (the portable launch runs then)."""
    device = x.get_device()
    if device in _wide_refused:
        return False
    key = (device, x.dtype, None if weight is None else weight.dtype, cfg, residual, rms_only)
    fits = _wide_fits.get(key)
    if fits is None:
        lib = _load(x.device, True)
        flags = (
            _FLAGS["rms"] * rms_only + _FLAGS["residual"] * residual + _FLAGS["weight"] * (weight is not None)
        )
        count = -1 if lib is None else lib.ok_norm_fwd_push_clusters(
            _device_index(x), _CODES[x.dtype], 0 if weight is None else _CODES[weight.dtype], cfg.threads,
            cfg.vectors_per_thread, cfg.cluster, flags,
        )  # fmt: skip
        fits = _wide_fits[key] = count > 0
    return fits


def push_supports(key: DispatchKey) -> str | None:
    """Dispatch predicate of the pushed forward (the default on sm_90 where push_config says)."""
    if key.backend != "cuda" or key.arch != "sm_90":
        return f"thread-block clusters are built for sm_90 (this is {key.backend}/{key.arch})"
    if key.dtype not in PUSH_DTYPES:
        return f"dtype {key.dtype}: the pushed forward takes bfloat16 and float16"
    return cuda_build.no_nvcc_reason()


def staged_bytes(cfg: ClusterConfig, residual: bool) -> int:
    """Dynamic shared memory of the staged forward: the x chunk (and the residual's)."""
    return cfg.threads * cfg.vectors_per_thread * 16 * (2 if residual else 1)


def use_staged(cfg: ClusterConfig, residual: bool, staged: bool | None = None) -> bool:
    """Whether the forward holds its chunk in shared memory (cp.async; few registers, so more
    CTAs per SM) rather than in registers: `staged` if given, else whenever it fits."""
    fits = staged_bytes(cfg, residual) <= MAX_STAGED_BYTES
    if staged and not fits:
        raise ValueError(
            f"{cfg}: the staged chunk needs {staged_bytes(cfg, residual)} bytes of shared memory"
        )
    return fits if staged is None else staged


def supports(key: DispatchKey) -> str | None:
    """Dispatch predicate: None when these kernels can run `key`, else why not."""
    if key.backend != "cuda" or key.arch != "sm_90":
        return f"thread-block clusters are built for sm_90 (this is {key.backend}/{key.arch})"
    if key.dtype not in _CODES:
        return f"dtype {key.dtype}: the cluster kernels take float32, bfloat16 and float16"
    return cuda_build.no_nvcc_reason()


def _aligned(t: torch.Tensor, row_stride: bool = True) -> bool:
    return t.data_ptr() % 16 == 0 and (not row_stride or t.stride(0) * t.element_size() % 16 == 0)


def unsupported_call(x, residual, weight, bias, out, residual_out, mean, rstd, h_dtype) -> str | None:
    """Why this call goes to the Triton kernels instead (None: the cluster kernel takes it)."""
    n_rows, n_cols = x.shape
    if x.dtype not in _CODES:
        return f"dtype {x.dtype}"
    if h_dtype != x.dtype or out.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return "x, residual, output and residual stream of different dtypes"
    params = [t for t in (weight, bias) if t is not None]
    if params and (
        params[0].dtype not in (x.dtype, torch.float32) or any(t.dtype != params[0].dtype for t in params)
    ):
        return "a weight or bias dtype other than x's or float32 (or the two differ)"
    if rstd.dtype != torch.float32:
        return "statistics other than float32"
    vec = _vector(x.dtype)
    if n_cols % vec:
        return f"rows of {n_cols} columns: not a whole number of 16-byte vectors"
    rows = [t for t in (x, residual, out, residual_out) if t is not None]
    if not all(_aligned(t) for t in rows):
        return "a row start not 16-byte aligned"
    if params and not all(t.data_ptr() % (vec * params[0].element_size()) == 0 for t in params):
        return "a weight or bias not aligned to its vector"
    cfg = cluster_config(n_cols, x.dtype)
    if cfg is None:
        return f"rows of {n_cols} columns: longer than {MAX_CLUSTER} CTAs hold"
    if cfg.cluster * n_rows >= 2**31:
        return "more CTAs than one launch takes"
    return None


def unsupported_bwd_call(dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias) -> str | None:
    """Why this backward goes to the Triton kernels instead (None: the cluster kernel takes it)."""
    n_cols = h.shape[1]
    if h.dtype not in _CODES:
        return f"dtype {h.dtype}"
    if any(t is not None and t.dtype != h.dtype for t in (dy, dh_out, dh)):
        return "dy, h, dh_out and dh of different dtypes"
    if weight is not None and weight.dtype not in (h.dtype, torch.float32):
        return "a weight dtype other than h's or float32"
    if rstd.dtype != torch.float32:
        return "statistics other than float32"
    vec = _vector(h.dtype)
    if n_cols % vec:
        return f"rows of {n_cols} columns: not a whole number of 16-byte vectors"
    if not all(_aligned(t) for t in (dy, h, dh_out, dh) if t is not None):
        return "a row start not 16-byte aligned"
    if weight is not None and weight.data_ptr() % (vec * weight.element_size()):
        return "a weight not aligned to its vector"
    if cluster_config(n_cols, h.dtype, shapes=BWD_STAGED_SHAPES) is None:
        return f"rows of {n_cols} columns: longer than {MAX_CLUSTER} CTAs hold in the backward"
    return None


@functools.cache
def _sm_count(index: int) -> int:
    """SMs of CUDA device `index`; -1 (CPU tensors, the emulation) a few."""
    return torch.cuda.get_device_properties(index).multi_processor_count if index >= 0 else 4


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.is_cuda else -1


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


_broken: list[str] = []  # why the library cannot run (built once per process; warned once)


def _triton_fwd(*args, **kwargs) -> None:
    from ..triton import norm_fwd as triton_norm_fwd

    triton_norm_fwd(*args, **kwargs)


def _triton_bwd(*args, **kwargs) -> None:
    from ..triton import norm_bwd as triton_norm_bwd

    triton_norm_bwd(*args, **kwargs)


def _load(device: torch.device, push: bool | str = False) -> object | None:
    """The library for `device` (`push`: norm_push.cu's; a name of PUSH_VARIANTS: that
    variant's), or None (warned once) when it cannot be built or loaded. CPU tensors (tests
    without a GPU) take the kernels built for the CPU emulation."""
    library = push_variant_library(push) if isinstance(push, str) else _push_library if push else _library
    if device.type == "cpu":
        return library.emulated()
    if _broken:
        return None
    try:
        return library()
    except cuda_build.CudaBuildError as error:
        _broken.append(str(error))
        warnings.warn(
            f"openkernels.layernorm: the cluster kernels are off: {error}", RuntimeWarning, stacklevel=3
        )
        return None


def _launch_failed(status: int, what: str, on_gpu: bool) -> None:
    # A launch the GPU refused (say, a cluster it cannot schedule): nothing ran.
    if not on_gpu:
        raise RuntimeError(f"the emulated cluster kernel refused a launch ({what}, status {status})")
    _broken.append(f"{what}: launch status {status}")
    warnings.warn(
        f"openkernels.layernorm: the cluster kernel's launch failed ({what}, status {status}); the Triton "
        "kernels run from now on",
        RuntimeWarning,
        stacklevel=3,
    )


def norm_fwd(
    x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset, rms, h_dtype, config=None,
    staged=None, push: bool | str = False, routed: bool = False,
) -> None:  # fmt: skip
    """triton.norm_fwd's contract. `config`: (threads, vectors per thread) forced, `staged`: the
    chunk in shared memory (True) or registers (False) forced, `push`: the pushed kernel
    (norm_push.cu: staged chunk, statistics sent to every CTA by st.async; a shape of
    PUSH_SHAPES), or a name of PUSH_VARIANTS: that variant of it (tests, benchmarks).
    `routed` (push_norm_fwd's calls): a refused non-portable launch sends this device's later
    calls to portable launches, and this one through that route, instead of turning the
    cluster kernels off."""
    args = (x, residual, weight, bias, out, residual_out, mean, rstd)
    kwargs = dict(eps=eps, weight_offset=weight_offset, rms=rms, h_dtype=h_dtype)
    if (_broken and x.is_cuda) or unsupported_call(*args, h_dtype) is not None:
        return _triton_fwd(*args, **kwargs)
    cfg = cluster_config(x.shape[1], x.dtype, config, PUSH_SHAPES if push else SHAPES)
    if cfg is None:
        raise ValueError(f"config {config}: a row of {x.shape[1]} columns needs more than {MAX_CLUSTER} CTAs")
    if push and (
        (cfg.threads, cfg.vectors_per_thread) not in PUSH_SHAPES
        or not use_staged(cfg, residual is not None, True)
    ):
        raise ValueError(f"{cfg}: the pushed forward is built for the shapes {PUSH_SHAPES}")
    lib = _load(x.device, push)
    if lib is None:
        return _triton_fwd(*args, **kwargs)
    flags = (
        _FLAGS["rms"] * rms + _FLAGS["residual"] * (residual is not None)
        + _FLAGS["store_residual"] * (residual_out is not None) + _FLAGS["weight"] * (weight is not None)
        + _FLAGS["bias"] * (bias is not None)
        + (0 if push else _FLAGS["staged"] * use_staged(cfg, residual is not None, staged))
    )  # fmt: skip
    params = weight if weight is not None else bias
    entry = lib.ok_norm_fwd_push if push else lib.ok_norm_fwd_cluster
    status = entry(
        _device_index(x), _CODES[x.dtype], 0 if params is None else _CODES[params.dtype], cfg.threads,
        cfg.vectors_per_thread, cfg.cluster, x.shape[0], x.data_ptr(),
        0 if residual is None else residual.data_ptr(), 0 if weight is None else weight.data_ptr(),
        0 if bias is None else bias.data_ptr(), out.data_ptr(),
        0 if residual_out is None else residual_out.data_ptr(), 0 if mean is None else mean.data_ptr(),
        rstd.data_ptr(), x.shape[1], x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0), eps, weight_offset, flags,
        _stream(x),
    )  # fmt: skip
    if status != 0:
        if routed and cfg.cluster > PORTABLE_CLUSTER and x.get_device() not in _wide_refused:
            _wide_refused.add(x.get_device())
            warnings.warn(
                f"openkernels.layernorm: {x.device} refused a cluster of {cfg.cluster} CTAs that it had said it "
                f"schedules (status {status}); the pushed forward takes portable clusters there from now on",
                RuntimeWarning,
                stacklevel=3,
            )
            return push_norm_fwd(*args, **kwargs)
        _launch_failed(status, f"{'pushed ' if push else ''}forward {cfg}", x.is_cuda)
        return _triton_fwd(*args, **kwargs)
    return None


def push_norm_fwd(
    x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset, rms, h_dtype
) -> None:  # fmt: skip
    """The default forward on sm_90 (dispatch name "push", above Triton): the pushed kernel
    where push_config says it measured faster, every other call to the Triton launcher
    (norm_fwd also sends there the calls the kernel cannot take: dtypes, alignment)."""
    args = (x, residual, weight, bias, out, residual_out, mean, rstd)
    kwargs = dict(eps=eps, weight_offset=weight_offset, rms=rms, h_dtype=h_dtype)
    cfg = _push_route(x, residual is not None, weight, rms and bias is None)
    if cfg is None:
        return _triton_fwd(*args, **kwargs)
    return norm_fwd(*args, **kwargs, config=(cfg.threads, cfg.vectors_per_thread), push=True, routed=True)


def _push_route(
    x: torch.Tensor, residual: bool, weight: torch.Tensor | None, rms_only: bool
) -> ClusterConfig | None:
    """push_config for this call: non-portable clusters for RMSNorm calls (no bias) and calls
    without a residual where the device schedules them, else the portable launch."""
    n_cols, dtype = x.shape[-1], x.dtype
    cfg = push_config(n_cols, dtype, residual, wide=rms_only or not residual)
    if (
        cfg is not None and cfg.cluster > PORTABLE_CLUSTER
        and not wide_clusters_fit(x, weight, cfg, residual, rms_only)
    ):  # fmt: skip
        cfg = push_config(n_cols, dtype, residual)
    return cfg


def _explain_push(x, *args, **kwargs) -> str | None:
    """For dispatch.explain (the public call's arguments or the launcher's): where the default
    forward sends a call on rows like x's (the launcher also checks alignment and dtypes). The
    launcher's arguments (x, residual, weight, bias, ..., rms=) name the call exactly; the
    public call's are read as RMSNorm's, a residual only when passed by keyword."""
    if not x.is_cuda:
        return None
    if "rms" in kwargs:  # the launcher's
        residual, weight, bias = (*args, None, None, None)[:3]
        rms_only = kwargs["rms"] and bias is None
    else:
        residual, weight, rms_only = kwargs.get("residual"), None, True
    has_residual = torch.is_tensor(residual)
    cfg = _push_route(x, has_residual, weight, rms_only)
    if cfg is not None:
        wide = " (non-portable: this device schedules them)" if cfg.cluster > PORTABLE_CLUSTER else ""
        if wide and "rms" not in kwargs and has_residual:  # the public call's: LayerNorm's differ
            portable = push_config(x.shape[-1], x.dtype, has_residual)
            wide += "; LayerNorm calls: " + (
                f"clusters of {portable.cluster}" if portable is not None else "handed on to 'triton'"
            )
        return (
            f"the pushed cluster kernel ({cfg.threads} threads x {cfg.vectors_per_thread} vectors,"
            f" clusters of {cfg.cluster}{wide})"
        )
    return (
        "handed on to 'triton' (the pushed kernel runs 32768-262144 columns or to 524288 on clusters of 9-16,"
        " with a residual 32768-65536 or to 262144 on clusters of 9-16 (RMSNorm), bfloat16 / float16; this is"
        f" {x.shape[-1]} columns, {x.dtype})"
    )


push_norm_fwd.route = _explain_push  # type: ignore[attr-defined]


def norm_bwd(
    dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias, *, weight_offset, rms, config=None, staged=None,
    ctas_per_sm=None,
) -> None:  # fmt: skip
    """triton.norm_bwd's contract. `config`: (threads, vectors per thread), `staged` (dy and h
    in shared memory, True, or registers, False; default staged) and `ctas_per_sm` (clusters
    launched per SM's worth of CTAs) forced (tests, benchmarks). Each cluster takes a run of
    rows; the (clusters, N) float32 dweight / dbias partials are summed in a fixed order by the
    Triton launcher's `_sum_parts`."""
    args = (dy, h, weight, mean, rstd, dh_out, dh, dweight, dbias)
    kwargs = dict(weight_offset=weight_offset, rms=rms)
    if (_broken and h.is_cuda) or unsupported_bwd_call(*args) is not None:
        return _triton_bwd(*args, **kwargs)
    n_rows, n_cols = h.shape
    staged = True if staged is None else staged
    if not staged and cluster_config(n_cols, h.dtype, shapes=BWD_SHAPES) is None:
        staged = True  # rows only the staged kernel's 4-vector chunks hold
    cfg = cluster_config(n_cols, h.dtype, config, BWD_STAGED_SHAPES if staged else BWD_SHAPES)
    if cfg is None:
        raise ValueError(f"config {config}: a row of {n_cols} columns needs more than {MAX_CLUSTER} CTAs")
    lib = _load(h.device)
    if lib is None:
        return _triton_bwd(*args, **kwargs)
    if ctas_per_sm is None:
        ctas_per_sm = max(1, 65536 // (_BWD_REGISTERS * cfg.threads))
    n_clusters = max(1, min(n_rows, _sm_count(_device_index(h)) * ctas_per_sm // cfg.cluster))
    rows_per_cluster = -(-n_rows // n_clusters)
    n_clusters = -(-n_rows // rows_per_cluster)
    dw_part = (
        torch.empty((n_clusters, n_cols), dtype=torch.float32, device=h.device)
        if dweight is not None
        else None
    )
    db_part = (
        torch.empty((n_clusters, n_cols), dtype=torch.float32, device=h.device) if dbias is not None else None
    )
    flags = (
        _BWD_FLAGS["rms"] * rms + _BWD_FLAGS["weight"] * (weight is not None)
        + _BWD_FLAGS["dh_out"] * (dh_out is not None) + _BWD_FLAGS["weight_grad"] * (dweight is not None)
        + _BWD_FLAGS["bias_grad"] * (dbias is not None) + _BWD_FLAGS["staged"] * staged
    )  # fmt: skip
    status = lib.ok_norm_bwd_cluster(
        _device_index(h), _CODES[h.dtype], 0 if weight is None else _CODES[weight.dtype], cfg.threads,
        cfg.vectors_per_thread, cfg.cluster, n_clusters, dy.data_ptr(), h.data_ptr(),
        0 if weight is None else weight.data_ptr(), 0 if mean is None else mean.data_ptr(), rstd.data_ptr(),
        0 if dh_out is None else dh_out.data_ptr(), dh.data_ptr(), 0 if dw_part is None else dw_part.data_ptr(),
        0 if db_part is None else db_part.data_ptr(), n_rows, n_cols, dy.stride(0), h.stride(0),
        0 if dh_out is None else dh_out.stride(0), dh.stride(0), rows_per_cluster, weight_offset, flags,
        _stream(h),
    )  # fmt: skip
    if status != 0:
        _launch_failed(status, f"backward {cfg}", h.is_cuda)
        return _triton_bwd(*args, **kwargs)
    for part, total in ((dw_part, dweight), (db_part, dbias)):
        if total is not None:
            if h.is_cuda:
                from ..triton import _sum_parts

                _sum_parts(part, total)
            else:  # the emulation: the reference's sum
                total.copy_(part.sum(0))
    return None
