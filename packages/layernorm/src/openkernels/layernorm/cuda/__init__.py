"""CUDA C++ backend of the layernorm forward on Hopper: one row per thread-block cluster, the
row's partial statistics exchanged through distributed shared memory (norm_cluster.cu).

Dispatch name "cluster", registered for the forward on sm_90 below the Triton kernels'
priority: it runs only when forced (`dispatch.force("cluster")`) until its H200 measurements
say where it wins. Same entry point as triton.norm_fwd; a call it does not take (dtypes other
than one 16-bit or float32 row dtype with a weight of that dtype or float32, rows not a whole
number of 16-byte vectors, misaligned rows or parameters, rows longer than 16 CTAs hold) goes
to the Triton launcher, which takes every call. The library is built with nvcc on first use
(openkernels.shared.cuda_build); if that fails the Triton kernels run, with one warning.
"""

from __future__ import annotations

import ctypes
import pathlib
import warnings
from typing import NamedTuple

import torch

from openkernels.shared import cuda_build, replay
from openkernels.shared.dispatch import DispatchKey

__all__ = ["ClusterConfig", "SHAPES", "cluster_config", "norm_fwd", "supports", "unsupported_call"]

_SOURCE = pathlib.Path(__file__).with_name("norm_cluster.cu")
ARCH = "sm_90a"  # clusters and distributed shared memory: Hopper's; machine code for sm_90 only
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "ok_norm_fwd_cluster": [_I32, _I32, _I32, _I32, _I32, _I32, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64,
                            _I64, _I64, _I64, _F64, _F64, _I32, _P],
}  # fmt: skip
_library = cuda_build.CudaLibrary(
    _SOURCE, name="openkernels_layernorm_cuda", arch=ARCH, signatures=_SIGNATURES
)

# (threads per CTA, 16-byte vectors per thread): the shapes norm_cluster.cu is built for, from
# the narrowest chunk (bf16: 8192 columns per CTA) to the widest (65536).
SHAPES: tuple[tuple[int, int], ...] = ((256, 4), (256, 8), (512, 8), (512, 16))
PORTABLE_CLUSTER = 8  # any sm_90 part schedules 8 CTAs per cluster
MAX_CLUSTER = 16  # the non-portable limit (the launcher opts in per kernel)
_FLAGS = {"rms": 1, "residual": 2, "store_residual": 4, "weight": 8, "bias": 16}


class ClusterConfig(NamedTuple):
    threads: int
    vectors_per_thread: int
    cluster: int


def _vector(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def cluster_config(
    n_cols: int, dtype: torch.dtype, shape: tuple[int, int] | None = None
) -> ClusterConfig | None:
    """The narrowest chunk whose cluster stays portable (<= 8 CTAs), else the narrowest within
    16; None when a row is longer than 16 of the widest chunks. `shape` forces (threads,
    vectors per thread) (tests); None then if the row needs more than 16 such chunks."""
    vec = _vector(dtype)
    candidates = [shape] if shape is not None else list(SHAPES)
    for limit in (PORTABLE_CLUSTER, MAX_CLUSTER):
        for threads, vpt in candidates:
            cluster = -(-n_cols // (threads * vpt * vec))
            if cluster <= limit:
                return ClusterConfig(threads, vpt, cluster)
    return None


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


_broken: list[str] = []  # why the library cannot run (built once per process; warned once)


def _triton_fwd(*args, **kwargs) -> None:
    from ..triton import norm_fwd as triton_norm_fwd

    kwargs.pop("config", None)
    triton_norm_fwd(*args, **kwargs)


def norm_fwd(
    x, residual, weight, bias, out, residual_out, mean, rstd, *, eps, weight_offset, rms, h_dtype, config=None
) -> None:
    """triton.norm_fwd's contract. `config`: (threads, vectors per thread) forced (tests)."""
    args = (x, residual, weight, bias, out, residual_out, mean, rstd)
    kwargs = dict(eps=eps, weight_offset=weight_offset, rms=rms, h_dtype=h_dtype)
    if _broken or unsupported_call(*args, h_dtype) is not None:
        return _triton_fwd(*args, **kwargs)
    cfg = cluster_config(x.shape[1], x.dtype, config)
    if cfg is None:
        raise ValueError(f"config {config}: a row of {x.shape[1]} columns needs more than {MAX_CLUSTER} CTAs")
    try:
        lib = _library()
    except cuda_build.CudaBuildError as error:
        _broken.append(str(error))
        warnings.warn(
            f"openkernels.layernorm: the cluster kernels are off: {error}", RuntimeWarning, stacklevel=2
        )
        return _triton_fwd(*args, **kwargs)
    replay.launches_unseen("the cluster norm kernel")
    flags = (
        _FLAGS["rms"] * rms + _FLAGS["residual"] * (residual is not None)
        + _FLAGS["store_residual"] * (residual_out is not None) + _FLAGS["weight"] * (weight is not None)
        + _FLAGS["bias"] * (bias is not None)
    )  # fmt: skip
    params = weight if weight is not None else bias
    status = lib.ok_norm_fwd_cluster(
        x.device.index, _CODES[x.dtype], 0 if params is None else _CODES[params.dtype], cfg.threads,
        cfg.vectors_per_thread, cfg.cluster, x.shape[0], x.data_ptr(),
        0 if residual is None else residual.data_ptr(), 0 if weight is None else weight.data_ptr(),
        0 if bias is None else bias.data_ptr(), out.data_ptr(),
        0 if residual_out is None else residual_out.data_ptr(), 0 if mean is None else mean.data_ptr(),
        rstd.data_ptr(), x.shape[1], x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        0 if residual_out is None else residual_out.stride(0), eps, weight_offset, flags,
        torch.cuda.current_stream(x.device).cuda_stream,
    )  # fmt: skip
    if status != 0:
        # A launch the GPU refused (say, a cluster it cannot schedule): nothing ran.
        _broken.append(f"launch status {status}")
        warnings.warn(
            f"openkernels.layernorm: the cluster kernel's launch failed (status {status}, config {cfg}); "
            "the Triton kernels run from now on",
            RuntimeWarning,
            stacklevel=2,
        )
        return _triton_fwd(*args, **kwargs)
    return None
