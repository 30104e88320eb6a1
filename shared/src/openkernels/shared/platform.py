"""What kind of device a tensor lives on: backend (cuda / rocm / cpu) and arch."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform as _platform
from dataclasses import dataclass

import torch

__all__ = [
    "DeviceInfo",
    "device_info",
    "triton_available",
    "triton_interpreting",
    "gluon_hopper_available",
    "graph_capturing",
    "cpu_isa",
]


@dataclass(frozen=True)
class DeviceInfo:
    """Backend and architecture of one device.

    backend: "cuda", "rocm" or "cpu".
    arch: "sm_90", "gfx942", ... for GPUs; the widest SIMD ISA ("avx512", "avx2", "neon",
    "generic") for CPUs.
    """

    backend: str
    arch: str
    name: str


@functools.cache
def triton_interpreting() -> bool:
    """True when Triton kernels run on the CPU through TRITON_INTERPRET=1.

    Read once per process, as Triton itself decides it when kernels are decorated."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def graph_capturing(device: torch.device) -> bool:
    """True while a CUDA-graph capture is under way on `device`'s current stream (a CUDA
    device): host reads of device values and allocations meant to outlive the call are not
    allowed then, so launchers skip such checks and caches, as while compiling."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def triton_available() -> bool:
    """True when the triton package can be imported (it is never imported here)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def gluon_hopper_available() -> bool:
    """True when this Triton has Gluon's Hopper language (`warpgroup_mma`, TMA, mbarriers):
    what the Gluon sm_90 kernels of the families need. Imports triton's Gluon modules on the
    first call only (callers ask from dispatch predicates, never at import)."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cpu_isa() -> str:
    """Widest SIMD instruction set this CPU has, read from /proc/cpuinfo where present."""
    machine = _platform.machine().lower()
    if machine in ("arm64", "aarch64"):
        return "neon"
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    if " avx512f" in flags:
        return "avx512"
    if " avx2" in flags:
        return "avx2"
    return "generic"


@functools.cache
def _gpu_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        # gcnArchName reads like "gfx942:sramecc+:xnack-"; the features do not pick kernels.
        return DeviceInfo("rocm", props.gcnArchName.split(":")[0], props.name)
    return DeviceInfo("cuda", f"sm_{props.major}{props.minor}", props.name)


def device_info(device: torch.device | str) -> DeviceInfo:
    """Backend and arch of `device` (cached per device)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _gpu_info(index)
    if device.type == "cpu":
        return _CPU_INFO()
    return DeviceInfo(device.type, "unknown", device.type)


@functools.cache
def _CPU_INFO() -> DeviceInfo:  # noqa: N802 - a cached constant
    return DeviceInfo("cpu", cpu_isa(), _platform.processor() or _platform.machine())
